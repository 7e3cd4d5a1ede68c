"""`python -m nano_quant.bench`: the quantized GEMMs against bf16 cuBLAS and torch's own kernels, same run.

    python -m nano_quant.bench                         # GPU: llama3-8b layer shapes, M = 1 .. 8192
    python -m nano_quant.bench tune=true ms=[1,16,64]  # also sweep our kernels' tile configs (a tool)

For each projection of the model's layers (qkv, o, gate_up, down as (K, N)) and each token count M, with
random weights quantized once:

| system | what runs | peer |
|---|---|---|
| `bf16` | `x @ Wᵀ`, cuBLAS | — |
| `w4a16` | ours: what `linear.awq_gemm` dispatches for this M (GEMV, GEMM, dequantize + cuBLAS) | W4 peers |
| `w4a16 gemv` / `w4a16 mma` | each small-M W4A16 kernel forced (M ≤ 8 / M ≤ 64) | W4 peers |
| `tinygemm` | `torch.ops.aten._weight_int4pack_mm` (gpt-fast's int4 kernel), same INT4 weights | |
| `gemlite w4a16` | gemlite's A16W4 Triton layer, same INT4 weights, its autotuning on (`peer_ms`) | |
| `torchao int4` | torchao `Int4WeightOnlyConfig` (tinygemm layout) under `torch.compile` (`peer_ms`) | |
| `w8a8` | ours: SmoothQuant's INT8 GEMM, scales in the epilogue (inputs quantized) | `int_mm+scale` |
| `w8a8 linear` | ours: per-token quantization kernel + the GEMM (what `W8A8Linear` runs) | the INT8 peers |
| `int_mm` / `int_mm+scale` | `torch._int_mm` (cuBLAS INT8, int32 out) / then the scales in eager torch | |
| `torchao int8` | torchao `Int8DynamicActivationInt8WeightConfig` under `torch.compile` (`peer_ms`, M > 16) | |
| `fp8` | ours: the same GEMM on float8 e4m3 | `scaled_mm` |
| `scaled_mm` | `torch._scaled_mm`, row-wise scales, bf16 out (cuBLASLt FP8) | |

Rows report GPU time (CUDA events, L2 flushed), TFLOP/s (2·M·N·K), TB/s (operand bytes read + output
written), the ratio to bf16 and to the fastest of the row's peers measured (named in `peer`; "W4 peers":
tinygemm, gemlite, torchao; torchao and gemlite only where installed, at the M of `peer_ms`), and the relative error against an fp32 evaluation of the same
quantized operands (a fast wrong kernel shows here). The physical limits (bf16 matmul 8192³, device copy)
are measured in the same process. Without CUDA a tiny smoke run on the torch references says so.
`performance_layers=false` runs the paper path's torch references in the dispatched rows and leaves out the
rows that force one layer's kernel (as it does for a layer a fork deleted).
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from nano_flashattn.registry import layers_enabled, performance_layers
from shared.bench import (
    benchmark,
    format_rate,
    measure_copy_bandwidth,
    measure_matmul_flops,
    print_table,
    release_memory,
    report_oversubscription,
    write_json,
)
from shared.config import resolve_model_config
from shared.hydra_utils import hydra_run_dir

from .layers.split_k import num_sms
from .linear import REGISTRY, awq_dequantize_torch, awq_gemm, quantize_per_token, scaled_mm
from .perplexity import config_record
from .quant import dequantize_rowwise, pack_awq, quantize_groupwise, quantize_rowwise

GROUP = 128
LIBRARY_PEERS = ("gemlite w4a16", "torchao int4", "torchao int8")  # installed separately, may fail to build
W4_PEERS = ("tinygemm", "gemlite w4a16", "torchao int4")
# each row's peers: the ratio is to the fastest of them measured in the same run (named in the row)
PEERS = {"w4a16": W4_PEERS, "w4a16 gemv": W4_PEERS, "w4a16 mma": W4_PEERS, "w4a16 gemv repacked": W4_PEERS,
         "w4a16 mma repacked": W4_PEERS, "w8a8": ("int_mm+scale",),
         "w8a8 linear": ("int_mm+scale", "torchao int8"), "fp8": ("scaled_mm",)}


def layer(name: str) -> ModuleType | None:
    """The performance layer module `name` (`nano_quant.layers.<name>`, loaded by the registry in its
    order), or None when it is missing or the layers are off."""
    if not layers_enabled() or not REGISTRY.present(name):
        return None
    return sys.modules[REGISTRY.module_name(name)]


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """(K, N) of the four projections of one decoder layer of a preset / checkpoint."""
    c = resolve_model_config(model)
    return {"qkv": (c.hidden_size, c.q_size + 2 * c.kv_size), "o": (c.q_size, c.hidden_size),
            "gate_up": (c.hidden_size, 2 * c.intermediate_size), "down": (c.intermediate_size, c.hidden_size)}


def weights(k: int, n: int, device: torch.device) -> dict:
    """One random bf16 weight (N, K) and its INT4 (AWQ layout and tinygemm's), INT8 and FP8 versions."""
    w = torch.randn(n, k, device=device) * 0.02
    q, scales, zeros = quantize_groupwise(w, GROUP)
    ops = {"w": w.to(torch.bfloat16 if device.type == "cuda" else torch.float32), "qweight": pack_awq(q.t()),
           "qzeros": pack_awq(zeros.t()), "scales": scales.t().contiguous()}
    ops["w4_dense"] = awq_dequantize_torch(ops["qweight"], ops["qzeros"], ops["scales"], GROUP).t()
    ops["int8"], ops["fp8"] = quantize_rowwise(w, "int8"), quantize_rowwise(w, "fp8")
    repacked = layer("repacked")
    if repacked is not None:
        ops["repacked"] = repacked.repack_for_gemv(ops["qweight"], ops["qzeros"], ops["scales"], GROUP)
    if device.type == "cuda":  # tinygemm: (q - 8)·Δ + zero with zero = (8 - z)·Δ is the same grid
        packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        ops["int4pack"] = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
        sz = torch.stack([scales.float(), (8 - zeros).float() * scales.float()], -1)
        ops["scales_and_zeros"] = sz.transpose(0, 1).contiguous().to(torch.bfloat16)
        ops["groupwise"] = (q, scales, zeros)  # the same grid for gemlite (W = (q - z)·Δ, HQQ's convention)
    return ops


def _torchao_linear(w: torch.Tensor, kind: str) -> Any:
    """`w` as a torchao-quantized nn.Linear under torch.compile, as torchao's docs run it: "int8" (dynamic
    per-token INT8 activations, per-channel INT8 weights) or "int4" (weight-only, groups of GROUP, the
    tinygemm tile layout: torchao's other INT4 layouts need the mslk / fbgemm kernels, not installed)."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, quantize_

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    config = (Int8DynamicActivationInt8WeightConfig() if kind == "int8" else
              Int4WeightOnlyConfig(group_size=GROUP, int4_packing_format="tile_packed_to_4d"))
    quantize_(lin, config)
    return torch.compile(lin, mode="max-autotune-no-cudagraphs", dynamic=False)


def _gemlite_linear(ops: dict) -> Any:
    """The same INT4 weights as gemlite's A16W4 layer (its Triton GEMV / GEMM), with its autotuning on at
    every M (`set_autotune("max")`, `set_autotune_setting(lambda M: M)`, as its README says for peak speed)."""
    import gemlite

    gemlite.set_autotune("max")
    gemlite.set_autotune_setting(lambda m: m)
    q, scales, zeros = ops["groupwise"]
    return gemlite.helper.A16Wn(device=str(q.device), dtype=torch.bfloat16).from_weights(
        q.to(torch.uint8), scales.to(torch.bfloat16), zeros.to(torch.bfloat16), W_nbits=4, group_size=GROUP)


def peer_systems(ops: dict, x: torch.Tensor, found: dict, ref4: torch.Tensor, ref8: torch.Tensor,
                 w4_bytes: int) -> None:
    """torchao's and gemlite's layers, where installed (CUDA): built once per weight, compiled per M."""
    m, k = x.shape
    n = ops["w"].shape[0]
    out = m * n * 2
    for name, build, nbytes, ref, min_m in (  # torchao's INT8 runs torch._int_mm, which needs M > 16
            ("torchao int8", lambda: _torchao_linear(ops["w"], "int8"), n * k + m * k * 3 + out, ref8, 17),
            ("torchao int4", lambda: _torchao_linear(ops["w"], "int4"), w4_bytes + m * k * 2 + out, ref4, 1),
            ("gemlite w4a16", lambda: _gemlite_linear(ops), w4_bytes + m * k * 2 + out, ref4, 1)):
        if m < min_m:
            continue
        if name not in ops:
            try:
                ops[name] = build()
            except Exception as e:  # not installed, or no kernel for this GPU: no row, and say why
                print(f"note: no {name} rows ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]})",
                      flush=True)
                ops[name] = None
        if ops[name] is not None:
            found[name] = (functools.partial(ops[name], x), nbytes, ref)


def systems(ops: dict, x: torch.Tensor, peers: bool = False) -> dict[str, tuple]:
    """name -> (callable, bytes moved, fp32 reference of what it computes); `peers`: torchao's and gemlite's
    layers too."""
    m, k = x.shape
    n = ops["w"].shape[0]
    (qa, sa), (qa8, sa8) = quantize_rowwise(x, "int8"), quantize_rowwise(x, "fp8")
    (qw, sw), (qw8, sw8) = ops["int8"], ops["fp8"]
    out = m * n * 2
    ref8 = dequantize_rowwise(qa, sa) @ dequantize_rowwise(qw, sw).t()
    ref_fp8 = dequantize_rowwise(qa8, sa8) @ dequantize_rowwise(qw8, sw8).t()
    ref4 = x.float() @ ops["w4_dense"].t()
    w4_bytes = n * k // 2 + 2 * (n * k // GROUP) * 2
    found = {
        "bf16": (lambda: x @ ops["w"].t(), n * k * 2 + m * k * 2 + out, x.float() @ ops["w"].float().t()),
        "w4a16": (lambda: awq_gemm(x, ops["qweight"], ops["qzeros"], ops["scales"], GROUP, None),
                  w4_bytes + m * k * 2 + out, ref4),
        "w8a8": (lambda: scaled_mm(qa, qw, sa, sw, None, torch.bfloat16),
                 n * k + m * k + out + 4 * (m + n), ref8),
        "w8a8 linear": (lambda: _w8a8_linear(x, qw, sw), n * k + m * k * 3 + out, ref8),
        "fp8": (lambda: scaled_mm(qa8, qw8, sa8, sw8, None, torch.bfloat16), n * k + m * k + out,
                ref_fp8),
    }
    awq = (ops["qweight"], ops["qzeros"], ops["scales"], GROUP, None)
    gemv, kernels, repacked = layer("gemv"), layer("kernels"), layer("repacked")
    for name, module, kernel, (lo, hi) in (("w4a16 gemv", gemv, "awq_gemv_triton", (1, 8)),
                                           ("w4a16 mma", kernels, "awq_gemm_triton", (1, 64))):
        if module is not None and x.is_cuda and lo <= m <= hi:  # the Triton kernels themselves: CUDA only
            found[name] = (functools.partial(getattr(module, kernel), x, *awq), w4_bytes + m * k * 2 + out,
                           ref4)
    if repacked is not None and x.is_cuda and m <= repacked.AWQ_LARGE_M:  # fp16 scales, fp32 zeros: 6 B a group
        name, kernel = (("w4a16 gemv repacked", repacked.awq_gemv_repacked_triton) if m == 1 else
                        ("w4a16 mma repacked", repacked.awq_mma_repacked_triton))
        found[name] = (functools.partial(kernel, x, *ops["repacked"], GROUP, None),
                       n * k // 2 + 6 * (n * k // GROUP) + m * k * 2 + out, ref4)
    if x.is_cuda:
        found["tinygemm"] = (lambda: torch.ops.aten._weight_int4pack_mm(x, ops["int4pack"], GROUP,
                                                                          ops["scales_and_zeros"]),
                             w4_bytes + m * k * 2 + out, ref4)
        if m > 16:  # cuBLAS INT8 needs M > 16
            wt = qw.t()
            found["int_mm"] = (lambda: torch._int_mm(qa, wt), n * k + m * k + m * n * 4,
                               ref8 / sa[:, None] / sw)
            found["int_mm+scale"] = (
                lambda: (torch._int_mm(qa, wt).float() * sa[:, None] * sw).to(torch.bfloat16),
                n * k + m * k + out, ref8)
        w8t = qw8.t()
        found["scaled_mm"] = (lambda: torch._scaled_mm(qa8, w8t, scale_a=sa8[:, None], scale_b=sw8[None, :],
                                                       out_dtype=torch.bfloat16),
                              n * k + m * k + out, ref_fp8)
        if peers:
            peer_systems(ops, x, found, ref4, ref8, w4_bytes)
    return found


def _w8a8_linear(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    qa, sa = quantize_per_token(x, "int8")
    return scaled_mm(qa, qw, sa, sw, None, torch.bfloat16)


def run_shape(name: str, k: int, n: int, ms: list[int], device: torch.device, warmup: int,
              repeats: int, only: list[str] | None = None, peer_ms: list[int] = ()) -> list[dict]:
    """One table's rows: every system of `systems` (those in `only` and bf16, when `only` is given); the
    installed libraries' layers (torchao, gemlite) at the M of `peer_ms`."""
    ops = weights(k, n, device)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        found = {s: job for s, job in systems(ops, x, m in peer_ms).items()
                 if only is None or s in only or s == "bf16"}
        times = {}
        for system, (fn, nbytes, ref) in list(found.items()):
            try:
                y = fn()
            except Exception as e:  # a peer's shape constraint (e.g. M a multiple of 16), or its compile: no row
                if not isinstance(e, RuntimeError) and system not in LIBRARY_PEERS:
                    raise
                print(f"note: {system} at M={m}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}",
                      flush=True)
                del found[system]
                continue
            err = float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30))
            times[system] = benchmark(fn, warmup=warmup, repeats=repeats, device=device)
            t = times[system]
            rows.append({"shape": name, "K": k, "N": n, "M": m, "system": system, "us": t * 1e6,
                         "TFLOP/s": 2 * m * n * k / t / 1e12, "TB/s": nbytes / t / 1e12, "rel err": err})
        for row in rows[-len(found):]:
            row["vs bf16"] = times["bf16"] / times[row["system"]]
            peers = [p for p in PEERS.get(row["system"], ()) if p in times]
            peer = min(peers, key=times.get) if peers else None  # the fastest peer of this run
            row["peer"], row["vs peer"] = peer, times[peer] / times[row["system"]] if peer else None
        del x, found
    del ops
    release_memory()
    return rows


def tune_configs(kind: str, m: int, n: int = 4096, k: int = 4096) -> list[dict]:
    """Candidate tile configs for the sweep (`tune=true`), at most ~40 per kernel and M; SPLIT_K from
    how many times the grid should cover the SMs (132 on an H200) for this (N, K)."""
    sms, groups = 132, k // GROUP

    def split(tiles: int, waves: int) -> int:
        return max(1, min(groups, -(-waves * sms // tiles)))

    if kind == "awq_gemv":  # 2 x 2 x 3 x 3 = 36: tiles, grid coverage, and the pipeline over K's groups
        bm = 1 if m == 1 else 2 if m == 2 else 4
        grid = itertools.product((128, 256), (16, 32), (4, 8, 16), (1, 2, 3))
        return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split(-(-n // bn) * -(-m // bm), wv),
                 "num_warps": 4, "num_stages": st} for bn, bk, wv, st in grid]
    if kind == "awq_gemv_repacked":  # 6 tiles (columns, groups a step, warps) x 2 pipelines x 2 split-K
        tiles = [(8, 2, 1), (16, 2, 1), (16, 4, 1), (32, 2, 1), (32, 4, 2), (64, 2, 2)]
        return [{"BLOCK_N": bn, "GPS": gps, "SPLIT_K": sp, "num_warps": w, "num_stages": st}
                for (bn, gps, w), st, sp in itertools.product(tiles, (3, 4), (1, 4)) if groups >= gps * sp]
    if kind == "awq_mma_repacked":  # 3 x 2 x 2 x 4 x 2 = 96: columns, warps, stages, split-K, tiles a step
        bm = layer("repacked").awq_mma_repacked_config(m, n, k, GROUP, sms)["BLOCK_M"]
        return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "SPLIT_K": sp, "K_TILES": kt, "num_warps": w,
                 "num_stages": st}
                for bn, w, st, sp, kt in itertools.product((64, 128, 256), (4, 8), (3, 4), (1, 2, 4, 8), (1, 2))
                if k // 128 % kt == 0]
    small = [(16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 4, 4)]
    large = [(128, 128, 128, 4, 4), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3),
             (128, 128, 64, 4, 5), (128, 256, 64, 8, 4), (64, 256, 128, 4, 4)]
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": w, "num_stages": st}
            for bm, bn, bk, w, st in (small if m <= 64 else large)]


def _tune_jobs(ops: dict, x: torch.Tensor) -> dict:
    (qa, sa), (qa8, sa8) = quantize_rowwise(x, "int8"), quantize_rowwise(x, "fp8")
    gemv, kernels, repacked = layer("gemv"), layer("kernels"), layer("repacked")
    jobs = {}
    awq = (x, ops["qweight"], ops["qzeros"], ops["scales"], GROUP, None)
    if kernels is not None:
        jobs["fp8"] = (lambda c: kernels.scaled_mm_triton(qa8, ops["fp8"][0], sa8, ops["fp8"][1], None,
                                                          torch.bfloat16, c), "mm")
        jobs["w8a8"] = (lambda c: kernels.scaled_mm_triton(qa, ops["int8"][0], sa, ops["int8"][1], None,
                                                           torch.bfloat16, c), "mm")
        if x.shape[0] <= kernels.AWQ_LARGE_M:
            jobs["w4a16 mma"] = (lambda c: kernels.awq_gemm_triton(*awq, c), "awq")
    if gemv is not None and x.shape[0] <= 8:
        jobs["w4a16 gemv"] = (lambda c: gemv.awq_gemv_triton(*awq, c), "awq_gemv")
    if repacked is not None and 1 < x.shape[0] <= repacked.AWQ_LARGE_M:
        jobs["w4a16 mma repacked"] = (lambda c: repacked.awq_mma_repacked_triton(x, *ops["repacked"], GROUP,
                                                                                 None, c), "awq_mma_repacked")
    if repacked is not None and x.shape[0] == 1:
        jobs["w4a16 gemv repacked"] = (lambda c: repacked.awq_gemv_repacked_triton(x, *ops["repacked"], GROUP,
                                                                                   None, c), "awq_gemv_repacked")
    return jobs


def tune_shape(name: str, k: int, n: int, ms: list[int], device: torch.device,
               systems: list[str] | None = None) -> list[dict]:
    """Time every candidate config of our kernels (those named in `systems`, all when None); the best per
    (shape, M, kernel) against the default."""
    ops = weights(k, n, device)
    rows = []
    for m in ms:
        jobs = _tune_jobs(ops, torch.randn(m, k, device=device, dtype=torch.bfloat16))
        for system, (fn, kind) in jobs.items():
            if systems is not None and system not in systems:
                continue
            default = benchmark(fn, None, device=device)
            best, best_t = None, default
            for c in tune_configs(kind, m, n, k):
                try:
                    t = benchmark(fn, c, warmup=2, repeats=10, device=device)
                except Exception as e:  # a config that does not fit (shared memory, registers): skip it
                    print(f"  skip {system} {c}: {type(e).__name__}", flush=True)
                    continue
                if t < best_t:
                    best, best_t = c, t
            rows.append({"shape": name, "M": m, "system": system, "default us": default * 1e6,
                         "best us": best_t * 1e6, "speedup": default / best_t, "best config": str(best)})
            if system == "w4a16 gemv repacked":  # a line for repacked.MEASURED_REPACKED
                best = best or layer("repacked").awq_gemv_repacked_config(n, k, GROUP, num_sms(device))
                print(f"    ({n}, {k}): {best},  # {name}: {best_t * 1e6:.1f} us, "
                      f"{torch.cuda.get_device_name(device)}", flush=True)
            if system == "w4a16 mma repacked":  # an entry for repacked.MEASURED_MMA_REPACKED
                c = best or layer("repacked").awq_mma_repacked_config(m, n, k, GROUP, num_sms(device))
                print(f"    ({n}, {k}, {c['BLOCK_M']}): ({c['BLOCK_N']}, {c['num_warps']}, {c['num_stages']}, "
                      f"{c['SPLIT_K']}, {c.get('K_TILES', 1)}),  # {name} M={m}: {best_t * 1e6:.1f} us", flush=True)
    release_memory()
    return rows


def _repacked_summary(rows: list[dict], tuned: list[dict]) -> list[dict]:
    """Per shape at M = 1: µs of the AutoAWQ-layout GEMV, the repacked GEMV (default and best swept config),
    tinygemm and bf16 cuBLAS, from the table rows and the sweep."""
    us = {(r["shape"], r["system"]): r["us"] for r in rows if r["M"] == 1}
    best = {r["shape"]: r for r in tuned if r["M"] == 1 and r["system"] == "w4a16 gemv repacked"}
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows if r["M"] == 1):
        if (shape, "w4a16 gemv repacked") not in us:
            continue
        b = best.get(shape)
        out.append({"shape": shape, "gemv": us.get((shape, "w4a16 gemv")),
                    "repacked": us[(shape, "w4a16 gemv repacked")], "repacked best": b and b["best us"],
                    "tinygemm": us.get((shape, "tinygemm")), "bf16": us.get((shape, "bf16")),
                    "best config": b and b["best config"]})
    return out


def run(cfg: DictConfig) -> dict:
    """Everything `main` does, callable without Hydra (tests); `performance_layers=false`: the
    paper path's torch references alone."""
    with performance_layers(cfg.get("performance_layers", True)):
        cuda = torch.cuda.is_available()
        device = torch.device("cuda" if cuda else "cpu")
        model, ms = str(cfg.model), [int(m) for m in cfg.ms]
        if not cuda:
            print("note: no GPU: a smoke run of the torch references on tiny shapes; it says nothing about speed",
                  flush=True)
            model, ms = "tiny", [1, 32]
            report_oversubscription(device)
        shapes = layer_shapes(model)
        unknown = sorted(set(cfg.shapes or shapes) - set(shapes))
        if unknown:
            raise ValueError(f"shapes {unknown} are unknown; choose from {sorted(shapes)}")
        peak = measure_matmul_flops(device, n=None if cuda else 256)
        copy = measure_copy_bandwidth(device)
        rows, tuned = [], []
        for name in cfg.shapes or shapes:
            k, n = shapes[name]
            only = cfg.get("systems")
            shape_rows = run_shape(name, k, n, ms, device, int(cfg.warmup), int(cfg.repeats),
                                   None if only is None else list(only), [int(m) for m in cfg.get("peer_ms") or ()])
            print_table(shape_rows, title=f"{model} {name}: K={k}, N={n}, bf16 activations, INT4 groups of "
                                          f"{GROUP}")
            rows += shape_rows
            if cfg.tune and cuda:
                systems = cfg.get("tune_systems")
                shape_tuned = tune_shape(name, k, n, ms, device, None if systems is None else list(systems))
                print_table(shape_tuned, title=f"tile sweep, {name}")
                tuned += shape_tuned
        summary = _repacked_summary(rows, tuned)
        if summary:
            print_table(summary, title="M = 1 W4A16: GEMV (AutoAWQ layout), repacked GEMV (default, best swept), "
                                       "tinygemm, bf16 cuBLAS (us)")
        matmul = "bf16 matmul 8192^3" if cuda else "fp32 matmul 256^3"
        print(f"limits on this device: {matmul} {format_rate(peak, 'FLOP/s')}, copy {format_rate(copy, 'B/s')} "
              "(read + write)", flush=True)
        record = {"bench": "nano_quant", "model": model, "ms": ms, "matmul_TFLOPs": peak / 1e12,
                  "copy_TBps": copy / 1e12, "rows": rows, "tuned": tuned,
                  "config": config_record(cfg)}
        path = Path(hydra_run_dir()) / "bench.json"
        write_json(path, record)
        print(f"wrote {path}", flush=True)
        return record


@hydra.main(version_base=None, config_path="configs", config_name="bench")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
