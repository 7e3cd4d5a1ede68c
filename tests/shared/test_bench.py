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
    mbu,
    measure_copy_bandwidth,
    measure_matmul_flops,
    mfu,
    print_table,
    write_json,
)
from shared.bench_kernels import main  # what `python -m shared.bench` runs

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


def test_main_in_process(tmp_path, capsys, monkeypatch):
    import shared.bench

    monkeypatch.setattr(shared.bench, "oversubscription_warning", lambda device, processes: f"warning: {device}")
    rec = main(
        ["--device", "cpu", "--quick", "--tokens", "8", "--hidden", "256", "--json", str(tmp_path / "k.json")]
    )
    out = capsys.readouterr().out
    assert "torch references" in out  # on CPU it says what it compares
    assert "\nwarning: cpu\n" in out  # the CPU run asks whether torch's threads fit the free cores
    limits = next(line for line in out.splitlines() if line.startswith("physical limits on cpu"))
    assert "FLOP/s" in limits and "0.0 TFLOP/s" not in limits and "0.1 TFLOP/s" not in limits, limits
    ops = {r["op"].split(" (")[0] for r in rec["rows"]}
    assert ops == {"rms_norm fwd", "add+rms_norm fwd", "rms_norm bwd", "rope", "silu_and_mul"}
    assert all(r["ms"] > 0 and r["GB/s"] > 0 for r in rec["rows"])
    # the tables come last: kernels, then the model train step against transformers
    assert out.rstrip().splitlines()[-6].startswith("silu_and_mul")
    assert [r["impl"].split()[0] for r in rec["model"]["rows"]] == ["shared.model", "transformers"]
    assert all(r["tokens/s"] > 0 and r["MFU % (measured matmul)"] > 0 for r in rec["model"]["rows"])
    assert "MFU % (datasheet)" not in rec["model"]["rows"][0]  # a CPU has no datasheet peak here
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


def test_compiled_eager_references_are_peer_rows(monkeypatch, capsys):
    """`torch.compile`d eager references join each op's table (inductor's own speed is a GPU matter: the
    eager backend stands in for it here), and a peer that fails to compile costs its row only."""
    import shared.bench_kernels as bench

    monkeypatch.setattr(bench, "_compiled", lambda fn: torch.compile(fn, backend="eager", dynamic=False))
    rec = bench.run_kernel_bench("cpu", 8, 64, torch.float32, quick=True, compiled=True)
    by_op: dict[str, list[str]] = {}
    for r in rec["rows"]:
        by_op.setdefault(r["op"].split(" (")[0], []).append(r["impl"])
    assert all(impls[0] == "torch eager" and impls[-1] == bench.COMPILED for impls in by_op.values()), by_op
    assert len(by_op) == 5

    def broken(fn):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(bench, "_compiled", broken)
    rec = bench.run_kernel_bench("cpu", 8, 64, torch.float32, quick=True, compiled=True)
    assert bench.COMPILED not in {r["impl"] for r in rec["rows"]} and len(rec["rows"]) >= 11
    assert "no torch.compile row (RuntimeError: no C++ compiler)" in capsys.readouterr().out


def test_datasheet_peak_only_for_the_gpus_it_describes():
    from shared.bench import DATASHEET_BF16_TFLOPS, datasheet_bf16_flops

    assert DATASHEET_BF16_TFLOPS == 989.0
    assert datasheet_bf16_flops("cpu") is None


def test_report_oversubscription_prints_the_warning_on_a_cpu_only(monkeypatch, capsys):
    import nano_flashattn.bench_host
    import shared.bench

    assert shared.bench.oversubscription_warning is nano_flashattn.bench_host.oversubscription_warning
    seen = []

    def warning(device, processes):
        seen.append((str(device), processes))
        return "warning: too many threads"

    monkeypatch.setattr(shared.bench, "oversubscription_warning", warning)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert shared.bench.report_oversubscription("cpu") == "warning: too many threads"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's ranks on this host share its cores
    shared.bench.report_oversubscription(torch.device("cpu"))
    assert shared.bench.report_oversubscription("cuda") is None
    assert seen == [("cpu", 1), ("cpu", 4)]
    assert capsys.readouterr().out == "warning: too many threads\n" * 2
