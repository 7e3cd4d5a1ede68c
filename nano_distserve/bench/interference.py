"""`mode=interference` of `python -m nano_distserve.bench`: the wall time of every engine step while decodes
run and one long prompt joins them, with plain colocation and with chunked prefill (DistServe, arXiv
2401.09670, §2.3, Fig. 2)."""

from __future__ import annotations

import dataclasses
import statistics

import torch

from nano_distserve.bench.measure import StepRecord, measured_engine_args, step_record
from nano_vllm.bench.step_timing import StepTimer
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.sampling_params import SamplingParams
from shared.bench import KernelCompiles, release_memory
from shared.bench import format_table as shared_format_table
from shared.config import resolve_model_config


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
    engine_args = measured_engine_args(c["engine"], "interference.engine", cfg.get("performance_layers"))
    for policy in policies:  # one engine at a time, in this order (each sizes its KV cache from free memory)
        budget = max(prefill + decodes, max_len) if policy == "plain" else chunk
        graphs = [int(v) for v in (c.get("mixed_cudagraph_sizes") or []) if int(v) <= budget]
        engine = LLMEngine(EngineConfig(**{
            **engine_args, "max_num_batched_tokens": budget, "max_num_seqs": max(decodes + 1, 2),
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
    return {"mode": "interference", "settings": dict(c), "engine": engine_args, "rows": rows, "traces": traces}


def format_interference_table(result: dict) -> str:
    s = result["settings"]
    lines = [f"{s['decodes']} running decodes ({s['engine']['model']}), then one {s['prefill_tokens']}-token "
             f"prompt joins (chunked: {s['chunk_tokens']} tokens per step); traces in bench.json"]
    lines.append(shared_format_table(result["rows"]))
    return "\n".join(lines)
