"""nano_quant.kv_quality: the decode-cache attention reads what KIVICache holds at every decoding step, the
retrieval probe's questions, greedy agreement, and the whole evaluation on a tiny checkpoint (CPU)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from nano_quant import kv_quality
from nano_quant.kv import KIVICache, dequantize_fp8, parse_kv_cache_dtype, quantize_fp8
from nano_quant.kv_quality import DecodeCacheAttention, agreement, build_probes, grade
from shared.checkpoint import save_checkpoint
from shared.config import ModelConfig
from shared.data import stdlib_split
from shared.model import build_model, sdpa_attention
from shared.tokenizer import get_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIG = Path(kv_quality.__file__).parent / "configs" / "kv_quality.yaml"
ENGINE = importlib.util.find_spec("nano_vllm") is not None  # absent in a fork of nano_quant


def qkv(batch: int = 2, s: int = 70, hq: int = 4, hk: int = 2, d: int = 32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, s, h, d, generator=gen) for h in (hq, hk, hk))
    k[..., 3] *= 8  # an outlier channel, as KIVI's keys have
    return q, k, v


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query row (heads_q, d) against keys (n, heads_k, d), in fp64."""
    rep = q.shape[0] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    p = (torch.einsum("hd,nhd->hn", q.double(), k) / math.sqrt(q.shape[-1])).softmax(-1)
    return torch.einsum("hn,nhd->hd", p, v)


@pytest.mark.parametrize("name", ["kivi2", "kivi4"])
def test_each_query_reads_the_cache_kivicache_holds_when_it_decodes(name):
    """Token by token through KIVICache (Algorithm 1's decoding): query i attends to what the cache
    dequantizes after token i was appended — the window, the key groups that left it, the values."""
    spec = parse_kv_cache_dtype(name, group_size=16, residual=8)
    q, k, v = qkv()
    out = DecodeCacheAttention(spec, query_chunk=16)(q, k, v)
    for b in range(q.shape[0]):
        cache = KIVICache(spec)
        for i in range(q.shape[1]):
            cache.append(k[b, i: i + 1], v[b, i: i + 1])
            ck, cv = cache.dequantize()
            want = softmax_attention(q[b, i], ck, cv)
            torch.testing.assert_close(out[b, i].double(), want, atol=1e-5, rtol=1e-5)
    # quantization is visible: not the 16-bit answer
    exact = DecodeCacheAttention(parse_kv_cache_dtype("auto"))(q, k, v)
    assert (out - exact).abs().max() > 1e-2


def test_auto_is_causal_attention_and_fp8_reads_e4m3_values():
    q, k, v = qkv(s=40)
    auto = DecodeCacheAttention(parse_kv_cache_dtype("auto"), query_chunk=7)(q, k, v)
    torch.testing.assert_close(auto, sdpa_attention(q, k, v), atol=1e-5, rtol=1e-5)
    scale = torch.tensor(0.05)
    fp8 = DecodeCacheAttention(parse_kv_cache_dtype("fp8"), fp8_scale=0.05)(q, k, v)
    kq, vq = (dequantize_fp8(quantize_fp8(x, scale), scale) for x in (k, v))
    torch.testing.assert_close(fp8, sdpa_attention(q, kq, vq), atol=1e-5, rtol=1e-5)


def test_the_window_and_whole_key_groups():
    """G = 32, R = 128: at R + G - 1 tokens no key group has left the window and G - 1 values have;
    at R + G one key group and G values (nano_quant.kv's boundary)."""
    attn = DecodeCacheAttention(parse_kv_cache_dtype("kivi2"))
    nk, nv = attn.quantized_counts(200, torch.device("cpu"))
    assert (nk[158].item(), nv[158].item()) == (0, 31) and (nk[159].item(), nv[159].item()) == (32, 32)
    assert nk[127].item() == nv[127].item() == 0 and nv[128].item() == 1
    nk, nv = DecodeCacheAttention(parse_kv_cache_dtype("fp8")).quantized_counts(5, torch.device("cpu"))
    assert nk.tolist() == nv.tolist() == [1, 2, 3, 4, 5]


def document(defined: str, filler: int = 120, duplicate: str | None = None) -> str:
    lines = ['"""A module."""', "import os", defined, *([duplicate] if duplicate else [])]
    lines += [f"def helper_{i}(arg_{i}, scale={i}):\n    return arg_{i} * {i}\n" for i in range(filler)]
    return "\n".join(lines) + "\n"


def test_probes_ask_for_a_definition_made_early():
    enc = get_tokenizer()
    docs = [("a.py", document("MAGIC_VALUE = 123457")), ("short.py", "X_SHORT = 99\n"),
            ("dup.py", document("OTHER_VALUE = 424242", duplicate="OTHER_VALUE = 424242"))]
    probes = build_probes(docs, context=512, num=10, per_file=1)
    assert [p.file for p in probes] == ["a.py", "dup.py"]  # the short file has no long context
    first = probes[0]
    assert (first.kind, first.question, first.answer, first.line) == ("assign", "MAGIC_VALUE =", "123457", 3)
    text = enc.decode(first.prompt)
    assert text.startswith('"""A module."""') and text.endswith("\nMAGIC_VALUE =")
    assert text.count("123457") == 1 and first.distance > 0.75 * len(first.prompt)
    assert 0.9 * (512 - 24 - 2 - 16) <= len(first.prompt) <= 512 - first.answer_tokens - 2
    # dup.py's constant is assigned twice: its question would be ambiguous, a function is asked instead
    second = probes[1]
    assert (second.kind, second.question, second.answer) == ("def", "def helper_0", "(arg_0, scale=0):")
    assert grade(first, " 123457\nNEXT") and grade(first, "123457") and not grade(first, " 123456\n")


def test_agreement_by_hand():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = agreement(ref, [[1, 2, 3, 4], [5, 9, 7, 8]])
    assert got == {"identical token fraction": 0.875, "first divergence mean": 2.5,
                   "first divergence median": 2.5, "identical prompts": 0.5}


def config(tmp_path: Path, **overrides):
    cfg = OmegaConf.load(CONFIG)
    cfg.merge_with(OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))
    return cfg


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside Hydra the JSON record lands in the working directory
    cfg = ModelConfig.from_name("tiny").replace(num_hidden_layers=2, max_position_embeddings=384)
    ckpt = save_checkpoint(build_model(cfg, seed=0), cfg, tmp_path / "float")
    root = tmp_path / "lib"  # a stdlib of three long modules, in whichever split their names hash to
    root.mkdir()
    names = [f"mod{i}.py" for i in range(40)]
    split = stdlib_split(names[0])
    for i, name in enumerate([n for n in names if stdlib_split(n) == split][:3]):
        (root / name).write_text(document(f"CONSTANT_{i} = {1000 + 37 * i}"))
    return ckpt, root, split


def test_the_evaluation_end_to_end(tiny, tmp_path):
    ckpt, root, split = tiny
    record = kv_quality.run(config(tmp_path, model=ckpt, device="cpu", dtype="fp32", **{
        "kivi.group_size": 16, "kivi.residual": 0, "perplexity.other_residual": 40,
        "perplexity.corpus": "docs", "perplexity.seq_len": 96, "perplexity.max_tokens": 400,
        "probe.root": root, "probe.split": split, "probe.num": 3, "probe.per_file": 1,
        "agreement.num_prompts": 2, "agreement.prompt_len": 40, "agreement.max_tokens": 6}))
    rows = {r["kv_cache_dtype"]: r for r in record["rows"]}
    assert list(rows) == ["auto", "fp8", "kivi2", "kivi4", "kivi2, R=40", "kivi4, R=40"]
    assert record["context"] == 384 and "probe accuracy" not in rows["kivi2, R=40"]  # perplexity alone
    assert rows["kivi2"]["ppl"] != rows["kivi2, R=40"]["ppl"] != auto_ppl(rows)
    auto = rows["auto"]
    assert auto["ppl vs auto"] == 0 and auto["ppl"] == pytest.approx(auto["ppl, model's attention"], rel=1e-5)
    assert auto["tokens"] == 4 * 96 and len(record["probes"]) == 3
    for name in ("fp8", "kivi2", "kivi4"):
        assert rows[name]["ppl"] != auto["ppl"]  # every dtype's codes change the forward
    if not ENGINE:  # a fork of nano_quant without nano_vllm: the perplexity alone, and why
        assert record["notes"] == ["the retrieval probe and greedy agreement need a serving engine: "
                                   "engine_api='nano_vllm' is not installed"]
        return
    assert auto["identical token fraction"] == 1
    assert 0 <= rows["fp8"]["identical token fraction"] <= 1
    assert rows["fp8"]["probe accuracy"] in (0, 1 / 3, 2 / 3, 1)
    for name in ("fp8", "kivi2", "kivi4"):
        assert "skipped" in rows[name] or "probe accuracy" in rows[name]  # the engine serves it, or says not
    assert all("auto" in p for p in record["probes"])
    saved = json.loads((tmp_path / "kv_quality.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(record["rows"])) and "targets" in saved


def auto_ppl(rows: dict) -> float:
    return rows["auto"]["ppl"]


def test_bad_inputs(tiny, tmp_path):
    ckpt, _, _ = tiny
    with pytest.raises(ValueError, match="model=DIR is required"):
        kv_quality.run(config(tmp_path))
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*got 'int3'"):
        kv_quality.run(config(tmp_path, model=ckpt, kv_cache_dtypes="[auto,int3]"))
    with pytest.raises(ValueError, match="must include 'auto'"):
        kv_quality.run(config(tmp_path, model=ckpt, kv_cache_dtypes="[fp8]"))
    with pytest.raises(ValueError, match=r"group_size \(12\) must be a positive multiple of 16"):
        kv_quality.run(config(tmp_path, model=ckpt, **{"kivi.group_size": 12}))
    with pytest.raises(ValueError, match="fp8_scale must be a positive number"):
        DecodeCacheAttention(parse_kv_cache_dtype("fp8"), fp8_scale=0)
    with pytest.raises(ValueError, match="head_dim 32 is not a multiple of the KIVI group size 64"):
        DecodeCacheAttention(parse_kv_cache_dtype("kivi2", group_size=64))(*qkv(s=8))
    with pytest.raises(ValueError, match=r"agreement.prompt_len \(400\) \+ max_tokens \(128\) must fit"):
        kv_quality.run(config(tmp_path, model=ckpt, device="cpu", dtype="fp32", **{
            "perplexity.enabled": False, "probe.enabled": False, "agreement.prompt_len": 400}))
