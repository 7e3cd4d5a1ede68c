"""`python -m nano_specdec.serve` — nano_vllm's OpenAI-compatible server over a speculative-decoding engine.

The same server as `python -m nano_vllm.serve` (the same routes, limits, drain, API key and every key of
its config, nano_vllm/configs/serve.yaml, which configs/serve.yaml extends), with vLLM's
`speculative_config` (nano_specdec.config: method, num_speculative_tokens, model, prompt_lookup_max/min):

    python -m nano_specdec.serve speculative_config='{method: ngram, num_speculative_tokens: 4}'
    python -m nano_specdec.serve model=/path/to/target port=8080 \
        speculative_config='{method: draft_model, model: /path/to/draft, num_speculative_tokens: 4}'
    curl localhost:8000/v1/completions -d '{"prompt": "def f(x):", "max_tokens": 64, "temperature": 0}'

Without `speculative_config` (null, the default) it serves plain decoding, as vLLM does without
`--speculative-config`. With it, `/metrics` gains vLLM V1's speculative-decoding counters (vllm/v1/
spec_decode/metrics.py; exported with `_total`, as prometheus_client exports every counter):
`vllm:spec_decode_num_drafts` (verifications: sequence-steps that carried drafts),
`vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens` and
`vllm:spec_decode_num_accepted_tokens_per_pos` (label `position`, 0 .. k - 1). Mean acceptance length
(τ) = 1 + accepted / drafts; acceptance rate = accepted / draft tokens.
"""

from __future__ import annotations

import functools
import sys
import traceback
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from prometheus_client.core import CounterMetricFamily

from nano_specdec.engine import SpecDecodeEngine
from nano_specdec.memory import memory_summary
from nano_vllm.engine import LLMEngine
from nano_vllm.serve.engine_loop import EngineLoop
from nano_vllm.serve.server import build as build_plain
from nano_vllm.serve.server import serve_until_stopped

SPEC_COUNTERS = (  # (vLLM's name, its documentation, the stats field)
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_verifications"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "num_accepted_tokens"),
)


class SpecDecodeCollector:
    """vLLM's spec_decode counters of one engine, read at scrape time from its `spec_decode_stats`
    (plain integers and a list the engine thread only grows: a scrape may mix two adjacent steps)."""

    def __init__(self, engine: SpecDecodeEngine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.k = engine.speculative_config.num_speculative_tokens

    def collect(self):
        stats, labels = self.engine.spec_decode_stats, [self.model_name]
        for name, doc, field in SPEC_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, getattr(stats, field))
            yield family
        by_pos = list(stats.accepted_by_position)
        by_pos += [0] * (self.k - len(by_pos))
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.",
                                     labels=["model_name", "position"])
        for pos, n in enumerate(by_pos):
            family.add_metric([*labels, str(pos)], n)
        yield family


def speculative_config_of(cfg: DictConfig) -> dict[str, Any] | None:
    """The config's `speculative_config` as a plain dict (None: plain decoding); checked by the engine."""
    value = cfg.get("speculative_config")
    if value is None:
        return None
    if not isinstance(value, DictConfig):
        raise TypeError("speculative_config must be a mapping such as '{method: ngram, "
                        f"num_speculative_tokens: 4}}' or null, got {value!r}")
    return OmegaConf.to_container(value, resolve=True)


def build(cfg: DictConfig):
    """(http server, engine loop) of nano_vllm.serve's `build` with a SpecDecodeEngine when the config
    has a `speculative_config`, whose counters the server's `/metrics` then exports. A bad
    speculative_config fails before the port is bound or the model loaded."""
    spec = speculative_config_of(cfg)
    if spec is None:
        return build_plain(cfg)
    from nano_specdec.config import SpeculativeConfig

    SpeculativeConfig.of(spec)  # every key and value checked before anything is built
    server, loop = build_plain(cfg, functools.partial(SpecDecodeEngine, speculative_config=spec))
    server.api.metrics.registry.register(SpecDecodeCollector(loop.engine, server.api.model_name))
    return server, loop


def describe(cfg: DictConfig, server, loop: EngineLoop) -> str:
    """The start-up line: address, the speculative config, the target's and the draft's memory."""
    engine: LLMEngine = loop.engine
    host, port = server.server_address[:2]
    key = "; /v1 needs an API key" if server.requires_api_key else ""
    spec = getattr(engine, "speculative_config", None)
    how = "plain decoding" if spec is None else f"speculative decoding {spec}"
    return (f"nano_specdec: serving {cfg.model} as {server.api.model_name!r} on http://{host}:{port} with "
            f"{how} (max_model_len {engine.max_model_len}; {memory_summary(engine)}; layers: "
            f"{', '.join(engine.layers_applied) or 'none'}{key})")


@hydra.main(version_base=None, config_path="configs", config_name="serve")
def main(cfg: DictConfig) -> None:
    try:
        serve(cfg)
    except Exception:  # Hydra's report would print the overrides, api_key=... among them
        traceback.print_exc()
        sys.exit(1)


def serve(cfg: DictConfig) -> None:
    server, loop = build(cfg)
    serve_until_stopped(server, loop, describe(cfg, server, loop), "nano_specdec")


if __name__ == "__main__":
    main()
