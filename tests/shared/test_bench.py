"""shared.bench on CPU: the helpers' contracts and the CLI's smoke run. Never asserts a timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shared.bench import (
    benchmark,
    format_table,
    main,
    mbu,
    measure_copy_bandwidth,
    measure_matmul_flops,
    mfu,
    print_table,
    write_json,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_benchmark_returns_positive_seconds_and_passes_arguments():
    calls = []

    def fn(a, b, *, scale):
        calls.append((a, b, scale))
        return (a @ b) * scale

    a = torch.randn(16, 16)
    seconds = benchmark(fn, a, a, scale=2.0, warmup=2, repeats=3)
    assert seconds > 0 and len(calls) == 5 and calls[0][2] == 2.0
    assert benchmark(lambda: None, device="cpu", warmup=0, repeats=1) >= 0
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        benchmark(fn, a, a, scale=1.0, repeats=0)


def test_utilisation_ratios():
    assert mfu(375e12, 750e12) == pytest.approx(0.5)
    assert mbu(2.12e12, 4.24e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak_flops must be > 0"):
        mfu(1.0, 0)
    with pytest.raises(ValueError, match="peak_bandwidth must be > 0"):
        mbu(1.0, -1.0)


def test_physical_limits_on_cpu_are_positive():
    assert measure_copy_bandwidth("cpu", nbytes=1 << 20) > 0
    assert measure_matmul_flops("cpu", n=64) > 0


def test_table_is_aligned(capsys):
    rows = [{"op": "rms_norm", "ms": 0.123456, "GB/s": 2970.4}, {"op": "rope", "ms": 12.0, "note": "x"}]
    # text left-aligned, numbers right-aligned, missing cells blank, floats to 4 significant digits
    assert format_table(rows, title="t").splitlines() == [
        "t",
        "op            ms  GB/s  note",
        "--------  ------  ----  ----",
        "rms_norm  0.1235  2970",
        "rope          12        x",
    ]
    print_table(rows)
    assert capsys.readouterr().out.splitlines()[0] == "op            ms  GB/s  note"


def test_write_json_adds_provenance(tmp_path):
    path = tmp_path / "sub" / "r.json"
    out = write_json(path, {"bench": "x", "value": 1.5, "dtype": torch.bfloat16})
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(out, default=str))
    for key in ("date", "host", "gpu", "torch", "triton", "python", "command"):
        assert key in on_disk
    assert on_disk["torch"] == torch.__version__ and on_disk["value"] == 1.5
    assert on_disk["dtype"] == "torch.bfloat16"


def test_main_in_process(tmp_path, capsys):
    rec = main(
        ["--device", "cpu", "--quick", "--tokens", "8", "--hidden", "256", "--json", str(tmp_path / "k.json")]
    )
    out = capsys.readouterr().out
    assert "torch references" in out  # on CPU it says what it compares
    ops = {r["op"].split(" (")[0] for r in rec["rows"]}
    assert ops == {"rms_norm fwd", "add+rms_norm fwd", "rms_norm bwd", "rope", "silu_and_mul"}
    assert all(r["ms"] > 0 and r["GB/s"] > 0 for r in rec["rows"])
    # the tables come last: kernels, then the model train step against transformers
    assert out.rstrip().splitlines()[-6].startswith("silu_and_mul")
    assert [r["impl"].split()[0] for r in rec["model"]["rows"]] == ["shared.model", "transformers"]
    assert all(r["tokens/s"] > 0 and r["MFU %"] > 0 for r in rec["model"]["rows"])
    assert out.rstrip().splitlines()[-1].startswith("tiny   transformers")
    saved = json.loads((tmp_path / "k.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rec["rows"]))
    assert saved["model"]["rows"] == json.loads(json.dumps(rec["model"]["rows"]))


@pytest.mark.slow
def test_cli_quick_runs(tmp_path):
    path = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "shared.bench", "--quick", "--device", "cpu", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "rms_norm fwd" in proc.stdout and "% copy bw" in proc.stdout
    rec = json.loads(path.read_text())
    assert rec["bench"] == "shared.kernels" and rec["device"] == "cpu" and len(rec["rows"]) >= 11


def test_union_seconds_counts_overlaps_once():
    from shared.bench import device_activity_seconds, union_seconds

    assert union_seconds([]) == 0.0
    assert union_seconds([(0, 2), (1, 3), (5, 6)]) == 4.0  # [0, 3] and [5, 6]
    assert union_seconds([(4, 5), (0, 10)]) == 10.0  # a kernel inside another stream's span
    assert device_activity_seconds(lambda: None, "cpu") is None


def test_idle_ops_charges_each_gpu_gap_to_the_innermost_host_op(capsys):
    from types import SimpleNamespace

    from shared.bench import _print_idle_ops

    def ev(a, b, name="kernel"):
        return SimpleNamespace(time_range=SimpleNamespace(start=a, end=b), name=name)

    # GPU busy [0,10] [100,110] [300,310]; gaps 10→100 (inside "wait") and 110→300 (inside "step" only)
    gpu = [ev(0, 10), ev(100, 110), ev(300, 310)]
    host = [ev(0, 400, "step"), ev(5, 95, "wait"), ev(102, 108, "launch")]
    _print_idle_ops(gpu, host, top=5)
    out = capsys.readouterr().out
    assert "GPU idle 0.28 ms in 2 gaps" in out
    assert "0.09 ms      1 gaps  wait" in out and "0.19 ms      1 gaps  step" in out
