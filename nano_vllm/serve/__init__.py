"""nano_vllm's serving stack: `python -m nano_vllm.serve` (an OpenAI-compatible HTTP server, configs/serve.yaml).

* `engine_loop.py` — `EngineLoop`: one thread steps the engine; callers add requests and read streams;
* `server.py` — the FastAPI app (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`,
  `/metrics`) over an EngineLoop, and `build` (engine, loop and server from a serve config);
* `protocol.py` — the request bodies (pydantic) and OpenAI's error shape;
* `request_prep.py` — a request body to prompt ids and sampling params, bounded, off the asyncio loop;
* `http_server.py` — uvicorn with limits, timeouts (a first-byte timeout among them) and a graceful drain;
* `auth.py` — the API key (`api_key`, `api_key_file`, NANO_VLLM_API_KEY) every `/v1` path needs once set;
* `server_metrics.py` — the Prometheus metrics;
* `__main__.py` — the Hydra app.
"""
