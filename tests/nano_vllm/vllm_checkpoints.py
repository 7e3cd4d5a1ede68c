"""Random small HF checkpoints made with transformers (never by us) and random prompts, for tests/nano_vllm.

A module with a unique name rather than conftest, so `from vllm_checkpoints import ...` cannot pick up
another package's conftest when the whole suite runs in one pytest process.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 4096  # the shared tokenizer's size, so text prompts work too
# Every performance layer that runs by default on CUDA, asked for explicitly (on a CPU they stay off by
# default): overlapped steps, fused projections and sampling, the GEMV layer (which on a CPU keeps F.linear).
# A CPU captures no graphs; the tests pick their own step budgets.
LAYERS = {"async_scheduling": True, "fused_projections": True, "fused_sampling": True, "gemv_max_tokens": 1}


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


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
