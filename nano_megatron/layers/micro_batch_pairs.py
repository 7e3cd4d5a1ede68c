"""Performance layer: micro-batches in pairs, each on its own CUDA stream, issued half-layer by half-layer
so one's tensor-parallel collectives overlap the other's GEMMs (`parallel.overlap_micro_batches`).

Domino (Wang et al. 2024, arXiv 2409.15241 §4): two independent batch slices hide each other's
communication. Forward and backward alike: autograd runs each backward op on its forward op's stream.
Keeps two micro-batches' activations alive instead of one; pp = 1 (the pipeline schedules order
micro-batches themselves) and an even number of micro-batches per rank.

Runs when asked for (`parallel.overlap_micro_batches=true`), not by default: it trades memory for speed.
One H200, the 1.1B shape of configs/model/1b.yaml, micro-batch 8, 2026-12-01: +2.1% over the eager step
(two streams fill the gaps between kernels) for +23 GiB of activations (BENCHMARKS.md) — a run that fits
without it may not fit with it, and the default must never turn a run that fits into one that does not.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from nano_megatron.build import REGISTRY
from nano_megatron.engine import MegatronEngine, ParallelConfig
from nano_megatron.pipeline_parallel import PipelineSchedule
from shared.config import ModelConfig
from shared.model import CausalLM
from shared.train import TrainConfig


def on_stream(stream: torch.cuda.Stream | None):
    """`torch.cuda.stream(stream)`, or nothing for None (CPU, or the current stream)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def stage_forward_interleaved(model: CausalLM, inputs: list[torch.Tensor], seq_len: int,
                              streams: list[torch.cuda.Stream | None], activation_checkpointing: bool = False
                              ) -> list[torch.Tensor]:
    """`pipeline_parallel.stage_forward` of several micro-batches at once, micro-batch i's kernels on
    `streams[i]` (None: the current stream), issued layer by layer in turn. The caller makes the streams
    wait for the current one first and the current one wait for them afterwards."""
    inner = model.model
    states = []
    for x, stream in zip(inputs, streams):
        with on_stream(stream):
            if inner.embed_tokens is not None:
                h, residual = inner.embed_tokens(x), None
            else:
                h, residual = x.unbind(0)
            batch = h.shape[0]
            positions = torch.arange(seq_len, device=h.device).expand(batch, seq_len)
            states.append([h, residual, *inner.rope_cos_sin(positions)])
    for layer in inner.layers.values():
        if activation_checkpointing or len(states) == 1:  # whole layers (checkpointing recomputes whole ones)
            for state, stream in zip(states, streams):
                with on_stream(stream):
                    if activation_checkpointing:
                        state[:2] = checkpoint(layer, *state, None, use_reentrant=False)
                    else:
                        state[:2] = layer(*state, None)
            continue
        # half layers in turn: micro-batch 0's attention, 1's attention, 0's MLP, ... so the collectives
        # (one per half, issued in this order on one NCCL stream) alternate between the micro-batches
        for state, stream in zip(states, streams):
            with on_stream(stream):
                state[:2] = layer.attention_half(*state, None)
        for state, stream in zip(states, streams):
            with on_stream(stream):
                state[:2] = layer.mlp_half(*state[:2])
    outs = []
    for (h, residual, _, _), stream in zip(states, streams):
        with on_stream(stream):
            if model.lm_head is None:
                outs.append(torch.stack([h, residual]))
            else:
                h, _ = inner.norm(h, residual)
                outs.append(model.lm_head(h))
    return outs


class PairedMicroBatchesEngine(MegatronEngine):
    """MegatronEngine that runs its micro-batches two at a time (`stage_forward_interleaved`), then one
    backward pass over both losses."""

    switch = "overlap_micro_batches"

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig, cfg: TrainConfig,
                 device: torch.device | str | None = None, model: CausalLM | None = None) -> None:
        # raised on every rank, before the grid's collectives
        if parallel.pp > 1:
            raise ValueError(f"parallel.overlap_micro_batches needs pp=1 (the pipeline schedules order "
                             f"micro-batches themselves), got pp={parallel.pp}")
        per_rank = cfg.global_batch_size // (cfg.micro_batch_size * parallel.dp)
        if per_rank % 2:
            raise ValueError(f"parallel.overlap_micro_batches runs micro-batches in pairs: global_batch_size "
                             f"({cfg.global_batch_size}) / (micro_batch_size ({cfg.micro_batch_size}) x dp "
                             f"({parallel.dp})) = {per_rank} must be even")
        super().__init__(model_config, parallel, cfg, device=device, model=model)
        self._streams: list[torch.cuda.Stream | None] = [None, None]  # None: CPU, one stream
        if self.device.type == "cuda":
            self._streams = [torch.cuda.Stream(self.device) for _ in range(2)]
            # a weight's gradient from the second stream meets its AccumulateGrad (created on the first) by
            # design; autograd synchronises the streams and warns about it every step unless told not to
            quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
            if quiet is not None:
                quiet(False)

    def _run_micro_batches(self, schedule: PipelineSchedule,
                           micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward two micro-batches at once (one stream each), then one backward pass over both losses;
        returns the summed loss (pp = 1: the schedule has nothing to order)."""
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


def on_by_default(parallel: ParallelConfig, cfg: TrainConfig, device: torch.device) -> bool:
    """Never on by default: two micro-batches' activations at once may not fit (module docstring)."""
    return False


REGISTRY.register("engine_class", PairedMicroBatchesEngine, applies=on_by_default)
