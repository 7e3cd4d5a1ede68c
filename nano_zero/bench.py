"""`torchrun --nproc-per-node N -m nano_zero.bench`: every ZeRO stage against torch's own, same model, same run.

Systems (all train shared.model with AdamW, global-norm clipping and the same data):
  ddp             torch DistributedDataParallel; bf16 model + fp32 master copies (the stage-0 recipe)
  zero_optimizer  DDP + torch ZeroRedundancyOptimizer over the fp32 masters (ZeRO-1 à la torch)
  fsdp2           torch `fully_shard` per block + root, MixedPrecisionPolicy(bf16, bf16) (ZeRO-3 à la torch)
  fsdp2_fused     the same with AdamW(fused=True): one kernel for every tensor of the step
  zero0..zero3    nano_zero.ZeroEngine

Reported per system: tokens/s (global) and per GPU, MFU per GPU against the datasheet peak (989 TFLOP/s
dense bf16 on H100/H200 SXM; `peak_tflops=` overrides it) and against the bf16 matmul rate measured in the
same process, both labelled; peak memory per GPU (CUDA: the allocator's peak while the system is built and
trained, minus what was allocated before it was built), model-state memory by §3.1's formula, and for ours
the measured ledger. `baseline_json=<a 1-GPU run's bench.json>` adds the scaling efficiency
tok/s(N) / (N · tok/s(1)). Writes `bench.json` in the Hydra run directory. On CPU, `quick=true` is a smoke
run (tiny model, fp32, a few steps): numbers from gloo mean nothing (docs/ARCHITECTURE.md: gloo emulates
reduce-scatter with an all-reduce). `performance_layers=false` runs every system with shared.model's
kernels on their paper paths.

    torchrun --nproc-per-node 2 -m nano_zero.bench model=1b
    python -m nano_zero.bench quick=true
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from nano_flashattn.registry import performance_layers
from nano_zero.engine import ZeroEngine
from nano_zero.ledger import formula_for
from shared.accounting import flops_per_token, param_count
from shared.bench import (
    datasheet_bf16_flops,
    format_rate,
    measure_matmul_flops,
    print_table,
    release_memory,
    report_oversubscription,
    write_json,
)
from shared.data import TokenBatches
from shared.dist import destroy_distributed, init_distributed
from shared.hydra_utils import hydra_run_dir, model_config_from, to_dataclass
from shared.model import build_model
from shared.train import MixedPrecisionAdamW, StepResult, TrainConfig, micro_batches_of, next_token_loss

SYSTEMS = ("ddp", "zero_optimizer", "fsdp2", "fsdp2_fused", "zero0", "zero1", "zero2", "zero3")


class TorchPeer:
    """torch's DDP / ZeroRedundancyOptimizer / FSDP2 behind `train_step`, with the recipe ours uses."""

    def __init__(self, kind: str, model_config, cfg: TrainConfig, device: torch.device) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.cfg, self.kind, self.device = cfg, kind, device
        self.world = dist.get_world_size()
        self.fsdp = kind.startswith("fsdp2")
        dtype = cfg.torch_dtype
        model = build_model(model_config, device, seed=cfg.seed)  # fp32
        options: dict = {}
        if self.fsdp:  # FSDP2's sharded parameters stay fp32 (the masters); its policy computes in bf16
            mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            self.opt = MixedPrecisionAdamW(list(model.parameters()), dataclasses.replace(cfg, dtype="fp32"),
                                           **({"fused": True} if kind == "fsdp2_fused" else {}))
        else:  # bf16 model for compute, fp32 master copies for the optimizer (as LocalEngine)
            if kind == "zero_optimizer":
                options["optimizer_class"] = functools.partial(ZeroRedundancyOptimizer,
                                                               optimizer_class=torch.optim.AdamW)
            self.opt = MixedPrecisionAdamW(list(model.parameters()), cfg, **options)
            model.to(dtype)
            model = DDP(model)
        self.model = model

    def train_step(self, micro_batches, lr: float) -> StepResult:
        num_tokens = sum(y.numel() for _, y in micro_batches)  # DDP / FSDP average over ranks
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            sync = i == len(micro_batches) - 1
            ctx = self.model.no_sync() if (not sync and not self.fsdp) else nullcontext()
            if self.fsdp:
                self.model.set_requires_gradient_sync(sync)
            with ctx:
                loss = next_token_loss(self.model(x.to(self.device)), y.to(self.device), num_tokens)
                loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.get_total_norm(self.opt.master_grads())
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.opt.step(norm, self.cfg.grad_clip, lr)
        dist.all_reduce(total)
        return StepResult(loss=float(total) / self.world, grad_norm=float(norm))


def _formula_bytes(name: str, psi: int, world: int, dtype: torch.dtype) -> float:
    if name.startswith("zero") and name != "zero_optimizer":
        return formula_for(psi, int(name[-1]), world, dtype).total
    size = torch.empty(0, dtype=dtype).element_size()
    master = 0 if dtype == torch.float32 else 4
    if name == "ddp":
        return (2 * size + master + 8) * psi
    if name == "zero_optimizer":  # torch shards only the moments; masters stay replicated
        return (2 * size + master) * psi + 8 * psi / world
    return (4 + 4 + 8) * psi / world  # fsdp2(_fused): fp32 sharded params, grads and moments


def _live_engines() -> str:
    """Which engines of earlier systems are still alive, and what refers to them (a leak's diagnosis)."""
    from nano_zero.flat import FlatUnit
    from nano_zero.zero import ZeroDataParallel

    live = [o for o in gc.get_objects() if type(o) in (ZeroDataParallel, TorchPeer, FlatUnit)]
    return f"{len(live)} engine(s) or unit(s) alive" + "".join(
        f"; {type(o).__name__} referred to by {sorted({type(r).__name__ for r in gc.get_referrers(o)})}" for o in live[:3])


def bench_one(name: str, model_config, cfg: TrainConfig, device: torch.device, warmup: int, steps: int,
              peaks: dict[str, float] | None = None) -> dict:
    """One system's row: mean step time over `steps` after `warmup`, MFU per GPU against each of `peaks`
    ({label: FLOP/s}), memory against §3.1's formula, and for ours the measured ledger and traffic."""
    rank, world = dist.get_rank(), dist.get_world_size()
    before = 0
    release_memory()  # the previous system's engine, if a reference cycle kept it past its `del`
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)  # what earlier systems left behind (should be ~0)
        if before > 2**28 and rank == 0:
            print(f"warning: {before / 2**30:.2f} GiB still allocated before {name} is built: {_live_engines()}",
                  flush=True)
    ours = name.startswith("zero") and name != "zero_optimizer"
    engine = ZeroEngine(model_config, cfg, int(name[-1]), device=device) if ours else TorchPeer(name, model_config, cfg,
                                                                                              device)
    data = TokenBatches.from_corpus("train", batch_size=cfg.global_batch_size // world, seq_len=cfg.seq_len,
                                    seed=cfg.seed, rank=rank, world_size=world)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            dist.barrier()
            t0 = time.perf_counter()
        x, y = data.next_batch()
        result = engine.train_step(micro_batches_of(x, y, cfg.micro_batch_size), cfg.lr)
    sync()
    seconds = (time.perf_counter() - t0) / steps
    tokens = cfg.global_batch_size * cfg.seq_len
    peak = None
    if device.type == "cuda":
        # this system's own peak: the allocator's peak minus what was allocated before it was built
        t = torch.tensor(float(torch.cuda.max_memory_allocated(device) - before), device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peak = t.item() / 2**30
    psi = param_count(model_config)
    row = {"system": name, "tokens/s": tokens / seconds, "tokens/s/GPU": tokens / seconds / world,
           "ms/step": seconds * 1e3}
    for label, flops in (peaks or {}).items():
        row[f"MFU % ({label})"] = 100 * flops_per_token(model_config, cfg.seq_len) * tokens / seconds / (flops * world)
    if "datasheet" in (peaks or {}):  # the attention FLOPs a causal kernel does: half of PaLM's count
        row["MFU % (datasheet, causal attention halved)"] = 100 * flops_per_token(
            model_config, cfg.seq_len, causal_halved=True) * tokens / seconds / (peaks["datasheet"] * world)
    row |= {"peak GiB/GPU": peak,
            "model states GiB (formula)": _formula_bytes(name, psi, world, cfg.torch_dtype) / 2**30,
            "loss": result.loss}
    if peak is not None:  # activations, workspace and transient buffers: equal across stages if only the
        # model states differ (the memory target: peak within 10% of formula + activations)
        row["peak − model states GiB"] = peak - row["model states GiB (formula)"]
    if isinstance(engine, ZeroEngine):
        row["model states GiB (ours, measured)"] = engine.memory_report().total / 2**30
        row["comm Ψ/step"] = engine.last_step_comm[0] / psi
    del engine
    return row


def run(cfg: DictConfig) -> dict:
    if cfg.get("avoid_record_streams"):
        # An experiment on stage 3's peak memory (BENCHMARKS.md): NCCL's recordStream keeps every freed
        # gathered/gradient buffer reserved until the NCCL stream passes it; with this, torch holds the
        # tensors until the work completes instead. Read when the process group is created, so set first.
        os.environ["TORCH_NCCL_AVOID_RECORD_STREAMS"] = "1"
    env = init_distributed(cfg.get("backend"))
    try:
        report_oversubscription(env.device)  # on a CPU: torch's threads against the free cores
        quick = bool(cfg.quick)
        mcfg = model_config_from("tiny" if quick and env.device.type != "cuda" else cfg.model)
        if quick and env.device.type != "cuda":
            mcfg = mcfg.replace(num_hidden_layers=1)
        tcfg = to_dataclass(TrainConfig, cfg.train, **({"dtype": "fp32", "seq_len": 32, "global_batch_size":
                                                          2 * env.world_size, "micro_batch_size": 1}
                                                         if quick and env.device.type != "cuda" else {}))
        warmup, steps = (1, 2) if quick else (int(cfg.warmup), int(cfg.steps))
        matmul = measure_matmul_flops(env.device)
        datasheet = cfg.peak_tflops * 1e12 if cfg.get("peak_tflops") else datasheet_bf16_flops(env.device)
        peaks = ({"datasheet": datasheet} if datasheet else {}) | {"measured matmul": matmul}
        with performance_layers(bool(cfg.performance_layers)):  # the peers' kernels too
            rows = [bench_one(name, mcfg, tcfg, env.device, warmup, steps, peaks) for name in cfg.systems]
        if cfg.get("baseline_json"):
            base = {r["system"]: r["tokens/s"] for r in json.loads(Path(cfg.baseline_json).read_text())["rows"]}
            for r in rows:
                if r["system"] in base:
                    r["scaling efficiency"] = r["tokens/s"] / (env.world_size * base[r["system"]])
        for peer in ("fsdp2", "fsdp2_fused"):  # torch's ZeRO-3, as shipped and with the fused AdamW
            ref = next((r["tokens/s"] for r in rows if r["system"] == peer), None)
            for r in rows:
                r[f"vs {peer}"] = r["tokens/s"] / ref if ref else None
        record = {"bench": "nano_zero", "world_size": env.world_size, "model": param_count(mcfg),
                  "performance_layers": bool(cfg.performance_layers),
                  "dtype": tcfg.dtype, "global_batch": tcfg.global_batch_size, "seq_len": tcfg.seq_len,
                  "micro_batch": tcfg.micro_batch_size, "quick": quick, "matmul_TFLOPs_measured": matmul / 1e12,
                  "peak_TFLOPs_datasheet": datasheet / 1e12 if datasheet else None, "rows": rows}
        path = Path(hydra_run_dir()) / "bench.json"  # a collective (rank 0 decides): every rank calls it
        if env.rank == 0:
            write_json(path, record)
            print_table(rows, title=f"nano_zero bench: {param_count(mcfg) / 1e6:,.1f}M params, {env.world_size} "
                                    f"rank(s) ({env.backend}), {tcfg.dtype}, {tcfg.global_batch_size} x "
                                    f"{tcfg.seq_len} tokens/step; MFU per GPU against "
                                    + " and ".join(f"{k} {format_rate(v, 'FLOP/s')}" for k, v in peaks.items()))
            print(f"wrote {path}")
        return record
    finally:
        destroy_distributed()


@hydra.main(version_base=None, config_path="configs", config_name="bench")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
