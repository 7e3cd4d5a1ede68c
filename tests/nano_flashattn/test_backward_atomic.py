"""nano_flashattn.backward_atomic, the one-kernel backward with atomic dQ, against the fp64 torch reference
(FlashAttention's error rule, `fa_check`), through the dispatch point it registers into.

On CPU the kernel runs under TRITON_INTERPRET=1 on 16-row tiles, fp16 and fp32: dense and packed batches,
causal, non-causal and sliding windows, seqlen_q above and below seqlen_k (rows that see no key, key tiles
past the sequence end), GQA with and without K/V expansion, head_dim 64 and the padded 40 and 96. The
descriptor flavour runs where the interpreter has tensor-descriptor atomics (skipped otherwise); the `gpu`
tests compile both flavours in bf16 with the default configs."""

from __future__ import annotations

import pytest
import torch
from test_flashattn_dense import _inputs, _run_and_compare
from test_flashattn_varlen_decode import _compare_varlen

import nano_flashattn as fa
from nano_flashattn import backward_atomic as ba
from nano_flashattn import interface
from nano_flashattn.backward_atomic import AtomicBackwardConfig, atomic_backward
from nano_flashattn.interface import PAPER_KERNELS, run_kernel

# A performance layer's interpreter tests: run from the repository, left out of a fork of the package.
pytestmark = pytest.mark.slow

CPU = {atomic: AtomicBackwardConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, atomic=atomic)
       for atomic in ba.ATOMICS}


def _flavour_runs_here(atomic: str, device: str = "cpu") -> None:
    if atomic != "descriptor":
        return
    try:
        ba._check_descriptor_support(torch.device(device))
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture
def layer_for():
    """Register atomic_backward (with a config) for every backward call; after the test, assert it ran."""
    removes, calls = [], []

    def launch(config, **arguments):
        calls.append(config)
        return atomic_backward(**arguments, config=config)

    def register(config: AtomicBackwardConfig | None = None) -> None:
        removes.append(fa.register_kernel("backward", lambda **a: launch(config, **a)))

    yield register
    for remove in removes:
        remove()
    assert calls or not removes, "the layer never ran"


# (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window)
CASES = [
    (2, 37, 53, 4, 1, 64, False, (-1, -1)),  # odd lengths, seqlen_q < seqlen_k, GQA 4, last key tile partial
    (1, 53, 37, 4, 2, 64, True, (-1, -1)),  # seqlen_q > seqlen_k: the first rows see no key
    (1, 40, 40, 2, 2, 40, False, (7, 3)),  # local window (masked runs on both sides), padded head_dim
    (1, 30, 45, 2, 1, 96, True, (10, -1)),  # sliding window + causal, padded head_dim 96
]


@pytest.mark.parametrize("atomic", ba.ATOMICS)
@pytest.mark.parametrize("case", CASES)
def test_fwd_bwd_fp16(fa_check, layer_for, atomic, case):
    _flavour_runs_here(atomic)
    layer_for(CPU[atomic])
    _run_and_compare(fa_check, *case[:5], case[5], torch.float16, case[6], case[7], device="cpu")


def test_fp32_and_default_config(fa_check, layer_for):
    layer_for(None)  # the interpreter's default tiles
    _run_and_compare(fa_check, 1, 20, 30, 2, 1, 64, torch.float32, True, (-1, -1), device="cpu")


def test_keys_past_the_sequence_end_add_nothing_to_dq(layer_for):
    """Scores all near -32 make L very negative, so a zero-filled key row past the sequence end would have
    P = exp(-L) ~ 1e13 (inf in fp16) and poison dQ unless the key tile's query tiles are masked."""
    g = torch.Generator().manual_seed(0)
    q = (2 + 0.1 * torch.randn(1, 24, 2, 64, generator=g)).half()
    k = (-2 + 0.1 * torch.randn(1, 21, 2, 64, generator=g)).half()
    v, do = torch.randn(1, 21, 2, 64, generator=g).half(), torch.randn(1, 24, 2, 64, generator=g).half()
    layer_for(CPU["pointer"])
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    grads = torch.autograd.grad(fa.flash_attn_func_triton(qq, kk, vv), (qq, kk, vv), do)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(fa.flash_attn_func_torch(*ref), ref, do.double())
    for name, ours, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.isfinite(ours).all(), name
        torch.testing.assert_close(ours.double(), r, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("expand_waves", [0, 1 << 20])
def test_gqa_both_paths(fa_check, layer_for, monkeypatch, expand_waves):
    """kv-head programs looping over their query heads (0: never expand) and K/V expanded per query head
    (always expand): dQ rows of every query head come from the atomics either way."""
    from nano_flashattn import configs

    monkeypatch.setattr(configs, "GQA_EXPAND_WAVES", expand_waves)
    layer_for(CPU["pointer"])
    _run_and_compare(fa_check, 1, 40, 40, 8, 2, 64, torch.float16, True, (-1, -1), device="cpu")


@pytest.mark.parametrize("atomic", ba.ATOMICS)
def test_varlen(fa_check, layer_for, atomic):
    """Packed sequences, empty and length-1 ones on both sides: no dQ partial crosses a sequence boundary
    (the poisoned dK/dV would show an unwritten row, a wrong neighbour a wrong value)."""
    _flavour_runs_here(atomic)
    layer_for(CPU[atomic])
    _compare_varlen(fa_check, [0, 1, 17, 5, 3], [3, 1, 20, 9, 0], 4, 2, 64, torch.float16, True, device="cpu")


def test_enable_round_trip_through_flash_attn_func():
    """enable(): flash_attn_func_triton's backward runs the layer (CPU fp16 is one of its calls);
    disable() hands it back to the paper path. The interpreter runs the atomics in order, so both
    results are exact copies of the launchers' own."""
    q, k, v, do = _inputs(1, 24, 24, 2, 1, 64, torch.float16, "cpu")

    def grads():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(fa.flash_attn_func_triton(qq, kk, vv, causal=True), (qq, kk, vv), do)

    out, lse = fa.flash_attn_func_triton(q, k, v, causal=True, return_lse=True)
    arguments = dict(do=do[0], q=q[0], k=k[0], v=v[0], out=out[0], lse=lse[0], batch=1, seqlen_q=24,
                     seqlen_k=24, cu_seqlens_q=None, cu_seqlens_k=None, scale=64**-0.5, window_left=1 << 30,
                     window_right=0)
    before = len(interface._LAYERS["backward"])
    remove = ba.enable()
    ba.enable(CPU["pointer"])  # enabling again replaces, never stacks
    try:
        assert len(interface._LAYERS["backward"]) == before + 1 and ba.applies(**arguments)
        ours = atomic_backward(**arguments)
        assert all(torch.equal(a, b.view_as(a)) for a, b in zip(ours, grads()))
        assert all(torch.equal(a, b) for a, b in zip(run_kernel("backward", **arguments), ours))
    finally:
        remove()
    assert len(interface._LAYERS["backward"]) == before
    paper = PAPER_KERNELS["backward"](**arguments)
    assert all(torch.equal(a, b.view_as(a)) for a, b in zip(paper, grads()))
    ba.disable()  # twice: harmless


def test_applies():
    q = torch.zeros(4, 2, 64, dtype=torch.float16)
    assert ba.applies(q=q, k=q, v=q)
    wide = torch.zeros(4, 2, 256, dtype=torch.float16)
    assert not ba.applies(q=wide, k=wide, v=wide)  # head_dim > 128: the paper path
    assert not ba.applies(q=q, k=q.float(), v=q)
    assert not ba.applies(q=q.bfloat16(), k=q.bfloat16(), v=q.bfloat16())  # the interpreter's bf16 is wrong


def test_empty_batch():
    q = torch.zeros(0, 2, 64, dtype=torch.float16)
    dq, dk, dv = atomic_backward(q, q, q, q, q, torch.zeros(2, 0), 0, 0, 0, None, None, 0.125, 1 << 30, 0)
    assert dq.shape == dk.shape == dv.shape == q.shape


def test_bad_arguments():
    q = torch.zeros(8, 2, 64, dtype=torch.float16)
    args = dict(batch=1, seqlen_q=8, seqlen_k=8, cu_seqlens_q=None, cu_seqlens_k=None, scale=0.125,
                window_left=1 << 30, window_right=0)
    lse = torch.zeros(2, 8)
    wide = torch.zeros(8, 2, 256, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^head_dim must be a multiple of 8 from 16 to 128 for the atomic "
                                         r"backward, got 256"):
        atomic_backward(wide, wide, wide, wide, wide, lse, **args)
    with pytest.raises(TypeError, match=r"^config must be an AtomicBackwardConfig, got tuple"):
        atomic_backward(q, q, q, q, q, lse, config=(64, 128, 8, 2), **args)
    with pytest.raises(TypeError, match=r"^config must be an AtomicBackwardConfig or None, got dict"):
        ba.enable({"block_m": 64})
    with pytest.raises(ValueError, match=r"^AtomicBackwardConfig.block_m must be a positive power of two, "
                                         r"got 48"):
        AtomicBackwardConfig(block_m=48)
    with pytest.raises(ValueError, match=r"^AtomicBackwardConfig: block_m and block_n must be >= 16"):
        AtomicBackwardConfig(block_n=8)
    with pytest.raises(ValueError, match=r"^AtomicBackwardConfig.num_stages must be a positive int, got 0"):
        AtomicBackwardConfig(num_stages=0)
    with pytest.raises(ValueError, match=r"^AtomicBackwardConfig.atomic must be one of \('pointer', "
                                         r"'descriptor'\), got 'tma'"):
        AtomicBackwardConfig(atomic="tma")


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("atomic", ba.ATOMICS)
@pytest.mark.parametrize("d", [64, 96, 128])
def test_gpu_bf16(fa_check, layer_for, atomic, d):
    """The default tiles of each head width in bf16 (fp16 too at 128): causal GQA with ragged lengths, a
    local window with seqlen_q > seqlen_k, packed sequences."""
    if atomic == "descriptor" and not _sm90():
        pytest.skip("TMA reduce-add needs sm_90")
    _flavour_runs_here(atomic, "cuda")
    cfg = ba.default_config(d, torch.device("cuda"))
    layer_for(AtomicBackwardConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, atomic))
    _run_and_compare(fa_check, 2, 300, 333, 4, 2, d, torch.bfloat16, True, (-1, -1), device="cuda")
    _run_and_compare(fa_check, 1, 200, 150, 2, 1, d, torch.bfloat16, False, (40, 8), device="cuda")
    _run_and_compare(fa_check, 1, 1000, 1000, 4, 4, d, torch.float16, False, (-1, -1), device="cuda")
    _compare_varlen(fa_check, [0, 1, 200, 129], [5, 1, 300, 129], 8, 2, d, torch.bfloat16, True,
                    device="cuda")
