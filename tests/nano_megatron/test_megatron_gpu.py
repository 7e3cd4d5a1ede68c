"""nano_megatron on NCCL and CUDA (marker `gpu`; on a 2-GPU machine: `pytest tests/nano_megatron -m gpu`).

The CPU tests prove the parallel algebra over gloo; this runs the same two-rank cases through NCCL on two
GPUs in fp32 and compares them with the single-process LocalEngine on one GPU. Tolerance: the reference
and the ranks run different kernels in different summation orders (cuBLAS picks algorithms by shape, and
a tensor-parallel shard is a different shape), fp32 rounding ~1e-7 relative per op; with Adam eps 1e-6
(megatron_cases) 5 steps move parameters by ~5e-3 and those rounding differences stay below 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from megatron_cases import global_batches, local_rows, make_engine, max_abs_diff, model_config, train_config

from shared.dist import run_distributed
from shared.train import LocalEngine, micro_batches_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

CASES = {
    "tp2": dict(parallel=dict(tp=2)),
    "tp2-sp": dict(parallel=dict(tp=2, sequence_parallel=True)),
    "pp2-1f1b": dict(parallel=dict(pp=2)),
    "pp2-gpipe": dict(parallel=dict(pp=2, schedule="gpipe")),
    "dp2": dict(parallel=dict(dp=2, bucket_mb=0.01)),
    # the backward overlap layer (each block's collective under its dW GEMMs), as the bench's tp rows run it
    "tp2-overlap": dict(parallel=dict(tp=2, tp_comm_overlap=True)),
    "tp2-sp-overlap": dict(parallel=dict(tp=2, sequence_parallel=True, tp_comm_overlap=True)),
    # the whole step captured in a CUDA graph at step 3 (2 eager warm-up steps), replayed for steps 3-5
    "tp2-graph": dict(parallel=dict(tp=2, cuda_graph=True, tp_comm_overlap=True)),
    "tp2-sp-graph": dict(parallel=dict(tp=2, sequence_parallel=True, cuda_graph=True, tp_comm_overlap=True)),
}

TOL = 1e-4


def _nccl_job() -> dict:
    out = {}
    for name, case in CASES.items():
        engine = make_engine(case)
        assert engine.device.type == "cuda"
        cfg, losses = engine.cfg, []
        for x, y in global_batches(cfg, 5):
            x, y = (local_rows(t, engine.dp_rank, engine.dp_world_size) for t in (x, y))
            losses.append(engine.train_step(micro_batches_of(x, y, cfg.micro_batch_size), cfg.lr).loss)
        state = engine.consolidated_state_dict()
        engine.close()
        out[name] = (losses, None if state is None else {k: v.cpu() for k, v in state.items()})
    return out


def _reference(case: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    mc, cfg = model_config(**case.get("model", {})), train_config(**case.get("train", {}))
    engine = LocalEngine(mc, cfg, device="cuda")
    losses = [engine.train_step(micro_batches_of(x, y, cfg.micro_batch_size), cfg.lr).loss
              for x, y in global_batches(cfg, 5)]
    return losses, {k: v.cpu() for k, v in engine.consolidated_state_dict().items()}


def test_nccl_two_ranks_equal_single_gpu():
    results = run_distributed(_nccl_job, 2, backend="nccl", timeout_s=300.0)
    for name, case in CASES.items():
        ref_losses, ref_state = _reference(case)
        losses, state = results[0][name]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL, (name, losses, ref_losses)
        assert results[1][name][0] == pytest.approx(losses, abs=1e-6), name  # every rank reports the loss
        err = max_abs_diff(state, ref_state)
        assert err < TOL, f"{name}: parameters differ from the single GPU by {err:.2e}"

