"""Programmatic dependent launch (PDL, Hopper and later) — a performance layer: a kernel's launch overlaps
the end of the one before.

A decode step runs a few hundred short kernels back to back, and between two of them the SMs idle while the
first drains and the second is launched and its programs placed (about a microsecond a boundary, CUDA graph
or not). Launched with PDL (`cudaLaunchAttributeProgrammaticStreamSerialization`; Triton's `launch_pdl=True`)
a kernel may be placed once every program of the kernel before it has executed
`griddepcontrol.launch_dependents` or exited; its programs then block in `griddepcontrol.wait` until that
kernel has finished and its writes are visible.

The kernels that take `PDL` (shared's RMSNorm and SwiGLU gate, nano_vllm's and nano_quant's decode-step
kernels) call `launch.pdl_prologue(PDL)` before they touch memory, so only the launch overlaps, never a read
or a write, and a kernel is as correct with PDL as without whatever ran before it. Short kernels let the
next kernel be placed at once; long ones (the W4 GEMMs) call `launch.pdl_release(PDL)` after their main
loop, so the next kernel's programs, parked on the SMs, do not land unevenly while the current one still
has work to place. H200, llama3-8b shape, batch-16 decode in `nano_vllm` (2026-12-02): W4A16 4,545 → 4,690
tokens/s with the release after the main loops, 4,575 → 4,432 with every kernel releasing at its start.

Flash-Decoding's kernels (decode.py, the paper path) take no `PDL`: this layer registers a decode launcher
(`pdl_decode`, at the "decode" point) that launches them wrapped in kernels of its own, which wait for the
kernel before and then run the paper kernel's body inlined, unchanged. On one H100 (2026-12-06, `python -m
nano_vllm.bench workload=batch1`, qwen3-0.6b shape, a decode step of ~1.15 ms holding 56 of them) Flash-
Decoding launched without PDL cost ~4% of batch-1 decode throughput.

This layer registers at the "pdl" and "decode" points for CUDA devices of compute capability 9.0 or more,
with a Triton that has grid dependency control; `disable()` (or `performance_layers(False)`) turns it off
for an A/B run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..decode import _combine_kernel, _decode_split_kernel, decode_forward
from ..dispatch import REGISTRY
from ..launch import HAS_PDL, capability, pdl_prologue


def applies(device: torch.device) -> bool:
    """CUDA, Hopper or later, and a Triton that can emit the grid-dependency instructions."""
    return HAS_PDL and device.type == "cuda" and capability(device)[0] >= 9


def launch_args(device: torch.device) -> dict[str, bool]:
    """The constexpr and Triton's launch option of a kernel launched with PDL."""
    return {"PDL": True, "launch_pdl": True}


@triton.jit(do_not_specialize=["seqlen_q", "group", "stride_bt"])
def _pdl_split_kernel(Q, K, V, Out, LSE, cache_seqlens, block_table, K_scale, V_scale,
                      seqlen_q, group, qk_scale, window_right,
                      stride_qb, stride_qt, stride_qh,
                      stride_kb, stride_kt, stride_kh, stride_bt, stride_ks, stride_vs,
                      stride_ob, stride_ot, stride_oh, stride_os,
                      stride_lb, stride_lt, stride_lh, stride_ls,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, FP8_KV: tl.constexpr):
    """decode.py's split kernel after a wait for the kernel before (the next one is placed as this one
    exits: a slice's main loop is long, and programs parked early would land unevenly)."""
    pdl_prologue(True, RELEASE=False)
    _decode_split_kernel(Q, K, V, Out, LSE, cache_seqlens, block_table, K_scale, V_scale,
                         seqlen_q, group, qk_scale, window_right,
                         stride_qb, stride_qt, stride_qh,
                         stride_kb, stride_kt, stride_kh, stride_bt, stride_ks, stride_vs,
                         stride_ob, stride_ot, stride_oh, stride_os,
                         stride_lb, stride_lt, stride_lh, stride_ls,
                         HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION,
                         FP8_KV)


@triton.jit
def _pdl_combine_kernel(O_part, LSE_part, Out, LSE, num_splits,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """decode.py's combine kernel after a wait for the split kernel; the next kernel is placed at once."""
    pdl_prologue(True)
    _combine_kernel(O_part, LSE_part, Out, LSE, num_splits, HEAD_DIM, BLOCK_D, BLOCK_S)


def pdl_decode(**arguments):
    """Flash-Decoding (decode.py's launcher) with the two kernels above, launched with PDL."""
    return decode_forward(**arguments, kernels=(_pdl_split_kernel, _pdl_combine_kernel),
                          launch_pdl=True)


def _decode_applies(q: torch.Tensor, **arguments) -> bool:
    return applies(q.device)


def enable() -> Callable[[], None]:
    """Launch with PDL where `applies` (on import); returns `disable`."""
    REGISTRY.register("pdl", launch_args, applies)
    REGISTRY.register("decode", pdl_decode, _decode_applies)
    return disable


def disable() -> None:
    """Every kernel launches without PDL."""
    REGISTRY.remove("pdl", __name__)
    REGISTRY.remove("decode", __name__)


def enabled() -> bool:
    return REGISTRY.registered("pdl", __name__)


enable()
