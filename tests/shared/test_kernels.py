"""shared.kernels: each Triton kernel against its torch reference, and each reference against float64.

The Triton halves run under TRITON_INTERPRET=1 on CPU (tests/conftest.py sets it), fp32 and fp16 only:
the interpreter computes bf16 arithmetic wrongly, so bf16 lives in the `gpu` tests. On a GPU machine
the same tests run the compiled kernels on CUDA tensors. Accuracy rule
(FlashAttention's): the kernel's max error against a float64 computation is at most twice the error of
the torch reference run in the same low precision, plus 1e-5 of the output's magnitude. Every float
tensor created with torch.empty/empty_like during a test starts as NaN, so an element a kernel fails to
write cannot pass.
"""

from __future__ import annotations

import secrets

import pytest
import torch
import torch.nn.functional as F

from shared.kernels import (
    apply_rope,
    apply_rope_torch,
    apply_rope_triton,
    rms_norm,
    rms_norm_torch,
    rms_norm_triton,
    silu_and_mul,
    silu_and_mul_torch,
    silu_and_mul_triton,
    use_triton,
)

DTYPES = [torch.float32, torch.float16]
# Compiled kernels on a GPU machine, the interpreter elsewhere (conftest sets TRITON_INTERPRET=1).
DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (reported on failure), so CI keeps exploring new inputs."""
    s = secrets.randbits(31)
    torch.manual_seed(s)
    return s


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


def check(out: torch.Tensor, ref_lowp: torch.Tensor, ref64: torch.Tensor, what: str, seed: int) -> None:
    assert out.shape == ref64.shape and out.dtype == ref_lowp.dtype, what
    assert torch.isfinite(out).all(), f"{what}: non-finite (unwritten?) elements, seed {seed}"
    err = (out.double() - ref64).abs().max().item()
    ref_err = (ref_lowp.double() - ref64).abs().max().item()
    # twice the reference's own error, plus one ulp of the largest value in the output's dtype: two results
    # rounded independently (a reduction summed in another order, as dweight is) can differ by that
    # even where the reference happens to land close
    ulp = max(torch.finfo(out.dtype).eps, 1e-5) if out.is_floating_point() else 1e-5
    bound = 2 * ref_err + ulp * ref64.abs().max().item()
    assert err <= bound, f"{what}: error {err:.3g} > {bound:.3g} (reference's {ref_err:.3g}), seed {seed}"


def grads(fn, inputs, outputs_grad):
    """Run fn on leaf copies of inputs; return outputs and d(outputs . outputs_grad)/d(inputs)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    return outs, torch.autograd.grad(outs, leaves, outputs_grad)


def f64(ts):
    return [t.double() for t in ts]


# ------------------------------------------------------------------------------------------- RMSNorm

# (shape, ...): odd hidden sizes (tail masking), several rows per program with a ragged last block,
# more row blocks than backward programs (the row loop), and one row per program at hidden 4096.
RMS_SHAPES = [(7, 96), (5, 41, 100), (9, 4096), (3, 1000)]


def rms_inputs(shape, dtype, residual: bool, device=DEV):
    x = torch.randn(shape, dtype=dtype, device=device)
    w = (1 + 0.5 * torch.randn(shape[-1], device=device)).to(dtype)
    r = torch.randn(shape, dtype=dtype, device=device) if residual else None
    return x, w, r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RMS_SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_forward(seed, shape, dtype, residual):
    x, w, r = rms_inputs(shape, dtype, residual)
    out, ref = rms_norm_triton(x, w, EPS, r), rms_norm_torch(x, w, EPS, r)
    ref64 = rms_norm_torch(x.double(), w.double(), EPS, None if r is None else r.double())
    if residual:
        check(out[0], ref[0], ref64[0], "y", seed)
        check(out[1], ref[1], ref64[1], "x + residual", seed)
        assert torch.equal(out[1], ref[1])  # the same rounding of the same sum
    else:
        check(out, ref, ref64, "y", seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RMS_SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_backward(seed, shape, dtype, residual):
    x, w, r = rms_inputs(shape, dtype, residual)
    inputs = [x, w] + ([r] if residual else [])
    # dy, and (with a residual) ds, the gradient reaching the x + residual output
    dys = [torch.randn(shape, dtype=dtype, device=DEV) for _ in range(1 + residual)]

    def run(impl):
        return lambda x, w, *r: impl(x, w, EPS, *r)

    _, g = grads(run(rms_norm_triton), inputs, dys)
    _, g_ref = grads(run(rms_norm_torch), inputs, dys)
    _, g64 = grads(run(rms_norm_torch), f64(inputs), f64(dys))
    for name, a, b, c in zip(["dx", "dweight", "dresidual"], g, g_ref, g64):
        check(a, b, c, name, seed)


def test_rms_norm_backward_only_one_output_used(seed):
    x, w, r = rms_inputs((6, 100), torch.float32, residual=True)
    dy = torch.randn_like(x)
    # Only y used: the gradient into x + residual comes from the norm alone.
    _, g = grads(lambda *a: rms_norm_triton(a[0], a[1], EPS, a[2])[0], [x, w, r], [dy])
    _, g64 = grads(lambda *a: rms_norm_torch(a[0], a[1], EPS, a[2])[0], f64([x, w, r]), [dy.double()])
    for a, c in zip(g, g64):
        torch.testing.assert_close(a.double(), c, rtol=1e-5, atol=1e-5)
    # Only s used: the gradient passes straight through the add, and the weight gets none.
    _, (dx, dw, dr) = grads(lambda *a: rms_norm_triton(a[0], a[1], EPS, a[2])[1], [x, w, r], [dy])
    assert torch.equal(dx, dy) and torch.equal(dr, dy) and not dw.any()


def test_rms_norm_strided_and_empty(seed):
    big = torch.randn(10, 300, device=DEV)
    x, r = big[:, 7:107], big[:, 150:250]  # row stride 300, not 100
    w = torch.randn(100, device=DEV)
    for a, b in zip(rms_norm_triton(x, w, EPS, r), rms_norm_torch(x, w, EPS, r)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    x3 = big.view(10, 3, 100).transpose(0, 1)  # (3, 10, 100) with a non-mergeable leading layout
    torch.testing.assert_close(rms_norm_triton(x3, w, EPS), rms_norm_torch(x3, w, EPS), rtol=1e-5, atol=1e-5)
    assert rms_norm_triton(torch.randn(0, 100, device=DEV), w, EPS).shape == (0, 100)


# ---------------------------------------------------------------------------------------------- RoPE


def rope_inputs(shape, dtype, device=DEV):
    x = torch.randn(shape, dtype=dtype, device=device)
    theta = 10 * torch.randn((*shape[:-2], shape[-1] // 2), dtype=torch.float64, device=device)
    return x, theta.cos().float(), theta.sin().float(), theta


# (B, S, H, D) and (T, H, D); a non-power-of-two half (48) and head count (3, 5)
ROPE_SHAPES = [(2, 5, 3, 16), (9, 5, 96), (2, 3, 32, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES)
def test_rope_forward_backward(seed, shape, dtype):
    x, cos, sin, _ = rope_inputs(shape, dtype)
    dout = torch.randn(shape, dtype=dtype, device=DEV)
    (out,), (dx,) = grads(lambda x: apply_rope_triton(x, cos, sin), [x], [dout])
    (ref,), (dx_ref,) = grads(lambda x: apply_rope_torch(x, cos, sin), [x], [dout])
    (ref64,), (dx64,) = grads(
        lambda x: apply_rope_torch(x, cos.double(), sin.double()), [x.double()], [dout.double()]
    )
    check(out, ref, ref64, "rope", seed)
    check(dx, dx_ref, dx64, "d rope", seed)


def test_rope_strided_and_broadcast(seed):
    b, s, h, d = 2, 6, 4, 32
    qkv = torch.randn(b, s, 3 * h, d, device=DEV)
    q = qkv[:, :, h : 2 * h]  # a slice of a fused projection: head stride d, token stride 3*h*d
    _, cos, sin, _ = rope_inputs((1, s, h, d), torch.float32)  # cos/sin shared by the batch
    torch.testing.assert_close(
        apply_rope_triton(q, cos, sin), apply_rope_torch(q, cos, sin), rtol=0, atol=1e-6
    )


# --------------------------------------------------------------------------------------------- SwiGLU

SILU_SHAPES = [(7, 100), (2, 3, 96), (2, 5000)]  # 5000: several column blocks and a ragged tail


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_silu_and_mul_forward_backward(seed, shape, dtype):
    g, u, dout = (torch.randn(shape, dtype=dtype, device=DEV) for _ in range(3))
    g = 4 * g  # reach silu's saturated tails
    (out,), grad = grads(silu_and_mul_triton, [g, u], [dout])
    (ref,), grad_ref = grads(silu_and_mul_torch, [g, u], [dout])
    (ref64,), grad64 = grads(silu_and_mul_torch, f64([g, u]), [dout.double()])
    check(out, ref, ref64, "silu*up", seed)
    for name, a, b, c in zip(["dgate", "dup"], grad, grad_ref, grad64):
        check(a, b, c, name, seed)


def test_silu_and_mul_fused_gate_up_slices(seed):
    gu = torch.randn(4, 5, 2 * 70, device=DEV)
    g, u = gu[..., :70], gu[..., 70:]  # row stride 140
    dout = torch.randn(4, 5, 70, device=DEV)
    (out,), grad = grads(silu_and_mul_triton, [g, u], [dout])
    (ref,), grad_ref = grads(silu_and_mul_torch, [g, u], [dout])
    for a, b in zip([out, *grad], [ref, *grad_ref]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------- references against independent float64 math


def test_references_against_float64_formulas(seed):
    x, w, r = (torch.randn(6, 50, dtype=torch.float64) for _ in range(3))
    w = w[0]
    s = x + r
    torch.testing.assert_close(
        rms_norm_torch(x, w, EPS, r)[0], F.rms_norm(s, (50,), w, EPS), rtol=1e-12, atol=0
    )
    torch.testing.assert_close(
        rms_norm_torch(x.float(), w.float(), EPS),
        (x * w / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt()).float(),
    )
    # RoPE as RoFormer's complex multiplication: (x1 + i x2) * e^{i theta}.
    x, cos, sin, theta = rope_inputs((3, 4, 2, 24), torch.float64, device="cpu")
    x1, x2 = x.chunk(2, -1)
    z = torch.complex(x1, x2) * torch.polar(torch.ones_like(theta), theta).unsqueeze(-2)
    torch.testing.assert_close(apply_rope_torch(x, theta.cos(), theta.sin()), torch.cat([z.real, z.imag], -1))
    torch.testing.assert_close(apply_rope_torch(x.float(), cos, sin), torch.cat([z.real, z.imag], -1).float())
    g, u = torch.randn(2, 2, 30, dtype=torch.float64).unbind(0)
    torch.testing.assert_close(silu_and_mul_torch(g, u), g / (1 + torch.exp(-g)) * u, rtol=1e-12, atol=0)


def test_references_match_transformers(seed):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    norm = llama.LlamaRMSNorm(64, eps=EPS).half()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(5, 64, dtype=torch.float16)
    assert torch.equal(rms_norm_torch(x, norm.weight.detach(), EPS), norm(x).detach())  # bitwise: same ops
    q, k = torch.randn(2, 2, 3, 7, 32).unbind(0)  # HF layout (B, H, S, D)
    _, cos, sin, _ = rope_inputs((2, 7, 3, 32), torch.float32, device="cpu")
    q_hf, k_hf = llama.apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    for t, t_hf in [(q, q_hf), (k, k_hf)]:
        ours = apply_rope_torch(t.transpose(1, 2), cos, sin).transpose(1, 2)
        torch.testing.assert_close(ours, t_hf, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------- dispatch, bad inputs


def test_dispatch_uses_reference_on_cpu(seed):
    x, w, r = rms_inputs((4, 64), torch.float32, residual=True, device="cpu")
    assert not use_triton(x)
    for a, b in zip(rms_norm(x, w, EPS, r), rms_norm_torch(x, w, EPS, r)):
        assert torch.equal(a, b)
    x4, cos, sin, _ = rope_inputs((1, 3, 2, 8), torch.float32, device="cpu")
    assert torch.equal(apply_rope(x4, cos, sin), apply_rope_torch(x4, cos, sin))
    assert torch.equal(silu_and_mul(x, r), silu_and_mul_torch(x, r))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bad_inputs(impl):
    rms = {"torch": rms_norm_torch, "triton": rms_norm_triton}[impl]
    rope = {"torch": apply_rope_torch, "triton": apply_rope_triton}[impl]
    silu = {"torch": silu_and_mul_torch, "triton": silu_and_mul_triton}[impl]
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"rms_norm: weight \(7,\) must be \(hidden,\)"):
        rms(x, torch.ones(7), EPS)
    with pytest.raises(ValueError, match="rms_norm: residual .* must match x"):
        rms(x, torch.ones(8), EPS, torch.ones(3, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="apply_rope: x .* with D even"):
        rope(torch.randn(2, 3, 7), torch.ones(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"apply_rope: cos/sin \(2, 3\)/\(2, 3\) must be \(2, 4\)"):
        rope(torch.randn(2, 3, 8), torch.ones(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="do not broadcast"):
        rope(torch.randn(2, 3, 2, 8), torch.ones(3, 3, 4), torch.ones(3, 3, 4))
    with pytest.raises(ValueError, match="silu_and_mul: gate .* and up .* differ"):
        silu(x, torch.randn(3, 9))


# --------------------------------------------------------------------------- GPU: bf16, larger shapes

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(4096, 4096), (2, 1000, 5120), (8192, 128), (3000, 1000)])
def test_gpu_rms_norm(seed, shape, dtype):
    x, w, r = rms_inputs(shape, dtype, residual=True, device="cuda")
    dys = [torch.randn(shape, dtype=dtype, device="cuda") for _ in range(2)]

    def fn(impl):
        return lambda x, w, *r: impl(x, w, EPS, *r)

    for residual in (False, True):
        inputs, dy = ([x, w, r], dys) if residual else ([x, w], dys[:1])
        out, g = grads(fn(rms_norm_triton), inputs, dy)
        ref, g_ref = grads(fn(rms_norm_torch), inputs, dy)
        ref64, g64 = grads(fn(rms_norm_torch), f64(inputs), f64(dy))
        names = ["y", "s", "dx", "dw", "dr"] if residual else ["y", "dx", "dw"]
        for name, a, b, c in zip(names, [*out, *g], [*ref, *g_ref], [*ref64, *g64]):
            check(a, b, c, f"{name} residual={residual}", seed)
    assert use_triton(x) and torch.equal(rms_norm(x, w, EPS), rms_norm_triton(x, w, EPS))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(4, 1024, 32, 128), (4096, 8, 64), (1000, 5, 96)])
def test_gpu_rope(seed, shape, dtype):
    x, cos, sin, _ = rope_inputs(shape, dtype, device="cuda")
    dout = torch.randn(shape, dtype=dtype, device="cuda")
    (out,), (dx,) = grads(lambda x: apply_rope_triton(x, cos, sin), [x], [dout])
    (ref,), (dx_ref,) = grads(lambda x: apply_rope_torch(x, cos, sin), [x], [dout])
    (ref64,), (dx64,) = grads(
        lambda x: apply_rope_torch(x, cos.double(), sin.double()), [x.double()], [dout.double()]
    )
    check(out, ref, ref64, "rope", seed)
    check(dx, dx_ref, dx64, "d rope", seed)
    assert torch.equal(apply_rope(x, cos, sin), out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(4096, 11008), (2, 333, 1000)])
def test_gpu_silu_and_mul(seed, shape, dtype):
    g, u, dout = (torch.randn(shape, dtype=dtype, device="cuda") for _ in range(3))
    (out,), grad = grads(silu_and_mul_triton, [4 * g, u], [dout])
    (ref,), grad_ref = grads(silu_and_mul_torch, [4 * g, u], [dout])
    (ref64,), grad64 = grads(silu_and_mul_torch, f64([4 * g, u]), [dout.double()])
    for name, a, b, c in zip(["out", "dgate", "dup"], [out, *grad], [ref, *grad_ref], [ref64, *grad64]):
        check(a, b, c, name, seed)
    assert torch.equal(silu_and_mul(4 * g, u), out)


def test_inference_path_equals_autograd_path():
    """Without grad (inference) the wrappers skip torch.autograd.Function: the same kernels, so the same bits."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 64, generator=g).to(DEV)
    w = torch.randn(64, generator=g).to(DEV)
    res = torch.randn(6, 5, 64, generator=g).to(DEV)
    cos, sin = torch.randn(6, 16, generator=g).to(DEV), torch.randn(6, 16, generator=g).to(DEV)
    q = torch.randn(6, 3, 32, generator=g).to(DEV)
    cases = [(lambda a: rms_norm_triton(a, w, 1e-6), x), (lambda a: rms_norm_triton(a, w, 1e-6, res)[0], x),
             (lambda a: rms_norm_triton(a, w, 1e-6, res)[1], x), (lambda a: apply_rope_triton(a, cos, sin), q),
             (lambda a: silu_and_mul_triton(a, res), x)]
    for i, (fn, inp) in enumerate(cases):
        with torch.no_grad():
            fast = fn(inp)
        slow = fn(inp.clone().requires_grad_(True))
        assert slow.requires_grad and not fast.requires_grad, i
        assert fast.shape == slow.shape and torch.equal(fast, slow.detach()), i


def test_read_stream_reads_every_word_once():
    """shared.bench's read-only ceiling kernel: each program's strided share summed, all words once."""
    from shared.kernels.read_stream import read_stream

    g = torch.Generator().manual_seed(0)
    for n, programs in [(1, 3), (4096, 1), (3 * 4096 + 17, 2), (10_000, 5)]:
        words = torch.randint(-1000, 1000, (n,), dtype=torch.int32, generator=g).to(DEV)
        out = read_stream(words, torch.empty(programs, dtype=torch.int32, device=DEV))
        assert int(out.sum()) == int(words.sum())
