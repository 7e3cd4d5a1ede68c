"""`python -m nano_vllm.serve` — an OpenAI-compatible server over one nano_vllm engine (a Hydra app).

    python -m nano_vllm.serve                                   # the tiny preset on 127.0.0.1:8000
    python -m nano_vllm.serve model=/path/to/Qwen3-0.6B port=8080 host=0.0.0.0 engine.max_model_len=8192
    curl localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 16, "stream": true}'
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from nano_vllm.config import EngineConfig, engine_args_from
from nano_vllm.engine import LLMEngine
from nano_vllm.engine_loop import EngineLoop
from nano_vllm.kv_cache import kv_cache_summary
from nano_vllm.performance import with_performance_layers
from nano_vllm.server import make_server


def build(cfg: DictConfig):
    """(http server, engine loop) for a serve config; the loop is started, the server not yet."""
    args = engine_args_from(OmegaConf.to_container(cfg.engine, resolve=True) or {})
    engine = with_performance_layers(LLMEngine(EngineConfig(model=str(cfg.model), **args)))
    loop = EngineLoop(engine).start()
    name = cfg.get("served_model_name") or str(cfg.model)
    return make_server(loop, name, cfg.host, int(cfg.port)), loop


@hydra.main(version_base=None, config_path="configs", config_name="serve")
def main(cfg: DictConfig) -> None:
    server, loop = build(cfg)
    host, port = server.server_address[:2]
    print(f"nano_vllm: serving {cfg.model} as {server.RequestHandlerClass.api.model_name!r} on "
          f"http://{host}:{port} (max_model_len {loop.engine.max_model_len}; {kv_cache_summary(loop.engine)})",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        loop.stop()
        loop.engine.shutdown()


if __name__ == "__main__":
    main()
