"""A discrete-event simulator of colocated and disaggregated serving (DistServe, arXiv 2401.09670, §4.1
and Appendix A: the placement search needs attainment at many rates, far too many to measure).

* `LatencyModel`: step time = c0 + c_prefill * prefill tokens + c_decode * decode sequences
  + c_context * context tokens read by attention (+ c_prefill_step + c_mixed_context * context tokens in a
  step that carries prefill), divided by a tensor-parallel speed-up. The paper derives
  the same shape from FLOP counts (its Appendix A: linear and quadratic prefill terms, linear decode
  terms); `LatencyModel.fit` fits it by least squares to steps measured by the real engine
  (`StepRecord`s, logged by nano_distserve.bench.measure), so the simulator predicts *this* engine on *this* GPU.
* KV memory: every instance has `kv_tokens` of cache; a request reserves prompt + output tokens when
  admitted (conservative: no preemption is modelled). A disaggregated prefill instance keeps a request's
  prompt K/V until the decode instance has pulled it, so a full decode side backs up into the prefill side.
* KV transfer: prompt tokens x `kv_bytes_per_token` / `bandwidth` + `transfer_latency`, overlapped with
  compute (a separate link), starting when the decode instance admits the request (pull) — or, as the real
  instances do, when the prefill instance ends the step it was running then (`pull_at_step_boundary`).
* Scheduling: colocated "plain" (vLLM before chunked prefill: a prefill step whenever prompts wait, which
  stalls every decode — the interference of §2.3) or "chunked" (Sarathi: decodes first, prompt chunks fill
  the token budget); disaggregated: prefill-only and decode-only instances, requests to the least-loaded.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field, fields

import torch

from nano_vllm.metrics import RequestMetrics


@dataclass
class LatencyModel:
    """Step time of one instance (§4.1, Appendix A), with the coefficients fitted to measured steps."""

    c0: float = 5e-3
    c_prefill: float = 5e-5
    c_decode: float = 1e-4
    c_context: float = 1e-7
    # Fixed cost of a step that carries any prefill tokens: a step that replays no CUDA graph is host-bound
    # on a fast GPU (on an H200, qwen3-0.6b shape, a 256-token eager chunk step took ~21 ms against ~2.5 ms
    # for 32 graph-replayed decodes), which a per-token slope alone cannot fit.
    c_prefill_step: float = 0.0
    # Extra cost per context token in a step that carries prefill. An engine that attends a mixed step's
    # decodes with the varlen prefill kernel makes each decode's one query row pay for a 128-row tile's pass
    # over its context (~1.4-2e-7 s/token on the llama3-8b shape against ~3-6e-8 in decode-only steps);
    # nano_vllm routes those decodes to the decode kernel, and the fit puts this term at 0.
    c_mixed_context: float = 0.0
    tp_efficiency: float = 0.85  # speed-up of tp GPUs = tp * efficiency ** log2(tp)

    def __post_init__(self) -> None:
        if not 0 < self.tp_efficiency <= 1:
            raise ValueError(f"tp_efficiency must be in (0, 1], got {self.tp_efficiency}")
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0 (seconds), got {getattr(self, f.name)}")

    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int,
                  tp: int = 1) -> float:
        """Seconds of a step with these phase counts on `tp` GPUs."""
        t = (self.c0 + self.c_prefill * prefill_tokens + self.c_decode * decode_seqs
             + self.c_context * context_tokens)
        if prefill_tokens:
            t += self.c_prefill_step + self.c_mixed_context * context_tokens
        return t / (tp * self.tp_efficiency ** (tp.bit_length() - 1))

    @classmethod
    def fit(cls, steps: list) -> LatencyModel:
        """Non-negative least squares over measured steps (`measure.StepRecord`: prefill_tokens, decode_seqs,
        context_tokens, seconds): a coefficient the data would make negative (noise) is fixed at 0 and the
        others are fitted again without it (clamping it afterwards would leave the rest fitted to a model with
        it). Without both decode-only and prefill-carrying steps the step constant and `c_prefill_step` cannot
        be told apart: the minimum-norm solution splits it."""
        # columns: 1, prefill tokens, decode seqs, context tokens, carries prefill, context if it does
        x = torch.tensor([[1.0, s.prefill_tokens, s.decode_seqs, s.context_tokens,
                           s.prefill_tokens > 0, s.context_tokens * (s.prefill_tokens > 0)]
                          for s in steps], dtype=torch.float64)
        y = torch.tensor([s.seconds for s in steps], dtype=torch.float64)[:, None]
        # columns of similar size: tokens are 1e3x seconds' terms
        scale = x.abs().amax(dim=0).clamp(min=1.0)
        active, coef = list(range(x.shape[1])), torch.zeros(x.shape[1], dtype=torch.float64)
        while active:
            sol = torch.linalg.lstsq(x[:, active] / scale[active], y, driver="gelsd").solution[:, 0]
            if (sol >= 0).all():
                coef[active] = sol / scale[active]
                break
            active.pop(int(sol.argmin()))  # the most negative goes first, then refit
        return cls(*coef.tolist())  # the columns are in the order of the coefficient fields


@dataclass
class SimConfig:
    mode: str = "disaggregated"  # "colocated" | "disaggregated"
    policy: str = "chunked"  # colocated only: "plain" | "chunked"
    num_instances: int = 1  # colocated replicas
    num_prefill: int = 1
    num_decode: int = 1
    tp: int = 1  # GPUs per instance
    tp_prefill: int | None = None  # per-phase overrides (the planner's (tp, #prefill, #decode))
    tp_decode: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    kv_tokens: int = 200_000  # KV cache capacity of one instance, tokens
    # K and V, layers, hidden, bf16 (a 13B-class model)
    kv_bytes_per_token: float = 2 * 40 * 5120 * 2
    bandwidth: float = 25e9  # bytes/s between a prefill and a decode instance
    transfer_latency: float = 1e-4
    # A prefill instance answers pulls between its steps (nano_distserve's instance loop: poll, then step),
    # so a pull that finds it running a step waits for that step to end. False: pulls start at once.
    pull_at_step_boundary: bool = True

    def __post_init__(self) -> None:
        modes, policies = ("colocated", "disaggregated"), ("plain", "chunked")
        if self.mode not in modes or self.policy not in policies:
            raise ValueError(f"mode must be 'colocated' or 'disaggregated' and policy 'plain' or "
                             f"'chunked', got {self.mode!r} and {self.policy!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0 (bytes/s), got {self.bandwidth}")

    @property
    def num_gpus(self) -> int:
        if self.mode == "colocated":
            return self.num_instances * self.tp
        return (self.num_prefill * (self.tp_prefill or self.tp)
                + self.num_decode * (self.tp_decode or self.tp))


@dataclass
class _Req:
    rid: int
    arrival: float
    prompt: int
    output: int
    prefilled: int = 0
    generated: int = 0
    first_token: float | None = None
    finish: float | None = None


@dataclass
class _Instance:
    kind: str  # "colocated" | "prefill" | "decode"
    tp: int
    kv_tokens: int
    # prompts to prefill (or, decode side: (req, src) to pull)
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    kv_used: int = 0
    busy: bool = False
    # prefill side: pulls waiting for the step in flight to end
    pulls: list = field(default_factory=list)

    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def reservation(self, r: _Req) -> int:
        """KV tokens `r` holds here: a prefill instance keeps the prompt only, the others prompt + output."""
        return r.prompt + (0 if self.kind == "prefill" else r.output)


def simulate(cfg: SimConfig, model: LatencyModel, requests: list[tuple[int, int]],
             arrivals: list[float], decode_model: LatencyModel | None = None
             ) -> list[RequestMetrics]:
    """Serve (prompt_len, output_len) requests arriving at `arrivals`; returns nano_vllm RequestMetrics.
    `decode_model` (default `model`) times a disaggregated decode instance's steps: its iteration also
    receives and imports K/V, work a prefill instance's steps do not have, so each role gets its own fit."""
    sim = _Simulation(cfg, model, decode_model or model)
    reqs = [_Req(i, a, p, max(o, 1)) for i, ((p, o), a) in enumerate(zip(requests, arrivals))]
    for r in reqs:
        if r.prompt + r.output > cfg.kv_tokens:
            raise ValueError(f"request {r.rid} needs {r.prompt + r.output} KV tokens, an instance "
                             f"holds {cfg.kv_tokens}")
    sim.run(reqs)
    return [RequestMetrics(str(r.rid), r.arrival, r.first_token,
                           r.finish if r.finish is not None else r.arrival, r.prompt, r.output)
            for r in reqs]


class _Simulation:
    """`simulate`'s event loop: request arrivals, step ends and finished pulls, in time order."""

    def __init__(self, cfg: SimConfig, model: LatencyModel, decode_model: LatencyModel):
        self.cfg, self.model, self.decode_model = cfg, model, decode_model
        if cfg.mode == "colocated":
            self.fronts = [_Instance("colocated", cfg.tp, cfg.kv_tokens)
                           for _ in range(cfg.num_instances)]
            self.decodes: list[_Instance] = []
        else:  # disaggregated
            self.fronts = [_Instance("prefill", cfg.tp_prefill or cfg.tp, cfg.kv_tokens)
                           for _ in range(cfg.num_prefill)]
            self.decodes = [_Instance("decode", cfg.tp_decode or cfg.tp, cfg.kv_tokens)
                            for _ in range(cfg.num_decode)]
        self.events: list = []
        self.tick = itertools.count()  # ties in time go in the order pushed

    def push(self, t: float, handler, *args) -> None:
        heapq.heappush(self.events, (t, next(self.tick), handler, args))

    def run(self, reqs: list[_Req]) -> None:
        for r in reqs:
            self.push(r.arrival, self.arrive, r)
        while self.events:
            now, _, handler, args = heapq.heappop(self.events)
            handler(now, *args)

    # ------------------------------------------------------------------ events
    def arrive(self, now: float, r: _Req) -> None:
        target = min(self.fronts, key=_Instance.load)  # the router: least loaded instance
        target.waiting.append(r)
        self.start(target, now)

    def pulled(self, now: float, inst: _Instance, r: _Req, src: _Instance) -> None:
        """A request's K/V reached decode instance `inst`: it decodes from the next step; `src` frees it."""
        src.kv_used -= src.reservation(r)
        inst.running.append(r)
        self.start(inst, now)
        self.start(src, now)

    def step_done(self, now: float, inst: _Instance, pre: list, dec: list) -> None:
        """A step ended: its decodes got a token each, its prompt chunks advanced; done prompts move on."""
        inst.busy = False
        for r in dec:
            r.generated += 1
            if r.generated >= r.output:
                inst.running.remove(r)
                self.finish(inst, r, now)
        handed = []
        for r, n in pre:
            r.prefilled += n
            if r.prefilled < r.prompt:
                continue
            r.first_token, r.generated = now, 1
            if inst.kind == "colocated":
                inst.waiting.remove(r)
            if r.output == 1:
                self.finish(inst, r, now)
            elif inst.kind == "colocated":
                inst.running.append(r)
            else:
                handed.append(r)
        for dec_inst, r in inst.pulls:  # pulls that waited for this step: served now, between steps
            self.pull(dec_inst, r, inst, now)
        inst.pulls.clear()
        if inst.kind == "decode":
            self.admit_decode(inst, now)
        self.start(inst, now)
        # The hand-offs' pulls come back after the instance may have started its next step (the decode
        # side hears of them only now): with work waiting, they wait for that step too.
        for r in handed:
            target = min(self.decodes, key=_Instance.load)
            target.waiting.append((r, inst))
            self.admit_decode(target, now)

    # ------------------------------------------------------------------ actions
    def finish(self, inst: _Instance, r: _Req, now: float) -> None:
        r.finish = now
        inst.kv_used -= inst.reservation(r)

    def start(self, inst: _Instance, now: float) -> None:
        """Start the instance's next step unless it is busy or idle; it ends `LatencyModel.step_time`
        later."""
        if inst.busy:
            return
        batch = self.plan_step(inst)
        if batch is None:
            return
        pre, dec = batch
        ctx = sum(r.prefilled + n for r, n in pre) + sum(r.prompt + r.generated for r in dec)
        model = self.decode_model if inst.kind == "decode" else self.model
        inst.busy = True
        seconds = model.step_time(sum(n for _, n in pre), len(dec), ctx, inst.tp)
        self.push(now + seconds, self.step_done, inst, pre, dec)

    def pull(self, inst: _Instance, r: _Req, src: _Instance, now: float) -> None:
        """Start `r`'s KV transfer from `src` to `inst`: latency + prompt bytes / bandwidth."""
        cfg = self.cfg
        seconds = cfg.transfer_latency + r.prompt * cfg.kv_bytes_per_token / cfg.bandwidth
        self.push(now + seconds, self.pulled, inst, r, src)

    def admit_decode(self, inst: _Instance, now: float) -> None:
        """Backpressure: pull the oldest waiting request only when its whole reservation fits."""
        while (inst.waiting
               and inst.kv_used + inst.reservation(inst.waiting[0][0]) <= inst.kv_tokens):
            r, src = inst.waiting.popleft()
            inst.kv_used += inst.reservation(r)
            if self.cfg.pull_at_step_boundary and src.busy:
                src.pulls.append((inst, r))
            else:
                self.pull(inst, r, src, now)

    def plan_step(self, inst: _Instance) -> tuple[list, list] | None:
        """(prefill [(req, tokens)], decode [req]) of the instance's next step, or None if it has nothing to
        do."""
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        if inst.kind == "decode":
            return ([], inst.running[: cfg.max_num_seqs]) if inst.running else None
        chunked = inst.kind == "colocated" and cfg.policy == "chunked"
        dec = inst.running[: cfg.max_num_seqs] if inst.kind == "colocated" else []
        # Colocated, as nano_vllm's scheduler: the running decodes go first (one token of budget each), then
        # prompts fill what is left — in chunks (chunked), or whole and only if they fit (plain). Either way
        # a prompt rides in the same step as the decodes, whose step it slows down (interference).
        budget -= len(dec)
        pre: list = []
        for r in inst.waiting:
            if budget <= 0:
                break
            if r.prefilled == 0:  # admission: reserve its KV (prefill side: the prompt only)
                if inst.kv_used + inst.reservation(r) > inst.kv_tokens:
                    break
                inst.kv_used += inst.reservation(r)
            n = r.prompt - r.prefilled
            if n > budget:
                # plain: whole prompts, in order
                if not chunked and (pre or n <= cfg.max_num_batched_tokens):
                    inst.kv_used -= inst.reservation(r)
                    break
                # chunked: what fits; plain: a prompt over the whole budget (nano_vllm refuses that config)
                n = budget if chunked else n
            pre.append((r, n))
            budget -= n
        if inst.kind != "colocated":
            for r, n in pre:
                if r.prefilled + n >= r.prompt:
                    inst.waiting.remove(r)
        return (pre, dec) if pre or dec else None
