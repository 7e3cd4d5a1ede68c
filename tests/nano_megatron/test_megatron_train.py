"""The Hydra trainer and the bench, end to end: `python -m nano_megatron.train` as one process, the same
app on 2 gloo ranks (tp=2 + sequence parallel, pp=2 with stop/resume), and `nano_megatron.bench --quick`.

One 2-rank job runs every multi-process case (spawning torch processes costs seconds); it calls the
Hydra entry points themselves with command-line overrides, as torchrun would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.checkpoint import load_model, load_state_dict
from shared.dist import run_distributed

# multi-process runs shared by the module's tests: the forkability test leaves them to the repository run
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# A small variant of the tiny preset; lr / eps as in megatron_cases (see its docstring).
COMMON = ["model=tiny", "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
          "model.head_dim=16", "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1",
          "train.lr=1e-3", "train.min_lr=0", "train.eps=1e-6", "train.warmup_steps=1"]


def _hydra(entry, overrides: list[str]) -> None:
    """Run a Hydra `main` as `python -m ...` would, with these command-line overrides."""
    argv = sys.argv
    sys.argv = ["prog", *overrides]
    try:
        entry()
    finally:
        sys.argv = argv


def _two_rank_job(tmp: str) -> None:
    from nano_megatron import bench, train

    t = Path(tmp)
    _hydra(train.main, [*COMMON, "parallel.tp=2", "parallel.sequence_parallel=true", "train.steps=3",
                        f"hydra.run.dir={t / 'tp2'}"])
    pp = [*COMMON, "parallel.pp=2", "train.steps=4"]
    _hydra(train.main, [*pp, f"hydra.run.dir={t / 'pp2-full'}"])
    _hydra(train.main, [*pp, "train.stop_at=2", f"hydra.run.dir={t / 'pp2-first-half'}"])
    _hydra(train.main, [*pp, f"train.resume_from={t / 'pp2-first-half' / 'checkpoint'}",
                        f"hydra.run.dir={t / 'pp2-resumed'}"])
    _hydra(bench.main, ["quick=true", f"hydra.run.dir={t / 'bench'}"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron_train")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # the single-threaded one-process run goes on beside the 2-rank job, whose ranks often wait on each other
    # (the reference run takes the paper path alone: on a CPU no layer applies anyway)
    with subprocess.Popen([sys.executable, "-m", "nano_megatron.train", *COMMON, "train.steps=3",
                           "performance_layers=false", f"hydra.run.dir={tmp / 'single'}"], env=env,
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as single:
        try:
            run_distributed(_two_rank_job, 2, str(tmp), timeout_s=240.0)
            _, stderr = single.communicate(timeout=240)
        finally:
            single.kill()  # no-op once it has exited
        assert single.returncode == 0, stderr[-3000:]
    return tmp


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_single_process_run_writes_metrics_and_hf_checkpoint(runs):
    records = _metrics(runs / "single")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 and "mfu" in r for r in records)
    assert (runs / "single" / ".hydra" / "config.yaml").is_file()  # the run keeps its config
    log = (runs / "single" / "train.log").read_text()  # Hydra's log file holds the run's report
    assert "nano_megatron: tp=1 pp=1 dp=1" in log and "step      3 | loss" in log
    assert "; performance layers off;" in log
    assert f"checkpoint of step 3: {(runs / 'single' / 'checkpoint').resolve()}" in log
    model = load_model(runs / "single" / "checkpoint")
    assert model.config.num_hidden_layers == 2


def test_tensor_and_sequence_parallel_run_equals_single_process(runs):
    single, tp2 = _metrics(runs / "single"), _metrics(runs / "tp2")
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(single, tp2)) < 1e-5
    # LocalEngine's norm is an fp32 CPU reduction over whole tensors, itself ~5e-5 off the fp64 value
    # here (ours accumulates in fp64); clipping scales all gradients alike, which Adam barely sees.
    assert max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(single, tp2)) < 2e-4
    a, b = load_state_dict(runs / "single" / "checkpoint"), load_state_dict(runs / "tp2" / "checkpoint")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_checkpoint_loads_in_transformers(runs):
    transformers = pytest.importorskip("transformers")
    ckpt = runs / "tp2" / "checkpoint"
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    ids = torch.randint(0, 4096, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, load_model(ckpt)(ids), atol=1e-4, rtol=1e-4)


def test_pipeline_run_resumes_where_it_stopped(runs):
    full, first, resumed = (_metrics(runs / n) for n in ("pp2-full", "pp2-first-half", "pp2-resumed"))
    assert [r["step"] for r in first] == [1, 2] and [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(full, first + resumed):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and a["lr"] == b["lr"]
    a = load_state_dict(runs / "pp2-full" / "checkpoint")
    b = load_state_dict(runs / "pp2-resumed" / "checkpoint")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    shards = sorted(p.name for p in (runs / "pp2-full" / "checkpoint" / "resume").glob("megatron-*.pt"))
    assert shards == ["megatron-pp000-tp000.pt", "megatron-pp001-tp000.pt"]


def test_bench_quick_runs_every_system(runs):
    record = json.loads((runs / "bench" / "bench.json").read_text())
    systems = [r["system"] for r in record["rows"]]
    assert systems == ["tp", "tp_sp", "dtensor_tp", "dtensor_tp_sp", "pp_1f1b", "pp_gpipe"]
    assert all(r["tokens/s"] > 0 and r["MFU % (measured matmul)"] > 0 for r in record["rows"])
    # on a CPU no layer applies; the JSON says which ran
    assert [r.get("layers") for r in record["rows"]] == ["none", "none", None, None, "none", "none"]
    assert record["performance_layers"] is True
    assert record["peak_TFLOPs_datasheet"] is None  # gloo on a CPU: no datasheet peak, no such column
    pp = record["rows"][4]
    assert pp["bubble % (p-1)/(m+p-1)"] == pytest.approx(100 / 5)  # p=2, m=4
    assert len(pp["bubble % (stages)"].split(" / ")) == 2


def test_bench_system_names_map_to_parallel_configs():
    from nano_megatron.bench import tp_parallel_config

    # the bench's tp rows leave the backward overlap to its default (on with tp > 1 on GPUs) unless
    # `_serial` says the paper path's f and g; the layers a name lists are required, the others off
    plain = {"sequence_parallel": False, "cuda_graph": False, "overlap_micro_batches": False}
    assert tp_parallel_config("tp", 2) == {"tp": 2, **plain, "tp_comm_overlap": None}
    assert tp_parallel_config("tp_sp_serial", 2) == {"tp": 2, **plain, "sequence_parallel": True,
                                                     "tp_comm_overlap": False}
    assert tp_parallel_config("tp_sp_graph_pairs", 4) == {"tp": 4, "sequence_parallel": True,
                                                         "cuda_graph": True, "overlap_micro_batches": True,
                                                         "tp_comm_overlap": None}
    for bad in ("tp_sp_sp", "tp_fast", "dtensor_tp", "pp_1f1b", "tpsp"):
        assert tp_parallel_config(bad, 2) is None


def test_cli_refuses_a_resume_past_the_end_or_of_another_model(runs, tmp_path):
    """`train.resume_from` of the single run's step-3 checkpoint: with train.steps=2 the trainer exits
    non-zero naming the step and the key (and writes no checkpoint); with another model it names the
    checkpoint and the difference."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ckpt = runs / "single" / "checkpoint"
    cases = {"past": [*COMMON, "train.steps=2"], "model": [*COMMON, "train.steps=5", "model.num_hidden_layers=3"]}
    procs = {name: subprocess.Popen([sys.executable, "-m", "nano_megatron.train", *args,
                                     f"train.resume_from={ckpt}", f"hydra.run.dir={tmp_path / name}"],
                                    cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, args in cases.items()}
    out = {}
    for name, proc in procs.items():
        try:
            out[name] = proc.communicate(timeout=240)[0]
        finally:
            proc.kill()
        assert proc.returncode != 0, out[name][-2000:]
        assert not (tmp_path / name / "checkpoint").exists()
    assert (f"ValueError: train.resume_from: checkpoint '{ckpt}' is at step 3, past train.steps=2: nothing "
            "to train") in out["past"], out["past"][-2000:]
    assert (f"ValueError: train.resume_from: checkpoint '{ckpt}' holds another model than this run's "
            "(num_hidden_layers 2 in the checkpoint, 3 in this run)") in out["model"], out["model"][-2000:]
