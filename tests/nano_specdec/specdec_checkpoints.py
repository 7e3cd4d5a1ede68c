"""Random small HF checkpoints made with transformers (never by us), a small target trained here on a
synthetic cycle (for the trained drafts), and random prompts, for tests/nano_specdec. A module with a unique name rather than conftest, so `from specdec_checkpoints import
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


def make_cycle_target(path, seed: int = 0, cycle: int = 64, steps: int = 80) -> str:
    """A small target trained (shared.train's LocalEngine, a few seconds on a CPU) to continue any text
    around a fixed cycle of `cycle` tokens: its greedy continuations are learnable, so a trained draft
    is accepted where an untrained one is not. Windows start with up to 7 random tokens, from which the
    model learns to enter the cycle."""
    from shared.checkpoint import save_checkpoint
    from shared.config import ModelConfig
    from shared.train import LocalEngine, TrainConfig, lr_at

    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=256, tie_word_embeddings=False)
    tc = TrainConfig(steps=steps, global_batch_size=16, micro_batch_size=16, seq_len=32, lr=1e-2,
                     min_lr=1e-3, warmup_steps=5, seed=seed)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(VOCAB, generator=g)[:cycle]
    engine = LocalEngine(cfg, tc)
    for step in range(steps):
        at = (torch.randint(0, cycle, (16, 1), generator=g) + torch.arange(33)) % cycle
        noise = torch.arange(33) < torch.randint(0, 8, (16, 1), generator=g)
        rows = torch.where(noise, torch.randint(0, VOCAB, (16, 33), generator=g), order[at])
        engine.train_step([(rows[:, :-1], rows[:, 1:])], lr_at(step, tc))
    save_checkpoint(engine.model, cfg, path)
    return str(path)


DRAFT_TRAINING = ["data.corpus=docs", "data.num_prompts=32", "data.prompt_len=16", "data.max_tokens=32",
                  "train.steps=60", "train.global_batch_size=8", "train.micro_batch_size=8",
                  "train.warmup_steps=5", "train.lr=1e-2", "train.min_lr=1e-3", "train.log_every=60",
                  "medusa.num_heads=3", "eval.num_prompts=4", "eval.max_tokens=32",
                  "eval.num_speculative_tokens=3"]
UNTRAINED = ["train.steps=1", "train.lr=0", "train.min_lr=0", "train.warmup_steps=0",
             "draft_model.init_from_target=false"]


def train_draft(target: str, method: str, out, overrides: list[str]) -> dict:
    """`python -m nano_specdec.train target=... method=... out=...` through its shipped Hydra config,
    in this process; returns the run's summary (τ of the draft on held-out prompts included)."""
    from hydra import compose, initialize_config_module

    from nano_specdec.train import run

    with initialize_config_module("nano_specdec.configs", version_base=None):
        device = [] if any(o.startswith("device=") for o in overrides) else ["device=cpu"]
        cfg = compose("train", overrides=[f"target={target}", f"method={method}", f"out={out}",
                                          *device, *DRAFT_TRAINING, *overrides])
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(cfg)
    finally:
        torch.set_num_threads(old)
