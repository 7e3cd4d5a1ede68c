"""Host-side helpers for launching the Triton kernels cheaply.

Why not `triton.cdiv` / `triton.next_power_of_2`: in recent Triton they are wrapped to work inside kernels
too and cost microseconds per host call; an eager model step launches a few hundred kernels, so the
wrappers' Python time is the step's time on a fast GPU (nano_distserve's interference profile in
BENCHMARKS.md: ~4.5 ms of GPU work in a ~30 ms eager step).
"""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd must see this call: grad mode on and some input requires grad. When not (inference,
    `torch.no_grad()`), the wrappers call the forward directly and skip torch.autograd.Function's cost."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
