"""`python -m nano_vllm.bench`: the Hydra app of nano_vllm.bench.throughput (configs/bench.yaml)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from nano_vllm.bench.throughput import run


@hydra.main(version_base=None, config_path="../configs", config_name="bench")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
