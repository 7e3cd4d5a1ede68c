"""Performance layer: each block's backward tensor-parallel collective overlapped with its weight-gradient
GEMMs (`parallel.tp_comm_overlap`; the paper path runs f and g of 1909.08053 Figure 3 as written).

Megatron-LM's asynchronous tensor-parallel all-reduce (Narayanan et al. 2021, arXiv 2104.04473; with
sequence parallelism Korthikanti et al. 2022, §4.2.2): in the backward pass of a block's column-parallel
GEMMs, dL/dX must be all-reduced (reduce-scattered under SP) over tp, but dL/dW = dYᵀ·X does not need that
result. Launch the collective first and run the weight-gradient GEMMs while it is in flight. Here the
column-parallel layers of a block (q/k/v, gate/up) compute only dX in their own backward and leave (dY, X)
in a stash; the block's entry node (f, or the sequence all-gather) gets their weights as extra inputs, so
its backward — which autograd runs after all of theirs — starts the collective on dX, computes every
stashed dW, waits, and returns dW as those weights' gradients (so data-parallel gradient hooks still fire).

On by default where it applies and was measured: tensor parallelism (tp > 1) on GPUs. 2× H200, the 1.1B
shape of configs/model/1b.yaml, micro-batch 8, 2026-11-30: 4% for TP = 2, 2% with SP (BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nano_megatron.build import REGISTRY
from nano_megatron.engine import MegatronEngine, ParallelConfig
from nano_megatron.grid import ParallelGrid
from nano_megatron.sequence_parallel import all_gather_seq
from nano_megatron.tensor_parallel import ColumnParallelLinear, TPShard
from shared.config import ModelConfig
from shared.dist import reduce_scatter_single
from shared.model import CausalLM
from shared.train import TrainConfig


def start_reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup
                             ) -> tuple[torch.Tensor, dist.Work | None]:
    """`sequence_parallel.reduce_scatter_seq`, launched asynchronously: returns the output and the
    collective's work (None when tp = 1), to wait on before reading it."""
    world = dist.get_world_size(group)
    if world == 1:
        return x, None
    b, s, h = x.shape
    out = x.new_empty((b * s // world, h))
    work = reduce_scatter_single(out, x.contiguous().view(b * s, h), group=group, async_op=True)
    return out.view(b, s // world, h), work


class _LinearDeferredWgrad(torch.autograd.Function):
    """Y = X·Wᵀ + b whose backward returns dX (and db) and stashes (dY, X) for the block entry's dW."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stash: dict):
        ctx.save_for_backward(x, weight)
        # keyed by the parameter seen now: under activation checkpointing the saved weight comes back from
        # recomputation as another tensor object
        ctx.stash, ctx.key, ctx.has_bias = stash, id(weight), bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        ctx.stash[ctx.key] = (grad, x)
        db = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad.matmul(weight), None, db, None


class _BlockEntry(torch.autograd.Function):
    """f (identity forward, all-reduce backward) or, under sequence parallelism, the all-gather along the
    sequence (reduce-scatter backward), whose backward overlaps that collective with the deferred dW GEMMs
    of the `weights` (the block's column-parallel layers)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, sequence_parallel: bool, stash: dict,
                *weights: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.sequence_parallel, ctx.stash = group, sequence_parallel, stash
        ctx.weight_ids = [id(w) for w in weights]
        return all_gather_seq(x, group) if sequence_parallel else x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.sequence_parallel:
            dx, work = start_reduce_scatter_seq(grad, ctx.group)
        else:
            dx = grad.contiguous()
            work = dist.all_reduce(dx, group=ctx.group, async_op=True)
        dws = []
        for wid in ctx.weight_ids:  # while the collective runs
            pending = ctx.stash.pop(wid, None)
            if pending is None:  # that layer's output did not reach the loss
                dws.append(None)
                continue
            dy, x = pending
            dws.append(dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])))
        if work is not None:
            work.wait()
        return (dx, None, None, None, *dws)


def block_entry(x: torch.Tensor, group: dist.ProcessGroup, sequence_parallel: bool,
                weights: list[torch.Tensor]) -> torch.Tensor:
    """A block's input after f (or the SP all-gather), tagged so that the block's column-parallel layers
    defer their dW to this node's backward (see the module docstring)."""
    stash: dict = {}
    out = _BlockEntry.apply(x, group, sequence_parallel, stash, *weights)
    out._tp_wgrad_stash = stash
    return out


class DeferredWgradColumnParallelLinear(ColumnParallelLinear):
    """A ColumnParallelLinear whose backward leaves dW to the block entry when its input carries a stash."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stash = getattr(x, "_tp_wgrad_stash", None)
        if stash is None:
            return super().forward(x)
        return _LinearDeferredWgrad.apply(x, self.weight, self.bias, stash)


def apply_tp_comm_overlap(model: CausalLM, grid: ParallelGrid, sequence_parallel: bool) -> None:
    """On a model `apply_tensor_parallel` has sharded: replace each block's entry hook (f, or the SP
    all-gather) by `block_entry` over the block's column-parallel weights, and make those layers defer
    their dW. The layers change class in place, as torch's `fully_shard` does, so parameters, names and
    checkpoints stay the same."""
    if grid.tp == 1:
        return
    for layer in model.model.layers.values():
        blocks = ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj")))
        for block, names in blocks:
            columns = [getattr(block, n) for n in names]
            for m in columns:
                m.__class__ = DeferredWgradColumnParallelLinear

            def hook(mod: nn.Module, args: tuple, columns: list[nn.Module] = columns) -> tuple:
                if torch.is_grad_enabled():
                    weights = [m.weight for m in columns]
                    x = block_entry(args[0], grid.tp_group, sequence_parallel, weights)
                else:  # no backward: f is the identity, the SP all-gather its forward
                    x = all_gather_seq(args[0], grid.tp_group) if sequence_parallel else args[0]
                return (x, *args[1:])

            block.tp_input_hook.remove()
            block.tp_input_hook = block.register_forward_pre_hook(hook)


class TPCommOverlapEngine(MegatronEngine):
    """MegatronEngine with `apply_tp_comm_overlap` on its blocks (`parallel.tp_comm_overlap`)."""

    switch = "tp_comm_overlap"

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig, cfg: TrainConfig,
                 device: torch.device | str | None = None, model: CausalLM | None = None) -> None:
        if parallel.tp == 1:  # raised on every rank, before the grid's collectives
            raise ValueError("parallel.tp_comm_overlap=true needs tp > 1: with one tensor-parallel rank "
                             "there is no collective to overlap")
        super().__init__(model_config, parallel, cfg, device=device, model=model)

    def _parallelize(self, model: CausalLM) -> dict[str, TPShard]:
        shards = super()._parallelize(model)
        apply_tp_comm_overlap(model, self.grid, self.parallel.sequence_parallel)
        return shards


def measured_to_help(parallel: ParallelConfig, cfg: TrainConfig, device: torch.device) -> bool:
    """On by default: tensor parallelism on GPUs, where it was measured (module docstring)."""
    return device.type == "cuda" and parallel.tp > 1


REGISTRY.register("engine_class", TPCommOverlapEngine, applies=measured_to_help)
