"""Cache-aware scheduling (SGLang, arXiv 2312.07104, §3 "Cache-aware scheduling", Algorithm 1, Theorem 3.1).

nano_vllm's `Scheduler` admits waiting requests in its queue order; this subclass re-orders the queue
before every step and leaves everything else (budget, chunked prefill, preemption) to it:

* `lpm` — longest prefix match first: sort waiting requests by the length of their cached prefix. The
  paper's Theorem 3.1: for a batch of requests, visiting the radix tree of the requests in DFS order
  attains the optimal hit rate when the cache holds at least the longest request; longest-shared-prefix
  first realises that order online (tests/nano_sglang/test_scheduling.py checks Σ|edges| exactly).
* `dfs-weight` — SGLang's variant: a DFS over the matched tree nodes, heavier subtrees (more waiting
  requests) first, so requests that will share a prefix run together.
* `fcfs` — arrival order (nano_vllm's own), for comparison.

Two refinements from SGLang's runtime:

* deferral: a request that shares ≥ `defer_threshold` uncached tokens with a request ahead of it in the
  order sits out this step; next step the other one's blocks are in the tree and it hits them instead of
  computing the same prefix twice (nano_vllm inserts blocks at admission, so this matters when the
  leader's prompt is split into chunks or cannot be admitted fully);
* aging: a request waiting more than `max_wait_steps` steps goes first (arrival order) whatever the
  policy says, so a request with no shared prefix cannot starve behind a stream of cache hits.

`postprocess` also drives constrained decoding (nano_sglang.constrained): it advances each constrained
request's FSM with the sampled token, finishes it when the FSM accepts and nothing may follow, and
performs jump-forward (§4) by appending the forced string's tokens, which the next step prefills; forced
tokens count against `max_tokens` and `max_model_len`, and a request cut by either ends with "length".
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from nano_sglang.block_manager import RadixBlockManager
from nano_sglang.constrained import Constraint
from nano_sglang.radix_cache import TreeNode
from nano_sglang.sequence import SGLSequence
from nano_vllm.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from nano_vllm.sequence import Sequence, SequenceStatus

POLICIES = ("lpm", "dfs-weight", "fcfs")


@dataclass
class CacheAwareConfig:
    """The cache-aware scheduler's policy and refinements (module docstring)."""

    policy: str = "lpm"
    defer_threshold: int | None = 32  # tokens; None: no deferral
    max_wait_steps: int = 128  # aging bound
    # Longer queues fall back to fcfs: matching every waiting request at every step costs host time that
    # grows with the queue (SGLang's scheduler switches LPM off above 128 waiting requests, too).
    lpm_max_queue: int = 128

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_wait_steps < 1:
            raise ValueError(f"max_wait_steps must be >= 1, got {self.max_wait_steps}")


def lpm_order(seqs: list[Sequence], match_len: dict[int, int]) -> list[Sequence]:
    """Longest prefix match first (Algorithm 1); ties in arrival order."""
    return sorted(seqs, key=lambda s: (-match_len[s.seq_id], s.seq_id))


def dfs_weight_order(seqs: list[Sequence], nodes: dict[int, TreeNode],
                     root: TreeNode) -> list[Sequence]:
    """DFS over the tree of matched nodes, children by weight (waiting requests below) descending."""
    weight: Counter[int] = Counter()
    children: defaultdict[int, dict[int, TreeNode]] = defaultdict(dict)
    at_node: defaultdict[int, list[Sequence]] = defaultdict(list)
    for s in sorted(seqs, key=lambda s: s.seq_id):
        node = nodes[s.seq_id]
        at_node[node.id].append(s)
        while node is not None:
            weight[node.id] += 1
            if node.parent is not None:
                children[node.parent.id][node.id] = node
            node = node.parent
    out: list[Sequence] = []
    stack = [root]
    while stack:
        node = stack.pop()
        out += at_node[node.id]
        # the heaviest child is pushed last, so it is visited first
        stack += sorted(children[node.id].values(), key=lambda n: (weight[n.id], -n.id))
    return out


class CacheAwareScheduler(Scheduler):
    """nano_vllm's scheduler with the waiting queue re-ordered before every step (§3) and jump-forward for
    constrained requests after it (§4)."""

    def __init__(self, config: SchedulerConfig, block_manager: RadixBlockManager,
                 eos_token_ids: set[int] | None = None, policy: CacheAwareConfig | None = None):
        super().__init__(config, block_manager, eos_token_ids)
        self.policy = policy or CacheAwareConfig()
        self.num_steps = 0
        self.enqueued_at: dict[int, int] = {}  # seq_id -> step it first waited

    def add(self, seq: SGLSequence) -> None:
        super().add(seq)
        self.enqueued_at.setdefault(seq.seq_id, self.num_steps)

    def _finish(self, seq: SGLSequence, reason: str) -> None:
        super()._finish(seq, reason)
        self.enqueued_at.pop(seq.seq_id, None)

    # ------------------------------------------------------------------ ordering
    def order_waiting(self) -> tuple[list[SGLSequence], list[SGLSequence]]:
        """(this step's admission order, requests deferred to a later step)."""
        p, bm = self.policy, self.block_manager
        aged, rest = [], []  # aged: waited max_wait_steps or more, they go first in arrival order
        for s in self.waiting:
            waited = self.num_steps - self.enqueued_at.get(s.seq_id, self.num_steps)
            (aged if waited >= p.max_wait_steps else rest).append(s)
        match_len = dict.fromkeys((s.seq_id for s in rest), 0)
        if p.policy == "fcfs" or len(rest) > p.lpm_max_queue or not bm.enabled:
            rest.sort(key=lambda s: s.seq_id)
        else:
            nodes = {}
            for s in rest:
                pages, nodes[s.seq_id] = bm.tree.match_prefix(s.token_ids[: s.num_cacheable_tokens])
                match_len[s.seq_id] = len(pages) * bm.block_size
            bm.matched.update(nodes)  # the allocation that follows uses these matches
            rest = (lpm_order(rest, match_len) if p.policy == "lpm"
                    else dfs_weight_order(rest, nodes, bm.tree.root))
        order, deferred = sorted(aged, key=lambda s: s.seq_id), []
        # (cached length, next uncached tokens) of the requests ahead
        leaders: set[tuple[int, tuple[int, ...]]] = set()
        for s in rest:
            m = match_len[s.seq_id]
            if p.defer_threshold is None or s.num_tokens - m - 1 < p.defer_threshold:
                order.append(s)  # nothing long left to share
                continue
            key = (m, tuple(s.token_ids[m : m + p.defer_threshold]))
            (deferred if key in leaders else order).append(s)
            leaders.add(key)
        return order, deferred

    def schedule(self) -> SchedulerOutput:
        """nano_vllm's step over the cache-aware order; deferred requests wait for the next step."""
        self.waiting, deferred = self.order_waiting()
        try:
            return super().schedule()
        finally:
            self.waiting += deferred  # re-ordered next step anyway
            self.num_steps += 1

    # ------------------------------------------------------------------ constrained decoding
    def postprocess(self, out: SchedulerOutput, sampled: list[int],
                    now: float | None = None) -> list[SGLSequence]:
        """nano_vllm's postprocess, then §4 for constrained requests: advance the FSM by the sampled
        token, jump forward over the compressed edge it now stands on, finish when the FSM accepts and
        nothing may follow ("stop") or when the request has no room left ("length")."""
        finished = super().postprocess(out, sampled, now)
        for seq, samples in zip(out.seqs, out.samples):
            constraint = seq.constraint
            # finished already (EOS in an accepting state, the length limit) or aborted
            if constraint is None or not samples or seq.status is not SequenceStatus.RUNNING:
                continue
            state = constraint.state  # before the sampled token: a jump re-reads that token's text
            constraint.advance(seq.token_ids[-1])
            forced = constraint.forced_string() if constraint.jump_forward else ""
            if forced:
                self._jump_forward(seq, constraint, state, forced)
            reason = ("stop" if constraint.is_terminal() else
                      "length" if self._room(seq) == 0 else None)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _room(self, seq: SGLSequence) -> int:
        """Tokens `seq` may still append: what is left of its max_tokens and of max_model_len."""
        return min(seq.sampling_params.max_tokens - seq.num_output_tokens,
                   self.config.max_model_len - seq.num_tokens)

    def _jump_forward(self, seq: SGLSequence, constraint: Constraint, state: int,
                      forced: str) -> None:
        """§4 jump-forward: append the forced string without model calls. The last sampled token is not
        computed yet, so it is re-tokenized together with the forced string (a boundary token such as
        `"` followed by `name` may merge differently); the next step prefills the new tokens. Forced
        tokens count against max_tokens and max_model_len: a jump is cut to the room left, and the FSM
        reads, from `state` (where it stood before the sampled token), the text actually appended."""
        tok = constraint.tokenizer
        ids = tok.encode(tok.decode(seq.token_ids[-1:]) + forced)[: self._room(seq) + 1]
        seq.token_ids[-1:] = ids
        seq.token_times.extend([seq.token_times[-1]] * (len(ids) - 1))
        constraint.state = state
        constraint.advance_string(tok.decode(ids))
        constraint.num_jump_tokens += len(ids) - 1
