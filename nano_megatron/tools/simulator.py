"""A pure-Python pipeline simulator: replays the schedules' action lists with unit costs.

    python -m nano_megatron.tools.simulator --stages 4 --micro 8 --schedule 1f1b

Each stage runs its list from `schedules.py` (interleaved 1F1B: `interleaved_1f1b` below, which only the
simulator runs) in order. Between two actions it posts one batch of point-to-point operations — the
sends of the action just finished and the receives the next action needs — and waits until every one of
them is matched by the peer, exactly as the runtime does with `dist.batch_isend_irecv`
(`pipeline_parallel.PipelineSchedule`). Communication itself takes no time.
So the simulator is also a deadlock check of the runtime's ordering: a cycle of waiting stages raises.
The interleaved schedule (not executed by the runtime) is simulated with buffered sends instead: a
send completes when posted and only receives wait, the idealised model of 2104.04473 §2.2.2.

The bubble fraction of a stage is 1 − busy / makespan; for GPipe and 1F1B it equals (p−1)/(m+p−1)
(2104.04473 §2.2.1), which the tests check for many (p, m).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from fractions import Fraction

from nano_megatron.schedules import Action, _check, bubble_fraction_formula, schedule_actions


def interleaved_1f1b(num_stages: int, num_micro: int, stage: int, num_chunks: int) -> list[Action]:
    """Interleaved 1F1B (2104.04473 §2.2.2): device `stage` holds chunks c = 0..v−1, i.e. virtual stages
    c·p + stage. Micro-batches go through in groups of p; forwards visit chunk 0 for a group, then
    chunk 1, …; backwards visit chunks in reverse. Warm-up is (p−stage−1)·2 + (v−1)·p forwards
    (Megatron's `forward_backward_pipelining_with_interleaving`). Needs m divisible by p."""
    _check(num_stages, num_micro, stage)
    p, v, m = num_stages, num_chunks, num_micro
    if v < 1 or m % p:
        raise ValueError(f"interleaved 1F1B needs num_chunks >= 1 and num_micro % num_stages == 0, "
                         f"got v={v}, m={m}, p={p}")
    total = m * v

    def fwd(k: int) -> Action:  # k-th forward of this device
        group, within = divmod(k, p * v)
        return Action("F", group * p + within % p, within // p)

    def bwd(k: int) -> Action:
        group, within = divmod(k, p * v)
        return Action("B", group * p + within % p, v - 1 - within // p)

    warmup = total if m == p else min(total, (p - stage - 1) * 2 + (v - 1) * p)
    actions = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [fwd(warmup + k), bwd(k)]
    actions += [bwd(k) for k in range(total - warmup, total)]
    return actions


@dataclass
class SimResult:
    """timelines[s] = [(start, end, action)] of stage s; makespan and bubble as exact fractions."""

    timelines: list[list[tuple[Fraction, Fraction, Action]]]
    makespan: Fraction
    busy: list[Fraction]

    @property
    def bubble(self) -> list[Fraction]:
        return [1 - b / self.makespan for b in self.busy]

    def render(self, unit: Fraction | int = 1) -> str:
        """One line per stage, one 3-character cell per `unit` of time ('..' = idle)."""
        unit = Fraction(unit)
        cells = int(self.makespan / unit)
        lines = []
        for s, tl in enumerate(self.timelines):
            row = [".."] * cells
            for start, end, a in tl:
                for c in range(int(start / unit), int(end / unit)):
                    row[c] = str(a)
            lines.append(f"stage {s}: " + " ".join(f"{x:>{2 + (len(x) > 2)}}" for x in row)
                         + f"   bubble {float(self.bubble[s]):.3f}")
        return "\n".join(lines)


def _messages(a: Action, stage: int, p: int, v: int) -> tuple[list[tuple], list[tuple]]:
    """(receives needed before `a`, sends made after `a`) as message keys (kind, micro, to-virtual-stage).
    Virtual stage of chunk c on device d is c·p + d; activations go up, gradients go down."""
    vs, last = a.chunk * p + stage, v * p - 1
    if a.kind == "F":
        recv = [("act", a.micro, vs)] if vs > 0 else []
        send = [("act", a.micro, vs + 1)] if vs < last else []
    else:
        recv = [("grad", a.micro, vs)] if vs < last else []
        send = [("grad", a.micro, vs - 1)] if vs > 0 else []
    return recv, send


def simulate(schedule: str, num_stages: int, num_micro: int, t_f: int | Fraction = 1,
             t_b: int | Fraction = 2, num_chunks: int = 1) -> SimResult:
    """Run `schedule` ("gpipe", "1f1b" or "interleaved") with forward cost t_f and backward cost t_b
    per full stage (a chunk of the interleaved schedule costs 1/num_chunks of that)."""
    p, m, v = num_stages, num_micro, num_chunks
    buffered = schedule == "interleaved"
    if buffered:
        lists = [interleaved_1f1b(p, m, s, v) for s in range(p)]
    else:
        if v != 1:
            raise ValueError(f"num_chunks > 1 needs schedule='interleaved', got {schedule!r}")
        lists = [schedule_actions(schedule, p, m, s) for s in range(p)]
    cost = {"F": Fraction(t_f) / v, "B": Fraction(t_b) / v}
    posted_send: dict[tuple, Fraction] = {}  # message -> when its sender posted it
    posted_recv: dict[tuple, Fraction] = {}
    clock = [Fraction(0)] * p
    nxt = [0] * p  # index of the next action of each stage
    pending: list[list[tuple] | None] = [None] * p  # the batch a stage is waiting on
    timelines: list[list] = [[] for _ in range(p)]
    carry_sends: list[list[tuple]] = [[] for _ in range(p)]

    def post(s: int) -> None:
        recvs = _messages(lists[s][nxt[s]], s, p, v)[0] if nxt[s] < len(lists[s]) else []
        for key in carry_sends[s]:
            posted_send[key] = clock[s]
        for key in recvs:
            posted_recv[key] = clock[s]
        pending[s] = [("send", k) for k in carry_sends[s]] + [("recv", k) for k in recvs]

    for s in range(p):
        post(s)
    while any(pending[s] is not None for s in range(p)):
        progressed = False
        for s in range(p):
            batch = pending[s]
            if batch is None:
                continue
            peer = [(clock[s] if buffered else posted_recv.get(k)) if op == "send" else posted_send.get(k)
                    for op, k in batch]
            if any(t is None for t in peer):
                continue  # some peer has not posted its side yet
            clock[s] = max([clock[s], *peer])
            progressed = True
            if nxt[s] == len(lists[s]):
                pending[s] = None  # final sends delivered: this stage is done
                continue
            a = lists[s][nxt[s]]
            timelines[s].append((clock[s], clock[s] + cost[a.kind], a))
            clock[s] += cost[a.kind]
            carry_sends[s] = _messages(a, s, p, v)[1]
            nxt[s] += 1
            post(s)
        if not progressed:
            stuck = {s: str(lists[s][nxt[s]]) if nxt[s] < len(lists[s]) else "final sends"
                     for s in range(p) if pending[s] is not None}
            raise RuntimeError(f"{schedule} deadlocks with p={p}, m={m}: stages waiting at {stuck}")
    busy = [sum((e - b for b, e, _ in tl), Fraction(0)) for tl in timelines]
    return SimResult(timelines, max(clock), busy)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m nano_megatron.tools.simulator`."""
    ap = argparse.ArgumentParser(prog="python -m nano_megatron.tools.simulator",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--stages", "-p", type=int, default=4)
    ap.add_argument("--micro", "-m", type=int, default=8)
    ap.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    ap.add_argument("--chunks", "-v", type=int, default=1, help="model chunks per device (interleaved)")
    ap.add_argument("--t-f", type=int, default=1, help="forward cost of a full stage")
    ap.add_argument("--t-b", type=int, default=2, help="backward cost of a full stage")
    return ap


def main(argv: list[str] | None = None) -> SimResult:
    a = build_parser().parse_args(argv)
    v = a.chunks if a.schedule == "interleaved" else 1
    res = simulate(a.schedule, a.stages, a.micro, a.t_f, a.t_b, v)
    print(f"{a.schedule}: p={a.stages}, m={a.micro}, v={v}, t_f={a.t_f}, t_b={a.t_b}")
    print(res.render(Fraction(a.t_f, v)))
    print(f"bubble fraction: simulated {float(max(res.bubble)):.4f}, "
          f"formula (p-1)/(v·m+p-1) = {bubble_fraction_formula(a.stages, a.micro, v):.4f}")
    return res


if __name__ == "__main__":
    main()
