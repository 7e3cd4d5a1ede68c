"""Where the frontend's primitives run: nano_sglang.lang hands each `gen`, `select` and fork hint to a
backend (`generate`, `score_choices`, `cache_prefix`).

* `runtime.py` — `Runtime`: an `SGLEngine` stepped by its own thread (nano_vllm's `EngineLoop`), which
  every program state's thread submits to, so concurrent programs share steps and the radix tree;
* `runtime_backend.py` — `RuntimeBackend`: the primitives on a `Runtime` (tokenizes, submits, scores
  `select`'s choices, sends fork hints);
* `openai_backend.py` — `OpenAIBackend`: `gen` and fork hints on any OpenAI-compatible server.
"""

from nano_sglang.backend.openai_backend import OpenAIBackend
from nano_sglang.backend.runtime import Handle, Runtime
from nano_sglang.backend.runtime_backend import RuntimeBackend

__all__ = ["Handle", "OpenAIBackend", "Runtime", "RuntimeBackend"]
