"""The bench (Hydra app, quick CPU run with the transformers peer), the workload, the roofline, metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nano_vllm import LLM, SamplingParams
from nano_vllm.bench.throughput import fit_workload
from nano_vllm.loadgen import Request, nano_vllm_workload, poisson_arrivals, run_engine_open_loop
from nano_vllm.metrics import RequestMetrics, percentile, slo_attainment, summarize
from shared.accounting import serving_roofline
from shared.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]


def test_workload_is_nano_vllms():
    reqs = nano_vllm_workload()
    assert len(reqs) == 256 and sum(r.sampling_params.max_tokens for r in reqs) == 133_966
    assert sum(len(r.prompt) for r in reqs) == 142_827
    assert all(r.sampling_params.ignore_eos and r.sampling_params.temperature == 0.6 for r in reqs)


def test_roofline_matches_the_issue_estimate():
    """Qwen3-0.6B, bf16, H200 (4.24 TB/s, 751 TFLOP/s): the issue's ≈ 37.6k tok/s is the decode-only bound."""
    reqs = nano_vllm_workload()
    bound = serving_roofline(ModelConfig.from_name("qwen3-0.6b"), [len(r.prompt) for r in reqs],
                     [r.sampling_params.max_tokens for r in reqs], 2, 4.24e12, 751e12)
    assert bound["decode_only_tok_per_s"] == pytest.approx(37_600, rel=0.01)
    assert bound["decode_memory_bound_frac"] == 1.0 and bound["roofline_tok_per_s"] < 37_600


@pytest.mark.slow
def test_bench_cli_quick_with_transformers_peer(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "nano_vllm.bench", "quick=true", "peer=transformers", "progress=false",
           "workload.num_seqs=4", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "quick run" in proc.stdout and "roofline:" in proc.stdout
    record = json.loads((tmp_path / "bench.json").read_text())
    ours, peer = record["rows"]
    assert ours["system"] == "nano_vllm" and peer["system"].startswith("transformers")
    assert ours["output tokens"] == peer["output tokens"] == sum(
        r.sampling_params.max_tokens for r in nano_vllm_workload(4, 16, 64, 16, 48, 4000))
    assert ours["output tok/s"] > 0 and 0 < ours["% of roofline"] < 100
    assert (tmp_path / ".hydra" / "config.yaml").is_file()


def test_compiled_decode_peer_is_greedy_decoding_of_the_same_model():
    """gpt-fast's decode (static cache, SDPA under a position mask) over shared.model's weights gives the
    recompute-everything oracle's tokens, Qwen3's q/k norms and GQA included (fp32, a CPU: no compile)."""
    import dataclasses

    import torch

    from nano_vllm.bench.compiled_decode import run_compiled_decode
    from shared.model import build_model, greedy_generate

    cfg = dataclasses.replace(ModelConfig.from_name("tiny"), qk_norm=True)
    prompt = [int(t) for t in torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(3))]
    row = run_compiled_decode(cfg, prompt, 10, "cpu", torch.float32, seed=5)
    assert row["_tokens"] == greedy_generate(build_model(cfg, "cpu", torch.float32, seed=5), prompt, 10)
    assert row["output tokens"] == 10 and row["output tok/s"] > 0
    with pytest.raises(ValueError, match="max_tokens"):
        run_compiled_decode(cfg, prompt, 0, "cpu", torch.float32)


@pytest.mark.slow
def test_bench_cli_batch1_with_compiled_peer_and_pdl_off(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "nano_vllm.bench", "quick=true", "workload=batch1", "peer=compiled",
           "progress=false", "workload.max_input_len=32", "workload.min_output_len=12",
           "workload.max_output_len=12", "warmup=false", "pdl=false", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pdl=false: programmatic dependent launch off" in proc.stdout  # the A/B switch, recorded below
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["pdl"] is False
    ours, peer = record["rows"]
    assert peer["system"].startswith("torch.compile decode") and peer["output tokens"] == ours["output tokens"] == 12
    assert peer["tokens equal to ours before the first difference"] == 12  # fp32 on a CPU: the same tokens
    assert "vs compiled" in ours
    # a workload of several requests: named before any engine is built
    bad = subprocess.run([sys.executable, "-m", "nano_vllm.bench", "quick=true", "peer=compiled", "progress=false",
                          f"hydra.run.dir={tmp_path / 'bad'}"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "peer=compiled decodes one request" in bad.stderr + bad.stdout
    assert "layers applied" not in bad.stdout
    bad = subprocess.run([sys.executable, "-m", "nano_vllm.bench", "quick=true", "repeats=0", "progress=false",
                          f"hydra.run.dir={tmp_path / 'bad'}"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "repeats must be >= 1" in bad.stderr + bad.stdout


def test_workload_fits_the_model_and_says_so():
    """The published draws as they are where the model takes them; ids past the vocabulary folded into it
    and requests longer than max_model_len cut, each with a note, where it does not."""
    reqs = nano_vllm_workload(6, 100, 3000, 10, 600, 10000)
    same, notes = fit_workload(reqs, 151936, 4096)
    assert same == reqs and not notes
    fitted, notes = fit_workload(reqs, 4096, 2048)
    assert len(notes) == 2 and "folded into the model's vocabulary of 4096" in notes[0] and "max_model_len (2048)" in notes[1]
    for r, f in zip(reqs, fitted):
        assert f.prompt == [t % 4096 for t in r.prompt][:2047]
        assert len(f.prompt) + f.sampling_params.max_tokens <= 2048
        assert f.sampling_params.max_tokens == min(r.sampling_params.max_tokens, 2048 - len(f.prompt))


@pytest.mark.slow
def test_bench_runs_a_preset_as_given(tmp_path):
    """`model=llama-100m workload=batch1` (a 2048-position, 4096-token model; the workload draws ids up to
    10,000) runs: max_model_len is the model's, the ids are folded and the output says so; `repeats=3` keeps
    every run. Outputs cut to 8 tokens and no warm-up keep it small on a CPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "nano_vllm.bench", "model=llama-100m", "workload=batch1", "quick=false",
           "warmup=false", "progress=false", "workload.min_output_len=8", "workload.max_output_len=8",
           "repeats=3", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "folded into the model's vocabulary of 4096" in proc.stdout
    record = json.loads((tmp_path / "bench.json").read_text())
    row = record["rows"][0]
    assert row["output tokens"] == 8 and record["workload_notes"]
    # repeats=3: every run kept, the row's figure their median, its range beside it
    runs = row["_runs_tok_per_s"]
    assert row["runs"] == len(runs) == 3 and row["min tok/s"] <= row["output tok/s"] <= row["max tok/s"]
    assert row["output tok/s"] == sorted(runs)[1] and "3 runs: output tok/s median" in proc.stdout


@pytest.mark.slow
def test_readme_cpu_excerpt_is_what_the_bench_prints(tmp_path):
    """nano_vllm/README.md's CPU excerpt of `python -m nano_vllm.bench`: its title and column lines are the
    ones the bench prints on a CPU, its row has the run's requests and output tokens."""
    readme = (REPO / "nano_vllm" / "README.md").read_text()
    section = readme[readme.index("Without a GPU the bench runs"):]
    excerpt = section[section.index("```\n") + 4:section.index("\n```", section.index("```\n") + 4)].splitlines()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "nano_vllm.bench", "progress=false", f"hydra.run.dir={tmp_path}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = proc.stdout.splitlines()
    title = printed.index(excerpt[0])  # "nano_vllm bench: tiny, 8 requests, 233 output tokens, float32 on cpu"
    assert printed[title + 1:title + 3] == excerpt[1:3]  # the columns and their rule
    assert printed[title + 3].split()[:3] == excerpt[3].split()[:3] == ["nano_vllm", "8", "233"]
    assert printed[title + 4].startswith("roofline: ") and excerpt[4].startswith("roofline: ")


def test_percentiles_and_slo():
    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    ms = [RequestMetrics(str(i), 0.0, ttft, ttft + 0.1 * (n - 1), 5, n) for i, (ttft, n) in
          enumerate([(0.1, 11), (0.5, 3), (0.2, 1)])]
    assert ms[0].tpot == pytest.approx(0.1) and ms[2].tpot is None
    assert slo_attainment(ms, ttft_slo=0.3) == pytest.approx(2 / 3)
    assert slo_attainment(ms, ttft_slo=1.0, tpot_slo=0.05) == pytest.approx(1 / 3)  # no TPOT: meets it
    row = summarize(ms, duration=2.0, ttft_slo=1.0)
    assert row["output_tokens"] == 15 and row["output_tok_per_s"] == 7.5 and row["slo_attainment"] == 1.0
    assert row["ttft_p50_s"] == pytest.approx(0.2)


def test_engine_open_loop():
    llm = LLM("tiny", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = [Request([1, 2, 3, i + 4], SamplingParams(temperature=0, max_tokens=4)) for i in range(6)]
    arrivals = poisson_arrivals(6, rate=200.0, seed=1)
    assert arrivals == sorted(arrivals) and poisson_arrivals(3, float("inf")) == [0.0] * 3
    metrics, seconds = run_engine_open_loop(llm.engine, reqs, arrivals)
    assert [m.num_output_tokens for m in metrics] == [4] * 6 and seconds >= arrivals[-1]
    assert all(m.ttft > 0 and m.latency >= m.ttft for m in metrics)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, rate=0)


def test_the_roofline_reads_a_quantized_models_and_caches_bytes():
    """nano_vllm.bench's roofline counts what a quantized engine stores: W4's packed weights with their
    scales (not bf16's bytes, which put W4 runs above 100% of the roofline) and FP8's one-byte K/V."""
    from nano_vllm import LLM
    from nano_vllm.bench.throughput import stored_bytes
    from shared.accounting import matmul_param_count

    args = {"device": "cpu", "dtype": "float32", "max_model_len": 64, "num_kv_blocks": 16}
    assert stored_bytes(LLM("tiny", **args)) == {}  # 16 bits: the default count
    llm = LLM("tiny", quantization="rtn-w4", kv_cache_dtype="fp8", **args)
    stored = stored_bytes(llm)
    full = matmul_param_count(llm.engine.model_runner.model_config) * 4  # fp32
    assert 0 < stored["weight_bytes"] < full / 2 and stored["kv_dtype_bytes"] == 1
