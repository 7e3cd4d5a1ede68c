"""`python -m nano_specdec.bench`: the Hydra app of nano_specdec.bench.speedup (configs/bench.yaml)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from nano_specdec.bench.speedup import run


@hydra.main(version_base=None, config_path="../configs", config_name="bench")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
