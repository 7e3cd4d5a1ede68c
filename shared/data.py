"""Training data: the embedded corpus, tokenized, and a seeded batcher for next-token prediction.

The corpus is the standard library's documentation (`shared/corpus/stdlib_docs.txt.gz`, built by
`shared/corpus/build_corpus.py`), documents separated by `<|endoftext|>`. It ships inside the package,
so training needs no download and sees the same bytes on every machine.

`TokenBatches` draws random windows for the language-modelling objective of GPT (next-token prediction:
targets are the inputs shifted by one). Under data parallelism every rank draws the same *global* batch
and keeps its own rows, so N ranks with `batch_size` b see exactly what one process with b·N sees, which
is what makes "DP training equals single-process training" testable.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.resources
from collections.abc import Iterator
from typing import Any

import tiktoken
import torch

from shared.tokenizer import EOT, get_tokenizer

CORPUS_PACKAGE, CORPUS_FILE = "shared.corpus", "stdlib_docs.txt.gz"
SPLITS = ("train", "val")
VAL_EVERY = 20  # every 20th document is validation: a 5% split spread over all modules


@functools.lru_cache(maxsize=1)
def load_corpus() -> str:
    """The embedded corpus as one string (about 2 MB of UTF-8), documents joined by `<|endoftext|>`."""
    data = importlib.resources.files(CORPUS_PACKAGE).joinpath(CORPUS_FILE).read_bytes()
    return gzip.decompress(data).decode("utf-8")


def corpus_documents(split: str = "train") -> list[str]:
    """The documents of one split. Document i is validation iff i % 20 == 19 (fixed, seed-free).

    Interleaving rather than taking the tail keeps validation representative: the corpus is sorted by
    module name, so its last 5% would be only `xml`..`zoneinfo`.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    docs = load_corpus().split(EOT)
    is_val = split == "val"
    return [d for i, d in enumerate(docs) if (i % VAL_EVERY == VAL_EVERY - 1) == is_val]


# (split, encoding) -> tokens; Encoding objects hash by identity, and get_tokenizer() is itself cached.
# Tokenizing the whole corpus takes ~0.25 s, so an in-memory cache is enough (no disk cache).
_TOKENS: dict[tuple[str, tiktoken.Encoding], torch.Tensor] = {}


def corpus_tokens(split: str = "train", encoding: tiktoken.Encoding | None = None) -> torch.Tensor:
    """The split as one 1-D int64 tensor of token ids, every document followed by `<|endoftext|>`.

    `encoding` defaults to the project tokenizer (`shared.tokenizer.get_tokenizer()`). The result is
    cached per (split, encoding) and shared: do not modify it in place.
    """
    enc = encoding if encoding is not None else get_tokenizer()
    key = (split, enc)
    if key not in _TOKENS:
        docs = corpus_documents(split)
        text = "".join(d + EOT for d in docs)
        ids = enc.encode(text, allowed_special={EOT})
        _TOKENS[key] = torch.tensor(ids, dtype=torch.int64)
    return _TOKENS[key]


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_tokens(tokens: Any, seq_len: int) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
        raise ValueError(f"tokens must be a 1-D integer tensor, got {type(tokens).__name__} "
                         f"{getattr(tokens, 'shape', '')}")
    if seq_len >= tokens.numel():
        raise ValueError(f"seq_len ({seq_len}) must be < len(tokens) ({tokens.numel()}): a window needs "
                         "seq_len + 1 tokens for its shifted targets")


def _check_rank(rank: Any, world_size: Any) -> None:
    _check_positive_int("world_size", world_size)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")


def _step_seed(seed: int, step: int) -> int:
    # One generator seed per (seed, step): resuming at step k is O(1), and nearby (seed, step) pairs get
    # unrelated streams (seed*K + step would make seed 1 step 0 equal seed 0 step K).
    digest = hashlib.sha256(f"nano-infra/{seed}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TokenBatches:
    """Random next-token windows from a token stream, deterministic under `seed` on any machine.

    Step k draws `batch_size * world_size` window starts uniformly from a `torch.Generator` seeded by
    (seed, k); rank r keeps rows [r*batch_size, (r+1)*batch_size) of that global batch. Each batch is
    `(inputs, targets)`, two int64 tensors of shape (batch_size, seq_len) with
    `targets[:, i] == inputs[:, i + 1]` for i < seq_len - 1 (both slices of one seq_len+1 window).
    The stream is infinite: iterate, or call `next_batch()`.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        _check_positive_int("batch_size", batch_size)
        _check_positive_int("seq_len", seq_len)
        _check_tokens(tokens, seq_len)
        _check_rank(rank, world_size)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.tokens = tokens.to(device="cpu", dtype=torch.int64)
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.step = 0
        self._offsets = torch.arange(seq_len + 1)

    @classmethod
    def from_corpus(cls, split: str = "train", batch_size: int = 8, seq_len: int = 128, seed: int = 0,
                    rank: int = 0, world_size: int = 1,
                    encoding: tiktoken.Encoding | None = None) -> TokenBatches:
        """Batches over a split of the embedded corpus (see `corpus_tokens`)."""
        return cls(corpus_tokens(split, encoding), batch_size, seq_len, seed, rank, world_size)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def global_starts(self, step: int) -> torch.Tensor:
        """Window starts of the whole global batch at `step` (the same on every rank)."""
        gen = torch.Generator(device="cpu").manual_seed(_step_seed(self.seed, step))
        # a start s needs tokens s .. s+seq_len, so s ranges over [0, len - seq_len)
        high = self.tokens.numel() - self.seq_len
        return torch.randint(0, high, (self.global_batch_size,), generator=gen)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) for the current step; advances the step."""
        starts = self.global_starts(self.step)[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        self.step += 1
        windows = self.tokens[starts[:, None] + self._offsets]  # (batch_size, seq_len + 1)
        # contiguous, so callers can `.view(-1)` them for the loss
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Where the stream is; plain ints, so it fits in a checkpoint's JSON or torch.save."""
        return {"seed": self.seed, "step": self.step, "global_batch_size": self.global_batch_size,
                "seq_len": self.seq_len, "num_tokens": self.tokens.numel()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the stream saved by `state_dict()`.

        The world size may change between save and load as long as the global batch size is the same:
        the stream of global batches is defined by (seed, step, global batch, seq_len, data) only.
        """
        missing = {"seed", "step", "global_batch_size", "seq_len", "num_tokens"} - set(state)
        if missing:
            raise ValueError(f"state dict is missing {sorted(missing)}")
        for name, mine in (("global_batch_size", self.global_batch_size), ("seq_len", self.seq_len),
                           ("num_tokens", self.tokens.numel())):
            if state[name] != mine:
                raise ValueError(f"state dict has {name}={state[name]}, but this TokenBatches has {mine}")
        if not isinstance(state["step"], int) or state["step"] < 0:
            raise ValueError(f"state dict step must be a non-negative int, got {state['step']!r}")
        self.seed, self.step = int(state["seed"]), int(state["step"])


def sequential_batches(tokens: torch.Tensor, batch_size: int, seq_len: int, rank: int = 0,
                       world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every non-overlapping window of `tokens` once, in order: for a deterministic validation loss.

    Windows are dealt round-robin to ranks (window j goes to rank j % world_size); a rank's last batch
    may be smaller than `batch_size`, and the tail shorter than one window is dropped.
    """
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("seq_len", seq_len)
    _check_tokens(tokens, seq_len)
    _check_rank(rank, world_size)
    tokens = tokens.to(dtype=torch.int64)
    n_windows = (tokens.numel() - 1) // seq_len
    starts = torch.arange(rank, n_windows, world_size) * seq_len
    offsets = torch.arange(seq_len + 1)
    for chunk in starts.split(batch_size):
        windows = tokens[chunk[:, None] + offsets]
        yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
