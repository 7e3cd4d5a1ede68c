"""`torchrun --nproc-per-node N -m nano_megatron.bench`: our tensor / sequence / pipeline parallelism
against torch's own tensor parallelism, same model, same data, same run.

Systems (each a full training step: forward, backward, gradient reduction, clipping, AdamW on fp32
master weights of a bf16 model — LocalEngine's recipe):
  tp          MegatronEngine, tp = N, with the backward overlap layer where it applies (tp > 1, GPUs:
              `parallel.tp_comm_overlap` left to its default) and no other layer
  tp_sp       the same with sequence parallelism
  tp[_sp][_serial][_graph][_pairs]   tp / tp_sp with options, in any combination: `_serial` leaves the
              backward overlap out (the paper path's f and g alone); `_graph` captures the whole step once
              in a CUDA graph and replays it (`parallel.cuda_graph=true`); `_pairs` runs micro-batches two
              at a time on two streams (`parallel.overlap_micro_batches=true`)
  dtensor_tp, dtensor_tp_sp, dtensor_tp_sp_compile   torch DTensor `parallelize_module`, tp = N: plain,
              with SequenceParallel, and that under torch.compile (nano_megatron/tools/bench_peers.py)
  pp_1f1b     MegatronEngine, pp = N, 1F1B over `pp_micro_batches` micro-batches
  pp_gpipe    the same with GPipe
A 1-GPU baseline's tp rows (tp, tp_graph, ...) are the same single-GPU model; scaling efficiency is
measured against the faster of them. Reported: ms/step, tokens/s, MFU (6N + 12·L·d·S FLOPs per token,
shared.accounting) against two peaks per GPU, both labelled: the datasheet's dense bf16 (989 TFLOP/s on
H100/H200 SXM, what published MFUs quote; `peak_tflops=` overrides it) and the bf16 matmul rate measured
in the same process; on GPUs the share of a step's wall time the GPU was running kernels (one extra
profiled step; well under 100% means the host's launches are the bottleneck), peak memory, and for the
pipeline rows the measured bubble: 1 − (time spent in forward/backward kernels) / (step time of the
slowest stage), per stage, next to (p−1)/(m+p−1).
`baseline_json` (a 1-GPU run's bench.json) adds scaling efficiency. Writes bench.json to the run dir,
each row naming the performance layers it ran. `performance_layers=false` runs every row on the paper
path (the `_graph` and `_pairs` rows then raise: they ask for a layer).
On CPU, `quick=true` (or `--quick`) is a smoke run with a tiny model: gloo numbers mean nothing.

    torchrun --nproc-per-node 1 -m nano_megatron.bench systems=[tp,tp_graph_pairs] train.micro_batch_size=8
    torchrun --nproc-per-node 2 -m nano_megatron.bench systems=[tp_sp,dtensor_tp_sp] train.micro_batch_size=8
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
from omegaconf import DictConfig

from nano_flashattn.registry import performance_layers
from nano_megatron.build import LayerConfig, build_engine, layer_names, split_layer_switches
from nano_megatron.engine import ParallelConfig
from nano_megatron.schedules import bubble_fraction_formula
from nano_megatron.tools.bench_peers import DTENSOR_SYSTEMS, DTensorTP
from nano_megatron.tools.bench_profile import busy_seconds, device_activity_seconds, timed_schedule
from shared.accounting import flops_per_token, param_count
from shared.bench import (
    DATASHEET_BF16_TFLOPS,
    datasheet_bf16_flops,
    format_rate,
    measure_matmul_flops,
    print_table,
    report_oversubscription,
    write_json,
)
from shared.config import ModelConfig
from shared.dist import destroy_distributed, init_distributed
from shared.hydra_utils import hydra_run_dir, model_config_from, to_dataclass
from shared.train import TrainConfig, micro_batches_of

SYSTEMS = ("tp", "tp_sp", "tp_serial", "tp_sp_serial", "tp_graph", "tp_sp_graph", "tp_sp_graph_pairs",
           *DTENSOR_SYSTEMS, "pp_1f1b", "pp_gpipe")  # the named rows; any tp[_sp][_serial][_graph][_pairs] too
TP_OPTIONS = {"sp": "sequence_parallel", "serial": "tp_comm_overlap", "graph": "cuda_graph",
              "pairs": "overlap_micro_batches"}


def tp_parallel_config(system: str, world: int) -> dict | None:
    """ParallelConfig and LayerConfig fields of a tp[_option...] system name (None: not such a name):
    the layers a name lists are required, the backward overlap is left to its default unless `_serial`
    turns it off, and every other layer is off, so a row measures what its name says."""
    base, *options = system.split("_")
    if base != "tp" or len(set(options)) != len(options) or not set(options) <= set(TP_OPTIONS):
        return None
    return {"tp": world, "sequence_parallel": "sp" in options, "cuda_graph": "graph" in options,
            "overlap_micro_batches": "pairs" in options,
            "tp_comm_overlap": False if "serial" in options else None}


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


def bench_system(system: str, mcfg: ModelConfig, cfg: TrainConfig, bench: DictConfig,
                 device: torch.device, peaks: dict[str, float]) -> dict:
    """One system's row: median step time over `bench.steps` after `bench.warmup`, MFU against each of
    `peaks` ({label: FLOP/s per GPU}), and the GPU-side measurements (see the module docstring)."""
    world = dist.get_world_size()
    if system.startswith("pp"):
        m = int(bench.pp_micro_batches)
        cfg = to_dataclass(TrainConfig, {**cfg.__dict__, "global_batch_size": m * cfg.micro_batch_size})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if system in DTENSOR_SYSTEMS:
        engine = DTensorTP(mcfg, cfg, device, sequence_parallel="_sp" in system, compile="_compile" in system)
    else:
        p = tp_parallel_config(system, world) or {"pp_1f1b": dict(pp=world),
                                                  "pp_gpipe": dict(pp=world, schedule="gpipe")}[system]
        p, switches = split_layer_switches(p)
        switches = {"cuda_graph": False, "overlap_micro_batches": False, **switches}  # pp rows: no layer
        layers = LayerConfig(**switches, performance_layers=bool(bench.performance_layers))
        engine = build_engine(mcfg, ParallelConfig(**p), cfg, device=device, layers=layers)
    # a graphed engine warms up and captures in its first calls: untimed
    warmup = max(int(bench.warmup), getattr(engine, "GRAPH_WARMUP_STEPS", -1) + 1)
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
            timeline: list = []
            engine.pipeline_schedule = timed_schedule(timeline)
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            engine.forward_backward(mb)
            _sync(device)
            span = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(span, op=dist.ReduceOp.MAX)
            bubbles.append(1.0 - busy_seconds(timeline) / span.item())
        del engine.pipeline_schedule
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
    row = {"system": system, "GPUs": world, "ms/step": seconds * 1e3, "tokens/s": tokens / seconds}
    if system not in DTENSOR_SYSTEMS:
        row["layers"] = "+".join(layer_names(engine)) or "none"
    for label, peak in peaks.items():
        row[f"MFU % ({label})"] = 100 * flops_per_token(mcfg, cfg.seq_len) * tokens / seconds / (peak * world)
    if "datasheet" in peaks:  # the attention FLOPs a causal kernel does: half of PaLM's count
        row["MFU % (datasheet, causal attention halved)"] = 100 * flops_per_token(
            mcfg, cfg.seq_len, causal_halved=True) * tokens / seconds / (peaks["datasheet"] * world)
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
        report_oversubscription(env.device)  # on a CPU: torch's threads against the free cores
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
        datasheet = cfg.peak_tflops * 1e12 if cfg.peak_tflops else datasheet_bf16_flops(env.device)
        peaks = {"datasheet": datasheet} if datasheet else {}
        peaks["measured matmul"] = matmul
        rows = []
        for s in systems:  # each row as soon as it is measured: a later failure keeps the earlier ones
            # the peers too run shared.model's paper-path kernels under performance_layers=false
            with performance_layers(bool(cfg.performance_layers)):
                rows.append(bench_system(s, mcfg, tcfg, bench, env.device, peaks))
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
                  "dtype": tcfg.dtype, "performance_layers": bool(cfg.performance_layers),
                  "matmul_TFLOPs_measured": matmul / 1e12,
                  "peak_TFLOPs_datasheet": datasheet / 1e12 if datasheet else None, "torch": torch.__version__,
                  "device": torch.cuda.get_device_name(env.device) if cuda else "cpu", "rows": rows}
        if env.rank == 0:
            path = Path(out_dir[0]) / "bench.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, record)
            print("MFU per GPU against " + " and ".join(f"{k} {format_rate(v, 'FLOP/s')}" for k, v in peaks.items())
                  + (f" ({DATASHEET_BF16_TFLOPS:.0f}: dense bf16, H100/H200 SXM)" if datasheet and not cfg.peak_tflops
                     else ""), flush=True)
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
