"""The collectives ZeRO moves model states with (Rajbhandari et al. 2019, arXiv 1910.02054 §7): all-gather
of parameter shards, reduce-scatter of gradients, all-reduce (stage 0), over one process group of flat
buffers. Without a process group (or with one rank) they are local copies, so one process runs the same
code. Plain on purpose: `nano_zero.ledger.count_communication` wraps them from outside to count the
elements each one moves, the way §7 counts them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shared.dist import all_gather_single, reduce_scatter_single


class Collectives:
    """The collectives of ZeroDataParallel over `group` (None: the world, or no process group at all)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """Every rank's `shard`, in rank order, into `out`; a c10d Work when `async_op`, else None."""
        if self.distributed and out.numel():  # a unit without parameters has nothing to move
            return all_gather_single(out, shard, group=self.group, async_op=async_op)
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return None

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """This rank's shard of the sum of every rank's `full` into `out` (which may be a slice of it)."""
        if self.distributed and full.numel():
            return reduce_scatter_single(out, full, group=self.group, async_op=async_op)
        if out.data_ptr() != full.data_ptr():
            out.copy_(full)
        return None

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place."""
        if self.distributed and t.numel():
            dist.all_reduce(t, group=self.group)

    def all_reduce_scalar(self, t: torch.Tensor) -> torch.Tensor:
        """SUM of a few numbers (loss, squared gradient norm): not model state, never counted."""
        if self.distributed:
            dist.all_reduce(t, group=self.group)
        return t
