"""Compile, in parallel worker processes, the kernel variants a bench run (or a config sweep) will launch.

Triton compiles a kernel variant the first time it is launched, one at a time, and an attention kernel costs
seconds; a bench touching three head_dims, causal and not, forward, backward and decode meets dozens. The
workers compile by running each variant once on small inputs with the same specialisations (head_dim, tile
config, strides that are multiples of 16); Triton's on-disk cache then serves the main process. GPU only.

`run_fwd`, `run_bwd` and `run_decode` build the closures the bench's sweep (tools/flashattn_sweep.py) times.
"""

from __future__ import annotations

import os
import pickle
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

from . import configs
from .checks import NO_WINDOW
from .decode import decode_forward
from .dispatch import REGISTRY, layers_enabled
from .interface import run_kernel

SEQLEN, BATCH, HIDDEN = 8192, 2, 2048  # the attention shape a sweep times (heads x head_dim = HIDDEN)
DEVICE = "cuda"


def _attn_inputs(head_dim: int, seqlen: int, batch: int, dtype=torch.bfloat16):
    heads = HIDDEN // head_dim  # as the bench: its strides (heads x head_dim) specialise the same way
    return [torch.randn(batch * seqlen, heads, head_dim, device=DEVICE, dtype=dtype) for _ in range(4)]


def _attn_args(head_dim: int, causal: bool, seqlen: int, batch: int) -> dict:
    q, k, v, do = _attn_inputs(head_dim, seqlen, batch)
    return dict(q=q, k=k, v=v, do=do, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, cu_seqlens_q=None,
                cu_seqlens_k=None, scale=head_dim**-0.5, window_left=NO_WINDOW,
                window_right=0 if causal else NO_WINDOW)


def run_fwd(head_dim: int, causal: bool, cfg, seqlen: int = SEQLEN, batch: int = BATCH):
    """A closure launching the forward (Algorithm 1, or the layer registered for it: `run_kernel`) with tile
    config `cfg` (None: the launcher's default) on packed bf16 inputs."""
    a = _attn_args(head_dim, causal, seqlen, batch)
    del a["do"]
    return lambda: run_kernel("forward", block_table=None, config=cfg, **a)


def run_bwd(head_dim: int, causal: bool, cfg, seqlen: int = SEQLEN, batch: int = BATCH):
    """A closure launching the backward (Algorithm 2, or its registered layer) with configs `cfg` =
    (dK/dV, dQ), None: the launcher's default."""
    a = _attn_args(head_dim, causal, seqlen, batch)
    do = a.pop("do")
    out, lse = run_kernel("forward", block_table=None, **a)
    return lambda: run_kernel("backward", do=do, out=out, lse=lse, config=cfg, **a)


def run_decode(batch: int, ctx: int, cfg, splits: int, paged: bool, head_dim: int = 128, heads_q: int = 32,
               heads_k: int = 8, page: int = 16):
    """A closure launching Flash-Decoding (one new token per sequence) with split-kernel config `cfg`."""
    q = torch.randn(batch, 1, heads_q, head_dim, device=DEVICE, dtype=torch.bfloat16)
    if paged:
        kc = torch.randn(batch * ctx // page, page, heads_k, head_dim, device=DEVICE, dtype=torch.bfloat16)
        table = torch.randperm(batch * ctx // page, device=DEVICE, dtype=torch.int32).view(batch, -1)
    else:
        kc, table = torch.randn(batch, ctx, heads_k, head_dim, device=DEVICE, dtype=torch.bfloat16), None
    vc = torch.randn_like(kc)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    torch.cuda.synchronize()  # do_bench_cudagraph runs on a side stream that does not wait for these
    return lambda: decode_forward(q, kc, vc, lens, table, head_dim**-0.5, False, splits, config=cfg)


def _compile(job: tuple) -> str | None:
    """Worker: compile one variant by running it once on small inputs. Returns an error line or None."""
    kind, *a = job
    try:
        if kind == "fwd":
            run_fwd(*a, seqlen=256, batch=1)()
        elif kind == "bwd":
            run_bwd(*a, seqlen=256, batch=1)()
        else:
            head_dim, cfg, splits, page = a
            run_decode(2, 1024, cfg, splits, page > 0, head_dim=head_dim, page=max(page, 16))()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported; the caller skips the variant
        return f"{job}: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _picklable(layer) -> bool:
    """A layer registered as a lambda cannot reach a worker: its kernels compile in the main process."""
    try:
        pickle.dumps(layer)
    except Exception:  # pickle raises several types (PicklingError, AttributeError, TypeError)
        return False
    return True


def _take_layers(snapshot: dict) -> None:
    """Worker initializer: the parent's layer registrations, in its order (or none, on the paper path)."""
    REGISTRY.restore(snapshot)


def precompile(jobs: list[tuple]) -> set[str]:
    """Compile `jobs` in parallel: ("fwd", head_dim, causal, cfg), ("bwd", head_dim, causal, (cfg, cfg)),
    ("dec", head_dim, cfg, splits, page or 0). Prints and returns the jobs (as str) that failed."""
    if not jobs:
        return set()
    workers = min(len(jobs), os.cpu_count() or 1, 16)
    # spawned workers take the layers registered here, so they compile the kernels that run here
    snapshot = {point: tuple(layer for layer in layers if _picklable(layer))
                for point, layers in REGISTRY.snapshot().items()} if layers_enabled() else {}
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_take_layers,
                             initargs=(snapshot,)) as pool:
        errors = [e for e in pool.map(_compile, jobs) if e]
    for e in errors:
        print("compile failed:", e, flush=True)
    return {e.split(": ")[0] for e in errors}


def precompile_tables(head_dims, decode_head_dims=(128,), pages=(16, 256), causal=(False, True)) -> None:
    """Compile what a bench run will launch with the current config tables (cache hits are cheap)."""
    cuda = torch.device("cuda")
    # attention: config None, so that each launcher (the paper path's or a layer's) picks its own
    jobs = [job for d in head_dims for c in causal for job in (("fwd", d, c, None), ("bwd", d, c, None))]
    for d in decode_head_dims:
        for page in (0, *pages):
            cfg = configs.decode_config(d, torch.bfloat16, cuda, page > 0)
            jobs += [("dec", d, cfg, s, page) for s in (1, 2)]
    precompile(jobs)
