"""The bench's runs: nano_vllm's plain decode, then each speculative method, on the same prompts.

Each engine is built once (the plain `nano_vllm.LLM`, then a `nano_specdec.LLM` per method, one at a
time, with the same engine arguments), warmed up on every batch size and temperature, and runs every
(workload, temperature, batch size): `max(batch, min_requests)` requests sent in waves of `batch`, so
`batch` requests decode together from the first step to the last (ignore_eos: each emits
`output_tokens`). The prefix cache is emptied before each run. A run's output tok/s counts its wall
time, prefills included; the speculating runs' τ, acceptance and draft time come from `probe.Probe`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from nano_specdec.bench.cost import measure_costs, projection
from nano_specdec.bench.probe import Probe, sync
from nano_specdec.bench.workloads import make_prompts
from nano_specdec.config import SpeculativeConfig
from nano_specdec.engine import LLM
from nano_specdec.memory import memory_record, memory_summary
from nano_vllm.config import EngineConfig, engine_args_from
from nano_vllm.engine import LLM as PlainLLM
from nano_vllm.sampling_params import SamplingParams
from shared.bench import (
    KernelCompiles,
    measure_ceilings,
    print_table,
    release_memory,
    report_oversubscription,
    write_json,
)
from shared.config import resolve_model_config
from shared.hydra_utils import hydra_run_dir

# Without a GPU: the tiny model as target and as its own draft (every draft accepted: τ = k + 1 for the
# draft model), short prompts, two batch sizes; the cost shapes tiny too.
QUICK = {"model": "tiny", "speculative": {"draft_model": {"model": "tiny"}}, "batch_sizes": [1, 4],
         "prompt_tokens": 96, "output_tokens": 24, "min_requests": 2, "cost_model": "tiny",
         "cost_draft": "tiny", "cost_context": 64}


def _command_line() -> dict:
    """The `key=value` overrides of this Hydra run as a nested dict (empty outside one)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    items = [o.lstrip("+") for o in HydraConfig.get().overrides.task if not o.startswith(("~", "hydra."))]
    return OmegaConf.to_container(OmegaConf.from_dotlist(items), resolve=True)


def _update(base: dict, changes: dict) -> dict:
    """`base` with `changes` merged in (dicts key by key; any other value replaces)."""
    out = dict(base)
    for key, value in changes.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _update(out[key], value) if both else value
    return out


def spec_configs(cfg: DictConfig) -> dict[str, dict]:
    """Each method's speculative_config, checked (nano_specdec.config) before any engine is built."""
    extra = OmegaConf.to_container(cfg.speculative, resolve=True) if cfg.get("speculative") else {}
    out = {}
    for method in cfg.methods:
        spec = {"method": str(method), "num_speculative_tokens": int(cfg.num_speculative_tokens),
                **(extra.get(str(method)) or {})}
        SpeculativeConfig.of(spec)
        out[str(method)] = spec
    return out


def engine_args(cfg: DictConfig, k: int) -> dict:
    """Both engines' arguments: the `engine:` keys, `performance_layers`, and where null the batch size,
    a max_model_len of a request's prompt, output and drafts, and a KV pool for the largest batch."""
    args = engine_args_from(OmegaConf.to_container(cfg.engine, resolve=True) or {})
    args["performance_layers"] = bool(cfg.performance_layers)
    max_batch = max(cfg.batch_sizes)
    args.setdefault("max_num_seqs", max_batch)
    need = int(cfg.prompt_tokens) + int(cfg.output_tokens) + k + 1
    bs = int(args.get("block_size", 16))
    args.setdefault("max_model_len", math.ceil(need / bs) * bs)
    args.setdefault("num_kv_blocks", max_batch * (math.ceil(args["max_model_len"] / bs) + 1))
    max_model_len = EngineConfig(model=str(cfg.model), **args).resolve_max_model_len(
        resolve_model_config(str(cfg.model)))
    if need > max_model_len:
        raise ValueError(f"prompt_tokens + output_tokens + num_speculative_tokens + 1 = {need} is more "
                         f"than max_model_len ({max_model_len}): shorten them or raise "
                         "engine.max_model_len")
    return args


def timed_run(llm: Any, probe: Probe, prompts: list[list[int]], batch: int,
              params: SamplingParams) -> tuple[list[list[int]], float]:
    """Every prompt through `llm` in waves of `batch`; (output token ids, seconds)."""
    llm.engine.block_manager.reset_prefix_cache()
    probe.reset()
    outs = []
    sync()
    with KernelCompiles() as compiles:  # a Triton build inside the timed run is a bench defect: counted
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            outs += llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        sync()
        seconds = time.perf_counter() - t0
    probe.kernels_built = len(compiles.names) if compiles.available else None
    return [o.token_ids for o in outs], seconds


def measure_engine(llm: Any, cfg: DictConfig, prompts: dict[str, list[list[int]]], k: int) -> dict:
    """{(workload, temperature, batch): (token ids, seconds, probe summary)} of one engine."""
    probe = Probe(llm.engine)
    if cfg.warmup:  # every batch shape and both samplers, verify steps included
        first = next(iter(prompts.values()))
        for t in cfg.temperatures:
            for b in cfg.batch_sizes:
                llm.generate(first[:b], SamplingParams(temperature=float(t), max_tokens=2 * k + 3,
                                                       ignore_eos=True), use_tqdm=False)
    results = {}
    for workload, ps in prompts.items():
        for t in cfg.temperatures:
            for b in cfg.batch_sizes:
                n = max(int(b), int(cfg.min_requests))
                params = SamplingParams(temperature=float(t), max_tokens=int(cfg.output_tokens),
                                        ignore_eos=True)
                ids, seconds = timed_run(llm, probe, ps[:n], int(b), params)
                results[(workload, float(t), int(b))] = (ids, seconds, probe.summary(seconds))
    return results


def row_of(method: str, key: tuple, result: tuple, plain: tuple) -> dict:
    (workload, t, b), (ids, seconds, stats), (plain_ids, plain_s, _) = key, result, plain
    tokens = sum(map(len, ids))
    row = {"workload": workload, "method": method, "batch": b, "temperature": t,
           "requests": len(ids), "output tokens": tokens,
           "plain tok/s": sum(map(len, plain_ids)) / plain_s, "tok/s": tokens / seconds}
    row["speedup"] = row["tok/s"] / row["plain tok/s"]
    row.update(stats)
    if t == 0:  # greedy: the target's own tokens (up to the device's reduction order at near-ties)
        row["same tokens %"] = 100 * sum(a == p for a, p in zip(ids, plain_ids)) / len(ids)
    return row


def summary_rows(rows: list[dict], batch_sizes: list[int]) -> list[dict]:
    """One row per (method, workload, temperature): the speedup at each batch size, τ at the first."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["method"], r["workload"], r["temperature"])
        s = out.setdefault(key, {"method": key[0], "workload": key[1], "T": key[2]})
        s[f"x b={r['batch']}"] = r["speedup"]
        if r["batch"] == batch_sizes[0]:
            s[f"tau b={r['batch']}"] = r["tau"]
    return list(out.values())


def run(cfg: DictConfig) -> dict:
    cuda = torch.cuda.is_available() and str(cfg.engine.get("device") or "cuda").startswith("cuda")
    quick = (not cuda) if cfg.get("quick") is None else bool(cfg.quick)
    device = "cuda" if cuda else "cpu"
    oversubscribed = report_oversubscription(device)
    ceilings = measure_ceilings(device)  # at process start, before an engine takes the memory
    print(ceilings.describe(), flush=True)
    if quick:  # QUICK replaces the defaults, what the command line says still wins
        cfg = OmegaConf.create(_update(_update(OmegaConf.to_container(cfg, resolve=True), QUICK),
                                       _command_line()))
        print("note: quick run (no GPU, or quick=true): the tiny model, as target and as its own draft, "
              "short prompts and outputs; its numbers say nothing about a GPU's", flush=True)
        if device == "cpu":  # a tiny model runs fastest on one thread, and steadiest beside other work
            torch.set_num_threads(1)
    k = int(cfg.num_speculative_tokens)
    specs = spec_configs(cfg)
    args = engine_args(cfg, k)
    plain_llm = PlainLLM(str(cfg.model), **args)
    encode = plain_llm.tokenizer.encode
    count = max(max(cfg.batch_sizes), int(cfg.min_requests))
    prompts, notes = {}, []
    for workload in cfg.workloads:
        prompts[str(workload)], more = make_prompts(str(workload), encode, int(cfg.prompt_tokens), count)
        notes += more
    for note in notes:
        print(note, flush=True)
    memory, layers = {}, {}

    def built(name: str, llm: Any) -> None:
        memory[name], layers[name] = memory_record(llm.engine), list(llm.engine.layers_applied)
        print(f"{name}: {memory_summary(llm.engine)}; layers: {', '.join(layers[name]) or 'none'}",
              flush=True)

    built("plain", plain_llm)
    plain = measure_engine(plain_llm, cfg, prompts, k)
    dtype = str(plain_llm.engine.config.torch_dtype).removeprefix("torch.")
    plain_llm.shutdown()
    del plain_llm
    release_memory()
    rows = []
    for method, spec in specs.items():
        llm = LLM(str(cfg.model), speculative_config=spec, **args)
        built(method, llm)
        for key, result in measure_engine(llm, cfg, prompts, k).items():
            rows.append(row_of(method, key, result, plain[key]))
        llm.shutdown()
        del llm
        release_memory()
    costs = projected = None
    if cfg.cost:
        base = EngineConfig(model=str(cfg.cost_model), **{**args, "num_kv_blocks": None})
        draft = cfg.cost_draft if isinstance(cfg.cost_draft, str) else \
            OmegaConf.to_container(cfg.cost_draft, resolve=True)
        costs = measure_costs(base, str(cfg.cost_model), draft, k, [int(b) for b in cfg.batch_sizes],
                              int(cfg.cost_context), device, eagle="eagle" in specs)
        projected = projection(costs, rows, k)
    record = {"bench": "nano_specdec", "model": str(cfg.model), "device": device, "dtype": dtype,
              "quick": quick, "num_speculative_tokens": k, "speculative_configs": specs,
              "workloads": list(prompts), "batch_sizes": list(cfg.batch_sizes),
              "temperatures": list(cfg.temperatures), "prompt_tokens": int(cfg.prompt_tokens),
              "output_tokens": int(cfg.output_tokens), "engine": args, "ceilings": ceilings.as_dict(),
              "layers_applied": layers, "performance_layers": dict.fromkeys(layers["plain"], True),
              "memory": memory, "rows": rows, "workload_notes": notes,
              "cost": None if costs is None else {
                  "label": "projection", "model": str(cfg.cost_model),
                  "draft": OmegaConf.to_container(cfg.cost_draft) if not isinstance(cfg.cost_draft, str)
                  else cfg.cost_draft, "context": int(cfg.cost_context), "steps": costs,
                  "projection": projected},
              "oversubscription": oversubscribed}
    path = Path(hydra_run_dir()) / "bench.json"
    write_json(path, record)
    print_table(rows, title=f"nano_specdec bench: {cfg.model}, k = {k}, {cfg.output_tokens} output tokens "
                            f"a request, {dtype} on {device}; speedup against nano_vllm's plain decode")
    if costs is not None:
        print_table(costs, title=f"step costs at the {cfg.cost_model} shape (random weights), "
                                 f"{cfg.cost_context} tokens of context, k = {k}")
        print_table(projected, title=f"projection for {cfg.cost_model}: the speedup these costs and the "
                                     "measured τ imply (τ measured on the bench's own target and draft)")
    print(f"wrote {path}", flush=True)
    print_table(summary_rows(rows, [int(b) for b in cfg.batch_sizes]),
                title="speedup over nano_vllm's plain decode (output tok/s ratio), by batch size")
    return record
