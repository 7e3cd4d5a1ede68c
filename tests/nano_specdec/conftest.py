"""Random small HF checkpoints made with transformers (never by us) for the engine tests: a target, a
smaller unrelated draft and a near copy of the target (both of its vocabulary), a draft of another
vocabulary, and a toy pair over 16 tokens for the distribution test. Norm weights are perturbed away from 1 and the init scale raised so the argmax is
decisive (as tests/nano_vllm's checkpoints: a near-tie would make "token for token" a coin flip under
fp32 reordering)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_checkpoints import UNTRAINED, make_checkpoint, train_draft  # noqa: E402


@pytest.fixture(scope="session")
def target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), seed=1)


@pytest.fixture(scope="session")
def small_draft(tmp_path_factory):
    """Smaller (one layer, hidden 32) and unrelated to the target: nearly every draft is rejected."""
    return make_checkpoint(tmp_path_factory.mktemp("small_draft"), seed=2, layers=1, hidden=32)


@pytest.fixture(scope="session")
def near_draft(target, tmp_path_factory):
    """The target with noise on its decoder layers (0.15 of each weight's spread): it agrees with the
    target often but not always, so verifications accept some drafts and reject the rest."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target)
    torch.manual_seed(6)
    with torch.no_grad():
        for p in model.model.layers.parameters():
            p.add_(0.15 * p.std() * torch.randn_like(p))
    path = tmp_path_factory.mktemp("near_draft")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def other_vocab(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("other_vocab"), seed=3, vocab_size=1000,
                           layers=1, hidden=32)


@pytest.fixture(scope="session")
def toy_pair(tmp_path_factory):
    """A target and a strongly different draft over 16 tokens (high-entropy rows)."""
    return (make_checkpoint(tmp_path_factory.mktemp("toy_target"), seed=4, vocab_size=16,
                            init=0.02),
            make_checkpoint(tmp_path_factory.mktemp("toy_draft"), seed=5, vocab_size=16, layers=1,
                            init=0.1))


# --------------------------------------------------------------------------- trained drafts
@pytest.fixture(scope="session")
def cycle_target(tmp_path_factory):
    from specdec_checkpoints import make_cycle_target

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return make_cycle_target(tmp_path_factory.mktemp("cycle_target"))
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="session")
def trained_drafts(cycle_target, tmp_path_factory):
    """{method: (checkpoint directory, the training run's summary)} for eagle, medusa, draft_model, each
    trained for a second or two on the cycle target's own generations."""
    out = {}
    for method in ("eagle", "medusa", "draft_model"):
        path = tmp_path_factory.mktemp(f"trained_{method}")
        out[method] = (str(path), train_draft(cycle_target, method, path, []))
    return out


@pytest.fixture(scope="session")
def untrained_drafts(cycle_target, tmp_path_factory):
    """The same drafts as saved by a run at learning rate 0 (Medusa's heads as initialised: the
    identity and the target's LM head; the draft model from random weights)."""
    out = {}
    for method in ("eagle", "medusa", "draft_model"):
        path = tmp_path_factory.mktemp(f"untrained_{method}")
        out[method] = (str(path), train_draft(cycle_target, method, path, UNTRAINED))
    return out
