"""`torchrun --nproc-per-node N -m nano_megatron.bench`: our tensor / sequence / pipeline parallelism
against torch's own tensor parallelism, same model, same data, same run.

Systems (each a full training step: forward, backward, gradient reduction, clipping, AdamW on fp32
master weights of a bf16 model — LocalEngine's recipe):
  tp          MegatronEngine, tp = N
  tp_sp       MegatronEngine, tp = N with sequence parallelism
  tp[_sp][_serial][_graph][_pairs]   tp / tp_sp with options, in any combination: `_serial` does not overlap
              the backward tp collectives with the dW GEMMs (`parallel.tp_comm_overlap=false`); `_graph`
              captures the whole step once in a CUDA graph and replays it (`parallel.cuda_graph=true`);
              `_pairs` runs micro-batches two at a time on two streams (`parallel.overlap_micro_batches=true`)
  dtensor_tp  torch DTensor `parallelize_module` (ColwiseParallel / RowwiseParallel on q,k,v,o and the
              MLP, vocab-sharded embedding and LM head, `loss_parallel`), tp = N
  pp_1f1b     MegatronEngine, pp = N, 1F1B over `pp_micro_batches` micro-batches
  pp_gpipe    the same with GPipe
A 1-GPU baseline's tp rows (tp, tp_graph, ...) are the same single-GPU model; scaling efficiency is
measured against the faster of them. Reported: ms/step, tokens/s, MFU (6N + 12·L·d·S FLOPs per token,
shared.accounting, against `peak_tflops` per GPU), on GPUs the share of a step's wall time the GPU was
running kernels (one extra profiled step; well under 100% means the host's launches are the bottleneck),
peak memory, and for the pipeline rows the measured bubble: 1 − (time spent in forward/backward kernels)
/ (step time of the slowest stage), per stage, next to (p−1)/(m+p−1).
`baseline_json` (a 1-GPU run's bench.json) adds scaling efficiency. Writes bench.json to the run dir.
On CPU, `quick=true` (or `--quick`) is a smoke run with a tiny model: gloo numbers mean nothing.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig

from nano_megatron.engine import MegatronEngine, ParallelConfig
from nano_megatron.pipeline_parallel import busy_seconds
from nano_megatron.schedules import bubble_fraction_formula
from shared.accounting import flops_per_token, param_count
from shared.bench import device_activity_seconds, measure_matmul_flops, print_table, write_json
from shared.config import ModelConfig
from shared.dist import destroy_distributed, init_distributed
from shared.hydra_utils import hydra_run_dir, model_config_from, to_dataclass
from shared.model import build_model
from shared.train import StepResult, TrainConfig, clip_coefficient, decays, micro_batches_of

SYSTEMS = ("tp", "tp_sp", "tp_serial", "tp_sp_serial", "tp_graph", "tp_sp_graph", "tp_sp_graph_pairs",
           "dtensor_tp", "pp_1f1b", "pp_gpipe")  # the named rows; any tp[_sp][_serial][_graph][_pairs] is accepted
TP_OPTIONS = {"sp": "sequence_parallel", "serial": "tp_comm_overlap", "graph": "cuda_graph",
              "pairs": "overlap_micro_batches"}


def tp_parallel_config(system: str, world: int) -> dict | None:
    """ParallelConfig fields of a tp[_option...] system name (None: not such a name)."""
    base, *options = system.split("_")
    if base != "tp" or len(set(options)) != len(options) or not set(options) <= set(TP_OPTIONS):
        return None
    fields = {TP_OPTIONS[o]: o != "serial" for o in options}
    return {"tp": world, **fields}


DATASHEET_BF16_TFLOPS = 989.0  # H100 / H200 SXM dense bf16: what published MFUs are quoted against


class DTensorTP:
    """torch's tensor parallelism behind `train_step`, with our recipe (bf16 model, fp32 masters)."""

    def __init__(self, mcfg: ModelConfig, cfg: TrainConfig, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.cfg, self.device = cfg, device
        model = build_model(mcfg, device, seed=cfg.seed)
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(mcfg.num_hidden_layers):
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                         "mlp.up_proj"):
                plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        self.model = parallelize_module(model, mesh, plan)
        # A Replicate output with use_local_output is an AsyncCollectiveTensor: a wrapper around the
        # all-reduce still in flight, with no storage of its own. torch ops wait on it transparently, but a
        # Triton kernel (our RMSNorm, next) reads raw pointers: an illegal memory access on the GPU. One
        # clone per all-reduced output makes it a plain tensor (the b·s·h copy is charged to this peer).
        for name, style in plan.items():
            if isinstance(style, RowwiseParallel):
                self.model.get_submodule(name).register_forward_hook(lambda mod, args, out: out.clone())
        self.master = [p.detach().clone() for p in self.model.parameters()]
        self.model.to(cfg.torch_dtype)
        self.params = list(self.model.parameters())
        groups = [{"params": [m for m in self.master if decays(m)], "weight_decay": cfg.weight_decay},
                  {"params": [m for m in self.master if not decays(m)], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        num_tokens = sum(y.numel() for _, y in micro_batches)
        for x, y in micro_batches:
            with loss_parallel():
                logits = self.model(x.to(self.device))
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(self.device).flatten(),
                                       reduction="sum") / num_tokens
                loss.backward()
        for m, p in zip(self.master, self.params):
            m.grad, p.grad = p.grad.float(), None
        # torch.nn.utils.clip_grad_norm_ refuses a mix of DTensor and plain (norm) gradients:
        # its norm per kind, sharded ones reduced as a scalar, then clipped with the same formula.
        sharded = [m.grad for m in self.master if isinstance(m.grad, DTensor)]
        plain = [m.grad for m in self.master if not isinstance(m.grad, DTensor)]
        sq = torch.zeros((), device=self.device)
        if sharded:
            sq = sq + torch.nn.utils.get_total_norm(sharded).full_tensor().pow(2)
        if plain:
            sq = sq + torch.nn.utils.get_total_norm(plain).pow(2)
        coef = clip_coefficient(sq.sqrt(), self.cfg.grad_clip)
        for m in self.master:
            m.grad.mul_(coef)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                p.copy_(m)
        return StepResult(loss=0.0, grad_norm=float(sq.sqrt()))

    def close(self) -> None:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(mcfg: ModelConfig, cfg: TrainConfig, count: int, dp_rank: int, dp: int):
    gen = torch.Generator().manual_seed(cfg.seed)
    out = []
    for _ in range(count):
        w = torch.randint(0, mcfg.vocab_size, (cfg.global_batch_size, cfg.seq_len + 1), generator=gen)
        n = cfg.global_batch_size // dp
        w = w[dp_rank * n:(dp_rank + 1) * n]
        out.append(micro_batches_of(w[:, :-1], w[:, 1:], cfg.micro_batch_size))
    return out


def bench_system(system: str, mcfg: ModelConfig, cfg: TrainConfig, bench: DictConfig, device: torch.device,
                 peak_flops: float) -> dict:
    world = dist.get_world_size()
    if system.startswith("pp"):
        m = int(bench.pp_micro_batches)
        cfg = to_dataclass(TrainConfig, {**cfg.__dict__, "global_batch_size": m * cfg.micro_batch_size})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if system == "dtensor_tp":
        engine = DTensorTP(mcfg, cfg, device)
    else:
        p = tp_parallel_config(system, world) or {"pp_1f1b": dict(pp=world),
                                                  "pp_gpipe": dict(pp=world, schedule="gpipe")}[system]
        engine = MegatronEngine(mcfg, ParallelConfig(**p), cfg, device=device)
    warmup = int(bench.warmup)
    if "_graph" in system:  # a graphed engine warms up and captures in its first calls: untimed
        warmup = max(warmup, MegatronEngine.GRAPH_WARMUP_STEPS + 1)
    # on the device before the clock starts: a pageable host-to-device copy would stall the host mid-step
    batches = [[(x.to(device), y.to(device)) for x, y in mb]
               for mb in _batches(mcfg, cfg, warmup + int(bench.steps), 0, 1)]
    times, bubbles = [], []
    for i, mb in enumerate(batches):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        engine.train_step(mb, cfg.lr)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if system.startswith("pp"):
        # The bubble of the schedule alone (forward_backward, no optimizer step): this stage's time in
        # forward/backward kernels over the span of the slowest stage, all stages started together.
        for mb in batches[-int(bench.steps):]:
            engine.pipeline_timeline = []
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            engine.forward_backward(mb)
            _sync(device)
            span = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(span, op=dist.ReduceOp.MAX)
            bubbles.append(1.0 - busy_seconds(engine.pipeline_timeline) / span.item())
        engine.pipeline_timeline = None
    seconds = statistics.median(times)
    busy = None
    if device.type == "cuda":  # one more step under the profiler: is the GPU fed, or waiting on the host?
        dist.barrier()
        rank0 = dist.get_rank() == 0  # only rank 0 prints the optional kernel and idle-op listings
        try:
            busy = device_activity_seconds(lambda e=engine: e.train_step(batches[-1], cfg.lr), device,
                                          top_kernels=int(bench.get("top_kernels", 0)) if rank0 else 0,
                                          idle_ops=int(bench.get("idle_ops", 0)) if rank0 else 0)
        except Exception as e:  # a diagnostic must not cost the measurement
            print(f"GPU busy time not measured: {type(e).__name__}: {e}", flush=True)
    tokens = cfg.global_batch_size * cfg.seq_len
    row = {"system": system, "GPUs": world, "ms/step": seconds * 1e3, "tokens/s": tokens / seconds,
           "MFU %": 100 * flops_per_token(mcfg, cfg.seq_len) * tokens / seconds / (peak_flops * world)}
    if device.type == "cuda":  # every rank joins the reduction; -1 marks a rank that could not measure
        # per rank: busy, NCCL kernels, all other kernels, as fractions of the step; -1: not measured
        keys = ("busy", "nccl", "other")
        t = torch.tensor([-1.0] * 3 if busy is None else [busy[k] / seconds for k in keys], dtype=torch.float64,
                         device=device)
        low, high = t.clone(), t.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if low[0].item() >= 0:
            row["GPU busy % (min rank)"] = 100 * low[0].item()
            row["NCCL kernel % (max rank)"] = 100 * high[1].item()  # far above bytes / bandwidth: ranks wait
            row["non-NCCL kernel % (min rank)"] = 100 * low[2].item()
    if device.type == "cuda":
        peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        row["peak GiB/GPU"] = peak.item()
    if bubbles:
        bubble = torch.tensor(statistics.median(bubbles), dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(bubble) for _ in range(world)]
        dist.all_gather(gathered, bubble)
        row["bubble % (stages)"] = " / ".join(f"{100 * b.item():.1f}" for b in gathered)
        row["bubble % (p-1)/(m+p-1)"] = 100 * bubble_fraction_formula(world, int(bench.pp_micro_batches))
    if hasattr(engine, "close"):
        engine.close()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run(cfg: DictConfig) -> dict:
    owns_group = not dist.is_initialized()  # a caller's (test's) process group is left alone
    env = init_distributed(cfg.get("backend"))
    try:
        out_dir = [hydra_run_dir()]
        dist.broadcast_object_list(out_dir, src=0)
        quick = bool(cfg.quick)
        train_node = dict(cfg.train)
        mcfg = model_config_from(cfg.model)
        if quick:  # a tiny model in fp32 on CPU: exercises every code path in seconds
            mcfg = model_config_from({"preset": "tiny", "num_hidden_layers": 2 * env.world_size,
                                      "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "tie_word_embeddings": False, "qk_norm": False})
            train_node.update(seq_len=32, global_batch_size=4, micro_batch_size=1,
                              dtype="fp32" if env.device.type == "cpu" else train_node["dtype"])
        tcfg = to_dataclass(TrainConfig, train_node, out_dir=out_dir[0])
        bench = cfg.copy()
        if quick:
            bench.warmup, bench.steps, bench.pp_micro_batches = 1, 2, 4
        systems = list(cfg.systems)
        unknown = sorted(s for s in set(systems) - set(SYSTEMS) if tp_parallel_config(s, 1) is None)
        if unknown:
            raise ValueError(f"unknown systems {unknown}; choose from {list(SYSTEMS)} or any "
                             "tp[_sp][_serial][_graph][_pairs]")
        if env.world_size == 1:
            systems = [s for s in systems if not s.startswith("pp")]  # one stage: nothing to measure
        cuda = env.device.type == "cuda"
        matmul = measure_matmul_flops(env.device)
        peak = (cfg.peak_tflops * 1e12 if cfg.peak_tflops else (DATASHEET_BF16_TFLOPS * 1e12 if cuda else matmul))
        rows = []
        for s in systems:  # each row as soon as it is measured: a later failure keeps the earlier ones
            rows.append(bench_system(s, mcfg, tcfg, bench, env.device, peak))
            if env.rank == 0:
                print(f"measured {rows[-1]}", flush=True)
        if cfg.baseline_json:
            base = json.loads(Path(cfg.baseline_json).read_text())
            ref = {r["system"]: r["tokens/s"] for r in base["rows"]}
            # the strongest single-GPU run of the same model (eager or graphed)
            ref_tp = max((v for s, v in ref.items() if tp_parallel_config(s, 1) is not None), default=None)
            for r in rows:
                if ref_tp:
                    r["scaling eff %"] = 100 * r["tokens/s"] / (env.world_size * ref_tp)
        record = {"bench": "nano_megatron", "model": {"params": param_count(mcfg), **mcfg.to_hf()},
                  "world_size": env.world_size, "backend": env.backend, "quick": quick,
                  "seq_len": tcfg.seq_len, "global_batch_size": tcfg.global_batch_size,
                  "dtype": tcfg.dtype, "matmul_TFLOPs_measured": matmul / 1e12,
                  "peak_TFLOPs_for_MFU": peak / 1e12, "torch": torch.__version__,
                  "device": torch.cuda.get_device_name(env.device) if cuda else "cpu", "rows": rows}
        if env.rank == 0:
            path = Path(out_dir[0]) / "bench.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, record)
            print(f"measured matmul ceiling {matmul / 1e12:.3g} TFLOP/s per device; MFU against "
                  f"{peak / 1e12:.3g} TFLOP/s", flush=True)
            print_table(rows, title=f"nano_megatron bench: {param_count(mcfg) / 1e6:,.1f}M params, "
                        f"{env.world_size} x {record['device']}, seq {tcfg.seq_len}, batch "
                        f"{tcfg.global_batch_size}, {tcfg.dtype}")
            print(f"wrote {path}", flush=True)
        return record
    finally:
        if owns_group:
            destroy_distributed()


@hydra.main(version_base=None, config_path="configs", config_name="bench")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    if "--quick" in sys.argv:  # the flag other benches take, as a Hydra override
        sys.argv[sys.argv.index("--quick")] = "quick=true"
    main()
