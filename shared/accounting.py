"""The memory and compute ledger every AI-infra engineer does by hand, for the one model (shared.model).

* `param_count` — exact count of shared.model's parameters for a config (tied embeddings counted once).
* `flops_per_token` — training FLOPs per token, 6N + 12·L·d·S (Kaplan et al. 2020 §2.1; PaLM, Chowdhery
  et al. 2022, App. B): 6 FLOPs per matmul parameter (2 forward, 4 backward) plus attention's QKᵀ and AV.
  The MFU denominator of nano_megatron and nano_zero.
* `kv_cache_bytes` — K and V of every layer for every cached token (what PagedAttention manages).
* `training_memory` — ZeRO's model-state ledger (Rajbhandari et al. 2019, §3.1 and Figure 1): mixed-precision
  Adam keeps 2Ψ bytes of fp16/bf16 parameters, 2Ψ of gradients and KΨ of optimizer state with K = 12
  (fp32 master weights 4Ψ, momentum 4Ψ, variance 4Ψ); stage 1 partitions the K part across N data-parallel
  ranks, stage 2 also the gradients, stage 3 also the parameters.

`python -m shared.accounting llama2-7b` prints the ledger as a table.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

from shared.config import PRESETS, ModelConfig, resolve_model_config

GiB = 2**30


def param_count(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Number of parameters of shared.model for `cfg` (the LM head counted once when tied)."""
    h, q, kv, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    attn = h * q + 2 * h * kv + q * h
    if cfg.attention_bias:
        attn += q + 2 * kv
    if cfg.qk_norm:
        attn += 2 * d
    mlp = 3 * h * cfg.intermediate_size
    per_layer = attn + mlp + 2 * h  # + input and post-attention RMSNorm weights
    total = cfg.num_hidden_layers * per_layer + h  # + final norm
    embedding = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return total + head + (embedding if include_embedding else 0)


def matmul_param_count(cfg: ModelConfig) -> int:
    """Parameters that take part in a matrix multiply (the N of 6N): everything but the input embedding
    lookup, which costs no FLOPs — unless it is tied to the LM head, whose matmul then uses it."""
    return param_count(cfg, include_embedding=cfg.tie_word_embeddings)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6N + 12·L·d·S, d = heads × head_dim, S = sequence length.

    12·L·d·S counts QKᵀ and AV (2·2·d·S per token forward, ×3 with backward) without the causal
    halving, as PaLM's MFU does, so numbers compare with published MFUs.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    d = cfg.num_attention_heads * cfg.head_dim
    return 6 * matmul_param_count(cfg) + 12 * cfg.num_hidden_layers * d * seq_len


def kv_cache_bytes(cfg: ModelConfig, seq_len: int, batch: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of K and V for `batch` sequences of `seq_len` tokens: 2 · L · Hkv · head_dim · bytes · S · B."""
    if seq_len < 0 or batch < 0 or dtype_bytes <= 0:
        raise ValueError(f"seq_len, batch must be >= 0 and dtype_bytes > 0, got {seq_len}, {batch}, {dtype_bytes}")
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    return per_token * seq_len * batch


@dataclass(frozen=True)
class TrainingMemory:
    """Per-rank bytes of model states under ZeRO (no activations, buffers or fragmentation)."""

    num_params: int
    zero_stage: int
    dp: int
    params: float  # bf16 / fp16 working copy (2Ψ)
    grads: float  # bf16 / fp16 gradients (2Ψ)
    master_weights: float  # fp32 copy the optimizer updates (4Ψ)
    optimizer_states: float  # Adam momentum + variance in fp32 (8Ψ)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master_weights + self.optimizer_states

    @property
    def bytes_per_param(self) -> float:
        return self.total / self.num_params


def training_memory(cfg: ModelConfig | int, zero_stage: int = 0, dp: int = 1, param_bytes: int = 2,
                    grad_bytes: int = 2, master_bytes: int = 4, moment_bytes: int = 8) -> TrainingMemory:
    """ZeRO §3.1's (2 + 2 + K)Ψ per rank, K = master_bytes + moment_bytes = 12 for mixed-precision Adam.

    Stage 0: (2+2+K)Ψ = 16Ψ; stage 1: 4Ψ + KΨ/N; stage 2: 2Ψ + (2+K)Ψ/N; stage 3: (2+2+K)Ψ/N.
    `cfg` may be a ModelConfig or a parameter count Ψ.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp!r}")
    psi = cfg if isinstance(cfg, int) else param_count(cfg)
    shard = 1.0 / dp
    return TrainingMemory(
        num_params=psi, zero_stage=zero_stage, dp=dp,
        params=param_bytes * psi * (shard if zero_stage >= 3 else 1.0),
        grads=grad_bytes * psi * (shard if zero_stage >= 2 else 1.0),
        master_weights=master_bytes * psi * (shard if zero_stage >= 1 else 1.0),
        optimizer_states=moment_bytes * psi * (shard if zero_stage >= 1 else 1.0),
    )


def _fmt_bytes(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def report(cfg: ModelConfig, seq_len: int, batch: int, dp: int) -> str:
    """The ledger as text: parameters, FLOPs, KV cache, and ZeRO model states per stage."""
    n = param_count(cfg)
    lines = [
        f"parameters              {n:,} ({n / 1e9:.2f} B; {matmul_param_count(cfg):,} in matmuls)",
        f"train FLOPs / token     {flops_per_token(cfg, seq_len) / 1e9:,.2f} GFLOP at seq_len {seq_len}",
        f"KV cache / token        {kv_cache_bytes(cfg, 1) / 2**20:,.3f} MiB (fp16/bf16)",
        f"KV cache {seq_len} x {batch}    {_fmt_bytes(kv_cache_bytes(cfg, seq_len, batch))}",
        "",
        f"model states per rank, mixed-precision AdamW (ZeRO, K = 12), dp = 1 and dp = {dp}:",
        f"{'stage':>5} | {'dp':>4} | {'params':>12} | {'grads':>12} | {'fp32 master':>12} | "
        f"{'Adam m+v':>12} | {'total':>12} | bytes/param",
    ]
    for stage in range(4):
        for ranks in sorted({1, dp}):
            m = training_memory(cfg, stage, ranks)
            lines.append(
                f"{stage:>5} | {ranks:>4} | {_fmt_bytes(m.params):>12} | {_fmt_bytes(m.grads):>12} | "
                f"{_fmt_bytes(m.master_weights):>12} | {_fmt_bytes(m.optimizer_states):>12} | "
                f"{_fmt_bytes(m.total):>12} | {m.bytes_per_param:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m shared.accounting", description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default="llama2-7b",
                   help=f"preset ({', '.join(sorted(PRESETS))}) or checkpoint directory")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dp", type=int, default=64, help="data-parallel ranks for the ZeRO columns")
    args = p.parse_args(argv)
    cfg = resolve_model_config(args.model)
    print(f"{args.model}: {asdict(cfg) | {'extra': None}}\n")
    print(report(cfg, args.seq_len, args.batch, args.dp))


if __name__ == "__main__":
    main()
