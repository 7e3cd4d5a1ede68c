"""Random small HF checkpoints (made with transformers, never by us) and their greedy outputs.

Every engine test compares against `transformers` `generate` (greedy, fp32) on these checkpoints: one
Llama (untied embeddings, GQA) and one Qwen3 (q/k norm, tied embeddings), 2 layers, hidden 64, head_dim
32. Norm weights are perturbed away from 1 and the init scale raised so that the argmax is decisive
(a near-tie between two logits would make "token for token" a coin flip under fp32 reordering).
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 4096  # the shared tokenizer's size, so text prompts work too


def make_checkpoint(path, family: str, **overrides) -> str:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                  initializer_range=0.08, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    common.update(overrides)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
    else:
        cfg = transformers.Qwen3Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
    torch.manual_seed({"llama": 1, "qwen3": 2}[family])
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def ckpt(request):
    return request.getfixturevalue(f"{request.param}_ckpt")


@functools.cache
def _hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def _hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = _hf_model(path)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


@pytest.fixture
def hf_greedy():
    """hf_greedy(path, prompt_ids, n) -> the n tokens transformers' greedy generate produces."""
    return lambda path, prompt, n: list(_hf_greedy(path, tuple(prompt), n))


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(autouse=True)
def one_thread():
    """The models here are tiny: one intra-op thread is fastest, and immune to a busy CI box (OpenMP
    threads spinning against other processes slow tiny matmuls down 50x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
