"""Check and time `nano_flashattn.backward_atomic` (one kernel, dQ added atomically) against the paper path's
backward, SDPA flash and SDPA cuDNN, over a small grid of launch configs per head_dim (GPU only).

    PYTHONPATH=$PWD python tools/flashattn_bwd_probe.py --out bwd_probe.json     (an H200: ~3-4 minutes)

Shapes: nano_flashattn.bench's attention grid (batch x seqlen = 16k tokens, heads x head_dim = 2048, bf16),
head_dim 64, 96 and 128, causal and not, seqlen 4k and 16k. head_dim 96's paper path is the split_head layer
(registered here, as the bench does on a GPU); the atomic layer runs it on the padded 128-wide tile.

1. Compile: every atomic config in parallel worker processes (the layer enabled in each), the paper path's
   default tiles likewise (nano_flashattn.bench_compile); a config that fails to compile (out of shared
   memory, say) is reported and skipped.
2. Check, per shape and config: the atomic dq, dk, dv against the paper path's on the same bf16 inputs,
   max |atomic - paper| / max |paper| < TOL (both round dS and the outputs to bf16; dQ's fp32 sums differ in
   order only). A config that fails the check is not timed.
3. Time (shared.bench.benchmark: median of CUDA-event-timed torch.autograd.grad calls, L2 flushed): the paper
   backward, each atomic config, SDPA flash and cuDNN. TFLOP/s: nano_flashattn.bench's convention,
   2.5 x 4 B S^2 H D, halved when causal.

Prints a table per shape (TFLOP/s, and the best atomic config / paper, / flash, / cuDNN), then each config's
TFLOP/s summed over the shapes of its head_dim (the one to put in DEFAULT_CONFIGS), and writes it all to
--out as JSON.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without an install

import torch
import torch.nn.functional as F
import triton

import nano_flashattn as fa
from nano_flashattn import backward_atomic as ba
from nano_flashattn import bench as fa_bench
from nano_flashattn.backward_atomic import AtomicBackwardConfig as C
from nano_flashattn.bench_compile import _compile, precompile
from shared.bench import benchmark, print_table, write_json

DEVICE, DTYPE = "cuda", torch.bfloat16
TOL = 2e-2  # bf16 keeps 8 bits: outputs differ by about one rounding of the largest gradient
P, D = "pointer", "descriptor"
# (block_m, block_n, num_warps, num_stages, atomic), by padded head width (96 runs the 128 tiles)
GRIDS: dict[int, list[C]] = {
    128: [C(64, 128, 8, 2, P), C(64, 128, 8, 3, P), C(64, 64, 4, 2, P), C(64, 64, 4, 3, P),
          C(128, 64, 8, 2, P), C(64, 128, 8, 2, D), C(64, 64, 4, 3, D), C(128, 64, 8, 2, D)],
    64: [C(64, 128, 8, 2, P), C(64, 128, 4, 2, P), C(64, 128, 8, 3, P), C(128, 128, 8, 2, P),
         C(64, 64, 4, 3, P), C(128, 64, 4, 2, P), C(64, 128, 8, 2, D), C(128, 128, 8, 2, D)],
}


def name(c: C) -> str:
    return f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.num_stages}{'-tma' if c.atomic == D else ''}"


def grid(head_dim: int, limit: int) -> list[C]:
    configs = GRIDS[128 if head_dim > 64 else 64]
    return [c for c in configs if c.atomic == P or ba.HAS_DESCRIPTOR_ATOMICS][:limit]


def _enable_in_worker() -> None:
    import nano_flashattn.split_head  # noqa: F401  (importing registers, as in the main process)

    ba.enable()  # run_kernel("backward", config=<AtomicBackwardConfig>) reaches atomic_backward


def compile_all(head_dims, causal, limit: int) -> set[str]:
    """Compile the paper path's backward and every atomic config (bench_compile's small-input runs, which
    share the bench shapes' specialisations). Returns the failed jobs, as str."""
    failed = precompile([("bwd", d, c, None) for d in head_dims for c in causal])
    jobs = [("bwd", d, c, cfg) for d in head_dims for c in causal for cfg in grid(d, limit)]
    workers = min(len(jobs), os.cpu_count() or 1, 16)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_enable_in_worker) as pool:
        errors = [e for e in pool.map(_compile, jobs) if e]
    for e in errors:
        print("compile failed:", e, flush=True)
    return failed | {e.split(": ")[0] for e in errors}


def grads(q, k, v, do, causal):
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(fa.flash_attn_func(qq, kk, vv, causal=causal), (qq, kk, vv), do)


def tflops(f, inputs, causal, grad, flops) -> float:
    """Backward TFLOP/s of f(*inputs, causal): autograd.grad timed with shared.bench.benchmark."""
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = f(*inputs, causal)
    seconds = benchmark(torch.autograd.grad, out, inputs, grad, retain_graph=True, device=out.device,
                        warmup=5, repeats=20)
    return 2.5 * flops / seconds / 1e12


def sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def ours(q, k, v, causal):
    return fa.flash_attn_func(q, k, v, causal=causal)


def probe_shape(d, causal, seqlen, args, failed) -> dict:
    batch, heads = max(1, args.tokens // seqlen), args.hidden // d
    q, k, v, do = (torch.randn(batch, seqlen, heads, d, device=DEVICE, dtype=DTYPE) for _ in range(4))
    flops = 4 * batch * seqlen**2 * heads * d / (2 if causal else 1)
    row = {"head_dim": d, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads}
    paper = grads(q, k, v, do, causal)
    row["paper"] = tflops(ours, (q, k, v), causal, do, flops)
    errors = {}
    for cfg in grid(d, args.configs):
        key = name(cfg)
        if str(("bwd", d, causal, cfg)) in failed:
            row[key] = "compile failed"
            continue
        remove = fa.register_kernel("backward", functools.partial(ba.atomic_backward, config=cfg), ba.applies)
        try:
            got = grads(q, k, v, do, causal)
            err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                      for a, b in zip(got, paper))
            errors[key] = err
            row[key] = tflops(ours, (q, k, v), causal, do, flops) if err < TOL else f"wrong: {err:.2e}"
        except Exception as e:  # a config this GPU / Triton cannot run: reported, not fatal
            row[key] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        finally:
            remove()
    sdpa_layout = [t.transpose(1, 2).contiguous() for t in (q, k, v, do)]
    for peer, backend in fa_bench.PEERS:
        with fa_bench.sdpa_backend(backend):
            row[peer] = fa_bench._try(tflops, sdpa, sdpa_layout[:3], causal, sdpa_layout[3], flops)
    timed = {k: v for k, v in row.items() if k.startswith("m") and isinstance(v, float)}
    if timed:
        best = max(timed, key=timed.get)
        row["best"] = best
        for peer in ("paper", "sdpa_flash", "sdpa_cudnn"):
            ref = row.get(peer)
            row[f"best/{peer}"] = timed[best] / ref if isinstance(ref, float) else None
    row["_max_rel_err"] = errors
    return row


def _short(row: dict) -> dict:
    """A row for the printed table: messages cut to 28 characters (the JSON keeps them whole)."""
    return {k: v[:28] if isinstance(v, str) else v for k, v in row.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bwd_probe.json", help="JSON file of the results")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 96, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--causal", choices=sorted(fa_bench.CAUSAL), default="both")
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen (the bench's grid)")
    p.add_argument("--hidden", type=int, default=2048, help="heads x head_dim (the bench's grid)")
    p.add_argument("--configs", type=int, default=8, help="the first N configs of each head_dim's grid")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    import nano_flashattn.split_head  # noqa: F401  (importing registers: head_dim 96's paper path)

    if not ba.HAS_DESCRIPTOR_ATOMICS:
        print(f"descriptor atomics: not in Triton {triton.__version__}; pointer configs only", flush=True)

    causal = fa_bench.CAUSAL[args.causal]
    failed = compile_all(args.head_dims, causal, args.configs)
    rows = []
    for d in args.head_dims:
        for c in causal:
            for seqlen in args.seqlens:
                rows.append(probe_shape(d, c, seqlen, args, failed))
                print_table([_short(rows[-1])])
    print_table([_short({k: v for k, v in r.items() if not k.startswith("m")}) for r in rows],
                "best atomic config per shape (TFLOP/s and ratios)")
    totals = []
    for d in args.head_dims:
        for cfg in grid(d, args.configs):
            values = [r.get(name(cfg)) for r in rows if r["head_dim"] == d]
            ok = all(isinstance(v, float) for v in values)
            totals.append({"head_dim": d, "config": name(cfg), "sum_tflops": sum(values) if ok else None,
                           "paper_sum": sum(r["paper"] for r in rows if r["head_dim"] == d)})
    print_table(totals, "each config summed over its head_dim's shapes (paper_sum: the paper path's)")
    return write_json(args.out, {"rows": rows, "totals": totals, "tol": TOL,
                                 "grids": {d: [name(c) for c in grid(d, args.configs)] for d in args.head_dims}})


if __name__ == "__main__":
    main()
