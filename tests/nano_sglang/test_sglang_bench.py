"""The bench runs end to end (a smoke test, not a timing): quick shapes, one workload, JSON with 2 programs."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from nano_sglang.bench.programs import run


@pytest.mark.slow
def test_bench_quick(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.load(__import__("nano_sglang.configs", fromlist=["x"]).__path__[0] + "/bench.yaml")
    cfg.quick, cfg.workloads, cfg.json_programs = True, ["kshot"], 16
    record = run(cfg)
    sgl, on, off = record["rows"]  # nano_sglang, its peer (nano_vllm's hash prefix cache), no prefix caching
    assert [r["system"] for r in (sgl, on, off)] == ["nano_sglang", record["peer"], "nano_vllm, prefix caching off"]
    assert off["hit rate"] == 0 and sgl["hit rate"] > 0.5 and sgl["hit rate"] <= sgl["optimal hit rate"]
    assert on["vs vllm on"] == 1 and off["vs vllm off"] == 1 and on["hit rate"] > 0
    assert capsys.readouterr().out.count("radix cache") == 1  # the headline of the one workload
    assert record["json"][1]["steps"] < record["json"][0]["steps"]
    assert (tmp_path / "bench.json").is_file()
