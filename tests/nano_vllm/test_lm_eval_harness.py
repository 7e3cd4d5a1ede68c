"""lm-evaluation-harness's `local-completions` model scores a multiple-choice task through nano_vllm.serve,
and its scores equal those computed offline from `LLM(...).generate(..., prompt_logprobs=k)`.

How the harness scores a choice (lm-eval >= 0.4.5: lm_eval/models/api_models.py `TemplateAPI`,
openai_completions.py `LocalCompletionsAPI`): each (context, target_delimiter + choice) pair is tokenized
on the client (`_encode_pair`: trailing whitespace of the context moves to the continuation; the whole text
is encoded and split after the context's tokens), the pairs are sorted longest first, and each batch of
`batch_size` of them is one POST to /v1/completions:

    {"model": <name>, "prompt": [[token ids], ...], "temperature": 0, "max_tokens": 1, "logprobs": 1,
     "seed": 1234, "echo": true}

The response's choices, sorted by `index`, are read one per prompt: a choice's log-likelihood is
`sum(token_logprobs[ctxlen:-1])` (the continuation's tokens; `-1` drops the one generated token, so the
server must return it after the echoed prompt) and it is greedy when each of those tokens' log-probability
equals `max(top_logprobs[i].values())`. A document's `acc` is whether its likeliest choice is the gold one,
`acc_norm` the same after dividing each log-likelihood by the choice's length in characters,
`exact_match` whether the gold choice is greedy. lm-eval 0.4.0-0.4.3 asked for `max_tokens: 0`,
`logprobs: 10` instead (the prompt alone, read as `token_logprobs[ctxlen:]`), choices in response order.

The task: the next line of a docstring of the stdlib docs corpus (its held-out documents), among the next
lines of three other questions. The model: the README walkthrough's (`tiny` preset, trained by shared.train
on the docs corpus; fewer steps here: the scores need not be good, only equal).

`test_replayed_harness_requests_match_offline` sends both request shapes above (no lm-eval needed);
`test_lm_eval_local_completions_matches_offline` runs lm-eval itself (the `eval` extra) and checks that
what it sends is exactly the replayed requests.
"""

from __future__ import annotations

import copy
import http.client
import importlib.util
import json
import math

import pytest
import torch
from server_client import DEADLINE_S, start, stop

from nano_vllm import LLM, SamplingParams
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.serve.engine_loop import EngineLoop
from shared.config import ModelConfig
from shared.data import corpus_documents
from shared.tokenizer import get_tokenizer
from shared.train import TrainConfig, train_local

MODEL_NAME = "tiny"  # the walkthrough's served_model_name
TRAIN_STEPS = 40  # the walkthrough trains 200 (a minute); 40 leave distributions peaked, far from ties
NUM_QUESTIONS, NUM_CHOICES, CONTEXT_LINES = 12, 4, 3
DELIMITER = "\n"  # the task's target_delimiter: a choice is the line after the context
BATCH_SIZE = 8  # prompts per request (lm-eval's `batch_size` model argument; its default is 1)
SEED = 1234  # lm-eval's default `seed`, sent with every request
ATOL_TOKEN, ATOL_SUM = 1e-5, 1e-4  # fp32 on a CPU, the same weights in differently composed batches
# lm-eval's request shapes: (max_tokens, logprobs, generated tokens at the end of an echo's logprobs)
SHAPES = {"lm-eval>=0.4.4": (1, 1, 1), "lm-eval<=0.4.3": (0, 10, 0)}

Pair = tuple[list[int], list[int]]  # (context tokens, continuation tokens)


# ------------------------------------------------------------------------------- the task
def next_line_questions(n: int = NUM_QUESTIONS, k: int = NUM_CHOICES) -> list[dict]:
    """`n` questions from the corpus's held-out documents: up to CONTEXT_LINES lines of a docstring, the
    line after them (gold) and the gold lines of the k - 1 next questions; gold at position i % k."""
    found = []
    for doc in corpus_documents("val")[::7]:
        lines = [line.strip() for line in doc.splitlines()]
        for i in range(1, len(lines) - 1):
            if all(16 <= len(line) <= 72 for line in lines[i:i + 2]):
                found.append(("\n".join(lines[max(0, i - CONTEXT_LINES + 1):i + 1]), lines[i + 1]))
                break
        if len(found) == n:
            break
    assert len(found) == n, "the corpus has too few documents for the task"
    questions = []
    for q, (context, gold) in enumerate(found):
        others = [found[(q + j) % n][1] for j in range(1, k)]
        choices = [*others[:q % k], gold, *others[q % k:]]
        assert len(set(choices)) == k, f"question {q} has a choice twice: {choices}"
        questions.append({"context": context, "choices": choices, "gold": q % k})
    return questions


def encode_pair(encode, context: str, continuation: str) -> Pair:
    """lm-eval's `TemplateLM._encode_pair` for a causal model: trailing whitespace of the context goes to
    the continuation, the whole text is encoded and split after the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = encode(context + continuation), encode(context)
    return ctx, whole[len(ctx):]


def harness_pairs(questions: list[dict]) -> list[Pair]:
    """Every pair the harness scores, question by question, choice by choice."""
    enc = get_tokenizer()
    return [encode_pair(enc.encode, q["context"], DELIMITER + c) for q in questions for c in q["choices"]]


def metrics(questions: list[dict], scores: list[tuple[float, bool]]) -> list[dict]:
    """lm-eval's multiple-choice metrics of each question from its choices' (log-likelihood, is_greedy)."""
    out, k = [], NUM_CHOICES
    for q, question in enumerate(questions):
        lls, greedy = zip(*scores[q * k:(q + 1) * k])
        norm = [ll / len(c) for ll, c in zip(lls, question["choices"])]
        gold = question["gold"]
        out.append({"pred": lls.index(max(lls)), "acc": float(lls.index(max(lls)) == gold),
                    "acc_norm": float(norm.index(max(norm)) == gold), "exact_match": float(greedy[gold])})
    return out


# ------------------------------------------------------------------------------- model, offline scores
@pytest.fixture(scope="module")
def walkthrough_ckpt(tmp_path_factory) -> str:
    out, threads = tmp_path_factory.mktemp("walkthrough"), torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains fastest on one thread (conftest's `one_thread`)
    try:
        train_local(ModelConfig.from_name("tiny"), TrainConfig(steps=TRAIN_STEPS, out_dir=str(out)))
    finally:
        torch.set_num_threads(threads)
    return str(out / "checkpoint")


@pytest.fixture(scope="module")
def questions() -> list[dict]:
    return next_line_questions()


@pytest.fixture(scope="module")
def offline(walkthrough_ckpt, questions) -> list[list]:
    """Each pair's prompt log-probabilities from the offline API: per token None (the first) or its
    {token id: Logprob} (the token itself and the top one)."""
    pairs = harness_pairs(questions)
    llm = LLM(walkthrough_ckpt, max_model_len=256)
    outs = llm.generate([ctx + cont for ctx, cont in pairs],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    llm.shutdown()
    for (ctx, cont), out in zip(pairs, outs):
        assert out.prompt_token_ids == ctx + cont and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(ctx + cont)
    return [out.prompt_logprobs for out in outs]


def offline_scores(pairs: list[Pair], offline: list[list]) -> list[tuple[float, bool]]:
    """(the continuation's summed log-probability, whether each of its tokens ranks first) per pair."""
    scores = []
    for (ctx, cont), entries in zip(pairs, offline):
        ids, span = ctx + cont, range(len(ctx), len(ctx + cont))
        scores.append((math.fsum(entries[i][ids[i]].logprob for i in span),
                       all(entries[i][ids[i]].rank == 1 for i in span)))
    return scores


@pytest.fixture(scope="module")
def server(walkthrough_ckpt):
    loop = EngineLoop(LLMEngine(EngineConfig(model=walkthrough_ckpt, max_model_len=256))).start()
    srv, thread = start(loop, MODEL_NAME)
    yield srv
    stop(srv, thread)
    loop.stop()


# ------------------------------------------------------------------------------- the harness, replayed
def harness_payloads(pairs: list[Pair], batch_size: int = BATCH_SIZE, shape: str = "lm-eval>=0.4.4"):
    """The requests lm-eval sends for `pairs` (tokenized requests): the pairs longest first (ties by their
    tokens), `batch_size` per request. Yields (the pairs' indices, their ctxlens, the payload)."""
    max_tokens, logprobs, _ = SHAPES[shape]
    order = sorted(range(len(pairs)), key=lambda i: (-len(pairs[i][0] + pairs[i][1]),
                                                     tuple(pairs[i][0] + pairs[i][1])))
    for b in range(0, len(order), batch_size):
        chunk = order[b:b + batch_size]
        payload = {"model": MODEL_NAME, "prompt": [pairs[i][0] + pairs[i][1] for i in chunk],
                   "temperature": 0, "max_tokens": max_tokens, "logprobs": logprobs, "seed": SEED,
                   "echo": True}
        yield chunk, [len(pairs[i][0]) for i in chunk], payload


def parse_logprobs(response: dict, ctxlens: list[int], generated: int) -> list[tuple[float, bool]]:
    """lm-eval's `LocalCompletionsAPI.parse_logprobs`: per choice (by index), the continuation's summed
    log-probability and whether each of its tokens is the likeliest (`generated` tokens end the echo)."""
    out = []
    for choice, ctxlen in zip(sorted(response["choices"], key=lambda c: c["index"]), ctxlens):
        end = len(choice["logprobs"]["token_logprobs"]) - generated
        lps = choice["logprobs"]["token_logprobs"][ctxlen:end]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
        out.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))))
    return out


def post_json(srv, body: dict) -> dict:
    c = http.client.HTTPConnection(*srv.server_address[:2], timeout=DEADLINE_S)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = c.getresponse()
    data = resp.read()
    c.close()
    assert resp.status == 200, data[:2000]
    return json.loads(data)


def assert_same_scores(questions, got, want) -> None:
    torch.testing.assert_close(torch.tensor([ll for ll, _ in got], dtype=torch.float64),
                               torch.tensor([ll for ll, _ in want], dtype=torch.float64),
                               atol=ATOL_SUM, rtol=0)
    assert [g for _, g in got] == [g for _, g in want]
    assert metrics(questions, got) == metrics(questions, want)


@pytest.mark.parametrize("batch_size", [1, BATCH_SIZE])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_replayed_harness_requests_match_offline(server, questions, offline, shape, batch_size):
    pairs = harness_pairs(questions)
    generated = SHAPES[shape][2]
    scores: list = [None] * len(pairs)
    greedy_tokens = 0
    for chunk, ctxlens, payload in harness_payloads(pairs, batch_size, shape):
        response = post_json(server, payload)
        assert [c["index"] for c in response["choices"]] == list(range(len(chunk)))  # one per prompt
        for choice, ids, i in zip(response["choices"], payload["prompt"], chunk):
            lp, entries, scored = choice["logprobs"], offline[i], range(1, len(ids))
            # the echo: every prompt token (the first unscored), then the generated ones
            assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + generated
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            # every prompt token as offline: its log-probability, and whether it is the likeliest
            torch.testing.assert_close(
                torch.tensor([lp["token_logprobs"][p] for p in scored], dtype=torch.float64),
                torch.tensor([entries[p][ids[p]].logprob for p in scored], dtype=torch.float64),
                atol=ATOL_TOKEN, rtol=0)
            is_top = [lp["token_logprobs"][p] == max(lp["top_logprobs"][p].values()) for p in scored]
            assert is_top == [entries[p][ids[p]].rank == 1 for p in scored]
            greedy_tokens += sum(is_top)
        for i, score in zip(chunk, parse_logprobs(response, ctxlens, generated)):
            scores[i] = score
    assert 0 < greedy_tokens < sum(map(len, pairs))  # the greedy check saw both outcomes
    assert_same_scores(questions, scores, offline_scores(pairs, offline))


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("lm_eval", "tenacity")),
                    reason='lm-evaluation-harness with its API models: pip install -e ".[eval]"')
@pytest.mark.parametrize("backend", ["remote", "tiktoken"])
def test_lm_eval_local_completions_matches_offline(server, questions, offline, tmp_path, monkeypatch, backend):
    """`remote`: lm-eval tokenizes through the server's vLLM routes (/tokenizer_info, /tokenize,
    /detokenize), nothing patched; `tiktoken`: its own copy of the tokenizer."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # a local task: nothing comes from the hub
        monkeypatch.setenv(name, "1")
    import lm_eval
    import requests
    import tiktoken
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    # tokenizer_backend="tiktoken" looks the encoding up by the model's name: the project's, for "tiny"
    # (the walkthrough checkpoint ships no Hugging Face tokenizer)
    lookup = tiktoken.encoding_for_model
    monkeypatch.setattr(tiktoken, "encoding_for_model",
                        lambda name: get_tokenizer() if name == MODEL_NAME else lookup(name))
    sent, post = [], requests.post

    def recording_post(url, *args, json=None, **kwargs):
        sent.append(copy.deepcopy(json))
        return post(url, *args, json=json, **kwargs)

    monkeypatch.setattr(requests, "post", recording_post)
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions))
    task = {"task": "stdlib_next_line", "dataset_path": "json", "test_split": "test",
            "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "datasets")},
            "output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
            "doc_to_target": "gold", "target_delimiter": DELIMITER,
            "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                            for m in ("acc", "acc_norm", "exact_match")]}
    host, port = server.server_address[:2]
    lm = LocalCompletionsAPI(model=MODEL_NAME, base_url=f"http://{host}:{port}/v1/completions",
                             tokenizer_backend=backend, batch_size=BATCH_SIZE, max_retries=1)
    results = lm_eval.simple_evaluate(model=lm, tasks=[task], num_fewshot=0, log_samples=True,
                                      bootstrap_iters=0, task_manager=TaskManager(include_defaults=False))

    pairs = harness_pairs(questions)
    assert sent == [payload for _, _, payload in harness_payloads(pairs)]  # the replayed requests
    samples = sorted(results["samples"]["stdlib_next_line"], key=lambda s: s["doc_id"])
    want = offline_scores(pairs, offline)
    assert_same_scores(questions, [tuple(r[0]) for s in samples for r in s["resps"]], want)
    for metric in ("acc", "acc_norm", "exact_match"):
        per_doc = [m[metric] for m in metrics(questions, want)]
        assert [s[metric] for s in samples] == per_doc
        mean = results["results"]["stdlib_next_line"][f"{metric},none"]
        assert mean == pytest.approx(sum(per_doc) / len(per_doc))
