"""nano_flashattn.layers.hopper, the Hopper forward and backward layers, against the fp64 torch reference (FlashAttention's error
rule, `fa_check`), through the dispatch point it registers into.

On CPU the kernel runs under TRITON_INTERPRET=1, whose tensor descriptors read zeros past a descriptor's
shape and clip stores at it as TMA does, so the TMA load path and the pointer-load path (`use_tma=False`)
are both tested here, in fp16 on 16-row tiles. The `gpu` tests compile it on an sm_90 GPU in bf16 and fp16
with the default configs and the other knobs; warp specialisation is compiled and checked by
tools/flashattn_hopper_probe.py, which reports a Triton that cannot build it instead of failing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_flashattn_dense import _inputs, _run_and_compare

import nano_flashattn as fa
from nano_flashattn import REGISTRY
from nano_flashattn.interface import PAPER_KERNELS, run_kernel
from nano_flashattn.layers import hopper
from nano_flashattn.layers.hopper import HopperConfig, hopper_backward, hopper_forward

# A performance layer's interpreter tests: run from the repository, left out of a fork of the package.
pytestmark = pytest.mark.slow

CPU_CONFIGS = {
    "tma": hopper.INTERPRETER_CONFIG,
    "split_m": HopperConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, split_m=True),
    "pointer": HopperConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, use_tma=False),
    # one loop, masks on every tile: the warp-specialised form (the interpreter ignores the warp split)
    "one_loop": HopperConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, two_phase=False,
                             warp_specialize=True),
}


@pytest.fixture
def layer_for():
    """Register hopper_forward (with a config) for every forward call, as `enable` does on sm_90; after the
    test, assert that it ran."""
    removes, calls = [], []

    def launch(config, **arguments):
        calls.append(config)
        return hopper_forward(**arguments, config=config)

    def register(config: HopperConfig | None = None) -> None:
        removes.append(REGISTRY.register("forward", lambda **a: launch(config, **a)))

    yield register
    for remove in removes:
        remove()
    assert calls, "the layer never ran"


# (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window)
CASES = [
    (2, 37, 53, 4, 1, 64, False, (-1, -1)),  # odd lengths, seqlen_q < seqlen_k, GQA 4
    (1, 53, 37, 4, 2, 64, True, (-1, -1)),  # seqlen_q > seqlen_k: the first rows see no key
    (1, 40, 40, 2, 2, 64, False, (7, 3)),  # local window: masked runs on both sides
    (1, 19, 19, 2, 2, 128, True, (-1, -1)),  # head_dim 128, one tile past the sequence end
    (2, 37, 29, 4, 2, 96, True, (-1, -1)),  # head_dim 96: two parts (64 + 32), seqlen_q > seqlen_k
]


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_through_the_layer(fa_check, layer_for, case):
    """The layer's out and LSE feed the paper path's backward: both must match fp64."""
    layer_for(CPU_CONFIGS["tma"])
    _run_and_compare(fa_check, *case[:5], case[5], torch.float16, case[6], case[7])


@pytest.mark.parametrize("name", ["split_m", "pointer", "one_loop"])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4]])
def test_split_m_and_pointer_loads(fa_check, layer_for, name, case):
    layer_for(CPU_CONFIGS[name])
    _run_and_compare(fa_check, *case[:5], case[5], torch.float16, case[6], case[7], backward=False)


def _varlen_check(fa_check, lens, hq, hk, d, dtype, causal, device):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k, v, _ = _inputs(1, sum(lens), sum(lens), hq, hk, d, dtype, device)
    out, lse = fa.flash_attn_varlen_func_triton(q[0], k[0], v[0], cu, cu, max(lens), max(lens), causal=causal,
                                               return_lse=True)
    for i, n in enumerate(lens):
        rows = slice(int(cu[i]), int(cu[i]) + n)
        one = [t[:, rows] for t in (q, k, v)]
        ref, ref_lse = fa.flash_attn_func_torch(*[t.double() for t in one], causal=causal, return_lse=True)
        low, low_lse = fa.flash_attn_func_torch(*one, causal=causal, return_lse=True)
        fa_check(f"out[{i}]", out[rows][None], low, ref)
        fa_check(f"lse[{i}]", lse[:, rows][None], low_lse, ref_lse)


@pytest.mark.parametrize("name", ["tma", "split_m", "one_loop"])
def test_varlen(fa_check, layer_for, name):
    """Packed sequences: each descriptor ends at its sequence's end, so no row of a neighbour is read or
    written (the poisoned output would show an unwritten row, a wrong neighbour a wrong value)."""
    layer_for(CPU_CONFIGS[name])
    _varlen_check(fa_check, [13, 1, 30], 2, 1, 64, torch.float16, True, "cpu")
    _varlen_check(fa_check, [13, 1, 30], 2, 1, 96, torch.float16, False, "cpu")


def test_enable_registers_for_the_calls_it_applies_to():
    """On CPU tensors `applies` is False: after enable() the paper path still runs them; disable() removes."""
    q, k, v, _ = _inputs(1, 20, 20, 2, 2, 64, torch.float16, "cpu")
    arguments = dict(q=q[0], k=k[0], v=v[0], batch=1, seqlen_q=20, seqlen_k=20, cu_seqlens_q=None,
                     cu_seqlens_k=None, block_table=None, scale=0.125, window_left=1 << 30, window_right=0)
    assert REGISTRY.layers("forward") == []  # the conftest cleared the registry for this test
    remove = hopper.enable()
    hopper.enable(HopperConfig(num_stages=3))  # enabling again replaces, never stacks
    try:
        assert hopper.enabled() and len(REGISTRY.layers("forward")) == 1
        # the config given: every head_dim the kernel takes; enable() alone: where it measured faster
        assert REGISTRY.layers("forward")[0].applies.keywords["head_dims"] == hopper.HEAD_DIMS
        hopper.enable()
        assert REGISTRY.layers("forward")[0].applies.keywords["head_dims"] == hopper.ENABLED_HEAD_DIMS
        assert not hopper.applies(**arguments)
        out, lse = run_kernel("forward", **arguments)
        ref_out, ref_lse = PAPER_KERNELS["forward"](**arguments)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    finally:
        remove()
    assert not hopper.enabled() and REGISTRY.layers("forward") == []
    hopper.disable()  # twice: harmless


def test_tuple_config_is_the_paper_paths_tile_format():
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), what the config sweep passes, is that HopperConfig."""
    q, k, v, _ = _inputs(1, 40, 40, 2, 2, 96, torch.float16, "cpu")
    args = dict(q=q[0], k=k[0], v=v[0], batch=1, seqlen_q=40, seqlen_k=40, cu_seqlens_q=None, cu_seqlens_k=None,
                block_table=None, scale=96 ** -0.5, window_left=1 << 30, window_right=0)
    got = hopper_forward(config=(32, 16, 4, 1), **args)
    ref = hopper_forward(config=HopperConfig(block_m=32, block_n=16, num_warps=4, num_stages=1), **args)
    assert all(torch.equal(g, r) for g, r in zip(got, ref))


def test_bad_arguments():
    q = torch.zeros(8, 2, 64, dtype=torch.float16)
    args = dict(batch=1, seqlen_q=8, seqlen_k=8, cu_seqlens_q=None, cu_seqlens_k=None, scale=0.125,
                window_left=1 << 30, window_right=0)
    with pytest.raises(ValueError, match=r"^block_table: the Hopper forward reads contiguous K/V only"):
        hopper_forward(q, q, q, block_table=torch.zeros(1, 1, dtype=torch.int32), **args)
    q80 = torch.zeros(8, 2, 80, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^head_dim must be one of \(64, 96, 128\) for the Hopper forward, "
                                         r"got 80"):
        hopper_forward(q80, q80, q80, block_table=None, **args)
    with pytest.raises(TypeError, match=r"^config must be a HopperConfig or a \(BLOCK_M, BLOCK_N, num_warps, "
                                        r"num_stages\) tuple, got dict"):
        hopper_forward(q, q, q, block_table=None, config={"block_m": 128}, **args)
    with pytest.raises(TypeError, match=r"^config must be a HopperConfig or None, got dict"):
        hopper.enable({"block_m": 128})
    with pytest.raises(ValueError, match=r"^HopperConfig.block_n must be a positive power of two, got 96"):
        HopperConfig(block_n=96)
    with pytest.raises(ValueError, match=r"^HopperConfig.num_stages must be a positive int, got 0"):
        HopperConfig(num_stages=0)
    with pytest.raises(ValueError, match=r"^HopperConfig: block_m >= 32 and block_n >= 16"):
        HopperConfig(block_m=16, split_m=True)


@pytest.fixture
def backward_layer():
    """Register hopper_backward (TMA loads, or pointer loads) for every backward call; after the test,
    assert that it ran."""
    removes, calls = [], []

    def register(use_tma: bool = True) -> None:
        def launch(**arguments):
            calls.append(arguments["q"].shape[-1])
            return hopper_backward(**arguments, use_tma=use_tma)

        removes.append(REGISTRY.register("backward", launch))

    yield register
    for remove in removes:
        remove()
    assert calls, "the layer never ran"


BACKWARD_CASES = [
    (2, 37, 53, 4, 1, 64, False, (-1, -1)),  # GQA 4, seqlen_q < seqlen_k
    (1, 53, 37, 4, 2, 96, True, (-1, -1)),  # the split head axis (64 + 32); rows that see no key
    (1, 40, 40, 2, 2, 96, False, (7, 3)),  # local window: masked runs on both sides
    (1, 19, 19, 2, 2, 128, True, (-1, -1)),  # head_dim 128, one tile past the sequence end
]


@pytest.mark.parametrize("case,use_tma",
                         [(case, True) for case in BACKWARD_CASES] + [(BACKWARD_CASES[1], False)])
def test_backward_layer(fa_check, backward_layer, case, use_tma):
    """dQ, dK, dV of the layer against fp64 (the forward is the paper path's)."""
    backward_layer(use_tma)
    _run_and_compare(fa_check, *case[:5], case[5], torch.float16, case[6], case[7])


def test_backward_layer_varlen_equals_the_paper_path():
    """Packed sequences: per-sequence descriptors read no neighbour's rows; the sums run in the paper path's
    order, so the gradients are bit-identical to it (one power-of-two part)."""
    lens = [13, 1, 30]
    cu = torch.tensor([0, 13, 14, 44], dtype=torch.int32)
    q, k, v, do = (t[0] for t in _inputs(1, 44, 44, 4, 2, 64, torch.float16, "cpu"))
    args = dict(q=q, k=k, v=v, batch=3, seqlen_q=max(lens), seqlen_k=max(lens), cu_seqlens_q=cu,
                cu_seqlens_k=cu, scale=0.125, window_left=1 << 30, window_right=0)
    out, lse = PAPER_KERNELS["forward"](block_table=None, **args)
    expected = PAPER_KERNELS["backward"](do=do, out=out, lse=lse, **args)
    for got, want in zip(hopper_backward(do=do, out=out, lse=lse, **args), expected, strict=True):
        assert torch.equal(got, want)


def test_enable_backward_registers_for_the_calls_it_applies_to():
    q, k, v, do = (t[0] for t in _inputs(1, 20, 20, 2, 2, 64, torch.float16, "cpu"))
    remove = hopper.enable_backward()
    hopper.enable_backward()  # enabling again replaces, never stacks
    try:
        assert hopper.backward_enabled() and len(REGISTRY.layers("backward")) == 1
        assert not hopper.backward_applies(q=q, k=k, v=v, do=do)  # CPU tensors: the paper path
    finally:
        remove()
    assert not hopper.backward_enabled() and REGISTRY.layers("backward") == []
    hopper.disable_backward()  # twice: harmless


def test_backward_bad_arguments():
    args = dict(batch=1, seqlen_q=8, seqlen_k=8, cu_seqlens_q=None, cu_seqlens_k=None, scale=0.125,
                window_left=1 << 30, window_right=0)
    q80 = torch.zeros(8, 2, 80, dtype=torch.float16)
    lse = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"^head_dim must be one of \(64, 96, 128\) for the Hopper backward, "
                                         r"got 80"):
        hopper_backward(q80, q80, q80, q80, q80, lse, **args)
    q32 = torch.zeros(8, 2, 64)
    with pytest.raises(ValueError,
                       match=r"^q.dtype must be one of .* for the Hopper backward, got torch.float32"):
        hopper_backward(q32, q32, q32, q32, q32, lse, **args)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Hopper forward needs sm_90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", hopper.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_enabled_forward(fa_check, dtype, d, causal):
    """enable(): flash_attn_func runs the layer on sm_90 (default configs; head_dim 64, which enable() leaves
    to the paper path, with its config given), backward through its LSE."""
    remove = hopper.enable(None if d in hopper.ENABLED_HEAD_DIMS else hopper.DEFAULT_CONFIGS[d])
    try:
        q, k, v, _ = _inputs(1, 8, 8, 2, 2, d, dtype, "cuda")
        assert hopper.applies(q=q, k=k, v=v, block_table=None)
        _run_and_compare(fa_check, 2, 300, 333, 4, 2, d, dtype, causal, (-1, -1), device="cuda")
        _run_and_compare(fa_check, 1, 1000, 1000, 4, 4, d, dtype, causal, (-1, -1), backward=False,
                         device="cuda")
        _varlen_check(fa_check, [700, 1, 130, 257], 4, 2, d, dtype, causal, "cuda")
    finally:
        remove()


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Hopper forward needs sm_90")
@pytest.mark.parametrize("config", [HopperConfig(split_m=True, block_n=64), HopperConfig(use_tma=False),
                                    HopperConfig(block_n=64, num_stages=3), HopperConfig(two_phase=False)],
                         ids=["split_m", "pointer", "n64", "one_loop"])
def test_gpu_configs(fa_check, layer_for, config):
    layer_for(config)
    _run_and_compare(fa_check, 1, 777, 901, 4, 1, 128, torch.bfloat16, True, (-1, -1), backward=False,
                     device="cuda")
    _run_and_compare(fa_check, 1, 500, 500, 4, 4, 128, torch.bfloat16, False, (100, 30), backward=False,
                     device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Hopper backward needs sm_90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", sorted(hopper.BWD_CONFIGS))
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_enabled_backward(fa_check, dtype, d, causal):
    """enable_backward(): flash_attn_func's backward runs the layer on sm_90 (default configs), dense with
    GQA, a window, and packed sequences."""
    remove = hopper.enable_backward()
    try:
        q, k, v, do = _inputs(1, 8, 8, 2, 2, d, dtype, "cuda")
        assert hopper.backward_applies(q=q[0], k=k[0], v=v[0], do=do[0])
        _run_and_compare(fa_check, 2, 300, 333, 4, 2, d, dtype, causal, (-1, -1), device="cuda")
        _run_and_compare(fa_check, 1, 500, 500, 4, 4, d, dtype, causal, (100, 30), device="cuda")
        lens = [700, 1, 130, 257]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q, k, v, do = (t[0] for t in _inputs(1, sum(lens), sum(lens), 4, 2, d, dtype, "cuda"))
        args = dict(q=q, k=k, v=v, batch=4, seqlen_q=max(lens), seqlen_k=max(lens), cu_seqlens_q=cu,
                    cu_seqlens_k=cu, scale=d**-0.5, window_left=1 << 30,
                    window_right=0 if causal else 1 << 30)
        out, lse = PAPER_KERNELS["forward"](block_table=None, **args)
        # the same sums in the same order as the pointer-load kernels: 96 as split_head's two parts
        from nano_flashattn.layers.split_head import split_backward

        expected = (split_backward if d == 96 else PAPER_KERNELS["backward"])(do=do, out=out, lse=lse, **args)
        got = run_kernel("backward", do=do, out=out, lse=lse, **args)
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)
    finally:
        remove()


def _host_vs_device(d: int, dtype, device: str, batch: int, seqlen: int, heads: tuple[int, int], causal: bool,
                    **configs):
    """Forward and backward of a dense batch whose lengths are whole tiles, with descriptors made once on
    the host and made by every program: the same tiles at the same places, so the same bits."""
    q, k, v, do = (t[0] for t in _inputs(1, batch * seqlen, batch * seqlen, *heads, d, dtype, device))
    args = dict(q=q, k=k, v=v, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, cu_seqlens_q=None,
                cu_seqlens_k=None, scale=d**-0.5, window_left=1 << 30, window_right=0 if causal else 1 << 30)
    fwd = configs.get("forward") or (hopper.INTERPRETER_CONFIG if device == "cpu" else hopper.DEFAULT_CONFIGS[d])
    host = hopper_forward(block_table=None, config=fwd, **args)
    per_program = hopper_forward(block_table=None, config=dataclasses.replace(fwd, host_descriptors=False), **args)
    for got, want in zip(host, per_program, strict=True):
        assert torch.equal(got, want)
    out, lse = host
    host = hopper_backward(do=do, out=out, lse=lse, **args)
    per_program = hopper_backward(do=do, out=out, lse=lse, host_descriptors=False, **args)
    for got, want in zip(host, per_program, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("d,causal", [(64, True), (96, False), (128, True)])
def test_host_descriptors_equal_per_program_descriptors(d, causal):
    _host_vs_device(d, torch.float16, "cpu", 2, 32, (4, 2), causal)


@pytest.mark.skipif(not hopper.HAS_HOST_DESCRIPTORS, reason="this Triton has no host TensorDescriptor")
def test_host_descriptors_apply_to_dense_whole_tiles_up_to_the_bound(monkeypatch):
    """Where host-made descriptors apply: dense batches of whole tiles up to HOST_DESCRIPTORS_UP_TO keys, any
    length with any_length (head_dim 64's forward), none at all when the bound is 0 (the bench's switch)."""
    monkeypatch.setattr(hopper, "HOST_DESCRIPTORS_UP_TO", 32)
    t = torch.zeros(64, 2, 64, dtype=torch.float16)

    def made(seqlen, any_length=False, cu=None, tile=16):
        return sorted(hopper._host_descs(True, cu, (seqlen, tile), (seqlen, tile), 64, 0, any_length=any_length,
                                         QD=(t, tile)))

    assert made(32) == ["QD0"] and made(64) == [] and made(64, any_length=True) == ["QD0"]
    assert made(24) == [] and made(32, cu=torch.zeros(2, dtype=torch.int32)) == []  # partial tiles, varlen
    assert hopper._host_descs(False, None, (32, 16), (32, 16), 64, 0, QD=(t, 16)) == {}
    monkeypatch.setattr(hopper, "HOST_DESCRIPTORS_UP_TO", 0)
    assert made(32) == [] and made(64, any_length=True) == []
    assert hopper.HOST_DESCRIPTORS_ANY_LENGTH == (64,)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="TMA descriptors need sm_90")
@pytest.mark.parametrize("d", hopper.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_host_descriptors_equal_per_program_descriptors(d, causal):
    _host_vs_device(d, torch.bfloat16, "cuda", 2, 1024, (8, 2), causal)
