"""`python -m nano_distserve.bench`: colocated (plain, chunked prefill) vs disaggregated serving on the
same GPUs — attainment-vs-rate curves and goodput per GPU under a Table 1 workload (DistServe, arXiv
2401.09670, §6.2 / Fig. 8) — plus the planner's placement (Algorithm 1).

mode=sim runs the discrete-event simulator only (CPU, well under a minute). Prints a table, writes
bench.json into the Hydra run directory.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from nano_distserve.planner import colocated_goodput, phase_goodputs, plan
from nano_distserve.simulator import LatencyModel, SimConfig, simulate
from nano_distserve.workloads import WORKLOADS
from nano_vllm.loadgen import poisson_arrivals
from nano_vllm.metrics import slo_attainment
from shared.hydra_utils import hydra_run_dir, to_dataclass


def run_sim(cfg: dict) -> dict:
    """The simulation-only bench; `cfg` has bench.yaml's keys. Returns the JSON-able result."""
    w = WORKLOADS[cfg["workload"]].scaled(cfg.get("length_scale", 1.0), cfg.get("slo_scale", 1.0))
    model = to_dataclass(LatencyModel, cfg["latency"])
    base = to_dataclass(SimConfig, cfg["sim"])
    lengths = w.lengths(cfg["num_requests"], cfg["seed"])
    g = cfg["num_gpus"]
    g_p, g_d = phase_goodputs(model, base, lengths, w.ttft_slo, w.tpot_slo, cfg["max_rate"], seed=cfg["seed"])
    placement = plan(g_p, g_d, g)
    systems = {
        "colocated": dataclasses.replace(base, mode="colocated", policy="plain", num_instances=g),
        "colocated_chunked": dataclasses.replace(base, mode="colocated", policy="chunked", num_instances=g),
        "disaggregated": dataclasses.replace(base, mode="disaggregated", num_prefill=placement.num_prefill,
                                             tp_prefill=placement.tp_prefill, num_decode=placement.num_decode,
                                             tp_decode=placement.tp_decode),
    }
    rows = []
    for name, sc in systems.items():
        curve = []
        for rate in cfg["rates"]:
            arr = poisson_arrivals(len(lengths), rate, cfg["seed"], cfg.get("burstiness", 1.0))
            curve.append(slo_attainment(simulate(sc, model, lengths, arr), w.ttft_slo, w.tpot_slo))
        goodput = colocated_goodput(model, sc, lengths, w.ttft_slo, w.tpot_slo, cfg["max_rate"], seed=cfg["seed"])
        rows.append({"system": name, "gpus": sc.num_gpus, "goodput_req_s": goodput,
                     "goodput_per_gpu": goodput / sc.num_gpus, "attainment": curve})
    return {"workload": dataclasses.asdict(w), "rates": list(cfg["rates"]), "systems": rows,
            "placement": {**dataclasses.asdict(placement), "planned_goodput_per_gpu": placement.goodput_per_gpu,
                          "prefill_goodput_tp1": g_p(1), "decode_goodput_tp1": g_d(1)}}


def format_table(result: dict) -> str:
    rates = result["rates"]
    head = f"{'system':<20}{'GPUs':>5}{'goodput/GPU':>13}  " + "".join(f"{f'@{r:g}':>7}" for r in rates)
    lines = [head]
    for row in result["systems"]:
        lines.append(f"{row['system']:<20}{row['gpus']:>5}{row['goodput_per_gpu']:>13.3f}  "
                     + "".join(f"{a:>7.2f}" for a in row["attainment"]))
    p = result["placement"]
    lines.append(f"planner (Algorithm 1): {p['num_prefill']}P(tp{p['tp_prefill']}) + {p['num_decode']}D"
                 f"(tp{p['tp_decode']}), {p['planned_goodput_per_gpu']:.3f} req/s/GPU planned")
    return "\n".join(lines)


@hydra.main(version_base=None, config_path="configs", config_name="bench")
def main(cfg: DictConfig) -> None:
    if cfg.mode != "sim":
        raise ValueError(f"mode={cfg.mode!r}: only mode=sim is implemented (measured serving: see the README)")
    t0 = time.perf_counter()
    result = run_sim(OmegaConf.to_container(cfg, resolve=True))
    result["seconds"] = time.perf_counter() - t0
    print(f"workload {cfg.workload}: TTFT SLO {result['workload']['ttft_slo']:g} s, TPOT SLO "
          f"{result['workload']['tpot_slo']:g} s; joint SLO attainment at each rate (req/s):")
    print(format_table(result))
    out = Path(hydra_run_dir()) / "bench.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} ({result['seconds']:.1f} s)")


if __name__ == "__main__":
    main()
