"""The one training loop of nano-infra: data, LR schedule, optimizer steps, logging, checkpoint and resume.

Parallelism lives elsewhere. A parallel package (nano_megatron, nano_zero) implements `TrainEngine` —
"run forward/backward over these micro-batches, reduce, clip, step; gather the weights; save/load my
shards" — and `train(engine, cfg)` drives it. `LocalEngine` is the single-process engine (shared.model +
torch.optim.AdamW): the oracle every parallel engine is tested against, as in "parallel training equals
single-process training" (docs/ARCHITECTURE.md).

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

import contextlib
import json
import math
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from shared.accounting import flops_per_token
from shared.checkpoint import (  # a training run's checkpoints live beside the HF format they write
    CHECKPOINT_DIR,
    RESUME_DIR,
    ResumableEngine,
    load_resume_file,
    load_training_checkpoint,
    resume_directory,
    save_training_checkpoint,
)
from shared.config import ModelConfig
from shared.data import TokenBatches
from shared.dist import get_world_size, report
from shared.model import CausalLM, build_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


class TrainEngine(ResumableEngine, Protocol):
    """What a parallelism package implements; the loop drives it (and checkpoints it: ResumableEngine's
    consolidated_state_dict, save_resume_state, load_resume_state)."""

    dp_rank: int
    dp_world_size: int

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        """Forward/backward every micro-batch of this dp rank, reduce gradients, clip, one optimizer step."""
        ...


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


def check_seq_len(cfg: TrainConfig, model_config: ModelConfig) -> None:
    """ValueError unless the training windows fit the model's positions (RoPE tables and the saved
    config.json are sized by `max_position_embeddings`)."""
    if cfg.seq_len > model_config.max_position_embeddings:
        raise ValueError(f"train.seq_len ({cfg.seq_len}) exceeds the model's max_position_embeddings "
                         f"({model_config.max_position_embeddings}): shorten train.seq_len or set "
                         f"model.max_position_embeddings")


def check_batch_sizes(cfg: TrainConfig, dp_world_size: int) -> int:
    """Micro-batches per step on one dp rank; ValueError unless global = micro × dp × accumulation."""
    if cfg.global_batch_size % (cfg.micro_batch_size * dp_world_size):
        raise ValueError(
            f"global_batch_size ({cfg.global_batch_size}) must be divisible by micro_batch_size "
            f"({cfg.micro_batch_size}) x data-parallel size ({dp_world_size})")
    return cfg.global_batch_size // (cfg.micro_batch_size * dp_world_size)


# ---------------------------------------------------------------------------------------------------
# The single-process reference engine.


class MixedPrecisionAdamW:
    """AdamW on fp32 master weights, the optimizer every engine of this repo steps with.

    dtype="fp32": the parameters are the master weights. dtype="bf16": mixed precision as in Micikevicius
    et al. 2018 and ZeRO §3.1 — the model computes in bf16, AdamW updates fp32 copies of its parameters,
    which are copied back into the model after each step. Create it from the fp32 parameters *before*
    the model is cast to bf16 (casting keeps the Parameter objects). Matrices and embeddings decay,
    vectors do not (`decays`). `options` go to torch.optim.AdamW (fused, foreach, capturable, ...), or to
    `optimizer_class` (e.g. torch's ZeroRedundancyOptimizer over AdamW) given AdamW's arguments.
    """

    def __init__(self, params: list[torch.Tensor], cfg: TrainConfig, lr: float | torch.Tensor | None = None,
                 optimizer_class: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW, **options: Any) -> None:
        self.params = params
        self.master = params if cfg.dtype == "fp32" else [p.detach().float().clone() for p in params]
        groups = [{"params": [m for m in self.master if decays(m)], "weight_decay": cfg.weight_decay},
                  {"params": [m for m in self.master if not decays(m)], "weight_decay": 0.0}]
        self.optimizer = optimizer_class(groups, lr=cfg.lr if lr is None else lr, betas=(cfg.beta1, cfg.beta2),
                                         eps=cfg.eps, **options)

    def master_grads(self) -> list[torch.Tensor]:
        """The fp32 gradients AdamW will use: under bf16 the model's gradients upcast onto the master
        weights (the model's own are released); parameters without a gradient are left out."""
        if self.master is not self.params:
            for m, p in zip(self.master, self.params):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        return [m.grad for m in self.master if m.grad is not None]

    def step(self, grad_norm: torch.Tensor | float, max_norm: float, lr: float | None) -> None:
        """Clip by the global norm (torch.nn.utils.clip_grad_norm_'s rule), one AdamW step at `lr`, copy
        the master weights into the model, drop the gradients. `lr=None`: the optimizer keeps its own
        (a device tensor) and clipping never reads the norm back to the host, so the step can be
        captured in a CUDA graph."""
        grads = [m.grad for m in self.master if m.grad is not None]
        if lr is None:
            coef = clip_coefficient_on_device(grad_norm, max_norm)
        else:
            coef = clip_coefficient(grad_norm, max_norm)
            coef = None if coef >= 1.0 else coef
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        if coef is not None:
            for kind in {type(g) for g in grads}:  # DTensor and plain gradients cannot share one foreach call
                torch._foreach_mul_([g for g in grads if type(g) is kind], coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)

    @torch.no_grad()
    def load(self, master: list[torch.Tensor], optimizer_state: dict) -> None:
        """Restore saved master weights (copied into the model too) and AdamW's state."""
        torch._foreach_copy_(self.master, [t.to(m.device) for m, t in zip(self.master, master)])
        if self.master is not self.params:
            torch._foreach_copy_(self.params, self.master)
        self.optimizer.load_state_dict(optimizer_state)


class LocalEngine:
    """One process, shared.model + torch.optim.AdamW, clipping: the reference every parallel engine matches.

    dtype="fp32": fp32 weights, gradients and Adam states. dtype="bf16": a bf16 model, fp32 master weights
    (`MixedPrecisionAdamW`; autocast is not used: the model's fused norm+residual needs one dtype for
    both, which autocast's fp32 embeddings and bf16 matmuls break).
    """

    def __init__(self, model_config: ModelConfig, cfg: TrainConfig, device: str | torch.device = "cpu",
                 model: CausalLM | None = None) -> None:
        self.model_config, self.cfg = model_config, cfg
        self.dp_rank, self.dp_world_size = 0, 1
        self.device = torch.device(device)
        self.model = model if model is not None else build_model(model_config, self.device, seed=cfg.seed)
        self.opt = MixedPrecisionAdamW([p for p in self.model.parameters() if p.requires_grad], cfg,
                                       foreach=False)
        if cfg.dtype == "bf16":
            self.model.to(torch.bfloat16)
        self.params, self.master, self.optimizer = self.opt.params, self.opt.master, self.opt.optimizer

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        num_tokens = sum(t.numel() for _, t in micro_batches)
        total = 0.0
        for x, y in micro_batches:
            loss = next_token_loss(self.model(x.to(self.device)), y.to(self.device), num_tokens)
            loss.backward()
            total += loss.item()
        grads = self.opt.master_grads()
        # fp32 reductions over 1e5+ elements on CPU drift by ~1e-5 relative: accumulate the oracle's norm
        # in fp64 there, as the parallel engines do (CUDA's tree reductions are exact enough)
        acc = torch.float64 if self.device.type == "cpu" else torch.float32
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=acc) for g in grads]))
        self.opt.step(norm, self.cfg.grad_clip, lr)
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
        state = load_resume_file(Path(directory) / "local_engine.pt", ("master", "optimizer"),
                                 "LocalEngine resume", self.device)
        self.opt.load(state["master"], state["optimizer"])


# ---------------------------------------------------------------------------------------------------
# The loop.


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the records of steps <= `last_step` (the resumed step): a run resumed into its own directory
    logs the steps after it again, and must not list them twice. Rewritten atomically."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= last_step:
            keep.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)


def train(engine: TrainEngine, cfg: TrainConfig, *, is_main: bool = True,
          peak_flops: float | None = None) -> list[dict]:
    """Train `engine` for `cfg.steps` optimizer steps (or until `cfg.stop_at`); return the logged records.

    Every dp rank draws its rows of the same global batch, split into micro-batches; rank 0 shows a
    progress bar, reports each logged record (`shared.dist.report`: under Hydra also into the run's log
    file) and appends it to `out_dir/metrics.jsonl`: step, loss, lr, grad_norm, tokens_per_s (global),
    mfu (per-device `peak_flops` × world size; None when no peak is given). Saves every `save_every` steps
    and at the end (see `save_training_checkpoint`) and reports where; `resume_from` continues the same
    data stream, schedule and RNG (metrics.jsonl keeps only the steps up to the resumed one); a checkpoint
    already past the run's last step (`train.steps`, or `train.stop_at`) is a ValueError raised before
    anything is written, as one at that step has nothing to train. Call on every rank; the batch-size and sequence-length checks raise before any collective, on every
    rank alike.
    """
    check_batch_sizes(cfg, engine.dp_world_size)
    check_seq_len(cfg, engine.model_config)
    local_batch = cfg.global_batch_size // engine.dp_world_size
    data = TokenBatches.from_corpus("train", batch_size=local_batch, seq_len=cfg.seq_len, seed=cfg.seed,
                                    rank=engine.dp_rank, world_size=engine.dp_world_size, corpus=cfg.corpus)
    start = 0
    if cfg.resume_from:
        start = load_training_checkpoint(engine, cfg.resume_from, data)
    end = cfg.stop_at if cfg.stop_at is not None else cfg.steps
    name = "train.stop_at" if cfg.stop_at is not None else "train.steps"
    if start > end:  # its weights are of step `start`: saving them as step `end` would be a lie
        raise ValueError(f"train.resume_from: checkpoint {str(cfg.resume_from)!r} is at step {start}, past "
                         f"{name}={end}: nothing to train (set {name} above {start} to continue the run)")
    if start == end and cfg.resume_from and is_main:
        report(f"train.resume_from: checkpoint {str(cfg.resume_from)!r} is at step {start} = {name}: "
               "nothing to train")
    out = Path(cfg.out_dir)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(out / "metrics.jsonl", start)
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    flops_per_step = flops_per_token(engine.model_config, cfg.seq_len) * tokens_per_step
    peak_total = peak_flops * get_world_size() if peak_flops else None
    records: list[dict] = []
    bar, console = None, contextlib.nullcontext()
    if is_main:
        from tqdm.auto import tqdm  # the one progress bar, on rank 0
        from tqdm.contrib.logging import logging_redirect_tqdm

        bar = tqdm(total=end, initial=start, desc="train", unit="step", dynamic_ncols=True)
        console = logging_redirect_tqdm()  # log lines on the console go above the bar, not through it
    saved_at = start
    with console:
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
                    report(f"step {rec['step']:>6} | loss {rec['loss']:.4f} | lr {lr:.2e} | "
                           f"grad_norm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s"
                           + (f" | mfu {rec['mfu']:.1%}" if rec["mfu"] is not None else ""), bar.write)
            if bar is not None:
                bar.update(1)
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < end:
                save_training_checkpoint(engine, cfg.out_dir, asdict(cfg), step + 1, data, is_main)
                saved_at = step + 1
        if bar is not None:
            bar.close()
        ckpt = out / CHECKPOINT_DIR
        if end > saved_at or not (ckpt / RESUME_DIR).exists():
            save_training_checkpoint(engine, cfg.out_dir, asdict(cfg), end, data, is_main)
        if is_main:
            report(f"checkpoint of step {end}: {ckpt.resolve()} (HF format: loads in transformers, "
                   f"shared.checkpoint.load_model and nano_vllm; resume with train.resume_from={ckpt.resolve()})")
    return records


def train_local(model_config: ModelConfig, cfg: TrainConfig) -> tuple[LocalEngine, list[dict]]:
    """Convenience: single-process training of shared.model (the reference run)."""
    engine = LocalEngine(model_config, cfg)
    return engine, train(engine, cfg)


__all__ = [
    "LocalEngine",
    "MixedPrecisionAdamW",
    "StepResult",
    "TrainConfig",
    "TrainEngine",
    "check_batch_sizes",
    "check_seq_len",
    "clip_coefficient",
    "clip_coefficient_on_device",
    "decays",
    "load_training_checkpoint",
    "lr_at",
    "micro_batches_of",
    "next_token_loss",
    "resume_directory",
    "save_training_checkpoint",
    "train",
    "train_local",
]
