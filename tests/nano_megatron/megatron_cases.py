"""Shared setup of the nano_megatron tests: the tiny model, the data, the runs on both sides.

Module-level functions, so `shared.dist.run_distributed` can import them in its spawned processes.

Why lr=1e-3 and Adam eps=1e-6: parallel runs sum the same numbers in a different order, so gradients
differ from the single process by fp32 rounding (~1e-9 absolute here). Adam divides each gradient by
√v + eps; for an element whose gradient is itself ~1e-8 (near eps=1e-8) that rounding becomes a
percent-level change of its update. eps=1e-6 bounds the relative change of any update by ~1e-3, so
parameters after 5 steps agree to a few 1e-6 while every step moves them by ~lr = 1e-3: a wrong
gradient anywhere shows as an O(1e-3) difference, far above the 1e-5 tolerance.
"""

from __future__ import annotations

import torch

from nano_megatron.build import LayerConfig, build_engine, split_layer_switches
from nano_megatron.engine import MegatronEngine, ParallelConfig
from shared.config import ModelConfig
from shared.train import LocalEngine, TrainConfig, micro_batches_of

VOCAB = 1001  # odd: not divisible by tp=2, so the vocabulary is padded
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def model_config(**overrides) -> ModelConfig:
    """The `tiny` preset (Qwen3-style: q/k norms, GQA 4:2, tied embeddings), made smaller."""
    return ModelConfig.from_name("tiny").replace(**{**SMALL, **overrides})


def train_config(**overrides) -> TrainConfig:
    base = dict(global_batch_size=4, micro_batch_size=1, seq_len=16, lr=1e-3, min_lr=0.0, eps=1e-6, warmup_steps=0)
    return TrainConfig(**{**base, **overrides})


def global_batches(cfg: TrainConfig, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random token windows, with the ids at the vocabulary shard edges (0, 500, 501, 1000) forced in,
    so the vocab-parallel embedding and loss see ids on both sides of every boundary and the last one."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        w = torch.randint(0, VOCAB, (cfg.global_batch_size, cfg.seq_len + 1), generator=gen)
        w[:, 1:5] = torch.tensor([0, VOCAB // 2, VOCAB // 2 + 1, VOCAB - 1])
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out


def local_rows(x: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    n = x.shape[0] // dp
    return x[dp_rank * n:(dp_rank + 1) * n]


def reference_run(case: dict, steps: int = 5) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The oracle: shared.train.LocalEngine, one process, same initial weights (seed) and data."""
    mc, cfg = model_config(**case.get("model", {})), train_config(**case.get("train", {}))
    engine = LocalEngine(mc, cfg)
    losses = [engine.train_step(micro_batches_of(x, y, cfg.micro_batch_size), cfg.lr).loss
              for x, y in global_batches(cfg, steps)]
    return losses, engine.consolidated_state_dict()


NO_LAYERS = dict(tp_comm_overlap=False, cuda_graph=False, overlap_micro_batches=False)


def make_engine(case: dict) -> MegatronEngine:
    """The engine a case's `parallel` asks for, with exactly the performance layers it names (the others
    off, so that what runs does not depend on the machine), built as the trainer builds it."""
    mc, cfg = model_config(**case.get("model", {})), train_config(**case.get("train", {}))
    parallel, switches = split_layer_switches(case["parallel"])
    layers = LayerConfig(**{**NO_LAYERS, **switches})
    return build_engine(mc, ParallelConfig(**parallel), cfg, layers=layers)


def parallel_run(case: dict, steps: int = 5) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    """The same training on this rank's part of the grid; (losses, full weights on rank 0)."""
    engine = make_engine(case)
    cfg = engine.cfg
    losses = []
    for x, y in global_batches(cfg, steps):
        x, y = (local_rows(t, engine.dp_rank, engine.dp_world_size) for t in (x, y))
        losses.append(engine.train_step(micro_batches_of(x, y, cfg.micro_batch_size), cfg.lr).loss)
    state = engine.consolidated_state_dict()
    engine.close()
    return losses, state


def parallel_grads(case: dict) -> dict[str, torch.Tensor] | None:
    """Fully reduced gradients of the first global batch (full tensors on rank 0)."""
    engine = make_engine(case)
    x, y = global_batches(engine.cfg, 1)[0]
    x, y = (local_rows(t, engine.dp_rank, engine.dp_world_size) for t in (x, y))
    engine.forward_backward(micro_batches_of(x, y, engine.cfg.micro_batch_size))
    grads = engine.consolidated_grads()
    engine.close()
    return grads


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
