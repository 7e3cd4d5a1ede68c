"""nano_vllm: vLLM / PagedAttention (Kwon et al., SOSP 2023, arXiv 2309.06180) in a package you read in an
afternoon — a paged KV cache with prefix caching, a continuous-batching scheduler with chunked prefill and
preemption by recomputation, a model runner with device sampling, an offline `LLM` API; beside it the
performance layers (layers/: CUDA graphs, overlapped scheduling, fused kernels), an OpenAI-compatible
server (serve/) and the nano-vllm benchmark (bench/).

    from nano_vllm import LLM, SamplingParams
    llm = LLM("qwen3-0.6b")                      # a shared.config preset (random weights) or an HF checkpoint dir
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=16))[0]
    print(out.text, out.token_ids)

Fast by default: every performance layer that is present and applies runs (they load on first use, see
nano_vllm.config.REGISTRY); `LLM("qwen3-0.6b", performance_layers=False)` runs the paper path alone.
"""

from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLM, LLMEngine
from nano_vllm.outputs import CompletionOutput, RequestOutput
from nano_vllm.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
