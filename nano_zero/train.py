"""Train shared.model with ZeRO: `torchrun --nproc-per-node N -m nano_zero.train zero.stage=3 model=tiny`.

A Hydra app (configs in nano_zero/configs): `zero.*` picks the stage, `model=` a model file (any ModelConfig
field is overridable, `model.num_hidden_layers=2`), `train.*` the loop (shared.train.TrainConfig);
`performance_layers=false` runs shared.model's kernels on their paper paths (nano_zero itself has no
performance layer). Without torchrun it runs as one process. The run directory gets Hydra's config, `metrics.jsonl` and `checkpoint/`
(HF format, plus `resume/` with one ZeRO shard per rank: `train.resume_from=<run>/checkpoint`).
"""

from __future__ import annotations

import hydra
import torch
from omegaconf import DictConfig

from nano_zero.engine import ZeroEngine
from shared.dist import destroy_distributed, init_distributed, log0
from shared.hydra_utils import hydra_run_dir, model_config_from, peak_flops_from, to_dataclass
from shared.train import TrainConfig, train


def run(cfg: DictConfig) -> list[dict]:
    """Everything `main` does, callable without Hydra's decorator (tests, notebooks)."""
    env = init_distributed(cfg.get("backend"))
    try:
        out_dir = hydra_run_dir()
        tcfg = to_dataclass(TrainConfig, cfg.train, out_dir=out_dir)
        mcfg = model_config_from(cfg.model)
        engine = ZeroEngine(mcfg, tcfg, int(cfg.zero.stage), device=env.device,
                            prefetch=bool(cfg.zero.prefetch),
                            performance_layers=cfg.get("performance_layers", True))
        log0(f"nano_zero: stage {engine.stage}, {env.world_size} rank(s), {env.backend}, out_dir {out_dir}")
        log0(engine.memory_report().format(env.rank))
        peak_flops = peak_flops_from(cfg, env.device)
        records = train(engine, tcfg, is_main=env.rank == 0, peak_flops=peak_flops)
        elements, nbytes = engine.last_step_comm
        psi = sum(u.numel for u in engine.model.units)
        log0(f"communication in the last step: {elements:,} elements = {elements / psi:.3f} Ψ "
               f"({nbytes / 2**20:,.1f} MiB per rank; §7: 2Ψ stages 0-2, 3Ψ per micro-step stage 3)")
        log0(engine.memory_report().format(env.rank))
        return records
    finally:
        destroy_distributed()


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    torch.manual_seed(int(cfg.train.seed))
    run(cfg)


if __name__ == "__main__":
    main()
