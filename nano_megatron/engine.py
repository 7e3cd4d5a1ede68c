"""`MegatronEngine`: tensor + sequence + pipeline + data parallel training of shared.model, as a
`shared.train.TrainEngine` (the loop, data, LR schedule, logging and checkpoints live in shared.train).

One step (`train_step`), on every rank of the (dp, pp, tp) grid:

1. the pipeline schedule runs forward/backward over this dp rank's micro-batches (pipeline_parallel),
   every layer split over tp (tensor_parallel, optionally sequence_parallel), each micro-batch loss
   normalised by the global token count (shared.train.next_token_loss's convention);
2. the last backward pass arms the bucketed dp all-reduce, which overlaps with it (data_parallel);
3. the two copies of a tied embedding (first and last stage) sum their gradients, and replicated
   parameters whose gradients are partial over tp (SP norms, per-head q/k norms) are all-reduced;
4. the global gradient norm (each parameter counted once), clipping and AdamW — elementwise, so
   sharded AdamW equals unsharded AdamW — on fp32 master weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nano_megatron.data_parallel import BucketedGradReducer
from nano_megatron.grid import GridShape, ParallelGrid
from nano_megatron.pipeline_parallel import PipelineSchedule, split_into_stage, stage_forward
from nano_megatron.schedules import SCHEDULES
from nano_megatron.tensor_parallel import (
    TPShard,
    apply_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from shared.checkpoint import load_resume_file
from shared.config import ModelConfig
from shared.dist import all_gather_single
from shared.model import CausalLM, build_model
from shared.train import (
    MixedPrecisionAdamW,
    StepResult,
    TrainConfig,
    check_batch_sizes,
    check_seq_len,
)

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]  # (inputs, targets) of each micro-batch


@dataclass
class ParallelConfig:
    """Hydra's `parallel.*` group: the grid and the papers' options (the performance-layer switches of
    the same group are `build.LayerConfig`'s)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # "gpipe" | "1f1b"
    activation_checkpointing: bool = False
    bucket_mb: float = 25.0  # data-parallel gradient bucket size


def validate(model_config: ModelConfig, parallel: ParallelConfig, cfg: TrainConfig,
             world_size: int) -> None:
    """Every configuration error, raised as ValueError identically on every rank before any collective."""
    shape = GridShape(parallel.tp, parallel.pp, parallel.dp)
    shape.check_world_size(world_size)
    tp, pp = parallel.tp, parallel.pp
    mc = model_config
    if mc.num_attention_heads % tp:
        raise ValueError(f"num_attention_heads ({mc.num_attention_heads}) is not divisible by "
                         f"tp={tp}: tensor parallelism gives every rank whole attention heads")
    if mc.num_key_value_heads % tp:
        raise ValueError(f"num_key_value_heads ({mc.num_key_value_heads}) is not divisible by "
                         f"tp={tp}: every rank needs whole kv heads (replicating kv heads when tp "
                         "exceeds them is not implemented)")
    if mc.intermediate_size % tp:
        raise ValueError(f"intermediate_size ({mc.intermediate_size}) is not divisible by tp={tp}")
    if mc.num_hidden_layers % pp:
        raise ValueError(f"num_hidden_layers ({mc.num_hidden_layers}) is not divisible by pp={pp}: "
                         "every pipeline stage gets the same number of layers")
    check_batch_sizes(cfg, parallel.dp)
    check_seq_len(cfg, model_config)
    if parallel.sequence_parallel and cfg.seq_len % tp:
        raise ValueError(f"sequence parallelism needs seq_len ({cfg.seq_len}) divisible by tp={tp}")
    if parallel.schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {parallel.schedule!r}; "
                         f"choose from {SCHEDULES}")
    if parallel.bucket_mb <= 0:
        raise ValueError(f"parallel.bucket_mb must be > 0, got {parallel.bucket_mb}")


def default_device() -> torch.device:
    """This rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MegatronEngine:
    """The TrainEngine of nano_megatron. Collective to construct (it builds the process grid).

    model: optionally the initial full model (consumed: it is split and sharded in place); default
    `build_model(model_config, seed=cfg.seed)`, the same weights on every rank (and as LocalEngine).
    """

    # the runtime of the schedules (the bench times a subclass)
    pipeline_schedule = PipelineSchedule

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig, cfg: TrainConfig,
                 device: torch.device | str | None = None, model: CausalLM | None = None) -> None:
        validate(model_config, parallel, cfg, dist.get_world_size())
        self.model_config, self.parallel, self.cfg = model_config, parallel, cfg
        self.device = torch.device(device) if device is not None else default_device()
        self.grid = grid = ParallelGrid(GridShape(parallel.tp, parallel.pp, parallel.dp))
        self.dp_rank, self.dp_world_size = grid.dp_rank, grid.dp
        if model is None:
            model = build_model(model_config, self.device, seed=cfg.seed)
        model = model.to(self.device)
        self.shards: dict[str, TPShard] = self._parallelize(model)
        self.model = model
        # names/params of this rank (named_parameters drops the second name of a tied matrix)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        # fp32 master weights that AdamW updates (the parameters themselves under fp32), as LocalEngine
        self.opt = MixedPrecisionAdamW([p for _, p in named], cfg, **self._optimizer_options())
        if cfg.dtype == "bf16":
            model.to(torch.bfloat16)
        self.params, self.master = self.opt.params, self.opt.master
        self.optimizer = self.opt.optimizer
        self.tied_copy = (model_config.tie_word_embeddings and grid.pp > 1
                          and (grid.is_first_stage or grid.is_last_stage))
        self.reducer = BucketedGradReducer(self.params, grid.dp_group, parallel.bucket_mb)
        self.vocab_start = 0
        if model.lm_head is not None:
            self.vocab_start = grid.tp_rank * model.lm_head.weight.shape[0] if grid.tp > 1 else 0
        self._num_tokens = 1
        self._seq_len = cfg.seq_len

    def _parallelize(self, model: CausalLM) -> dict[str, TPShard]:
        """Keep this rank's pipeline stage of `model` and shard it over tp, in place."""
        split_into_stage(model, self.grid)
        return apply_tensor_parallel(model, self.grid, self.parallel.sequence_parallel)

    def _optimizer_options(self) -> dict:
        # fused on GPU (one kernel for all tensors); per-tensor on CPU, exactly LocalEngine's arithmetic
        return {"fused": True} if self.device.type == "cuda" else {"foreach": False}

    # ------------------------------------------------------------------ one step
    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce = vocab_parallel_cross_entropy(logits, targets, self.vocab_start,
                                          self.model_config.vocab_size, self.grid.tp_group)
        return ce.sum() / self._num_tokens

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return stage_forward(self.model, x, self._seq_len, self.parallel.activation_checkpointing)

    def forward_backward(self, micro_batches: MicroBatches) -> float:
        """Gradients of the global-batch mean loss, fully reduced (dp, tied copies, tp-partial);
        returns that loss (the same value on every rank)."""
        return float(self._forward_backward(micro_batches))

    def _forward_backward(self, micro_batches: MicroBatches) -> torch.Tensor:
        """`forward_backward` with the loss left on the device (no host synchronisation)."""
        g = self.grid
        mb, seq = micro_batches[0][0].shape
        self._seq_len = seq
        self._num_tokens = sum(t.numel() for _, t in micro_batches) * g.dp
        local_seq = seq // g.tp if self.parallel.sequence_parallel else seq
        schedule = self.pipeline_schedule(g, self.parallel.schedule, self._forward, self._loss,
                                          (2, mb, local_seq, self.model_config.hidden_size),
                                          self.params[0].dtype, self.device)
        self.reducer.zero_grad()
        loss = self._run_micro_batches(schedule, micro_batches)
        self.reducer.finish()
        if self.tied_copy:  # the embedding (first stage) and LM head (last stage) are one matrix
            name = "model.embed_tokens.weight" if g.is_first_stage else "lm_head.weight"
            dist.all_reduce(self.params[self.names.index(name)].grad, group=g.embedding_group)
        partial = [p.grad for n, p in zip(self.names, self.params) if self.shards[n].partial_grad]
        if partial:
            flat = torch.cat([t.reshape(-1) for t in partial])
            dist.all_reduce(flat, group=g.tp_group)
            for t, f in zip(partial, flat.split([t.numel() for t in partial])):
                t.copy_(f.view_as(t))
        # the loss lives on the last stage; tp ranks hold copies, dp ranks hold parts
        holds_loss = g.is_last_stage and g.tp_rank == 0
        loss = loss.float() if holds_loss else torch.zeros((), device=self.device)
        dist.all_reduce(loss)
        return loss

    def _run_micro_batches(self, schedule: PipelineSchedule,
                           micro_batches: MicroBatches) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches in the pipeline schedule's order, the dp
        reduction armed before the last backward pass; the summed loss (on the last stage)."""
        return schedule.run(micro_batches, before_last_backward=self.reducer.arm)

    def _grad_norm(self) -> torch.Tensor:
        """Global L2 norm, counting every parameter of the full model once: sharded ones on every tp
        rank, replicated ones on tp rank 0 only, the tied LM-head copy not at all; then summed over tp
        and pp (dp replicas are identical after the reduction)."""
        g = self.grid
        counted = [m.grad for n, m in zip(self.names, self.master)
                   if m.grad is not None and not (self.tied_copy and n == "lm_head.weight")
                   and (self.shards[n].dim is not None or g.tp_rank == 0)]
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        if self.device.type == "cuda" and counted:
            # one multi-tensor launch instead of ~4 per parameter (~1000 launches per step on the 1B shape)
            total += torch.stack(torch._foreach_norm(counted)).double().pow(2).sum()
        else:
            # fp32 reductions over 1e5+ elements on CPU drift by ~1e-5 relative, so a sharded sum would
            # not match an unsharded one: accumulate in fp64 there (CUDA's tree reductions are exact enough)
            for t in counted:
                total += torch.linalg.vector_norm(t, dtype=torch.float64).pow(2)
        if g.tp > 1:
            dist.all_reduce(total, group=g.tp_group)
        if g.pp > 1:
            dist.all_reduce(total, group=g.pp_group)
        return total.sqrt()

    def train_step(self, micro_batches: MicroBatches, lr: float) -> StepResult:
        loss, norm = self._step(micro_batches, lr)
        return StepResult(loss=float(loss), grad_norm=float(norm))

    def _step(self, micro_batches: MicroBatches, lr: float | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step — elementwise AdamW, so sharded AdamW equals unsharded AdamW — on the fp32
        master weights; returns (loss, grad norm) as device tensors. `lr=None`: AdamW keeps its own
        (device) learning rate and clipping never consults the host (MixedPrecisionAdamW.step)."""
        loss = self._forward_backward(micro_batches)
        self.opt.master_grads()
        norm = self._grad_norm()
        self.opt.step(norm, self.cfg.grad_clip, lr)
        return loss, norm

    # ------------------------------------------------------------------ weights in and out
    def _owner_stage(self, name: str) -> int:
        if name.startswith("model.embed_tokens."):
            return 0
        if name.startswith("model.layers."):
            per = self.model_config.num_hidden_layers // self.grid.pp
            return int(name.split(".")[2]) // per
        return self.grid.pp - 1  # final norm, LM head

    def _full_tensor(self, local: torch.Tensor, shard: TPShard) -> torch.Tensor:
        """All-gather a tp-sharded tensor over this rank's tp group and drop the vocabulary padding."""
        if shard.dim is None or self.grid.tp == 1:
            return local.detach()
        front = local.detach().movedim(shard.dim, 0).contiguous()
        out = front.new_empty((front.shape[0] * self.grid.tp, *front.shape[1:]))
        all_gather_single(out, front, group=self.grid.tp_group)
        return out[:shard.full_size].movedim(0, shard.dim)

    def _gather(self, local_of: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Full HF-named tensors on global rank 0: tp all-gather inside each stage (dp replica 0), then
        the stage leader sends each tensor to rank 0 in the full model's parameter order."""
        g = self.grid
        with torch.device("meta"):
            full_model = CausalLM(self.model_config)
        out: dict[str, torch.Tensor] = {}
        for name, meta in full_model.named_parameters():
            owner = self._owner_stage(name)
            if g.pp_rank == owner and g.dp_rank == 0:
                t = self._full_tensor(local_of[name], self.shards[name]).contiguous()
                if g.rank == 0:
                    out[name] = t.float().cpu().clone()
                elif g.tp_rank == 0:
                    dist.send(t.float(), dst=0)
            elif g.rank == 0:
                buf = torch.empty(meta.shape, dtype=torch.float32, device=self.device)
                dist.recv(buf, src=g.stage_leader(owner))
                out[name] = buf.cpu()
        if g.rank != 0:
            return None
        if self.model_config.tie_word_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named fp32 weights (the master weights under bf16) on global rank 0, None elsewhere."""
        return self._gather(dict(zip(self.names, self.master)))

    def consolidated_grads(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named gradients on rank 0 after `forward_backward` (for tests)."""
        return self._gather({n: p.grad for n, p in zip(self.names, self.params)})

    def _resume_file(self, directory: Path) -> Path:
        return Path(directory) / f"megatron-pp{self.grid.pp_rank:03d}-tp{self.grid.tp_rank:03d}.pt"

    def save_resume_state(self, directory: Path) -> None:
        """dp replica 0 writes one file per (pp, tp) shard: master weights and AdamW state. dp replicas
        are identical, so a run may resume with another dp (same tp and pp)."""
        if self.grid.dp_rank != 0:
            return
        torch.save({"grid": {"tp": self.grid.tp, "pp": self.grid.pp},
                    "master": {n: m.detach().cpu() for n, m in zip(self.names, self.master)},
                    "optimizer": self.optimizer.state_dict()}, self._resume_file(directory))

    def load_resume_state(self, directory: Path) -> None:
        path = self._resume_file(directory)
        if not path.is_file():
            raise FileNotFoundError(f"no resume shard {str(path)!r}: was the run saved with "
                                    f"tp={self.grid.tp}, pp={self.grid.pp}? (resharding a resume "
                                    "checkpoint is not supported)")
        keys = ("grid", "master", "optimizer")
        state = load_resume_file(path, keys, "nano_megatron resume shard", self.device)
        saved = state["grid"]
        if (saved["tp"], saved["pp"]) != (self.grid.tp, self.grid.pp):
            raise ValueError(f"resume state was saved with tp={saved['tp']}, pp={saved['pp']}, "
                             f"this run has tp={self.grid.tp}, pp={self.grid.pp}")
        self.opt.load([state["master"][n] for n in self.names], state["optimizer"])

    def close(self) -> None:
        """Free the grid's process groups (the default group stays)."""
        self.grid.destroy()
