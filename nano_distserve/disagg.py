"""Disaggregated serving in processes: a router + prefill instance on rank 0, decode instances on the other
ranks (DistServe, arXiv 2401.09670, §4: one phase per GPU, KV pulled over the interconnect).

Launch with `run_disaggregated(...)` (spawns the ranks with shared.dist.run_distributed: gloo on CPU, NCCL
with one GPU each) or call `instance_main` under torchrun. Every rank builds an ordinary nano_vllm
`LLMEngine` for its model runner, scheduler and block manager and drives them as one phase:

    engine = build_engine(cfg)                  # this rank's nano_vllm engine
    node = connect(cfg, engine)                 # geometry handshake; the rank's instance (+ router on rank 0)
    rank 0:    node.router.serve(...) per round, then stop_decodes(node.instance)
    ranks 1..: serve_decode(node.instance)      # until Stop

The measured bench (nano_distserve.bench.measure) composes the same pieces with step logs, TTFT parts and
KV-transfer timings: `run_disaggregated(..., main=measure.measured_instance_main)`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nano_distserve.instance import DecodeInstance, PrefillInstance
from nano_distserve.protocol import Stop
from nano_distserve.transport import DistTransport, KVGeometry, handshake, register
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.loadgen import Request
from shared.dist import find_free_port, run_distributed


@dataclass
class DisaggConfig:
    """engine: nano_vllm EngineConfig fields of every instance (`decode_engine` overrides the decode ones);
    lease_ttl_s: how long either side holds blocks for a silent peer; handshake_timeout_s: how long the
    router waits for every instance to register. Read by the measurement layer only: keep_kv (return what
    was sent and received, for tests) and wire_samples (requests whose KV transfer is timed alone)."""

    engine: dict
    decode_engine: dict | None = None
    num_decode: int = 1
    lease_ttl_s: float = 30.0
    handshake_timeout_s: float = 60.0
    keep_kv: bool = False
    wire_samples: int = 200


class Router:
    """Admission control in front of the prefill instance: rejects what no decode instance could hold."""

    def __init__(self, prefill: PrefillInstance, max_model_len: int, decode_blocks: int, block_size: int):
        self.prefill, self.max_model_len = prefill, max_model_len
        self.decode_blocks, self.block_size = decode_blocks, block_size

    def check(self, prompt: list[int], max_tokens: int) -> None:
        total = len(prompt) + max_tokens
        if len(prompt) > self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens, more than max_model_len "
                             f"({self.max_model_len})")
        need = math.ceil(min(total, self.max_model_len) / self.block_size)
        if need > self.decode_blocks:
            raise ValueError(f"request needs {need} KV blocks ({total} tokens) but the decode instance's "
                             f"cache has only {self.decode_blocks}: it could never be decoded")

    def submit(self, request_id: str, req: Request, arrival_time: float) -> None:
        prompt = list(req.prompt)
        self.check(prompt, req.sampling_params.max_tokens)
        self.prefill.add_request(request_id, prompt, req.sampling_params, arrival_time)

    def serve(self, tag: str, requests: list[Request], arrivals: list[float]) -> dict:
        """Submit each request at its arrival time (seconds from now; open loop) as "<tag><index>" and step
        the prefill instance until all have ended. Returns {"completions": in request order, ids as the
        caller numbers them, "duration": seconds}."""
        pre = self.prefill
        order = sorted(range(len(requests)), key=lambda i: arrivals[i])
        ids = [f"{tag}{i}" for i in range(len(requests))]
        t0, nxt = time.perf_counter(), 0
        while nxt < len(order) or any(i not in pre.completed for i in ids):
            now = time.perf_counter()
            while nxt < len(order) and t0 + arrivals[order[nxt]] <= now:
                i = order[nxt]
                self.submit(ids[i], requests[i], t0 + arrivals[i])
                nxt += 1
            pre.step()
            if not pre.scheduler.has_unfinished():
                time.sleep(1e-4)
        completions = [pre.completed[i] for i in ids]
        for c in completions:
            c.request_id = c.request_id.removeprefix(tag)
        return {"completions": completions, "duration": time.perf_counter() - t0}


@dataclass
class Node:
    """One rank of the system: its engine, the mailbox store, its instance, and on rank 0 the router."""

    engine: LLMEngine
    store: dist.TCPStore
    instance: PrefillInstance | DecodeInstance
    router: Router | None = None


def build_engine(cfg: DisaggConfig) -> LLMEngine:
    """This rank's nano_vllm engine (rank 0: `cfg.engine`; decode ranks: with `cfg.decode_engine` over it)."""
    args = dict(cfg.engine) if dist.get_rank() == 0 else {**cfg.engine, **(cfg.decode_engine or {})}
    if torch.cuda.is_available():
        args["device"] = f"cuda:{torch.cuda.current_device()}"
    return LLMEngine(EngineConfig(**args))


def connect(cfg: DisaggConfig, engine: LLMEngine,
            prefill_cls: Callable[..., PrefillInstance] = PrefillInstance,
            decode_cls: Callable[..., DecodeInstance] = DecodeInstance) -> Node:
    """Register this rank's KV geometry, wait for the router's verdict on all of them (transport.handshake)
    and build the rank's instance over `engine`'s scheduler and runner: `prefill_cls` on rank 0,
    `decode_cls` on the others (extension points: the measurement layer passes its subclasses)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    port = [find_free_port() if rank == 0 else 0]  # a store of our own: the process group's is private
    dist.broadcast_object_list(port, src=0)
    store = dist.TCPStore("127.0.0.1", port[0], world, is_master=rank == 0, wait_for_workers=True)
    runner, transport = engine.model_runner, DistTransport(store, rank)
    names = ["prefill0"] + [f"decode{r}" for r in range(1, world)]
    register(store, names[rank], KVGeometry.of_cache(runner.kv_cache), runner.num_blocks)
    if rank > 0:
        store.wait(["handshake"])
        verdict = store.get("handshake").decode()
        if verdict != "ok":
            raise RuntimeError(f"decode rank {rank}: router rejected the handshake: {verdict}")
        return Node(engine, store, decode_cls(engine.scheduler, runner, transport, 0, cfg.lease_ttl_s))
    try:
        info = handshake(store, names, cfg.handshake_timeout_s)
    except BaseException as e:
        store.set("handshake", f"{type(e).__name__}: {e}")
        raise
    store.set("handshake", "ok")
    pre = prefill_cls(engine.scheduler, runner, transport, list(range(1, world)), cfg.lease_ttl_s)
    decode_blocks = min(info[n]["num_blocks"] for n in names[1:])
    router = Router(pre, engine.max_model_len, decode_blocks, engine.config.block_size)
    return Node(engine, store, pre, router)


def instance_main(cfg: DisaggConfig, requests: list[Request], rounds: list[list[float]]) -> dict:
    """Body of every rank: rank 0 routes and prefills, ranks 1.. decode. Serves `requests` once per round of
    arrival times (one round per rate: engines and connections are set up once). Rank 0 returns
    {"rounds": [Router.serve's result, ...]}, a decode rank {}."""
    node = connect(cfg, build_engine(cfg))
    result = {}
    if node.router is None:
        serve_decode(node.instance)
    else:
        result["rounds"] = serve_rounds(node.router, requests, rounds)
        stop_decodes(node.instance)
    dist.barrier()  # rank 0 hosts the store: it must outlive every reader
    return result


def serve_decode(dec: DecodeInstance) -> None:
    """A decode rank's loop: step until the router says Stop and nothing is left."""
    while not dec.stopped or dec.has_work():
        dec.step()
        if not dec.has_work():
            time.sleep(1e-4)


def stop_decodes(pre: PrefillInstance) -> None:
    """Tell every decode instance to stop once it has drained."""
    for dst in pre.decode_ranks:
        pre.transport.send(dst, Stop())


def serve_rounds(router: Router, requests: list[Request], rounds: list[list[float]]) -> list[dict]:
    """`Router.serve` once per list of arrival times, request ids "<k>:<index>" in round k, with a progress
    line after each (a run cut off by a time limit shows how far it got)."""
    out = []
    for k, arrivals in enumerate(rounds):
        out.append(router.serve(f"{k}:", requests, arrivals))
        print(f"disaggregated round {k + 1}/{len(rounds)}: {len(requests)} requests in "
              f"{out[-1]['duration']:.1f} s", flush=True)
    return out


def run_disaggregated_rounds(cfg: DisaggConfig, requests: list[Request], rounds: list[list[float]],
                             timeout_s: float = 300.0, main: Callable[..., dict] = instance_main) -> dict:
    """Spawn 1 prefill + `num_decode` decode ranks (gloo on CPU, NCCL on GPUs), run `main` (default
    `instance_main`) on each: `requests` served open-loop once per list of arrival times in `rounds`
    (seconds from the round's start). Returns rank 0's result — {"rounds": [{"completions": [Completion,
    ...] in request order, "duration"}, ...]} — with the decode ranks' results merged in (lists
    concatenated, dicts joined: what `measure.measured_instance_main` logs)."""
    backend = "nccl" if torch.cuda.device_count() > cfg.num_decode else "gloo"
    results = run_distributed(main, 1 + cfg.num_decode, cfg, requests, rounds, backend=backend,
                              timeout_s=timeout_s)
    merged = dict(results[0])
    for res in results[1:]:
        for key, value in res.items():
            if isinstance(value, list):
                merged[key] = merged.get(key, []) + value
            else:
                merged[key] = {**merged.get(key, {}), **value}
    return merged


def run_disaggregated(cfg: DisaggConfig, requests: list[Request], arrivals: list[float],
                      timeout_s: float = 300.0, main: Callable[..., dict] = instance_main) -> dict:
    """One round of `run_disaggregated_rounds`: {"completions": [Completion, ...] in request order,
    "duration"}, and what `main` logged (per-request dicts keyed by request index: one round, no
    ambiguity)."""
    res = run_disaggregated_rounds(cfg, requests, [arrivals], timeout_s, main)
    (one,) = res.pop("rounds")
    for key, value in res.items():
        if isinstance(value, dict):  # "0:<id>" -> "<id>"
            res[key] = {k.split(":", 1)[1]: v for k, v in value.items()}
    return {**one, **res}
