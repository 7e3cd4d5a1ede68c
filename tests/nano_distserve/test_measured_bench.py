"""The measured bench on CPU, smallest settings: real colocated (plain, chunked) and 1P+1D disaggregated
processes at two rates, the simulator fitted to their steps beside each measurement (< 1 minute). Rates are
high enough that the few requests all arrive within a quarter of a second: an open-loop run waits for its
last arrival."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import nano_distserve
from nano_distserve.bench.measured import format_measured_table, run_measured
from nano_distserve.simulator import LatencyModel

BENCH_YAML = Path(nano_distserve.__file__).parent / "configs" / "bench.yaml"


@pytest.mark.slow
def test_measured_bench_reports_attainment_transfers_and_simulator_prediction():
    cfg = OmegaConf.to_container(OmegaConf.load(BENCH_YAML))
    cfg["measured"].update(num_requests=4, rates=[16, 64], timeout_s=120)
    result = run_measured(cfg)
    assert result["rates"] == [16, 64]
    assert [r["system"] for r in result["systems"]] == ["colocated", "colocated_chunked", "disaggregated"]
    for row in result["systems"]:
        assert row["gpus"] == 2
        assert len(row["attainment"]) == len(row["sim_attainment"]) == len(row["summaries"]) == 2
        assert all(0.0 <= a <= 1.0 for a in row["attainment"] + row["sim_attainment"])
        assert all(s["requests"] == 4 for s in row["summaries"])  # every request served, none lost
        assert row["goodput_per_gpu"] >= 0 and row["sim_goodput_per_gpu"] >= 0
    t = result["transfer"]
    assert t["count"] == 2 * 4  # one pull per request per rate
    assert 0 < t["p50_s"] <= t["p90_s"] <= t["p99_s"] and not math.isnan(t["p99_s"])
    wire = result["transfer_wire"]  # each request's prompt blocks sent once more, alone, after serving
    assert wire["count"] == 4 and 0 < wire["p50_s"] <= wire["p99_s"]
    for row in result["systems"]:  # one step-latency model per system, fitted to its own steps
        steps = result["step_logs"][row["system"]]
        assert row["num_steps_fitted"] == len(steps) > 0
        # Which coefficients carry the time depends on the timings (noisy on a loaded CPU); that a
        # non-negative fit to positive step times is non-negative and predicts positive time does not.
        assert all(v >= 0 for v in row["latency_fit"].values())
        fit = LatencyModel(**row["latency_fit"])
        assert sum(fit.step_time(p, d, c) for p, d, c, _ in steps) > 0
    parts = result["systems"][-1]["ttft_parts_p50"]  # where each rate's disaggregated TTFT went
    assert len(parts) == 2 and all(set(p) == {"router", "queue", "messages", "forward"} for p in parts)
    assert all(p["forward"] > 0 and p["queue"] >= 0 for p in parts)
    table = format_measured_table(result)
    assert "KV transfer alone" in table and "hand-off" in table and "meas|sim" in table
    assert "TTFT parts P50" in table


@pytest.mark.slow
def test_interference_trace_plain_vs_chunked():
    """mode=interference on a CPU: the traces have the right shape (the times mean nothing here); the
    policies run in the order `interference.policies` names them."""
    from nano_distserve.bench.interference import format_interference_table, run_interference

    cfg = OmegaConf.to_container(OmegaConf.load(BENCH_YAML))
    cfg["interference"].update(decodes=4, prefill_tokens=256, chunk_tokens=64, steps_before=4, steps_after=2,
                               engine={"model": "tiny", "enable_prefix_caching": False},
                               policies=["chunked", "plain"])
    cfg["performance_layers"] = False
    result = run_interference(cfg)
    assert result["engine"]["performance_layers"] is False and result["engine"]["async_scheduling"] is False
    chunked, plain = result["rows"]
    assert (chunked["policy"], plain["policy"]) == ("chunked", "plain")
    assert plain["steps carrying the prefill"] == 1  # the whole prompt in one step
    assert chunked["steps carrying the prefill"] == math.ceil(256 / (64 - 4))  # decodes go first in each step
    for policy, trace in result["traces"].items():
        assert all(r["prefill_tokens"] == 0 and r["decode_seqs"] == 4 for r in trace[:4]), policy
        assert sum(r["prefill_tokens"] for r in trace) == 256, policy
        assert all(r["seconds"] > 0 for r in trace)
    assert "slowest prefill-carrying step / median decode step" in format_interference_table(result)


@pytest.mark.slow
def test_measured_bench_runs_a_subset_of_systems():
    """measured.systems: a colocated system alone, on one GPU (here one CPU replica); the first test runs
    the whole set, in order."""
    cfg = OmegaConf.to_container(OmegaConf.load(BENCH_YAML))
    cfg["num_gpus"] = 1
    cfg["measured"].update(num_requests=3, rates=[32], timeout_s=120, systems=["colocated_chunked"])
    result = run_measured(cfg)
    assert [r["system"] for r in result["systems"]] == ["colocated_chunked"]
    assert result["engine"]["performance_layers"] is True and result["engine"]["async_scheduling"] is False
    assert all(r["gpus"] == 1 and r["summaries"][0]["requests"] == 3 for r in result["systems"])
    assert result["transfer"]["count"] == 0
    assert "meas|sim" in format_measured_table(result)
    for bad, message in (([], "measured.systems must name"), (["disaggregated"], "add a colocated system"),
                         (["colocated", "disaggregated"], "num_gpus must be 2")):
        cfg["measured"]["systems"] = bad
        with pytest.raises(ValueError, match=message):
            run_measured(cfg)


@pytest.mark.parametrize("policies", [["chunked", "chunked"], ["eager"], "plain"])
def test_interference_policies_are_checked(policies):
    """interference.policies: plain and/or chunked, each once, as a list; anything else is refused by name
    before an engine is built."""
    from nano_distserve.bench.interference import run_interference

    cfg = OmegaConf.to_container(OmegaConf.load(BENCH_YAML))
    cfg["interference"]["policies"] = policies
    with pytest.raises(ValueError, match="interference.policies"):
        run_interference(cfg)


@pytest.mark.parametrize("node", ["measured", "interference"])
def test_overlapped_scheduling_is_refused_where_steps_are_fitted(node):
    """The simulator is fitted to serial steps: a bench engine asked for nano_vllm's overlapped scheduling
    is a ValueError naming the key, before an engine is built."""
    from nano_distserve.bench.interference import run_interference

    cfg = OmegaConf.to_container(OmegaConf.load(BENCH_YAML))
    assert cfg["performance_layers"] is True and cfg[node]["engine"]["async_scheduling"] is False
    cfg[node]["engine"]["async_scheduling"] = True
    with pytest.raises(ValueError, match=rf"{node}.engine.async_scheduling must be false: the simulator is "
                                         "fitted to serial steps"):
        (run_measured if node == "measured" else run_interference)(cfg)
