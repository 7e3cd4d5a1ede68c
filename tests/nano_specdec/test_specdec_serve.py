"""`python -m nano_specdec.serve` through a real HTTP server on loopback (the `tiny` preset): greedy
completions, streamed and not, equal nano_vllm.serve's with prompt lookup and with a draft model; vLLM's
spec_decode counters on /metrics move with the verifications (and are absent without speculation); the
start-up line reports the draft's memory. A bad speculative_config fails before the port is bound, and
(through `nano_specdec.LLM`) before the target loads: nothing is built, nothing queued."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nano_specdec import LLM
from nano_specdec import serve as specdec_serve
from nano_vllm.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = Path(specdec_serve.__file__).parent / "configs"
DEADLINE_S = 120.0
ENGINE = ["engine.device=cpu", "engine.max_model_len=256", "engine.num_kv_blocks=96",
          "engine.max_num_seqs=8"]
NGRAM = "speculative_config={method: ngram, num_speculative_tokens: 3, prompt_lookup_max: 3, " \
        "prompt_lookup_min: 1}"
SELF_DRAFT = "speculative_config={method: draft_model, model: tiny, num_speculative_tokens: 3}"
PROMPTS = ["def f(x):\n    return x\n" * 3, "The quick brown fox jumps. The quick brown fox",
           "import os\nimport sys\n"]


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return hydra_compose(config_name="serve", overrides=["port=0", *ENGINE, *overrides])


class Served:
    """A server of `nano_specdec.serve.build` on a free loopback port, serving in a thread."""

    def __init__(self, *overrides: str):
        self.cfg = compose(*overrides)
        self.srv, self.loop = specdec_serve.build(self.cfg)
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + DEADLINE_S
        while not self.srv.uvicorn.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        c = http.client.HTTPConnection(*self.srv.server_address[:2], timeout=DEADLINE_S)
        c.request(method, path, None if body is None else json.dumps(body),
                  {"Content-Type": "application/json"})
        resp = c.getresponse()
        data = resp.read()
        c.close()
        return resp.status, data

    def complete(self, body: dict) -> dict:
        status, data = self.request("POST", "/v1/completions", body)
        assert status == 200, data
        if not body.get("stream"):
            return json.loads(data)
        events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        return {"text": "".join(c["choices"][0]["text"] for c in chunks),
                "finish_reason": chunks[-1]["choices"][0]["finish_reason"]}

    def metrics(self) -> dict[str, float]:
        """{sample name (with a position label, if any): value} of the spec_decode series."""
        status, data = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for family in text_string_to_metric_families(data.decode()):
            for s in family.samples:
                if s.name.startswith("vllm:spec_decode") and not s.name.endswith("_created"):
                    pos = s.labels.get("position")
                    out[s.name + (f"[{pos}]" if pos is not None else "")] = s.value
        return out

    def stop(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()
        self.thread.join(DEADLINE_S)
        self.loop.stop()
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def plain():
    served = Served()
    yield served
    served.stop()


def texts(served: Served, stream: bool) -> list[tuple[str, str]]:
    out = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "stream": stream}
        got = served.complete(body)
        choice = got if stream else got["choices"][0]
        out.append((choice["text"], choice["finish_reason"]))
    return out


@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "draft_model"])
def test_greedy_completions_equal_nano_vllm_serve_and_the_counters_move(plain, spec):
    served = Served(spec)
    try:
        assert served.metrics() == {f"vllm:spec_decode_{name}_total": 0.0 for name in
                                    ("num_drafts", "num_draft_tokens", "num_accepted_tokens")} | \
            {f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{p}]": 0.0 for p in range(3)}
        for stream in (False, True):
            assert texts(served, stream) == texts(plain, stream)
        m = served.metrics()
        stats = served.loop.engine.spec_decode_stats
        assert m["vllm:spec_decode_num_drafts_total"] == stats.num_verifications > 0
        assert m["vllm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens > 0
        accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
        assert accepted == stats.num_accepted_tokens > 0
        assert sum(m[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{p}]"]
                   for p in range(3)) == accepted
        if "draft_model" in spec:  # the target as its own draft: every draft accepted
            assert accepted == m["vllm:spec_decode_num_draft_tokens_total"]
            line = specdec_serve.describe(served.cfg, served.srv, served.loop)
            assert "speculative decoding" in line and "draft 'tiny': weights:" in line
            assert line.count("KV cache") == 2
    finally:
        served.stop()
    assert plain.metrics() == {}  # no speculation, no spec_decode series


@pytest.mark.parametrize("spec, error, match", [
    ("speculative_config={method: eagle9, num_speculative_tokens: 2}", ValueError, "unknown method"),
    ("speculative_config={method: ngram, num_speculative_tokens: 0}", ValueError,
     "num_speculative_tokens"),
    ("speculative_config={method: ngram}", TypeError, "missing key"),
    ("speculative_config=4", TypeError, "must be a mapping"),
])
def test_a_bad_speculative_config_fails_before_the_port_is_bound(spec, error, match, monkeypatch):
    def listen(*args):
        raise AssertionError("the port was bound before the speculative_config was checked")

    monkeypatch.setattr("nano_vllm.serve.http_server.listen", listen)
    with pytest.raises(error, match=match):
        specdec_serve.build(compose(spec))


@pytest.mark.parametrize("config, error, match", [
    ({"method": "medusa9", "num_speculative_tokens": 2}, ValueError, "unknown method"),
    ({"method": None, "num_speculative_tokens": 2}, ValueError, "unknown method"),
    ({"method": "ngram", "num_speculative_tokens": -1}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, ValueError, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/draft"}, ValueError,
     "/no/such/draft"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "other_vocab"}, ValueError,
     "vocabulary of 1000 tokens"),
])
def test_bad_input_fails_at_construction_before_the_target_loads(config, error, match, monkeypatch,
                                                                 request):
    if config.get("model") == "other_vocab":
        config = {**config, "model": request.getfixturevalue("other_vocab")}

    def load(*args, **kwargs):
        raise AssertionError("the target was built before the speculative_config was checked")

    monkeypatch.setattr(LLMEngine, "__init__", load)
    with pytest.raises(error, match=match):
        LLM("tiny", speculative_config=config, device="cpu")
