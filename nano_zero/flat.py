"""Flat padded parameter units: the data layout ZeRO partitions (Rajbhandari et al. 2019, arXiv 1910.02054).

A *unit* is a group of parameters that are gathered, reduced and stepped together: one decoder block, or
the "root" (embeddings, final norm, LM head). Its parameters are laid end to end in one flat buffer,
padded to a multiple of the data-parallel size N, so that rank r owns exactly one contiguous shard
[r·S, (r+1)·S) with S = padded / N. Then every ZeRO collective is a single `all_gather_into_tensor` /
`reduce_scatter_tensor` over a flat buffer, and the fp32 master weights and AdamW moments of a rank are
three flat fp32 tensors of S elements (§5.1, Pos: the optimizer states are grouped into N equal partitions
and rank i updates only partition i).

Within a unit, parameters that take weight decay come first, so the decayed elements of any shard are
one prefix of it and AdamW needs no per-element mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shared.train import decays


@dataclass
class Slot:
    """Where one parameter lives inside its unit's flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


class FlatUnit:
    """One unit's geometry (which parameter sits where, who owns which shard) and its buffers.

    Buffers (created by ZeroDataParallel according to the stage; None when the stage does not keep them):
      full        compute-dtype flat parameters; module parameters are views into it. Stage 3 keeps its
                  storage at size 0 except while the unit is gathered.
      param_shard stage 3 only: this rank's compute-dtype slice of the parameters at rest (2Ψ/N).
      grad_full   compute-dtype flat gradients, `param.grad` are views into it (stages 0, 1 always; stage 2
                  between the first micro-step and its reduce-scatter; stage 3 while the unit's backward runs).
      grad_shard  this rank's reduced gradient slice (stages 2 and 3; stage 1 uses its slice of grad_full).
      master, exp_avg, exp_avg_sq
                  fp32 master weights and AdamW moments of this rank's shard (stage 0: of everything).
    """

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter]], rank: int,
                 world: int) -> None:
        # decayed parameters first (sorted is stable: each group keeps its order)
        ordered = sorted(named_params, key=lambda np: not decays(np[1]))
        self.name, self.rank, self.world = name, rank, world
        self.slots: list[Slot] = []
        offset = 0
        for pname, p in ordered:
            self.slots.append(Slot(pname, p, offset, p.numel(), p.shape))
            offset += p.numel()
        self.numel = offset
        self.decay_numel = sum(s.numel for s in self.slots if decays(s.param))
        # Pad to a multiple of N: sizes that do not divide are padded, never rejected. The padding is
        # zero in every buffer, so it adds nothing to norms and its "updates" stay zero.
        self.shard_numel = -(-self.numel // world) if self.numel else 0
        self.padded = self.shard_numel * world
        self.full: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.ready = 0  # parameters whose gradient arrived in the current backward pass
        self.reduced = False  # gradient reduced in the current backward pass
        self.gathered = False  # stage 3: `full` holds the parameters
        # stage 3: an in-flight prefetch all-gather (a c10d Work)
        self.pending: object | None = None

    # --------------------------------------------------------------- shard geometry
    def shard_slice(self, rank: int | None = None) -> slice:
        r = self.rank if rank is None else rank
        return slice(r * self.shard_numel, (r + 1) * self.shard_numel)

    def decay_numel_in_shard(self, rank: int | None = None) -> int:
        """How many leading elements of rank's shard take weight decay."""
        r = self.rank if rank is None else rank
        return max(0, min(self.shard_numel, self.decay_numel - r * self.shard_numel))

    # --------------------------------------------------------------- views
    def point_params_at(self, flat: torch.Tensor) -> None:
        """Make every parameter a view of `flat` (its storage may later be resized: views stay valid)."""
        for s in self.slots:
            s.param.data = flat[s.offset:s.offset + s.numel].view(s.shape)

    def point_grads_at(self, flat: torch.Tensor) -> None:
        """Make every `param.grad` a view of `flat`, so autograd accumulates into the flat buffer in place."""
        for s in self.slots:
            s.param.grad = flat[s.offset:s.offset + s.numel].view(s.shape)

    def drop_grads(self) -> None:
        for s in self.slots:
            s.param.grad = None

    def flatten_params(self, dtype: torch.dtype) -> torch.Tensor:
        """A fresh padded flat copy of the parameters' current values."""
        device = self.slots[0].param.device if self.slots else torch.device("cpu")
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for s in self.slots:
            flat[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        return flat

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """{parameter name: a copy of its values in `flat`}."""
        return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape).clone() for s in self.slots}


@torch.no_grad()
def adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
           exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
           eps: float, weight_decay: float, decay_numel: int) -> None:
    """AdamW (Loshchilov & Hutter 2019; decoupled weight decay) on one flat fp32 shard, in place.

    Op for op what torch.optim.AdamW's single-tensor path does, so a sharded step equals torch's step
    on the same elements; `decay_numel` leading elements take weight decay (see module docstring).
    """
    if weight_decay and decay_numel:
        master[:decay_numel].mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))


__all__ = ["FlatUnit", "Slot", "adamw_"]
