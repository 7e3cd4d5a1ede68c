"""`python -m nano_sglang.bench`: the Hydra app of nano_sglang.bench.programs (configs/bench.yaml)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from nano_sglang.bench.programs import run


@hydra.main(version_base=None, config_path="../configs", config_name="bench")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
