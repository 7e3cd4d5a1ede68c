"""In-memory stand-ins for the leak test: a transport with a simulated clock, random delays, drops and dead
ranks, and a model runner that only samples (the real Scheduler / BlockManager / instances run unchanged)."""

from __future__ import annotations

import random

import torch

from nano_distserve.protocol import Message, Nack, Pull, Ready, Renew, Sent


class SimNet:
    def __init__(self, seed: int = 0, max_delay: float = 0.05, drop: float = 0.0, slow: float = 0.0,
                 slow_delay: float = 5.0):
        self.now, self.rng = 0.0, random.Random(seed)
        self.max_delay, self.drop, self.slow, self.slow_delay = max_delay, drop, slow, slow_delay
        self.inbox: dict[int, list[tuple[float, int, int, Message]]] = {}
        self.kv: dict[tuple[int, int, int], torch.Tensor] = {}
        self.dead: set[int] = set()
        self.count = 0

    def clock(self) -> float:
        return self.now

    def transport(self, rank: int) -> SimTransport:
        self.inbox[rank] = []
        return SimTransport(self, rank)


class _Done:
    def __init__(self, fn=None):
        self.fn = fn

    def is_completed(self) -> bool:
        return True

    def wait(self):
        return self.fn() if self.fn else None


class SimTransport:
    def __init__(self, net: SimNet, rank: int):
        self.net, self.rank = net, rank

    def send(self, dst: int, msg: Message) -> None:
        net = self.net
        # Transfer-protocol messages may be lost (a stand-in for a peer that dies and comes back); the
        # final reports to the router ride the reliable store, as in DistTransport, and rank 0 never dies.
        lossy = isinstance(msg, (Ready, Pull, Sent, Renew, Nack))
        if dst in net.dead or self.rank in net.dead or (lossy and net.rng.random() < net.drop):
            return  # lost: only a lease can notice
        delay = net.slow_delay if net.rng.random() < net.slow else net.rng.random() * net.max_delay
        net.count += 1
        net.inbox[dst].append((net.now + delay, net.count, self.rank, msg))

    def poll(self) -> list[tuple[int, Message]]:
        box = self.net.inbox[self.rank]
        box.sort(key=lambda x: (x[0], x[1]))
        ready = [(src, m) for t, _, src, m in box if t <= self.net.now]
        self.net.inbox[self.rank] = [x for x in box if x[0] > self.net.now]
        return ready

    def isend_kv(self, dst: int, tag: int, tensor: torch.Tensor):
        self.net.kv[(self.rank, dst, tag)] = tensor
        return _Done()

    def irecv_kv(self, src: int, tag: int, tensor: torch.Tensor):
        return _Done(lambda: tensor.copy_(self.net.kv.pop((src, self.rank, tag))))


class FakeRunner:
    """Samples token 7 for everyone; K/V of a token = its id, so transfers stay checkable."""

    def __init__(self, num_blocks: int, block_size: int):
        self.kv_cache = torch.zeros(2, 1, num_blocks + 1, block_size, 1, 1)
        self.block_size = block_size

    def execute(self, out) -> list[int]:
        for seq, n in zip(out.seqs, out.num_new_tokens):
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                b, o = divmod(p, self.block_size)
                self.kv_cache[:, 0, seq.block_table[b], o] = float(seq.token_ids[p])
        return [7] * sum(out.samples)

    def release(self, seq) -> None:
        pass
