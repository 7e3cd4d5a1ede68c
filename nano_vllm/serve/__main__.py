"""`python -m nano_vllm.serve` — an OpenAI-compatible server over one nano_vllm engine (a Hydra app).

    python -m nano_vllm.serve                                   # the tiny preset on 127.0.0.1:8000
    python -m nano_vllm.serve model=/path/to/Qwen3-0.6B port=8080 host=0.0.0.0 engine.max_model_len=8192
    python -m nano_vllm.serve server.max_body_bytes=1048576 server.drain_timeout_s=10
    python -m nano_vllm.serve performance_layers=false          # the paper path alone
    NANO_VLLM_API_KEY=... python -m nano_vllm.serve host=0.0.0.0   # /v1 needs `Authorization: Bearer ...`
    curl localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 16, "stream": true}'

SIGTERM (or Ctrl-C) drains: new requests get 503, requests in flight finish within `server.drain_timeout_s`;
a second signal stops at once. The API key (`api_key=`, `api_key_file=` or NANO_VLLM_API_KEY; serve/auth.py)
is never printed: a failed start reports its traceback here, not through Hydra, which would print the
command line's overrides.
"""

from __future__ import annotations

import sys
import traceback

import hydra
from omegaconf import DictConfig

from nano_vllm.kv_cache import kv_cache_summary
from nano_vllm.serve.server import build, serve_until_stopped


@hydra.main(version_base=None, config_path="../configs", config_name="serve")
def main(cfg: DictConfig) -> None:
    try:
        serve(cfg)
    except Exception:  # Hydra's report would print the overrides, api_key=... among them
        traceback.print_exc()
        sys.exit(1)


def serve(cfg: DictConfig) -> None:
    server, loop = build(cfg)
    host, port = server.server_address[:2]
    key = "; /v1 needs an API key" if server.requires_api_key else ""
    serve_until_stopped(server, loop, f"nano_vllm: serving {cfg.model} as {server.api.model_name!r} on "
                        f"http://{host}:{port} (max_model_len {loop.engine.max_model_len}; "
                        f"{kv_cache_summary(loop.engine.model_runner)}; layers: "
                        f"{', '.join(loop.engine.layers_applied) or 'none'}{key})", "nano_vllm")


if __name__ == "__main__":
    main()
