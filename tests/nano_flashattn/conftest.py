"""Fixtures for the nano_flashattn tests.

* `poison`: every tensor the kernels allocate with torch.empty / empty_like starts as NaN (floats) or
  a huge value (ints), so an output element no program wrote fails the comparison.
* `paper_path`: no performance layer is registered when a test starts (so these tests test the paper path);
  a layer's own tests register it inside the test (its `enable()`), and the registrations come back after.
* `fa_check`: FlashAttention's error rule (flash-attn's tests): our error against the fp64 oracle must
  be at most twice the error of the same reference computed in the low precision, plus a rounding eps.
"""

from __future__ import annotations

import pytest
import torch

_empty, _empty_like = torch.empty, torch.empty_like


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max // 2) if t.numel() else t


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: _poisoned(_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: _poisoned(_empty_like(*a, **kw)))


@pytest.fixture(autouse=True)
def paper_path():
    """Every test starts on the paper path: the layers registered on import (dispatch.REGISTRY) are taken
    out for the test and put back after it. Its value: those registrations (`REGISTRY.restore(paper_path)`
    gives a test the default dispatch)."""
    from nano_flashattn import REGISTRY

    saved = REGISTRY.snapshot()
    REGISTRY.restore({})
    yield saved
    REGISTRY.restore(saved)


def _err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    both_inf = torch.isinf(x) & torch.isinf(ref) & (x == ref)  # LSE of a query that sees no key: -inf
    return (torch.where(both_inf, 0.0, x - ref)).abs().max().item() if x.numel() else 0.0


@pytest.fixture
def fa_check():
    def check(name: str, ours: torch.Tensor, low: torch.Tensor, ref: torch.Tensor, slack: float = 0.0):
        """ours, low (reference in the same low precision) and ref (fp64) must have one shape."""
        assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
        assert not torch.isnan(ours).any(), f"{name}: NaN (an unwritten element?)"
        err, low_err = _err(ours, ref), _err(low, ref)
        # eps: rounding of values of this magnitude in the output dtype (flash-attn's fwd_atol)
        finite = ref[torch.isfinite(ref)]
        scale = finite.abs().max().item() if finite.numel() else 0.0
        eps = 2 * torch.finfo(ours.dtype).eps * scale + 1e-6 + slack
        assert err <= 2 * low_err + eps, f"{name}: error {err:.3g} > 2 x {low_err:.3g} + {eps:.3g}"
        return err, low_err

    return check
