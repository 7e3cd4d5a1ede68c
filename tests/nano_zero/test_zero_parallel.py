"""nano_zero on gloo ranks against single-process training, torch's ZeroRedundancyOptimizer + DDP and FSDP2.

Spawning torch processes costs seconds on a 2-core CI box, so each world size is ONE `run_distributed` call
that runs every check and returns the results; the test functions below only compare. The model has odd
sizes (hidden 127, intermediate 383) so that no unit divides by the world size: every run is padded.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nano_zero import ZeroDataParallel, ZeroEngine
from shared.config import ModelConfig
from shared.data import TokenBatches
from shared.dist import DistributedError, run_distributed
from shared.model import build_model
from shared.train import LocalEngine, TrainConfig, decays, lr_at, micro_batches_of, next_token_loss, train

ODD = ModelConfig.from_name("tiny").replace(num_hidden_layers=2, hidden_size=127, intermediate_size=383)
GLOBAL_BATCH, SEQ, STEPS = 8, 16, 5
# fp32. The reference runs the same micro-batches in one process, so only summation orders differ (across
# ranks, in the norm of shards); Adam's first steps (≈ lr·sign(g)) amplify them where |g| is near
# rounding noise, hence a modest peak lr. Observed: ≤ 6e-6 at world 2.
TOL = 1e-5
PEER_TOL = 1e-6


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # see tests/conftest.py


def _cfg(micro: int, **kw) -> TrainConfig:
    base = dict(steps=STEPS, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro, seq_len=SEQ, lr=1e-3,
                min_lr=1e-4, warmup_steps=2, grad_clip=1.0, weight_decay=0.1)
    return TrainConfig(**{**base, **kw})


def _run(engine, cfg: TrainConfig, rank: int, world: int, steps: int = STEPS) -> list[tuple[float, float]]:
    """The loop's data and schedule without its checkpointing: (loss, grad_norm) per step."""
    data = TokenBatches.from_corpus("train", batch_size=cfg.global_batch_size // world, seq_len=cfg.seq_len,
                                    seed=cfg.seed, rank=rank, world_size=world)
    out = []
    for step in range(steps):
        x, y = data.next_batch()
        r = engine.train_step(micro_batches_of(x, y, cfg.micro_batch_size), lr_at(step, cfg))
        out.append((r.loss, r.grad_norm))
    return out


def _peer(kind: str, cfg: TrainConfig, rank: int, world: int, steps: int = 3) -> dict[str, torch.Tensor]:
    """torch's own ZeRO-1 (ZeroRedundancyOptimizer over DDP) or ZeRO-3 (FSDP2 fully_shard), same recipe."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(ODD, seed=cfg.seed)
    if kind == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)  # replaces the parameters by DTensor shards: build the optimizer after
    params = list(model.parameters())
    groups = [{"params": [p for p in params if decays(p)], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if kind == "zero1":
        run = DDP(model)
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kw)
    else:
        run = model
        opt = torch.optim.AdamW(groups, **kw, foreach=False)
    data = TokenBatches.from_corpus("train", batch_size=cfg.global_batch_size // world, seq_len=cfg.seq_len,
                                    seed=cfg.seed, rank=rank, world_size=world)
    for step in range(steps):
        x, y = data.next_batch()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        # DDP and FSDP average gradients over ranks, so the loss is this rank's mean.
        next_token_loss(run(x), y, y.numel()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}
    return full if rank == 0 else {}


class Twice(nn.Module):
    """Both blocks run twice per forward: a module used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 5)])
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        for _ in range(2):
            x = torch.tanh(self.blocks[1](torch.tanh(self.blocks[0](x))))
        return self.head(x)


def _twice_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(3, 8, 5, generator=g), torch.randn(3, 8, 3, generator=g)  # 3 steps of 8 rows


def _twice_train(stage: int | None, rank: int, world: int) -> dict[str, torch.Tensor]:
    """stage None: plain single-process torch AdamW on the whole batch (the reference)."""
    torch.manual_seed(0)
    module = Twice()
    xs, ys = _twice_data()
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    if stage is None:
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), foreach=False)
    else:
        zm = ZeroDataParallel(module, stage, betas=(0.9, 0.95))
    for step in range(3):
        out = (module if stage is None else zm)(xs[step][rows])
        ((out - ys[step][rows]) ** 2).sum().div(ys[step].numel()).backward()
        if stage is None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), 0.1)
            opt.step()
            opt.zero_grad()
        else:
            zm.step(1e-2, max_norm=0.1)
    return zm.full_state_dict() if stage is not None else dict(module.state_dict())


def _world_job(tmp: str, full: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    res: dict = {}
    accumulations = (1, 4) if world == 2 else (2,)
    for stage in (0, 1, 2, 3) if full else (1, 2, 3):
        for acc in accumulations:
            cfg = _cfg(GLOBAL_BATCH // (world * acc))
            engine = ZeroEngine(ODD, cfg, stage)
            res["train", stage, acc] = {
                "hist": _run(engine, cfg, rank, world), "state": engine.consolidated_state_dict(),
                "comm": engine.last_step_comm, "padded": [u.padded for u in engine.model.units],
                "numel": [u.numel for u in engine.model.units]}
    if not full:
        return res
    for stage in (1, 3):  # the peers' comparison point: 3 steps, no accumulation
        engine = ZeroEngine(ODD, _cfg(4), stage)
        _run(engine, _cfg(4), rank, world, steps=3)
        res["ours3", stage] = engine.consolidated_state_dict()
    res["peer", "zero1"] = _peer("zero1", _cfg(4), rank, world)
    res["peer", "fsdp2"] = _peer("fsdp2", _cfg(4), rank, world)
    for stage in (0, 1, 2, 3):  # bf16 mixed precision: the memory ledger after a step
        engine = ZeroEngine(ODD, _cfg(4, dtype="bf16"), stage)
        hist = _run(engine, _cfg(4, dtype="bf16"), rank, world, steps=1)
        res["bf16", stage] = {"hist": hist, "report": engine.memory_report()}
    for stage in (0, 1, 2, 3):
        res["twice", stage] = _twice_train(stage, rank, world)
    # The loop end to end: 6 steps straight == 4 steps, save, resume into a fresh engine, 2 more.
    runs = {}
    for name, extra in (("a", {}), ("b", {"stop_at": 4}), ("c", {"resume_from": f"{tmp}/b/checkpoint"})):
        cfg = _cfg(2, steps=6, out_dir=f"{tmp}/{name}", **extra)
        engine = ZeroEngine(ODD, cfg, 3)
        records = train(engine, cfg, is_main=rank == 0)
        runs[name] = {"records": records, "state": engine.consolidated_state_dict()}
    res["resume"] = runs
    return res


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero2")
    return run_distributed(_world_job, 2, str(tmp), full=True, timeout_s=300)[0], tmp


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world_job, 4, "", full=False, timeout_s=300)[0]


def _reference(micro: int, steps: int = STEPS, **kw):
    engine = LocalEngine(ODD, _cfg(micro, **kw))
    return _run(engine, _cfg(micro, **kw), 0, 1, steps), engine.consolidated_state_dict()


def _assert_states_close(ours: dict, ref: dict, tol: float) -> None:
    assert set(ours) >= {k for k in ref if k != "lm_head.weight"}
    for name, t in ref.items():
        torch.testing.assert_close(ours[name], t, atol=tol, rtol=0, msg=name)


def _check_training(results: dict, world: int) -> None:
    references = {}
    for key, r in results.items():
        if key[0] != "train":
            continue
        _, stage, acc = key
        micro = GLOBAL_BATCH // (world * acc)
        if micro not in references:
            references[micro] = _reference(micro)
        ref_hist, ref_state = references[micro]
        for (loss, norm), (ref_loss, ref_norm) in zip(r["hist"], ref_hist):
            assert abs(loss - ref_loss) <= TOL and abs(norm - ref_norm) <= 1e-4 * ref_norm, (key, loss, ref_loss)
        _assert_states_close(r["state"], ref_state, TOL)
        # §7: elements moved per step; padded to N so each rank owns an equal shard.
        psi = sum(r["padded"])
        expected = {0: 2 * psi, 1: 2 * psi, 2: 2 * psi, 3: 3 * psi * acc}[stage]
        assert r["comm"][0] == expected, (key, r["comm"], expected)
        assert r["comm"][1] == 4 * expected  # fp32: 4 bytes per element
        assert any(n % world for n in r["numel"]) and all(p % world == 0 for p in r["padded"])


def test_every_stage_equals_single_process_world2(world2):
    results, _ = world2
    assert {k for k in results if k[0] == "train"} == {("train", s, a) for s in range(4) for a in (1, 4)}
    _check_training(results, 2)


def test_stages_1_to_3_equal_single_process_world4(world4):
    assert {k for k in world4 if k[0] == "train"} == {("train", s, 2) for s in (1, 2, 3)}
    _check_training(world4, 4)


def test_stage1_matches_zero_redundancy_optimizer_and_stage3_matches_fsdp2(world2):
    results, _ = world2
    _assert_states_close(results["ours3", 1], results["peer", "zero1"], PEER_TOL)
    _assert_states_close(results["ours3", 3], results["peer", "fsdp2"], PEER_TOL)


def test_bf16_memory_report_matches_formula(world2):
    results, _ = world2
    ref_hist, _ = _reference(4, steps=1, dtype="bf16")
    for stage in range(4):
        r = results["bf16", stage]
        assert abs(r["hist"][0][0] - ref_hist[0][0]) < 0.02  # bf16 rounding, not a different model
        rep = r["report"]
        f = rep.formula
        assert rep.stage == stage and rep.dp == 2 and f.bytes_per_param == pytest.approx(
            {0: 16, 1: 4 + 12 / 2, 2: 2 + 14 / 2, 3: 16 / 2}[stage])
        for measured, formula in ((rep.params, f.params), (rep.grads, f.grads),
                                  (rep.master_weights, f.master_weights),
                                  (rep.optimizer_states, f.optimizer_states), (rep.total, f.total)):
            assert abs(measured - formula) <= 0.05 * formula, (stage, measured, formula)
        assert rep.buffers == 0  # after the step: no gathered unit, no unreduced bucket
        assert "measured MB" in rep.format()


def test_module_used_twice_trains_like_one_process(world2):
    results, _ = world2
    ref = _twice_train(None, 0, 1)
    for stage in range(4):
        _assert_states_close(results["twice", stage], ref, TOL)


def test_train_loop_resume_and_checkpoint_under_zero3(world2):
    results, tmp = world2
    runs = results["resume"]
    assert [r["step"] for r in runs["b"]["records"] + runs["c"]["records"]] == list(range(1, 7))
    losses = [r["loss"] for r in runs["a"]["records"]]
    assert [r["loss"] for r in runs["b"]["records"] + runs["c"]["records"]] == pytest.approx(losses, abs=1e-6)
    _assert_states_close(runs["c"]["state"], runs["a"]["state"], 1e-6)
    # ... and equals the single-process loop, whose checkpoint loads in transformers with the same logits.
    cfg = _cfg(2, steps=6, out_dir=str(tmp / "local"))
    local = LocalEngine(ODD, cfg)
    rec = train(local, cfg)
    assert [r["loss"] for r in rec] == pytest.approx(losses, abs=TOL)
    _assert_states_close(runs["a"]["state"], local.consolidated_state_dict(), TOL)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "a" / "checkpoint").eval()
    ids = torch.randint(0, ODD.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - local.model(ids)).abs().max().item() <= 1e-4
    assert sorted(p.name for p in (tmp / "a" / "checkpoint" / "resume").iterdir()) == [
        "loop-rank00000.pt", "loop-rank00001.pt", "zero-rank00000.pt", "zero-rank00001.pt"]


def _dies(stage: int) -> None:
    engine = ZeroEngine(ODD.replace(num_hidden_layers=1), _cfg(4), stage)
    data = TokenBatches.from_corpus("train", batch_size=4, seq_len=SEQ, rank=dist.get_rank(), world_size=2)
    for step in range(3):
        if step == 1 and dist.get_rank() == 1:
            os._exit(7)  # no exception, no goodbye: like a killed process
        x, y = data.next_batch()
        engine.train_step([(x, y)], 1e-3)


def test_a_dying_rank_fails_the_job_fast():
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(_dies, 2, 3, timeout_s=60)
    assert time.monotonic() - t0 < 60
    assert 1 in info.value.failures and "exited with code 7" in info.value.failures[1]
