"""`mode=sim` of `python -m nano_distserve.bench`: plain colocation, chunked-prefill colocation and the
planner's disaggregated placement (Algorithm 1) on `num_gpus` GPUs, simulated (DistServe, arXiv
2401.09670, §4.1, §6.2): attainment at each rate and goodput per GPU, on a CPU in seconds."""

from __future__ import annotations

import dataclasses

from nano_distserve.planner import colocated_goodput, phase_goodputs, plan
from nano_distserve.simulator import LatencyModel, SimConfig, simulate
from nano_distserve.workloads import workload
from nano_vllm.loadgen import poisson_arrivals
from nano_vllm.metrics import slo_attainment
from shared.hydra_utils import to_dataclass


def from_node(cls: type, cfg: dict, key: str):
    """bench.yaml's node `key` as a `cls`; a bad key or value is a ValueError naming the node."""
    try:
        return to_dataclass(cls, cfg[key])
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None


def run_sim(cfg: dict) -> dict:
    """The simulation-only bench; `cfg` has bench.yaml's keys. Returns the JSON-able result."""
    w = workload(cfg["workload"]).scaled(cfg.get("length_scale", 1.0), cfg.get("slo_scale", 1.0))
    model, base = from_node(LatencyModel, cfg, "latency"), from_node(SimConfig, cfg, "sim")
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
        goodput = colocated_goodput(model, sc, lengths, w.ttft_slo, w.tpot_slo, cfg["max_rate"],
                                    seed=cfg["seed"])
        rows.append({"system": name, "gpus": sc.num_gpus, "goodput_req_s": goodput,
                     "goodput_per_gpu": goodput / sc.num_gpus, "attainment": curve})
    return {"mode": "sim", "workload": dataclasses.asdict(w), "rates": list(cfg["rates"]), "systems": rows,
            "placement": {**dataclasses.asdict(placement),
                          "planned_goodput_per_gpu": placement.goodput_per_gpu,
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
