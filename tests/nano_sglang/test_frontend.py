"""The frontend against the in-process runtime and nano_vllm's OpenAI server: select == scoring each option
separately (transformers), fork/join, run_batch sharing a prefix, streaming, constrained gen."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import nano_sglang as sgl
from nano_vllm import SamplingParams
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.serve.engine_loop import EngineLoop
from nano_vllm.serve.server import make_server


@pytest.fixture(scope="module")
def runtime(ckpt):
    rt = sgl.Runtime(ckpt, max_model_len=256, max_num_seqs=16, num_kv_blocks=96)
    yield rt
    rt.shutdown()


def separate_scores(hf_model, tokenizer, text, choices):
    prefix = tokenizer.encode(text)
    out = []
    for c in choices:
        ids = prefix + tokenizer.encode(c)
        with torch.no_grad():
            lp = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        toks = [lp[p - 1, ids[p]].item() for p in range(len(prefix), len(ids))]
        out.append(sum(toks) / len(toks))
    return out


@sgl.function
def pick(s, question, choices):
    s += sgl.system("Answer briefly.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.select("answer", choices=choices))


def test_select_equals_separate_scoring(runtime, hf_model):
    backend = sgl.RuntimeBackend(runtime)
    choices = ["yes", "no", "maybe later", "certainly not"]
    for q in ("Is it raining?", "Do cats fly?", "Is water wet?"):
        state = pick.run(q, choices, backend=backend)
        text = state.text().rsplit(state["answer"] + "<|im_end|>", 1)[0]
        ref = separate_scores(hf_model, runtime.tokenizer, text, choices)
        got = state.meta["answer"]["normalized_prompt_logprobs"]
        assert got == pytest.approx(ref, abs=1e-4)
        assert state["answer"] == choices[max(range(len(ref)), key=ref.__getitem__)]


@sgl.function
def branches(s, topic):
    s += sgl.system("You write short lists. " * 6)
    s += sgl.user(f"Ideas about {topic}.")
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Idea {i}: " + sgl.gen("idea", max_tokens=6)
    s.join(forks)
    s += "Summary: " + sgl.gen("summary", max_tokens=5)
    s += " Score: " + sgl.gen("score", regex=r"[1-9]\d?", max_tokens=4)
    s.vars["ideas"] = [f["idea"] for f in forks]


def test_fork_join_run_batch_share_the_prefix(runtime):
    backend = sgl.RuntimeBackend(runtime)
    states = branches.run_batch([{"topic": t} for t in ("tea", "rain", "maps", "owls")], backend=backend)
    for st in states:
        assert len(st.vars["ideas"]) == 3 and all(isinstance(i, str) for i in st.vars["ideas"])
        assert st["score"].isdigit() and 1 <= int(st["score"]) <= 99
        assert st.text().endswith(st["score"])
    bm = runtime.engine.block_manager
    assert bm.tree.total_pages() > 0 and not bm.locked


def test_streaming_yields_the_text(runtime):
    backend = sgl.RuntimeBackend(runtime)
    state = sgl.ProgramState(backend)
    state += "Once upon a time" + sgl.gen("story", max_tokens=8)
    chunks = list(state.text_iter())
    assert "".join(chunks) == state.text() and state["story"]


def test_errors_surface_in_the_program(runtime):
    backend = sgl.RuntimeBackend(runtime)
    state = sgl.ProgramState(backend)
    state += "x" + sgl.gen("bad", regex="(ab")
    with pytest.raises(ValueError, match="invalid regex"):
        state.text()
    with pytest.raises(ValueError, match="non-empty list of choices"):
        sgl.select("s", choices=[])


def test_against_nano_vllm_openai_server(ckpt, runtime):
    loop = EngineLoop(LLMEngine(EngineConfig(model=ckpt, max_model_len=256, max_num_seqs=8))).start()
    srv = make_server(loop, "m", port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        backend = sgl.OpenAIBackend(f"http://{srv.server_address[0]}:{srv.server_address[1]}")

        @sgl.function
        def chat(s, q):
            s += sgl.user(q)
            forks = s.fork(2)
            for f in forks:
                f += sgl.assistant(sgl.gen("a", max_tokens=5, temperature=0.0))
            s.vars["a"] = [f["a"] for f in forks]

        remote = chat.run("Hello?", backend=backend)
        local = chat.run("Hello?", backend=sgl.RuntimeBackend(runtime))
        assert remote.vars["a"][0] == remote.vars["a"][1] == local.vars["a"][0]  # greedy: same engine math
        with pytest.raises(NotImplementedError, match="prompt logprobs"):
            backend.score_choices("x", ["a"])
        state = sgl.ProgramState(backend)
        state += "Hi" + sgl.gen("g", max_tokens=3)  # no EOS in this checkpoint: it runs to max_tokens
        assert state.get_meta_info("g") == {"finish_reason": "length"}
    finally:
        srv.shutdown()
        srv.server_close()
        loop.stop()
    json.dumps(remote.vars)


def test_a_gen_cut_by_max_tokens_says_so(runtime):
    """Jump-forward's forced tokens count against max_tokens; the program state reports how each gen
    ended (SGLang's meta info), and a runtime handle carries the finish reason."""
    backend = sgl.RuntimeBackend(runtime)
    state = sgl.ProgramState(backend)
    state += "x" + sgl.gen("v", max_tokens=8, regex=r"(a|b)*c{1000}") + sgl.gen("w", max_tokens=8, regex="c{5}")
    assert len(runtime.tokenizer.encode(state["v"])) == 8 and state["w"] == "ccccc"
    assert state.get_meta_info("v") == {"finish_reason": "length"} == state.meta["v"]
    assert state.get_meta_info("w")["finish_reason"] == "stop"
    handle = runtime.submit([5, 6], SamplingParams(temperature=0.0, max_tokens=4), regex=r"c{100}")
    handle.wait(timeout=60)
    assert handle.finish_reason == "length"
