"""shared.dist: the gloo harness (results, errors, deaths, timeouts) and single-process init.

Each `run_distributed` call spawns fresh torch processes (a few seconds each on 2 cores), so the
collectives are checked together in one call and every failure path costs exactly one call.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from shared.dist import (
    DistributedError,
    all_gather_single,
    all_reduce_mean,
    destroy_distributed,
    get_rank,
    get_world_size,
    init_distributed,
    is_main,
    reduce_scatter_single,
    run_distributed,
)

# Hang guard for the failure paths: far above a normal run, far below "hangs forever".
HANG_GUARD_S = 60.0


def _collectives(scale: float, *, offset: float) -> dict[str, torch.Tensor]:
    rank, world = get_rank(), get_world_size()
    x = torch.full((2,), scale * rank + offset)
    summed = x.clone()
    dist.all_reduce(summed)
    gathered = torch.empty(2 * world)
    all_gather_single(gathered, x)
    # Rank r contributes arange + r; rank q keeps chunk q of the sum.
    scattered = torch.empty(2)
    reduce_scatter_single(scattered, torch.arange(2.0 * world) + rank)
    exchanged = torch.empty(2 * world)
    dist.all_to_all_single(exchanged, torch.arange(2.0 * world) + 100 * rank)
    return {
        "rank": torch.tensor(rank),
        "sum": summed,
        "mean": all_reduce_mean(x.clone()),
        "gathered": gathered,
        "scattered": scattered,
        "exchanged": exchanged,
    }


@pytest.mark.slow  # worker processes
def test_collectives_on_two_gloo_ranks():
    world = 2
    out = run_distributed(_collectives, world, 10.0, offset=1.0)
    values = [torch.full((2,), 10.0 * r + 1.0) for r in range(world)]
    inputs = [torch.arange(2.0 * world) + r for r in range(world)]
    for rank, res in enumerate(out):
        assert res["rank"].item() == rank  # results come back indexed by rank
        torch.testing.assert_close(res["sum"], sum(values))
        torch.testing.assert_close(res["mean"], sum(values) / world)
        torch.testing.assert_close(res["gathered"], torch.cat(values))
        torch.testing.assert_close(res["scattered"], sum(inputs)[2 * rank : 2 * rank + 2])
        expected = torch.cat(
            [(torch.arange(2.0 * world) + 100 * src)[2 * rank : 2 * rank + 2] for src in range(world)]
        )
        torch.testing.assert_close(res["exchanged"], expected)


def _rank1_raises() -> None:
    if get_rank() == 1:
        raise ValueError("boom from the second process")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here, waiting for a rank that never comes


@pytest.mark.slow  # worker processes
def test_exception_names_rank_and_traceback_without_hanging():
    start = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1") as info:
        run_distributed(_rank1_raises, 2)
    assert time.monotonic() - start < HANG_GUARD_S
    assert info.value.rank == 1
    message = str(info.value)
    assert "Traceback" in message and "_rank1_raises" in message
    assert "ValueError: boom from the second process" in message


def _rank1_exits() -> None:
    if get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


@pytest.mark.slow  # worker processes
def test_silent_death_reports_exit_code():
    start = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1") as info:
        run_distributed(_rank1_exits, 2)
    assert time.monotonic() - start < HANG_GUARD_S
    assert "exited with code 3" in info.value.failures[1]


def _sleep_forever() -> None:
    time.sleep(3600)


@pytest.mark.slow  # worker processes
def test_timeout_kills_and_names_unfinished_ranks():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks not finished: \[0, 1\]"):
        run_distributed(_sleep_forever, 2, timeout_s=3.0)
    assert time.monotonic() - start < HANG_GUARD_S


def test_rejects_unpicklable_function():
    def local_fn() -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(lambda: None, 2)
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(local_fn, 2)


def test_init_without_torchrun_is_one_rank(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    if dist.is_initialized():
        pytest.skip("another test left a process group in this process")
    try:
        env = init_distributed()
        assert (env.rank, env.world_size, env.local_rank) == (0, 1, 0)
        assert is_main() and get_world_size() == 1
        assert init_distributed() == env  # idempotent
        t = torch.tensor([3.0, 5.0], device=env.device)  # a CUDA tensor when the default is nccl
        dist.all_reduce(t)  # collectives work as identities
        torch.testing.assert_close(t.cpu(), torch.tensor([3.0, 5.0]))
    finally:
        destroy_distributed()
    assert not dist.is_initialized()
