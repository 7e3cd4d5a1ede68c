"""The dispatch point performance layers register into (dispatch.REGISTRY, `interface.run_kernel`): a layer
runs the calls its predicate accepts, the paper path the rest; the default dispatch on Hopper, shape by
shape, with the device's capability pretended (no GPU needed); and the layout rule that nothing packaged
imports the repository's tools/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import nano_flashattn as fa
from nano_flashattn import REGISTRY, launch
from nano_flashattn.checks import NO_WINDOW
from nano_flashattn.interface import PAPER_KERNELS

ROOT = Path(__file__).resolve().parents[2]


def _recording_layer(kind: str, calls: list):
    """A stand-in layer: records the call, then runs the paper path's launcher (same results)."""

    def launch(**arguments):
        calls.append(arguments)
        return PAPER_KERNELS[kind](**arguments)

    return launch


def test_a_registered_forward_and_backward_run_where_they_apply():
    q, k, v = (torch.randn(1, 20, 2, 32, dtype=torch.float16) for _ in range(3))
    ref = fa.flash_attn_func_triton(q, k, v, causal=True)
    fwd, bwd = [], []
    remove_fwd = REGISTRY.register("forward", _recording_layer("forward", fwd),
                                   applies=lambda **a: a["window_right"] == 0)  # causal calls only
    remove_bwd = REGISTRY.register("backward", _recording_layer("backward", bwd))
    try:
        qq = q.clone().requires_grad_()
        out = fa.flash_attn_func_triton(qq, k, v, causal=True)
        out.sum().backward()
        assert torch.equal(out, ref) and len(fwd) == 1 and len(bwd) == 1
        assert fwd[0]["q"].shape == (20, 2, 32) and fwd[0]["block_table"] is None
        fa.flash_attn_func_triton(q, k, v, causal=False)
        assert len(fwd) == 1  # not causal: the paper path ran
        with fa.performance_layers(False):  # the switch: every lookup finds no layer
            fa.flash_attn_func_triton(q, k, v, causal=True)
        assert len(fwd) == 1
    finally:
        remove_fwd()
        remove_bwd()
    fa.flash_attn_func_triton(q, k, v, causal=True)
    assert len(fwd) == 1  # removed
    remove_fwd()  # removing twice is harmless


def test_the_backward_keeps_the_forwards_switch_on_another_thread():
    """Autograd runs a CUDA backward on a thread of its own, outside the forward's context: a forward run
    under performance_layers(False) must still get the paper path's backward there."""
    import threading

    q, k, v = (torch.randn(1, 20, 2, 32, dtype=torch.float16) for _ in range(3))
    bwd = []
    remove = REGISTRY.register("backward", _recording_layer("backward", bwd))
    try:
        qq = q.clone().requires_grad_()
        with fa.performance_layers(False):
            out = fa.flash_attn_func_triton(qq, k, v, causal=True)
        thread = threading.Thread(target=lambda: out.sum().backward())  # a fresh context, layers on
        thread.start()
        thread.join()
        assert qq.grad is not None and not bwd
    finally:
        remove()


def test_a_registered_decode_runs_and_the_first_that_applies_wins():
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16)
    kc, vc = torch.randn(2, 24, 2, 32, dtype=torch.float16), torch.randn(2, 24, 2, 32, dtype=torch.float16)
    first, second = [], []
    removes = [REGISTRY.register("decode", _recording_layer("decode", calls)) for calls in (first, second)]
    try:
        out = fa.flash_attn_with_kvcache_triton(q, kc, vc, 24)
        assert len(first) == 1 and not second and first[0]["num_splits"] == 0
        torch.testing.assert_close(out, fa.flash_attn_with_kvcache_torch(q, kc, vc, 24), atol=2e-3, rtol=0)
    finally:
        for remove in removes:
            remove()


def test_register_bad_arguments():
    with pytest.raises(ValueError, match=r"^nano_flashattn has no extension point 'fwd'; its points are "
                                         r"\['backward', 'decode', 'forward', 'pdl'\]"):
        REGISTRY.register("fwd", lambda **a: None)
    with pytest.raises(TypeError, match=r"^impl and applies must be callables, got int and NoneType"):
        REGISTRY.register("forward", 3)
    with pytest.raises(TypeError, match=r"^impl and applies must be callables, got function and str"):
        REGISTRY.register("forward", lambda **a: None, applies="always")


def test_every_layer_loads_here():
    assert fa.load_layers() == {} and REGISTRY.modules == ("hopper_ws", "hopper", "split_head", "pdl")


# ------------------------------------------------------------------ the default dispatch, shape by shape
class Pretend:
    """What the layers' predicates read of a tensor, for a contiguous tensor on a pretend CUDA device."""

    is_cuda = True

    def __init__(self, *shape: int, dtype: torch.dtype = torch.bfloat16):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device("cuda", 0)

    def stride(self) -> tuple[int, ...]:
        return torch.empty(self.shape, device="meta").stride()

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return 1 << 20

    def element_size(self) -> int:
        return torch.finfo(self.dtype).bits // 8


def _call(kind, d=128, batch=2, seqlen=4096, heads=(16, 16), dtype=torch.bfloat16, causal=True, window=None,
          varlen=False, paged=False, seqlen_k=None):
    """The keyword arguments `run_kernel(kind, ...)` gets for such a call (pretend tensors)."""
    seqlen_k = seqlen_k or seqlen
    q = Pretend(batch * seqlen, heads[0], d, dtype=dtype)
    k = Pretend(batch * seqlen_k, heads[1], d, dtype=dtype) if not paged else Pretend(64, 16, heads[1], d)
    cu = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32) if varlen else None
    args = dict(q=q, k=k, v=k, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen_k, cu_seqlens_q=cu,
                cu_seqlens_k=cu, scale=d**-0.5, window_left=window or NO_WINDOW,
                window_right=0 if causal else NO_WINDOW)
    if kind == "forward":
        return {**args, "block_table": torch.zeros(batch, 4, dtype=torch.int32) if paged else None}
    return {**args, "do": q, "out": q, "lse": None}


@pytest.fixture
def hopper_machine(paper_path, monkeypatch):
    """The default registrations, a pretend device of the capability the test sets, and a Triton with
    tensor descriptors and Gluon (as on the H100 / H200 runs)."""
    from nano_flashattn.layers import hopper, hopper_ws, pdl

    REGISTRY.restore(paper_path)
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability["value"])
    monkeypatch.setattr(hopper, "HAS_TENSOR_DESCRIPTORS", True)
    monkeypatch.setattr(hopper_ws, "HAS_GLUON", True)
    monkeypatch.setattr(pdl, "HAS_PDL", True)
    launch._capability.cache_clear()

    def set_capability(cap):
        capability["value"] = cap
        launch._capability.cache_clear()

    yield set_capability
    launch._capability.cache_clear()


def test_default_dispatch_on_hopper_per_shape(hopper_machine):
    """hopper_ws ahead of hopper ahead of split_head, each where it measured faster: dense head_dim 128
    batches of whole tiles go to the Gluon kernels (backward 64 too), 64 / 96 / 128 to the TMA kernels,
    48 / 80 / 96 / ... to the split kernels elsewhere, the rest to the paper path."""
    from nano_flashattn.layers.hopper import hopper_backward, hopper_forward
    from nano_flashattn.layers.hopper_ws import ws_backward, ws_forward
    from nano_flashattn.layers.pdl import pdl_decode
    from nano_flashattn.layers.split_head import split_backward, split_forward

    forward = [  # (call, launcher on sm_90, launcher on sm_80)
        (dict(), ws_forward, None),
        (dict(causal=False, dtype=torch.float16), ws_forward, None),
        (dict(seqlen=4000), hopper_forward, None),  # not whole 128-row tiles
        (dict(seqlen=1024, seqlen_k=4096), hopper_forward, None),
        (dict(window=256), hopper_forward, None),
        (dict(varlen=True), hopper_forward, None),
        (dict(heads=(16, 4)), ws_forward, None),  # GQA
        (dict(d=64), hopper_forward, None),
        (dict(d=96), hopper_forward, split_forward),
        (dict(d=96, paged=True), split_forward, split_forward),
        (dict(d=96, dtype=torch.float32), split_forward, split_forward),
        (dict(d=80), split_forward, split_forward),
        (dict(d=192), split_forward, split_forward),
        (dict(d=128, paged=True), None, None),
        (dict(d=128, dtype=torch.float32), None, None),
        (dict(d=256), None, None),
        (dict(d=40), None, None),
    ]
    backward = [
        (dict(), ws_backward, None),
        (dict(d=64), ws_backward, None),
        (dict(d=64, seqlen=4000), hopper_backward, None),
        (dict(varlen=True), hopper_backward, None),
        (dict(d=96), hopper_backward, split_backward),
        (dict(d=80), split_backward, split_backward),
        (dict(dtype=torch.float32), None, None),
        (dict(d=256), None, None),
    ]
    for cap, column in (((9, 0), 1), ((8, 0), 2), ((10, 0), 2)):
        hopper_machine(cap)
        for kind, table in (("forward", forward), ("backward", backward)):
            got = [REGISTRY.select(kind, **_call(kind, **call)) for call, *_ in table]
            want = [row[column] for row in table]
            assert got == want, (cap, kind, [(t[0], g, w) for t, g, w in zip(table, got, want) if g != w])
        # decode: the paper path's kernels, launched with PDL from Hopper on
        want = pdl_decode if cap[0] >= 9 else None
        assert REGISTRY.select("decode", q=Pretend(2, 1, 32, 128)) is want


def test_the_paper_path_switch_and_a_disabled_layer(hopper_machine):
    from nano_flashattn.layers import hopper, hopper_ws

    call = _call("forward")
    with fa.performance_layers(False):
        assert REGISTRY.select("forward", **call) is None
    hopper_ws.disable()  # the bench's --no-gluon-forward
    assert REGISTRY.select("forward", **call) is hopper.hopper_forward
    hopper.disable()
    assert REGISTRY.select("forward", **call) is None
    hopper_ws.enable()
    hopper.enable()  # enabled again, in any order: the registry's order holds
    assert [layer.module.rsplit(".", 1)[1] for layer in REGISTRY.layers("forward")] == [
        "hopper_ws", "hopper", "split_head"]


def test_no_package_imports_tools():
    """tools/ (sweeps, diagnostics) is not packaged: a non-editable install has none."""
    bad = []
    for path in ROOT.glob("*/**/*.py"):
        top = path.relative_to(ROOT).parts[0]
        if not (top == "shared" or top.startswith("nano_")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "tools"]
    assert not bad, bad

