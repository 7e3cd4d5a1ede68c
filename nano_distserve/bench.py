"""`python -m nano_distserve.bench`: colocated (plain, chunked prefill) vs disaggregated serving on the
same GPUs — attainment-vs-rate curves and goodput per GPU under a Table 1 workload (DistServe, arXiv
2401.09670, §6.2 / Fig. 8) — plus the planner's placement (Algorithm 1).

mode=interference traces step times while decodes run and a long prompt joins them (§2.3, Fig. 2).
mode=sim runs the discrete-event simulator only (CPU, well under a minute). mode=measured serves a
seeded workload open-loop (nano_vllm.loadgen) at each rate with real engines on `num_gpus` devices:
colocated = `num_gpus` nano_vllm replicas (plain, then chunked prefill), disaggregated = 1 prefill + 1
decode instance (`disagg.run_disaggregated` with the measurement layer, nano_distserve.measure); it fits
one `LatencyModel` per system to that system's own measured steps and simulates the same requests and
arrivals beside each measurement. Every mode prints a table and writes bench.json (`shared.bench.write_json`:
with date, GPU and versions) into the Hydra run directory.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import statistics
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from nano_distserve.disagg import DisaggConfig, run_disaggregated_rounds
from nano_distserve.goodput import report, to_metrics
from nano_distserve.measure import StepRecord, measured_instance_main, step_record, warmup_requests
from nano_distserve.planner import colocated_goodput, phase_goodputs, plan
from nano_distserve.simulator import LatencyModel, SimConfig, simulate
from nano_distserve.workloads import WORKLOADS
from nano_vllm.bench.step_timing import StepTimer
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.loadgen import Request, poisson_arrivals, run_engine_open_loop
from nano_vllm.metrics import percentile, slo_attainment, summarize
from nano_vllm.sampling_params import SamplingParams
from shared.bench import KernelCompiles, release_memory, write_json
from shared.bench import format_table as shared_format_table
from shared.config import resolve_model_config
from shared.dist import run_distributed
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


def colocated_replica(engine_args: dict, requests: list[Request],
                      arrivals_per_rate: list[list[float]]) -> dict:
    """Body of one colocated replica (one device, rank r of n): at each rate it serves requests r, r+n, ...
    open-loop (round-robin dispatch) after a warm-up burst (`warmup_requests`), so kernel compiles stay out
    of TTFT. Returns, per rate, its requests' metrics and generated token ids (`outputs`: request index →
    tokens), and its measured steps."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    args = dict(engine_args)
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
    w = WORKLOADS[m["workload"]].scaled(m["length_scale"], m["slo_scale"])
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

    def engine_args(budget: int, **extra) -> dict:
        # Mixed-step CUDA graphs (nano_vllm), the same sizes for every system, up to each one's step budget.
        return {**m["engine"], **extra, "max_num_batched_tokens": budget,
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
            "engine": dict(m["engine"]), "chunk_tokens": m["chunk_tokens"], "systems": rows,
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


def _interference_trace(engine: LLMEngine, prompts: list[list[int]], long_prompt: list[int],
                        keep: SamplingParams, before: int, after: int) -> tuple[list[StepRecord], int]:
    """Step `engine` through the decodes' prefills (untraced), `before` decode-only steps, the long prompt's
    prefill and `after` more steps; returns the step log (each step timed by nano_vllm's StepTimer, from its
    schedule to the end of its postprocess) and the index where the long prompt joined."""
    sched, log = engine.scheduler, []
    timer = StepTimer(engine, on_step=lambda out, seconds: log.append(step_record(out, seconds)))
    seqs = [engine.add_request(p, keep) for p in prompts]
    while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
        engine.step()
    log.clear()  # the decodes' own prefills are not traced
    for _ in range(before):
        engine.step()
    engine.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    joined = len(log)
    while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
        engine.step()
    for _ in range(after):
        engine.step()
    timer.remove()
    for seq in seqs:  # the decodes run to max_len otherwise: end them, their blocks go back to the pool
        engine.abort_request(seq.request_id)
    return log, joined


def run_interference(cfg: dict) -> dict:
    """§2.3 / Fig. 2's measurement: the wall time of each engine step while `decodes` requests decode, then
    while one `prefill_tokens`-token prompt joins them; once with plain colocation (the whole prompt in one
    step, every decode waits for it) and once with chunked prefill (Sarathi: at most `chunk_tokens` per step).
    Each running decode gets its next token from the step that carries the prefill, so the ratio of the
    slowest such step to the median decode-only step is the longest token gap a decode sees, relative to
    its usual one: a per-step spike, which a request's TPOT (its mean gap) averages over all its steps.
    `interference.policies` picks the policies and the order their engines are built in (default plain,
    then chunked). Returns the step traces (StepRecord dicts)."""
    c = cfg["interference"]
    policies = c.get("policies") or ["plain", "chunked"]
    if (not isinstance(policies, (list, tuple)) or not set(policies) <= {"plain", "chunked"}
            or len(set(policies)) != len(policies)):
        raise ValueError(f"interference.policies must list plain and/or chunked once each, got {policies!r}")
    decodes, prefill, chunk = int(c["decodes"]), int(c["prefill_tokens"]), int(c["chunk_tokens"])
    before, after = int(c["steps_before"]), int(c["steps_after"])
    chunk_steps = -(-prefill // max(chunk - decodes, 1))
    max_len = max(prefill + 8, int(c["decode_prompt"]) + before + after + chunk_steps + 64)
    gen = torch.Generator().manual_seed(int(cfg["seed"]))
    vocab = min(resolve_model_config(c["engine"]["model"]).vocab_size, 10000)
    prompts = [torch.randint(0, vocab, (int(c["decode_prompt"]),), generator=gen).tolist()
               for _ in range(decodes)]
    long_prompt = torch.randint(0, vocab, (prefill,), generator=gen).tolist()
    keep = SamplingParams(temperature=0.0, max_tokens=max_len, ignore_eos=True)
    rows, traces = [], {}
    for policy in policies:  # one engine at a time, in this order (each sizes its KV cache from free memory)
        budget = max(prefill + decodes, max_len) if policy == "plain" else chunk
        graphs = [int(v) for v in (c.get("mixed_cudagraph_sizes") or []) if int(v) <= budget]
        engine = LLMEngine(EngineConfig(**{
            **c["engine"], "max_num_batched_tokens": budget, "max_num_seqs": max(decodes + 1, 2),
            "max_model_len": max_len, "enable_chunked_prefill": policy == "chunked",
            "mixed_cudagraph_sizes": graphs, "enable_prefix_caching": False}))  # traced twice: no hits
        # once untimed: the first run of each shape compiles Triton kernels (seconds, not interference)
        with KernelCompiles() as first:
            _interference_trace(engine, prompts, long_prompt, keep, before, after)
        print(f"{policy}, untimed first pass: {first.summary()}", flush=True)
        with KernelCompiles() as compiles:
            log, joined = _interference_trace(engine, prompts, long_prompt, keep, before, after)
        engine.shutdown()
        del engine
        release_memory()  # the next policy's engine sizes its KV cache from free memory: this one goes first
        base = statistics.median(r.seconds for r in log[:joined])
        with_prefill = [r for r in log[joined:] if r.prefill_tokens > 0]
        slowest = max(r.seconds for r in with_prefill)
        rows.append({"policy": policy, "mixed-step CUDA graphs": max(graphs, default=0),
                     "median decode-only step ms": 1e3 * base,
                     "steps carrying the prefill": len(with_prefill),
                     "slowest such step ms": 1e3 * slowest,
                     "slowest prefill-carrying step / median decode step": slowest / base,
                     "prefill done after ms": 1e3 * sum(r.seconds for r in log[joined:][:len(with_prefill)]),
                     "kernels built while traced": len(compiles.names) if compiles.available else None})
        traces[policy] = [dataclasses.asdict(r) for r in log]
    return {"mode": "interference", "settings": dict(c), "rows": rows, "traces": traces}


def format_interference_table(result: dict) -> str:
    s = result["settings"]
    lines = [f"{s['decodes']} running decodes ({s['engine']['model']}), then one {s['prefill_tokens']}-token "
             f"prompt joins (chunked: {s['chunk_tokens']} tokens per step); traces in bench.json"]
    lines.append(shared_format_table(result["rows"]))
    return "\n".join(lines)


@hydra.main(version_base=None, config_path="configs", config_name="bench")
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
