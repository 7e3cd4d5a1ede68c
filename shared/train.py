"""The one training loop of nano-infra: data, LR schedule, optimizer steps, logging, checkpoint and resume.

Parallelism lives elsewhere. A parallel package (nano_megatron, nano_zero) implements `TrainEngine` —
"run forward/backward over these micro-batches, reduce, clip, step; gather the weights; save/load my
shards" — and `train(engine, cfg)` drives it. `LocalEngine` is the single-process engine (shared.model +
torch.optim.AdamW): the oracle every parallel engine is tested against, as in "parallel training equals
single-process training" (DESIGN.md).

Two conventions make that equality exact rather than approximate:

* **The loss is normalised by the global batch.** `next_token_loss` sums the cross-entropy of a
  micro-batch and divides by the number of target tokens of the whole *global* batch. Gradients of
  micro-batches and data-parallel ranks therefore simply add up (gradient accumulation is `+=`, the
  data-parallel reduction is a SUM), and no split of the batch changes a gradient.
* **Every dp rank draws the same global batch and keeps its rows** (`shared.data.TokenBatches`), so N
  ranks see exactly what one process sees.

Weight decay follows nanoGPT / GPT-3: matrices and embeddings decay, vectors (norm weights, biases) do
not (`decays`); every engine applies the same rule.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from shared.accounting import flops_per_token
from shared.checkpoint import save_checkpoint
from shared.config import ModelConfig
from shared.data import TokenBatches
from shared.dist import barrier, get_rank, get_world_size
from shared.model import CausalLM, build_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CHECKPOINT_DIR = "checkpoint"  # under out_dir: the consolidated HF checkpoint
RESUME_DIR = "resume"  # under the checkpoint: engine shards + loop state


@dataclass
class TrainConfig:
    """What `train` does, independent of how the model is parallelised (Hydra's `train.*` group)."""

    steps: int = 100
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 2  # sequences per forward/backward on one dp rank
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global L2 norm; 0 disables
    seed: int = 0
    dtype: str = "fp32"  # "fp32" | "bf16"
    log_every: int = 1
    save_every: int = 0  # 0: save only at the end
    out_dir: str = "."  # the Hydra run directory
    resume_from: str | None = None
    stop_at: int | None = None  # end this run after this many steps (the schedule still spans `steps`)
    corpus: str = "docs"  # shared.data corpus to train on: "docs" (embedded docstrings) | "stdlib" (source)

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "micro_batch_size", "seq_len", "log_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {v!r}")
        for name in ("warmup_steps", "save_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be a non-negative int, got {v!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"TrainConfig needs 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError(f"grad_clip and weight_decay must be >= 0, got {self.grad_clip}, {self.weight_decay}")
        if self.stop_at is not None and not 0 < self.stop_at <= self.steps:
            raise ValueError(f"TrainConfig.stop_at must be in [1, steps={self.steps}], got {self.stop_at!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class StepResult:
    loss: float  # mean next-token cross-entropy over every token of the global batch
    grad_norm: float  # global L2 norm before clipping


class TrainEngine(Protocol):
    """What a parallelism package implements; the loop drives it."""

    model_config: ModelConfig
    dp_rank: int
    dp_world_size: int

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        """Forward/backward every micro-batch of this dp rank, reduce gradients, clip, one optimizer step."""
        ...

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights on the global rank 0, None elsewhere (a collective: call on all ranks)."""
        ...

    def save_resume_state(self, directory: Path) -> None:
        """Each rank writes its own shard(s) of weights and optimizer state into `directory`."""
        ...

    def load_resume_state(self, directory: Path) -> None: ...


# ---------------------------------------------------------------------------------------------------
# The pieces every engine shares.


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up to `lr` over `warmup_steps`,
    then cosine decay to `min_lr` at the last step (GPT-3's schedule, Brown et al. 2020 App. B)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Summed next-token cross-entropy of this micro-batch divided by `num_tokens`, the number of target
    tokens of the *global* batch: summing this over micro-batches and dp ranks gives the global mean, so
    neither gradient accumulation nor data parallelism changes the gradients. Computed in fp32."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return ce / num_tokens


def decays(param: torch.Tensor) -> bool:
    """Weight decay for matrices and embeddings, none for vectors (norm weights, biases)."""
    return param.dim() >= 2


def clip_coefficient(grad_norm: torch.Tensor | float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1; 1 when disabled."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (float(grad_norm) + 1e-6))


def clip_coefficient_on_device(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """`clip_coefficient` as an fp32 device scalar, without reading the norm back (CUDA-graph capturable):
    multiplying by it is exact (× 1.0) below the threshold. None when clipping is disabled."""
    if max_norm <= 0:
        return None
    return (max_norm / (grad_norm + 1e-6)).clamp(max=1.0).float()


def weak_hook(method: Callable, *bound: Any) -> Callable:
    """A hook that calls `method(*bound, *args)` without keeping `method`'s object alive.

    Why: autograd keeps tensor hooks (e.g. `register_post_accumulate_grad_hook`) in C++, where Python's
    garbage collector cannot see them, so param -> hook -> wrapper -> module -> param is a cycle nobody
    frees: every ZeRO / data-parallel wrapper built in a process (a bench trying several systems) would
    keep its buffers on the GPU forever. Once the object is gone the hook does nothing. `bound` is held
    strongly: it must not lead back to the hooked tensor (pass lookup keys, not objects that hold it)."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        live = ref()
        return None if live is None else live(*bound, *args)

    return hook


def micro_batches_of(inputs: torch.Tensor, targets: torch.Tensor, micro_batch_size: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a rank's batch into micro-batches of `micro_batch_size` rows (gradient accumulation)."""
    return list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)))


def check_batch_sizes(cfg: TrainConfig, dp_world_size: int) -> int:
    """Micro-batches per step on one dp rank; ValueError unless global = micro × dp × accumulation."""
    if cfg.global_batch_size % (cfg.micro_batch_size * dp_world_size):
        raise ValueError(
            f"global_batch_size ({cfg.global_batch_size}) must be divisible by micro_batch_size "
            f"({cfg.micro_batch_size}) x data-parallel size ({dp_world_size})")
    return cfg.global_batch_size // (cfg.micro_batch_size * dp_world_size)


# ---------------------------------------------------------------------------------------------------
# The single-process reference engine.


class LocalEngine:
    """One process, shared.model + torch.optim.AdamW, clipping: the reference every parallel engine matches.

    dtype="fp32": fp32 weights, gradients and Adam states. dtype="bf16": mixed precision as in
    Micikevicius et al. 2018 and ZeRO §3.1 — a bf16 model for forward/backward, fp32 master weights that
    AdamW updates, copied back to bf16 after each step (autocast is not used: the model's fused
    norm+residual needs one dtype for both, which autocast's fp32 embeddings and bf16 matmuls break).
    """

    def __init__(self, model_config: ModelConfig, cfg: TrainConfig, device: str | torch.device = "cpu",
                 model: CausalLM | None = None) -> None:
        self.model_config, self.cfg = model_config, cfg
        self.dp_rank, self.dp_world_size = 0, 1
        self.device = torch.device(device)
        self.model = model if model is not None else build_model(model_config, self.device, seed=cfg.seed)
        params = [p for p in self.model.parameters() if p.requires_grad]
        # master[i] is what AdamW updates: the parameter itself in fp32, an fp32 copy in bf16.
        self.master = params
        if cfg.dtype == "bf16":
            self.master = [p.detach().float().clone() for p in params]
            self.model.to(torch.bfloat16)
            params = [p for p in self.model.parameters() if p.requires_grad]
        self.params = params
        groups = [{"params": [m for m in self.master if decays(m)], "weight_decay": cfg.weight_decay},
                  {"params": [m for m in self.master if not decays(m)], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                           foreach=False)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        num_tokens = sum(t.numel() for _, t in micro_batches)
        total = 0.0
        for x, y in micro_batches:
            loss = next_token_loss(self.model(x.to(self.device)), y.to(self.device), num_tokens)
            loss.backward()
            total += loss.item()
        if self.master is not self.params:  # mixed precision: fp32 gradients for the fp32 master
            for m, p in zip(self.master, self.params):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        grads = [m.grad for m in self.master if m.grad is not None]
        # fp32 reductions over 1e5+ elements on CPU drift by ~1e-5 relative: accumulate the oracle's norm
        # in fp64 there, as the parallel engines do (CUDA's tree reductions are exact enough)
        acc = torch.float64 if self.device.type == "cpu" else torch.float32
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=acc) for g in grads]))
        coef = clip_coefficient(norm, self.cfg.grad_clip)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)
        return StepResult(loss=total, grad_norm=float(norm))

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named weights (the fp32 master weights under bf16)."""
        master = {id(p): m for p, m in zip(self.params, self.master)}
        return {k: master.get(id(v), v).detach().clone()
                for k, v in self.model.state_dict(keep_vars=True).items()}

    def save_resume_state(self, directory: Path) -> None:
        torch.save({"master": [m.detach() for m in self.master], "optimizer": self.optimizer.state_dict()},
                   Path(directory) / "local_engine.pt")

    def load_resume_state(self, directory: Path) -> None:
        state = torch.load(Path(directory) / "local_engine.pt", map_location=self.device, weights_only=True)
        with torch.no_grad():
            torch._foreach_copy_(self.master, state["master"])
            if self.master is not self.params:
                torch._foreach_copy_(self.params, self.master)
        self.optimizer.load_state_dict(state["optimizer"])


# ---------------------------------------------------------------------------------------------------
# Checkpoints: a consolidated HF directory for users, engine shards + loop state for resuming.


def _loop_state_file(directory: Path, rank: int) -> Path:
    return directory / f"loop-rank{rank:05d}.pt"


def save_training_checkpoint(engine: TrainEngine, cfg: TrainConfig, step: int, data: TokenBatches,
                             is_main: bool) -> Path:
    """Write `out_dir/checkpoint` (HF format, from rank 0) and `out_dir/checkpoint/resume` (every rank).

    The resume directory is written next to the old one and swapped in only when every rank is done, so
    a job killed mid-save still has the previous resume point. Collective: call on every rank.
    """
    ckpt = Path(cfg.out_dir) / CHECKPOINT_DIR
    tmp, final = ckpt / (RESUME_DIR + ".tmp"), ckpt / RESUME_DIR
    state = engine.consolidated_state_dict()
    if is_main:
        if state is None:
            raise RuntimeError("consolidated_state_dict() returned None on the main rank")
        save_checkpoint(state, engine.model_config, ckpt)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    engine.save_resume_state(tmp)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"step": step, "data": data.state_dict(), "rng": rng, "config": asdict(cfg)},
               _loop_state_file(tmp, get_rank()))
    barrier()
    if is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    barrier()
    return ckpt


def resume_directory(path: str | os.PathLike) -> Path:
    """Accept either the checkpoint directory or its `resume/` subdirectory."""
    p = Path(path)
    if (p / RESUME_DIR).is_dir():
        p = p / RESUME_DIR
    if not _loop_state_file(p, 0).is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a resume checkpoint (no {_loop_state_file(p, 0).name})")
    return p


def load_training_checkpoint(engine: TrainEngine, path: str | os.PathLike, data: TokenBatches) -> int:
    """Restore the engine, the data stream and the RNG; return the step to continue from."""
    directory = resume_directory(path)
    own = _loop_state_file(directory, get_rank())
    loop = torch.load(own if own.is_file() else _loop_state_file(directory, 0), weights_only=True)
    engine.load_resume_state(directory)
    data.load_state_dict(loop["data"])
    torch.set_rng_state(loop["rng"]["cpu"])
    if "cuda" in loop["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(loop["rng"]["cuda"])
    return int(loop["step"])


# ---------------------------------------------------------------------------------------------------
# The loop.


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def train(engine: TrainEngine, cfg: TrainConfig, *, is_main: bool = True,
          peak_flops: float | None = None) -> list[dict]:
    """Train `engine` for `cfg.steps` optimizer steps (or until `cfg.stop_at`); return the logged records.

    Every dp rank draws its rows of the same global batch, split into micro-batches; rank 0 shows a
    progress bar, prints each logged record and appends it to `out_dir/metrics.jsonl`:
    step, loss, lr, grad_norm, tokens_per_s (global), mfu (per-device `peak_flops` × world size; None
    when no peak is given). Saves every `save_every` steps and at the end (see
    `save_training_checkpoint`); `resume_from` continues the same data stream, schedule and RNG.
    Call on every rank; the batch-size check raises before any collective, on every rank alike.
    """
    check_batch_sizes(cfg, engine.dp_world_size)
    local_batch = cfg.global_batch_size // engine.dp_world_size
    data = TokenBatches.from_corpus("train", batch_size=local_batch, seq_len=cfg.seq_len, seed=cfg.seed,
                                    rank=engine.dp_rank, world_size=engine.dp_world_size, corpus=cfg.corpus)
    start = 0
    if cfg.resume_from:
        start = load_training_checkpoint(engine, cfg.resume_from, data)
    end = cfg.stop_at if cfg.stop_at is not None else cfg.steps
    out = Path(cfg.out_dir)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    flops_per_step = flops_per_token(engine.model_config, cfg.seq_len) * tokens_per_step
    peak_total = peak_flops * get_world_size() if peak_flops else None
    records: list[dict] = []
    bar = None
    if is_main:
        from tqdm.auto import tqdm  # the one progress bar, on rank 0

        bar = tqdm(total=end, initial=start, desc="train", unit="step", dynamic_ncols=True)
    saved_at = start
    for step in range(start, end):
        lr = lr_at(step, cfg)
        inputs, targets = data.next_batch()
        _sync()
        t0 = time.perf_counter()
        result = engine.train_step(micro_batches_of(inputs, targets, cfg.micro_batch_size), lr)
        _sync()
        dt = time.perf_counter() - t0
        if (step + 1) % cfg.log_every == 0 or step + 1 == end:
            rec: dict[str, Any] = {
                "step": step + 1, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                "tokens_per_s": tokens_per_step / dt,
                "mfu": flops_per_step / dt / peak_total if peak_total else None,
            }
            records.append(rec)
            if is_main:
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(rec) + "\n")
                bar.write(f"step {rec['step']:>6} | loss {rec['loss']:.4f} | lr {lr:.2e} | "
                          f"grad_norm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s"
                          + (f" | mfu {rec['mfu']:.1%}" if rec["mfu"] is not None else ""))
        if bar is not None:
            bar.update(1)
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < end:
            save_training_checkpoint(engine, cfg, step + 1, data, is_main)
            saved_at = step + 1
    if bar is not None:
        bar.close()
    if end > saved_at or not (Path(cfg.out_dir) / CHECKPOINT_DIR / RESUME_DIR).exists():
        save_training_checkpoint(engine, cfg, end, data, is_main)
    return records


def train_local(model_config: ModelConfig, cfg: TrainConfig) -> tuple[LocalEngine, list[dict]]:
    """Convenience: single-process training of shared.model (the reference run)."""
    engine = LocalEngine(model_config, cfg)
    return engine, train(engine, cfg)


__all__ = [
    "LocalEngine",
    "StepResult",
    "TrainConfig",
    "TrainEngine",
    "check_batch_sizes",
    "clip_coefficient",
    "clip_coefficient_on_device",
    "decays",
    "load_training_checkpoint",
    "lr_at",
    "micro_batches_of",
    "next_token_loss",
    "save_training_checkpoint",
    "train",
    "train_local",
]
