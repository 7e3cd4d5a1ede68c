"""The (dp, pp, tp) process grid: one object that owns every process group and coordinate of this rank.

Megatron-LM (Narayanan et al. 2021, arXiv 2104.04473, §3, Takeaway #1) orders the grid so that the
tensor-parallel ranks — which all-reduce activations in every layer — are adjacent global ranks, hence on
the same node (NVLink), pipeline neighbours next, and data-parallel replicas furthest apart (they talk
once per step). As picotron does, the grid is just `arange(world).view(dp, pp, tp)`: tp varies fastest,

    global_rank = (dp_rank * pp + pp_rank) * tp + tp_rank

and every group is a line through that 3-D array. There are no environment-variable globals: code that
needs a group or a rank takes the `ParallelGrid`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GridShape:
    """The three parallel degrees; `world_size` is their product."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def ranks(self) -> torch.Tensor:
        """Global ranks laid out as a (dp, pp, tp) array: tp fastest."""
        return torch.arange(self.world_size).view(self.dp, self.pp, self.tp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a grid of {self.world_size} ranks")
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def tp_groups(self) -> list[list[int]]:
        return self.ranks().reshape(-1, self.tp).tolist()

    def pp_groups(self) -> list[list[int]]:
        return self.ranks().permute(0, 2, 1).reshape(-1, self.pp).tolist()

    def dp_groups(self) -> list[list[int]]:
        return self.ranks().permute(1, 2, 0).reshape(-1, self.dp).tolist()

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each (dp, tp) line: they hold the two copies of a tied
        embedding / LM-head matrix and sum its gradient (Megatron's "embedding group")."""
        r = self.ranks()
        return torch.stack([r[:, 0, :], r[:, -1, :]], dim=-1).reshape(-1, 2).tolist()

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} != tp × pp × dp = {self.tp} × {self.pp} × {self.dp} = "
                f"{self.world_size}; launch {self.world_size} processes or change parallel.tp/pp/dp"
            )


class ParallelGrid:
    """This rank's place in the (dp, pp, tp) grid and the process groups along each axis.

    Creating it is a collective over the whole world (torch requires every rank to take part in
    every `new_group`), so all ranks must construct grids in the same order. `destroy()` frees the
    groups, so one process can build several grids one after the other (the tests do).
    """

    def __init__(self, shape: GridShape) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        shape.check_world_size(world)  # raises on every rank, before any collective
        self.shape = shape
        self.tp, self.pp, self.dp = shape.tp, shape.pp, shape.dp
        self.rank = rank
        self.dp_rank, self.pp_rank, self.tp_rank = shape.coords(rank)
        self._groups: list[dist.ProcessGroup] = []
        self.tp_group = self._new_groups(shape.tp_groups())
        self.pp_group = self._new_groups(shape.pp_groups())
        self.dp_group = self._new_groups(shape.dp_groups())
        self.embedding_group = self._new_groups(shape.embedding_groups()) if shape.pp > 1 else None
        self.tp_ranks = shape.tp_groups()[rank // shape.tp]
        # NCCL wants the first collective of a group to involve all its ranks before batched p2p
        # (dist.batch_isend_irecv's note); pipeline sends go through the default group.
        dist.barrier()

    def _new_groups(self, enumeration: list[list[int]]) -> dist.ProcessGroup:
        mine, _ = dist.new_subgroups_by_enumeration(enumeration)
        self._groups.append(mine)
        return mine

    # pipeline neighbours (global ranks, as dist.P2POp wants them)
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int | None:
        if self.is_first_stage:
            return None
        return self.shape.rank_of(self.dp_rank, self.pp_rank - 1, self.tp_rank)

    @property
    def next_rank(self) -> int | None:
        if self.is_last_stage:
            return None
        return self.shape.rank_of(self.dp_rank, self.pp_rank + 1, self.tp_rank)

    def stage_leader(self, pp_rank: int) -> int:
        """Global rank of (dp 0, pp_rank, tp 0): the rank that sends that stage's weights to rank 0."""
        return self.shape.rank_of(0, pp_rank, 0)

    def destroy(self) -> None:
        # new_subgroups_by_enumeration creates every group on every rank, but returns only ours;
        # the others are left to the default group's teardown.
        for group in self._groups:
            dist.destroy_process_group(group)
        self._groups.clear()

    def __repr__(self) -> str:
        return (f"ParallelGrid(rank={self.rank}, dp={self.dp_rank}/{self.dp}, "
                f"pp={self.pp_rank}/{self.pp}, tp={self.tp_rank}/{self.tp})")
