"""Data parallelism with bucketed gradient all-reduce overlapped with the backward pass.

Every dp replica computes gradients on its share of the global batch; summing them gives the gradient
of the whole batch (each micro-batch loss is already divided by the global token count, so the
reduction is a SUM, not a mean). Doing one all-reduce per parameter wastes latency and doing one at the
end wastes the backward pass's time, so, as PyTorch DDP (Li et al. 2020, arXiv 2006.15704, §3.2) and
Megatron-LM's DistributedDataParallel do:

* parameters are grouped into buckets of ~`bucket_mb` MiB in reverse registration order (the order
  in which backward produces their gradients, last layer first);
* every gradient is a view into its bucket's flat buffer, so autograd accumulates straight into it;
* a post-accumulate-grad hook counts the gradients of a bucket; when the last one is in, the bucket's
  all-reduce is launched asynchronously while backward continues with earlier layers.

Buckets are launched strictly in order, so every rank issues the same collectives in the same order
even if autograd finished two buckets in a different order on different ranks. With gradient
accumulation over micro-batches the reduction is only armed for the last backward pass (`arm()`),
like DDP's `no_sync()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from shared.train import weak_hook


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    pending: int = 0
    work: dist.Work | None = None
    views: list[torch.Tensor] = field(default_factory=list)


class BucketedGradReducer:
    """Owns the gradients of `params` (as views of flat per-bucket buffers) and sums them over `group`."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None,
                 bucket_mb: float = 25.0) -> None:
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.buckets: list[_Bucket] = []
        limit = max(1, int(bucket_mb * 2**20))
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed([p for p in params if p.requires_grad]):
            if current and (size >= limit or p.dtype != current[0].dtype):  # one buffer, one dtype
                self._add_bucket(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self._add_bucket(current)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._armed = False
        self._next_launch = 0
        self.launched_by_hooks = 0  # buckets whose reduction started inside the last backward pass
        if self.world > 1:
            for b in self.buckets:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))
        self.zero_grad()

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.buckets.append(_Bucket(params, buffer, views=views))

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def zero_grad(self) -> None:
        """Zero the buffers and (re)attach every .grad to its view; disarm the reduction."""
        for b in self.buckets:
            b.buffer.zero_()
            b.pending, b.work = len(b.params), None
            for p, view in zip(b.params, b.views):
                p.grad = view
        self._armed, self._next_launch, self.launched_by_hooks = False, 0, 0

    def arm(self) -> None:
        """Reduce during the next backward pass (call it before the last micro-batch's backward)."""
        self._armed = True

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._armed:
            return
        bucket = self._bucket_of[id(p)]
        bucket.pending -= 1
        # Launch every bucket that is complete, in bucket order.
        buckets = self.buckets
        while self._next_launch < len(buckets) and buckets[self._next_launch].pending == 0:
            self._launch(buckets[self._next_launch])
            self._next_launch += 1
            self.launched_by_hooks += 1

    def _launch(self, b: _Bucket) -> None:
        b.work = dist.all_reduce(b.buffer, group=self.group, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket's all-reduce (launching any bucket whose parameters got no gradient in
        this backward pass). After this every rank holds the sum of the replicas' gradients."""
        if self.world == 1:
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for b in self.buckets:
            b.work.wait()
            views = zip(b.params, b.views)
            if any(p.grad is None or p.grad.data_ptr() != v.data_ptr() for p, v in views):
                raise RuntimeError("a gradient was replaced instead of accumulated into its "
                                   "bucket view; do not set .grad to None between zero_grad() "
                                   "and finish()")
        self._armed = False
