"""The bench runs end to end (a smoke test, not a timing): quick shapes, one workload, JSON with 2 programs."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from nano_sglang.bench import run


@pytest.mark.slow
def test_bench_quick(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.load(__import__("nano_sglang.configs", fromlist=["x"]).__path__[0] + "/bench.yaml")
    cfg.quick, cfg.workloads, cfg.json_programs = True, ["kshot"], 16
    record = run(cfg)
    sgl, off, _on = record["rows"]
    assert off["hit rate"] == 0 and sgl["hit rate"] > 0.5 and sgl["hit rate"] <= sgl["optimal hit rate"]
    assert record["json"][1]["steps"] < record["json"][0]["steps"]
    assert (tmp_path / "bench.json").is_file()
