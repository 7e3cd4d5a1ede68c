"""Training data: two corpora, tokenized, and a seeded batcher for next-token prediction.

* `docs` (the default): the standard library's documentation (`shared/corpus/stdlib_docs.txt.gz`, built
  by `shared/corpus/build_corpus.py`, about 2 MB), documents separated by `<|endoftext|>`. It ships
  inside the package, so training needs no download and sees the same bytes on every machine.
* `stdlib`: the standard library's own source, every `.py` file of the running interpreter's stdlib
  directory (CPython 3.11: 1,789 files, 31.5 MB, tests included; 10.4M tokens), one document per file
  in sorted path order. Whole modules are held out for evaluation (`stdlib_split`). Big enough to train a
  ~100M-parameter model for a few epochs (the `llama-100m` preset); tokenized once per machine in
  parallel and cached under the user cache directory (`stdlib_tokens`). Its bytes depend on the Python
  version: `python -m shared.data stdlib` reports the file and token counts.

`TokenBatches` draws random windows for the language-modelling objective of GPT (next-token prediction:
targets are the inputs shifted by one). Under data parallelism every rank draws the same *global* batch
and keeps its own rows, so N ranks with `batch_size` b see exactly what one process with b·N sees, which
is what makes "DP training equals single-process training" testable.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import os
import sys
import sysconfig
import time
import tokenize
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken
import torch

from shared.corpus import CORPUS_FILE, CORPUS_PACKAGE, load_corpus  # noqa: F401  (shared.data's names too)
from shared.tokenizer import EOT, get_tokenizer

SPLITS = ("train", "val")
CORPORA = ("docs", "stdlib")
VAL_EVERY = 20  # every 20th document is validation: a 5% split spread over all modules


def _check_split(split: Any) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def corpus_documents(split: str = "train") -> list[str]:
    """The documents of one split. Document i is validation iff i % 20 == 19 (fixed, seed-free).

    Interleaving rather than taking the tail keeps validation representative: the corpus is sorted by
    module name, so its last 5% would be only `xml`..`zoneinfo`.
    """
    _check_split(split)
    docs = load_corpus().split(EOT)
    is_val = split == "val"
    return [d for i, d in enumerate(docs) if (i % VAL_EVERY == VAL_EVERY - 1) == is_val]


# (split, encoding) -> tokens; Encoding objects hash by identity, and get_tokenizer() is itself cached.
# Tokenizing the whole docs corpus takes ~0.25 s, so an in-memory cache is enough (no disk cache).
_TOKENS: dict[tuple[str, tiktoken.Encoding], torch.Tensor] = {}


def corpus_tokens(split: str = "train", encoding: tiktoken.Encoding | None = None,
                  corpus: str = "docs") -> torch.Tensor:
    """The split of a corpus as one 1-D int64 tensor of token ids, every document followed by `<|endoftext|>`.

    `corpus` is "docs" (the embedded docstrings) or "stdlib" (the stdlib source, see `stdlib_tokens`).
    `encoding` defaults to the project tokenizer (`shared.tokenizer.get_tokenizer()`). The result is
    cached per (corpus, split, encoding) and shared: do not modify it in place.
    """
    if corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {CORPORA}, got {corpus!r}")
    if corpus == "stdlib":
        return stdlib_tokens(split, encoding)
    _check_split(split)
    enc = encoding if encoding is not None else get_tokenizer()
    key = (split, enc)
    if key not in _TOKENS:
        docs = corpus_documents(split)
        text = "".join(d + EOT for d in docs)
        ids = enc.encode(text, allowed_special={EOT})
        _TOKENS[key] = torch.tensor(ids, dtype=torch.int64)
    return _TOKENS[key]


# ---------------------------------------------------------------------------------------------------
# The stdlib source corpus.

# Not the standard library: installed packages, bytecode, and the build configuration (`config-3.11-*`,
# whose python-config.py is a generated script).
_STDLIB_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
STDLIB_CACHE_VERSION = 1  # bump when the file rule, the split rule or the cache format changes
_STDLIB: dict[str, dict[str, torch.Tensor]] = {}  # cache key -> split -> tokens


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory (`sysconfig`'s "stdlib" path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | os.PathLike | None = None) -> list[str]:
    """Every `.py` file under `root` (default `stdlib_root()`), as sorted POSIX paths relative to it."""
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise FileNotFoundError(f"stdlib root {str(base)!r} is not a directory")
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-")]
        rel = Path(dirpath).relative_to(base)
        found += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    return sorted(found)


def stdlib_split(relpath: str) -> str:
    """"val" for a held-out module, "train" otherwise. A file is held out iff the SHA-256 of its relative
    path is 0 mod 20: 5% of the modules, spread over every package, the same on every machine, and a
    held-out module is never seen in training (not even its neighbours' copies of it)."""
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "little")
    return "val" if h % VAL_EVERY == 0 else "train"


def read_source(path: str | os.PathLike) -> str:
    """A Python file's text, decoded as Python decodes it (PEP 263 coding cookie, else UTF-8); the few
    files the stdlib's tests keep with deliberately broken encodings are read as UTF-8 with replacement."""
    data = Path(path).read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except (SyntaxError, LookupError, UnicodeDecodeError):
        return data.decode("utf-8", errors="replace")


def default_cache_dir() -> Path:
    """Where tokenized corpora are kept: `$XDG_CACHE_HOME/nano-infra`, default `~/.cache/nano-infra`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nano-infra"


@functools.lru_cache(maxsize=8)
def _encoding_digest(enc: tiktoken.Encoding) -> str:
    h = hashlib.sha256(f"{enc.name}|{enc.n_vocab}|{getattr(enc, '_pat_str', '')}".encode())
    for tok, rank in sorted(getattr(enc, "_mergeable_ranks", {}).items(), key=lambda kv: kv[1]):
        h.update(tok + rank.to_bytes(4, "little"))
    h.update(json.dumps(sorted(getattr(enc, "_special_tokens", {}).items())).encode())
    return h.hexdigest()


def _stdlib_cache_key(base: Path, files: list[str], enc: tiktoken.Encoding) -> str:
    # Paths, sizes and modification times (make's rule): an edited or upgraded stdlib is re-tokenized.
    h = hashlib.sha256(f"v{STDLIB_CACHE_VERSION}|{_encoding_digest(enc)}".encode())
    for rel in files:
        st = (base / rel).stat()
        h.update(f"{rel}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def _tokenize_stdlib(base: Path, files: list[str], enc: tiktoken.Encoding,
                     workers: int) -> dict[str, np.ndarray]:
    dtype = np.uint16 if enc.n_vocab <= 1 << 16 else np.int32
    eot = np.array([enc.eot_token], dtype=dtype)

    def encode(rel: str) -> np.ndarray:
        return np.asarray(enc.encode_ordinary(read_source(base / rel)), dtype=dtype)

    parts: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    # tiktoken releases the GIL while it encodes, so threads scale with cores; map() keeps file order.
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for rel, ids in zip(files, pool.map(encode, files)):
            parts[stdlib_split(rel)] += [ids, eot]
    return {s: np.concatenate(p) if p else np.zeros(0, dtype) for s, p in parts.items()}


def _load_cache(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path) as f:
            return {s: f[s] for s in SPLITS}
    except FileNotFoundError:
        return None
    except Exception:  # a damaged file (killed writer on a filesystem without atomic rename): rebuild it
        return None


def _save_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    # Written beside the target and renamed over it: readers see the old file or the whole new one, and
    # ranks of one job that tokenize at the same time each replace it with identical bytes.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def stdlib_tokens(split: str = "train", encoding: tiktoken.Encoding | None = None,
                  root: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
                  workers: int | None = None) -> torch.Tensor:
    """One split of the stdlib source corpus as a 1-D int64 tensor, every file followed by `<|endoftext|>`.

    The files of `root` (default: this interpreter's stdlib) in `stdlib_files` order; "val" holds the
    held-out modules (`stdlib_split`). Both splits are tokenized together on first use with `workers`
    threads (default: every core) and saved to `cache_dir` (default `default_cache_dir()`) as one
    `stdlib-<key>.npz`, written atomically; the key covers the tokenizer and every file's path, size and
    mtime, so a later call (any process) reuses it. Tests pass a small `root` and a temporary `cache_dir`.
    """
    _check_split(split)
    enc = encoding if encoding is not None else get_tokenizer()
    base = Path(root) if root is not None else stdlib_root()
    files = stdlib_files(base)
    if not files:
        raise ValueError(f"stdlib root {str(base)!r} has no .py files")
    key = _stdlib_cache_key(base, files, enc)
    if key not in _STDLIB:
        path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"stdlib-{key}.npz"
        arrays = _load_cache(path)
        if arrays is None:
            t0 = time.perf_counter()
            arrays = _tokenize_stdlib(base, files, enc, workers or os.cpu_count() or 1)
            _save_atomic(path, arrays)
            print(f"stdlib corpus: {len(files)} files under {base} -> {arrays['train'].size:,} train + "
                  f"{arrays['val'].size:,} held-out tokens in {time.perf_counter() - t0:.1f}s; cached at "
                  f"{path}",
                  file=sys.stderr, flush=True)
        _STDLIB[key] = {s: torch.from_numpy(a.astype(np.int64)) for s, a in arrays.items()}
    return _STDLIB[key][split]


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
                    rank: int = 0, world_size: int = 1, encoding: tiktoken.Encoding | None = None,
                    corpus: str = "docs") -> TokenBatches:
        """Batches over a split of a corpus, "docs" or "stdlib" (see `corpus_tokens`)."""
        return cls(corpus_tokens(split, encoding, corpus), batch_size, seq_len, seed, rank, world_size)

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


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m shared.data`."""
    parser = argparse.ArgumentParser(prog="python -m shared.data",
                                     description="documents, bytes and tokens of each split of a corpus")
    parser.add_argument("corpus", nargs="?", default="stdlib", choices=CORPORA)
    return parser


def main(argv: list[str] | None = None) -> None:
    """`python -m shared.data [docs|stdlib]`: documents, bytes and tokens of each split of a corpus."""
    args = build_parser().parse_args(argv)
    if args.corpus == "docs":
        docs = {s: corpus_documents(s) for s in SPLITS}
        sizes = {s: sum(len(d.encode()) for d in docs[s]) for s in SPLITS}
        counts = {s: len(docs[s]) for s in SPLITS}
    else:
        files = stdlib_files()
        counts = {s: sum(stdlib_split(f) == s for f in files) for s in SPLITS}
        sizes = {s: sum((stdlib_root() / f).stat().st_size for f in files if stdlib_split(f) == s)
                 for s in SPLITS}
        print(f"stdlib of Python {sys.version.split()[0]} at {stdlib_root()}")
    for s in SPLITS:
        print(f"{args.corpus} {s:>5}: {counts[s]:6,} documents, {sizes[s] / 1e6:6.2f} MB, "
              f"{corpus_tokens(s, corpus=args.corpus).numel():>11,} tokens")


if __name__ == "__main__":
    main()
