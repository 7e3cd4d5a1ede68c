"""The bench's --quick mode runs on a CPU in seconds and writes its JSON and markdown."""

from __future__ import annotations

import json

import pytest
import torch

from nano_flashattn import bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="--quick on a GPU times real kernels; CPU smoke test")
def test_bench_quick_writes_json(tmp_path):
    result = bench.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["ceilings"]["matmul_tflops"] > 0 and saved["ceilings"]["copy_tbps"] > 0
    assert len(saved["attention"]) == 4 and len(saved["decode"]) == 1
    row = result["attention"][0]
    for key in ("ours_fwd", "ours_bwd", "sdpa_fwd", "sdpa_bwd"):
        assert row[key] > 0, key
    assert saved["decode"][0]["ours_paged16"] > 0
    assert "| hd | causal | seqlen |" in (tmp_path / "bench.md").read_text()
