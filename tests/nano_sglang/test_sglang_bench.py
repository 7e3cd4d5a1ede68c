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


@pytest.mark.slow
def test_bench_passes_performance_layers_to_every_engine(tmp_path, monkeypatch):
    from nano_vllm.config import EngineConfig

    built = []
    monkeypatch.setattr(EngineConfig, "__post_init__", lambda self, init=EngineConfig.__post_init__: (
        built.append(self.performance_layers), init(self))[1])
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.load(__import__("nano_sglang.configs", fromlist=["x"]).__path__[0] + "/bench.yaml")
    assert cfg.performance_layers is True and cfg.engine.async_scheduling is False
    cfg.quick, cfg.workloads, cfg.json_programs, cfg.performance_layers = True, [], 2, False
    cfg.repeats = 2  # the JSON off / on pairs twice: the median and the range
    record = run(cfg)
    assert built == [False] and record["engine"]["performance_layers"] is False
    assert record["layers_applied"] == {"nano_sglang JSON": []}
    off, on = record["json"]
    assert off["runs"] == on["runs"] == 2 and len(on["runs programs/s"]) == 2
    assert on["min speedup"] <= on["speedup"] <= on["max speedup"]
    assert off["min programs/s"] <= off["programs/s"] <= off["max programs/s"]
