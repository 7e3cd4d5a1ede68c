"""shared.train: the one training loop, its LR schedule, loss normalisation, checkpoint/resume and metrics,
driven through the single-process LocalEngine (the oracle the parallel engines are tested against)."""

import itertools
import json
import logging
import math

import pytest
import torch

from shared.checkpoint import load_model
from shared.config import ModelConfig
from shared.data import TokenBatches
from shared.hydra_utils import model_config_from, to_dataclass
from shared.train import (
    LocalEngine,
    TrainConfig,
    check_batch_sizes,
    lr_at,
    micro_batches_of,
    next_token_loss,
    train,
)

TINY = ModelConfig.from_name("tiny").replace(num_hidden_layers=1)


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(steps=10, global_batch_size=4, micro_batch_size=2, seq_len=32, lr=3e-3, min_lr=3e-4,
                warmup_steps=3, out_dir=str(tmp_path))
    return TrainConfig(**{**base, **kw})


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=20, lr=1.0, min_lr=0.1, warmup_steps=5)
    lrs = [lr_at(s, cfg) for s in range(cfg.steps)]
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert lrs[5] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(lrs[5:]))  # non-increasing after warm-up
    mid = 5 + (cfg.steps - 1 - 5) / 2  # halfway through the decay: the mean of lr and min_lr
    assert lr_at(int(mid), cfg) == pytest.approx(0.55)
    assert lr_at(0, TrainConfig(steps=3, lr=1.0, min_lr=0.5, warmup_steps=0)) == 1.0


def test_loss_normalised_by_global_batch_makes_accumulation_exact():
    """Splitting a batch into micro-batches only re-associates a sum: the same gradients up to fp32
    rounding. (Parameters after an Adam step differ more, ≈ lr·1e-3, where |g| is near Adam's eps.)"""
    cfg = TrainConfig(steps=2, global_batch_size=4, micro_batch_size=4, seq_len=16, grad_clip=0.5)
    x, y = TokenBatches.from_corpus("train", batch_size=4, seq_len=16).next_batch()
    whole, split = LocalEngine(TINY, cfg), LocalEngine(TINY, cfg)
    for engine, micro in ((whole, 4), (split, 1)):
        for xm, ym in micro_batches_of(x, y, micro):
            next_token_loss(engine.model(xm), ym, y.numel()).backward()
    for (name, a), b in zip(whole.model.named_parameters(), split.model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=1e-5, msg=name)
        a.grad = b.grad = None
    r1 = whole.train_step(micro_batches_of(x, y, 4), lr=1e-3)
    r2 = split.train_step(micro_batches_of(x, y, 1), lr=1e-3)
    assert r1.loss == pytest.approx(r2.loss, abs=1e-5) and r1.grad_norm == pytest.approx(r2.grad_norm, rel=1e-5)
    for a, b in zip(whole.model.parameters(), split.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    logits = torch.randn(2, 3, 5)
    t = torch.randint(0, 5, (2, 3))
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 5), t.reshape(-1))
    assert next_token_loss(logits, t, 6).item() == pytest.approx(ref.item())
    assert next_token_loss(logits, t, 12).item() == pytest.approx(ref.item() / 2)


def test_local_engine_loss_falls_and_metrics_are_logged(tmp_path):
    cfg = _cfg(tmp_path, steps=30, global_batch_size=8, micro_batch_size=4, seq_len=64, lr=1e-2, min_lr=1e-3,
               log_every=2)
    engine = LocalEngine(TINY, cfg)
    records = train(engine, cfg)
    assert [r["step"] for r in records] == list(range(2, 31, 2))
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-3:]) / 3
    # From ln(4096) = 8.3 (uniform) to below 7.4: at least the token frequencies are learned.
    assert first > 8.0 and last < 7.4, (first, last)
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == records
    for r in lines:
        assert set(r) == {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"}
        assert r["mfu"] is None and r["tokens_per_s"] > 0 and math.isfinite(r["grad_norm"])
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, cfg))
    mfu = train(LocalEngine(TINY, cfg), _cfg(tmp_path / "b", steps=1), peak_flops=1e12)
    assert 0 < mfu[0]["mfu"] < 1


def test_resume_continues_the_same_run(tmp_path):
    """Train 10 steps == train 6, save, resume into a fresh engine, train 4 (bitwise on CPU fp32)."""
    straight = LocalEngine(TINY, _cfg(tmp_path / "a"))
    rec_a = train(straight, _cfg(tmp_path / "a"))
    first = LocalEngine(TINY, _cfg(tmp_path / "b"))
    rec_b = train(first, _cfg(tmp_path / "b", stop_at=6))
    resumed = LocalEngine(TINY, _cfg(tmp_path / "c"))
    rec_c = train(resumed, _cfg(tmp_path / "c", resume_from=str(tmp_path / "b" / "checkpoint")))
    assert [r["step"] for r in rec_b + rec_c] == list(range(1, 11))
    assert [r["loss"] for r in rec_b + rec_c] == [r["loss"] for r in rec_a]
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_periodic_save_and_checkpoint_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = _cfg(tmp_path, steps=4, save_every=2)
    engine = LocalEngine(TINY, cfg)
    train(engine, cfg)
    ckpt = tmp_path / "checkpoint"
    assert (ckpt / "config.json").is_file() and (ckpt / "resume" / "loop-rank00000.pt").is_file()
    assert not (ckpt / "resume.tmp").exists()
    assert torch.load(ckpt / "resume" / "loop-rank00000.pt", weights_only=True)["step"] == 4
    ids = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        ref = engine.model(ids)
        assert (hf(input_ids=ids).logits - ref).abs().max().item() <= 1e-4
        assert torch.equal(load_model(ckpt)(ids), ref)


def test_bf16_mixed_precision_keeps_fp32_master():
    cfg = TrainConfig(steps=1, global_batch_size=2, micro_batch_size=2, seq_len=16, dtype="bf16")
    x, y = TokenBatches.from_corpus("train", batch_size=2, seq_len=16).next_batch()
    engine, ref = LocalEngine(TINY, cfg), LocalEngine(TINY, TrainConfig(**{**cfg.__dict__, "dtype": "fp32"}))
    assert engine.model.lm_head.weight.dtype == torch.bfloat16
    res, res_ref = engine.train_step([(x, y)], lr=1e-3), ref.train_step([(x, y)], lr=1e-3)
    assert abs(res.loss - res_ref.loss) < 0.05 and abs(res.loss - math.log(TINY.vocab_size)) < 0.5
    state = engine.consolidated_state_dict()
    assert all(t.dtype == torch.float32 for t in state.values())
    for name, t in ref.consolidated_state_dict().items():  # one bf16 step ≈ one fp32 step
        torch.testing.assert_close(state[name], t, atol=2e-3, rtol=0, msg=name)
        assert torch.equal(engine.model.state_dict()[name], state[name].bfloat16())  # bf16 copy of master


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"global_batch_size \(6\) must be divisible by micro_batch_size "
                                         r"\(4\) x data-parallel size \(1\)"):
        train(LocalEngine(TINY, _cfg(tmp_path)), _cfg(tmp_path, global_batch_size=6, micro_batch_size=4))
    with pytest.raises(ValueError, match=r"data-parallel size \(3\)"):
        check_batch_sizes(_cfg(tmp_path, global_batch_size=8, micro_batch_size=2), 3)
    assert check_batch_sizes(_cfg(tmp_path, global_batch_size=8, micro_batch_size=2), 2) == 2
    with pytest.raises(ValueError, match="dtype must be one of"):
        TrainConfig(dtype="fp16")
    with pytest.raises(ValueError, match="steps must be a positive int"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="min_lr <= lr"):
        TrainConfig(lr=1e-4, min_lr=1e-3)
    with pytest.raises(ValueError, match="stop_at"):
        TrainConfig(steps=5, stop_at=6)
    with pytest.raises(FileNotFoundError, match="not a resume checkpoint"):
        train(LocalEngine(TINY, _cfg(tmp_path)), _cfg(tmp_path, resume_from=str(tmp_path / "nope")))


def test_hydra_helpers():
    from omegaconf import OmegaConf

    node = OmegaConf.create({"preset": "tiny", "num_hidden_layers": 2})
    assert model_config_from(node) == ModelConfig.from_name("tiny").replace(num_hidden_layers=2)
    assert model_config_from("tiny") == ModelConfig.from_name("tiny")
    cfg = to_dataclass(TrainConfig, OmegaConf.create({"steps": 3, "lr": 1e-3}), out_dir="/x")
    assert (cfg.steps, cfg.lr, cfg.out_dir) == (3, 1e-3, "/x")
    with pytest.raises(ValueError, match=r"unknown TrainConfig field\(s\) \['stpes'\]"):
        to_dataclass(TrainConfig, {"stpes": 3})


def test_clip_coefficient_on_device_equals_the_host_one():
    from shared.train import clip_coefficient, clip_coefficient_on_device

    for norm in (0.25, 1.0, 3.0, 1e4):
        t = torch.tensor(norm, dtype=torch.float64)
        assert float(clip_coefficient_on_device(t, 1.0)) == pytest.approx(clip_coefficient(t, 1.0), rel=1e-7)
    assert clip_coefficient_on_device(torch.tensor(5.0), 0.0) is None


def test_resume_into_the_same_directory_logs_each_step_once(tmp_path):
    """A run saved at step 4 and killed in step 6, then resumed into its own directory: metrics.jsonl
    lists steps 1-8 once each (the killed run's step 5 is replaced by the resumed one's)."""
    engine = LocalEngine(TINY, _cfg(tmp_path, steps=8, save_every=4))
    step, calls = engine.train_step, []

    def dies_in_step_6(*args):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt("killed")
        return step(*args)

    engine.train_step = dies_in_step_6
    with pytest.raises(KeyboardInterrupt):
        train(engine, _cfg(tmp_path, steps=8, save_every=4))
    (tmp_path / "metrics.jsonl").open("a").write('{"step": 6, "lo')  # a line cut short by the kill
    resumed = train(LocalEngine(TINY, _cfg(tmp_path, steps=8)),
                    _cfg(tmp_path, steps=8, resume_from=str(tmp_path / "checkpoint")))
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 9))
    assert lines[4:] == resumed


def test_seq_len_longer_than_the_model_raises(tmp_path):
    cfg = _cfg(tmp_path, seq_len=4096)
    with pytest.raises(ValueError, match=r"train.seq_len \(4096\) exceeds the model's max_position_embeddings "
                                         r"\(2048\)"):
        train(LocalEngine(TINY, cfg), cfg)
    assert not (tmp_path / "checkpoint").exists()


def test_run_reports_where_the_checkpoint_went(tmp_path, capsys, caplog):
    cfg = _cfg(tmp_path, steps=1)
    train(LocalEngine(TINY, cfg), cfg)
    ckpt = (tmp_path / "checkpoint").resolve()
    assert f"checkpoint of step 1: {ckpt}" in capsys.readouterr().out
    with caplog.at_level(logging.INFO, logger="nano_infra"):  # logging set up, as in a Hydra app
        train(LocalEngine(TINY, cfg), _cfg(tmp_path, steps=1))
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("step      1 | loss") for m in messages)
    assert f"checkpoint of step 1: {ckpt} (HF format" in messages[-1]


def test_resume_point_survives_a_save_killed_between_its_renames(tmp_path):
    """A save swaps `resume` out to `resume.old` before swapping the new one in: killed in between, the
    previous resume point is still found."""
    from shared.train import resume_directory

    cfg = _cfg(tmp_path, steps=2)
    train(LocalEngine(TINY, cfg), cfg)
    ckpt = tmp_path / "checkpoint"
    assert resume_directory(ckpt) == ckpt / "resume" and not (ckpt / "resume.old").exists()
    (ckpt / "resume").rename(ckpt / "resume.old")
    assert resume_directory(ckpt) == ckpt / "resume.old"
    assert train(LocalEngine(TINY, cfg), _cfg(tmp_path / "b", steps=3, resume_from=str(ckpt)))[0]["step"] == 3


def test_resume_past_the_last_step_is_refused_and_writes_nothing(tmp_path):
    """A checkpoint of step 4 resumed with train.steps=2 (or stop_at=3) holds weights of step 4: the run
    refuses before writing, instead of saving them labelled step 2. At step 4 itself: nothing to train."""
    train(LocalEngine(TINY, _cfg(tmp_path / "a", steps=4)), _cfg(tmp_path / "a", steps=4))
    ckpt = tmp_path / "a" / "checkpoint"
    for kw, name in (({"steps": 2}, "train.steps=2"), ({"steps": 8, "stop_at": 3}, "train.stop_at=3")):
        cfg = _cfg(tmp_path / "b", resume_from=str(ckpt), **kw)
        with pytest.raises(ValueError, match=rf"train.resume_from: checkpoint '{ckpt}' is at step 4, past "
                                             rf"{name}: nothing to train \(set {name[:-2]} above 4"):
            train(LocalEngine(TINY, cfg), cfg)
        assert not (tmp_path / "b").exists()
    before = torch.load(ckpt / "resume" / "loop-rank00000.pt", weights_only=True)
    assert before["step"] == 4 and before["data"]["step"] == 4  # the resumed checkpoint is left as it was
    cfg = _cfg(tmp_path / "c", steps=4, resume_from=str(ckpt))
    assert train(LocalEngine(TINY, cfg), cfg) == []
    loop = torch.load(tmp_path / "c" / "checkpoint" / "resume" / "loop-rank00000.pt", weights_only=True)
    assert loop["step"] == loop["data"]["step"] == 4


def test_resume_of_another_model_names_the_checkpoint_and_the_difference(tmp_path):
    cfg = _cfg(tmp_path / "a", steps=1)
    train(LocalEngine(TINY, cfg), cfg)
    ckpt = tmp_path / "a" / "checkpoint"
    other = TINY.replace(num_hidden_layers=2, hidden_size=64, head_dim=16)
    cfg = _cfg(tmp_path / "b", steps=2, resume_from=str(ckpt / "resume"))
    with pytest.raises(ValueError, match=rf"train.resume_from: checkpoint '{ckpt}' holds another model than "
                                         r"this run's \(hidden_size 128 in the checkpoint, 64 in this run; "
                                         r"num_hidden_layers 1 in the checkpoint, 2 in this run; head_dim 32 in "
                                         r"the checkpoint, 16 in this run\)"):
        train(LocalEngine(other, cfg), cfg)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("content", [b"\x80\x02garbage", b"", "a dict without the loop's keys"])
def test_unreadable_resume_files_name_the_file(tmp_path, content):
    cfg = _cfg(tmp_path / "a", steps=1)
    train(LocalEngine(TINY, cfg), cfg)
    resume = tmp_path / "a" / "checkpoint" / "resume"
    for name, what in (("loop-rank00000.pt", "loop-state"), ("local_engine.pt", "LocalEngine resume")):
        saved = (resume / name).read_bytes()
        if isinstance(content, str):
            torch.save({"something": 1}, resume / name)
        else:
            (resume / name).write_bytes(content)
        held = r": it holds a dict without \[" if isinstance(content, str) else r": torch.load cannot read it"
        cfg = _cfg(tmp_path / "b", steps=2, resume_from=str(resume.parent))
        with pytest.raises(ValueError, match=rf"'{resume / name}' is not a {what} file{held}"):
            train(LocalEngine(TINY, cfg), cfg)
        (resume / name).write_bytes(saved)
