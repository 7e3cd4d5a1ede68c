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

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nano_megatron.data_parallel import BucketedGradReducer
from nano_megatron.grid import GridShape, ParallelGrid
from nano_megatron.pipeline_parallel import (
    PipelineSchedule,
    on_stream,
    split_into_stage,
    stage_forward,
    stage_forward_interleaved,
)
from nano_megatron.schedules import SCHEDULES
from nano_megatron.tensor_parallel import TPShard, apply_tensor_parallel, vocab_parallel_cross_entropy
from shared.config import ModelConfig
from shared.dist import DEFAULT_TIMEOUT_S, all_gather_single
from shared.model import CausalLM, build_model
from shared.train import (
    StepResult,
    TrainConfig,
    check_batch_sizes,
    clip_coefficient,
    clip_coefficient_on_device,
    decays,
)


@dataclass
class ParallelConfig:
    """Hydra's `parallel.*` group."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    tp_comm_overlap: bool = True  # overlap each block's backward tp collective with its dW GEMMs
    schedule: str = "1f1b"  # "gpipe" | "1f1b"
    activation_checkpointing: bool = False
    bucket_mb: float = 25.0  # data-parallel gradient bucket size
    # capture the whole training step (forward, backward, collectives, clipping, AdamW) in one CUDA graph
    # and replay it (Megatron-Core's full-iteration CUDA graph): no host launch costs or host jitter
    # between kernels. CUDA only; pp = dp = 1; one batch shape per engine.
    cuda_graph: bool = False
    # pp = 1: run the micro-batches two at a time, each on its own CUDA stream and interleaved layer by layer,
    # so one's tensor-parallel collectives overlap the other's GEMMs (Domino, arXiv 2409.15241); forward and
    # backward alike. Keeps two micro-batches' activations alive instead of one.
    overlap_micro_batches: bool = False


def validate(model_config: ModelConfig, parallel: ParallelConfig, cfg: TrainConfig, world_size: int) -> None:
    """Every configuration error, raised as ValueError identically on every rank before any collective."""
    shape = GridShape(parallel.tp, parallel.pp, parallel.dp)
    shape.check_world_size(world_size)
    tp, pp = parallel.tp, parallel.pp
    mc = model_config
    if mc.num_attention_heads % tp:
        raise ValueError(f"num_attention_heads ({mc.num_attention_heads}) is not divisible by tp={tp}: "
                         "tensor parallelism gives every rank whole attention heads")
    if mc.num_key_value_heads % tp:
        raise ValueError(f"num_key_value_heads ({mc.num_key_value_heads}) is not divisible by tp={tp}: "
                         "every rank needs whole kv heads (replicating kv heads when tp exceeds them "
                         "is not implemented)")
    if mc.intermediate_size % tp:
        raise ValueError(f"intermediate_size ({mc.intermediate_size}) is not divisible by tp={tp}")
    if mc.num_hidden_layers % pp:
        raise ValueError(f"num_hidden_layers ({mc.num_hidden_layers}) is not divisible by pp={pp}: "
                         "every pipeline stage gets the same number of layers")
    check_batch_sizes(cfg, parallel.dp)
    if parallel.sequence_parallel and cfg.seq_len % tp:
        raise ValueError(f"sequence parallelism needs seq_len ({cfg.seq_len}) divisible by tp={tp}")
    if parallel.schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {parallel.schedule!r}; choose from {SCHEDULES}")
    if parallel.bucket_mb <= 0:
        raise ValueError(f"parallel.bucket_mb must be > 0, got {parallel.bucket_mb}")
    if parallel.overlap_micro_batches:
        if pp > 1:
            raise ValueError(f"parallel.overlap_micro_batches needs pp=1 (the pipeline schedules order micro-batches "
                             f"themselves), got pp={pp}")
        per_rank = cfg.global_batch_size // (cfg.micro_batch_size * parallel.dp)
        if per_rank % 2:
            raise ValueError(f"parallel.overlap_micro_batches runs micro-batches in pairs: global_batch_size "
                             f"({cfg.global_batch_size}) / (micro_batch_size ({cfg.micro_batch_size}) x dp "
                             f"({parallel.dp})) = {per_rank} must be even")
    if parallel.cuda_graph and (pp > 1 or parallel.dp > 1):
        raise ValueError(f"parallel.cuda_graph supports tensor (and sequence) parallelism only: pp and dp must "
                         f"be 1, got pp={pp}, dp={parallel.dp}")


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MegatronEngine:
    """The TrainEngine of nano_megatron. Collective to construct (it builds the process grid).

    model: optionally the initial full model (consumed: it is split and sharded in place); default
    `build_model(model_config, seed=cfg.seed)`, the same weights on every rank (and as LocalEngine).
    """

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig, cfg: TrainConfig,
                 device: torch.device | str | None = None, model: CausalLM | None = None) -> None:
        validate(model_config, parallel, cfg, dist.get_world_size())
        self.model_config, self.parallel, self.cfg = model_config, parallel, cfg
        self.device = torch.device(device) if device is not None else _default_device()
        if parallel.cuda_graph and self.device.type != "cuda":  # raised on every rank, before any collective
            raise ValueError(f"parallel.cuda_graph needs a CUDA device (the NCCL backend), got {self.device}")
        self.grid = grid = ParallelGrid(GridShape(parallel.tp, parallel.pp, parallel.dp))
        self.dp_rank, self.dp_world_size = grid.dp_rank, grid.dp
        model = model if model is not None else build_model(model_config, self.device, seed=cfg.seed)
        model = model.to(self.device)
        split_into_stage(model, grid)
        self.shards: dict[str, TPShard] = apply_tensor_parallel(model, grid, parallel.sequence_parallel,
                                                                   parallel.tp_comm_overlap)
        self.model = model
        # names/params of this rank (named_parameters drops the second name of a tied matrix)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = self.master = [p for _, p in named]  # master: what AdamW updates
        if cfg.dtype == "bf16":  # LocalEngine's mixed precision: bf16 model, fp32 master weights
            self.master = [p.detach().float().clone() for p in self.params]
            model.to(torch.bfloat16)
            self.params = [p for n, p in model.named_parameters() if p.requires_grad]
        self.tied_copy = (model_config.tie_word_embeddings and grid.pp > 1
                          and (grid.is_first_stage or grid.is_last_stage))
        self.reducer = BucketedGradReducer(self.params, grid.dp_group, parallel.bucket_mb)
        groups = [{"params": [m for m in self.master if decays(m)], "weight_decay": cfg.weight_decay},
                  {"params": [m for m in self.master if not decays(m)], "weight_decay": 0.0}]
        # fused on GPU (one kernel for all tensors); per-tensor on CPU, exactly LocalEngine's arithmetic
        impl = {"fused": True} if self.device.type == "cuda" else {"foreach": False}
        lr: float | torch.Tensor = cfg.lr
        if parallel.cuda_graph:  # a replayed graph reads the learning rate from device memory
            lr = self._lr = torch.tensor(cfg.lr, dtype=torch.float32, device=self.device)
            impl["capturable"] = True
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)
        self.vocab_start = 0
        if model.lm_head is not None:
            self.vocab_start = grid.tp_rank * model.lm_head.weight.shape[0] if grid.tp > 1 else 0
        self._num_tokens = 1
        self._seq_len = cfg.seq_len
        self.pipeline_timeline: list | None = None  # set to [] to record the next step's actions
        # parallel.cuda_graph: the captured step, how many steps it has been asked for, and (set on the first
        # call) its static inputs, their shapes, its stream and its (loss, grad norm) outputs
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_calls = 0
        self.graph_timeout_s = DEFAULT_TIMEOUT_S  # a replay that takes longer raises (see _wait_for_replay)
        self._streams: list[torch.cuda.Stream | None] = [None, None]  # overlap_micro_batches (None: CPU)
        if parallel.overlap_micro_batches and self.device.type == "cuda":
            self._streams = [torch.cuda.Stream(self.device) for _ in range(2)]
            # a weight's gradient from the second stream meets its AccumulateGrad (created on the first) by
            # design; autograd synchronises the streams and warns about it every step unless told not to
            quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
            if quiet is not None:
                quiet(False)

    # ------------------------------------------------------------------ one step
    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce = vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.model_config.vocab_size,
                                          self.grid.tp_group)
        return ce.sum() / self._num_tokens

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return stage_forward(self.model, x, self._seq_len, self.parallel.activation_checkpointing)

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Gradients of the global-batch mean loss, fully reduced (dp, tied copies, tp-partial);
        returns that loss (the same value on every rank)."""
        return float(self._forward_backward(micro_batches))

    def _forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """`forward_backward` with the loss left on the device (no host synchronisation)."""
        g = self.grid
        mb, seq = micro_batches[0][0].shape
        self._seq_len = seq
        self._num_tokens = sum(t.numel() for _, t in micro_batches) * g.dp
        local_seq = seq // g.tp if self.parallel.sequence_parallel else seq
        dtype = self.params[0].dtype
        schedule = PipelineSchedule(g, self.parallel.schedule, self._forward, self._loss,
                                    (2, mb, local_seq, self.model_config.hidden_size), dtype, self.device)
        self.reducer.zero_grad()
        if self.parallel.overlap_micro_batches:
            loss = self._run_in_pairs(micro_batches)
        else:
            loss = schedule.run(micro_batches, before_last_backward=self.reducer.arm,
                                timeline=self.pipeline_timeline)
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
        loss = loss.float() if (g.is_last_stage and g.tp_rank == 0) else torch.zeros((), device=self.device)
        dist.all_reduce(loss)
        return loss

    def _run_in_pairs(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """parallel.overlap_micro_batches: forward two micro-batches at once (`stage_forward_interleaved`, one
        stream each), then one backward pass over both losses; returns the summed loss (pp = 1)."""
        streams = self._streams
        current = torch.cuda.current_stream(self.device) if streams[0] is not None else None
        loss_sum = torch.zeros((), device=self.device)
        for k in range(0, len(micro_batches), 2):
            pair = micro_batches[k:k + 2]
            for stream in streams:  # inputs, zeroed gradients and the previous pair's work come first
                if stream is not None:
                    stream.wait_stream(current)
            outs = stage_forward_interleaved(self.model, [x.to(self.device) for x, _ in pair], self._seq_len,
                                             streams, self.parallel.activation_checkpointing)
            losses = []
            for out, (_, y), stream in zip(outs, pair, streams):
                with on_stream(stream):
                    losses.append(self._loss(out, y.to(self.device)))
            if k + 2 == len(micro_batches):
                self.reducer.arm()
            # each backward op runs on its forward op's stream; a weight's two gradients meet in autograd's
            # input buffer (stream-synchronised) and are accumulated once
            torch.autograd.backward(losses)
            for stream in streams:
                if stream is not None:
                    current.wait_stream(stream)
            loss_sum += losses[0].detach() + losses[1].detach()
        return loss_sum

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

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        if self.parallel.cuda_graph:
            return self._graphed_step(micro_batches, lr)
        loss, norm = self._step(micro_batches, lr)
        return StepResult(loss=float(loss), grad_norm=float(norm))

    def _step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (loss, grad norm) as device tensors. `lr=None` (the CUDA-graph
        path): the learning rate is read from `self._lr` and clipping never consults the host, so the
        whole step can be captured."""
        loss = self._forward_backward(micro_batches)
        if self.master is not self.params:
            for m, p in zip(self.master, self.params):
                m.grad = p.grad.float()
        norm = self._grad_norm()
        grads = [m.grad for m in self.master]
        if lr is None:
            coef = clip_coefficient_on_device(norm, self.cfg.grad_clip)
            if coef is not None:
                torch._foreach_mul_(grads, coef)
        else:
            coef = clip_coefficient(norm, self.cfg.grad_clip)
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        if self.master is not self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)
            for m in self.master:
                m.grad = None
        return loss, norm

    # Eager steps before the capture: AdamW's state, Triton's autotuned kernels, cuBLAS workspaces and NCCL
    # communicators must all exist before a graph records addresses (torch.cuda.graph's documented recipe).
    GRAPH_WARMUP_STEPS = 2

    def _graphed_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        """parallel.cuda_graph: the first `GRAPH_WARMUP_STEPS` steps run eagerly on a side stream, the next
        is captured into one CUDA graph (every kernel and NCCL collective of the step, with their
        cross-stream dependencies), and every step from then on copies its batch into the graph's static
        input buffers, writes the learning rate, and replays it: one host call per step."""
        shapes = [(tuple(x.shape), tuple(y.shape)) for x, y in micro_batches]
        if self._graph_calls == 0:
            self._graph_shapes = shapes
            self._static = [(x.to(self.device, copy=True), y.to(self.device, copy=True)) for x, y in micro_batches]
            self._graph_stream = torch.cuda.Stream(self.device)
        elif shapes != self._graph_shapes:
            raise ValueError(f"parallel.cuda_graph replays one batch shape: captured {self._graph_shapes}, "
                             f"got {shapes}")
        for (sx, sy), (x, y) in zip(self._static, micro_batches):
            sx.copy_(x)
            sy.copy_(y)
        self._lr.fill_(lr)
        self._graph_calls += 1
        stream = self._graph_stream
        if self._graph is None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            if self._graph_calls <= self.GRAPH_WARMUP_STEPS:
                with torch.cuda.stream(stream), warnings.catch_warnings():
                    # AdamW(capturable=True) warns when it runs outside a graph: here it is meant to
                    warnings.filterwarnings("ignore", message=".*capturable=True.*")
                    self._out = self._step(self._static, None)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                return StepResult(loss=float(self._out[0]), grad_norm=float(self._out[1]))
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: NCCL's watchdog thread may query events while this thread captures
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self._out = self._step(self._static, None)
            self._graph = graph
        self._graph.replay()
        self._wait_for_replay()
        return StepResult(loss=float(self._out[0]), grad_norm=float(self._out[1]))

    def _wait_for_replay(self) -> None:
        """Wait for the replayed step, at most the process group's timeout. NCCL's watchdog does not watch
        collectives inside a CUDA graph, so a dead peer would leave this rank spinning in a replayed
        all-reduce forever (torchrun kills the job when a worker exits, a bare launch would not): poll an event
        and raise instead."""
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + self.graph_timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replayed CUDA-graph step did not finish within {self.graph_timeout_s:.0f} s "
                                   "(parallel.cuda_graph): a peer rank has probably died or hung")
            time.sleep(2e-4)

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
            raise FileNotFoundError(f"no resume shard {str(path)!r}: was the run saved with tp={self.grid.tp}, "
                                    f"pp={self.grid.pp}? (resharding a resume checkpoint is not supported)")
        state = torch.load(path, map_location=self.device, weights_only=True)
        saved = state["grid"]
        if (saved["tp"], saved["pp"]) != (self.grid.tp, self.grid.pp):
            raise ValueError(f"resume state was saved with tp={saved['tp']}, pp={saved['pp']}, "
                             f"this run has tp={self.grid.tp}, pp={self.grid.pp}")
        with torch.no_grad():
            for n, m in zip(self.names, self.master):
                m.copy_(state["master"][n])
            if self.master is not self.params:
                torch._foreach_copy_(self.params, self.master)
        self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Free the grid's process groups (the default group stays)."""
        self.grid.destroy()
