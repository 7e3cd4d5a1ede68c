"""Planner arithmetic (§2.3), goodput bisection, the simulator's interference and KV-memory behaviour, the
latency fit, and the simulation-only bench (< 1 minute on CPU)."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import nano_distserve
from nano_distserve.bench.measure import StepRecord
from nano_distserve.bench.sim import format_table, run_sim
from nano_distserve.goodput import find_goodput
from nano_distserve.planner import plan
from nano_distserve.simulator import LatencyModel, SimConfig, simulate
from nano_distserve.workloads import WORKLOADS

BENCH_YAML = Path(nano_distserve.__file__).parent / "configs" / "bench.yaml"


def test_planner_reproduces_the_papers_motivating_arithmetic():
    p = plan(lambda tp: 5.6, lambda tp: 10.0, gpu_budget=3, tps=(1,))
    assert (p.num_prefill, p.num_decode) == (2, 1)
    assert p.goodput_per_gpu == pytest.approx(10 / 3) and p.goodput_per_gpu > 2 * 1.6
    with pytest.raises(ValueError, match="cannot hold one prefill and one decode"):
        plan(lambda tp: 1.0, lambda tp: 1.0, gpu_budget=1, tps=(1,))


def test_find_goodput_bisects_to_the_threshold():
    assert find_goodput(lambda r: 1.0 if r <= 3.3 else 0.5, 0.01, 100) == pytest.approx(3.3, rel=0.03)
    assert find_goodput(lambda r: 0.0, 0.01, 100) == 0.0


def test_latency_fit_recovers_coefficients():
    true = LatencyModel(0.002, 3e-5, 1e-4, 2e-7, c_prefill_step=0.015, c_mixed_context=5e-7)
    steps = [StepRecord(p, d, c, true.step_time(p, d, c)) for p, d, c in
             [(100, 0, 100), (0, 8, 800), (500, 4, 900), (0, 32, 4000), (1000, 0, 1000), (50, 16, 3000),
              (0, 4, 600)]]
    fit = LatencyModel.fit(steps)
    for name in ("c0", "c_prefill", "c_decode", "c_context", "c_prefill_step", "c_mixed_context"):
        assert getattr(fit, name) == pytest.approx(getattr(true, name), rel=1e-6, abs=1e-12)


def test_latency_fit_of_noise_is_non_negative_and_predicts_positive_time():
    """What the measured bench may rely on however noisy its timings: a fit to positive step times has no
    negative coefficient and predicts positive time (which coefficients carry it depends on the noise)."""
    rng = random.Random(0)
    for trial in range(200):
        steps = []
        for _ in range(rng.randint(1, 12)):
            p = rng.choice([0, 0, rng.randint(1, 300)])
            steps.append(StepRecord(p, rng.randint(0, 8), p + rng.randint(0, 500), rng.uniform(1e-4, 0.1)))
        fit = LatencyModel.fit(steps)
        assert all(v >= 0 for v in dataclasses.astuple(fit)), trial
        assert sum(fit.step_time(s.prefill_tokens, s.decode_seqs, s.context_tokens) for s in steps) > 0, trial


def test_plain_colocation_stalls_decodes_and_disaggregation_does_not():
    model = LatencyModel(0.01, 1e-4, 1e-4, 0.0)
    reqs = [(16, 50)] + [(4000, 2)] * 3  # one decoding request, then long prompts join
    arrivals = [0.0, 0.2, 0.3, 0.4]
    plain = simulate(SimConfig(mode="colocated", policy="plain"), model, reqs, arrivals)
    disagg = simulate(SimConfig(mode="disaggregated"), model, reqs, arrivals)
    assert plain[0].tpot > 1.5 * disagg[0].tpot  # §2.2 interference


def test_a_pull_waits_for_the_prefill_step_in_flight():
    # A (100-token prompt) is prefilled by 0.1 s; B (1000 tokens) arrived meanwhile, so the prefill instance
    # starts B's 1 s step at once, and A's pull — heard only after that — is served when it ends (the real
    # instance polls for pulls between steps). A's second token then comes after 1.1 s, not ~0.1 s.
    model = LatencyModel(c0=0.0, c_prefill=1e-3, c_decode=0.0, c_context=0.0)
    reqs, arrivals = [(100, 2), (1000, 2)], [0.0, 0.05]
    waits = simulate(SimConfig(transfer_latency=1e-3, bandwidth=math.inf), model, reqs, arrivals)
    at_once_cfg = SimConfig(transfer_latency=1e-3, bandwidth=math.inf, pull_at_step_boundary=False)
    at_once = simulate(at_once_cfg, model, reqs, arrivals)
    assert waits[0].first_token_time == pytest.approx(0.1) == at_once[0].first_token_time
    assert waits[0].finish_time == pytest.approx(1.1 + 1e-3)
    assert at_once[0].finish_time == pytest.approx(0.1 + 1e-3)


def test_decode_memory_backs_up_into_prefill_and_finishes():
    cfg = SimConfig(mode="disaggregated", kv_tokens=300)
    out = simulate(cfg, LatencyModel(), [(100, 100)] * 6, [0.0] * 6)
    assert all(m.first_token_time is not None and m.finish_time > m.first_token_time for m in out)
    with pytest.raises(ValueError, match="needs 400 KV tokens"):
        simulate(cfg, LatencyModel(), [(300, 100)], [0.0])


def test_workloads_have_table1_slos_and_seeded_lengths():
    w = WORKLOADS["code_completion"]
    assert (w.ttft_slo, w.tpot_slo) == (0.125, 0.2)
    assert w.lengths(5, seed=1) == w.lengths(5, seed=1) != w.lengths(5, seed=2)
    s = WORKLOADS["summarization"]
    assert sum(p for p, _ in s.lengths(200)) > 5 * sum(p for p, _ in w.lengths(200))


def test_simulation_only_bench_runs_fast():
    cfg = OmegaConf.to_container(OmegaConf.load(BENCH_YAML))
    cfg.update(num_requests=100, rates=[1, 4])
    result = run_sim(cfg)
    assert {r["system"] for r in result["systems"]} == {"colocated", "colocated_chunked", "disaggregated"}
    assert all(len(r["attainment"]) == 2 and r["goodput_per_gpu"] > 0 for r in result["systems"])
    assert "planner" in format_table(result)


def test_plain_colocation_runs_decodes_in_the_prompt_step_as_nano_vllm_does():
    """nano_vllm's scheduler without chunking still schedules the running decodes first and a whole prompt
    beside them: the decoding request gets a token in the prompt's step (which that prompt slows down)."""
    model = LatencyModel(0.01, 1e-4, 1e-4, 0.0)
    out = simulate(SimConfig(mode="colocated", policy="plain", max_num_batched_tokens=2048), model,
                   [(16, 50), (1000, 2)], [0.0, 0.2])
    first = model.step_time(16, 0, 0)
    decode, mixed, both = model.step_time(0, 1, 0), model.step_time(1000, 1, 0), model.step_time(0, 2, 0)
    # 49 tokens after the first: one in the prompt's step, one beside the prompt's second token, 47 alone
    assert out[0].finish_time == pytest.approx(first + 47 * decode + mixed + both)


@pytest.mark.parametrize(("override", "message"), [
    ({"workload": "bogus"}, r"workload must be one of \['chatbot', 'code_completion', 'summarization'\], "
                            r"got 'bogus'"),
    ({"latency": {"tp_efficiency": 0}}, r"latency: tp_efficiency must be in \(0, 1\], got 0"),
    ({"latency": {"tp_efficiency": 1.5}}, r"latency: tp_efficiency must be in \(0, 1\], got 1.5"),
    ({"latency": {"c_decode": -1e-4}}, r"latency: c_decode must be >= 0 \(seconds\), got -0.0001"),
    ({"latency": {"c_fast": 1}}, r"latency: unknown LatencyModel field\(s\) \['c_fast'\]"),
    ({"sim": {"bandwidth": 0}}, r"sim: bandwidth must be > 0 \(bytes/s\), got 0"),
    ({"sim": {"mode": "colo"}}, r"sim: mode must be 'colocated' or 'disaggregated'"),
])
def test_bad_bench_settings_are_value_errors_naming_the_key(override, message):
    cfg = OmegaConf.to_container(OmegaConf.load(BENCH_YAML))
    for key, value in override.items():
        if isinstance(value, dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    with pytest.raises(ValueError, match=message):
        run_sim(cfg)


def test_the_measured_bench_names_a_bad_workload_before_it_starts_an_engine():
    from nano_distserve.bench.measured import run_measured

    cfg = OmegaConf.to_container(OmegaConf.load(BENCH_YAML))
    cfg["measured"]["workload"] = "bogus"
    with pytest.raises(ValueError, match=r"measured.workload must be one of \['chatbot', "):
        run_measured(cfg)


@pytest.mark.slow
def test_the_cli_says_which_workload_is_wrong(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "nano_distserve.bench", "workload=bogus",
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert ("ValueError: workload must be one of ['chatbot', 'code_completion', 'summarization'], got 'bogus'"
            in proc.stderr), proc.stderr[-2000:]
