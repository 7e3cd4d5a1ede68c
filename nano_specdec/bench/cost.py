"""The cost side of speculative decoding at a large target's shape (`cost=true`), and the speedup it implies.

Leviathan's walltime analysis (Theorem 3.8): with c the draft's cost relative to the target's forward,
the expected speedup is τ / (c·k + 1) when a k + 1 token verification costs what a one-token step does. On a
real device neither holds exactly, so the three costs are measured here, on random weights of the
target's shape (`cost_model`, default llama3-8b) and a draft's shape (`cost_draft`, default Llama-3.2-1B's,
the usual draft of an 8B Llama), through nano_vllm's own `ModelRunner` (its layers and CUDA graphs),
at `cost_context` tokens of context per sequence, for every batch size:

* the decode step: one token per sequence, the logits of each;
* the verify step: k + 1 tokens per sequence in one forward, the logits of every row (what
  nano_specdec's runner computes); the verification rule itself (an argmax or a residual draw) is not
  counted. Its attention runs as the engine runs it, each chain's rows through the decode kernel
  (`StepInputs.decode_rows`), and again with every row through the varlen kernel, as before that
  (`verify ms, varlen kernel`: the A/B of that choice, same runner, same inputs);
* the draft step: one token per sequence through the draft's shape (a draft model runs k of them);
* EAGLE's draft step: one token per sequence through one decoder layer of the target's shape and the
  target's LM head (EAGLE §3: the draft is one layer on the target's features, with the target's frozen
  embedding and head), timed as a one-layer model of the target's shape with a tied head; its FC (2h → h,
  ~4% of the step's bytes at the llama3-8b shape) is not counted. A chain runs k of them.

`projection(...)` turns those costs and a τ measured by the bench into the speedup they imply for the
large target: τ · t_decode / (f · t_verify + (1 − f) · t_decode + t_draft), with f the measured share of
decode forwards that verified drafts (prompt lookup proposes none where it finds no match), and t_draft
k draft steps for a draft model or EAGLE, the measured host time of prompt lookup for `ngram`. It is a projection — the τ comes from the bench's own
target and draft, not from an 8B pair — and is labelled so wherever it is printed or recorded.

Times are device times (`shared.bench.benchmark`: CUDA events; the host's work is not counted) on a GPU
and wall times on a CPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from nano_vllm.config import EngineConfig
from nano_vllm.model_runner import ModelRunner
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.scheduler import SchedulerOutput
from shared.bench import benchmark, release_memory
from shared.config import PRESETS, resolve_model_config


class CostSeq:
    """What `ModelRunner.prepare` reads of a sequence: `context` tokens cached, `new` to compute."""

    sampling_params = SamplingParams(temperature=0.0)

    def __init__(self, seq_id: int, context: int, new: int, block_table: list[int]):
        self.seq_id, self.block_table = seq_id, block_table
        self.token_ids = [1 + (7 * i + seq_id) % 1000 for i in range(context + new)]
        self.num_computed_tokens, self.num_cached_tokens = context, 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def make_runner(base: EngineConfig, model: Any, max_batch: int, per_seq: int,
                max_model_len: int, rows_per_seq: int = 1) -> ModelRunner:
    """nano_vllm's runner of `model` (a preset, a checkpoint directory, or a dict of ModelConfig fields:
    random weights of that shape) with a KV pool of `max_batch` sequences of `per_seq` blocks. A verifying
    runner (`rows_per_seq` = k + 1) captures graphs of k + 1 tokens a sequence at each decode batch size
    and keeps k + 1 logits rows a sequence, as nano_specdec's runner does: without them a verify step
    would be padded to the smallest prefill graph, or run eagerly, and cost what no engine pays."""
    mcfg = resolve_model_config(dict(model) if not isinstance(model, str) else model)
    # a dict is a shape: random weights, which nano_vllm builds for any preset name
    name = model if isinstance(model, str) else next(iter(PRESETS))
    cfg = base.replace(model=name, num_kv_blocks=max_batch * per_seq, kv_cache_memory_bytes=None,
                       max_num_seqs=max_batch, max_model_len=max_model_len)
    cls = ModelRunner if rows_per_seq == 1 else type(
        "VerifyingRunner", (ModelRunner,), {"sample_rows_per_seq": rows_per_seq})
    return cls(cfg, mcfg, max_model_len)


def step_seconds(runner: ModelRunner, batch: int, context: int, new: int, per_seq: int,
                 device: str, varlen: bool = False) -> float:
    """Median seconds of one forward of `batch` sequences computing `new` tokens each after `context`
    cached ones, every new row's logits returned; `varlen`: every row's attention in the varlen kernel."""
    seqs = [CostSeq(i, context, new, list(range(i * per_seq, (i + 1) * per_seq)))
            for i in range(batch)]
    out = SchedulerOutput(seqs, [new] * batch)

    def forward():
        inputs = runner.prepare(out)
        inputs.sample_rows = list(range(len(inputs.token_ids)))
        if varlen:
            inputs.num_decodes = 0
        return runner.run(inputs)

    return benchmark(forward, device=device, warmup=3, repeats=10)


def eagle_shape(target: Any) -> dict:
    """EAGLE's draft at `target`'s shape, as ModelConfig fields: one decoder layer, the head tied to the
    embedding (the target's, read once a step)."""
    mcfg = resolve_model_config(dict(target) if not isinstance(target, str) else target)
    fields = {k: v for k, v in dataclasses.asdict(mcfg).items() if k != "extra"}
    return {**fields, "num_hidden_layers": 1, "tie_word_embeddings": True}


def measure_costs(base: EngineConfig, target: Any, draft: Any, k: int, batch_sizes: list[int],
                  context: int, device: str, eagle: bool = False) -> list[dict]:
    """Per batch size: decode, verify (k + 1 tokens) and draft step times in ms, and with `eagle` EAGLE's
    draft step at the target's shape (module docstring)."""
    max_b, bs = max(batch_sizes), base.block_size
    per_seq = math.ceil((context + k + 1) / bs)
    max_model_len = per_seq * bs
    rows = [{"batch": b} for b in batch_sizes]
    base = base.replace(max_num_batched_tokens=max(base.max_num_batched_tokens, max_b * (k + 1)))
    runner = make_runner(base, target, max_b, per_seq, max_model_len, rows_per_seq=k + 1)
    for row in rows:
        b = row["batch"]
        row["decode ms"] = 1e3 * step_seconds(runner, b, context, 1, per_seq, device)
        row[f"verify ms ({k + 1} tokens)"] = 1e3 * step_seconds(runner, b, context, k + 1, per_seq,
                                                                device)
        row["verify / decode"] = row[f"verify ms ({k + 1} tokens)"] / row["decode ms"]
        row["verify ms, varlen kernel"] = 1e3 * step_seconds(runner, b, context, k + 1, per_seq, device,
                                                             varlen=True)
    del runner
    release_memory()  # the target's weights and KV pool, before the draft's are built
    runner = make_runner(base, draft, max_b, per_seq, max_model_len)
    for row in rows:
        row["draft step ms"] = 1e3 * step_seconds(runner, row["batch"], context, 1, per_seq, device)
        row["draft / decode"] = row["draft step ms"] / row["decode ms"]
    if eagle:
        del runner
        release_memory()
        runner = make_runner(base, eagle_shape(target), max_b, per_seq, max_model_len)
        for row in rows:
            row["eagle step ms"] = 1e3 * step_seconds(runner, row["batch"], context, 1, per_seq, device)
            row["eagle / decode"] = row["eagle step ms"] / row["decode ms"]
    return rows


def projection(costs: list[dict], rows: list[dict], k: int) -> list[dict]:
    """The speedup each measured (method, workload, batch, temperature) row's τ implies at the cost
    shapes' step times (module docstring); methods without a cost model here are left out."""
    by_batch = {c["batch"]: c for c in costs}
    out = []
    for r in rows:
        c, tau = by_batch.get(r["batch"]), r.get("tau")
        if c is None or tau is None:
            continue
        if r["method"] == "ngram":
            draft_ms = r["draft ms/step"]
        elif r["method"] == "draft_model":
            draft_ms = k * c["draft step ms"]
        elif r["method"] == "eagle" and "eagle step ms" in c:  # a chain: k steps of the one layer
            draft_ms = k * c["eagle step ms"]
        else:
            continue
        f = (r.get("verified %") or 0.0) / 100
        step_ms = f * c[f"verify ms ({k + 1} tokens)"] + (1 - f) * c["decode ms"] + draft_ms
        out.append({"method": r["method"], "workload": r["workload"], "batch": r["batch"],
                    "temperature": r["temperature"], "tau (measured)": tau,
                    "verified % (measured)": 100 * f, "draft ms": draft_ms, "step ms": step_ms,
                    "decode ms": c["decode ms"], "projected speedup": tau * c["decode ms"] / step_ms})
    return out
