"""Config sweep for the kernels (GPU only), run by `python -m nano_flashattn.bench --sweep`.

Tries a few tile shapes per kernel, keeps the fastest, and writes it into the config tables
(forward.FWD_CONFIGS, backward.BWD_CONFIGS, decode.DECODE_CONFIGS) for the rest of the process; the
winners measured on an H200 are then copied into those tables by hand (see BENCHMARKS.md).
Every candidate is compiled first in parallel worker processes (Triton's on-disk cache then serves
the main process), because compiling dozens of attention kernels one by one costs minutes.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

from . import backward, decode, forward

FWD_CANDIDATES = {
    64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 4)],
}
# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV kernel, then of the dQ kernel
DKDV_CANDIDATES = [(32, 128, 4, 3), (64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (64, 128, 8, 3)]
DQ_CANDIDATES = [(128, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 3)]
# (BLOCK_N, num_warps, num_stages) of the split kernel, contiguous and paged: a page lookup feeds the K/V
# addresses, and Triton's pipeliner only double-buffers such dependent loads from ~6 stages on
DECODE_CANDIDATES = {
    False: [(64, 4, 4), (64, 4, 3), (128, 4, 3), (128, 8, 3), (32, 4, 4), (64, 8, 4), (32, 4, 6)],
    True: [(64, 4, 4), (64, 4, 6), (64, 4, 8), (32, 4, 8), (128, 4, 5), (64, 8, 8), (32, 4, 6)],
}
DECODE_SPLITS = {(64, 4096): [1, 2, 4], (1, 65536): [16, 32, 64]}  # (batch, context): split counts
SEQLEN, BATCH = 8192, 2  # the attention shape timed (heads x head_dim = 2048)
DEVICE = "cuda"


def _attn_inputs(head_dim, seqlen, batch, dtype=torch.bfloat16):
    heads = 2048 // head_dim
    return [torch.randn(batch * seqlen, heads, head_dim, device=DEVICE, dtype=dtype) for _ in range(4)]


def _run_fwd(head_dim, causal, cfg, seqlen=None, batch=None):
    seqlen, batch = seqlen or SEQLEN, batch or BATCH
    q, k, v, _ = _attn_inputs(head_dim, seqlen, batch)
    right = 0 if causal else 1 << 30
    return lambda: forward.attention_forward(q, k, v, batch, seqlen, seqlen, None, None, None, head_dim**-0.5,
                                             1 << 30, right, config=cfg)  # fmt: skip


def _run_bwd(head_dim, causal, cfg, seqlen=None, batch=None):
    seqlen, batch = seqlen or SEQLEN, batch or BATCH
    q, k, v, do = _attn_inputs(head_dim, seqlen, batch)
    right = 0 if causal else 1 << 30
    args = (batch, seqlen, seqlen, None, None, head_dim**-0.5, 1 << 30, right)
    out, lse = forward.attention_forward(q, k, v, *args[:5], None, *args[5:])
    return lambda: backward.attention_backward(do, q, k, v, out, lse, *args, config=cfg)


def _run_decode(batch, ctx, cfg, splits, paged, heads_q=32, heads_k=8, head_dim=128, page=16):
    q = torch.randn(batch, 1, heads_q, head_dim, device=DEVICE, dtype=torch.bfloat16)
    if paged:
        kc = torch.randn(batch * ctx // page, page, heads_k, head_dim, device=DEVICE, dtype=torch.bfloat16)
        table = torch.randperm(batch * ctx // page, device=DEVICE, dtype=torch.int32).view(batch, -1)
    else:
        kc, table = torch.randn(batch, ctx, heads_k, head_dim, device=DEVICE, dtype=torch.bfloat16), None
    vc = torch.randn_like(kc)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    if DEVICE == "cuda":
        torch.cuda.synchronize()  # do_bench_cudagraph runs on a side stream that does not wait for these
    return lambda: decode.decode_forward(q, kc, vc, lens, table, head_dim**-0.5, False, splits, config=cfg)


def _compile(job):
    """Worker: compile one candidate by running it once on small inputs (same specialisations)."""
    kind, *a = job
    try:
        if kind == "fwd":
            _run_fwd(*a, seqlen=256, batch=1)()
        elif kind == "bwd":
            _run_bwd(*a, seqlen=256, batch=1)()
        else:
            cfg, splits, page = a
            _run_decode(2, 1024, cfg, splits, page > 0, page=max(page, 16))()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:  # reported, and the candidate is skipped in the sweep
        return f"{job}: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _precompile(jobs):
    workers = min(len(jobs), os.cpu_count() or 1, 16)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        errors = [e for e in pool.map(_compile, jobs) if e]
    for e in errors:
        print("compile failed:", e, flush=True)
    return {e.split(":")[0] for e in errors}


def _ms(fn, graph=False):
    import triton.testing

    if graph:  # decode: small kernels, replay a CUDA graph so that launch overhead does not count
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def precompile_tables(head_dims, pages=(16, 256)) -> None:
    """Compile, in parallel, what the bench will run with the current tables (cache hits are cheap)."""
    jobs = [(k, d, c, cfg) for d in head_dims for c in (False, True)
            for k, cfg in (("fwd", forward.FWD_CONFIGS[d]), ("bwd", backward.BWD_CONFIGS[d]))]  # fmt: skip
    for page in (0, *pages):
        jobs += [("dec", decode.DECODE_CONFIGS[page > 0], s, page) for s in (1, 2)]
    _precompile(jobs)


def sweep(head_dims=(64, 128)) -> dict:
    head_dims = [d for d in head_dims if d in FWD_CANDIDATES]
    base = {d: backward.BWD_CONFIGS[d] for d in head_dims}
    jobs = [("fwd", d, c, cfg) for d in head_dims for c in (False, True) for cfg in FWD_CANDIDATES[d]]
    for d in head_dims:  # one kernel's tiles varied, the other's held at the table's value
        jobs += [("bwd", d, c, (a, base[d][1])) for c in (False, True) for a in DKDV_CANDIDATES]
        jobs += [("bwd", d, c, (base[d][0], b)) for c in (False, True) for b in DQ_CANDIDATES]
    dec_jobs = [
        ("dec", cfg, s, 16 * p) for p in (False, True) for cfg in DECODE_CANDIDATES[p] for s in (1, 2)
    ]
    failed = _precompile(jobs + dec_jobs)
    report = {"fwd": {}, "bwd": {}, "decode": {}}
    for d in head_dims:
        scores = {}
        for cfg in FWD_CANDIDATES[d]:
            if any(str(("fwd", d, c, cfg)) in failed for c in (False, True)):
                continue
            scores[cfg] = sum(1 / _ms(_run_fwd(d, c, cfg)) for c in (False, True))
        forward.FWD_CONFIGS[d] = best = max(scores, key=scores.get)
        report["fwd"][d] = {"best": best, "score": {str(k): v for k, v in scores.items()}}
        print(
            f"sweep fwd hd{d}: best {best}  " + "  ".join(f"{k}:{v:.3f}" for k, v in scores.items()),
            flush=True,
        )
        # the whole backward's time, first over dK/dV tiles, then over dQ tiles with the best dK/dV
        best = base[d]
        scores = {}
        for which, cands in ((0, DKDV_CANDIDATES), (1, DQ_CANDIDATES)):
            for cand in cands:
                cfg = (cand, best[1]) if which == 0 else (best[0], cand)
                if any(str(("bwd", d, c, (cand, base[d][1]) if which == 0 else (base[d][0], cand))) in failed
                       for c in (False, True)):  # fmt: skip
                    continue
                scores[cfg] = sum(1 / _ms(_run_bwd(d, c, cfg)) for c in (False, True))
            best = max(scores, key=scores.get)
        backward.BWD_CONFIGS[d] = best
        report["bwd"][d] = {"best": best, "score": {str(k): v for k, v in scores.items()}}
        print(
            f"sweep bwd hd{d}: best {best}  " + "  ".join(f"{k}:{v:.3f}" for k, v in scores.items()),
            flush=True,
        )
        torch.cuda.empty_cache()
    for paged in (False, True):
        res = {}
        for cfg in DECODE_CANDIDATES[paged]:
            if any(str(("dec", cfg, s, 16 * paged)) in failed for s in (1, 2)):
                continue
            for (b, ctx), splits in DECODE_SPLITS.items():
                for s in splits:
                    res[str((cfg, b, ctx, s))] = _ms(_run_decode(b, ctx, cfg, s, paged), graph=True)

        # best config: fastest sum over the two shapes, each at its own best split count
        def total(cfg, res=res):
            return sum(min(res[str((cfg, b, c, s))] for s in ss) for (b, c), ss in DECODE_SPLITS.items())

        ok = [
            cfg for cfg in DECODE_CANDIDATES[paged] if any(str((cfg, *bc, 1)) in res for bc in DECODE_SPLITS)
        ]
        decode.DECODE_CONFIGS[paged] = best = min(ok, key=total)
        report["decode"][str(paged)] = {"best": best, "ms": res}
        print(f"sweep decode paged={paged}: best {best}; ms " + "  ".join(f"{k}:{v:.3f}" for k, v in res.items()),
              flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    return report
