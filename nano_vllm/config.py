"""`EngineConfig`: the engine arguments of `LLM(model, **engine_args)`, vLLM's names, checked once here;
and `REGISTRY`, the places where the performance layers (nano_vllm/layers/) plug into the paper path.

The paper path names three extension points; each layer module registers into them when it is imported,
and the registry imports every module it lists on first use (nano_flashattn.registry):

* "runner" — `hook(runner)`, applied to each new `ModelRunner` once its model is loaded, before the KV
  cache is sized (on every tensor-parallel rank: each builds its runner from the same EngineConfig);
* "graphs" — `hook(runner)`, applied once the KV cache is allocated: it appends the CUDA graphs `run`
  replays to `runner.cudagraphs`;
* "engine" — `hook(engine)`, applied to each new `LLMEngine` once it is built.

Fast by default: a layer runs wherever it is present and applies (its predicate: most apply on CUDA
only). `performance_layers=False` runs the paper path alone; a layer switch set to True asks for its layer
and is an error where the layer is missing (`LAYER_SWITCHES`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from nano_flashattn.registry import Registry, performance_layers
from shared.config import PRESETS, ModelConfig

# In load order, which is the order their hooks run: the GEMV swaps the projections fusion made.
REGISTRY = Registry("nano_vllm", points=("runner", "graphs", "engine"),
                    modules=("cudagraph", "fused", "gemv", "fused_decode", "fused_sampling", "overlap",
                             "warmup"))
# EngineConfig's layer switches and the layer module each asks for when set (True, or a row count > 0).
LAYER_SWITCHES = {"async_scheduling": "overlap", "fused_projections": "fused", "fused_decode": "fused_decode",
                  "fused_sampling": "fused_sampling", "gemv_max_tokens": "gemv"}

# kv_cache_dtype -> the cache's element type (None: the model's dtype; KIVI's blocks are bytes, nano_vllm.kivi)
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "kivi2": torch.uint8, "kivi4": torch.uint8}
KIVI_BITS = {"kivi2": 2, "kivi4": 4}  # bits per code
KIVI_GROUP_SIZE = 32  # KIVI's G (§4: 32 for every model it evaluates)
KIVI_RESIDUAL = 128  # KIVI's R (§4: 128)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


@dataclass
class EngineConfig:
    """Everything the engine needs besides the model weights.

    model: an HF checkpoint directory (Llama / Qwen2 / Qwen3) or a shared.config preset name (random weights).
    device: "cuda" / "cuda:1" / "cpu"; None picks CUDA when available.
    dtype: "auto" (bf16 on CUDA, fp32 on CPU), or bfloat16 / float16 / float32.
    max_num_seqs: most sequences in one step (the decode batch; 512, nano-vllm's default).
    max_num_batched_tokens: the token budget of one step (prefill chunks + decodes).
    max_model_len: longest sequence (prompt + output); None: the model's max_position_embeddings, at most 4096.
    block_size: tokens per KV block (a power of two >= 16, what the paged kernels accept).
    gpu_memory_utilization: fraction of the GPU memory the engine may use (weights + activations + KV cache).
    num_kv_blocks / kv_cache_memory_bytes: fix the KV cache size instead (the only way on a CPU; default
        there: room for max_num_seqs full sequences, at most 1 GiB).
    enforce_eager: never capture CUDA graphs (vLLM's name).
    mixed_cudagraph_sizes: token counts at which steps that are not pure decode (prefill chunks, short
        extends such as nano_sglang's jump-forward, decodes mixed with either) are also captured as CUDA
        graphs; a step of up to the largest size is padded to the next one instead of running eagerly
        (vLLM's cudagraph capture sizes cover mixed steps the same way). Empty: such steps run eagerly.
        None: the CUDA-graph layer's default (layers/cudagraph.py: 128-2048 tokens within
        max_num_batched_tokens, on one device; nano_sglang's Runtime sets 64-512, jump-forward's extends).
    enable_prefix_caching: reuse KV blocks of identical prefixes across requests (hash of full blocks).
    enable_chunked_prefill: split long prompts across steps and mix them with decodes (Sarathi-style).
    tensor_parallel_size: number of GPUs (processes) the model is sharded over (§4.6 of the paper).
    seed: seed of the random weights of a preset and of unseeded sampling.
    max_logprobs: the most log-probabilities a request may ask for per token (`SamplingParams.logprobs`,
        `prompt_logprobs`; vLLM's name and default, 20).
    quantization: vLLM's name: quantize a 16-bit model (checkpoint or preset) on the fly by a method that
        needs no calibration — "rtn-w4" (AWQ's W4A16 g128 format, round to nearest), "naive-w8a8" (INT8
        weights and per-token activations), "naive-fp8" (the same in e4m3). None: the model as it is; a
        checkpoint whose config.json has a `quantization_config` (AWQ / AutoAWQ GEMM, SmoothQuant W8A8) is
        served quantized by itself. Both go through nano_quant, imported only then.
    kv_cache_dtype: vLLM's name: "auto" (K/V in the model's dtype) or "fp8" (E4M3 codes, one byte an
        element, so the same memory holds 2x the tokens of bf16; written by nano_flashattn's
        `store_kv_fp8`, read back as code x scale with one fp32 scale per layer for K and for V, 1.0 as
        in vLLM for a model without calibrated scales), or KIVI's "kivi2" / "kivi4" (arXiv 2402.02750:
        2- / 4-bit codes, keys per channel over groups of `kv_cache_group_size` tokens, values per token
        over groups of that many channels, fp16 scale and zero per group; each sequence's last, not yet
        full key group stays in 16 bits; nano_vllm.kivi). KIVI runs on one device, without the mixed-step
        CUDA graphs (its prefill steps dequantize pages; decode steps are captured).
    kv_cache_group_size: KIVI's group size G, a power of two that divides block_size (a block holds
        whole key groups) and the model's head_dim; None: 32 (KIVI's), or block_size when that is 16.
    kv_cache_residual: KIVI's residual window R (§3.3): each sequence's newest R values, and its keys
        from the group holding the R-th newest on, read from a 16-bit copy kept beside the blocks
        (`nano_flashattn.kivi.KIVIWindow`); None: 128 (KIVI's); 0: none beyond the open key group.

    Performance layers (nano_vllm/layers/), each the same tokens faster. None: on where the layer is
    present and applies (on CUDA), True: asked for (ValueError if the layer is missing), False: off.
    performance_layers: False runs the paper path alone — no layer of nano_vllm, nano_flashattn or
        nano_quant, no CUDA graph, no warm-up (`nano_flashattn.registry.performance_layers(False)` around
        the engine's construction and every step).
    async_scheduling: overlapped scheduling (vLLM's name; layers/overlap.py): the host schedules and
        prepares step t+1 while the device runs step t. One device only (None: off with
        tensor_parallel_size > 1).
    fused_projections: q/k/v as one matmul and gate/up as one, fused at load time (layers/fused.py).
    fused_sampling: sampling in one pass over the logits, seeds by counter (layers/fused_sampling.py).
    gemv_max_tokens: steps of at most this many rows run their linear layers through the split-K Triton
        GEMV on CUDA (layers/gemv.py; at most 16), cuBLAS above; 0 = cuBLAS always; None: 1 on CUDA.
    fused_decode: one-row decode steps through a fused decoder layer (layers/fused_decode.py): five
        kernels a layer (norm + QKV + RoPE + KV write, attention, o_proj + residual, norm + gate/up +
        SwiGLU, down + residual), each reading its weights before it waits for its predecessor.
    """

    model: str = "tiny"
    device: str | None = None
    dtype: str = "auto"
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = False
    mixed_cudagraph_sizes: tuple[int, ...] | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    seed: int = 0
    max_logprobs: int = 20
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_group_size: int | None = None
    kv_cache_residual: int | None = None
    performance_layers: bool = True
    async_scheduling: bool | None = None
    fused_projections: bool | None = None
    fused_sampling: bool | None = None
    gemv_max_tokens: int | None = None
    fused_decode: bool | None = None

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) \
                or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an int >= 0, got {self.max_logprobs!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self._check_layers()
        self._check_quantization()
        if self.async_scheduling is True and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size 1 (the workers would not see the "
                             "tokens of the step in flight); pass async_scheduling=False")
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        try:
            sizes = () if self.mixed_cudagraph_sizes is None else tuple(self.mixed_cudagraph_sizes)
        except TypeError:
            raise ValueError(f"mixed_cudagraph_sizes must be a sequence of ints, got "
                             f"{self.mixed_cudagraph_sizes!r}") from None
        if any(not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= self.max_num_batched_tokens
               for v in sizes):
            raise ValueError(f"mixed_cudagraph_sizes must be ints in [1, max_num_batched_tokens "
                             f"({self.max_num_batched_tokens})], got {self.mixed_cudagraph_sizes!r}")
        if self.mixed_cudagraph_sizes is not None:
            self.mixed_cudagraph_sizes = tuple(sorted(set(sizes)))
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16 (the paged kernels' page size), "
                             f"got {self.block_size}")
        self._check_kv_cache_dtype()
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence must be able to decode in one step")

    def _check_layers(self) -> None:
        """The switches' types; a switch that asks for a layer (True, or gemv_max_tokens > 0) needs the layer
        present and `performance_layers` on."""
        if not isinstance(self.performance_layers, bool):
            raise TypeError(f"performance_layers must be a bool, got {self.performance_layers!r}")
        for name in LAYER_SWITCHES.keys() - {"gemv_max_tokens"}:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool or None, got {getattr(self, name)!r}")
        rows = self.gemv_max_tokens
        if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool)):
            raise TypeError(f"gemv_max_tokens must be an int or None, got {rows!r}")
        if rows is not None and not 0 <= rows <= 16:
            raise ValueError(f"gemv_max_tokens must be in [0, 16] (the GEMV's rows), got {rows}")
        for switch, module in LAYER_SWITCHES.items():
            value = getattr(self, switch)
            if value is None or value is False or value == 0:
                continue
            if not self.performance_layers:
                raise ValueError(f"{switch}={value!r} asks for the performance layer {module}, but "
                                 "performance_layers=False runs the paper path alone; drop one of them")
            REGISTRY.require(module, f"{switch}={value!r}")

    def wants(self, switch: str, device: torch.device) -> bool:
        """Whether the layer behind `switch` runs on `device`: asked for (True, or a count > 0), or left to
        the default (None) on CUDA, where the layers pay; `performance_layers=False` turns every one off."""
        value = getattr(self, switch)
        return self.performance_layers and (bool(value) if value is not None else device.type == "cuda")

    def layers_context(self) -> AbstractContextManager[None]:
        """The context the engine builds and steps in: nano_flashattn's switch, set as
        `performance_layers` says, so that every lookup of a layer (in every package) follows it."""
        return performance_layers(self.performance_layers)

    def _check_quantization(self) -> None:
        """`quantization` is None or a method nano_quant runs on the fly; a quantized model runs on one
        device (nano_quant's layers are not sharded for tensor parallelism)."""
        if self.quantization is not None:
            import_nano_quant(f"quantization={self.quantization!r}").check_quantization(self.quantization,
                                                                                      self.model)
        if self.tensor_parallel_size > 1:
            what = (f"quantization={self.quantization!r}" if self.quantization is not None else
                    f"the quantized checkpoint {self.model!r}" if checkpoint_quantization(self.model) is not None
                    else None)
            if what is not None:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} is not supported with "
                                 f"{what}: nano_quant's quantized layers are not sharded; use "
                                 "tensor_parallel_size=1")

    def _check_kv_cache_dtype(self) -> None:
        """`kv_cache_dtype` is one of KV_CACHE_DTYPES; `kv_cache_group_size` is KIVI's only, and divides
        `block_size`; KIVI runs on one device and turns the mixed-step CUDA graphs off."""
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        group, bits = self.kv_cache_group_size, KIVI_BITS.get(self.kv_cache_dtype)
        if bits is None:
            for name in ("kv_cache_group_size", "kv_cache_residual"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}={getattr(self, name)!r} is KIVI's (kv_cache_dtype kivi2 / "
                                     f"kivi4); kv_cache_dtype={self.kv_cache_dtype!r} takes none")
            return
        if self.kv_cache_residual is None:
            self.kv_cache_residual = KIVI_RESIDUAL
        if type(self.kv_cache_residual) is not int or self.kv_cache_residual < 0:
            raise ValueError(f"kv_cache_residual must be an int >= 0 (KIVI's window R), got "
                             f"{self.kv_cache_residual!r}")
        if group is None:
            group = self.kv_cache_group_size = min(KIVI_GROUP_SIZE, self.block_size)
        if type(group) is not int or group < 32 // bits or group & (group - 1):
            raise ValueError(f"kv_cache_group_size must be a power of two >= {32 // bits} (whole int32 "
                             f"words of {bits}-bit codes), got {group!r}")
        if self.block_size % group:
            raise ValueError(f"kv_cache_group_size ({group}) must divide block_size ({self.block_size}): "
                             f"a KIVI block holds whole key groups")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} runs on one device; got "
                             f"tensor_parallel_size={self.tensor_parallel_size}")
        if self.mixed_cudagraph_sizes:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} captures decode steps only: its "
                             f"prefill steps dequantize pages; drop mixed_cudagraph_sizes "
                             f"{self.mixed_cudagraph_sizes!r}")
        self.mixed_cudagraph_sizes = ()

    @property
    def kivi_bits(self) -> int | None:
        """KIVI's bits per code (2 or 4), None for a 16-bit or FP8 cache."""
        return KIVI_BITS.get(self.kv_cache_dtype)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's element type: `kv_cache_dtype`'s, or the model's for "auto"."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def check_args(cls, args: Mapping[str, Any]) -> None:
        """Raise TypeError naming every key of `args` that is not an engine argument."""
        unknown = sorted(set(args) - cls.field_names())
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid: {sorted(cls.field_names())}")

    def resolve_max_model_len(self, model_config: ModelConfig) -> int:
        """`max_model_len`, defaulted to min(max_position_embeddings, 4096), checked against the model and,
        without chunked prefill, against the token budget (a longer prompt could never be scheduled)."""
        max_len = self.max_model_len or min(model_config.max_position_embeddings, 4096)
        if max_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_len}) exceeds the model's max_position_embeddings "
                             f"({model_config.max_position_embeddings})")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens})"
                             f" must be >= max_model_len ({max_len}), or a long prompt could never run")
        return max_len


def checkpoint_quantization(model: str) -> dict[str, Any] | None:
    """The `quantization_config` of a checkpoint directory's config.json, as written; None for a float
    checkpoint, a preset, or a path without config.json (loading the model reports that)."""
    path = Path(model) / "config.json"
    if model in PRESETS or not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("quantization_config")
    except (json.JSONDecodeError, AttributeError):
        return None  # not a JSON object: shared.config's loader names the file


def import_nano_quant(what: str) -> ModuleType:
    """nano_quant, imported only for a quantized model: a copy of nano_vllm that never serves one runs
    without it. A missing nano_quant is an ImportError naming what asked for it."""
    try:
        import nano_quant
    except ImportError as e:
        raise ImportError(f"{what} needs the nano_quant package (nano_quant/ beside nano_vllm/; it stands on "
                          f"shared/ alone): {e}") from e
    return nano_quant


def apply_layers(point: str, target: Any) -> list[str]:
    """Apply every layer hook registered at `point` ("runner", "graphs" or "engine") that applies to
    `target`, in order; returns the names of their modules (what the engine reports as applied)."""
    names = []
    for hook in REGISTRY.active(point, target):
        hook(target)
        names.append(hook.__module__.rpartition(".")[2])
    return names


def engine_args_from(node: Mapping[str, Any]) -> dict[str, Any]:
    """The engine arguments of a dict (e.g. a Hydra node), dropping nulls so defaults apply; an unknown key
    raises TypeError (`EngineConfig.check_args`)."""
    EngineConfig.check_args(node)
    return {k: v for k, v in node.items() if v is not None}
