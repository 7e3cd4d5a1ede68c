"""Random small HF checkpoints made with transformers (never by us) and random prompts, for
tests/nano_specdec. A module with a unique name rather than conftest, so `from specdec_checkpoints import
...` cannot pick up another package's conftest when the whole suite runs in one pytest process."""

from __future__ import annotations

import torch
import transformers

VOCAB = 4096  # the shared tokenizer's size, so text (and stop strings) work


def make_checkpoint(path, seed: int, vocab_size: int = VOCAB, layers: int = 2, hidden: int = 64,
                    init: float = 0.08) -> str:
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=512, initializer_range=init, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)


def random_prompts(seed: int, lengths: list[int], vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
