"""nano_vllm: vLLM / PagedAttention (Kwon et al., SOSP 2023, arXiv 2309.06180) in a package you read in an
afternoon — a paged KV cache with prefix caching, a continuous-batching scheduler with chunked prefill and
preemption by recomputation, a model runner with CUDA graphs and device sampling, an offline `LLM` API,
an OpenAI-compatible server and the nano-vllm benchmark.

    from nano_vllm import LLM, SamplingParams
    llm = LLM("qwen3-0.6b")                      # a shared.config preset (random weights) or an HF checkpoint dir
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=16))[0]
    print(out.text, out.token_ids)
"""

from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLM, LLMEngine
from nano_vllm.outputs import CompletionOutput, RequestOutput
from nano_vllm.performance import register_layers
from nano_vllm.sampling_params import SamplingParams

# The performance layers register into the paper path's hooks (nano_vllm.performance lists them; delete
# this line and every step runs the paper path alone: same tokens, slower).
register_layers()

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
