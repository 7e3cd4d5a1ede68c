"""`python -m nano_sglang.bench` (`run`): synthetic LLM programs on nano_sglang's radix cache against its
peer, nano_vllm's hash prefix cache (prefix caching on), and against nano_vllm without prefix caching, in
one run; plus JSON decoding with and without jump-forward (SGLang, arXiv 2312.07104, §6).

A program is a list of calls; call j's prompt is everything before it (earlier prompts and outputs) plus
new tokens, so later calls extend earlier ones, as in the paper's workloads. Shapes (configs/bench.yaml):

* kshot     — one shared preamble of examples, then each program's own question (MMLU-style k-shot);
* chat      — a shared system prompt, then `turns` user turns each followed by the model's answer;
* tot       — a question, then `branches` thoughts per level for `depth` levels (tree of thought);
* react     — a shared agent system prompt, then `steps` of (model action, tool observation);
* prefixes  — `groups` generated shared prefixes, each program one of them plus its own suffix;
* noreuse   — independent random prompts (nothing to share): the cost of the tree's bookkeeping.

Every system runs all programs together, call by call (round j = every program's j-th call), greedy with
`ignore_eos`, so all systems see the same prompts. Reported per system: programs/s, prompt tokens, cache
hit rate (prompt tokens served from the cache / all prompt tokens) and the analytic optimum
1 − unique prompt tokens / total prompt tokens (unique = prompt tokens whose prefix appeared in no earlier
prompt or earlier generated text: what an infinite cache computes; `optimal_hit_rate`); for nano_sglang
also "bookkeeping %": wall time inside the radix tree (match, insert, lock, unlock, evict) and the
cache-aware ordering of the waiting queue, over the engine's step time.

Each system is one engine with nano_vllm's performance layers on (every engine's default on CUDA: CUDA
graphs for decode and for mixed steps at `engine.mixed_cudagraph_sizes`, fused projections and sampling,
the GEMV, the kernel warm-up; `performance_layers=false` runs every engine on the paper path alone), built
once, warmed up by running each workload once untimed, its prefix cache emptied before each run, and freed
before the next is built, so every engine sizes its KV cache from the same memory. nano_sglang's engine
reads each step's tokens in its postprocess, which nano_vllm's overlapped scheduling cannot serve, so
bench.yaml turns that layer off for every engine (`engine.async_scheduling: false`): the rows compare the
caches on one step path. bench.json names the layers each engine ran (`layers_applied`). The table lists, per workload,
nano_sglang, the peer (`vs vllm on`) and nano_vllm without prefix caching (`vs vllm off`); a headline per
workload follows it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from nano_sglang.engine import SGLEngine
from nano_sglang.scheduler import CacheAwareConfig
from nano_vllm.bench.step_timing import StepTimer
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.sampling_params import SamplingParams
from shared.bench import print_table, release_memory, write_json
from shared.hydra_utils import hydra_run_dir

Call = tuple[list[int], int]  # (new prompt tokens, output tokens)
SGL, VLLM_ON, VLLM_OFF = "nano_sglang", "nano_vllm, prefix caching on", "nano_vllm, prefix caching off"


def make_programs(name: str, shape: dict, rng: random.Random, vocab: int) -> list[list[Call]]:
    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    s = shape
    if name == "kshot":
        pre = toks(s["preamble"])
        return [[(pre + toks(s["question"]), s["output"])] for _ in range(s["programs"])]
    if name == "chat":
        sys_p = toks(s["system"])
        return [[(sys_p + toks(s["user"]) if t == 0 else toks(s["user"]), s["output"]) for t in range(s["turns"])]
                for _ in range(s["programs"])]
    if name == "react":
        sys_p = toks(s["system"])
        return [[(sys_p if k == 0 else toks(s["observation"]), s["output"]) for k in range(s["steps"])]
                for _ in range(s["programs"])]
    if name == "noreuse":
        return [[(toks(s["prompt"]), s["output"])] for _ in range(s["programs"])]
    if name == "prefixes":
        groups = [toks(s["prefix"]) for _ in range(s["groups"])]
        return [[(rng.choice(groups) + toks(s["suffix"]), s["output"])] for _ in range(s["programs"])]
    if name == "tot":  # each leaf of the thought tree is a program whose calls are its path
        progs = []
        for _ in range(s["programs"]):
            q = toks(s["question"])
            for leaf in range(s["branches"] ** s["depth"]):
                path = [(q + toks(4), s["thought"])] if leaf == 0 else None
                progs.append(path)
            # branches share their ancestors' calls: leaf i's level-d call is shared by all leaves in its block
            level_calls = [[(toks(4), s["thought"]) for _ in range(s["branches"] ** d)] for d in range(s["depth"])]
            first = len(progs) - s["branches"] ** s["depth"]
            for leaf in range(s["branches"] ** s["depth"]):
                calls = [(q + level_calls[0][0][0], s["thought"])]
                for d in range(1, s["depth"]):
                    calls.append(level_calls[d][leaf // s["branches"] ** (s["depth"] - d)])
                progs[first + leaf] = calls
        return progs
    raise ValueError(f"unknown workload {name!r}")


class Bookkeeping:
    """Wall time spent inside chosen methods of some objects (outermost calls only: a method that calls
    another timed one is counted once), installed on the instances, not the classes."""

    def __init__(self) -> None:
        self._depth = 0
        self.by_name: dict[str, float] = {}  # seconds, by the outermost method

    @property
    def seconds(self) -> float:
        return sum(self.by_name.values())

    def wrap(self, obj: object, names: list[str]) -> None:
        for name in names:
            setattr(obj, name, self._timed(getattr(obj, name), name))

    def _timed(self, fn, name: str):
        def timed(*args, **kwargs):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.by_name[name] = self.by_name.get(name, 0.0) + time.perf_counter() - t0
        return timed


def bookkeeping_of(engine: LLMEngine) -> Bookkeeping | None:
    """Time nano_sglang's tree operations and cache-aware ordering (None for nano_vllm)."""
    if not isinstance(engine, SGLEngine):
        return None
    book = Bookkeeping()
    book.wrap(engine.block_manager.tree, ["match_prefix", "insert", "lock", "unlock", "evict"])
    book.wrap(engine.scheduler, ["order_waiting"])
    return book


def optimal_hit_rate(calls: list[tuple[list[int], list[int]]]) -> float:
    """1 − unique prompt tokens / all prompt tokens over `calls` [(prompt, output)] in order: a prompt token
    is unique unless its prefix appeared before — in an earlier prompt, or in an earlier call's prompt plus
    all but the last of its output tokens (their K/V was written while decoding), which is what a cache that
    never evicts would serve. Prefixes are identified by a running hash chain, O(tokens)."""
    seen: set[int] = set()
    total = unique = 0
    for prompt, output in calls:
        h = 0
        for k, tok in enumerate(prompt + output[:-1]):
            h = hash((h, tok))
            if k < len(prompt):
                total += 1
                unique += h not in seen
            seen.add(h)
    return 1 - unique / max(total, 1)


def run_programs(engine: LLMEngine, programs: list[list[Call]], book: Bookkeeping | None = None) -> dict:
    """All programs together, call by call; returns programs/s, hit rate and the analytic optimum (computed
    after the timed region)."""
    engine.block_manager.reset_prefix_cache()  # the previous workload's (or warm-up's) prompts must not hit
    gc.collect()  # the previous run's garbage is not this run's time (a collection inside it lands anywhere)
    book_s0, timer = (book.seconds if book else 0.0), StepTimer(engine)
    by_name0 = dict(book.by_name) if book else {}
    contexts = [[] for _ in programs]
    calls, total, cached = [], 0, 0
    t0 = time.perf_counter()
    for j in range(max(len(p) for p in programs)):
        seqs = []
        for i, prog in enumerate(programs):
            if j < len(prog):
                new, out = prog[j]
                contexts[i] = contexts[i] + new
                seqs.append((i, engine.add_request(contexts[i], SamplingParams(temperature=0.0, max_tokens=out,
                                                                                ignore_eos=True))))
        while engine.has_unfinished_requests():
            engine.step()
        for i, seq in seqs:
            total += seq.num_prompt_tokens
            cached += seq.num_cached_tokens
            calls.append(seq)
            contexts[i] = contexts[i] + seq.output_token_ids
    seconds = time.perf_counter() - t0
    timer.remove()
    row = {"programs": len(programs), "seconds": seconds, "programs/s": len(programs) / seconds,
           "prompt tokens": total, "hit rate": cached / total,
           "optimal hit rate": optimal_hit_rate([(list(s.prompt_token_ids), list(s.output_token_ids))
                                                 for s in calls])}
    if book is not None:
        row["bookkeeping %"] = 100 * (book.seconds - book_s0) / max(timer.step_seconds, 1e-9)
        row["bookkeeping ms by method"] = {k: round(1e3 * (v - by_name0.get(k, 0.0)), 3) for k, v in book.by_name.items()}
    return row


def run_json(engine: SGLEngine, n: int, jump_forward: bool) -> dict:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "city": {"type": "string", "maxLength": 12}, "member": {"type": "boolean"}}}
    prompts = [f"Person {i} as JSON: " for i in range(n)]
    steps0, timer, t0 = engine.num_steps, StepTimer(engine), time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=128, seed=0), json_schema=schema,
                           jump_forward=jump_forward)
    seconds = time.perf_counter() - t0
    timer.remove()
    valid = 0  # outputs that parse and carry exactly the schema's keys (a check of masks + jumps under graphs)
    for o in outs:
        with contextlib.suppress(ValueError):
            valid += set(json.loads(o.text)) == set(schema["properties"])
    return {"system": f"nano_sglang JSON, jump-forward {'on' if jump_forward else 'off'}", "programs": n,
            "valid %": 100 * valid / n,
            "seconds": seconds, "programs/s": n / seconds, "steps": engine.num_steps - steps0,
            "eager steps": timer.num_eager_steps,
            "output tokens": sum(len(o.token_ids) for o in outs)}


def headlines(rows: list[dict]) -> list[str]:
    """One line per workload: nano_sglang against its peer (nano_vllm's hash prefix cache), then against
    nano_vllm without prefix caching."""
    out = []
    for r in rows:
        if r["system"] != SGL:
            continue
        peer = next(p for p in rows if p["workload"] == r["workload"] and p["system"] == VLLM_ON)
        out.append(f"{r['workload']}: radix cache {r['vs vllm on']:.2f}x the programs/s of nano_vllm's hash "
                   f"prefix cache (hit rate {r['hit rate']:.1%} vs {peer['hit rate']:.1%}, optimum "
                   f"{r['optimal hit rate']:.1%}); {r['vs vllm off']:.2f}x nano_vllm without prefix caching")
    return out


def spread(runs: list[dict]) -> dict:
    """The median programs/s of repeated timed runs and their range (nothing to add for one run)."""
    if len(runs) < 2:
        return {}
    rates = [r["programs/s"] for r in runs]
    return {"programs/s": statistics.median(rates), "min programs/s": min(rates), "max programs/s": max(rates),
            "runs": len(runs), "runs programs/s": rates}


def run(cfg: DictConfig) -> dict:
    quick = (not torch.cuda.is_available()) if cfg.quick is None else bool(cfg.quick)
    model = "tiny" if quick and not Path(str(cfg.model)).is_dir() else str(cfg.model)  # quick: any preset
    repeats = int(cfg.get("repeats") or 1)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    engine_args = {k: v for k, v in OmegaConf.to_container(cfg.engine).items() if v is not None}
    if cfg.get("performance_layers") is not None:  # false: every engine on the paper path alone
        engine_args["performance_layers"] = bool(cfg.performance_layers)
    if quick:  # < 1 min on a 2-core CPU: a tenth of the tokens, an eighth of the programs
        engine_args.update(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=2048)
    shapes = {}
    for name in cfg.workloads:
        shape = dict(cfg.shapes[name])
        if quick:
            shape = {k: (max(1, v // 8) if k == "programs" else v if k in ("turns", "steps", "branches", "depth",
                     "groups") else max(2, v // 10)) for k, v in shape.items()}
        shapes[name] = make_programs(name, shape, random.Random(cfg.seed), 4000)
    systems = [(SGL, lambda: SGLEngine(EngineConfig(model=model, **engine_args),
                                       CacheAwareConfig(cfg.policy))),
               (VLLM_OFF, lambda: LLMEngine(EngineConfig(model=model, **engine_args,
                                                         enable_prefix_caching=False))),
               (VLLM_ON, lambda: LLMEngine(EngineConfig(model=model, **engine_args)))]
    by_workload: dict[str, list[dict]] = {name: [] for name in shapes}
    layers: dict[str, list[str]] = {}  # the performance layers each engine ran (engine.layers_applied)
    for system, make in systems if shapes else []:  # workloads=[]: the JSON part only
        engine = make()
        layers[system] = engine.layers_applied
        book = bookkeeping_of(engine)
        for name, programs in shapes.items():
            # Warm-up on the whole workload (untimed, cache emptied after): every kernel variant its steps
            # need is compiled before the timed run. One program would not do: its steps are small and
            # replay CUDA graphs, so the workload's multi-sequence eager steps would compile while timed.
            run_programs(engine, programs)
            runs = [run_programs(engine, programs, book) for _ in range(repeats)]
            by_workload[name].append({"workload": name, "system": system, **runs[0], **spread(runs)})
        del engine, book
        release_memory()  # this engine's KV cache goes before the next one sizes its own from free memory
    rows, json_rows = [], []
    for results in by_workload.values():
        by_system = {r["system"]: r for r in results}
        for r in results:
            r["vs vllm on"] = r["programs/s"] / by_system[VLLM_ON]["programs/s"]
            r["vs vllm off"] = r["programs/s"] / by_system[VLLM_OFF]["programs/s"]
            r["% of optimal hits"] = (100 * r["hit rate"] / r["optimal hit rate"] if r["optimal hit rate"] > 0
                                      else None)
        rows += [by_system[s] for s in (SGL, VLLM_ON, VLLM_OFF)]  # nano_sglang, its peer, no cache
    if cfg.json_programs:
        engine = SGLEngine(EngineConfig(model=model, **engine_args))
        layers["nano_sglang JSON"] = engine.layers_applied
        n = max(2, cfg.json_programs // (8 if quick else 1))
        run_json(engine, 2, True)  # warm-up: FSM compile and token masks
        pairs = [(run_json(engine, n, False), run_json(engine, n, True)) for _ in range(repeats)]  # alternated
        json_rows = [{**pairs[0][i], **spread([p[i] for p in pairs])} for i in (0, 1)]
        speedups = [on["programs/s"] / off["programs/s"] for off, on in pairs]
        json_rows[1]["speedup"] = statistics.median(speedups)
        if repeats > 1:
            json_rows[1]["min speedup"], json_rows[1]["max speedup"] = min(speedups), max(speedups)
    if rows:
        key = "bookkeeping ms by method"
        print_table([{k: v for k, v in r.items() if k != key} for r in rows],
                    title=f"nano_sglang bench: {model}{' (quick CPU version)' if quick else ''}")
        for r in rows:
            if key in r:
                print(f"{r['workload']}: bookkeeping ms by method: {r[key]}", flush=True)
        for line in headlines(rows):
            print(line, flush=True)
    if json_rows:
        print_table(json_rows, title="JSON decoding (regex FSM from a JSON schema)")
    print(f"layers applied: {', '.join(dict.fromkeys(n for v in layers.values() for n in v)) or 'none'}",
          flush=True)
    record = {"bench": "nano_sglang", "model": model, "quick": quick, "policy": cfg.policy, "peer": VLLM_ON,
              "engine": engine_args, "layers_applied": layers, "rows": rows, "json": json_rows}
    path = Path(hydra_run_dir()) / "bench.json"
    write_json(path, record)
    print(f"wrote {path}", flush=True)
    return record
