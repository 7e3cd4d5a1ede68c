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

Inference, counted the same way by every bench:

* `decode_bytes` — bytes one decode step reads: every weight a matmul uses (the LM head included), the
  gathered embedding rows (a lookup reads rows, not the table; tied embeddings are the LM head's matrix,
  counted once), and the K/V of every key each sequence attends. PagedAttention (2309.06180, §2) and
  Flash-Decoding are bound by these bytes at small batch.
* `forward_flops` / `decode_flops` — FLOPs of a prefill and of a decode step: 2 per matmul parameter and
  token, the LM head only for the rows that are sampled, 4·Hq·head_dim per (query, key) pair for QKᵀ and
  PV (causal: only the keys a query attends).
* `decode_roofline` / `serving_roofline` — turn a measured copy bandwidth and matmul peak into tokens/s
  bounds (the roofline model, Williams et al. 2009): a step takes at least max(bytes / bandwidth,
  FLOPs / peak).
* `Ceilings` — the measured copy bandwidth and matmul peak of this process's device (measured once, by
  shared.bench's helpers), beside the datasheet values, and MFU / MBU against both, labelled.

`python -m shared.accounting llama2-7b` prints the ledger as a table.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
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


def flops_per_token(cfg: ModelConfig, seq_len: int, causal_halved: bool = False) -> int:
    """Training FLOPs per token: 6N + 12·L·d·S, d = heads × head_dim, S = sequence length.

    12·L·d·S counts QKᵀ and AV (2·2·d·S per token forward, ×3 with backward) without the causal
    halving, as PaLM's MFU does, so numbers compare with published MFUs. `causal_halved`: 6·L·d·S, the
    attention FLOPs a causal kernel actually does (the benches print both MFUs, labelled).
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    d = cfg.num_attention_heads * cfg.head_dim
    return 6 * matmul_param_count(cfg) + (6 if causal_halved else 12) * cfg.num_hidden_layers * d * seq_len


def kv_cache_bytes(cfg: ModelConfig, seq_len: int, batch: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of K and V for `batch` sequences of `seq_len` tokens: 2 · L · Hkv · head_dim · bytes · S · B."""
    if seq_len < 0 or batch < 0 or dtype_bytes <= 0:
        raise ValueError(f"seq_len, batch must be >= 0 and dtype_bytes > 0, got {seq_len}, {batch}, "
                         f"{dtype_bytes}")
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


# ------------------------------------------------------------------ inference: bytes, FLOPs, rooflines
def lm_head_params(cfg: ModelConfig) -> int:
    """Parameters of the LM head's vocab × hidden matrix (the input embedding's, when tied)."""
    return cfg.vocab_size * cfg.hidden_size


def _keys(context_lens: Sequence[int] | int) -> list[int]:
    lens = [context_lens] if isinstance(context_lens, int) else list(context_lens)
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lens):
        raise ValueError(f"context_lens must be positive ints (keys each sequence attends), got "
                         f"{context_lens!r}")
    return lens


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode step reads from memory, by kind (writes — the new K/V, the logits — not counted)."""

    weights: int  # every parameter but the input-embedding table: layers, norms, LM head (tied: table once)
    embedding_rows: int  # one gathered embedding row per sequence
    kv: int  # K and V of every key every sequence attends

    @property
    def total(self) -> int:
        return self.weights + self.embedding_rows + self.kv


def decode_bytes(cfg: ModelConfig, context_lens: Sequence[int] | int, dtype_bytes: int = 2,
                 kv_dtype_bytes: float | None = None, weight_bytes: float | None = None) -> DecodeBytes:
    """Bytes read by one decode step of len(context_lens) sequences, each attending context_lens[i] keys
    (its cached tokens plus the new one): weights once for the whole batch (matmul_param_count: the LM
    head is the tied table, or its own matrix while the untied table is only gathered from), one embedding
    row per sequence, and 2 · L · Hkv · head_dim bytes of K/V per key (kv_cache_bytes). A quantized model
    or cache reads what it stores: `weight_bytes`, the matmul weights' bytes (packed codes, scales and
    zeros), and `kv_dtype_bytes`, bytes per cached element (fractional for KIVI's codes and scales)."""
    keys = _keys(context_lens)
    if dtype_bytes <= 0 or (kv_dtype_bytes is not None and kv_dtype_bytes <= 0) or \
            (weight_bytes is not None and weight_bytes <= 0):
        raise ValueError(f"dtype_bytes, kv_dtype_bytes and weight_bytes must be > 0, got {dtype_bytes}, "
                         f"{kv_dtype_bytes}, {weight_bytes}")
    kv_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    per_key = kv_cache_bytes(cfg, 1, 1, 1)  # elements of K and V per key
    return DecodeBytes(weights=matmul_param_count(cfg) * dtype_bytes if weight_bytes is None else weight_bytes,
                       embedding_rows=len(keys) * cfg.hidden_size * dtype_bytes,
                       kv=round(per_key * sum(keys) * kv_bytes))


def forward_flops(cfg: ModelConfig, new_tokens: int, cached_tokens: int = 0, logits: int = 1) -> int:
    """FLOPs of one sequence's forward pass over `new_tokens` tokens after `cached_tokens` cached ones,
    sampling `logits` rows: 2·(N − N_head) per token for the layers' matmuls (N = matmul_param_count),
    2·N_head per sampled row for the LM head, and 4·Hq·head_dim·L per (query, key) pair for QKᵀ and PV,
    the i-th new token attending cached_tokens + i keys (causal). A prefill is forward_flops(cfg, prompt);
    a decode step of one sequence forward_flops(cfg, 1, context - 1)."""
    if new_tokens < 1 or cached_tokens < 0 or not 0 <= logits <= new_tokens:
        raise ValueError(f"need new_tokens >= 1, cached_tokens >= 0, 0 <= logits <= new_tokens; got "
                         f"{new_tokens}, {cached_tokens}, {logits}")
    head = lm_head_params(cfg)
    pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) // 2
    attn_per_pair = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    return 2 * (matmul_param_count(cfg) - head) * new_tokens + 2 * head * logits + attn_per_pair * pairs


def decode_flops(cfg: ModelConfig, context_lens: Sequence[int] | int) -> int:
    """FLOPs of one decode step: one new token per sequence, sequence i attending context_lens[i] keys."""
    return sum(forward_flops(cfg, 1, n - 1) for n in _keys(context_lens))


def decode_roofline(cfg: ModelConfig, context_lens: Sequence[int] | int, bandwidth: float, peak_flops: float,
                    dtype_bytes: int = 2, **stored: float | None) -> dict:
    """Upper bound on decode tokens/s: a step of B sequences takes at least max(decode_bytes / bandwidth,
    decode_flops / peak_flops) seconds and yields B tokens. `bandwidth` in bytes/s (the measured read-only
    stream, `Ceilings.stream_bytes_per_s`: a decode step only reads), `peak_flops` in FLOP/s; `stored`:
    decode_bytes' `weight_bytes` and `kv_dtype_bytes` of a quantized model or cache."""
    if bandwidth <= 0 or peak_flops <= 0:
        raise ValueError(f"bandwidth and peak_flops must be > 0, got {bandwidth}, {peak_flops}")
    keys = _keys(context_lens)
    read = decode_bytes(cfg, keys, dtype_bytes, **stored)  # kv_dtype_bytes, weight_bytes: as stored
    memory_s, compute_s = read.total / bandwidth, decode_flops(cfg, keys) / peak_flops
    step_s = max(memory_s, compute_s)
    return {"bytes_per_step": read.total, "weight_bytes": read.weights, "kv_bytes": read.kv,
            "step_s": step_s, "tokens_per_s": len(keys) / step_s,
            "bound": "memory" if memory_s >= compute_s else "compute"}


def serving_roofline(cfg: ModelConfig, prompt_lens: Sequence[int], output_lens: Sequence[int],
                     dtype_bytes: int, bandwidth: float, peak_flops: float, **stored: float | None) -> dict:
    """Lower-bound seconds for an offline workload: every prefill at `peak_flops` (forward_flops, one
    sampled row each), then every decode step at max(bytes / bandwidth, FLOPs / peak) with all requests
    decoding together — step t (t ≥ 1; the prefill yields the first token) serves each request with more
    than t outputs, which attends its prompt + t keys. Batching limits are ignored, so it is a bound."""
    if len(prompt_lens) != len(output_lens):
        raise ValueError(f"prompt_lens and output_lens differ in length: {len(prompt_lens)} vs "
                         f"{len(output_lens)}")
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
    prefill_s = sum(forward_flops(cfg, p) for p in prompt_lens) / peak_flops
    decode_s, memory_bound_steps = 0.0, 0
    steps = max(output_lens, default=0)
    for t in range(1, steps):
        step = decode_roofline(cfg, [p + t for p, o in zip(prompt_lens, output_lens) if o > t], bandwidth,
                               peak_flops, dtype_bytes, **stored)
        decode_s += step["step_s"]
        memory_bound_steps += step["bound"] == "memory"
    total, out = prefill_s + decode_s, sum(output_lens)
    return {"roofline_s": total, "roofline_tok_per_s": out / total if total else float("nan"),
            "decode_only_tok_per_s": out / decode_s if decode_s else float("nan"),
            "prefill_bound_s": prefill_s, "decode_bound_s": decode_s,
            "decode_memory_bound_frac": memory_bound_steps / max(steps - 1, 1)}


# ------------------------------------------------------------------ the physical limits of one device
# NVIDIA datasheet values, (HBM bytes/s, dense bf16 tensor-core FLOP/s), by a substring of the device name
# (most specific first). Published MFUs are quoted against the FLOP/s column.
DATASHEETS: dict[str, tuple[float, float]] = {
    "H200": (4.8e12, 989e12),
    "H100 PCIe": (2.0e12, 756e12),
    "H100": (3.35e12, 989e12),  # SXM
    "A100-SXM4-80GB": (2.039e12, 312e12),
    "A100-SXM4-40GB": (1.555e12, 312e12),
}
MFU_MEASURED, MFU_DATASHEET = "MFU % (measured peak)", "MFU % (datasheet peak)"
MBU_MEASURED, MBU_DATASHEET = "% of copy bandwidth (measured)", "% of HBM bandwidth (datasheet)"


_SI = (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def format_rate(per_second: float | None, unit: str) -> str:
    """A rate with three significant digits and the SI prefix that puts it in [1, 1000): "989 TFLOP/s",
    "145 GFLOP/s" (a CPU: not "0.1 TFLOP/s"), "3.35 TB/s", "25.1 GB/s"; `unit` is "FLOP/s", "B/s", ...;
    "n/a" for None."""
    if per_second is None:
        return "n/a"
    for prefix, scale in _SI:
        if abs(per_second) >= 0.9995 * scale:  # 999.6e12 prints as 1 P..., never as 1e+03 T...
            return f"{per_second / scale:.3g} {prefix}{unit}"
    return f"{per_second:.3g} {unit}"


def datasheet_for(device_name: str) -> tuple[float, float] | None:
    """(HBM bytes/s, dense bf16 FLOP/s) from DATASHEETS for a device name, or None if it is not listed."""
    return next((v for k, v in DATASHEETS.items() if k in device_name), None)


@dataclass(frozen=True)
class Ceilings:
    """The limits a bench's numbers are fractions of: the measured device copy (bytes read + written per
    second, 1 GiB on CUDA), a read-only stream (bytes read per second) and bf16 matmul (8192³ on CUDA), taken once per process by
    `shared.bench.measure_ceilings`, next to the datasheet values (None for a device DATASHEETS does not
    list). Measure at process start, before an engine takes the memory."""

    device: str
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    datasheet_bytes_per_s: float | None = None
    datasheet_flops_per_s: float | None = None
    # a kernel that only reads (shared.bench.measure_read_bandwidth): the ceiling of read-bound work
    read_bytes_per_s: float | None = None

    @property
    def stream_bytes_per_s(self) -> float:
        """The bandwidth read-bound work is held to: the read-only stream where measured, else the copy."""
        return self.read_bytes_per_s or self.copy_bytes_per_s

    def as_dict(self) -> dict:
        """The JSON record every bench writes under "ceilings" (units in the names)."""
        gb, tf = 1e9, 1e12
        return {"device": self.device, "copy_GBps": self.copy_bytes_per_s / gb,
                "read_GBps": self.read_bytes_per_s / gb if self.read_bytes_per_s else None,
                "matmul_TFLOPs": self.matmul_flops_per_s / tf,
                "datasheet_GBps": self.datasheet_bytes_per_s / gb if self.datasheet_bytes_per_s else None,
                "datasheet_TFLOPs": self.datasheet_flops_per_s / tf if self.datasheet_flops_per_s else None}

    def mfu(self, flops_per_s: float) -> dict[str, float | None]:
        """Model FLOPs utilisation in %, against the measured matmul peak and the datasheet peak."""
        sheet = self.datasheet_flops_per_s
        return {MFU_MEASURED: 100 * flops_per_s / self.matmul_flops_per_s,
                MFU_DATASHEET: 100 * flops_per_s / sheet if sheet else None}

    def mbu(self, bytes_per_s: float) -> dict[str, float | None]:
        """Memory bandwidth utilisation in %, against the measured copy and the datasheet HBM bandwidth."""
        sheet = self.datasheet_bytes_per_s
        return {MBU_MEASURED: 100 * bytes_per_s / self.copy_bytes_per_s,
                MBU_DATASHEET: 100 * bytes_per_s / sheet if sheet else None}

    def describe(self) -> str:
        """One line for a bench's printout."""
        sheet = (f"; datasheet {format_rate(self.datasheet_bytes_per_s, 'B/s')}, "
                 f"{format_rate(self.datasheet_flops_per_s, 'FLOP/s')} bf16 dense"
                 if self.datasheet_flops_per_s else "; no datasheet values for this device")
        read = (f", read-only stream {format_rate(self.read_bytes_per_s, 'B/s')}"
                if self.read_bytes_per_s else "")
        return (f"ceilings on {self.device}: measured copy {format_rate(self.copy_bytes_per_s, 'B/s')} "
                f"(read + write){read}, matmul {format_rate(self.matmul_flops_per_s, 'FLOP/s')}{sheet}")


def _fmt_bytes(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def report(cfg: ModelConfig, seq_len: int, batch: int, dp: int) -> str:
    """The ledger as text: parameters, FLOPs, KV cache, and ZeRO model states per stage."""
    n, step = param_count(cfg), decode_bytes(cfg, [seq_len] * batch)
    lines = [
        f"parameters              {n:,} ({n / 1e9:.2f} B; {matmul_param_count(cfg):,} in matmuls)",
        f"train FLOPs / token     {flops_per_token(cfg, seq_len) / 1e9:,.2f} GFLOP at seq_len {seq_len}",
        f"KV cache / token        {kv_cache_bytes(cfg, 1) / 2**20:,.3f} MiB (fp16/bf16)",
        f"KV cache {seq_len} x {batch}    {_fmt_bytes(kv_cache_bytes(cfg, seq_len, batch))}",
        f"decode step reads       {_fmt_bytes(step.total)} at batch {batch}, {seq_len} keys each (weights "
        f"{_fmt_bytes(step.weights)}, K/V {_fmt_bytes(step.kv)}; the input-embedding table is not read)",
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


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m shared.accounting`."""
    p = argparse.ArgumentParser(prog="python -m shared.accounting", description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default="llama2-7b",
                   help=f"preset ({', '.join(sorted(PRESETS))}) or checkpoint directory")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dp", type=int, default=64, help="data-parallel ranks for the ZeRO columns")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cfg = resolve_model_config(args.model)
    print(f"{args.model}: {asdict(cfg) | {'extra': None}}\n")
    print(report(cfg, args.seq_len, args.batch, args.dp))


if __name__ == "__main__":
    main()
