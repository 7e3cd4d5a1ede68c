"""The fused decoder layer (nano_vllm.layers.fused_decode) under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 on a machine without CUDA).

Each fused op against its torch definition (`reference_*`: the paper path's ops one after another, with the
paper path's roundings), by FlashAttention's rule: against the definition evaluated in fp64, our error is at
most twice the error of the definition evaluated in the same precision, plus four ulps of the result's
scale: the fused kernels sum in another order, and where an fp32 sum lands on the other side of a rounding
boundary the rounded intermediate (a projection's output, a normalised value) moves by one ulp, which the
ops after it carry on, scaled (SwiGLU multiplies two such values; RoPE adds two). Then the engine: a decode step
through the fused layers equals the paper path's layer by layer (the residual stream after every layer), and
greedy tokens equal transformers'.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, SamplingParams
from nano_vllm.layers import fused_decode as fd


def _as64(a):
    return a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a


def _close(ours, reference, *args) -> None:
    """`ours` against `reference(*args)` by the rule above (`reference` returns a tensor or a tuple)."""
    ours = ours if isinstance(ours, tuple) else (ours,)
    refs, exacts = reference(*args), reference(*map(_as64, args))
    refs = refs if isinstance(refs, tuple) else (refs,)
    exacts = exacts if isinstance(exacts, tuple) else (exacts,)
    for o, r, e in zip(ours, refs, exacts):
        assert torch.isfinite(o.float()).all()
        err = (o.double() - e).abs().max().item()
        ref_err = (r.double() - e).abs().max().item()
        assert err <= 2 * ref_err + 4 * torch.finfo(o.dtype).eps * e.abs().max().item(), (err, ref_err)


def _rope(d: int, pos: float = 7.0):
    inv = 1.0 / 10000 ** (torch.arange(d // 2) / (d // 2))
    return (pos * inv).cos(), (pos * inv).sin()




@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3", "llama_residual", "qwen2_bias"])
def test_norm_qkv_and_rope_store_attention_are_their_torch_definitions(dtype, family):
    """(a), then (b) on (a)'s output: the new key's cache row holds garbage (NaN) before the call, as a
    reused slot does, and the attention must take the new k, v from its own prologue, not from there.
    bf16 runs (a) only: Triton 3.9's interpreter multiplies bf16 tiles wrongly in tl.dot (fp16's are
    right), so (b) in bf16 is checked on the GPU (test_gpu_fused_decode.py)."""
    g = torch.Generator().manual_seed(0)
    k, hq, hkv, d, keys = 80, 4, 2, 16, 37  # K not a power of two: a masked tile
    n = (hq + 2 * hkv) * d
    x, r = (torch.randn(k, generator=g).to(dtype) for _ in range(2))
    nw = (torch.rand(k, generator=g) + 0.5).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if family == "qwen2_bias" else None
    qn, kn = ((torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2))
    if family != "qwen3":
        qn = kn = None
    res = r if family == "llama_residual" else None
    cos, sin = _rope(d)
    qkv = fd.norm_qkv(x, res, nw, 1e-6, w, b, config=fd.TileConfig(4, 32, 4))
    _close(qkv, fd.reference_norm_qkv, x, res, nw, 1e-6, w, b)
    if dtype == torch.bfloat16:
        return
    k_cache, v_cache = (torch.randn(16, 16, hkv, d, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(16, generator=g)[:4].int()
    pos = torch.arange(keys)
    rows = table[pos // 16].long(), pos % 16
    slot = rows[0][-1] * 16 + rows[1][-1]
    k_cache.view(-1, hkv, d)[slot] = v_cache.view(-1, hkv, d)[slot] = float("nan")
    before = k_cache.clone(), v_cache.clone()
    ws = fd.Workspace(hkv, hq // hkv, d, x.device, splits=4)
    out = fd.rope_store_attention(qkv, hq, cos, sin, qn, kn, 1e-6, k_cache, v_cache, slot.view(1), table,
                                  torch.tensor([keys], dtype=torch.int32), ws, block_keys=16)
    new_rows = k_cache.view(-1, hkv, d)[slot], v_cache.view(-1, hkv, d)[slot]
    _close((out, *new_rows), fd.reference_rope_store_attention, qkv, cos, sin, hq, hkv, qn, kn, 1e-6,
           k_cache[rows][:-1], v_cache[rows][:-1])
    for cache, old in zip((k_cache, v_cache), before):  # only the slot's row is written
        changed = (cache != old) & ~old.isnan()
        assert not changed.any()
    assert ws.attn_counters.eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_o_proj_residual_gate_up_and_down_are_their_torch_definitions(dtype):
    g = torch.Generator().manual_seed(1)
    k, n = 96, 48
    x, nw = torch.randn(k, generator=g).to(dtype), (torch.rand(k, generator=g) + 0.5).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    h, r = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
    for residual in (None, r):
        ours = fd.o_proj_residual(x, w, h, residual, config=fd.TileConfig(8, 64, 4))  # two K tiles
        _close(ours, fd.reference_o_proj_residual, x, w, h, residual)
    _close(fd.down(x, w), torch.nn.functional.linear, x, w)
    w2 = (torch.randn(2 * n, k, generator=g) / k**0.5).to(dtype)
    _close(fd.norm_gate_up_swiglu(x, nw, 1e-6, w2, config=fd.TileConfig(8, 32, 4)), fd.reference_swiglu,
           x, nw, 1e-6, w2)


@pytest.mark.parametrize("heads_q,heads_kv,d,keys,splits", [(4, 2, 16, 1, 4), (4, 2, 16, 37, 4), (8, 2, 32, 200, 4),
                                                           (2, 2, 16, 600, 4), (8, 2, 16, 600, 16)])
def test_decode_attention_is_softmax_attention_over_the_paged_keys(heads_q, heads_kv, d, keys, splits):
    """One key (the step's own), a slice boundary mid-page, more keys than the slices' first tiles, and
    600 keys in 10 of 16 slices (the combine skips the empty ones)."""
    g = torch.Generator().manual_seed(keys)
    k_cache, v_cache = (torch.randn(64, 16, heads_kv, d, generator=g) for _ in range(2))
    table = torch.randperm(64, generator=g)[:48].int()
    q = torch.randn(heads_q, d, generator=g)
    ws = fd.Workspace(heads_kv, heads_q // heads_kv, d, q.device, splits=splits)
    out = fd.decode_attention(q, k_cache, v_cache, table, torch.tensor([keys], dtype=torch.int32), ws)
    pos = torch.arange(keys)
    pages = table[pos // 16].long()
    _close(out, fd.reference_attention, q, k_cache[pages, pos % 16], v_cache[pages, pos % 16])
    assert ws.attn_counters.eq(0).all()  # ready for the next call


def test_attention_slices_grow_with_the_longest_sequence():
    """The measured slice count up to 4096 tokens; beyond, a slice of the longest sequence stays <= 8 tiles."""
    assert [fd.attention_splits(n) for n in (128, 4096, 8192, 32768, 1 << 20)] == [fd.ATTENTION_SPLITS, 8, 16, 32, 32]


def test_bad_shapes_are_errors_naming_the_op():
    x, w = torch.randn(8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="o_proj_residual: h"):
        fd.o_proj_residual(x, w, torch.randn(5), None)
    with pytest.raises(ValueError, match="down: x must be one contiguous row"):
        fd.down(torch.randn(2, 8), w)
    with pytest.raises(ValueError, match="norm_gate_up_swiglu: w must be"):
        fd.norm_gate_up_swiglu(x, torch.ones(8), 1e-6, torch.randn(3, 8))
    with pytest.raises(ValueError, match="decode_attention"):
        fd.decode_attention(torch.randn(4, 24), torch.zeros(2, 16, 2, 24), torch.zeros(2, 16, 2, 24),
                            torch.zeros(2, dtype=torch.int32), torch.tensor([3]))
    with pytest.raises(ValueError, match="norm_qkv: b must be"):
        fd.norm_qkv(x, None, torch.ones(8), 1e-6, w, torch.zeros(3))
    with pytest.raises(ValueError, match="rope_store_attention: qkv"):
        cos, sin = _rope(16)
        fd.rope_store_attention(torch.randn(40), 1, cos, sin, None, None, 0.0, torch.zeros(2, 2, 1, 16),
                                torch.zeros(2, 2, 1, 16), torch.tensor([0]), torch.zeros(2, dtype=torch.int32),
                                torch.tensor([3]))


def _streams(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens, and the residual stream (h + residual) after every layer of every one-row step."""
    layers = llm.engine.model_runner.model.model.layers
    seen: list[torch.Tensor] = []

    def hook(module, args, out):
        h, residual = out
        if h.shape[0] * h.shape[1] == 1:
            seen.append((h.float() + residual.float()).reshape(-1).clone())

    handles = [m.register_forward_hook(hook) for m in layers]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
    for handle in handles:
        handle.remove()
    return tokens, seen


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_decode_steps_equal_the_paper_path_layer_by_layer(family, request, hf_greedy):
    """One request (one-row decode steps): every layer's residual stream through the fused kernels equals the
    unfused layer's (fp32: to 1e-5), and the tokens equal transformers' greedy tokens."""
    ckpt = request.getfixturevalue(f"{family}_ckpt")
    prompt = random_prompts(3, [11])[0]
    common = {"device": "cpu", "max_num_seqs": 1, "fused_projections": True, "enable_prefix_caching": False}
    ref_tokens, ref = _streams(LLM(ckpt, fused_decode=False, **common), prompt, 5)
    llm = LLM(ckpt, fused_decode=True, **common)
    assert "fused_decode" in llm.engine.layers_applied
    assert all(isinstance(m, fd.FusedDecoderLayer) for m in llm.engine.model_runner.model.model.layers)
    tokens, ours = _streams(llm, prompt, 5)
    assert tokens == ref_tokens == list(hf_greedy(ckpt, tuple(prompt), 5))
    assert len(ours) == len(ref) == 4 * 2  # 4 decode steps (the first token comes from the prefill) x 2 layers
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_w4a16_decode_steps_equal_the_unfused_w4_layers(tmp_path):
    """W4A16 (rtn-w4, group 32, a Llama-style tiny model; nano_quant's repacked layers, which the engine swaps
    in on CUDA and this test swaps in on the CPU): with fused_decode=True a one-row step takes the six W4
    kernels (the GEMV's add + RMSNorm prologue and residual epilogue, rope_and_store, the fused attention) and
    every layer's residual stream equals the unfused W4 layers' (fp32: to 1e-5 of the stream's largest value,
    the W4 kernel summing in another order than dequantize-then-matmul), tokens too; with fused_decode=None
    (the default) W4 layers stay unfused."""
    from quant_checkpoints import tiny_config, trained_like

    from nano_quant import quantize_model, save_quantized
    from nano_quant.layers.repacked import use_repacked_gemv

    cfg = tiny_config(qk_norm=False)
    model = trained_like(cfg)
    quantize_model(model, "rtn-w4", progress=False, group_size=32)
    ckpt = save_quantized(model, tmp_path / "w4", dtype=None)
    prompt = random_prompts(3, [11])[0]
    common = {"device": "cpu", "max_num_seqs": 1, "fused_projections": True, "enable_prefix_caching": False}

    def w4_llm(fused: bool | None) -> LLM:
        llm = LLM(ckpt, fused_decode=fused, **common)
        use_repacked_gemv(llm.engine.model_runner.model)  # what module_swap does on CUDA
        fd.apply_fused_decode(llm.engine.model_runner)  # again, now that the layers are the repacked ones
        return llm

    unfused = w4_llm(False)
    ref_tokens, ref = _streams(unfused, prompt, 3)
    runner = unfused.engine.model_runner
    runner.config = runner.config.replace(fused_decode=None)  # the default: the hook leaves W4 layers alone
    fd.apply_fused_decode(runner)
    assert not any(isinstance(m, fd.FusedDecoderLayer) for m in runner.model.model.layers)
    llm = w4_llm(True)
    layers = llm.engine.model_runner.model.model.layers
    assert all(isinstance(m, fd.FusedDecoderLayer) and m.w4 for m in layers)
    tokens, ours = _streams(llm, prompt, 3)
    assert tokens == ref_tokens
    assert len(ours) == len(ref) == 2 * 2  # 2 decode steps x 2 layers
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))


_COMPILE = """
import sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashattn_compile_check import signature
from nano_vllm.layers import fused_decode as fd

launches = []


class Capture:  # stands in for a kernel: records the launch's arguments by name
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        names = [p.name for p in self.kernel.params]
        return lambda *args, **kwargs: launches.append((self.kernel, {**dict(zip(names, args)), **kwargs}))


for name in ("_norm_qkv_kernel", "_decode_attention_kernel", "_o_proj_residual_kernel",
             "_norm_gate_up_swiglu_kernel", "_down_kernel"):
    setattr(fd, name, Capture(getattr(fd, name)))
for config in sys.argv[1:]:  # "hidden,heads_q,heads_kv,head_dim,intermediate,dtype,pdl"
    hidden, hq, hkv, d, inter = map(int, config.split(",")[:5])
    dt, pdl = getattr(torch, config.split(",")[5]), config.split(",")[6] == "1"
    fd.pdl_args = lambda device, pdl=pdl: {"PDL": pdl}
    def e(*shape, dtype=dt):
        return torch.empty(*shape, device="meta", dtype=dtype)
    def tile(kind, n, k):
        return fd.tile_config(kind, n, k, fd.MEASURED_SMS)  # the GPU's table, not the interpreter's rule
    n = (hq + 2 * hkv) * d
    x, i32, cs = e(hidden), e(1, dtype=torch.int32), e(d // 2, dtype=torch.float32)
    fd.norm_qkv(x, x, x, 1e-6, e(n, hidden), e(n), config=tile("qkv", n, hidden))
    cache, table = e(64, 16, hkv, d), e(64, dtype=torch.int32)
    ws = fd.Workspace(hkv, hq // hkv, d, torch.device("meta"))
    fd.rope_store_attention(e(n), hq, cs, cs, e(d), e(d), 1e-6, cache, cache, e(1, dtype=torch.int64), table, i32,
                            ws)
    fd.decode_attention(e(hq, d), cache, cache, table, i32, ws)
    fd.o_proj_residual(e(hq * d), e(hidden, hq * d), x, x, config=tile("o_proj", hidden, hq * d))
    fd.norm_gate_up_swiglu(x, x, 1e-6, e(2 * inter, hidden), config=tile("gate_up", inter, hidden))
    fd.down(e(inter), e(hidden, inter), config=tile("down", hidden, inter))
    print("config", config, flush=True)
    for kernel, kwargs in launches:
        options = {"num_warps": kwargs.pop("num_warps", 4), "num_stages": kwargs.pop("num_stages", 3)}
        kwargs.pop("launch_pdl", None)
        sig, consts, attrs = signature(kernel, kwargs)
        ptx = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 64),
                             options=options).asm["ptx"]
        print(kernel.__name__, "griddepcontrol" in ptx, flush=True)
    launches.clear()
print("compiled")
"""

# qwen3-0.6b's and llama3-8b's shapes at the measured tiles, with and without PDL
SM90_SHAPES = [(1024, 16, 8, 128, 3072, "bfloat16", 1), (4096, 32, 8, 128, 14336, "bfloat16", 1),
               (1024, 16, 8, 128, 3072, "float16", 0)]


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    """Every fused kernel of a layer, both attention paths (rope in the prologue, and q given), compiled for
    sm_90 with the installed Triton on meta tensors, no GPU needed: a construct the interpreter takes and
    the compiler does not (a name rebound to another type in a branch, say) fails here, not on a GPU. With
    PDL each kernel holds the grid-dependency instructions. One process: this one runs the interpreter."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(root), str(root / "tools"), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _COMPILE, *(",".join(map(str, s)) for s in SM90_SHAPES)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
    for shape, log in zip(SM90_SHAPES, done.stdout.split("config ")[1:]):
        kernels = log.splitlines()[1:7]
        assert len(kernels) == 6, (shape, log)
        assert all(line.endswith(str(bool(shape[-1]))) for line in kernels), (shape, log)
