"""What a kernel launch may use on a device: programmatic dependent launch (PDL) and Hopper's facts.

PDL (Hopper and later) lets a kernel's launch overlap the end of the kernel before it. A kernel that takes
it has a constexpr `PDL` and calls, device side:

* `pdl_prologue(PDL)` before it touches memory: wait for the previous kernel (`griddepcontrol.wait`), then
  (RELEASE) let the next kernel be placed (`griddepcontrol.launch_dependents`);
* `pdl_release(PDL)` after its main loop instead, for a long kernel (`pdl_prologue(PDL, RELEASE=False)`).

Both compile to nothing when PDL is False. Host side, a launch passes `**pdl_args(device)`: `{"PDL": False}`
unless a performance layer at the "pdl" point applies to the device (layers/pdl.py; delete it and every
kernel launches without PDL, with the same results).

The Hopper layers also ask `is_sm90(device)` and `tma_ready(t)` (TMA's alignment rules).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .dispatch import REGISTRY

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:  # a Triton before grid dependency control: no layer may turn PDL on
    gdc_launch_dependents = gdc_wait = None
    HAS_PDL = False


@triton.jit
def pdl_prologue(PDL: tl.constexpr, RELEASE: tl.constexpr = True, EARLY: tl.constexpr = False):
    """First thing in a kernel launched with `launch_pdl=PDL`: wait for the previous kernel, then (RELEASE)
    let the next one be placed (its programs wait in turn, so nothing this kernel writes is read early).
    EARLY: let the next one be placed *before* waiting — a chain of such kernels is placed as far ahead as
    the SMs hold their programs, each one's pre-wait loads (weights) in flight while the ones before it
    wait and run; still safe, since every program's wait orders it after the kernel before, and that one's
    after its own."""
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
        if RELEASE and not EARLY:
            gdc_launch_dependents()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel be placed now (a long kernel calls it after its main loop, not at its start)."""
    if PDL:
        gdc_launch_dependents()


def pdl_args(device: torch.device) -> dict[str, bool]:
    """The launch arguments of a kernel that takes `PDL`: `{"PDL": False}`, or what the "pdl" layer gives
    where it applies (the constexpr and Triton's `launch_pdl` option together)."""
    layer = REGISTRY.select("pdl", device)
    return layer(device) if layer is not None else {"PDL": False}


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device ((0, 0) for any other device)."""
    if device.type != "cuda":
        return 0, 0
    return _capability(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def is_sm90(device: torch.device) -> bool:
    """Hopper (sm_90: H100, H200), where wgmma and TMA exist."""
    return capability(device) == (9, 0)


def tma_ready(t: torch.Tensor) -> bool:
    """TMA's rules: contiguous head_dim, 16-byte aligned base and row strides."""
    size = t.element_size()
    return (t.is_contiguous() and t.data_ptr() % 16 == 0
            and all(s * size % 16 == 0 for s in t.stride()[:-1]))
