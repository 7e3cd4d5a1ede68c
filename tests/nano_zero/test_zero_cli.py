"""The entry points: `torchrun -m nano_zero.train` (2 gloo ranks, a few steps), `nano_zero.bench quick=true`,
`python -m nano_zero.ledger` (Figure 1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nano_zero.ledger import figure1
from nano_zero.ledger import main as ledger_main
from shared.checkpoint import load_model

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_torchrun_trainer_two_ranks_stage3(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "nano_zero.train",
           "zero.stage=3", "model.num_hidden_layers=1", "train.steps=3", "train.seq_len=32",
           "train.global_batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=1",
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ZeRO stage 3, N = 2" in proc.stdout and "3.000 Ψ" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[0]["loss"] > 8.0
    model = load_model(run_dir / "checkpoint")
    assert model.config.num_hidden_layers == 1
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()
    assert sorted(p.name for p in (run_dir / "checkpoint" / "resume").iterdir()) == [
        "loop-rank00000.pt", "loop-rank00001.pt", "zero-rank00000.pt", "zero-rank00001.pt"]
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    log = (run_dir / "train.log").read_text()  # Hydra's log file holds the run's report
    assert "ZeRO stage 3, N = 2" in log and "step      3 | loss" in log
    assert f"checkpoint of step 3: {(run_dir / 'checkpoint').resolve()}" in log


@pytest.mark.slow
def test_bench_quick_runs_every_system(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_module

    import nano_zero.bench
    from nano_zero.bench import SYSTEMS, run

    checked = []  # on a CPU the bench first asks whether torch's threads fit the free cores
    monkeypatch.setattr(nano_zero.bench, "report_oversubscription", lambda device: checked.append(str(device)))

    with initialize_config_module(config_module="nano_zero.configs", version_base=None):
        # with shared.model's kernels on their paper paths, as `performance_layers=false` asks
        cfg = compose(config_name="bench", overrides=["quick=true", "performance_layers=false"])
    cwd = os.getcwd()
    os.chdir(tmp_path)  # without a Hydra run, bench.json lands in the working directory
    try:
        record = run(cfg)
    finally:
        os.chdir(cwd)
    assert [r["system"] for r in record["rows"]] == list(SYSTEMS) and checked == ["cpu"]
    assert record["performance_layers"] is False
    for r in record["rows"]:
        assert r["tokens/s"] > 0 and 8.0 < r["loss"] < 8.6  # one step from ln(4096) = 8.3
        assert r["MFU % (measured matmul)"] > 0 and "MFU % (datasheet)" not in r  # no datasheet for a CPU
    comm = {r["system"]: r["comm Ψ/step"] for r in record["rows"] if "comm Ψ/step" in r}
    assert comm == pytest.approx({"zero0": 2, "zero1": 2, "zero2": 2, "zero3": 6}, rel=1e-3)  # 2 micro-steps
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][0]["system"] == "ddp"


def test_figure1_of_the_paper(capsys):
    """Figure 1: Ψ = 7.5B, N = 64, K = 12 → 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device."""
    totals = [round(r["total GB"], 1) for r in figure1(7.5e9, 64)]
    assert totals == [120.0, 31.4, 16.6, 1.9]
    ledger_main([])
    out = capsys.readouterr().out
    assert "Pos+g+p" in out and "120" in out
