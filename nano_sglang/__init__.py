"""nano_sglang: SGLang (Zheng et al., arXiv 2312.07104) over nano_vllm — RadixAttention (a radix tree over
the paged KV pool), cache-aware scheduling, the frontend language, and constrained decoding with a
compressed FSM and jump-forward.

    import nano_sglang as sgl
    runtime = sgl.Runtime("tiny")                       # SGLEngine on its own thread
    @sgl.function
    def f(s, q):
        s += sgl.user(q) + sgl.assistant(sgl.gen("a", max_tokens=8))
    print(f.run(q="Hi", backend=sgl.RuntimeBackend(runtime))["a"])
"""

from nano_sglang.backend import OpenAIBackend, Runtime, RuntimeBackend
from nano_sglang.engine import SGLEngine
from nano_sglang.lang import ProgramState, assistant, function, gen, select, system, user
from nano_sglang.radix_cache import RadixCache
from nano_sglang.scheduler import CacheAwareConfig

__all__ = ["CacheAwareConfig", "OpenAIBackend", "ProgramState", "RadixCache", "Runtime", "RuntimeBackend",
           "SGLEngine", "assistant", "function", "gen", "select", "system", "user"]
