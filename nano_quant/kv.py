"""The quantized KV cache, as plain torch: KIVI's 2- and 4-bit codes and vLLM's FP8, the specification the
kernels and the engines' cache are tested against. Tensors are one layer's (tokens, kv_heads, head_dim).

* **KIVI** (Liu et al., ICML 2024, arXiv 2402.02750, §3): asymmetric b-bit round to nearest over a group,
  `scale = (max - min) / (2^b - 1)`, `zero = min` (both fp16), `code = clamp(round((x - zero) / scale),
  0, 2^b - 1)`, read back as `code * scale + zero`. §3.2's finding decides the group's axis: keys have
  outlier *channels*, so a key group is G tokens along one channel (per-channel: one scale and zero per
  (group of G tokens, head, channel)); values are quantized per token, a group is G channels of one token.
* **The residual window** (§3.3, Algorithm 1): the newest R tokens stay in 16 bits (G = 32, R = 128).
  Values leave the window token by token; keys only a whole group of G tokens at a time, once all G are
  older than the newest R (so R to R + G - 1 keys are 16-bit). Algorithm 1 flushes the key residual R
  tokens at a time (0 to R - 1 keys in 16 bits); the codes are the same G-token groups, but here both K
  and V of the newest R tokens are always exact and a paged cache writes one group at a time.
  `KIVICache.append` is both halves of Algorithm 1: the prompt (prefill) and each new token (decoding).
* **Packing**: codes go into int32 words, 32 / b per word (16 at 2 bits, 8 at 4 bits), code i of a word at
  bits [b·i, b·i + b). A word packs consecutive codes along its group's axis (key words: 32 / b tokens of
  one channel; value words: 32 / b channels of one token), so no word straddles two groups.
* **FP8** (vLLM's `kv_cache_dtype="fp8"`): E4M3 with one fp32 scale per tensor or per KV head, `scale =
  amax / 448`, quantized on write and dequantized on read. The scale is fixed before the cache is written
  (from calibration data; a later value beyond 448 · scale clamps). In E4M3's normal range a code's
  relative error (2^-4) does not depend on the scale, so per-token scales would add 4 bytes a token and
  head for headroom alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
KV_CACHE_DTYPES = {"auto": 16, "fp8": 8, "kivi2": 2, "kivi4": 4}  # name -> bits per element
KEY_AXIS, VALUE_AXIS = 0, -1  # a group runs along: keys' tokens (per channel), values' channels


class KVCacheSpec(NamedTuple):
    """A parsed `kv_cache_dtype`: bits per element; for KIVI the group size G and residual R (else 0)."""
    name: str
    bits: int
    group_size: int = 0
    residual: int = 0


def parse_kv_cache_dtype(value: str, block_size: int | None = None, group_size: int = 32,
                         residual: int = 128) -> KVCacheSpec:
    """"auto" (the model's 16 bits) | "fp8" | "kivi2" | "kivi4" -> a `KVCacheSpec`; anything else is a
    ValueError naming the argument. A KIVI group fills whole int32 words (16 codes at 2 bits, 8 at 4)
    and divides the block size, so a block holds whole key groups."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {value!r}")
    bits = KV_CACHE_DTYPES[value]
    if bits >= 8:
        return KVCacheSpec(value, bits)
    if type(group_size) is not int or group_size <= 0 or group_size % (32 // bits):
        raise ValueError(f"group_size ({group_size!r}) must be a positive multiple of {32 // bits}")
    if block_size is not None and block_size % group_size:
        raise ValueError(f"group_size ({group_size}) must divide block_size ({block_size})")
    if type(residual) is not int or residual < 0:
        raise ValueError(f"residual must be a non-negative int, got {residual!r}")
    return KVCacheSpec(value, bits, group_size, residual)


def kv_bytes_per_token(spec: KVCacheSpec, num_layers: int, num_kv_heads: int,
                       head_dim: int) -> float:
    """Bytes one cached token costs, K and V of every layer: its codes, plus for KIVI its share of the
    fp16 scale and zero of each group (4 bytes per G elements, amortised); "auto" counts 16 bits, FP8's
    per-tensor scales are a constant. Not counted: KIVI's 16-bit residual window, per sequence at most
    R + G - 1 keys and R values, 2 · head_dim · num_kv_heads · num_layers bytes per key or value."""
    overhead = 4 * head_dim / spec.group_size if spec.group_size else 0.0
    return 2 * num_layers * num_kv_heads * (head_dim * spec.bits / 8 + overhead)


def quantize(x: Tensor, bits: int, group_size: int, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """KIVI's asymmetric round to nearest over groups of `group_size` consecutive elements along `dim`:
    (the codes packed along `dim` by `pack`, scale, zero: fp16, shaped like x with `dim` divided by
    the group size)."""
    groups = x.float().movedim(dim, -1).unflatten(-1, (-1, group_size))  # (..., n / G, G)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    # fp16 scale and zero point; a constant group gets a tiny scale: code 0, exact
    scale, zero = ((hi - lo) / (2**bits - 1)).clamp(min=1e-6).half(), lo.half()
    codes = ((groups - zero) / scale).round().clamp(0, 2**bits - 1).flatten(-2).movedim(-1, dim)
    return pack(codes, bits, dim), scale[..., 0].movedim(-1, dim), zero[..., 0].movedim(-1, dim)


def dequantize(words: Tensor, scale: Tensor, zero: Tensor, bits: int, group_size: int, dim: int,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """The inverse of `quantize` up to its rounding: `code * scale + zero`, computed in fp32 (each
    group's scale and zero repeated over its elements)."""
    scale, zero = (t.float().repeat_interleave(group_size, dim) for t in (scale, zero))
    return (unpack(words, bits, dim).float() * scale + zero).to(dtype)


def pack(codes: Tensor, bits: int, dim: int = -1) -> Tensor:
    """b-bit codes -> int32 words along `dim` (32 / b codes a word, code i at bits [b·i, b·i + b))."""
    fields = codes.to(torch.int64).movedim(dim, -1).unflatten(-1, (-1, 32 // bits))
    shifts = torch.arange(32 // bits, device=codes.device) * bits
    words = (fields << shifts).sum(-1)  # disjoint bit fields: the sum is a bitwise or
    # two's complement: a word whose top code sets bit 31 is negative as an int32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim)


def unpack(words: Tensor, bits: int, dim: int = -1) -> Tensor:
    """The inverse of `pack`: int32 words -> uint8 codes, 32 / b times longer along `dim`."""
    shifts = torch.arange(32 // bits, device=words.device, dtype=torch.int32) * bits
    codes = (words.movedim(dim, -1)[..., None] >> shifts) & (2**bits - 1)  # mask: drops sign bits
    return codes.flatten(-2).movedim(-1, dim).to(torch.uint8)


class KIVICache:
    """One layer's K and V under KIVI (Algorithm 1): packed groups (words, scale, zero) in the order they
    left the residual window, then the window itself in 16 bits."""

    def __init__(self, spec: KVCacheSpec):
        if not spec.group_size:
            raise ValueError(f"spec must be a KIVI spec (kivi2 / kivi4), got {spec.name!r}")
        self.spec = spec
        # (words, scale, zero) per group: key words (n / (32 / b), H, D), value words (n, H, D / (32 / b))
        self.key_groups, self.value_groups = [], []
        self.key_residual = self.value_residual = None  # then (tokens, H, D): the newest, 16 bits

    def append(self, k: Tensor, v: Tensor) -> None:
        """Add new tokens' k, v (tokens, kv_heads, head_dim): the prompt (Algorithm 1's prefill: all but
        the residual is quantized) or a decoded token (decoding: quantize what leaves the window)."""
        G, R, bits = self.spec.group_size, self.spec.residual, self.spec.bits
        if k.dim() != 3 or k.shape != v.shape or k.shape[-1] % G:
            raise ValueError(f"k, v must be (tokens, kv_heads, head_dim) of one shape, head_dim a "
                             f"multiple of {G}; got {tuple(k.shape)} and {tuple(v.shape)}")
        if self.key_residual is not None:  # the new tokens join the 16-bit window
            k, v = torch.cat([self.key_residual, k]), torch.cat([self.value_residual, v])
        n = (len(k) - R) // G * G  # keys: the whole groups older than the newest R
        if n > 0:
            self.key_groups.append(quantize(k[:n], bits, G, KEY_AXIS))
            k = k[n:]
        n = len(v) - R  # values: every token older than the newest R
        if n > 0:
            self.value_groups.append(quantize(v[:n], bits, G, VALUE_AXIS))
            v = v[n:]
        self.key_residual, self.value_residual = k, v

    def dequantize(self) -> tuple[Tensor, Tensor]:
        """Every cached K and V (tokens, kv_heads, head_dim) in the window's dtype, as attention reads
        them: the groups dequantized in the order they were written, then the 16-bit window."""
        if self.key_residual is None:
            raise ValueError("KIVICache.dequantize: the cache is empty (append K and V first)")
        bits, G, dtype = self.spec.bits, self.spec.group_size, self.key_residual.dtype
        k = [dequantize(*g, bits, G, KEY_AXIS, dtype) for g in self.key_groups]
        v = [dequantize(*g, bits, G, VALUE_AXIS, dtype) for g in self.value_groups]
        return torch.cat([*k, self.key_residual]), torch.cat([*v, self.value_residual])


def fp8_scale(x: Tensor, per_head: bool = False) -> Tensor:
    """vLLM's FP8 KV scale, amax / 448 in fp32: one for x (tokens, kv_heads, head_dim), or per head
    (shaped (1, kv_heads, 1) to broadcast)."""
    amax = x.abs().amax(dim=(0, 2), keepdim=True) if per_head else x.abs().amax()
    return (amax.float() / FP8_MAX).clamp(min=1e-12)


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale in E4M3, clamped first (a quotient a rounding step above 448 must not become NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (q.float() * scale).to(dtype)
