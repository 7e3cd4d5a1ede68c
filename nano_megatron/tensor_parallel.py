"""Tensor (intra-layer) model parallelism of Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053, §3).

The paper splits each Transformer block with two conjugate operators (Figure 3):

    f: identity in the forward pass, all-reduce in the backward pass   (`copy_to_tp`)
    g: all-reduce in the forward pass, identity in the backward pass   (`reduce_from_tp`)

and two kinds of linear layers:

* ColumnParallelLinear: Y = X·[A_1, …, A_t] — rank i holds the column block A_i (rows of nn.Linear's
  (out, in) weight), sees the whole X (after f) and produces its slice Y_i with no communication.
* RowParallelLinear: Z = Σ_i Y_i·B_i — rank i holds the row block B_i, takes Y_i and its partial sums
  are added by g (§3, eq. 3 and the text after it).

The MLP is [gate, up] column-parallel → SwiGLU (element-wise, so local) → down row-parallel; attention
is q/k/v column-parallel by heads (each rank owns whole heads, so softmax is local) → o row-parallel.
Each block costs one all-reduce forward and one backward. The vocabulary is split the same way
(§3, last paragraphs): `VocabParallelEmbedding` looks up its own rows and g sums the partial vectors;
the LM head is column-parallel over the vocabulary and `vocab_parallel_cross_entropy` computes the loss
from the vocabulary shards, exchanging b·s scalars instead of b·s·v logits.

`apply_tensor_parallel` swaps these layers into shared.model from outside (torchtitan's
"parallelize function"): module names, hence checkpoint names, do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nano_megatron.grid import ParallelGrid
from nano_megatron.sequence_parallel import (
    gather_from_sequence_parallel,
    reduce_scatter_to_sequence_parallel,
)
from shared.model import CausalLM


# --------------------------------------------------------------------------- f and g (Figure 3)
class _CopyToTensorParallel(torch.autograd.Function):
    """f: the input X of a column-parallel block is used by every rank, so dL/dX is the sum of the
    ranks' partial dL/dX — an all-reduce in the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)  # a new autograd node on the same storage (an identity)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: sum the partial outputs Y_i·B_i of a row-parallel layer; its gradient is already whole."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron's f (Figure 3): identity forward, all-reduce backward."""
    return x if dist.get_world_size(group) == 1 else _CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron's g (Figure 3): all-reduce forward, identity backward."""
    return x if dist.get_world_size(group) == 1 else _ReduceFromTensorParallel.apply(x, group)


# --------------------------------------------------------------------------- layers
def _shard(full: torch.Tensor, dim: int, grid: ParallelGrid, padded: int | None = None
           ) -> torch.Tensor:
    """This tp rank's contiguous block of `full` along `dim`, after zero-padding that dim to `padded`
    rows."""
    if padded is not None and padded > full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    return full.chunk(grid.tp, dim=dim)[grid.tp_rank].clone()


class ColumnParallelLinear(nn.Module):
    """Y_i = X·A_i + b_i (§3, Figure 3a's first GEMM): this rank's block of output features.

    The input must already be "f-ed" (or all-gathered along the sequence, under sequence parallelism):
    apply_tensor_parallel does that once per block, so q, k and v (gate and up) share one backward
    all-reduce instead of issuing three (two).
    """

    def __init__(self, linear: nn.Linear, grid: ParallelGrid, padded_out: int | None = None
                 ) -> None:
        super().__init__()
        self.in_features, self.full_out = linear.in_features, linear.out_features
        self.weight = nn.Parameter(_shard(linear.weight.detach(), 0, grid, padded_out))
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(_shard(linear.bias.detach(), 0, grid, padded_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Z = g(Y_i·B_i) + b (§3, Figure 3a's second GEMM): input features split, partial sums reduced.

    Under sequence parallelism the reduction is a reduce-scatter along the sequence (ḡ of 2205.05198
    §4.2.2) instead of an all-reduce: same bytes received, and the result is already sequence-sharded
    for the norm that follows. The bias (replicated) is added once, after the reduction.
    """

    def __init__(self, linear: nn.Linear, grid: ParallelGrid, sequence_parallel: bool = False
                 ) -> None:
        super().__init__()
        self.group, self.sequence_parallel = grid.tp_group, sequence_parallel
        self.weight = nn.Parameter(_shard(linear.weight.detach(), 1, grid))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel(partial, self.group)
        else:
            out = reduce_from_tp(partial, self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over tp ranks (§3, "input embedding"), the vocabulary
    zero-padded to a multiple of tp. Each rank looks up the ids it owns, writes zeros for the rest, and
    g (or ḡ under sequence parallelism) sums the partial vectors: exactly one rank contributed each."""

    def __init__(self, embedding: nn.Embedding, grid: ParallelGrid, padded_vocab: int,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = grid.tp_group, sequence_parallel
        self.num_embeddings = embedding.num_embeddings
        self.weight = nn.Parameter(_shard(embedding.weight.detach(), 0, grid, padded_vocab))
        self.vocab_start = grid.tp_rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(out, self.group)
        return reduce_from_tp(out, self.group)


# --------------------------------------------------------------------------- the loss
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocabulary shards (§3: "fuse the output embedding GEMM with the cross entropy
    loss", reducing the communication from b·s·v to b·s). Three b·s-sized reductions replace a gather
    of the logits: the row max (for a stable softmax), then Σexp and the target's logit (one all-reduce).
    Columns at or past `vocab_size` (padding) are excluded, so the loss equals the unpadded model's."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        logits = logits.float()
        n_local = logits.shape[-1]
        n_valid = min(max(vocab_size - vocab_start, 0), n_local)
        if n_valid < n_local:  # padded vocabulary rows never win the softmax
            logits = logits.clone()
            logits[:, n_valid:] = float("-inf")
        single = dist.get_world_size(group) == 1
        row_max = logits.max(dim=-1).values
        if not single:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        local_t = targets - vocab_start
        mine = (local_t >= 0) & (local_t < n_local)
        local_t = local_t.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        if not single:
            dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local_t, mine = ctx.saved_tensors
        # d loss / d logits = softmax − one_hot(target); the one-hot lives on one rank only.
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= mine.to(g.dtype)
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 vocab_size: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shape = targets.shape) from this rank's logits[..., v_local],
    whose first column is vocabulary id `vocab_start`; ids ≥ `vocab_size` are padding."""
    flat = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]),
                                            targets.reshape(-1), vocab_start, vocab_size, group)
    return flat.view(targets.shape)


# --------------------------------------------------------------------------- the parallelize function
@dataclass(frozen=True)
class TPShard:
    """How a local parameter relates to the full HF tensor of the same name.

    dim: the dimension split over tp ranks (None: replicated). full_size: that dimension's true size
    (the vocabulary before padding). partial_grad: a replicated parameter whose gradient each rank
    computes from only part of the data (norms under sequence parallelism, the per-head q/k norms), so
    it must be all-reduced over tp after backward (2205.05198 §4.2.2).
    """

    dim: int | None = None
    full_size: int = 0
    partial_grad: bool = False


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def _prepare_input(module: nn.Module, grid: ParallelGrid, sequence_parallel: bool) -> None:
    """Put f (or, under sequence parallelism, the all-gather along the sequence) at the entry of a
    block — torchtitan's PrepareModuleInput — so that all column-parallel layers inside share it.
    The hook's handle is kept as `module.tp_input_hook` (a performance layer may swap the hook)."""

    def hook(mod: nn.Module, args: tuple) -> tuple:
        if sequence_parallel:
            return (gather_from_sequence_parallel(args[0], grid.tp_group), *args[1:])
        return (copy_to_tp(args[0], grid.tp_group), *args[1:])

    module.tp_input_hook = module.register_forward_pre_hook(hook)


def apply_tensor_parallel(model: CausalLM, grid: ParallelGrid, sequence_parallel: bool = False
                          ) -> dict[str, TPShard]:
    """Shard shared.model in place over `grid.tp_group` (§3, Figure 3); returns how each parameter is
    sharded.

    Works on a pipeline stage too (missing embedding / head / layers are skipped). With tied
    embeddings the LM head keeps sharing the (vocab-parallel) embedding weight.
    """
    cfg, tp = model.config, grid.tp
    if tp == 1:  # nothing to split: the plain model is its own single shard
        return {name: TPShard() for name, _ in model.named_parameters()}
    padded_vocab = padded_vocab_size(cfg.vocab_size, tp)
    info: dict[str, TPShard] = {}
    sp = sequence_parallel
    layers = model.model.layers
    for key, layer in (layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)):
        p = f"model.layers.{key}."
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, ColumnParallelLinear(getattr(attn, name), grid))
            size = cfg.q_size if name == "q_proj" else cfg.kv_size
            info[f"{p}self_attn.{name}.weight"] = TPShard(0, size)
            if cfg.attention_bias:
                info[f"{p}self_attn.{name}.bias"] = info[f"{p}self_attn.{name}.weight"]
        attn.o_proj = RowParallelLinear(attn.o_proj, grid, sp)
        info[f"{p}self_attn.o_proj.weight"] = TPShard(1, cfg.q_size)
        _prepare_input(attn, grid, sp)
        if attn.q_norm is not None:  # one weight shared by all heads; each rank sees only its heads
            for name in ("q_norm", "k_norm"):
                info[f"{p}self_attn.{name}.weight"] = TPShard(partial_grad=tp > 1)
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, grid)
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, grid)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, grid, sp)
        for name in ("gate_proj", "up_proj"):
            info[f"{p}mlp.{name}.weight"] = TPShard(0, cfg.intermediate_size)
        info[f"{p}mlp.down_proj.weight"] = TPShard(1, cfg.intermediate_size)
        _prepare_input(mlp, grid, sp)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            info[f"{p}{norm}.weight"] = TPShard(partial_grad=sp and tp > 1)
    if model.model.embed_tokens is not None:
        embedding = model.model.embed_tokens
        model.model.embed_tokens = VocabParallelEmbedding(embedding, grid, padded_vocab, sp)
        info["model.embed_tokens.weight"] = TPShard(0, cfg.vocab_size)
    if model.model.norm is not None:
        info["model.norm.weight"] = TPShard(partial_grad=sp and tp > 1)
    if model.lm_head is not None:
        tied_here = cfg.tie_word_embeddings and model.model.embed_tokens is not None
        model.lm_head = ColumnParallelLinear(model.lm_head, grid, padded_vocab)
        if tied_here:
            model.lm_head.weight = model.model.embed_tokens.weight
        else:
            info["lm_head.weight"] = TPShard(0, cfg.vocab_size)
        _prepare_input(model.lm_head, grid, sp)
    for name, _ in model.named_parameters():
        info.setdefault(name, TPShard())
    return info
