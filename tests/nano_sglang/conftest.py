"""A random 2-layer checkpoint made with `transformers` (hidden 64), its greedy outputs, and engines."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    cfg = transformers.Qwen3Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                   max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=True,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    return str(path)


@functools.cache
def _hf(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy(ckpt):
    @functools.cache
    def run(prompt: tuple[int, ...], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = _hf(ckpt).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                     pad_token_id=0)
        return out[0, len(prompt):].tolist()
    return run


@pytest.fixture(scope="session")
def hf_model(ckpt):
    return _hf(ckpt)
