"""Host-side helpers for launching the Triton kernels cheaply.

`cdiv` / `next_pow2` are nano_flashattn's host-side replacements for `triton.cdiv` / `triton.next_power_of_2`,
which in recent Triton also work inside kernels and cost microseconds per host call: an eager model step
launches a few hundred kernels, so such Python is the step's time on a fast GPU (nano_distserve's
interference profile in BENCHMARKS.md: ~4.5 ms of GPU work in a ~30 ms eager step).
"""

from __future__ import annotations

import torch

from nano_flashattn.checks import cdiv, next_pow2

__all__ = ["cdiv", "needs_grad", "next_pow2"]


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd must see this call: grad mode on and some input requires grad. When not (inference,
    `torch.no_grad()`), the wrappers call the forward directly and skip torch.autograd.Function's cost."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
