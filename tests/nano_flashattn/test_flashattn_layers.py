"""The dispatch point performance layers register into (interface.register_kernel), and the layout rule
that nothing packaged imports the repository's tools/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import nano_flashattn as fa
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
    remove_fwd = fa.register_kernel("forward", _recording_layer("forward", fwd),
                                    applies=lambda **a: a["window_right"] == 0)  # causal calls only
    remove_bwd = fa.register_kernel("backward", _recording_layer("backward", bwd))
    try:
        qq = q.clone().requires_grad_()
        out = fa.flash_attn_func_triton(qq, k, v, causal=True)
        out.sum().backward()
        assert torch.equal(out, ref) and len(fwd) == 1 and len(bwd) == 1
        assert fwd[0]["q"].shape == (20, 2, 32) and fwd[0]["block_table"] is None
        fa.flash_attn_func_triton(q, k, v, causal=False)
        assert len(fwd) == 1  # not causal: the paper path ran
    finally:
        remove_fwd()
        remove_bwd()
    fa.flash_attn_func_triton(q, k, v, causal=True)
    assert len(fwd) == 1  # removed
    remove_fwd()  # removing twice is harmless


def test_a_registered_decode_runs_and_the_latest_registration_wins():
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16)
    kc, vc = torch.randn(2, 24, 2, 32, dtype=torch.float16), torch.randn(2, 24, 2, 32, dtype=torch.float16)
    first, second = [], []
    removes = [fa.register_kernel("decode", _recording_layer("decode", calls)) for calls in (first, second)]
    try:
        out = fa.flash_attn_with_kvcache_triton(q, kc, vc, 24)
        assert not first and len(second) == 1 and second[0]["num_splits"] == 0
        torch.testing.assert_close(out, fa.flash_attn_with_kvcache_torch(q, kc, vc, 24), atol=2e-3, rtol=0)
    finally:
        for remove in removes:
            remove()


def test_register_kernel_bad_arguments():
    with pytest.raises(ValueError, match=r"^kind must be one of \['backward', 'decode', 'forward'\], got"):
        fa.register_kernel("fwd", lambda **a: None)
    with pytest.raises(TypeError, match=r"^launch and applies must be callables, got int and NoneType"):
        fa.register_kernel("forward", 3)
    with pytest.raises(TypeError, match=r"^launch and applies must be callables, got function and str"):
        fa.register_kernel("forward", lambda **a: None, applies="always")


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

