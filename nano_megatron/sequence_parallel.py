"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", arXiv 2205.05198, §4.2.2 and Figure 5).

Tensor parallelism leaves the norms (and dropout) replicated: every tp rank stores the same b·s·h
activations for them. Sequence parallelism splits those regions along the sequence instead, and
replaces Megatron's f / g pair around each block by

    g  (block entry):  all-gather along the sequence forward,  reduce-scatter backward
    ḡ  (block exit):   reduce-scatter along the sequence forward,  all-gather backward

An all-reduce *is* a reduce-scatter followed by an all-gather, so the communication volume is the same
as plain tensor parallelism while the norm activations shrink by tp. The norm weights then see only
s/tp tokens per rank, so their gradients are partial: the trainer all-reduces them over tp after the
backward pass (`TPShard.partial_grad`, summed in `engine.MegatronEngine`).

Activations are (batch, seq, hidden) here (shared.model's layout). Megatron keeps (seq, batch, hidden) so
that a sequence shard is a contiguous dim-0 slice; here a rank's shard is a contiguous 1/tp of the
flattened batch·seq tokens instead, viewed as (batch, seq/tp, hidden). The regions sequence parallelism
covers (norms, residual adds) work token by token, so which tokens a rank holds does not matter, and the
collectives then read and write contiguous memory: no transposes or copies around them (moving the
sequence to the front cost ~15 activation-sized copies per layer and micro-batch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shared.dist import all_gather_single, reduce_scatter_single


def all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, s/tp, h) shards → (b, s, h): the ranks' token blocks concatenated in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    b, s, h = x.shape
    out = x.new_empty((world * b * s, h))
    all_gather_single(out, x.contiguous().view(b * s, h), group=group)
    return out.view(b, s * world, h)


def reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, s, h) partial sums → this rank's (b, s/tp, h) block of summed tokens."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    b, s, h = x.shape
    if s % world:
        raise ValueError(f"sequence length {s} is not divisible by tp={world}")
    out = x.new_empty((b * s // world, h))
    reduce_scatter_single(out, x.contiguous().view(b * s, h), group=group)
    return out.view(b, s // world, h)


class _GatherFromSequenceParallel(torch.autograd.Function):
    """g of Figure 5: all-gather the sequence shards before the column-parallel GEMMs; the gradient
    arriving from them is a partial sum over tp ranks, hence reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """ḡ of Figure 5: sum the row-parallel partial outputs and keep this rank's sequence shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_seq(grad, ctx.group), None


def gather_from_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, s/tp, h) → (b, s, h): all-gather forward, reduce-scatter backward."""
    return _GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, s, h) partial sums → (b, s/tp, h) sums: reduce-scatter forward, all-gather backward."""
    return _ReduceScatterToSequenceParallel.apply(x, group)


def split_sequence(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's shard of a (b, s, h) tensor, as `reduce_scatter_to_sequence_parallel` keeps it: the
    rank-th contiguous 1/world of the flattened b·s tokens, viewed as (b, s/world, h)."""
    b, s, h = x.shape
    if s % world:
        raise ValueError(f"sequence length {s} is not divisible by tp={world}")
    return x.reshape(b * s, h).chunk(world)[rank].view(b, s // world, h)
