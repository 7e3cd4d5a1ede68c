"""`mode=measured` of `python -m nano_distserve.bench`: colocated (plain, chunked prefill) vs disaggregated
serving on the same GPUs — attainment-vs-rate curves and goodput per GPU under a Table 1 workload
(DistServe, arXiv 2401.09670, §6.2 / Fig. 8), measured with real engines beside the simulator.

A seeded workload is served open-loop (nano_vllm.loadgen) at each rate on `num_gpus` devices: colocated =
`num_gpus` nano_vllm replicas (plain, then chunked prefill), disaggregated = 1 prefill + 1 decode instance
(`disagg.run_disaggregated_rounds` with the measurement of bench/measure.py). One `LatencyModel` is fitted
per system to that system's own measured steps, and the same requests and arrivals are simulated beside
each measurement.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from nano_distserve.bench.measure import (
    measured_engine_args,
    measured_instance_main,
    step_record,
    warmup_requests,
)
from nano_distserve.disagg import DisaggConfig, run_disaggregated_rounds
from nano_distserve.goodput import report, to_metrics
from nano_distserve.planner import colocated_goodput
from nano_distserve.simulator import LatencyModel, SimConfig, simulate
from nano_distserve.workloads import workload
from nano_vllm.bench.step_timing import StepTimer
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.loadgen import Request, poisson_arrivals, run_engine_open_loop
from nano_vllm.metrics import percentile, slo_attainment, summarize
from shared.bench import KernelCompiles
from shared.dist import run_distributed


def colocated_replica(engine_args: dict, requests: list[Request],
                      arrivals_per_rate: list[list[float]]) -> dict:
    """Body of one colocated replica (one device, rank r of n): at each rate it serves requests r, r+n, ...
    open-loop (round-robin dispatch) after a warm-up burst (`warmup_requests`), so kernel compiles stay out
    of TTFT. Returns, per rate, its requests' metrics and generated token ids (`outputs`: request index →
    tokens), and its measured steps."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    args = measured_engine_args(engine_args, "engine_args")  # serial steps: what the fit models
    if torch.cuda.is_available():
        args["device"] = f"cuda:{torch.cuda.current_device()}"
    engine = LLMEngine(EngineConfig(**args))
    run_engine_open_loop(engine, *warmup_requests(requests))
    steps = []  # after the warm-up: what this replica's simulator model is fitted to
    StepTimer(engine, on_step=lambda out, seconds: steps.append(step_record(out, seconds)))
    mine = list(range(rank, len(requests), world))
    per_rate, compiles, outputs = [], [], []
    for arrivals in arrivals_per_rate:
        tokens: list[list[int]] = []
        with KernelCompiles() as built:  # a compile inside a rate stalls its requests for ~1 s: report it
            metrics, _ = run_engine_open_loop(engine, [requests[i] for i in mine],
                                              [arrivals[i] for i in mine], outputs=tokens)
        outputs.append(dict(zip(mine, tokens)))
        # what was built, argument signatures included ("" when nothing was)
        compiles.append(built.summary() + "".join(f"; {r[:300]}" for r in built.reprs) if built.names else "")
        per_rate.append([dataclasses.replace(m, request_id=str(i)) for i, m in zip(mine, metrics)])
    kv = engine.model_runner.kv_cache  # (2, layers, blocks + 1, block_size, kv heads, head dim)
    return {"per_rate": per_rate, "outputs": outputs, "steps": steps, "compiles": compiles,
            "kv_tokens": engine.model_runner.num_blocks * kv.shape[3],
            "kv_bytes_per_token": 2 * kv.shape[1] * kv.shape[4] * kv.shape[5] * kv.element_size()}


def _grid_goodput(rates: list[float], attainment: list[float], target: float = 0.9) -> float:
    """Highest measured rate whose attainment (and every lower rate's) meets `target`; 0 if none."""
    best = 0.0
    for r, a in sorted(zip(rates, attainment)):
        if a < target:
            break
        best = r
    return best


MEASURED_SYSTEMS = ("colocated", "colocated_chunked", "disaggregated")


def run_measured(cfg: dict) -> dict:
    """The measured bench (`cfg["measured"]` of bench.yaml): real colocated (plain, chunked) and 1P+1D
    disaggregated serving at each rate, the simulator fitted to the measured steps beside each number."""
    m = cfg["measured"]
    w = workload(m["workload"], "measured.workload").scaled(m["length_scale"], m["slo_scale"])
    n, g, seed, rates = m["num_requests"], cfg["num_gpus"], cfg["seed"], list(m["rates"])
    requests = w.requests(n, seed)
    lengths = [(len(r.prompt), r.sampling_params.max_tokens) for r in requests]
    arrivals = [poisson_arrivals(n, rate, seed, cfg.get("burstiness", 1.0)) for rate in rates]
    backend = "nccl" if torch.cuda.device_count() >= g else "gloo"
    budgets = {"colocated": m["engine"]["max_num_batched_tokens"], "colocated_chunked": m["chunk_tokens"]}
    graph_sizes = list(m.get("mixed_cudagraph_sizes") or [])
    names = list(MEASURED_SYSTEMS if m.get("systems") is None else m["systems"])
    unknown = sorted(set(names) - set(MEASURED_SYSTEMS))
    if unknown or not names:
        raise ValueError(f"measured.systems must name some of {list(MEASURED_SYSTEMS)}, got {names}")
    if names == ["disaggregated"]:
        raise ValueError("measured.systems: add a colocated system — the simulator takes the KV cache "
                         "geometry from a colocated run")
    if "disaggregated" in names and g != 2:
        raise ValueError(f"the disaggregated system is 1 prefill + 1 decode GPU: num_gpus must be 2 to "
                         f"compare on equal devices, got {g}")

    engine = measured_engine_args(m["engine"], "measured.engine", cfg.get("performance_layers"))

    def engine_args(budget: int, **extra) -> dict:
        # Mixed-step CUDA graphs (nano_vllm), the same sizes for every system, up to each one's step budget.
        return {**engine, **extra, "max_num_batched_tokens": budget,
                "mixed_cudagraph_sizes": [s for s in graph_sizes if s <= budget]}

    measured: dict[str, list] = {}
    steps: dict[str, list] = {}  # each system's measured steps: its simulator model is fitted to them
    geometry = {}
    for name, chunked in (("colocated", False), ("colocated_chunked", True)):
        if name not in names:
            continue
        args = engine_args(budgets[name], enable_chunked_prefill=chunked)
        t0 = time.perf_counter()
        res = run_distributed(colocated_replica, g, args, requests, arrivals, backend=backend,
                              timeout_s=m["timeout_s"])
        print(f"{name}: {len(rates)} rates served in {time.perf_counter() - t0:.1f} s", flush=True)
        for rate, built in zip(rates, res[0]["compiles"]):
            if built:
                print(f"  {name} @ {rate:g} req/s, replica 0: {built[:400]}", flush=True)
        geometry = {k: res[0][k] for k in ("kv_tokens", "kv_bytes_per_token")}
        measured[name] = [sorted((x for r in res for x in r["per_rate"][k]), key=lambda x: int(x.request_id))
                          for k in range(len(rates))]
        steps[name] = [s for r in res for s in r["steps"]]
    dis, transfers, wire, decode_steps = [], [], [], []
    if "disaggregated" in names:
        t0 = time.perf_counter()
        dis_all = run_disaggregated_rounds(DisaggConfig(engine=engine_args(budgets["colocated"])), requests,
                                           arrivals, m["timeout_s"], main=measured_instance_main)
        print(f"disaggregated: {len(rates)} rates served in {time.perf_counter() - t0:.1f} s", flush=True)
        dis = dis_all["rounds"]
        measured["disaggregated"] = [to_metrics(d["completions"]) for d in dis]
        transfers, wire = dis_all["transfer_times"], dis_all["wire_times"]
        decode_steps = dis_all["decode_steps"]
        steps["disaggregated"] = dis_all["prefill_steps"]
    # One step-latency model per system — and per role for disaggregation — fitted to its own steps
    # (§4.1: the simulator is fitted to profiles of the engine it predicts): a colocated step that carries a
    # long prompt and the decodes, a chunked step, a prefill-only step and a decode instance's iteration
    # (which also receives K/V) are different shapes of work. Step times are whole iterations (schedule,
    # forward, postprocess, an instance's messages and K/V imports): what a waiting request waits for.
    models = {name: LatencyModel.fit(s) for name, s in steps.items()}
    decode_model = LatencyModel.fit(decode_steps) if decode_steps else None
    base = SimConfig(max_num_seqs=m["engine"]["max_num_seqs"], kv_tokens=geometry["kv_tokens"],
                     kv_bytes_per_token=geometry["kv_bytes_per_token"], bandwidth=math.inf,
                     # the measured transfer alone stands in for bytes / bandwidth; the wait for the prefill
                     # instance's step in flight is simulated (`SimConfig.pull_at_step_boundary`)
                     transfer_latency=percentile(wire or transfers, 50) if (wire or transfers) else 0.0)
    sims = {
        "colocated": dataclasses.replace(base, mode="colocated", policy="plain", num_instances=g,
                                         max_num_batched_tokens=budgets["colocated"]),
        "colocated_chunked": dataclasses.replace(base, mode="colocated", policy="chunked", num_instances=g,
                                                 max_num_batched_tokens=budgets["colocated_chunked"]),
        "disaggregated": dataclasses.replace(base, max_num_batched_tokens=budgets["colocated"]),
    }
    rows = []
    for name, sc in sims.items():
        if name not in names:
            continue
        att = [slo_attainment(x, w.ttft_slo, w.tpot_slo) for x in measured[name]]
        model = models[name]
        dm = decode_model if name == "disaggregated" else None
        sim_att = [slo_attainment(simulate(sc, model, lengths, a, dm), w.ttft_slo, w.tpot_slo)
                   for a in arrivals]
        sim_goodput = colocated_goodput(model, sc, lengths, w.ttft_slo, w.tpot_slo, cfg["max_rate"],
                                        seed=seed, decode_model=dm)
        rows.append({"system": name, "gpus": sc.num_gpus, "attainment": att, "sim_attainment": sim_att,
                     "goodput_per_gpu": _grid_goodput(rates, att) / sc.num_gpus,
                     "sim_goodput_per_gpu": sim_goodput / sc.num_gpus,
                     "latency_fit": dataclasses.asdict(model), "num_steps_fitted": len(steps[name]),
                     **({"decode_latency_fit": dataclasses.asdict(dm),
                         "num_decode_steps_fitted": len(decode_steps)} if dm is not None else {}),
                     "summaries": [summarize(x, None, w.ttft_slo, w.tpot_slo) for x in measured[name]]})
    if dis:
        rows[-1]["reports"] = [report(d["completions"], w.ttft_slo, w.tpot_slo, d["duration"]) for d in dis]
        # where the disaggregated TTFT goes, per rate: P50 of each part (router, queue, messages, forward), s
        rows[-1]["ttft_parts_p50"] = [{k: percentile(v, 50) for k, v in d["ttft_parts"].items() if v}
                                      for d in dis]
    return {"mode": "measured", "workload": dataclasses.asdict(w), "rates": rates, "num_requests": n,
            "engine": engine, "chunk_tokens": m["chunk_tokens"], "systems": rows,
            "latency_fit": dataclasses.asdict(models[names[-1]]),
            "num_steps_fitted": len(steps[names[-1]]),
            "mixed_cudagraph_sizes": graph_sizes,
            "kv_geometry": geometry,  # what the simulator was given (with the step logs: re-simulate offline)
            "transfer": {"count": len(transfers),
                         **{f"p{q}_s": percentile(transfers, q) for q in (50, 90, 99) if transfers}},
            "transfer_wire": {"count": len(wire),
                              **{f"p{q}_s": percentile(wire, q) for q in (50, 90, 99) if wire}},
            "decode_step_p50_s": percentile([s.seconds for s in decode_steps], 50) if decode_steps else None,
            # every fitted step, [prefill tokens, decode seqs, context tokens, seconds]: main() writes them to
            # steps.json.gz beside bench.json, to refit or re-simulate offline
            "step_logs": {**{name: [dataclasses.astuple(x) for x in st] for name, st in steps.items()},
                          "disaggregated_decode": [dataclasses.astuple(x) for x in decode_steps]}}


def format_measured_table(result: dict) -> str:
    rates = result["rates"]
    head = (f"{'system':<20}{'GPUs':>5}{'goodput/GPU meas|sim':>22}  "
            + "".join(f"{f'@{r:g} meas|sim':>16}" for r in rates))
    lines = [head]
    for row in result["systems"]:
        lines.append(f"{row['system']:<20}{row['gpus']:>5}{row['goodput_per_gpu']:>12.3f}|"
                     f"{row['sim_goodput_per_gpu']:<9.3f}  "
                     + "".join(f"{a:>11.2f}|{b:<4.2f}" for a, b in zip(row["attainment"],
                                                                        row["sim_attainment"])))
    t, tw = result["transfer"], result["transfer_wire"]
    if not t["count"]:  # no disaggregated system in this run
        return "\n".join(lines + _fit_lines(result))
    lines.append(f"KV transfer alone (export, send, receive, import; both sides ready), {tw['count']} "
                 f"requests' prompts: P50 {tw['p50_s'] * 1e3:.2f} ms, P90 {tw['p90_s'] * 1e3:.2f} ms, "
                 f"P99 {tw['p99_s'] * 1e3:.2f} ms; decode step P50 "
                 f"{result['decode_step_p50_s'] * 1e3:.2f} ms")
    lines.append(f"KV hand-off while serving (pull sent -> in decode cache), {t['count']} transfers: P50 "
                 f"{t['p50_s'] * 1e3:.2f} ms, P90 {t['p90_s'] * 1e3:.2f} ms, P99 {t['p99_s'] * 1e3:.2f} ms")
    for row in result["systems"]:
        for rate, parts in zip(rates, row.get("ttft_parts_p50", [])):
            lines.append(f"{row['system']} @ {rate:g} req/s, TTFT parts P50 (ms): "
                         + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in parts.items()))
    return "\n".join(lines + _fit_lines(result))


def _fit_lines(result: dict) -> list[str]:
    """One line per fitted step-latency model (per system; per role for disaggregation)."""
    lines = []
    for row in result["systems"]:
        f = row["latency_fit"]
        fits = [("", row["num_steps_fitted"], f)]
        if "decode_latency_fit" in row:
            fits = [(" prefill instance", row["num_steps_fitted"], f),
                    (" decode instance", row["num_decode_steps_fitted"], row["decode_latency_fit"])]
        for role, count, f in fits:
            lines.append(f"{row['system']}{role}: simulator fitted to its {count} measured steps: c0 "
                         f"{f['c0']:.2e} s, prefill {f['c_prefill']:.2e} s/token, decode {f['c_decode']:.2e} "
                         f"s/seq, context {f['c_context']:.2e} s/token, prefill step "
                         f"{f['c_prefill_step']:.2e} s, "
                         f"context in prefill steps +{f['c_mixed_context']:.2e} s/token")
    return lines
