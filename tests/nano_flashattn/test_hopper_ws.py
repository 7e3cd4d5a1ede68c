"""The warp-specialised Gluon forward (nano_flashattn.layers.hopper_ws): which calls it takes and how it registers
(CPU: Gluon has no interpreter), and its outputs against the fp64 reference with FlashAttention's error rule
on an sm_90 GPU, with the paper path's backward reading its LSE."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_flashattn_dense import _run_and_compare

from nano_flashattn import REGISTRY
from nano_flashattn.checks import NO_WINDOW
from nano_flashattn.layers import hopper, hopper_ws

ROOT = Path(__file__).resolve().parents[2]


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _args(batch=2, seqlen=256, heads=(4, 2), d=128, dtype=torch.bfloat16, causal=True, **changes):
    q = torch.zeros(batch * seqlen, heads[0], d, dtype=dtype)
    k = torch.zeros(batch * seqlen, heads[1], d, dtype=dtype)
    args = dict(q=q, k=k, v=k.clone(), batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, cu_seqlens_q=None,
                cu_seqlens_k=None, block_table=None, window_left=NO_WINDOW, window_right=0 if causal else NO_WINDOW)
    return {**args, **changes}


def test_takes_dense_head_dim_128_batches_of_whole_tiles():
    assert hopper_ws.takes(**_args()) and hopper_ws.takes(**_args(causal=False, dtype=torch.float16))
    cu = torch.tensor([0, 256, 512], dtype=torch.int32)
    assert hopper_ws.takes(**_args(d=64)) and not hopper_ws.takes(**_args(d=64), head_dims=(128,))
    refused = [
        _args(d=96), _args(d=256), _args(dtype=torch.float32), _args(seqlen=200), _args(seqlen_k=512),
        _args(cu_seqlens_q=cu, cu_seqlens_k=cu), _args(block_table=torch.zeros(2, 1, dtype=torch.int32)),
        _args(window_left=64), _args(causal=False, window_right=5), _args(config=(128, 128, 8, 3)),
    ]
    assert not any(hopper_ws.takes(**a) for a in refused)


def test_never_applies_on_a_cpu_and_refuses_what_it_does_not_take():
    assert not hopper_ws.applies(**_args())
    with pytest.raises(ValueError, match=r"^ws_forward: q \(512, 4, 128\) torch.bfloat16 on cpu: takes dense sm_90"):
        hopper_ws.ws_forward(scale=1.0, **_args())
    with pytest.raises(ValueError, match=r"^head_dims must be of \(64, 128\), got \(96,\)"):
        hopper_ws.enable(head_dims=(96,))


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_enable_registers_ahead_and_disable_removes(kind):
    names = ("enable", "disable", "enabled") if kind == "forward" else ("enable_backward", "disable_backward",
                                                                      "backward_enabled")
    enable, disable, enabled = (getattr(hopper_ws, name) for name in names)
    launch_fn = getattr(hopper_ws, f"ws_{kind}")
    (hopper.enable if kind == "forward" else hopper.enable_backward)()  # registered first, tried second
    try:
        remove = enable()
        assert enabled() and REGISTRY.layers(kind)[0].impl is launch_fn
        enable()  # again: one registration
        assert sum(layer.impl is launch_fn for layer in REGISTRY.layers(kind)) == 1
        remove()
        assert not enabled() and all(layer.impl is not launch_fn for layer in REGISTRY.layers(kind))
    finally:
        disable()


def test_backward_takes_what_the_forward_takes_with_do_of_its_dtype():
    args = _args(d=64)
    assert not hopper_ws.backward_applies(do=args["q"], **args)  # a CPU tensor: never
    with pytest.raises(ValueError, match=r"^ws_backward: q \(512, 4, 64\) torch.bfloat16 on cpu: takes dense sm_90"):
        hopper_ws.ws_backward(do=args.pop("q"), q=torch.zeros(512, 4, 64, dtype=torch.bfloat16), out=None, lse=None,
                              scale=1.0, **{k: v for k, v in args.items() if k != "block_table"})
    with pytest.raises(ValueError, match=r"^config must be \(stages 2 or 3, dq_first bool\[, head_group int\]\)"):
        hopper_ws.ws_backward(do=args["k"], q=args["k"], out=None, lse=None, scale=1.0, config=(4, True),
                              **{k: v for k, v in args.items() if k != "block_table"})


def test_bench_switch():
    from nano_flashattn import bench

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on = bench.set_layers(bench.parse_args([]), device)
    assert hopper_ws.enabled() and hopper_ws.backward_enabled()
    assert on["gluon_forward"] is on["gluon_backward"] is (_sm90() and hopper_ws.HAS_GLUON)
    off = bench.set_layers(bench.parse_args(["--no-gluon-forward", "--no-gluon-backward"]), device)
    assert not (hopper_ws.enabled() or hopper_ws.backward_enabled())
    assert off["gluon_forward"] is off["gluon_backward"] is False
    assert off["hopper_forward"] is on["hopper_forward"]  # the others untouched


_COMPILE = """
import sys
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from nano_flashattn.layers import hopper_ws

d, causal, which = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
def desc(rows, dtype=gl.bfloat16, name="bf16"):
    return f"tensordesc<{name}[{rows}, {d}],{gl.NVMMASharedLayout.get_default_for([rows, d], dtype)!r}>"
if which == "forward":
    kernel = hopper_ws._ws_fwd_kernel
    signature = {"q_desc": desc(64), "k_desc": desc(128), "v_desc": desc(128), "o_desc": desc(64), "LSE": "*fp32",
                 "seqlen": "i32", "group": "i32", "stride_lse_h": "i32", "qk_scale": "fp32"}
    constants = {"CAUSAL": causal, "NUM_STAGES": hopper_ws.STAGES, "CONSUMER_REGS": hopper_ws.REGS[0],
                 "LOADER_REGS": hopper_ws.REGS[1], "num_warps": 4}
else:
    kernel = hopper_ws._ws_bwd_kernel
    signature = {"q_desc": desc(64), "do_desc": desc(64), "k_desc": desc(128), "v_desc": desc(128),
                 "dq_desc": desc(64, gl.float32, "fp32"), "dk_desc": desc(128), "dv_desc": desc(128),
                 "LSE2": "*fp32", "Delta": "*fp32", "seqlen": "i32", "group": "i32",
                 "stride_lse_h": "i32", "qk_scale": "fp32", "scale": "fp32"}
    stages, dq_first = hopper_ws.BWD_CONFIGS[d]
    constants = {"CAUSAL": causal, "NUM_STAGES": stages, "LOADER_REGS": hopper_ws.BWD_LOADER_REGS,
                 "DQ_FIRST": dq_first, "HEAD_GROUP": hopper_ws.BWD_HEAD_GROUP if causal else 0, "num_warps": 8}
signature.update(dict.fromkeys(constants, "constexpr"))
compiled = triton_compile(GluonASTSource(kernel, signature, constexprs=constants, attrs={}),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": constants["num_warps"]})
ptx = compiled.asm["ptx"]
assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx and "cp.async.bulk.tensor" in ptx, "missing instructions"
assert which == "forward" or "cp.reduce.async.bulk.tensor" in ptx, "the backward's dQ reduction is missing"
print("compiled")
"""


@pytest.mark.skipif(not hopper_ws.HAS_GLUON, reason="this Triton has no Gluon Hopper module")
@pytest.mark.parametrize("which,d,causal", [("forward", 128, False), ("forward", 64, True), ("backward", 128, True),
                                            ("backward", 64, False)])
def test_kernel_compiles_for_sm90_with_this_triton(which, d, causal, tmp_path):
    """Gluon's API moves between Triton releases (3.6's TMA copy names are gone in 3.9): each kernel is compiled
    for sm_90 with the installed Triton, no GPU needed, down to PTX with its wgmma, the register split and
    (backward) the TMA reduction, and on to SASS, where ptxas must not serialise the wgmmas for lack of
    registers (its warning C7512: the causal hd128 backward did with 40 registers for the producer warp, and
    ran 8-10% slower). In a process of its own: this one imported Triton under TRITON_INTERPRET=1, and an
    empty cache, so that the compiler runs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               TRITON_DUMP_PTXAS_LOG="1")  # ptxas' own report on stdout
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(d), str(int(causal)), which], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
    assert "C7512" not in done.stdout, done.stdout[-3000:]


@pytest.fixture(params=[False, True], ids=["paper_backward", "ws_backward"])
def launches(request, monkeypatch):
    """The forward layer, and with the "ws_backward" id the backward layer too, enabled for this test; counts
    their kernels' launches."""
    counts = {"forward": 0, "backward": 0, "ws_backward": request.param}

    def counted(kernel, key):
        class Counted:
            def __getitem__(self, grid):
                counts[key] += 1
                return kernel[grid]

        return Counted()

    monkeypatch.setattr(hopper_ws, "_ws_fwd_kernel", counted(hopper_ws._ws_fwd_kernel, "forward"))
    monkeypatch.setattr(hopper_ws, "_ws_bwd_kernel", counted(hopper_ws._ws_bwd_kernel, "backward"))
    hopper_ws.enable(head_dims=hopper_ws.HEAD_DIMS)
    if request.param:
        hopper_ws.enable_backward()
    yield counts
    hopper_ws.disable()
    hopper_ws.disable_backward()


@pytest.mark.gpu
@pytest.mark.skipif(not (_sm90() and hopper_ws.HAS_GLUON), reason="wgmma, TMA and Gluon need sm_90")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b,s,hq,hk,dtype,causal", [
    (2, 256, 4, 4, torch.bfloat16, True), (2, 384, 8, 2, torch.bfloat16, False), (1, 1024, 4, 1, torch.bfloat16, True),
    (1, 128, 2, 2, torch.bfloat16, True), (2, 512, 4, 2, torch.float16, False), (1, 2048, 2, 2, torch.float16, True)])
def test_gpu_forward_and_backward(fa_check, launches, d, b, s, hq, hk, dtype, causal):
    """Out, LSE and dQ, dK, dV against fp64 (one K/V tile, several, GQA and MQA, both dtypes): the forward with
    the paper path's backward reading its LSE, and with the warp-specialised backward (dQ summed in fp32 by
    TMA reductions; dK, dV over a GQA group in one program)."""
    _run_and_compare(fa_check, b, s, s, hq, hk, d, dtype, causal, (-1, -1), device="cuda")
    assert launches["forward"] == 1 and launches["backward"] == int(launches["ws_backward"])
