"""The split-K Triton GEMV (nano_vllm.layers.gemv) under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 on a machine without CUDA), fp16 and fp32, against torch matmul.

Tolerance (FlashAttention's rule): our error against an fp64 reference is at most twice the error of torch's
own matmul in the same precision, plus a small epsilon. Outputs are poisoned with NaN first, so an element
the kernel never writes fails.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nano_vllm.layers import gemv
from nano_vllm.layers.gemv import (
    GemvConfig,
    GemvLinear,
    GemvWorkspace,
    default_config,
    gemv_reference,
    gemv_triton,
)


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _check(y: torch.Tensor, x, w, b) -> None:
    exact = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    ours = (y.double() - exact).abs().max().item()
    same_precision = (torch.nn.functional.linear(x, w, b).double() - exact).abs().max().item()
    eps = 1e-3 if x.dtype == torch.float16 else 1e-5
    assert not torch.isnan(y).any()
    assert ours <= 2 * same_precision + eps, (ours, same_precision)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_gemv_matches_torch_matmul(dtype, m, split_k):
    n, k = 48, 160  # N not a multiple of BLOCK_N, K not of BLOCK_K * SPLIT_K: masked edges everywhere
    x, w, b = _case(m, n, k, dtype, bias=split_k != 2)
    config = GemvConfig(block_n=16 if m == 1 else 32, block_k=32, split_k=split_k)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    workspace = GemvWorkspace(split_k * m * n, 8, x.device)
    y = gemv_triton(x, w, b, config=config, workspace=workspace, out=out)
    assert y is out
    _check(y, x, w, b)
    assert workspace.counters.eq(0).all()  # every column block's arrival counter is back at 0
    again = gemv_triton(x, w, b, config=config, workspace=workspace)  # the same workspace, reused
    torch.testing.assert_close(again, y, rtol=0, atol=0)  # deterministic: partials summed in split order


def _run(x, w, b, config: GemvConfig) -> torch.Tensor:
    """The kernel into a NaN-poisoned output with a reused workspace; checks the counters are reset."""
    m, n = x.shape[0], w.shape[0]
    out = torch.full((m, n), float("nan"), dtype=x.dtype)
    workspace = GemvWorkspace(config.split_k * m * n, -(-n // config.block_n), x.device)
    y = gemv_triton(x, w, b, config=config, workspace=workspace, out=out)
    assert workspace.counters.eq(0).all()
    return y


@pytest.mark.parametrize("config", [
    GemvConfig(4, 64, 1, num_stages=1),  # narrow column blocks, no pipeline
    GemvConfig(8, 32, 2, num_warps=8, num_stages=2),
    GemvConfig(16, 16, 4, num_stages=4),  # more stages than a slice has iterations
    GemvConfig(8, 512, 1),  # one tile longer than K: a single masked iteration
    GemvConfig(4, 64, 8),  # more slices than K has tiles: empty slices add zeros
])
@pytest.mark.parametrize("n,k", [(37, 200), (40, 128)])  # ragged N and K; then K a multiple of block_k
def test_gemv_m1_tiles_stages_and_ragged_edges(config, n, k):
    """M = 1: the (BLOCK_N, BLOCK_K) accumulator reduced after the loop, on every edge: rows past N (clamped
    onto row N - 1, never stored), a ragged last tile of K (masked) or none (EVEN_K, unmasked)."""
    x, w, b = _case(1, n, k, torch.float32, bias=config.split_k != 2, seed=n + k)
    y = _run(x, w, b, config)
    _check(y, x, w, b)
    torch.testing.assert_close(y, gemv_reference(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [GemvConfig(16, 16, 1, num_stages=1), GemvConfig(32, 64, 2, num_stages=4),
                                    GemvConfig(16, 256, 1, num_warps=8)])
def test_gemv_dot_path_stages_and_ragged_edges(config):
    """M = 2..16: rows past M and N clamped (never stored), K ragged or shorter than one tile."""
    x, w, b = _case(5, 37, 200, torch.float16, bias=True, seed=3)
    _check(_run(x, w, b, config), x, w, b)


def test_gemv_default_config_and_strided_rows():
    x, w, b = _case(5, 40, 96, torch.float32, bias=True, seed=1)
    wide = torch.zeros(5, 128)
    wide[:, :96] = x
    y = gemv_triton(wide[:, :96], w, b)  # rows with a stride larger than K
    _check(y, x, w, b)
    torch.testing.assert_close(gemv_reference(x, w, b), y, rtol=1e-5, atol=1e-5)


def test_default_config_splits_k_for_small_n():
    assert default_config(1, 256, 16384, 132).split_k == 8  # 32 column blocks of 8: split to the cap
    assert default_config(1, 256, 8192, 132).split_k == 4  # slices of at least 2 tiles cap it
    assert default_config(1, 1024, 8192, 132).split_k == 4  # 128 blocks: 512 programs, ≥ 3 per SM
    assert default_config(1, 4096, 4096, 132).split_k == 1  # 512 blocks fill the GPU without a split
    assert default_config(1, 151936, 1024, 132).split_k == 1  # an LM head fills the GPU by itself
    for m in (1, 16):
        for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)):
            c = default_config(m, n, k, 132)
            assert c.split_k in (1, 2, 4, 8) and k >= c.split_k * c.block_k


def test_default_config_takes_the_measured_table(monkeypatch):
    """A measured (N, K) entry wins at M = 1 on a GPU of the table's SM count; M > 1, other shapes and other
    GPUs take the rule."""
    measured = GemvConfig(4, 2048, 2, 8, 4)
    monkeypatch.setitem(gemv.MEASURED_M1, (4096, 4096), measured)
    default_config.cache_clear()
    try:
        assert default_config(1, 4096, 4096, gemv.MEASURED_M1_SMS) == measured
        assert default_config(16, 4096, 4096, gemv.MEASURED_M1_SMS) != measured
        assert default_config(1, 4096, 4096, gemv.MEASURED_M1_SMS + 1) != measured
        assert default_config(1, 6144, 4096, gemv.MEASURED_M1_SMS) != measured
    finally:
        default_config.cache_clear()


@pytest.mark.parametrize("kwargs,match", [
    ({"block_n": 12, "block_k": 64}, "block_n must be a power of two"),
    ({"block_n": 16, "block_k": 0}, "block_k must be a power of two"),
    ({"block_n": 16, "block_k": 64, "num_warps": 3}, "num_warps must be a power of two"),
    ({"block_n": 16, "block_k": 64, "split_k": 0}, "split_k must be an int >= 1"),
    ({"block_n": 16, "block_k": 64, "num_stages": 0}, "num_stages must be an int >= 1"),
])
def test_gemv_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GemvConfig(**kwargs)


def test_gemv_errors():
    x, w, _ = _case(2, 16, 32, torch.float32, bias=False)
    with pytest.raises(ValueError, match="1..16 rows"):
        gemv_triton(torch.zeros(17, 32), w)
    with pytest.raises(ValueError, match="agree on K"):
        gemv_triton(x, torch.zeros(16, 33))
    with pytest.raises(ValueError, match="out must be"):
        gemv_triton(x, w, out=torch.zeros(2, 15))
    with pytest.raises(ValueError, match="block_n and block_k >= 16"):
        gemv_triton(x, w, config=GemvConfig(8, 64))  # two rows take tl.dot


def test_gemv_linear_keeps_the_module_and_falls_back_off_cuda():
    """The layer swaps nn.Linear in place: same parameters and state-dict names; on a CPU (or above
    max_rows) it is F.linear."""
    lin = nn.Linear(32, 24)
    weight, names = lin.weight, list(lin.state_dict())
    x = torch.randn(3, 1, 32)
    ref = lin(x)
    GemvLinear.swap(lin, max_rows=16, workspace=None)
    assert isinstance(lin, GemvLinear) and lin.weight is weight and list(lin.state_dict()) == names
    torch.testing.assert_close(lin(x), ref, rtol=0, atol=0)
