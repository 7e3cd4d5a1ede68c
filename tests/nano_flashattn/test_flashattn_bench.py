"""The bench's --quick mode runs on a CPU in seconds and writes its JSON and markdown; --sweep points at the
tool it moved to."""

from __future__ import annotations

import json
import re

import pytest
import torch

from nano_flashattn import bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="--quick on a GPU times real kernels; CPU smoke test")
def test_bench_quick_writes_json(tmp_path, capsys, monkeypatch):
    """Without a GPU the bench runs quick by default and says so, prints what the oversubscription check
    returns, and prints a CPU's small rates with significant digits (never "0.0")."""
    monkeypatch.setattr(bench, "oversubscription_warning", lambda device: f"warning: checked {device}")
    result = bench.main(["--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "note: quick run (no GPU, or --quick): tiny shapes" in out and "warning: checked cpu" in out
    assert not re.search(r"(?<![\d.])0\.0(?![\d])", out), out  # a rate printed as 0.0
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


def test_without_a_gpu_the_bench_is_quick_unless_told_otherwise(monkeypatch):
    """The full grid takes minutes on a CPU: without CUDA the quick shapes are the default; a shape given on
    the command line still wins, --no-quick keeps the grid, and with CUDA the grid is the default."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = bench.parse_args([])
    assert args.quick and (args.seqlens, args.head_dims, args.decode_contexts) == ([64, 128], [64], [256])
    args = bench.parse_args(["--seqlens", "32"])
    assert args.seqlens == [32] and args.head_dims == [64]
    args = bench.parse_args(["--no-quick"])
    assert not args.quick and args.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = bench.parse_args([])
    assert not args.quick and args.head_dims == [64, 96, 128]
    assert bench.parse_args(["--quick"]).tokens == 256


def test_rates_below_one_keep_two_significant_digits():
    assert [bench._num(x) for x in (0.0123, 0.00084, 12.34, 0.0)] == ["0.012", "0.00084", "12.3", "0.0"]
    assert bench._num(795.4, 0) == "795" and bench._num("unsupported") == "n/a"


def test_oversubscription_warning_compares_threads_with_free_cores():
    from nano_flashattn.bench_host import (
        busy_fraction,
        cgroup_cpu_quota,
        oversubscription_warning,
        usable_cores,
    )

    warn = oversubscription_warning("cpu", threads=2, processes=1, usable=2, busy=1.0)
    assert warn == ("warning: torch runs 2 intra-op thread(s) on 2 usable core(s), of which about 0.0 are "
                    "free (other work keeps 100% of them busy): CPU timings may come out many times slower "
                    "than this machine allows; rerun with OMP_NUM_THREADS=1 (or torch.set_num_threads(1))")
    assert "in each of 2 processes" in oversubscription_warning("cpu", threads=1, processes=2, usable=2, busy=0.5)
    assert "OMP_NUM_THREADS=4" in oversubscription_warning("cpu", threads=16, processes=1, usable=16, busy=0.7)
    for threads, usable, busy in ((2, 2, 0.0), (1, 2, 1.0), (16, 16, 0.05), (8, 16, 0.5)):
        assert oversubscription_warning("cpu", threads, 1, usable, busy) is None, (threads, usable, busy)
    assert oversubscription_warning("cuda", threads=64, processes=1, usable=1, busy=1.0) is None
    assert cgroup_cpu_quota("200000 100000\n") == 2.0 and cgroup_cpu_quota("max 100000") is None
    assert cgroup_cpu_quota("garbage") is None
    assert usable_cores() >= 1 and 0.0 <= busy_fraction(sample_s=0.01) <= 1.0
