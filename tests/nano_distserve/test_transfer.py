"""KV transfer building blocks: handshake, leases, block export/import, and 10,000 simulated requests with
aborts, transfer timeouts and a decode instance that stops answering — no block leaks on either side."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from ds_fakes import FakeRunner, SimNet

from nano_distserve.bench.measure import MeasuredDecodeInstance, MeasuredPrefillInstance
from nano_distserve.disagg import Router
from nano_distserve.instance import DecodeInstance, PrefillInstance
from nano_distserve.kv_transfer import LeaseTable, export_blocks, import_blocks
from nano_distserve.protocol import Renew, Stop
from nano_distserve.transport import KVGeometry, handshake, register
from nano_vllm.block_manager import BlockManager
from nano_vllm.loadgen import Request
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.scheduler import Scheduler, SchedulerConfig

GEO = KVGeometry(16, 2, 1, 32, "float32")


def test_handshake_accepts_matching_and_rejects_mismatched_geometry():
    store = dist.HashStore()
    register(store, "prefill0", GEO, 100)
    register(store, "decode1", GEO, 50)
    info = handshake(store, ["prefill0", "decode1"], timeout_s=1.0)
    assert info["decode1"]["num_blocks"] == 50 and info["prefill0"]["geometry"] == GEO
    bad = KVGeometry(32, 2, 2, 32, "bfloat16")
    register(store, "decode2", bad, 50)
    with pytest.raises(ValueError, match=r"prefill0 and decode2: block_size 16 != 32, num_kv_heads 1 != 2, "
                                         r"dtype float32 != bfloat16"):
        handshake(store, ["prefill0", "decode2"], timeout_s=1.0)


def test_instance_that_never_registers_times_out_by_name():
    store = dist.HashStore()
    register(store, "prefill0", GEO, 100)
    with pytest.raises(TimeoutError, match=r"\['decode1'\] did not register within 0.2 s"):
        handshake(store, ["prefill0", "decode1"], timeout_s=0.2)


def test_geometry_of_a_nano_vllm_cache():
    cache = torch.zeros(2, 3, 11, 16, 2, 64, dtype=torch.bfloat16)
    assert KVGeometry.of_cache(cache) == KVGeometry(16, 3, 2, 64, "bfloat16")


def test_lease_table_releases_once_on_expiry_or_release_never_after_take():
    now = [0.0]
    released = []
    leases = LeaseTable(lambda: now[0])
    for k in "abc":
        leases.grant(k, 1.0, lambda k=k: released.append(k))
    assert leases.take("a") and not leases.take("a")
    leases.renew("b", 5.0)
    now[0] = 2.0
    assert leases.expire() == ["c"] and released == ["c"]
    assert leases.release("b") and not leases.release("b") and released == ["c", "b"] and len(leases) == 0


def test_export_import_blocks_bit_exact():
    src = torch.randn(2, 2, 9, 16, 1, 32)
    dst = torch.zeros_like(src)
    blocks = export_blocks(src, [5, 1, 7])
    import_blocks(dst, [0, 3, 2], blocks)
    assert torch.equal(dst[:, :, [0, 3, 2]], src[:, :, [5, 1, 7]])
    assert dst[:, :, [1, 4, 5, 6, 7, 8]].abs().sum() == 0


def _instance(net, rank, num_blocks, bs=16, **kw):
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=rank == 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256, max_model_len=128), bm)
    return sched, FakeRunner(num_blocks, bs), net.transport(rank)


@pytest.mark.slow
def test_10000_requests_with_aborts_timeouts_and_a_dead_decode_instance_leak_nothing():
    net = SimNet(seed=0, max_delay=0.03, drop=0.002, slow=0.01, slow_delay=3.0)
    ttl = 1.0
    s, r, t = _instance(net, 0, 200)
    # the measurement layer's instances: the paper's, keeping what each transfer sent and received
    pre = MeasuredPrefillInstance(s, r, t, [1, 2], lease_ttl_s=ttl, clock=net.clock, keep_kv=True)
    decs = {}
    for rank in (1, 2):
        s, r, t = _instance(net, rank, 60)
        decs[rank] = MeasuredDecodeInstance(s, r, t, 0, lease_ttl_s=ttl, clock=net.clock, keep_kv=True)
    rng = random.Random(1)
    n, nxt, aborted = 10_000, 0, 0
    shared = [rng.randrange(1000) for _ in range(32)]  # shared prefixes exercise the prefill prefix cache
    while nxt < n or pre.has_work() or any(d.has_work() for d in decs.values()) or net.inbox[0]:
        net.now += 0.01
        tick = round(net.now * 100)
        net.dead = {2} if 300 <= tick < 700 else set()  # decode 2 stops answering for 4 s (> ttl)
        for _ in range(min(12, n - nxt)):
            prompt = shared[: rng.randrange(0, 33)] + [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
            pre.add_request(str(nxt), prompt, SamplingParams(max_tokens=rng.randint(1, 6), ignore_eos=True),
                            net.now)
            nxt += 1
        if rng.random() < 0.3 and nxt:
            pre.abort(str(rng.randrange(nxt)))
            aborted += 1
        pre.step()
        for rank, d in decs.items():
            if rank not in net.dead:
                d.step()
        if tick > 100_000:
            raise AssertionError("did not drain")
    # Every request ended exactly once, somewhere, and said how.
    assert sorted(pre.completed, key=int) == [str(i) for i in range(n)]
    reasons = {c.finish_reason for c in pre.completed.values()}
    assert {"length", "abort", "transfer_timeout"} <= reasons, reasons
    done = [c for c in pre.completed.values() if c.finish_reason == "length"]
    assert len(done) > n // 2
    # Zero leaked blocks, zero leases, on both sides.
    for inst in (pre, *decs.values()):
        bm = inst.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and sum(bm.pool.ref_counts) == 0
        assert len(inst.leases) == 0 and not inst.scheduler.has_unfinished()
    assert not pre.handed and all(not d.queue for d in decs.values())
    # What arrived is what was sent (K/V of a token = its id here).
    for d in decs.values():
        for rid, kv in d.received.items():
            assert torch.equal(kv, pre.sent[rid])
    assert sum(len(d.received) for d in decs.values()) > n // 2


def test_router_rejects_requests_longer_than_the_decode_cache_and_allocates_nothing():
    net = SimNet()
    s, r, t = _instance(net, 0, 20)
    pre = PrefillInstance(s, r, t, [1], clock=net.clock)
    router = Router(pre, max_model_len=128, decode_blocks=3, block_size=16)
    with pytest.raises(ValueError,
                       match=r"needs 4 KV blocks \(50 tokens\) but the decode instance's cache has only 3"):
        router.submit("x", Request([1] * 40, SamplingParams(max_tokens=10)), 0.0)
    with pytest.raises(ValueError, match="more than max_model_len"):
        router.submit("y", Request([1] * 129, SamplingParams(max_tokens=1)), 0.0)
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 20
    router.submit("ok", Request([1] * 40, SamplingParams(max_tokens=8)), 0.0)
    assert s.has_unfinished()


def test_an_instance_rejects_a_message_it_does_not_expect_by_name():
    net = SimNet(max_delay=0.0)  # every message arrives at once
    pre = PrefillInstance(*_instance(net, 0, 20), [1], clock=net.clock)
    dec = DecodeInstance(*_instance(net, 1, 20), 0, clock=net.clock)
    net.transport(2).send(0, Stop())  # Stop is for decode instances
    with pytest.raises(ValueError, match=r"prefill instance got an unexpected message Stop\(\)"):
        pre.step()
    net.transport(2).send(1, Renew(["x"]))  # Renew is for prefill instances
    with pytest.raises(ValueError, match=r"decode instance got an unexpected message Renew\(rids=\['x'\]\)"):
        dec.step()
