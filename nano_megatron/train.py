"""Train shared.model with tensor, sequence, pipeline and data parallelism:

    python -m nano_megatron.train model=tiny train.steps=100                   # one process
    torchrun --nproc-per-node 4 -m nano_megatron.train parallel.tp=2 parallel.pp=2 model=tiny

A Hydra app (configs in nano_megatron/configs): `parallel.*` is the grid (dp defaults to
world / (tp·pp)) and the performance-layer switches (nano_megatron/build.py; `performance_layers=false`
runs the paper path alone), `model=` a model file (any ModelConfig field overridable:
model.num_hidden_layers=2), `train.*` the loop (shared.train.TrainConfig, which owns data, LR schedule,
logging and checkpoints).
gloo on CPU, NCCL on GPU. The run directory gets Hydra's config, `metrics.jsonl` and `checkpoint/`
(HF format, loadable by transformers and nano_vllm, plus `resume/` with one shard per (pp, tp):
resume with `train.resume_from=<run>/checkpoint` and the same tp and pp).
"""

from __future__ import annotations

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from nano_megatron.build import REGISTRY, LayerConfig, build_engine, layer_names, split_layer_switches
from nano_megatron.engine import ParallelConfig
from nano_megatron.schedules import bubble_fraction_formula
from shared.accounting import param_count
from shared.dist import destroy_distributed, init_distributed, log0
from shared.hydra_utils import hydra_run_dir, model_config_from, peak_flops_from, to_dataclass
from shared.train import TrainConfig, train


def parallel_config_from(node: DictConfig | dict, world_size: int, performance_layers: bool = True
                         ) -> tuple[ParallelConfig, LayerConfig]:
    """`parallel.*` with dp = world / (tp·pp) when not given (validated later, on every rank), and the
    performance-layer switches of the same group."""
    values, switches = split_layer_switches(dict(node))
    tp, pp = int(values.get("tp", 1)), int(values.get("pp", 1))
    if values.get("dp") is None:
        values["dp"] = max(1, world_size // (tp * pp))
    if performance_layers is not True:  # the top-level switch; `parallel.performance_layers` works too
        switches["performance_layers"] = performance_layers
    layers = to_dataclass(LayerConfig, switches)
    return to_dataclass(ParallelConfig, values), layers


def run(cfg: DictConfig) -> list[dict]:
    """Everything `main` does, callable without Hydra's decorator (tests, notebooks)."""
    owns_group = not dist.is_initialized()  # a caller's (test's) process group is left alone
    env = init_distributed(cfg.get("backend"))
    engine = None
    try:
        out_dir = hydra_run_dir()
        tcfg = to_dataclass(TrainConfig, cfg.train, out_dir=out_dir)
        mcfg = model_config_from(cfg.model)
        pcfg, layers = parallel_config_from(cfg.parallel, env.world_size,
                                            cfg.get("performance_layers", True))
        engine = build_engine(mcfg, pcfg, tcfg, device=env.device, layers=layers)
        m = tcfg.global_batch_size // (tcfg.micro_batch_size * pcfg.dp)
        bubble = bubble_fraction_formula(pcfg.pp, m)
        names = ", ".join(layer_names(engine)) or ("none" if layers.performance_layers else "off")
        missing = f" (missing: {', '.join(REGISTRY.missing)})" if REGISTRY.missing else ""
        log0(f"nano_megatron: tp={pcfg.tp} pp={pcfg.pp} dp={pcfg.dp} ({env.world_size} rank(s), "
             f"{env.backend}), sequence_parallel={pcfg.sequence_parallel}, {pcfg.schedule} over {m} "
             f"micro-batch(es)" + (f" (bubble (p-1)/(m+p-1) = {bubble:.1%})" if pcfg.pp > 1 else "")
             + f"; {param_count(mcfg) / 1e6:.1f}M parameters; performance layers "
             + names + missing + f"; out_dir {out_dir}")
        peak_flops = peak_flops_from(cfg, env.device)
        return train(engine, tcfg, is_main=env.rank == 0, peak_flops=peak_flops)
    finally:
        if engine is not None:
            engine.close()
        if owns_group:
            destroy_distributed()


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    torch.manual_seed(int(cfg.train.seed))
    run(cfg)


if __name__ == "__main__":
    main()
