"""`python -m shared.report` draws each figure from small synthetic records shaped like the benches' JSON,
skips (and says so) a figure whose input is missing or lacks a field, and says how to get matplotlib."""

from __future__ import annotations

import builtins
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared import report

pytest.importorskip("matplotlib")

FLASHATTN = {  # nano_flashattn.bench: bench.json
    "env": {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "date": "2026-11-30"},
    "ceilings": {"matmul_tflops": 750.0, "copy_tbps": 4.22},
    "attention": [{"head_dim": 128, "causal": c, "seqlen": s, "batch": 16384 // s, "heads": 16,
                   "ours_fwd": 300.0 + s / 100, "ours_bwd": 200.0, "sdpa_flash_fwd": 250.0,
                   "sdpa_flash_bwd": 180.0, "sdpa_cudnn_fwd": 500.0, "sdpa_cudnn_bwd": "unsupported: shape"}
                  for c in (False, True) for s in (512, 1024, 2048)],
    "decode": [{"batch": b, "context": c, "kv_bytes": 2 * b * c * 8 * 128 * 2, "ours_contiguous": 4.1,
                "ours_paged16": 3.9, "sdpa_flash": 2.4, "sdpa_cudnn": 4.0}
               for b in (1, 64) for c in (4096, 16384)],
}
VLLM = {"bench": "nano_vllm", "model": "qwen3-0.6b", "date": "2026-12-01T04:58:00+00:00",
        "gpu": "NVIDIA H200", "workload": {"num_seqs": 256}, "copy_GBps": 3808.0, "matmul_TFLOPs": 787.0,
        "roofline_tok_per_s": 32416.0, "rows": [
            {"system": "nano_vllm", "output tok/s": 17449.0, "% of roofline": 53.8},
            {"system": "transformers 5.17.0 CB", "output tok/s": 392.0, "% of roofline": 1.2}],
        "performance_layers": {"async_scheduling": True, "gemv_max_tokens": 0},
        "timeline": {"summary": {"host_busy_ms_per_step": 0.6, "device_busy_ms_per_step": 7.0,
                                 "device_idle_ms_per_step": 0.05},
                     "window": {"host": [[p, 7.5 * i + j, 7.5 * i + j + 0.2]
                                         for i in range(4) for j, p in enumerate(("postprocess", "schedule",
                                                                                  "prepare", "launch"))],
                                "device": [[7.5 * i + 0.1, 7.5 * i + 7.4] for i in range(4)]}},
        "kernel_profile": {"available": True, "steps": 32, "kernels/step": 155.0, "device span us/step": 859.0,
                           "device busy us/step": 814.0, "bubbles us/step": 45.0, "gaps": [], "kernels": [
                               {"kernel": "_decode_attention_kernel", "launches/step": 28.0, "us/launch": 6.2,
                                "us/step": 173.1},
                               {"kernel": "_norm_qkv_rope_store_kernel", "launches/step": 28.0, "us/launch": 5.9,
                                "us/step": 165.5, "GB/s": 1422.0}]}}
SHARED = {"bench": "shared.kernels", "matmul_TFLOPs": 797.0, "copy_GBps": 4250.0, "rows": [],
          "model": {"model": "qwen3-0.6b", "rows": [{"impl": "shared.model", "MFU %": 43.3},
                                                    {"impl": "transformers 5.17", "MFU %": 29.9}]}}
MEGATRON = {"bench": "nano_megatron", "peak_TFLOPs_for_MFU": 989.0, "matmul_TFLOPs_measured": 790.0, "rows": [
    {"system": "tp", "GPUs": 2, "MFU %": 41.0, "scaling eff %": 82.1},
    {"system": "dtensor_tp", "GPUs": 2, "MFU %": 22.4, "scaling eff %": 44.9}]}
ZERO = {"bench": "nano_zero", "world_size": 2, "rows": [
    {"system": "zero3", "tokens/s": 116910.0, "scaling efficiency": 0.92, "MFU % (measured peak)": 50.0,
     "MFU % (datasheet peak)": 40.3}]}
SGLANG_SYSTEMS = (("nano_sglang", 0.92, 450.0), ("nano_vllm, prefix caching off", 0.0, 38.0),
                  ("nano_vllm, prefix caching on", 0.92, 468.0))
SGLANG = {"bench": "nano_sglang", "model": "llama3-8b", "rows": [
    {"workload": w, "system": s, "hit rate": h, "optimal hit rate": 0.93, "programs/s": p,
     "vs vllm off": p / 38} for w in ("kshot", "chat") for s, h, p in SGLANG_SYSTEMS]}
DISTSERVE = {"mode": "measured", "workload": {"name": "summarization", "ttft_slo": 1.05, "tpot_slo": 0.0105},
             "engine": {"model": "llama3-8b"}, "rates": [4, 6, 8], "systems": [
                 {"system": "colocated", "gpus": 1, "attainment": [0.98, 0.88, 0.58],
                  "sim_attainment": [0.98, 0.9, 0.55], "goodput_per_gpu": 5.0, "sim_goodput_per_gpu": 6.1},
                 {"system": "colocated_chunked", "gpus": 1, "attainment": [1.0, 0.95, 0.78],
                  "sim_attainment": [1.0, 0.98, 0.84], "goodput_per_gpu": 7.0, "sim_goodput_per_gpu": 7.7}]}
SPECDEC = {"bench": "nano_specdec", "model": "llama-100m", "num_speculative_tokens": 4, "gpu": "NVIDIA H100",
           "rows": [{"workload": w, "method": m, "batch": b, "temperature": t, "speedup": 1.5 / b ** 0.2,
                     "tau": 2.5 - t} for w in ("code", "edit") for m in ("ngram", "draft_model")
                    for b in (1, 4, 16) for t in (0.0, 1.0)],
           "cost": {"label": "projection", "model": "llama3-8b", "projection": [
               {"workload": "edit", "method": "ngram", "batch": b, "temperature": 0.0, "projected speedup": 1.8}
               for b in (1, 4)]}}
KV = {"bench": "nano_quant.bench_kv", "gpu": "NVIDIA H100",  # nano_quant.bench_kv: bench_kv.json
      "kernel": [{"model": "llama3-8b", "batch": b, "context": c, "page": 16, "kv_cache_dtype": d, "vs auto": x}
                 for b, c in ((64, 16384), (1, 4096)) for d, x in (("auto", 1.0), ("fp8", 1.9))],
      "engine": [{"model": "qwen3-0.6b", "kv_cache_dtype": d, "vs auto": x} for d, x in (("auto", 1), ("fp8", 1.6))],
      "memory": [{"model": "qwen3-0.6b", "kv_cache_dtype": "fp8", "tokens per GiB vs auto": 2.0},
                 {"model": "qwen3-0.6b", "kv_cache_dtype": "kivi2", "tokens per GiB, computed vs auto": 5.3}]}
ALL = {"nano_flashattn.json": FLASHATTN, "nano_vllm.json": VLLM, "shared.json": SHARED,
       "nano_megatron.json": MEGATRON, "nano_zero.json": ZERO, "nano_sglang.json": SGLANG,
       "nano_distserve_summarization.json": DISTSERVE, "nano_specdec.json": SPECDEC, "bench_kv.json": KV}
EXPECTED = ["attention_hd128.png", "decode.png", "vllm_roofline.png", "vllm_timeline.png", "vllm_kernels.png",
            "mfu_scaling.png",
            "sglang_hit_rate.png", "distserve_slo.png", "specdec_speedup.png", "kv_cache.png"]


def _write(directory: Path, records: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, rec in records.items():
        (directory / name).write_text(json.dumps(rec))
    return directory


@pytest.mark.slow  # ~3-13 s; runs in the repository suite, not again in the package's fork
def test_every_figure_from_the_benches_json(tmp_path):
    results = _write(tmp_path / "results", {**ALL, "notes.json": {"something": "else"}})
    lines = report.main(["--results", str(results), "--out", str(tmp_path / "img")])
    for name in EXPECTED:
        png = tmp_path / "img" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"wrote {png}" in lines
    assert "ignored notes.json: no figure reads this record" in lines
    assert not [line for line in lines if line.startswith("skipped")]


def test_the_mfu_bars_say_their_denominator():
    bars = report._mfu_bars("nano_megatron.json", MEGATRON) + report._mfu_bars("shared.json", SHARED)
    assert ("nano_megatron: tp (2 GPUs)", 41.0, "datasheet 989 TFLOP/s") in bars
    assert ("shared: qwen3-0.6b step, shared.model", 43.3, "measured 797 TFLOP/s") in bars
    assert {b[2] for b in report._mfu_bars("nano_zero.json", ZERO)} == {"measured", "datasheet"}
    assert report._scaling_bars("nano_zero.json", ZERO) == [("nano_zero: zero3", 92.0)]
    # the labels nano_megatron's, nano_zero's and shared's benches write, with the peaks they record
    one_gpu = {"bench": "nano_megatron", "matmul_TFLOPs_measured": 793.0, "peak_TFLOPs_datasheet": 989.0,
               "rows": [{"system": "tp", "GPUs": 1, "MFU % (datasheet)": 50.7, "MFU % (measured matmul)": 63.2}]}
    assert report._mfu_bars("nano_megatron_1gpu.json", one_gpu) == [
        ("nano_megatron_1gpu: tp (1 GPU)", 50.7, "datasheet 989 TFLOP/s"),
        ("nano_megatron_1gpu: tp (1 GPU)", 63.2, "measured 793 TFLOP/s")]


def test_missing_inputs_are_skipped_and_named(tmp_path):
    broken = {k: v for k, v in VLLM.items() if k != "roofline_tok_per_s"}
    results = _write(tmp_path / "results", {"nano_sglang.json": SGLANG, "nano_vllm.json": broken})
    lines = report.render(results, tmp_path / "img")
    assert f"wrote {tmp_path / 'img' / 'sglang_hit_rate.png'}" in lines
    assert any(line.startswith("skipped vllm: nano_vllm.json") and "roofline_tok_per_s" in line
               for line in lines)
    assert any(line.startswith("skipped attention: no flashattn JSON") and "nano_flashattn.bench" in line
               for line in lines)
    assert any(line.startswith("skipped distserve: no distserve JSON") for line in lines)
    assert not (tmp_path / "img" / "vllm_roofline.png").exists()


def test_a_json_decoding_only_sglang_run_draws_no_hit_rates(tmp_path):
    """`workloads=[]` writes no workload rows: that file gets no figure, the others theirs."""
    only_json = {**SGLANG, "rows": [], "json": [{"system": "nano_sglang JSON, jump-forward on", "programs/s": 1.0}]}
    results = _write(tmp_path / "results", {"nano_sglang.json": SGLANG, "nano_sglang_json.json": only_json})
    lines = report.render(results, tmp_path / "img", only=["sglang"])
    assert [p.name for p in (tmp_path / "img").glob("*.png")] == ["sglang_hit_rate_nano_sglang.png"], lines


def test_transcribed_json_draws_nothing(tmp_path):
    """A JSON transcribed from a printed table (`source` says so) is ignored, and the notes say why."""
    transcribed = {**SGLANG, "source": "transcribed from the tables the bench printed"}
    results = _write(tmp_path / "results", {"nano_sglang.json": transcribed})
    lines = report.render(results, tmp_path / "img", only=["sglang"])
    assert any("ignored nano_sglang.json: transcribed" in line for line in lines), lines
    assert not list((tmp_path / "img").glob("*.png"))


def test_only_draws_the_named_figures(tmp_path):
    results = _write(tmp_path / "results", ALL)
    lines = report.render(results, tmp_path / "img", only=["distserve"])
    assert lines == [f"wrote {tmp_path / 'img' / 'distserve_slo.png'}"]


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        report.render(tmp_path / "no_such_dir", tmp_path / "img")
    results = _write(tmp_path / "results", {})
    (results / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        report.render(results, tmp_path / "img")
    with pytest.raises(ValueError, match="unknown figure"):
        report.render(results, tmp_path / "img", only=["nope"])


def test_without_matplotlib_it_says_how_to_get_it(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit, match=r'pip install -e "\.\[plot\]"'):
        report.main(["--results", str(tmp_path), "--out", str(tmp_path / "img")])


def test_cli(tmp_path):
    results = _write(tmp_path / "results", {"nano_distserve.json": DISTSERVE})
    out = subprocess.run([sys.executable, "-m", "shared.report", "--results", str(results), "--out",
                          str(tmp_path / "img")], capture_output=True, text=True, check=True).stdout
    assert "distserve_slo.png" in out and "skipped attention" in out


def test_docs_img_holds_the_figures_the_pages_show():
    """Every PNG in docs/img is shown by a page (a Markdown `img/NAME.png`), and every one a page shows
    is there."""
    shown = report.shown_figures()
    on_disk = {p.name for p in report.DOCS_IMG.glob("*.png")}
    assert not on_disk - shown, f"in docs/img, shown by no page: {sorted(on_disk - shown)}"
    assert not shown - on_disk, f"shown by a page, missing from docs/img: {sorted(shown - on_disk)}"


def test_into_docs_img_only_shown_figures_are_kept(tmp_path, monkeypatch):
    """Drawn into the pages' folder, a figure no page shows is removed and named; elsewhere all stay."""
    results = _write(tmp_path / "results", ALL)
    monkeypatch.setattr(report, "DOCS_IMG", (tmp_path / "img").resolve())
    monkeypatch.setattr(report, "shown_figures", lambda: {"distserve_slo.png"})
    lines = report.render(results, tmp_path / "img", only=["distserve", "sglang"])
    assert any(line.startswith("wrote") and line.endswith("distserve_slo.png") for line in lines), lines
    assert any(line.startswith("not kept") and "sglang_hit_rate.png" in line for line in lines), lines
    assert sorted(p.name for p in (tmp_path / "img").glob("*.png")) == ["distserve_slo.png"]
