"""What speculative decoding costs in device memory: the draft's weights and KV cache beside the target's.

nano_vllm reports a runner's weights and KV cache in one line (`nano_vllm.kv_cache.kv_cache_summary`); a
`SpecDecodeEngine` holds a second model where its drafter has one, and this reports both the same way:

    from nano_specdec import LLM
    from nano_specdec.memory import memory_record, memory_summary
    llm = LLM("tiny", speculative_config={"method": "draft_model", "num_speculative_tokens": 4,
                                          "model": "tiny"})
    print(memory_summary(llm.engine))   # target: weights ..., KV cache ...; draft 'tiny': weights ...
    memory_record(llm.engine)["draft"]["kv_cache_GiB"]

A drafter that runs a model through nano_vllm's `ModelRunner` (a draft model, on its own paged KV pool)
is reported in full; one that holds other modules (draft heads, a draft layer) by their weights; prompt
lookup holds no model (its n-gram index lives on the host).
"""

from __future__ import annotations

from typing import Any

import torch

from nano_vllm.config import EngineConfig
from nano_vllm.kv_cache import kv_block_bytes, kv_cache_summary, weight_bytes
from shared.accounting import param_count
from shared.config import ModelConfig

GiB = 2**30


def _runner_record(runner: Any) -> dict:
    """Weights and KV cache of a nano_vllm ModelRunner (nano_vllm.bench's `memory` fields)."""
    kv = runner.num_blocks * runner.block_bytes * runner.tp_size
    return {"weights_GiB": weight_bytes(runner.model) / GiB, "kv_blocks": runner.num_blocks,
            "kv_block_bytes": runner.block_bytes, "kv_cache_GiB": kv / GiB,
            "kv_dtype": str(runner.config.kv_torch_dtype).removeprefix("torch.")}


def draft_modules(proposer: Any) -> dict[str, torch.nn.Module]:
    """The torch modules a drafter holds as attributes (a draft model's runner excluded)."""
    return {name: m for name, m in vars(proposer).items() if isinstance(m, torch.nn.Module)}


def memory_record(engine: Any) -> dict:
    """{"target": weights and KV cache, "draft": the same for the drafter (None without a model), "method",
    "total_GiB"}; sizes in GiB, rank 0's weights (nano_vllm's convention)."""
    target = _runner_record(engine.model_runner)
    proposer = getattr(engine, "proposer", None)
    spec = getattr(engine, "speculative_config", None)
    draft = None
    if proposer is not None and hasattr(getattr(proposer, "runner", None), "num_blocks"):
        draft = {"model": getattr(spec, "model", None), **_runner_record(proposer.runner)}
    elif proposer is not None and draft_modules(proposer):
        nbytes = sum(weight_bytes(m) for m in draft_modules(proposer).values())
        draft = {"model": getattr(spec, "model", None), "weights_GiB": nbytes / GiB,
                 "kv_blocks": 0, "kv_cache_GiB": 0.0}
    total = sum(r["weights_GiB"] + r["kv_cache_GiB"] for r in (target, draft) if r is not None)
    return {"method": getattr(spec, "method", None), "target": target, "draft": draft,
            "total_GiB": total}


def memory_summary(engine: Any) -> str:
    """One line: the target's `kv_cache_summary`, then the draft's (or why there is none)."""
    line = f"target: {kv_cache_summary(engine.model_runner)}"
    proposer = getattr(engine, "proposer", None)
    spec = getattr(engine, "speculative_config", None)
    if proposer is None:
        return line
    if hasattr(getattr(proposer, "runner", None), "num_blocks"):
        return line + f"; draft {getattr(spec, 'model', None)!r}: {kv_cache_summary(proposer.runner)}"
    record = memory_record(engine)["draft"]
    if record is not None:
        return line + f"; draft ({spec.method}): weights {_size(record['weights_GiB'] * GiB)}"
    return line + f"; draft ({getattr(spec, 'method', '?')}): no model (host-side lookup)"


def draft_bytes(config: EngineConfig, draft: ModelConfig, method: str) -> tuple[int, int]:
    """(weights, KV bytes per block) of the draft beside the target: a draft model whole; EAGLE's layer
    and its fc (2H -> H), the embedding and LM head being the target's; (0, 0) for prompt lookup and
    Medusa, which run no model on a KV pool of their own."""
    if method not in ("draft_model", "eagle"):
        return 0, 0
    h = draft.hidden_size
    params = param_count(draft) if method == "draft_model" else \
        param_count(draft, include_embedding=False) + 2 * h * h + h - \
        (0 if draft.tie_word_embeddings else draft.vocab_size * h)
    return (params * config.torch_dtype.itemsize,
            kv_block_bytes(draft, config.block_size, draft.num_key_value_heads, config))


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.2f} MiB"
