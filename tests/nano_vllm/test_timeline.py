"""The bench's per-step timeline (`StepTimer(engine, timeline=True)`) and its GEMV micro-bench, on a CPU."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, SamplingParams
from nano_vllm.bench.step_timing import StepTimer


@pytest.mark.parametrize("overlap", [False, True])
def test_timeline_sees_every_step(qwen3_ckpt, overlap):
    llm = LLM(qwen3_ckpt, max_model_len=64, async_scheduling=overlap)
    timer = StepTimer(llm.engine, timeline=True)
    llm.generate(random_prompts(80, [3, 20]), SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    tl = timer.timeline
    summary = tl.summary()
    assert summary["steps"] == timer.num_steps == llm.engine.num_steps == 6
    assert summary["device_busy_ms_per_step"] > 0 and summary["host_busy_ms_per_step"] > 0
    assert summary["device_idle_ms_per_step"] >= 0 and 0 < summary["device_busy_frac"] <= 1
    assert {p for p, _, _ in tl.host} == {"schedule", "prepare", "launch", "postprocess"}
    window = tl.window(4)
    assert len(window["device"]) == 4
    starts = [a for a, _ in window["device"]]
    assert starts == sorted(starts) and min(a for _, a, _ in window["host"]) == 0.0
    assert all(b >= a for a, b in window["device"]) and all(b >= a for _, a, b in window["host"])
    timer.remove()
    assert "run" not in vars(llm.engine.model_runner)
    assert ("sample" in vars(llm.engine.model_runner)) is False  # the paper path's sampler again


@pytest.mark.slow  # a performance layer's interpreter sweep (~5 s): run once, not again in the fork test
def test_gemv_bench_runs_under_the_interpreter(monkeypatch):
    """Every code path of the bench, not its numbers: each timing is one call (the interpreter runs a launch
    in ~0.1 s per few dozen programs, so the sweep's tiles are the larger ones of its grid)."""
    from nano_vllm.bench import gemv as bench_gemv
    from nano_vllm.layers.gemv import GemvConfig
    from shared.accounting import Ceilings

    benchmark = bench_gemv.benchmark
    monkeypatch.setattr(bench_gemv, "benchmark", lambda fn, *a, **kw: benchmark(fn, *a, **{**kw, "warmup": 0,
                                                                                             "repeats": 1}))
    monkeypatch.setattr(bench_gemv, "SWEEP_M1", [GemvConfig(16, 64, 1), GemvConfig(32, 64, 2)])
    monkeypatch.setattr(bench_gemv, "SWEEP_DOT", [GemvConfig(32, 64, 2)])
    monkeypatch.setattr(bench_gemv, "REFINE", [(1, 1), (2, 3)])
    cfg = OmegaConf.create({"gemv_model": "tiny", "gemv_rows": [1, 3], "gemv_sweep": True, "gemv_compile": None,
                            "gemv_compile_rows": [1]})
    ceilings = Ceilings("cpu", 1e10, 1e11)
    record = bench_gemv.run_gemv(cfg, ceilings, "cpu", interpreter=True)
    assert record["bench"] == "nano_vllm.layers.gemv" and record["crossover_rows"] in (0, 1, 3)
    shapes = [r["shape"] for r in record["rows"] if r["M"] == 1]
    assert shapes == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "layer"]
    assert all(r["ours TB/s"] > 0 and r["best TB/s"] > 0 for r in record["rows"] if r["shape"] != "layer")
    m1 = {f"{r['N']}x{r['K']}" for r in record["rows"] if r["M"] == 1 and r["shape"] != "layer"}
    assert set(record["measured_m1"]) == m1  # the pasteable table: one winner per M = 1 shape
    assert all(GemvConfig(**c) for c in record["measured_m1"].values())
