"""`python -m nano_distserve.bench`: the Hydra app (configs/bench.yaml) of the three modes — `sim`
(bench/sim.py), `measured` (bench/measured.py), `interference` (bench/interference.py). Each prints a
table and writes bench.json (`shared.bench.write_json`: with date, GPU and versions) into the Hydra run
directory; `measured` also writes every fitted step to steps.json.gz beside it."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from nano_distserve.bench.interference import format_interference_table, run_interference
from nano_distserve.bench.measured import format_measured_table, run_measured
from nano_distserve.bench.sim import format_table, run_sim
from shared.bench import write_json
from shared.hydra_utils import hydra_run_dir


@hydra.main(version_base=None, config_path="../configs", config_name="bench")
def main(cfg: DictConfig) -> None:
    modes = {"sim": (run_sim, format_table), "measured": (run_measured, format_measured_table),
             "interference": (run_interference, format_interference_table)}
    if cfg.mode not in modes:
        raise ValueError(f"mode must be one of {sorted(modes)}, got {cfg.mode!r}")
    t0 = time.perf_counter()
    run, fmt = modes[cfg.mode]
    result = run(OmegaConf.to_container(cfg, resolve=True))
    result["seconds"] = time.perf_counter() - t0
    if "workload" in result:
        w = result["workload"]
        print(f"workload {w['name']}: TTFT SLO {w['ttft_slo']:g} s, TPOT SLO {w['tpot_slo']:g} s; joint SLO "
              "attainment at each rate (req/s):")
    out = Path(hydra_run_dir()) / "bench.json"
    step_logs = result.pop("step_logs", None)
    if step_logs is not None:
        with gzip.open(out.with_name("steps.json.gz"), "wt") as f:
            json.dump(step_logs, f)
    write_json(out, result)
    print(f"wrote {out} ({result['seconds']:.1f} s)")
    print(fmt(result))


if __name__ == "__main__":
    main()
