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

Flash-Decoding's kernels (decode.py, the paper path) take no `PDL`: a layer that registers a decode
launcher may launch a PDL variant of them.

This layer registers at the "pdl" point for CUDA devices of compute capability 9.0 or more, with a Triton
that has grid dependency control; `disable()` (or `performance_layers(False)`) turns it off for an A/B run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..dispatch import REGISTRY
from ..launch import HAS_PDL, capability


def applies(device: torch.device) -> bool:
    """CUDA, Hopper or later, and a Triton that can emit the grid-dependency instructions."""
    return HAS_PDL and device.type == "cuda" and capability(device)[0] >= 9


def launch_args(device: torch.device) -> dict[str, bool]:
    """The constexpr and Triton's launch option of a kernel launched with PDL."""
    return {"PDL": True, "launch_pdl": True}


def enable() -> Callable[[], None]:
    """Launch with PDL where `applies` (on import); returns `disable`."""
    REGISTRY.register("pdl", launch_args, applies)
    return disable


def disable() -> None:
    """Every kernel launches without PDL."""
    REGISTRY.remove("pdl", __name__)


def enabled() -> bool:
    return REGISTRY.registered("pdl", __name__)


enable()
