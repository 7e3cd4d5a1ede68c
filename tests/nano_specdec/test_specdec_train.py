"""nano_specdec.train: drafts trained on the target's own generations are accepted where untrained ones
are not (τ in the engine, on held-out prompts); the checkpoints are HF-style directories the engine
loads (and refuses for another method); the losses see only predictions of generated tokens; bad
arguments fail before anything is generated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from specdec_checkpoints import train_draft

from nano_specdec.train import DraftTrainer, eagle_loss, medusa_loss, regenerate
from shared.checkpoint import load_state_dict
from shared.train import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("method", ["eagle", "medusa", "draft_model"])
def test_a_trained_draft_is_accepted_where_an_untrained_one_is_not(method, trained_drafts,
                                                                  untrained_drafts):
    trained, untrained = trained_drafts[method][1], untrained_drafts[method][1]
    print(f"{method}: τ trained {trained['tau']:.2f}, untrained {untrained['tau']:.2f}")
    assert trained["tau"] > 1.5 > untrained["tau"]
    assert trained["final_loss"] < untrained["final_loss"]
    assert len(trained["accepted_by_position"]) == 3  # eval.num_speculative_tokens
    assert trained["accepted_by_position"][0] >= trained["accepted_by_position"][-1]


def test_checkpoints_are_hf_directories_named_for_their_method(trained_drafts, cycle_target):
    eagle, medusa, draft = (Path(trained_drafts[m][0]) for m in ("eagle", "medusa", "draft_model"))
    target = json.loads((Path(cycle_target) / "config.json").read_text())
    for path, method in ((eagle, "eagle"), (medusa, "medusa")):
        config = json.loads((path / "config.json").read_text())
        assert config["speculative_method"] == method
        assert config["hidden_size"] == target["hidden_size"]
        assert config["vocab_size"] == target["vocab_size"]
        assert not list(path.glob(".*.tmp"))  # written atomically: no temporary file left
    assert json.loads((eagle / "config.json").read_text())["num_hidden_layers"] == 1
    names = set(load_state_dict(eagle))
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)  # the target's, not saved
    config = json.loads((medusa / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 1)
    assert set(load_state_dict(medusa)) == {f"medusa_head.{k}.{name}" for k in range(3) for name in
                                            ("0.linear.weight", "0.linear.bias", "1.weight")}
    config = json.loads((draft / "config.json").read_text())
    assert "speculative_method" not in config and config["num_hidden_layers"] == 1  # a plain model


def test_regenerated_data_is_the_targets_greedy_continuation(cycle_target):
    from omegaconf import OmegaConf

    from nano_vllm import LLM, SamplingParams

    data = OmegaConf.create({"corpus": "docs", "num_prompts": 3, "prompt_len": 8, "max_tokens": 6,
                             "temperature": 0.0, "seed": 1})
    ids, mask = regenerate(cycle_target, data, "cpu")
    assert ids.shape == mask.shape == (3, 14)
    assert mask[:, 7:].all() and not mask[:, :7].any()  # predictions of generated tokens only
    outs = LLM(cycle_target, device="cpu").generate(
        [row[:8] for row in ids.tolist()], SamplingParams(temperature=0.0, max_tokens=6),
        use_tqdm=False)
    assert [o.token_ids for o in outs] == ids[:, 8:].tolist()


def test_losses_cover_the_masked_predictions_and_train_the_draft_only(cycle_target):
    from nano_specdec.eagle import EagleDraft
    from nano_specdec.medusa import MedusaHeads
    from shared.checkpoint import load_model

    target = load_model(cycle_target).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (2, 12), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 5:] = True
    heads = MedusaHeads(target, 2)
    draft = EagleDraft(target.config.replace(num_hidden_layers=1), target)
    for loss in (medusa_loss(heads, target, 0.8), eagle_loss(draft, target, 0.1, 0.0)):
        assert loss(ids, torch.zeros_like(mask)).item() == 0.0  # no generated token: nothing to learn
        value = loss(ids, mask)
        assert torch.isfinite(value) and value.item() > 0
    cfg = TrainConfig(steps=2, global_batch_size=2, micro_batch_size=1, seq_len=12, lr=1e-3)
    trainer = DraftTrainer(draft, eagle_loss(draft, target, 0.1, 0.0), cfg)
    result = trainer.train_step([(ids[:1], mask[:1]), (ids[1:], mask[1:])], 1e-3)
    assert result.grad_norm > 0
    assert all(p.grad is None for p in target.parameters())


@pytest.mark.parametrize("overrides, error, match", [
    (["method=lookahead"], ValueError, "method must be one of"),
    (["out="], ValueError, "out=DIR is required"),
    (["target="], ValueError, "target=DIR is required"),
    (["method=draft_model", "draft_model.num_hidden_layers=0"], ValueError, "num_hidden_layers"),
    (["train.micro_batch_size=0"], ValueError, "micro_batch_size"),
])
def test_bad_arguments_fail_before_anything_runs(cycle_target, tmp_path, overrides, error, match):
    with pytest.raises(error, match=match):
        train_draft(cycle_target, "eagle", tmp_path / "out", overrides)
    assert not (tmp_path / "out" / "config.json").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_cuda_training_in_bf16_gives_an_accepted_draft(cycle_target, tmp_path, method):
    """On the GPU: regeneration and τ through nano_vllm with its layers, the draft trained in bf16
    (fp32 master weights, which the checkpoint holds)."""
    summary = train_draft(cycle_target, method, tmp_path / method, ["device=cuda", "train.dtype=bf16"])
    assert summary["tau"] > 1.5
    assert all(t.dtype == torch.float32 for t in load_state_dict(tmp_path / method).values())
