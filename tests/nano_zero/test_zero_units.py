"""nano_zero in one process (no process group: world size 1): the flat-shard AdamW against torch's, shard
geometry with padding, every stage against LocalEngine in fp32 and bf16, the ledgers, and bad inputs."""

import gc
import weakref

import pytest
import torch
from torch import nn

from nano_zero import ZeroDataParallel, ZeroEngine, init_like_build_model
from nano_zero.flat import FlatUnit, adamw_
from nano_zero.ledger import count_communication
from shared.config import ModelConfig
from shared.data import TokenBatches
from shared.model import build_model
from shared.train import LocalEngine, TrainConfig, micro_batches_of

TINY = ModelConfig.from_name("tiny").replace(num_hidden_layers=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_flat_adamw_is_torch_adamw():
    """One flat shard holding a decayed matrix and an undecayed vector == torch.optim.AdamW with two groups."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(6, 5, generator=g), torch.randn(7, generator=g)
    ref = [w.clone(), b.clone()]
    opt = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    flat = torch.cat([w.reshape(-1), b])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    for step in range(1, 4):
        grads = [torch.randn(6, 5, generator=g), torch.randn(7, generator=g)]
        ref[0].grad, ref[1].grad = grads
        opt.step()
        adamw_(flat, torch.cat([grads[0].reshape(-1), grads[1]]), m, v, step=step, lr=1e-2, beta1=0.9,
               beta2=0.95, eps=1e-8, weight_decay=0.1, decay_numel=30)
    torch.testing.assert_close(flat, torch.cat([ref[0].reshape(-1), ref[1]]), atol=1e-7, rtol=0)


def test_shard_geometry_pads_and_keeps_decay_prefix():
    params = [("norm", nn.Parameter(torch.ones(3))), ("w", nn.Parameter(torch.ones(2, 5)))]
    units = [FlatUnit("u", params, rank, 4) for rank in range(4)]
    u = units[0]
    assert [s.name for s in u.slots] == ["w", "norm"]  # decayed parameters first
    assert (u.numel, u.padded, u.shard_numel, u.decay_numel) == (13, 16, 4, 10)
    assert [x.decay_numel_in_shard() for x in units] == [4, 4, 2, 0]
    assert [x.shard_slice() for x in units] == [slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 16)]
    flat = u.flatten_params(torch.float32)
    assert flat.shape == (16,) and flat[13:].eq(0).all()  # padding is zero


def _batches(n: int = 3) -> list:
    data = TokenBatches.from_corpus("train", batch_size=4, seq_len=16)
    return [data.next_batch() for _ in range(n)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_world1_every_stage_equals_local_engine(dtype):
    """No process group at all. bf16 follows LocalEngine's recipe (bf16 compute, fp32 master) exactly, but
    only for one step: after it, a 1e-7 difference in the master (the norm's summation order) can flip a
    bf16 rounding of the compute copy and the runs drift apart by ~lr per step."""
    cfg = TrainConfig(steps=3, global_batch_size=4, micro_batch_size=2, seq_len=16, dtype=dtype, grad_clip=1.0)
    batches = _batches(3 if dtype == "fp32" else 1)
    ref = LocalEngine(TINY, cfg)
    ref_hist = [ref.train_step(micro_batches_of(x, y, 2), 1e-3) for x, y in batches]
    ref_state = ref.consolidated_state_dict()
    init = build_model(TINY, seed=0).state_dict()
    for stage in range(4):
        engine = ZeroEngine(TINY, cfg, stage)
        start = engine.consolidated_state_dict()
        assert all(torch.equal(start[k], init[k]) for k in init), stage  # meta build + per-unit init
        hist = [engine.train_step(micro_batches_of(x, y, 2), 1e-3) for x, y in batches]
        for a, b in zip(hist, ref_hist):
            assert a.loss == pytest.approx(b.loss, abs=1e-6) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
        state = engine.consolidated_state_dict()
        for k, t in ref_state.items():
            torch.testing.assert_close(state[k], t, atol=1e-6, rtol=0, msg=f"stage {stage} {k}")
        if dtype == "bf16":  # the compute copy is the bf16 rounding of the master
            engine.model._publish_params()
            for u in engine.model.units:
                if stage < 3:
                    assert torch.equal(u.full[u.shard_slice()], u.master.to(torch.bfloat16))
        report = engine.memory_report()
        assert report.total == pytest.approx(report.formula.total, rel=1e-3)


def test_deleted_engine_frees_its_buffers():
    """Autograd keeps post-accumulate-grad hooks in C++, out of the garbage collector's sight: a hook holding
    the wrapper (or a unit, which holds the parameter) made every stage-2/3 engine's buffers immortal (the
    bench's next system then measured both). Each stage's engine and buffers must die with its last reference."""
    cfg = TrainConfig(global_batch_size=4, micro_batch_size=2, seq_len=16, dtype="fp32")
    (x, y), = _batches(1)
    for stage in range(4):
        engine = ZeroEngine(TINY, cfg, stage)
        engine.train_step(micro_batches_of(x, y, 2), 1e-3)
        ref = weakref.ref(engine.model)
        del engine
        gc.collect()
        assert ref() is None, f"stage {stage}: ZeroDataParallel still referenced after del + gc"
        units = [o for o in gc.get_objects() if type(o) is FlatUnit]  # type(): no attribute access
        assert not units, f"stage {stage}: {len(units)} FlatUnit(s) (and their buffers) outlived the engine"


def test_init_like_build_model_is_the_same_draw():
    """The per-module init applied in modules() order draws exactly build_model's numbers."""
    model = build_model(TINY, seed=0)
    other = build_model(TINY, seed=1)
    gen = torch.Generator().manual_seed(0)
    init = init_like_build_model(TINY.initializer_range)
    with torch.no_grad():
        for m in other.modules():
            init(m, gen)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x))


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3, got 4"):
        ZeroDataParallel(_Two(), 4)
    frozen = _Two()
    frozen.blocks[0].bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"parameter 'blocks.0.bias' is frozen \(requires_grad=False\)"):
        ZeroDataParallel(frozen, 2)
    mixed = _Two()
    mixed.blocks[1].to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"mixed dtypes \['torch.bfloat16', 'torch.float32'\]"):
        ZeroDataParallel(mixed, 1)
    shared = _Two()
    shared.blocks[1].weight = shared.blocks[0].weight
    with pytest.raises(ValueError, match="parameter 'blocks.1.weight' is shared by units 'blocks.0' and 'blocks.1'"):
        ZeroDataParallel(shared, 3)
    nested = _Two()
    with pytest.raises(ValueError, match="unit 'blocks.0' is nested inside unit 'blocks'"):
        ZeroDataParallel(nested, 3, units=[nested.blocks, nested.blocks[0]])
    with torch.device("meta"):
        meta = _Two()
    with pytest.raises(ValueError, match="needs init_fn"):
        ZeroDataParallel(meta, 3)
    engine = ZeroEngine(TINY.replace(num_hidden_layers=1), TrainConfig(), 1)
    state = engine.model.shard_state_dict()
    with pytest.raises(ValueError, match=r"resume state was saved with world=4, this run has 1"):
        engine.model.load_shard_state_dict({**state, "world": 4})
    with pytest.raises(ValueError, match=r"train.seq_len \(4096\) exceeds the model's max_position_embeddings "
                                         r"\(2048\)"):
        ZeroEngine(TINY, TrainConfig(seq_len=4096), 3)


def test_resume_shard_errors_name_the_file(tmp_path):
    """A garbage ZeRO shard is a ValueError naming it; a checkpoint of another model names the difference
    before any shard is read (shared.checkpoint.check_same_model)."""
    from shared.train import train

    cfg = TrainConfig(steps=1, global_batch_size=4, micro_batch_size=2, seq_len=16, out_dir=str(tmp_path / "a"))
    train(ZeroEngine(TINY, cfg, 3), cfg)
    ckpt = tmp_path / "a" / "checkpoint"
    shard = ckpt / "resume" / "zero-rank00000.pt"
    shard.write_bytes(b"not a checkpoint")
    resumed = TrainConfig(steps=2, global_batch_size=4, micro_batch_size=2, seq_len=16,
                          out_dir=str(tmp_path / "b"), resume_from=str(ckpt))
    with pytest.raises(ValueError, match=rf"'{shard}' is not a ZeRO resume shard file: torch.load cannot read"):
        train(ZeroEngine(TINY, resumed, 3), resumed)
    torch.save({"stage": 3}, shard)
    with pytest.raises(ValueError, match=rf"'{shard}' is not a ZeRO resume shard file: it holds a dict without "
                                         r"\['world', 'geometry', 'adam_step', 'units'\]"):
        train(ZeroEngine(TINY, resumed, 3), resumed)
    with pytest.raises(ValueError, match=rf"checkpoint '{ckpt}' holds another model than this run's "
                                         r"\(vocab_size 4096 in the checkpoint, 8192 in this run\)"):
        train(ZeroEngine(TINY.replace(vocab_size=8192), resumed, 3), resumed)


def test_generic_module_stage3_reshards_after_forward_and_backward():
    """A plain nn.Module: at rest stage 3 holds no full parameters; a tied-free toy still trains."""
    torch.manual_seed(0)
    zm = ZeroDataParallel(_Two(), 3, weight_decay=0.0)
    counter = count_communication(zm)
    assert count_communication(zm) is counter  # wrapped once
    assert all(u.full.untyped_storage().nbytes() == 0 for u in zm.units)
    x = torch.randn(5, 4)
    zm(x).pow(2).sum().backward()
    assert all(u.full.untyped_storage().nbytes() == 0 and u.grad_full is None for u in zm.units)
    assert counter.elements["all_gather"] == 2 * sum(u.padded for u in zm.units)
    assert counter.elements["reduce_scatter"] == sum(u.padded for u in zm.units)
    before = zm.full_state_dict()
    zm.step(1e-2)
    after = zm.full_state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():  # inference: gathered and freed, no gradient buffers
        zm(x)
    assert all(u.full.untyped_storage().nbytes() == 0 and u.grad_full is None for u in zm.units)


def test_stage2_reduces_during_backward_and_not_under_no_sync():
    """§5.2: a bucket is reduce-scattered from the post-accumulate-grad hooks while backward still runs
    (blocks[1]'s bucket before blocks[0]'s backward), its full gradients freed; no_sync() moves nothing."""
    torch.manual_seed(0)
    zm = ZeroDataParallel(_Two(), 2)
    counter = count_communication(zm)
    seen = []

    def when_blocks0_backward_starts(module, args, out):
        out.register_hook(lambda g: seen.append(counter.elements["reduce_scatter"]))

    zm.module.blocks[0].register_forward_hook(when_blocks0_backward_starts)
    x = torch.randn(5, 4)
    with zm.no_sync():
        zm(x).sum().backward()
    assert counter.total_elements == 0 and all(u.grad_full is not None for u in zm.blocks)
    zm(x).sum().backward()
    b0, b1 = zm.blocks
    assert seen == [0, b1.padded]  # no_sync pass: nothing; sync pass: blocks[1] reduced mid-backward
    assert counter.elements["reduce_scatter"] == b0.padded + b1.padded and zm.root.numel == 0
    assert all(u.grad_full is None and u.slots[0].param.grad is None for u in zm.blocks)
    bias = next(s for s in b1.slots if s.name == "blocks.1.bias")
    grad = b1.grad_shard[bias.offset:bias.offset + bias.numel]  # world 1: the shard is everything
    torch.testing.assert_close(grad, torch.full((4,), 2 * 5.0))  # d(sum)/d(bias): 5 rows, 2 passes
