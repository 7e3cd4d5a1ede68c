"""The project's tokenizer: byte-level BPE trained on the embedded corpus, served by tiktoken, offline.

Byte-pair encoding (Sennrich, Haddow & Birch 2016, "Neural Machine Translation of Rare Words with
Subword Units", arXiv:1508.07909) starts from single symbols and repeatedly merges the most frequent
adjacent pair into a new symbol. GPT-2 (Radford et al. 2019, "Language Models are Unsupervised
Multitask Learners", sec. 2.2) runs it over *bytes* instead of characters, so every string, and every
byte sequence, has an encoding without an unknown token, and pre-splits text with a regex so merges never
cross word / number / punctuation boundaries. We train with the GPT-4 (cl100k) split pattern.

The trained ranks ship as `shared/tokenizer.tiktoken` (tiktoken's format: `base64(token) rank` per line):
256 byte tokens + 3839 merges = ranks 0..4094, and `<|endoftext|>` = 4095, so `n_vocab == 4096`, the
`tiny` preset's vocab_size. Retrain with `python -m shared.tokenizer train`.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import functools
import heapq
import importlib.resources
import itertools
import time
from collections import Counter
from pathlib import Path

import regex
import tiktoken

EOT = "<|endoftext|>"
N_VOCAB = 4096  # ranks 0..4094 and EOT
EOT_ID = N_VOCAB - 1
NAME = "nano-infra-4k"
RANK_FILE = "tokenizer.tiktoken"  # package data of `shared`
# GPT-4's cl100k_base split pattern (tiktoken_ext/openai_public.py): contractions, letter runs with
# one leading non-letter, numbers in groups of <= 3 digits, punctuation runs, whitespace.
PAT_STR = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------


def pretokenize(text: str, pat_str: str = PAT_STR) -> Counter[bytes]:
    """Count the regex pre-tokens (GPT-2 sec. 2.2) of `text`, as UTF-8 bytes.

    Documents are split at `<|endoftext|>` first so the special token is never learned as a merge.
    """
    pat = regex.compile(pat_str)
    counts: Counter[str] = Counter()
    for doc in text.split(EOT):
        counts.update(pat.findall(doc))
    return Counter({piece.encode("utf-8"): n for piece, n in counts.items()})


def train_bpe(text: str, vocab_size: int, pat_str: str = PAT_STR, *, verbose: bool = False) -> dict[bytes, int]:
    """Train byte-level BPE (Sennrich et al. 2016, Algorithm 1; GPT-2's byte-level variant).

    Returns tiktoken mergeable ranks: the 256 single bytes at ranks 0..255, then one token per merge in
    the order learned, `vocab_size` tokens in all (special tokens are not included).

    Each unique pre-token is stored once with its count, so a pair's frequency is the count-weighted
    number of its occurrences. Pair counts are kept up to date incrementally: a merge only rewrites the
    words that contain the merged pair (found through an inverted index), and a max-heap with lazy
    deletion yields the next most frequent pair. Ties go to the pair whose (left bytes, right bytes) is
    smallest, so the result depends on nothing but the text.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be >= 256 (the byte alphabet), got {vocab_size}")
    words: list[list[int]] = []
    freqs: list[int] = []
    for piece, n in sorted(pretokenize(text, pat_str).items()):
        words.append(list(piece))  # a byte's token id is the byte value
        freqs.append(n)
    vocab: list[bytes] = [bytes([i]) for i in range(256)]
    ranks: dict[bytes, int] = {b: i for i, b in enumerate(vocab)}

    pair_counts: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}  # pair -> words that (may) contain it
    for w, (word, n) in enumerate(zip(words, freqs)):
        for pair in itertools.pairwise(word):
            pair_counts[pair] += n
            where.setdefault(pair, set()).add(w)

    def entry(pair: tuple[int, int]) -> tuple[int, bytes, bytes, tuple[int, int]]:
        return (-pair_counts[pair], vocab[pair[0]], vocab[pair[1]], pair)

    heap = [entry(p) for p in pair_counts]
    heapq.heapify(heap)
    t0 = time.perf_counter()
    while len(vocab) < vocab_size:
        # pop until an entry agrees with the current count (older entries are stale)
        while heap and (heap[0][0] == 0 or -heap[0][0] != pair_counts.get(heap[0][3], 0)):
            heapq.heappop(heap)
        if not heap:
            raise ValueError(f"text too small: no pair left to merge after {len(vocab)} tokens "
                             f"(vocab_size={vocab_size})")
        pair = heapq.heappop(heap)[3]
        a, b = pair
        merged = vocab[a] + vocab[b]
        # Two different pairs can spell the same bytes ("a"+"bc", "ab"+"c"); tiktoken knows tokens by
        # their bytes, so the second one reuses the first token instead of adding a duplicate.
        new = ranks.get(merged)
        if new is None:
            new = len(vocab)
            vocab.append(merged)
            ranks[merged] = new
        touched: set[tuple[int, int]] = set()
        for w in sorted(where.pop(pair)):
            word, n = words[w], freqs[w]
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            if len(out) == len(word):
                continue  # stale index entry: an earlier merge already consumed the pair here
            for p in itertools.pairwise(word):
                pair_counts[p] -= n
                touched.add(p)
            for p in itertools.pairwise(out):
                pair_counts[p] += n
                touched.add(p)
                where.setdefault(p, set()).add(w)
            words[w] = out
        for p in touched:
            if pair_counts[p] <= 0:
                del pair_counts[p]
            elif p != pair:
                heapq.heappush(heap, entry(p))
        if verbose and len(vocab) % 500 == 0:
            print(f"  {len(vocab)} tokens, last merge {merged!r}, {time.perf_counter() - t0:.1f}s", flush=True)
    return ranks


# ---------------------------------------------------------------------------------------------------
# The .tiktoken rank format
# ---------------------------------------------------------------------------------------------------


def save_tiktoken(ranks: dict[bytes, int], path: str | Path) -> None:
    """Write ranks in tiktoken's format, one `base64(token) rank` line per token, in rank order."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    path.write_text("".join(lines), encoding="ascii")


def parse_tiktoken(data: bytes, source: str = "<bytes>") -> dict[bytes, int]:
    """Parse the contents of a `.tiktoken` rank file; errors name `source` and the 1-based line."""
    ranks: dict[bytes, int] = {}
    seen_ranks: dict[int, int] = {}
    for lineno, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{source}:{lineno}: expected 'base64_token rank', got {line[:60]!r}")
        try:
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{source}:{lineno}: malformed line {line[:60]!r} ({e})") from None
        if rank < 0:
            raise ValueError(f"{source}:{lineno}: negative rank {rank}")
        if token in ranks:
            raise ValueError(f"{source}:{lineno}: token {token!r} already has rank {ranks[token]}")
        if rank in seen_ranks:
            raise ValueError(f"{source}:{lineno}: rank {rank} already used on line {seen_ranks[rank]}")
        ranks[token] = rank
        seen_ranks[rank] = lineno
    if not ranks:
        raise ValueError(f"{source}: no tokens (empty rank file)")
    # byte-level BPE must be able to fall back to single bytes, or tiktoken cannot encode some strings
    missing = [i for i in range(256) if bytes([i]) not in ranks]
    if missing:
        raise ValueError(f"{source}: {len(missing)} single-byte tokens missing (first: {bytes([missing[0]])!r}); "
                         "a byte-level BPE rank file must contain all 256 bytes")
    return ranks


def make_encoding(ranks: dict[bytes, int], *, pat_str: str = PAT_STR,
                  special_tokens: dict[str, int] | None = None, name: str = NAME) -> tiktoken.Encoding:
    """A tiktoken Encoding from ranks; `special_tokens` defaults to `<|endoftext|>` right after the ranks."""
    if special_tokens is None:
        special_tokens = {EOT: max(ranks.values()) + 1}
    rank_values = set(ranks.values())
    for tok, tid in special_tokens.items():
        if tid in rank_values:
            raise ValueError(f"special token {tok!r} id {tid} collides with a mergeable rank")
    return tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special_tokens)


def load_tiktoken(path: str | Path, pat_str: str = PAT_STR, special_tokens: dict[str, int] | None = None,
                  name: str | None = None) -> tiktoken.Encoding:
    """Load any standard `.tiktoken` rank file (ours, or e.g. a downloaded cl100k_base.tiktoken).

    Raises FileNotFoundError if `path` does not exist and ValueError (naming path and line) if malformed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tiktoken rank file not found: {path}")
    ranks = parse_tiktoken(path.read_bytes(), str(path))
    return make_encoding(ranks, pat_str=pat_str, special_tokens=special_tokens, name=name or path.stem)


@functools.lru_cache(maxsize=1)
def get_tokenizer() -> tiktoken.Encoding:
    """The project tokenizer "nano-infra-4k": n_vocab 4096, `<|endoftext|>` = 4095 (`enc.eot_token`)."""
    resource = importlib.resources.files("shared").joinpath(RANK_FILE)
    ranks = parse_tiktoken(resource.read_bytes(), f"shared/{RANK_FILE}")
    enc = make_encoding(ranks, special_tokens={EOT: EOT_ID}, name=NAME)
    if enc.n_vocab != N_VOCAB:
        raise ValueError(f"shared/{RANK_FILE} gives n_vocab {enc.n_vocab}, expected {N_VOCAB}")
    return enc


def bytes_per_token(enc: tiktoken.Encoding, text: str) -> float:
    """Compression ratio: UTF-8 bytes of `text` per token."""
    return len(text.encode("utf-8")) / max(1, len(enc.encode(text, allowed_special={EOT})))


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m shared.tokenizer`."""
    parser = argparse.ArgumentParser(prog="python -m shared.tokenizer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    train = sub.add_parser("train", help="retrain the BPE ranks on the embedded corpus")
    train.add_argument("--vocab-size", type=int, default=N_VOCAB, help="n_vocab including <|endoftext|>")
    train.add_argument("--out", type=Path, default=Path(__file__).with_name(RANK_FILE))
    enc_p = sub.add_parser("encode", help="show the tokens of a text")
    enc_p.add_argument("text")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    if args.cmd == "encode":
        enc = get_tokenizer()
        ids = enc.encode(args.text, allowed_special={EOT})
        print(ids)
        print(" | ".join(repr(enc.decode_single_token_bytes(i))[2:-1] for i in ids))
        print(f"{len(args.text.encode())} bytes -> {len(ids)} tokens")
        return

    from shared.corpus import load_corpus

    text = load_corpus()
    t0 = time.perf_counter()
    ranks = train_bpe(text, args.vocab_size - 1, verbose=True)
    elapsed = time.perf_counter() - t0
    save_tiktoken(ranks, args.out)
    enc = make_encoding(ranks, name=args.out.stem)
    print(f"wrote {args.out}: {len(ranks)} ranks + {EOT} = {enc.n_vocab} tokens in {elapsed:.1f}s; "
          f"corpus {len(text.encode()) / 1e6:.2f} MB at {bytes_per_token(enc, text):.2f} bytes/token")


if __name__ == "__main__":
    main()
