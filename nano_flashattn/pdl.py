"""Programmatic dependent launch (PDL, Hopper and later): a kernel's launch overlaps the end of the one before.

A decode step runs a few hundred short kernels back to back, and between two of them the SMs idle while the
first drains and the second is launched and its programs placed (about a microsecond a boundary, CUDA graph
or not). Launched with PDL (`cudaLaunchAttributeProgrammaticStreamSerialization`; Triton's `launch_pdl=True`)
a kernel may be placed once every program of the kernel before it has executed
`griddepcontrol.launch_dependents` or exited; its programs then block in `griddepcontrol.wait` until that
kernel has finished and its writes are visible.

Every kernel that takes `PDL` calls `pdl_prologue(PDL)` before it touches memory: it waits for the kernel
before, so only the launch overlaps, never a read or a write, and a kernel is as correct with PDL as without
whatever ran before it (after a kernel launched without the attribute the wait is a no-op). Short kernels
(norms, RoPE, a merge) then let the next kernel be placed at once; long ones (the W4 GEMMs, Flash-Decoding's
slices) call `pdl_release(PDL)` after their main loop instead, so the next kernel's programs, parked on the
SMs, do not land unevenly while the current one still has work to place. H200, llama3-8b shape, batch-16
decode in `nano_vllm` (2026-12-02): W4A16 4,545 → 4,690 tokens/s with the release after the main loops,
4,575 → 4,432 with every kernel releasing at its start; bf16 (whose GEMMs are cuBLAS) 3,143 → 3,147.

`use_pdl(device)` turns it on for CUDA devices of compute capability 9.0 or more, unless the environment
sets `NANO_PDL=0` (for A/B measurements); a launch passes `**pdl_args(device)`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton before grid dependency control: no PDL (use_pdl is False)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_prologue(PDL: tl.constexpr, RELEASE: tl.constexpr = True):
    """First thing in a kernel launched with `launch_pdl=PDL`: wait for the previous kernel, then (RELEASE) let
    the next one be placed (its programs wait in turn, so nothing this kernel writes is read early)."""
    if PDL:
        gdc_wait()
        if RELEASE:
            gdc_launch_dependents()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel be placed now (a long kernel calls it after its main loop, not at its start)."""
    if PDL:
        gdc_launch_dependents()


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: Hopper or later, and not turned off by `NANO_PDL=0`."""
    if device.type != "cuda" or os.environ.get("NANO_PDL", "1") == "0":
        return False
    return _pdl_capable(torch.cuda.current_device() if device.index is None else device.index)


def pdl_args(device: torch.device) -> dict[str, bool]:
    """The launch arguments of a kernel that takes `PDL`: the constexpr and Triton's launch option together
    (`launch_pdl` only where it is on: a Triton without grid dependency control does not know the name)."""
    return {"PDL": True, "launch_pdl": True} if use_pdl(device) else {"PDL": False}


@functools.cache
def _pdl_capable(index: int) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(index)[0] >= 9
