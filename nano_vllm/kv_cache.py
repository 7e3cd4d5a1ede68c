"""How big the paged KV cache is (vLLM, arXiv 2309.06180, §5), and where the model's weights come from.

The block pool is one tensor of (2, layers, num_blocks + 1, block_size, kv_heads, head_dim) — K and V of
every layer, one scratch block at the end (`ModelRunner.allocate_kv_cache`). Its size comes from, in order:
`num_kv_blocks`; `kv_cache_memory_bytes`; on CUDA, the memory left under `gpu_memory_utilization` once
the weights are loaded and the largest step has been profiled for its peak activation memory (§5); on a
CPU, room for `max_num_seqs` full sequences, at most 1 GiB. Quantized weights (nano_quant) leave that
sizing more memory: `kv_cache_summary` reports both. A block's bytes count the cache's own elements
(`kv_block_bytes`), so an FP8 cache (`kv_cache_dtype="fp8"`, one byte an element) holds 2x the tokens
of a 16-bit one in the same memory.
"""

from __future__ import annotations

import itertools
import math
from typing import Protocol

import torch
import torch.distributed as dist

from nano_vllm.attention import AttentionContext
from nano_vllm.config import EngineConfig, checkpoint_quantization, import_nano_quant
from nano_vllm.kivi import kivi_layout, kivi_tail_bytes
from nano_vllm.sampler import Sampler, SamplingTensors
from nano_vllm.sampling_params import SamplingParams
from shared.checkpoint import load_model
from shared.config import PRESETS, ModelConfig
from shared.model import CausalLM, build_model

CPU_KV_CACHE_BYTES = 1 << 30  # default KV cache budget on a CPU (when not given)


class Runner(Protocol):
    """What the sizing reads of a model runner (nano_vllm.model_runner.ModelRunner, one rank's)."""

    config: EngineConfig
    model_config: ModelConfig
    model: CausalLM
    sampler: Sampler
    device: torch.device
    max_model_len: int
    block_size: int
    block_bytes: int
    num_blocks: int
    tp_size: int
    vocab_size: int
    num_kv_heads: int

    def allocate_kv_cache(self, num_blocks: int) -> None: ...


def load_engine_model(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> CausalLM:
    """An HF checkpoint directory through shared.checkpoint, or a preset with seeded random weights. A
    quantized model comes from nano_quant (imported only then): a checkpoint whose config.json carries a
    `quantization_config` (AWQ W4A16 in AutoAWQ's GEMM layout, ours or AutoAWQ's; SmoothQuant W8A8), or
    a 16-bit model quantized on the fly by `config.quantization` (rtn-w4, naive-w8a8, naive-fp8). Its
    decoder Linears become nano_quant's W8A8Linear / WQLinear_GEMM; everything else is unchanged."""
    quantized = config.quantization is not None or checkpoint_quantization(config.model) is not None
    nano_quant = import_nano_quant(f"serving {config.model!r} quantized") if quantized else None
    if config.model in PRESETS:
        model = build_model(model_config, device=device, dtype=config.torch_dtype, seed=config.seed)
        if nano_quant is not None:
            nano_quant.quantize_model(model, config.quantization, progress=False)
    elif nano_quant is not None:
        model = nano_quant.load_for_inference(config.model, device, config.torch_dtype, config.quantization)
        if config.quantization is None:  # a quantized checkpoint: loaded tensor by tensor, nothing to re-pack
            return model
    else:
        return load_model(config.model, device=device, dtype=config.torch_dtype)
    return compact(model, device)  # built in fp32 and cast, or quantized in place


def compact(model: CausalLM, device: torch.device) -> CausalLM:
    """Re-allocate a model that was converted in place on a GPU (a preset initialised in fp32 and cast, or
    float weights replaced by smaller quantized ones). Each freed tensor leaves a hole beside the new ones
    in its allocator segment, which `torch.cuda.empty_cache` cannot return, and §5's sizing counts every
    byte in use as taken. One round trip through host memory packs the tensors afresh (skipped when the
    host has less free memory than twice the model: the holes are cheaper than an out-of-memory kill)."""
    if device.type != "cuda" or 2 * weight_bytes(model) > host_free_bytes():
        return model
    model.to("cpu")
    torch.cuda.empty_cache()
    return model.to(device)


def host_free_bytes() -> int:
    """Host memory available now without swapping (Linux's MemAvailable; elsewhere 0, which skips `compact`)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (quantized weights, scales and zero points included),
    each storage counted once (tied embeddings share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in itertools.chain(model.parameters(), model.buffers())}
    return sum(storages.values())


def kv_block_bytes(model_config: ModelConfig, block_size: int, num_kv_heads: int,
                   dtype: torch.dtype | EngineConfig) -> int:
    """Bytes of one block across all layers, K and V, elements of `dtype`, the cache's (1 byte for FP8)
    (shared.accounting.kv_cache_bytes' formula). An FP8 cache's per-layer scales are not counted (8 bytes
    a layer, not per block). Given the engine's config, its cache's: for KIVI (kivi2 / kivi4) a token and
    head cost the packed codes and their share of the fp16 scales and zeros (`KIVILayout.width` bytes,
    K and V each); its 16-bit residual is a separate, fixed cost (`kv_side_bytes`)."""
    cfg = model_config
    if isinstance(dtype, EngineConfig) and dtype.kivi_bits is not None:
        width = kivi_layout(dtype, cfg, num_kv_heads).width
        return 2 * cfg.num_hidden_layers * block_size * num_kv_heads * width
    if isinstance(dtype, EngineConfig):
        dtype = dtype.kv_torch_dtype
    return 2 * cfg.num_hidden_layers * block_size * num_kv_heads * cfg.head_dim * dtype.itemsize


def kv_side_bytes(config: EngineConfig, model_config: ModelConfig, num_kv_heads: int) -> int:
    """Bytes the KV cache takes besides its blocks: KIVI's 16-bit residual (one open key group per
    sequence, `kivi.kivi_tail_bytes`); 0 for the other dtypes."""
    if config.kivi_bits is None:
        return 0
    return kivi_tail_bytes(config, model_config, num_kv_heads)


def decide_num_blocks(runner: Runner) -> int:
    """The number of KV blocks of `runner`'s cache (see the module docstring); every tensor-parallel rank
    agrees on the smallest, since a block id must name the same block on all of them. Raises ValueError
    when not even one `max_model_len` sequence fits."""
    cfg, needed = runner.config, math.ceil(runner.max_model_len / runner.block_size)
    # the residual of a KIVI cache comes out of the same memory (on CUDA the profiling pass allocates it:
    # it is counted as used there)
    side = kv_side_bytes(cfg, runner.model_config, runner.num_kv_heads)
    if cfg.num_kv_blocks is not None:
        num = cfg.num_kv_blocks
    elif cfg.kv_cache_memory_bytes is not None:
        num = max(cfg.kv_cache_memory_bytes - side, 0) // runner.block_bytes
    elif runner.device.type == "cuda":
        num = profile_num_blocks(runner)
    else:
        num = min(cfg.max_num_seqs * needed, max(CPU_KV_CACHE_BYTES - side, 0) // runner.block_bytes)
    if runner.tp_size > 1:  # a block id names the same block on every rank: all take the smallest
        num = all_reduce_min(num, runner.device)
    if num < needed:
        raise ValueError(f"the KV cache holds {num} blocks of {runner.block_size} tokens, fewer than one "
                         f"max_model_len ({runner.max_model_len}) sequence needs ({needed}); give it more "
                         f"memory or lower max_model_len")
    return num


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest `value` over the tensor-parallel ranks (torch.distributed's default group)."""
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


@torch.inference_mode()
def profile_num_blocks(runner: Runner) -> int:
    """§5: run the largest step (`max_num_batched_tokens` tokens, then the sampler over `max_num_seqs`
    rows), take its peak activation memory, and give everything else the engine may use to KV blocks."""
    dev, config = runner.device, runner.config
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    tokens = config.max_num_batched_tokens
    seq_len = min(runner.max_model_len, tokens)
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    runner.allocate_kv_cache(1)  # a dummy cache: the profiling pass attends to k, v directly
    ids = torch.zeros(1, tokens, dtype=torch.long, device=dev)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])[None]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    slots = torch.full((tokens,), 0, dtype=torch.long, device=dev)
    ctx = AttentionContext(slot_mapping=slots, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq_len,
                           max_seqlen_k=seq_len)
    hidden = runner.model.model(ids, positions, ctx)
    logits = runner.model.compute_logits(hidden[0, cu[1:] - 1][: config.max_num_seqs])
    rows = logits.shape[0]  # the sampler's vocab-sized temporaries count too
    runner.sampler.sample(logits, SamplingTensors.build([SamplingParams(temperature=1.0, top_k=2)] * rows,
                                                        [None] * rows, runner.vocab_size, dev))
    del hidden, logits, ids, positions, slots, ctx
    torch.cuda.synchronize(dev)
    stats = torch.cuda.memory_stats(dev)
    peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
    torch.cuda.empty_cache()  # so that `used` below counts weights and contexts, not cached activations
    free, total = torch.cuda.mem_get_info(dev)
    used = total - free  # everything on the GPU now, this process's and anyone else's
    budget = total * config.gpu_memory_utilization - used - (peak - current)
    return max(int(budget) // runner.block_bytes, 0)


def kv_cache_summary(r: Runner) -> str:
    """One line of a built runner (`engine.model_runner`): the weights (GiB on rank 0, and their
    quantization), then the KV cache: its dtype, blocks, tokens, GiB (all tensor-parallel ranks), tokens
    per GiB and how many full-length sequences fit. With the weights quantized, what they no longer take
    is what §5's sizing gives to KV blocks; an FP8 cache holds 2x the tokens per GiB of a 16-bit one, a
    KIVI cache's GiB and tokens per GiB count its 16-bit residual too."""
    bs, cfg = r.block_size, r.config
    qcfg = getattr(r.model, "quantization_config", None)
    quantized = str(cfg.torch_dtype).removeprefix("torch.") if qcfg is None else \
        f"quantized: {qcfg.to_dict()}"
    kv_dtype = str(cfg.kv_torch_dtype).removeprefix("torch.")
    side = kv_side_bytes(cfg, r.model_config, r.num_kv_heads) * r.tp_size
    if cfg.kivi_bits is not None:
        kv_dtype = (f"{cfg.kv_cache_dtype}: {cfg.kivi_bits}-bit codes, groups of {cfg.kv_cache_group_size}, "
                    f"window {cfg.kv_cache_residual}, 16-bit residual {_size(side)}")
    total = r.num_blocks * r.block_bytes * r.tp_size + side
    per_gib = round(r.num_blocks * bs * 2**30 / total) if total else 0
    return (f"weights: {_size(weight_bytes(r.model))} ({quantized}); "
            f"KV cache ({kv_dtype}): {r.num_blocks} blocks x {bs} tokens = {r.num_blocks * bs} tokens, "
            f"{_size(total)}, {per_gib} tokens per GiB "
            f"({math.floor(r.num_blocks * bs / r.max_model_len)} full-length sequences)")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
