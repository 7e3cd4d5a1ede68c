"""The offline API: prompts as text or ids, tokenizers, checkpoints from shared.checkpoint, bad arguments."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.request

import pytest
import torch

from nano_vllm import LLM, EngineConfig, SamplingParams
from shared.checkpoint import save_checkpoint
from shared.config import ModelConfig
from shared.model import build_model, greedy_generate


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64)


def test_text_and_ids_in_input_order(tiny):
    tok = tiny.tokenizer
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    outs = tiny.generate(["Hello world", [1, 2, 3], "a"], sp, use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello world", None, "a"]
    assert outs[0].prompt_token_ids == tok.encode("Hello world") and outs[1].prompt_token_ids == [1, 2, 3]
    for o in outs:
        assert len(o.token_ids) == 5 and o.text == tok.decode(o.token_ids) == o.outputs[0].text
    one = tiny.generate("Hello world", sp, use_tqdm=False)  # a single prompt, not a list
    assert len(one) == 1 and one[0].token_ids == outs[0].token_ids
    assert tiny.generate([[1, 2, 3]], sp)[0].token_ids == outs[1].token_ids  # with the progress bar
    dicts = tiny.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt": "a"}], sp, use_tqdm=False)
    assert [d.token_ids for d in dicts] == [outs[1].token_ids, outs[2].token_ids]


def test_checkpoint_saved_by_shared(tmp_path):
    """What nano_megatron / nano_zero save (shared.checkpoint, a Qwen3-family config) loads and runs."""
    cfg = ModelConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32, qk_norm=True,
                      initializer_range=0.1)
    model = build_model(cfg, seed=3)
    save_checkpoint(model, cfg, tmp_path)
    llm = LLM(str(tmp_path), max_model_len=64)
    prompt = [10, 20, 30, 40]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert out.token_ids == greedy_generate(model, prompt, 8)


def test_checkpoint_tokenizer_json_is_used(tmp_path, qwen3_ckpt):
    tokenizers = pytest.importorskip("tokenizers")
    shutil.copytree(qwen3_ckpt, tmp_path, dirs_exist_ok=True)
    vocab = {"[UNK]": 0, "hello": 5, "world": 6, "</s>": 7}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    llm = LLM(str(tmp_path), max_model_len=64)
    out = llm.generate(["hello world hello"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert out.prompt_token_ids == [5, 6, 5]
    assert llm.engine.scheduler.eos_token_ids == {7}  # config.json has no eos: the tokenizer's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert LLM(str(tmp_path), max_model_len=64).engine.scheduler.eos_token_ids == {3, 4}


@pytest.mark.parametrize("kwargs,match", [
    ({"block_size": 8}, "block_size"), ({"block_size": 48}, "block_size"), ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"dtype": "int8"}, "dtype"), ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"), ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
])  # fmt: skip
def test_engine_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_engine_errors(tiny):
    with pytest.raises(TypeError, match="bogus"):
        LLM("tiny", bogus=1)
    with pytest.raises(ValueError, match="neither a preset"):
        LLM("/no/such/model")
    with pytest.raises(ValueError, match="fewer than one max_model_len"):
        LLM("tiny", max_model_len=64, num_kv_blocks=3)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM("tiny", max_model_len=10**6)
    with pytest.raises(ValueError, match="max_model_len"):
        tiny.generate([[1] * 65], use_tqdm=False)
    with pytest.raises(ValueError, match=r"\[0, 4096\)"):
        tiny.generate([[1, 4096]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        tiny.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        tiny.generate([[1]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert not tiny.engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_frees_blocks(async_scheduling):
    engine = LLM("tiny", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                 async_scheduling=async_scheduling).engine
    seq = engine.add_request([1, 2, 3, 4] * 8, SamplingParams(max_tokens=30))
    engine.step()
    assert seq.block_table and engine.abort_request(seq.request_id)
    assert seq.finish_reason == "abort" and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.abort_request(seq.request_id)


def test_serve_hydra_app_builds_a_server():
    from hydra import compose, initialize_config_module

    from nano_vllm.serve.server import build

    with initialize_config_module(config_module="nano_vllm.configs", version_base=None):
        cfg = compose(config_name="serve", overrides=["port=0", "engine.max_model_len=64", "served_model_name=t",
                                                      "performance_layers=false"])
    server, loop = build(cfg)
    assert loop.engine.config.performance_layers is False and loop.engine.layers_applied == []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert json.loads(urllib.request.urlopen(url + "/health").read()) == {"status": "ok"}
        req = urllib.request.Request(url + "/v1/completions", json.dumps({"model": "t", "prompt": "Hi"}).encode(),
                                     {"Content-Type": "application/json"})
        body = json.loads(urllib.request.urlopen(req).read())
        assert body["usage"]["completion_tokens"] == 16  # vLLM's default max_tokens
    finally:
        server.shutdown()
        server.server_close()
        loop.stop()
    assert torch.get_num_threads() == 1  # the autouse fixture is in force


# ---------------------------------------------------------------------- EOS, special tokens, bad arguments
def _always_4095_checkpoint(path, eos_token_id=None) -> str:
    """A random Llama checkpoint (transformers-made, no tokenizer) whose greedy choice is always token 4095 —
    the fallback tokenizer's `<|endoftext|>`: every embedding carries +100 on feature 0, and only row 4095
    of the LM head reads that feature."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                   max_position_embeddings=256, bos_token_id=None, eos_token_id=eos_token_id,
                                   pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[4095, 0] = 10.0
    model.save_pretrained(path)
    return str(path)


def test_eos_comes_from_the_checkpoint_only(tmp_path, hf_greedy, layer_args):
    """A checkpoint that declares no EOS and ships no tokenizer runs to max_tokens, like transformers'
    generate: the fallback tokenizer's `<|endoftext|>` (4095) is an ordinary token to it."""
    ckpt = _always_4095_checkpoint(tmp_path)
    llm = LLM(ckpt, max_model_len=64, **layer_args)
    assert llm.engine.scheduler.eos_token_ids == set()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(ckpt, [1, 2, 3], 6) == [4095] * 6
    assert out.outputs[0].finish_reason == "length"


def test_special_tokens_are_skipped_in_text_by_default(tmp_path, layer_args):
    """vLLM's `skip_special_tokens=True`: the EOS the request stopped at is in token_ids, not in text; and
    as the token that stopped it, its text is left out even with `skip_special_tokens=False`, unless
    `include_stop_str_in_output`."""
    llm = LLM(_always_4095_checkpoint(tmp_path, eos_token_id=4095), max_model_len=64, **layer_args)
    assert llm.engine.scheduler.eos_token_ids == {4095}
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert out.token_ids == [4095] and out.outputs[0].finish_reason == "stop" and out.text == ""
    for include, text in ((False, ""), (True, "<|endoftext|>")):
        sp = SamplingParams(temperature=0.0, max_tokens=4, skip_special_tokens=False,
                            include_stop_str_in_output=include)
        kept = llm.generate([[1, 2, 3]], sp, use_tqdm=False)[0]
        assert kept.token_ids == [4095] and kept.text == text
    tok = llm.tokenizer
    ids = [*tok.encode("hi"), 4095]
    assert tok.decode(ids) == "hi" and tok.decode(ids, skip_special_tokens=False) == "hi<|endoftext|>"


def test_stop_token_text_is_left_out(layer_args):
    """A request that stops at one of its `stop_token_ids` keeps the token in `token_ids` but not its text
    in `text`, as vLLM does, unless `include_stop_str_in_output`; a request cut by length keeps all."""
    llm = LLM("tiny", max_model_len=64, **layer_args)
    prompt = [5, 6, 7, 8]
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].token_ids
    stop = full[2]
    k = full.index(stop)  # the first time the greedy output draws it
    decode = llm.tokenizer.decode
    assert decode(full[:k]) != decode(full[:k + 1])
    for include, text in ((False, decode(full[:k])), (True, decode(full[:k + 1]))):
        sp = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop], include_stop_str_in_output=include)
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        assert out.token_ids == full[:k + 1] and out.outputs[0].finish_reason == "stop" and out.text == text
    cut = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=k + 1), use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "length" and cut.text == decode(full[:k + 1])


def test_generate_checks_every_prompt_before_queueing_any(tiny):
    with pytest.raises(ValueError, match=r"\[0, 4096\)"):
        tiny.generate(["ok", [99999]], use_tqdm=False)
    assert not tiny.engine.has_unfinished_requests()  # "ok" was not queued
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt token ids must be ints in \[0, 4096\)"):
        tiny.generate(["ok", [99999]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[2\]: prompt has 65 tokens"):
        tiny.generate([[1], [2], [3] * 65], use_tqdm=False)
    assert not tiny.engine.has_unfinished_requests()
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    assert len(tiny.generate(["ok"], sp, use_tqdm=False)[0].token_ids) == 2  # nothing left over ran along


@pytest.mark.parametrize("call,error,match", [
    (lambda llm: llm.generate([None]), TypeError, r"prompts\[0\] must be a str, .* got NoneType"),
    (lambda llm: llm.generate(None), TypeError, "prompts must be a prompt or a list of prompts, got None"),
    (lambda llm: llm.generate(["a", 3.5]), TypeError, r"prompts\[1\] must be .* got float"),
    (lambda llm: llm.generate([{"prompt": None}]), TypeError, r"prompts\[0\]\['prompt'\] must be .* None"),
    (lambda llm: llm.generate([{"text": "a"}]), ValueError, r"prompts\[0\]: a dict prompt needs"),
    (lambda llm: llm.generate([[1, "2"]]), ValueError, r"prompts\[0\]: prompt token ids must be ints"),
    (lambda llm: llm.generate(["a"], {"max_tokens": 2}), TypeError,
     "sampling_params must be a SamplingParams or a list of them .* got dict"),
    (lambda llm: llm.generate(["a", "b"], [SamplingParams(), {"max_tokens": 2}]), TypeError,
     r"sampling_params\[1\] must be a SamplingParams, got dict"),
    (lambda llm: llm.engine.add_request(None), TypeError, "prompt must be a str or a list of token ids"),
    (lambda llm: llm.engine.add_request("a", {"max_tokens": 2}), TypeError,
     "sampling_params must be a SamplingParams, got dict"),
])  # fmt: skip
def test_bad_generate_arguments_name_the_argument(tiny, call, error, match):
    with pytest.raises(error, match=match):
        call(tiny)
    assert not tiny.engine.has_unfinished_requests()
