"""Train a draft for a target on the target's own generations, and write it as an HF-style directory:

    python -m nano_specdec.train target=DIR method=eagle out=DIR
    python -m nano_specdec.train target=DIR method=medusa medusa.num_heads=4 out=DIR
    python -m nano_specdec.train target=DIR method=draft_model draft_model.num_hidden_layers=1 out=DIR

The data is EAGLE-3's "target-regenerated" kind (Li et al. 2025, arXiv 2503.01840): prompts are windows
of shared.data's training split, continued by the target itself through nano_vllm's `LLM` (greedy, or
sampled at `data.temperature`), so the draft learns what the target says rather than what the corpus
says. The loss covers the predictions of generated tokens; the prompt is context.

* `medusa` — Medusa-1 (Cai et al. 2024, §2.2.1): K heads (`nano_specdec.medusa.MedusaHeads`) on the
  frozen target's last hidden state; head k at position t learns token t + k + 1 with weight λ_k = 0.8^k.
* `eagle` — EAGLE (Li et al. 2024, §4.2): the draft layer (`nano_specdec.eagle.EagleDraft`) reads the
  pair (f_j, x_{j+1}) and predicts f_{j+1}; loss = smooth-L1(f̂_{j+1}, f_{j+1}) + w_cls · the
  cross-entropy of the target's distribution of x_{j+2} (softmax of its LM head on f_{j+1}) against the
  draft's (the LM head on f̂_{j+1}), w_cls = 0.1, with U(−0.1, 0.1) noise on the input features.
* `draft_model` — a shared.model CausalLM of `draft_model.num_hidden_layers` layers (started as the
  target's embeddings, first layers, final norm and LM head), trained with cross-entropy on the tokens.

The schedule, AdamW and clipping are shared.train's (`TrainConfig`, `lr_at`, `MixedPrecisionAdamW`);
the checkpoint is written by shared.checkpoint (atomically; config.json names the method in
`speculative_method`, which the engine checks). At the end, τ (tokens per target forward) of the new
draft in the engine, greedy, on held-out prompts (`eval.*`). Metrics go to the Hydra run directory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from nano_specdec.eagle import EagleDraft
from nano_specdec.medusa import MedusaHeads
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLM as PlainLLM
from nano_vllm.kv_cache import load_engine_model
from nano_vllm.sampling_params import SamplingParams
from shared.checkpoint import save_checkpoint
from shared.config import ModelConfig, resolve_model_config
from shared.data import corpus_tokens
from shared.dist import report
from shared.hydra_utils import hydra_run_dir, to_dataclass
from shared.model import CausalLM
from shared.train import (
    MixedPrecisionAdamW,
    StepResult,
    TrainConfig,
    check_batch_sizes,
    lr_at,
    micro_batches_of,
)

METHODS = ("eagle", "medusa", "draft_model")
BATCH, BLOCK = 256, 16  # sequences at a time in the engine runs, tokens per KV block


def engine_args(num_seqs: int, max_len: int, device: str) -> dict[str, Any]:
    """nano_vllm's LLM arguments for `num_seqs` sequences of up to `max_len` tokens: a KV pool that
    holds a full batch of them (sized from the need, not from free memory: a draft's pool comes after
    the target's, and GPU tests share the card)."""
    seqs = min(num_seqs, BATCH)
    return {"device": device, "max_model_len": max_len, "max_num_seqs": seqs, "block_size": BLOCK,
            "num_kv_blocks": seqs * -(-max_len // BLOCK)}
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------- the data
def prompt_windows(corpus: str, split: str, num: int, length: int, seed: int) -> list[list[int]]:
    """`num` windows of `length` tokens at seeded random offsets of a corpus split."""
    tokens = corpus_tokens(split, corpus=corpus)
    if len(tokens) <= length:
        raise ValueError(f"the {corpus!r} corpus' {split} split has {len(tokens)} tokens, fewer than "
                         f"data.prompt_len={length}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - length, (num,), generator=g)
    return [tokens[s : s + length].tolist() for s in starts.tolist()]


def regenerate(target: str, data: DictConfig, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's continuations of training-split prompts through nano_vllm: token ids [N, P + G]
    and the mask of rows whose prediction is of a generated token ([N, P + G], True from P − 1)."""
    p, n = int(data.prompt_len), int(data.max_tokens)
    prompts = prompt_windows(str(data.corpus), "train", int(data.num_prompts), p, int(data.seed))
    temp = float(data.temperature)
    params = [SamplingParams(temperature=temp, max_tokens=n, ignore_eos=True,
                             seed=None if temp == 0 else int(data.seed) + i)
              for i in range(len(prompts))]
    llm = PlainLLM(target, **engine_args(len(prompts), p + n, device))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    report(f"regenerated {len(outs)} x {n} tokens with the target in {time.perf_counter() - t0:.1f}s")
    del llm
    ids = torch.tensor([q + o.token_ids for q, o in zip(prompts, outs)])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, p - 1 :] = True
    return ids, mask


# ----------------------------------------------------------------------------------- the losses
def medusa_loss(heads: MedusaHeads, target: CausalLM, decay: float) -> Loss:
    """Medusa-1 (§2.2.1): Σ_k λ_k · CE(head k at t, x_{t+k+1}), λ_k = decay^k, target frozen."""

    def loss(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            f = target.model(ids)
        s, total = ids.shape[1], 0.0
        for k in range(1, heads.num_heads + 1):  # head by head on its rows: no [B, S, K, V] logits
            logits = heads.medusa_head[k - 1](f[:, : s - k - 1])
            if heads.share_lm_head:
                logits = target.compute_logits(logits)
            ce = F.cross_entropy(logits.float().flatten(0, 1), ids[:, k + 1 :].flatten(),
                                 reduction="none")
            m = mask[:, k : s - 1].flatten().float()
            total = total + decay**k * (ce * m).sum() / m.sum().clamp(min=1)
        return total

    return loss


def eagle_loss(draft: EagleDraft, target: CausalLM, w_cls: float, noise: float) -> Loss:
    """EAGLE §4.2: smooth-L1(f̂_{j+1}, f_{j+1}) + w_cls · CE(p_{j+2}, p̂_{j+2}) over the pairs
    (f_j + U(−noise, noise), x_{j+1})."""

    def loss(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            f = target.model(ids)
            p = target.compute_logits(f[:, 1:]).float().softmax(-1)
        fin = f[:, :-1] + noise * (2 * torch.rand_like(f[:, :-1]) - 1)
        positions = torch.arange(ids.shape[1] - 1, device=ids.device).expand_as(ids[:, 1:])
        fhat = draft(ids[:, 1:], positions, None, features=fin)
        reg = F.smooth_l1_loss(fhat.float(), f[:, 1:].float(), reduction="none").mean(-1)
        cls = -(p * F.log_softmax(target.compute_logits(fhat).float(), -1)).sum(-1)
        m = mask[:, 1:].float()
        return ((reg + w_cls * cls) * m).sum() / m.sum().clamp(min=1)

    return loss


def draft_model_loss(draft: CausalLM) -> Loss:
    """Next-token cross-entropy on the target's generated tokens."""

    def loss(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(draft(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten(),
                             reduction="none")
        m = mask[:, :-1].flatten().float()
        return (ce * m).sum() / m.sum().clamp(min=1)

    return loss


# ----------------------------------------------------------------------------------- the drafts
def build_draft(method: str, target: CausalLM, cfg: DictConfig) -> tuple[nn.Module, ModelConfig,
                                                                          dict, Loss]:
    """(the draft, the ModelConfig its config.json holds, config.json's extra keys, its loss)."""
    tc = target.config
    torch.manual_seed(int(cfg.train.seed))
    if method == "medusa":
        m = cfg.medusa
        heads = MedusaHeads(target, int(m.num_heads), int(m.num_layers), bool(m.share_lm_head))
        extra = {"speculative_method": "medusa", "medusa_num_heads": heads.num_heads,
                 "medusa_num_layers": heads.num_layers, "share_lm_head": heads.share_lm_head}
        return heads, tc, extra, medusa_loss(heads, target, float(m.decay))
    if method == "eagle":
        dc = tc.replace(num_hidden_layers=1)
        draft = EagleDraft(dc, target)
        for module in draft.modules():  # HF's init (shared.model's), the FC layer's bias zero
            if isinstance(module, nn.Linear):
                module.weight.data.normal_(0.0, tc.initializer_range)
                if module.bias is not None:
                    module.bias.data.zero_()
        return draft, dc, {"speculative_method": "eagle"}, eagle_loss(
            draft, target, float(cfg.eagle.w_cls), float(cfg.eagle.noise))
    dc = tc.replace(num_hidden_layers=int(cfg.draft_model.num_hidden_layers))
    draft = CausalLM(dc).init_weights(int(cfg.train.seed))
    if cfg.draft_model.init_from_target:
        own = draft.state_dict()
        draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in own}, strict=False)
    return draft, dc, {}, draft_model_loss(draft)


class DraftTrainer:
    """shared.train's engine contract (`train_step(micro_batches, lr) -> StepResult`) for a draft
    beside a frozen target: each micro-batch's loss, backward, the global grad norm, one AdamW step."""

    def __init__(self, draft: nn.Module, loss: Loss, cfg: TrainConfig):
        self.draft, self.loss, self.cfg = draft, loss, cfg
        self.opt = MixedPrecisionAdamW([p for p in draft.parameters() if p.requires_grad], cfg,
                                       foreach=False)
        draft.to(cfg.torch_dtype).train()

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                   lr: float) -> StepResult:
        total = 0.0
        for ids, mask in micro_batches:
            loss = self.loss(ids, mask) / len(micro_batches)
            loss.backward()
            total += loss.item()
        grads = self.opt.master_grads()
        norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))
        self.opt.step(norm, self.cfg.grad_clip, lr)
        return StepResult(loss=total, grad_norm=float(norm))


def train_loop(trainer: DraftTrainer, ids: torch.Tensor, mask: torch.Tensor, cfg: TrainConfig,
               log_dir: Path) -> list[dict]:
    """`cfg.steps` steps of `cfg.global_batch_size` rows drawn at random (seeded) from the data, on
    shared.train's schedule; records to log_dir/metrics.jsonl."""
    from tqdm.auto import tqdm

    device = next(trainer.draft.parameters()).device
    g = torch.Generator().manual_seed(cfg.seed)
    records = []
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "metrics.jsonl", "w") as log:
        for step in tqdm(range(cfg.steps), desc="train", unit="step", dynamic_ncols=True):
            rows = torch.randint(0, len(ids), (cfg.global_batch_size,), generator=g)
            batch = micro_batches_of(ids[rows].to(device), mask[rows].to(device),
                                     cfg.micro_batch_size)
            lr = lr_at(step, cfg)
            result = trainer.train_step(batch, lr)
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                rec = {"step": step + 1, "loss": result.loss, "lr": lr,
                       "grad_norm": result.grad_norm}
                records.append(rec)
                log.write(json.dumps(rec) + "\n")
                report(f"step {step + 1:>6} | loss {result.loss:.4f} | lr {lr:.2e} | "
                       f"grad_norm {result.grad_norm:.3f}")
    return records


def measure_tau(target: str, method: str, draft: str, ev: DictConfig, corpus: str, device: str,
                seed: int) -> dict[str, Any]:
    """τ and acceptance by draft position of `draft` in the engine, greedy, on held-out prompts."""
    from nano_specdec.engine import LLM

    prompt_len = 32
    prompts = prompt_windows(corpus, "val", int(ev.num_prompts), prompt_len, seed)
    spec = {"method": method, "model": draft,
            "num_speculative_tokens": int(ev.num_speculative_tokens)}
    llm = LLM(target, speculative_config=spec,
              **engine_args(len(prompts), prompt_len + int(ev.max_tokens), device))
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=int(ev.max_tokens),
                                         ignore_eos=True), use_tqdm=False)
    stats = llm.engine.spec_decode_stats
    return {"tau": stats.mean_tokens_per_verification, "num_verifications": stats.num_verifications,
            "accepted_by_position": [a / max(stats.num_verifications, 1)
                                     for a in stats.accepted_by_position]}


def run(cfg: DictConfig) -> dict[str, Any]:
    """Everything `main` does, callable without Hydra (tests): returns the run's summary."""
    for key in ("target", "out"):
        if not cfg.get(key):
            raise ValueError(f"{key}=DIR is required (target: the target checkpoint, out: where the "
                             "draft goes)")
    method = str(cfg.method)
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    for key in ("data.num_prompts", "data.prompt_len", "data.max_tokens", "medusa.num_heads",
                "medusa.num_layers", "draft_model.num_hidden_layers", "eval.num_speculative_tokens"):
        value = OmegaConf.select(cfg, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be an int >= 1, got {value!r}")
    tcfg = to_dataclass(TrainConfig, cfg.train, seq_len=int(cfg.data.prompt_len)
                        + int(cfg.data.max_tokens))
    check_batch_sizes(tcfg, 1)
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target_name, out = str(cfg.target), Path(str(cfg.out))
    ids, mask = regenerate(target_name, cfg.data, device)
    ecfg = EngineConfig(model=target_name, device=device, dtype="float32")
    target = load_engine_model(ecfg, resolve_model_config(target_name), torch.device(device))
    target.requires_grad_(False).to(tcfg.torch_dtype).eval()
    draft, draft_config, extra, loss = build_draft(method, target, cfg)
    draft.to(device)
    trainer = DraftTrainer(draft, loss, tcfg)
    t0 = time.perf_counter()
    records = train_loop(trainer, ids, mask, tcfg, Path(hydra_run_dir(str(out))))
    seconds = time.perf_counter() - t0
    state = {k: master.detach() for k, master in zip(
        [k for k, p in draft.named_parameters() if p.requires_grad], trainer.opt.master)}
    state = {**draft.state_dict(), **state}  # fp32 master weights over the bf16 copies
    save_checkpoint(state, draft_config, out, config_extra=extra)
    summary: dict[str, Any] = {"method": method, "out": str(out), "train_seconds": seconds,
                               "final_loss": records[-1]["loss"] if records else None}
    if int(cfg.eval.num_prompts) > 0:
        summary.update(measure_tau(target_name, method, str(out), cfg.eval, str(cfg.data.corpus),
                                   device, int(cfg.data.seed)))
    report(f"{method} draft of {target_name} -> {out} in {seconds:.1f}s of training"
           + (f"; τ {summary['tau']:.2f} (greedy, k={cfg.eval.num_speculative_tokens}, held-out "
              "prompts)" if "tau" in summary else ""))
    return summary


@hydra.main(version_base=None, config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
