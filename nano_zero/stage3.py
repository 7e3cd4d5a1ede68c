"""ZeRO stage 3 (Pos+g+p, arXiv 1910.02054 §5.3): parameters sharded at rest, gathered per unit on demand.

The paper (§7.2.2, paraphrased): before the forward of a partition, the rank owning it broadcasts the
weights to all ranks; after that forward they can be discarded; they are collected again, in reverse
order, during the backward. Here the broadcast is an all-gather of every rank's shard into the unit's
flat buffer, whose *storage* is resized to zero when the unit is released: the parameters stay views of that
buffer (and autograd's saved views stay valid) while it holds no memory.

  pre-forward hook     gather the unit (waiting for its prefetch), start gathering the next one
  post-forward hook    release it; hook the outputs so the unit is re-gathered when their gradient arrives
  pre-backward (tensor hook on the outputs)
                       allocate the unit's flat gradient, gather it, prefetch the unit backward needs next
  post-accumulate-grad (ZeroDataParallel._on_grad)
                       the unit's last gradient landed: reduce-scatter into the 2Ψ/N shard, release it
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from nano_zero.flat import FlatUnit


class Stage3Mixin:
    """Gather / release / prefetch of ZeroDataParallel's units (its `root`, `blocks`, `module`, `comm`)."""

    def _install_stage3_hooks(self) -> None:
        def pre_forward(u: FlatUnit, module, args):
            self._gather(u)
            self._prefetch(u, forward=True)

        def post_forward(u: FlatUnit, module, args, output):
            self._reshard(u)  # §5.3: parameters are discarded right after the unit's forward
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(functools.partial(pre_backward, u))

        def pre_backward(u: FlatUnit, grad: torch.Tensor) -> None:
            # Fires when the gradient of the unit's output is ready, i.e. just before its backward.
            self._queue_final_callback()
            if u.reduced:
                return
            if u.grad_full is None:
                u.grad_full = torch.zeros(u.padded, dtype=self.dtype, device=self.device)
                u.point_grads_at(u.grad_full)
            self._gather(u)
            self._prefetch(u, forward=False)

        for u, m in [(self.root, self.module), *zip(self.blocks, self._block_modules())]:
            m.register_forward_pre_hook(functools.partial(pre_forward, u))
            m.register_forward_hook(functools.partial(post_forward, u))

    def _block_modules(self) -> list[nn.Module]:
        by_name = dict(self.module.named_modules())
        return [by_name[u.name] for u in self.blocks]

    def _gather(self, u: FlatUnit, async_op: bool = False) -> None:
        """§5.3: all-gather a unit's parameters from every rank's shard into its full buffer."""
        if not u.gathered:
            u.full.untyped_storage().resize_(u.padded * u.full.element_size())
            u.pending = self.comm.all_gather(u.full, u.param_shard, async_op=async_op)
            u.gathered = True
        if not async_op and u.pending is not None:
            u.pending.wait()
            u.pending = None

    def _reshard(self, u: FlatUnit) -> None:
        if u.gathered:
            if u.pending is not None:
                u.pending.wait()
                u.pending = None
            u.full.untyped_storage().resize_(0)
            u.gathered = False

    def _prefetch(self, u: FlatUnit, forward: bool) -> None:
        """Start gathering the unit that runs next (forward: root, block 0, 1, ...; backward: reversed)."""
        if not self.prefetch or not self.blocks:
            return
        order = [self.root, *self.blocks] if forward else [self.root, *reversed(self.blocks)]
        i = next(i for i, v in enumerate(order) if v is u)
        if i + 1 < len(order) and not order[i + 1].reduced:
            self._gather(order[i + 1], async_op=True)
