"""Pipeline (inter-layer) model parallelism (Narayanan et al. 2021, arXiv 2104.04473, §2.2).

The decoder layers are split into pp contiguous stages of L/pp layers; stage 0 also owns the token
embedding, the last stage the final norm, the LM head and the loss. A global batch is cut into m
micro-batches that flow through the stages in the order of a schedule (`schedules.py`: GPipe or
1F1B). The gradient is the sum of the micro-batch gradients, and each micro-batch loss is divided by
the token count of the whole global batch — the same normalisation as one big batch — so the update
does not depend on m (§2.2: "strict optimizer semantics").

Stage boundaries carry shared.model's two residual streams (the branch output h and the residual
sum), stacked into one (2, b, s, hidden) tensor: one message per micro-batch each way. Between two
actions a stage posts one `dist.batch_isend_irecv` holding the sends of the action it just finished
and the receive the next action needs (Megatron's send_forward_recv_backward & co.): posting both
before waiting on either is what keeps neighbouring stages from each waiting on the other.
With tied embeddings the first and last stage each hold a copy of the embedding matrix; their
gradients are summed over `grid.embedding_group` after the backward pass (Megatron-LM's "embedding
group"), so the copies stay identical.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from nano_megatron.grid import ParallelGrid
from nano_megatron.schedules import Action, schedule_actions
from shared.model import CausalLM


def stage_layers(num_layers: int, grid: ParallelGrid) -> range:
    """Global indices of the decoder layers of this stage (contiguous, L/pp each)."""
    per = num_layers // grid.pp
    return range(grid.pp_rank * per, (grid.pp_rank + 1) * per)


def split_into_stage(model: CausalLM, grid: ParallelGrid) -> None:
    """Keep only this stage's part of `model`, in place. Layers are kept in a ModuleDict keyed by their
    global index (as torchtitan does), so parameter names stay the HF names of the full model."""
    inner = model.model
    inner.layers = nn.ModuleDict({str(i): inner.layers[i]
                                  for i in stage_layers(model.config.num_hidden_layers, grid)})
    if not grid.is_first_stage:
        inner.embed_tokens = None
    if not grid.is_last_stage:
        inner.norm = None
        model.lm_head = None


def stage_forward(model: CausalLM, inputs: torch.Tensor, seq_len: int,
                  activation_checkpointing: bool = False) -> torch.Tensor:
    """This stage's share of `CausalLM.forward`: token ids → (2, b, s, h) on the first stage,
    (2, b, s, h) → (2, b, s, h) in the middle, → logits on the last stage (s is s/tp under sequence
    parallelism). With activation checkpointing each layer keeps only its inputs and is recomputed
    in the backward pass (Chen et al. 2016; the "full recomputation" of 2205.05198 §5)."""
    inner = model.model
    if inner.embed_tokens is not None:
        h, residual = inner.embed_tokens(inputs), None
    else:
        h, residual = inputs.unbind(0)
    positions = torch.arange(seq_len, device=h.device).expand(h.shape[0], seq_len)
    cos, sin = inner.rope_cos_sin(positions)
    for layer in inner.layers.values():
        if activation_checkpointing:
            h, residual = checkpoint(layer, h, residual, cos, sin, None, use_reentrant=False)
        else:
            h, residual = layer(h, residual, cos, sin, None)
    if model.lm_head is None:
        return torch.stack([h, residual])
    h, _ = inner.norm(h, residual)
    return model.lm_head(h)


class PipelineSchedule:
    """Runs one step's forward and backward passes over m micro-batches on this stage.

    forward_fn(x) -> stage output; loss_fn(logits, targets) -> scalar loss already divided by the
    global token count. `boundary_shape` is the (2, b, s_local, h) activation exchanged between stages.
    """

    def __init__(self, grid: ParallelGrid, schedule: str,
                 forward_fn: Callable[[torch.Tensor], torch.Tensor],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 boundary_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        schedule_actions(schedule, 1, 1, 0)  # validates the name
        self.grid, self.schedule = grid, schedule
        self.forward_fn, self.loss_fn = forward_fn, loss_fn
        self.boundary_shape, self.dtype, self.device = boundary_shape, dtype, device

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.boundary_shape, dtype=self.dtype, device=self.device)

    def _recv_for(self, a: Action) -> tuple[list[dist.P2POp], torch.Tensor | None]:
        g = self.grid
        if a.kind == "F" and not g.is_first_stage:
            buf = self._buffer()
            return [dist.P2POp(dist.irecv, buf, g.prev_rank)], buf
        if a.kind == "B" and not g.is_last_stage:
            buf = self._buffer()
            return [dist.P2POp(dist.irecv, buf, g.next_rank)], buf
        return [], None

    @staticmethod
    def _exchange(ops: list[dist.P2POp]) -> None:
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
            before_last_backward: Callable[[], None] = lambda: None) -> torch.Tensor:
        """Forward + backward of every micro-batch in the schedule's order; returns the summed loss on the
        last stage (0 elsewhere). `before_last_backward` runs once, before this stage's final backward
        pass: the data-parallel gradient reduction may start from then on."""
        g = self.grid
        actions = schedule_actions(self.schedule, g.pp, len(micro_batches), g.pp_rank)
        last_backward = max(k for k, a in enumerate(actions) if a.kind == "B")
        self.micro_batches = micro_batches
        # micro-batch -> received activation (needs its grad)
        self.inputs: dict[int, torch.Tensor] = {}
        # micro-batch -> stage output, or loss on the last stage
        self.outputs: dict[int, torch.Tensor] = {}
        self.loss_sum = torch.zeros((), device=self.device)
        sends: list[dist.P2POp] = []
        for k, a in enumerate(actions):
            recv_ops, buf = self._recv_for(a)
            self._exchange(sends + recv_ops)
            if k == last_backward:
                before_last_backward()
            sends = self.forward_step(a, buf) if a.kind == "F" else self.backward_step(a, buf)
        self._exchange(sends)
        return self.loss_sum

    def forward_step(self, a: Action, received: torch.Tensor | None) -> list[dist.P2POp]:
        """Forward of micro-batch `a.micro` (its input received from the previous stage, unless this is
        the first); returns the send of its output to the next stage (none on the last: the loss)."""
        g, i = self.grid, a.micro
        if g.is_first_stage:
            x = self.micro_batches[i][0].to(self.device)
        else:
            x = self.inputs[i] = received.requires_grad_()
        out = self.forward_fn(x)
        if g.is_last_stage:
            self.outputs[i] = self.loss_fn(out, self.micro_batches[i][1].to(self.device))
            self.loss_sum += self.outputs[i].detach()
            return []
        self.outputs[i] = out
        return [dist.P2POp(dist.isend, out.detach().contiguous(), g.next_rank)]

    def backward_step(self, a: Action, received: torch.Tensor | None) -> list[dist.P2POp]:
        """Backward of micro-batch `a.micro` from the gradient received from the next stage (from the loss
        on the last); returns the send of its input's gradient to the previous stage."""
        g = self.grid
        grad = None if g.is_last_stage else received
        torch.autograd.backward(self.outputs.pop(a.micro), grad_tensors=grad)
        if g.is_first_stage:
            return []
        return [dist.P2POp(dist.isend, self.inputs.pop(a.micro).grad, g.prev_rank)]
