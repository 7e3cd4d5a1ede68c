"""nano_zero on NCCL (marker `gpu`, run by hand on a GPU machine: `pytest tests/nano_zero -m gpu`).

Stages must agree with each other in fp32 (they differ only in where sums happen) and stay close in bf16;
the memory ledger must match the formula on CUDA too.
"""

import pytest
import torch
import torch.distributed as dist

from nano_zero import ZeroEngine
from shared.config import ModelConfig
from shared.data import TokenBatches
from shared.dist import run_distributed
from shared.train import TrainConfig, lr_at, micro_batches_of

CFG = ModelConfig.from_name("tiny").replace(num_hidden_layers=2, intermediate_size=383)


def _gpu_job(dtype: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = TrainConfig(steps=3, global_batch_size=8, micro_batch_size=2, seq_len=64, lr=1e-3, warmup_steps=1,
                      dtype=dtype)
    out = {}
    for stage in range(4):
        engine = ZeroEngine(CFG, cfg, stage)
        data = TokenBatches.from_corpus("train", batch_size=8 // world, seq_len=64, rank=rank, world_size=world)
        losses = []
        for step in range(3):
            x, y = data.next_batch()
            losses.append(engine.train_step(micro_batches_of(x, y, 2), lr_at(step, cfg)).loss)
        rep = engine.memory_report()
        out[stage] = {"losses": losses, "state": engine.consolidated_state_dict(),
                      "mem": (rep.total, rep.formula.total), "comm": engine.last_step_comm[0],
                      "padded": sum(u.padded for u in engine.model.units)}
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stages_agree_on_nccl(dtype):
    world = min(2, torch.cuda.device_count())
    res = run_distributed(_gpu_job, world, dtype, backend="nccl", timeout_s=600)[0]
    tol = 1e-5 if dtype == "fp32" else 3e-2
    for stage in range(1, 4):
        assert res[stage]["losses"] == pytest.approx(res[0]["losses"], abs=tol)
        if dtype == "fp32":
            for name, t in res[0]["state"].items():
                torch.testing.assert_close(res[stage]["state"][name], t, atol=1e-5, rtol=0, msg=name)
    for stage in range(4):
        measured, formula = res[stage]["mem"]
        assert abs(measured - formula) <= 0.05 * formula
        acc = 8 // (world * 2)
        assert res[stage]["comm"] == res[stage]["padded"] * (3 * acc if stage == 3 else 2)
