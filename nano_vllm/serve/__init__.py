"""nano_vllm's serving stack: `python -m nano_vllm.serve` (an OpenAI-compatible HTTP server, configs/serve.yaml).

* `engine_loop.py` — `EngineLoop`: one thread steps the engine; callers add requests and read streams;
* `server.py` — the FastAPI app (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`,
  `/metrics`) over an EngineLoop, and `build` (engine, loop and server from a serve config);
* `protocol.py` — the request bodies (pydantic) and OpenAI's error shape;
* `http_server.py` — uvicorn with limits, timeouts and a graceful drain;
* `server_metrics.py` — the Prometheus metrics;
* `__main__.py` — the Hydra app.
"""
