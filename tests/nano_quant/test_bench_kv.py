"""nano_quant.bench_kv on a CPU: both sections on small shapes, what each row records, the targets, the
page sizes KIVI needs, the figure, and bad configs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nano_quant import bench_kv
from shared.config import PRESETS

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIG = Path(bench_kv.__file__).parent / "configs" / "bench_kv.yaml"
ENGINE = importlib.util.find_spec("nano_vllm") is not None  # absent in a fork of nano_quant
SMALL = {"quick": False, "warmup": 1, "repeats": 2, "kernel.models": "[qwen3-0.6b]",
         "kernel.cases": "[[2,64],[1,128]]", "engine.models": "[tiny]", "engine.prompt_len": 40,
         "engine.output_len": 6, "engine.fit_seqs": 2, "engine.num_requests": 5}


def config(**overrides):
    cfg = OmegaConf.load(CONFIG)
    cfg.merge_with(OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))
    return cfg


def test_both_sections_on_small_shapes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside Hydra the JSON lands in the working directory
    record = bench_kv.run(config(**SMALL, **{"kernel.sweep": True}))
    assert "kernel.sweep: needs a CUDA GPU" in record["notes"]  # the configs are the Triton kernels'
    kernel = {(r["batch"], r["context"], r["page"], r["kv_cache_dtype"]): r for r in record["kernel"]}
    for case in ((2, 64), (1, 128)):
        auto, fp8 = kernel[(*case, 16, "auto")], kernel[(*case, 16, "fp8")]
        assert auto["vs auto"] == 1 and auto["rel err vs auto"] == 0
        assert 0 < fp8["rel err vs auto"] < 0.1  # E4M3's rounding, not a wrong kernel
        assert fp8["bytes read"] < auto["bytes read"] / 3  # 1-byte codes against fp32 on a CPU
        assert auto["heads"] == "16q/8kv x 128" and fp8["GB/s"] > 0
    kivi = [k for k in kernel if k[3].startswith("kivi")]
    assert kivi or any("kivi2" in n for n in record["notes"])  # timed (at page 32), or said why not
    assert all(k[2] == 32 for k in kivi)
    memory = {r["kv_cache_dtype"]: r for r in record["memory"]}
    if not ENGINE:  # a fork of nano_quant without nano_vllm: the kernel alone, and why
        assert not memory and any("engine.api='nano_vllm' is not installed" in n for n in record["notes"])
        return
    engine = {r["kv_cache_dtype"]: r for r in record["engine"]}
    auto, fp8 = engine["auto"], engine["fp8"]
    assert auto["vs auto"] == 1 and auto["whole sequences"] == 2 and auto["most running"] <= 2
    assert fp8["blocks"] == 4 * auto["blocks"] and fp8["most running"] == 5  # every request at once
    assert auto["output tok/s"] > 0 and auto["preemptions"] == 0
    assert list(memory) == ["auto", "fp8", "kivi2", "kivi4"]
    assert memory["fp8"]["tokens per GiB vs auto"] == 4  # E4M3 against the fp32 CPU engine
    assert memory["fp8"]["tokens per GiB, computed vs auto"] == 2  # against 16 bits
    kivi2 = 16 / (2 + 32 / 32)  # 2-bit codes, an fp16 scale and zero (32 bits) a group of 32
    assert memory["kivi2"]["tokens per GiB, computed vs auto"] == pytest.approx(kivi2)
    assert record["targets"] and json.loads((tmp_path / "bench_kv.json").read_text())["kernel"]
    matplotlib = pytest.importorskip("matplotlib")
    assert matplotlib
    from shared.report import render

    (tmp_path / "results").mkdir()
    (tmp_path / "bench_kv.json").rename(tmp_path / "results" / "bench_kv.json")
    lines = render(tmp_path / "results", tmp_path / "img", only=["kv_cache"])
    assert lines == [f"wrote {tmp_path / 'img' / 'kv_cache.png'}"]


def test_targets_by_hand():
    kernel = [(64, 16384, "fp8", 1.9), (1, 4096, "kivi2", 0.85), (1, 4096, "sdpa flash", 2)]
    record = {"kernel": [{"model": "m", "batch": b, "context": c, "kv_cache_dtype": d, "vs auto": x}
                         for b, c, d, x in kernel],
              "engine": [{"model": "m", "kv_cache_dtype": "kivi2", "vs auto": 2.1}],
              "memory": [{"model": "m", "kv_cache_dtype": "fp8", "tokens per GiB vs auto": 1.9}]}
    got = [(t["what"], t["dtype"], t["target"], t["met"]) for t in bench_kv.targets(record)]
    assert got == [("kernel m 64x16384", "fp8", 1.8, True), ("kernel m 1x4096", "kivi2", 0.9, False),
                   ("engine m", "kivi2", 2.0, True), ("memory m", "fp8", 1.95, False)]


def test_kivi_runs_at_a_page_that_holds_whole_key_groups():
    parse = bench_kv.parse_kv_cache_dtype
    pages = bench_kv.kernel_pages(config(), [parse(d) for d in ("auto", "fp8", "kivi2")])
    assert {p: [s.name for s in specs] for p, specs in pages.items()} == {16: ["auto", "fp8"],
                                                                         32: ["auto", "kivi2"]}
    cfg = config(**{"kivi.group_size": 16})
    pages = bench_kv.kernel_pages(cfg, [parse(d, group_size=16) for d in ("kivi4", "auto")])
    assert {p: [s.name for s in specs] for p, specs in pages.items()} == {16: ["auto", "kivi4"]}
    assert bench_kv.block_size(config()) == 32
    assert bench_kv.block_size(config(kv_cache_dtypes="[auto,fp8]")) == 16


def test_fewer_layers_of_a_preset():
    name = bench_kv.engine_model("llama3-8b", 2)
    assert name == "llama3-8b-2layers" and PRESETS[name].num_hidden_layers == 2
    assert PRESETS[name].hidden_size == PRESETS["llama3-8b"].hidden_size
    assert bench_kv.engine_model("tiny", None) == "tiny" and bench_kv.engine_model("tiny", 99) == "tiny"


def test_bad_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"sections \['fast'\] are unknown"):
        bench_kv.run(config(sections="[fast]"))
    with pytest.raises(ValueError, match="must include 'auto'"):
        bench_kv.run(config(kv_cache_dtypes="[fp8]"))
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*got 'int3'"):
        bench_kv.run(config(kv_cache_dtypes="[auto,int3]"))
    with pytest.raises(ValueError, match="engine.layers .* one entry per engine.models model"):
        bench_kv.run(config(**{**SMALL, "sections": "[engine]", "engine.layers": "[1,2]"}))
    with pytest.raises(ValueError, match=r"context \(100\) must be a multiple of the page size \(16\)"):
        bench_kv.paged_cache(1, 100, 2, 32, 16, bench_kv.torch.float32, bench_kv.torch.device("cpu"))
