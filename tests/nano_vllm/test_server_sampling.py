"""The server's stop strings, log-probabilities (completions with echo, chat), n choices and batches of
prompts, against the offline engine (`LLM`, itself tested against transformers in
test_openai_sampling.py) on the same checkpoint, in OpenAI's response shapes; streamed and not."""

from __future__ import annotations

import json
import socket

import pytest
from server_client import DEADLINE_S, gate_steps, post, sse, start, stop, wait_for, wait_idle
from server_client import conn as srv_conn
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, SamplingParams
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.serve.engine_loop import EngineLoop

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ATOL = 1e-5  # the same engine online and offline: only the batch around a request differs


@pytest.fixture(scope="module")
def server(qwen3_ckpt):
    loop = EngineLoop(LLMEngine(EngineConfig(model=qwen3_ckpt, max_model_len=128, max_num_seqs=16))).start()
    srv, thread = start(loop)
    yield srv, loop
    stop(srv, thread)
    loop.stop()


@pytest.fixture(scope="module")
def offline(qwen3_ckpt):
    return LLM(qwen3_ckpt, max_model_len=128, max_num_seqs=16)


def texts_by_index(chunks: list[dict]) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for choice in c.get("choices", []):
            out[choice["index"]] = out.get(choice["index"], "") + choice.get("text", "")
    return out


def test_stop_strings_online_equal_offline_and_never_flash(server, offline):
    srv, loop = server
    prompt = random_prompts(20, [8])[0]
    full = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].text
    stop_str = full[12:15]
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop=[stop_str]),
                            use_tqdm=False)[0].outputs[0]
    assert want.stop_reason == stop_str and want.text == full[: full.find(stop_str)]
    body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "stop": stop_str}
    status, out = post(srv, COMPLETIONS, body)
    choice = out["choices"][0]
    assert status == 200 and (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        want.text, "stop", stop_str)
    assert out["usage"]["completion_tokens"] == len(want.token_ids)
    status, data = post(srv, COMPLETIONS, {**body, "stream": True})
    chunks, shown = sse(data), ""
    for c in chunks:
        shown += c["choices"][0]["text"]
        assert want.text.startswith(shown)  # nothing shown is ever taken back
    assert shown == want.text and chunks[-1]["choices"][0]["stop_reason"] == stop_str
    status, out = post(srv, COMPLETIONS, {**body, "include_stop_str_in_output": True})
    assert out["choices"][0]["text"] == full[: full.find(stop_str) + len(stop_str)]
    wait_idle(loop, srv)


def test_echo_scores_the_prompt_like_offline_prompt_logprobs(server, offline):
    """What lm-evaluation-harness sends to score a continuation: echo, logprobs, max_tokens 0."""
    srv, loop = server
    prompts = random_prompts(21, [7, 12])
    status, out = post(srv, COMPLETIONS, {"prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 0,
                                          "temperature": 0})
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                            use_tqdm=False)
    dec = offline.tokenizer.decode
    for prompt, ref, choice in zip(prompts, refs, out["choices"]):
        lp = choice["logprobs"]
        assert choice["text"] == dec(prompt) and choice["finish_reason"] == "length"
        assert lp["tokens"] == [dec([t]) for t in prompt]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, len(prompt)):
            entry = ref.prompt_logprobs[i]
            assert lp["token_logprobs"][i] == pytest.approx(entry[prompt[i]].logprob, abs=ATOL)
            assert set(lp["top_logprobs"][i]) == {dec([t]) for t in entry}
        assert lp["text_offset"] == [len(dec(prompt[:i])) for i in range(len(prompt))]
    assert out["usage"] == {"prompt_tokens": 19, "completion_tokens": 0, "total_tokens": 19}
    wait_idle(loop, srv)


def test_echo_with_generated_tokens(server, offline):
    srv, loop = server
    prompt = random_prompts(22, [6])[0]
    status, out = post(srv, COMPLETIONS, {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3,
                                          "temperature": 0})
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
    lp, dec = out["choices"][0]["logprobs"], offline.tokenizer.decode
    assert out["choices"][0]["text"] == dec(prompt) + ref.text
    assert len(lp["tokens"]) == len(prompt) + 3
    for j, token in enumerate(ref.token_ids):
        assert lp["token_logprobs"][len(prompt) + j] == pytest.approx(
            ref.outputs[0].logprobs[j][token].logprob, abs=ATOL)
    status, data = post(srv, COMPLETIONS, {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3,
                                           "temperature": 0, "stream": True})
    chunks = sse(data)
    assert status == 200
    assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]
    streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    wait_idle(loop, srv)


def test_chat_logprobs_and_top_logprobs(server, offline):
    srv, loop = server
    msgs = [{"role": "user", "content": "Hello there"}]
    status, out = post(srv, CHAT, {"messages": msgs, "max_tokens": 4, "temperature": 0, "logprobs": True,
                                   "top_logprobs": 3})
    assert status == 200
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 4
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"} and len(item["top_logprobs"]) == 3
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][-1]["logprob"]
        assert item["logprob"] == pytest.approx(item["top_logprobs"][0]["logprob"])  # greedy: the argmax
        assert item["bytes"] == list(item["token"].encode())
    status, out = post(srv, CHAT, {"messages": msgs, "max_tokens": 2, "logprobs": True})
    assert all(item["top_logprobs"] == [] for item in out["choices"][0]["logprobs"]["content"])
    status, out = post(srv, CHAT, {"messages": msgs, "max_tokens": 2})
    assert out["choices"][0]["logprobs"] is None
    wait_idle(loop, srv)


def test_n_choices_and_several_prompts(server, offline):
    srv, loop = server
    prompts = random_prompts(23, [5, 9])
    body = {"prompt": prompts, "n": 3, "max_tokens": 6, "temperature": 1.0, "seed": 5}
    status, out = post(srv, COMPLETIONS, body)
    assert status == 200 and [c["index"] for c in out["choices"]] == list(range(6))
    want = offline.generate(prompts, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5), use_tqdm=False)
    assert [c["text"] for c in out["choices"]] == [c.text for r in want for c in r.outputs]
    assert len({c["text"] for c in out["choices"][:3]}) == 3
    assert out["usage"] == {"prompt_tokens": 14, "completion_tokens": 36, "total_tokens": 50}
    status, again = post(srv, COMPLETIONS, body)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in out["choices"]]
    status, data = post(srv, COMPLETIONS, {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse(data)
    assert texts_by_index(chunks) == {c["index"]: c["text"] for c in out["choices"]}
    assert sum(1 for c in chunks for ch in c["choices"] if ch["finish_reason"]) == 6
    assert chunks[-1]["usage"] == out["usage"]
    status, out = post(srv, CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3,
                                   "temperature": 1.0, "seed": 1})
    assert [c["index"] for c in out["choices"]] == [0, 1] and out["usage"]["completion_tokens"] == 6
    wait_idle(loop, srv)


def test_disconnect_aborts_every_choice_and_frees_every_block(server, monkeypatch):
    srv, loop = server
    gate = gate_steps(loop, monkeypatch)
    gate.allow(3)
    sock = socket.create_connection(srv.server_address[:2], timeout=DEADLINE_S)
    body = json.dumps({"prompt": [1, 2, 3, 4, 5], "n": 4, "max_tokens": 100, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while received.count(b"data: ") < 4:
        received += sock.recv(65536)
    assert loop.num_active == 4
    sock.close()
    wait_for(lambda: not srv.api.active, "the server to notice the disconnect")
    gate.set()
    wait_idle(loop, srv)  # every block free, nothing left in the engine
    bm = loop.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and loop.num_active == 0


def test_openai_client(server):
    openai = pytest.importorskip("openai", reason="pip install openai to run the official client")
    srv, loop = server
    host, port = srv.server_address[:2]
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused")
    out = client.completions.create(model="test-model", prompt=["ab", "cd"], n=2, max_tokens=3, echo=True,
                                    logprobs=1, stop=["\n\n"], temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text.startswith("ab") and out.choices[0].logprobs.token_logprobs[0] is None
    chat = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    wait_idle(loop, srv)


def test_tokenizer_routes(server):
    """vLLM's /tokenize, /detokenize and /tokenizer_info, with the completions' tokenizer."""
    srv, loop = server
    tok = loop.engine.tokenizer
    status, out = post(srv, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False})
    assert status == 200 and out == {"count": len(tok.encode("Hello there")), "max_model_len": 128,
                                     "tokens": tok.encode("Hello there")}
    status, out = post(srv, "/detokenize", {"tokens": tok.encode("Hello there")})
    assert status == 200 and out == {"prompt": "Hello there"}
    status, out = post(srv, "/detokenize", {"tokens": [10**6]})
    assert status == 400 and out["error"]["param"] == "tokens"
    status, out = post(srv, "/tokenize", {"text": "x"})
    assert status == 400 and "'prompt'" in out["error"]["message"]
    c = srv_conn(srv)
    c.request("GET", "/tokenizer_info")
    info = json.loads(c.getresponse().read())
    assert info["eos_token"] == tok.special_tokens.get("eos_token") and info["model_max_length"] == 128
