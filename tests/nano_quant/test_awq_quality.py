"""quality's fp32 evaluation: the W4A16 rows measured with the exact dequantized weights in fp32."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from nano_quant import quality
from nano_quant.perplexity import perplexity
from nano_quant.quant import fake_quantize_groupwise
from shared.checkpoint import load_model, save_checkpoint
from shared.config import ModelConfig
from shared.data import corpus_tokens
from shared.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow  # ~3-13 s; runs in the repository suite, not again in the package's fork
def test_fp32_eval_is_the_fake_quantized_model_in_fp32(tmp_path, monkeypatch):
    """RTN's fp32 perplexity equals that of the float model with every decoder weight replaced by Q(W)
    (quant.fake_quantize_groupwise, independent of the packing and the kernels); the summary gives AWQ's
    share of the gap in fp32 too; without fp32_eval no row carries the column."""
    monkeypatch.chdir(tmp_path)
    cfg = ModelConfig.from_name("tiny").replace(num_hidden_layers=2)
    path = save_checkpoint(build_model(cfg, seed=0), cfg, tmp_path / "float")
    overrides = {"model": path, "methods": "[rtn-w4,awq]", "corpus": "docs", "max_tokens": 1024,
                 "outlier_samples": 2, "device": "cpu", "synthetic.tokens": 256, "synthetic.k": 256,
                 "synthetic.n": 128, "calibration.corpus": "docs", "calibration.n_samples": 4,
                 "calibration.seq_len": 32}
    qcfg = OmegaConf.load(quality.__file__.replace("quality.py", "configs/quality.yaml"))
    qcfg.merge_with(OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))
    record = quality.run(qcfg)
    rows = {r["method"]: r for r in record["rows"]}
    model = load_model(path, device="cpu", dtype=torch.float32)
    tokens = corpus_tokens("val", corpus="docs")[:1025]
    assert rows["bf16"]["ppl fp32"] == pytest.approx(perplexity(model, tokens)["ppl"], rel=1e-6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and p.dim() == 2:
                p.copy_(fake_quantize_groupwise(p, 128, 4, True))
    assert rows["rtn-w4"]["ppl fp32"] == pytest.approx(perplexity(model, tokens)["ppl"], rel=1e-5)
    assert "ppl fp32" in rows["awq"] and "awq_gap_closed_fp32" in record["summary"]
    qcfg.fp32_eval = False
    assert not any("ppl fp32" in r for r in quality.run(qcfg)["rows"])
