"""Disaggregated serving in processes: a router + prefill instance on rank 0, decode instances on the other
ranks (DistServe, arXiv 2401.09670, §4: one phase per GPU, KV pulled over the interconnect).

Launch with `run_disaggregated(...)` (spawns the ranks with shared.dist.run_distributed: gloo on CPU, NCCL
with one GPU each) or call `instance_main` under torchrun. Every rank builds an ordinary nano_vllm
`LLMEngine` for its model runner, scheduler and block manager and then drives them as one phase.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nano_distserve.instance import Completion, DecodeInstance, PrefillInstance
from nano_distserve.kv_transfer import (
    DistTransport,
    KVGeometry,
    export_blocks,
    handshake,
    import_blocks,
    register,
)
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.loadgen import Request
from nano_vllm.performance import with_performance_layers
from shared.dist import find_free_port, run_distributed


def warmup_requests(requests: list[Request], count: int = 4, max_tokens: int = 16,
                    gap_s: float = 0.02) -> tuple[list[Request], list[float]]:
    """The workload's first `count` requests, cut to `max_tokens` outputs, and their arrival times, to serve
    untimed before a measurement: two arrive together and the rest `gap_s` apart while those decode, so the
    warm-up runs the step shapes the measurement will (multi-sequence prefill, a prompt joining running
    decodes, chunk continuations, mixed and decode CUDA graphs) and Triton compiles each kernel variant
    (~1 s apiece on an H200) before the clock starts, not inside the first rate's TTFTs."""
    warm = [dataclasses.replace(r, sampling_params=dataclasses.replace(
        r.sampling_params, max_tokens=min(max_tokens, r.sampling_params.max_tokens))) for r in requests[:count]]
    return warm, [max(0, i - 1) * gap_s for i in range(len(warm))]


@dataclass
class DisaggConfig:
    """engine: nano_vllm EngineConfig fields of every instance (`decode_engine` overrides the decode ones);
    lease_ttl_s: how long either side holds blocks for a silent peer; handshake_timeout_s: how long the
    router waits for every instance to register; keep_kv: return what was sent and received (tests)."""

    engine: dict
    decode_engine: dict | None = None
    num_decode: int = 1
    lease_ttl_s: float = 30.0
    handshake_timeout_s: float = 60.0
    keep_kv: bool = False
    wire_samples: int = 200  # after serving: time this many requests' KV transfers alone (see measure_wire)


class Router:
    """Admission control in front of the prefill instance: rejects what no decode instance could hold."""

    def __init__(self, prefill: PrefillInstance, max_model_len: int, decode_blocks: int, block_size: int):
        self.prefill, self.max_model_len = prefill, max_model_len
        self.decode_blocks, self.block_size = decode_blocks, block_size

    def check(self, prompt: list[int], max_tokens: int) -> None:
        total = len(prompt) + max_tokens
        if len(prompt) > self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens, more than max_model_len ({self.max_model_len})")
        need = math.ceil(min(total, self.max_model_len) / self.block_size)
        if need > self.decode_blocks:
            raise ValueError(f"request needs {need} KV blocks ({total} tokens) but the decode instance's cache "
                             f"has only {self.decode_blocks}: it could never be decoded")

    def submit(self, request_id: str, req: Request, arrival_time: float) -> None:
        prompt = list(req.prompt)
        self.check(prompt, req.sampling_params.max_tokens)
        self.prefill.add_request(request_id, prompt, req.sampling_params, arrival_time)


def _store(rank: int) -> dist.TCPStore:
    """A store of our own for the mailboxes (the process group's store is private to torch)."""
    port = [find_free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    return dist.TCPStore("127.0.0.1", port[0], dist.get_world_size(), is_master=rank == 0,
                         wait_for_workers=True)


def instance_main(cfg: DisaggConfig, requests: list[Request], rounds: list[list[float]]) -> dict:
    """Body of every rank: rank 0 routes and prefills, ranks 1.. decode. Serves `requests` once per round of
    arrival times (one round per rate: engines, NCCL and Triton kernels are set up once); a short warm-up
    request goes through first and is left out of every log. Returns what the rank measured."""
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _store(rank)
    is_prefill = rank == 0
    args = dict(cfg.engine) if is_prefill else {**cfg.engine, **(cfg.decode_engine or {})}
    if torch.cuda.is_available():
        args["device"] = f"cuda:{torch.cuda.current_device()}"
    engine = with_performance_layers(LLMEngine(EngineConfig(**args)))
    runner = engine.model_runner
    name = "prefill0" if is_prefill else f"decode{rank}"
    register(store, name, KVGeometry.of_cache(runner.kv_cache), runner.num_blocks)
    transport = DistTransport(store, rank)
    if not is_prefill:
        store.wait(["handshake"])
        verdict = store.get("handshake").decode()
        if verdict != "ok":
            raise RuntimeError(f"decode rank {rank}: router rejected the handshake: {verdict}")
        dec = DecodeInstance(engine.scheduler, runner, transport, 0, cfg.lease_ttl_s, keep_received=cfg.keep_kv)
        while not dec.stopped or dec.has_work():
            dec.step()
            if not dec.has_work():
                time.sleep(1e-4)
        wire = measure_wire(runner.kv_cache, requests, engine.config.block_size, cfg.wire_samples)
        dist.barrier()  # rank 0 hosts the store: it must outlive every reader
        return {"role": "decode", "received": dec.received, "transfer_times": dec.transfer_times,
                "steps": dec.step_log, "wire_times": wire}
    names = ["prefill0"] + [f"decode{r}" for r in range(1, world)]
    try:
        info = handshake(store, names, cfg.handshake_timeout_s)
    except BaseException as e:
        store.set("handshake", f"{type(e).__name__}: {e}")
        raise
    store.set("handshake", "ok")
    pre = PrefillInstance(engine.scheduler, runner, transport, list(range(1, world)), cfg.lease_ttl_s,
                          keep_sent=cfg.keep_kv, keep_ttft_parts=True)
    decode_blocks = min(info[n]["num_blocks"] for n in names[1:])
    router = Router(pre, engine.max_model_len, decode_blocks, engine.config.block_size)

    def serve(tag: str, reqs: list[Request], arrivals: list[float]) -> tuple[list[Completion], float]:
        order = sorted(range(len(reqs)), key=lambda i: arrivals[i])
        ids = [f"{tag}{i}" for i in range(len(reqs))]
        t0, nxt = time.perf_counter(), 0
        while nxt < len(order) or any(i not in pre.completed for i in ids):
            now = time.perf_counter()
            while nxt < len(order) and t0 + arrivals[order[nxt]] <= now:
                i = order[nxt]
                router.submit(ids[i], reqs[i], t0 + arrivals[i])
                nxt += 1
            pre.step()
            if not pre.scheduler.has_unfinished():
                time.sleep(1e-4)
        return [pre.completed[i] for i in ids], time.perf_counter() - t0

    serve("warmup:", *warmup_requests(requests))
    for r in range(1, world):
        transport.send(r, {"type": "reset_logs"})
    pre.step_log.clear()
    out = []
    for k, arrivals in enumerate(rounds):
        pre.ttft_parts.clear()
        completions, duration = serve(f"{k}:", requests, arrivals)
        # TTFT = (added − arrival) + (iteration start − added) + (forward start − iteration start) + forward
        parts = {name: [] for name in ("router", "queue", "messages", "forward")}
        for c in completions:
            if c.request_id in pre.ttft_parts and c.token_times:
                added, it, fw = pre.ttft_parts[c.request_id]
                for name, v in zip(parts, (added - c.arrival_time, it - added, fw - it, c.token_times[0] - fw)):
                    parts[name].append(v)
        for c in completions:  # request ids as the caller numbers them
            c.request_id = c.request_id.split(":", 1)[1]
        out.append({"completions": completions, "duration": duration, "ttft_parts": parts})
        # progress, so that a run cut off by a time limit shows how far it got
        print(f"disaggregated round {k + 1}/{len(rounds)}: {len(completions)} requests in {duration:.1f} s",
              flush=True)
    for r in range(1, world):
        transport.send(r, {"type": "stop"})
    measure_wire(runner.kv_cache, requests, engine.config.block_size, cfg.wire_samples)
    dist.barrier()
    return {"role": "prefill", "rounds": out, "sent": pre.sent, "steps": pre.step_log}


def measure_wire(kv_cache: torch.Tensor, requests: list[Request], block_size: int, samples: int) -> list[float]:
    """The KV transfer itself, with both sides ready (§4.4's claim: it takes less than a decode step): for
    each of the first `samples` requests, its prompt's blocks exported, sent, received and imported into the
    peer's cache, timed from a common barrier to the receiver's synchronize. Run after serving, when every
    block is free (the copies land in blocks nobody owns). The serving log's `transfer_times` time the hand-
    off instead: pull sent → blocks in the cache, which also waits for the prefill side's current step.
    Every rank calls it (rank 0 sends to each decode rank in turn). Returns a decode rank's times (seconds);
    rank 0 returns []."""
    rank, times = dist.get_rank(), []
    sync = torch.cuda.synchronize if kv_cache.is_cuda else (lambda: None)
    num_blocks = kv_cache.shape[2] - 1  # the last block is the runner's scratch
    for peer in range(1, dist.get_world_size()):
        for i, req in enumerate(requests[:samples]):
            ids = list(range(min(math.ceil(len(req.prompt) / block_size), num_blocks)))
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.isend(export_blocks(kv_cache, ids), peer, tag=1_000_000 + i).wait()
            elif rank == peer:
                shape = (*kv_cache.shape[:2], len(ids), *kv_cache.shape[3:])
                buf = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
                dist.irecv(buf, 0, tag=1_000_000 + i).wait()
                import_blocks(kv_cache, ids, buf)
            sync()
            if rank == peer:
                times.append(time.perf_counter() - t0)
    return times


def run_disaggregated_rounds(cfg: DisaggConfig, requests: list[Request], rounds: list[list[float]],
                             timeout_s: float = 300.0) -> dict:
    """Spawn 1 prefill + `num_decode` decode ranks (gloo on CPU, NCCL on GPUs) and serve `requests`
    open-loop once per list of arrival times in `rounds` (seconds from the round's start), one after the
    other on the same instances. Returns {"rounds": [{"completions": [Completion, ...] in request order,
    "duration"}, ...], "transfer_times", "prefill_steps", "decode_steps", "sent", "received"} (the logs
    pooled over rounds, the warm-up request left out; sent / received keyed "<round>:<request index>")."""
    backend = "nccl" if torch.cuda.device_count() > cfg.num_decode else "gloo"
    results = run_distributed(instance_main, 1 + cfg.num_decode, cfg, requests, rounds, backend=backend,
                              timeout_s=timeout_s)
    pre, decs = results[0], results[1:]
    received = {k: v for d in decs for k, v in d["received"].items() if not k.startswith("warmup:")}
    sent = {k: v for k, v in pre["sent"].items() if not k.startswith("warmup:")}
    return {"rounds": pre["rounds"], "transfer_times": [t for d in decs for t in d["transfer_times"]],
            "wire_times": [t for d in decs for t in d["wire_times"]],
            "prefill_steps": pre["steps"], "decode_steps": [s for d in decs for s in d["steps"]],
            "sent": sent, "received": received}


def run_disaggregated(cfg: DisaggConfig, requests: list[Request], arrivals: list[float],
                      timeout_s: float = 300.0) -> dict:
    """One round of `run_disaggregated_rounds`: {"completions": [Completion, ...] in request order,
    "duration", "transfer_times", "prefill_steps", "decode_steps", "sent", "received"}."""
    res = run_disaggregated_rounds(cfg, requests, [arrivals], timeout_s)
    (one,) = res.pop("rounds")
    for key in ("sent", "received"):  # "0:<id>" -> "<id>": one round, no ambiguity
        res[key] = {k.split(":", 1)[1]: v for k, v in res[key].items()}
    return {**one, **res}
