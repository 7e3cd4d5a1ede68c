"""The entry points: quantize -> perplexity -> quality on a tiny checkpoint, their bad-input errors, and
(slow) the Hydra apps as the README writes them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from nano_quant import perplexity, quality, quantize
from shared.checkpoint import save_checkpoint
from shared.config import ModelConfig
from shared.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIGS = Path(quantize.__file__).parent / "configs"
ROOT = Path(__file__).resolve().parents[2]


def config(name: str, **overrides):
    cfg = OmegaConf.load(CONFIGS / f"{name}.yaml")
    cfg.merge_with(OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))
    return cfg


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside Hydra the JSON records land in the working directory
    cfg = ModelConfig.from_name("tiny").replace(num_hidden_layers=2)
    return save_checkpoint(build_model(cfg, seed=0), cfg, tmp_path / "float")


SMALL = {"calibration.corpus": "docs", "calibration.n_samples": 4, "calibration.seq_len": 32, "device": "cpu"}


def test_quantize_then_perplexity(checkpoint, tmp_path):
    row = quantize.run(config("quantize", model=checkpoint, method="awq", out=tmp_path / "awq", **SMALL))
    assert row["quant_method"] == "awq" and row["group_size"] == 128 and row["bytes"] > 0
    hf = json.loads((tmp_path / "awq" / "config.json").read_text())
    assert hf["quantization_config"]["version"] == "gemm"
    ppl = {}
    for name in ("float", "awq"):
        ppl[name] = perplexity.run(config("perplexity", model=tmp_path / name, corpus="docs", max_tokens=2048,
                                          dtype="fp32", device="cpu"))["ppl"]
    # a random model predicts almost uniformly: perplexity near the vocabulary size, AWQ barely moves it
    assert 1 < ppl["float"] < 10_000 and abs(ppl["awq"] / ppl["float"] - 1) < 0.1
    assert json.loads(Path("perplexity.json").read_text())["ppl"] == ppl["awq"]
    # the paper path alone (on CPU tensors no kernel applies: the same number)
    off = perplexity.run(config("perplexity", model=tmp_path / "awq", corpus="docs", max_tokens=2048,
                                dtype="fp32", device="cpu", performance_layers=False))
    assert off["ppl"] == ppl["awq"]


@pytest.mark.slow  # ~3-13 s; runs in the repository suite, not again in the package's fork
def test_quality_runs_every_method_it_is_given(checkpoint):
    record = quality.run(config("quality", model=checkpoint, methods="[rtn-w4,awq,naive-w8a8,smoothquant]",
                                corpus="docs", max_tokens=1024, outlier_samples=2, **{"synthetic.tokens": 256,
                                "synthetic.k": 256, "synthetic.n": 128}, **SMALL))
    assert [r["method"] for r in record["rows"]] == ["bf16", "rtn-w4", "awq", "naive-w8a8", "smoothquant"]
    assert {"awq_gap_closed", "smoothquant_vs_bf16", "smoothquant_minus_naive_w8a8"} <= set(record["summary"])
    assert len(record["outliers"]) == 4 and record["outliers"][0]["max/median, worst layer"] >= 1
    assert record["rows"][1]["decoder weight MB"] < record["rows"][0]["decoder weight MB"] / 3


def test_bad_inputs(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="model=DIR is required"):
        quantize.run(config("quantize", out=tmp_path / "x"))
    with pytest.raises(ValueError, match="out=DIR is required"):
        quantize.run(config("quantize", model=checkpoint))
    with pytest.raises(ValueError, match=r"method must be one of \[.*'awq'.*\], got 'gptq'"):
        quantize.run(config("quantize", model=checkpoint, out=tmp_path / "x", method="gptq"))
    with pytest.raises(FileNotFoundError, match="checkpoint directory .*nowhere.* does not exist"):
        quantize.run(config("quantize", model=tmp_path / "nowhere", out=tmp_path / "x", method="rtn-w4",
                            device="cpu"))
    with pytest.raises(ValueError, match="model=DIR is required"):
        perplexity.run(config("perplexity"))
    with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'fp16', 'fp32'\], got 'int4'"):
        perplexity.run(config("perplexity", model=checkpoint, dtype="int4"))
    with pytest.raises(TypeError, match="performance_layers must be a bool, got str"):
        perplexity.run(config("perplexity", model=checkpoint, performance_layers="maybe"))
    with pytest.raises(ValueError, match=r"methods \['gptq'\] are unknown"):
        quality.run(config("quality", model=checkpoint, methods="[awq,gptq]"))


@pytest.mark.slow
def test_hydra_apps_as_documented(checkpoint, tmp_path):
    """The bench needs no checkpoint: it runs beside quantize -> perplexity (single-threaded processes that
    each spend seconds importing)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "rtn"

    def app(*cmd: str) -> list[str]:
        return [sys.executable, "-m", *cmd, f"hydra.run.dir={tmp_path / cmd[0]}"]

    with subprocess.Popen(app("nano_quant.bench", "repeats=2", "warmup=1"), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as bench:
        try:
            for cmd in (["nano_quant.quantize", f"model={checkpoint}", "method=rtn-w4", f"out={out}", "device=cpu"],
                        ["nano_quant.perplexity", f"model={out}", "corpus=docs", "max_tokens=1024", "dtype=fp32"]):
                proc = subprocess.run(app(*cmd), env=env, capture_output=True, text=True, timeout=600)
                assert proc.returncode == 0, proc.stderr[-3000:]
            stdout, stderr = bench.communicate(timeout=600)
        finally:
            bench.kill()  # no-op once it has exited
        assert bench.returncode == 0, stderr[-3000:]
    # a CPU's limits with significant digits and an SI prefix (not "0 TFLOP/s")
    assert re.search(r"limits on this device: fp32 matmul 256\^3 [1-9][\d.]* [kMGTP]?FLOP/s, copy [1-9][\d.]* "
                     r"[kMGTP]?B/s", stdout), stdout[-2000:]
    assert (out / "model.safetensors").is_file() and (tmp_path / "nano_quant.bench" / "bench.json").is_file()
    assert torch.load  # the subprocesses ran the real apps
