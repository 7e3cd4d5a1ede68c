"""The bench's --quick mode runs on a CPU in seconds and writes its JSON and markdown; --sweep points at the
tool it moved to."""

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
    assert saved["decode"][0]["ours_paged16"] > 0 and saved["decode"][0]["head_dim"] == 64
    md = (tmp_path / "bench.md").read_text()
    assert "| hd | causal | seqlen |" in md and "| hd | causal | seqlen | pass | ours | vs hd128 |" in md
    assert saved["env"]["performance_layers"] is True and saved["env"]["missing_layers"] == []


def test_bench_paper_path_switch(monkeypatch):
    """--paper-path: the run's lookups find no layer; the switch ends with the run."""
    from nano_flashattn.registry import layers_enabled

    args = bench.parse_args(["--paper-path", "--no-gluon-forward"])
    assert args.paper_path and args.no_gluon_forward
    seen = []
    monkeypatch.setattr(bench, "run", lambda args, argv, sweep: seen.append(layers_enabled()))
    bench.main(["--paper-path"])
    bench.main([])
    assert seen == [False, True] and layers_enabled()


def test_bench_sweep_names_the_tool(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--sweep"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--sweep moved to the repository's tools/: run `python tools/flashattn_sweep.py" in err


def test_bench_rows_each_head_dim_against_128():
    """The summary divides every head_dim's number by head_dim 128's at the same shape, and by each peer."""
    peers = {f"sdpa_{p}_{ps}": v for p, v in (("cudnn", 400.0), ("flash", 300.0)) for ps in ("fwd", "bwd")}
    attn = [{"head_dim": d, "causal": True, "seqlen": 4096, "ours_fwd": f, "ours_bwd": 2 * f, **peers}
            for d, f in ((64, 360.0), (128, 400.0))]
    lines = bench.summary({"attention": attn, "decode": []})
    assert "| 64 | True | 4096 | fwd | 360 | 0.90x | 0.90x | 1.20x |" in lines
    assert "| 128 | True | 4096 | bwd | 800 | - | 2.00x | 2.67x |" in lines
