"""shared.tokenizer: offline tiktoken encoding, the BPE trainer, and the .tiktoken rank format."""

from __future__ import annotations

import base64
import random

import pytest
import tiktoken

from shared.config import PRESETS
from shared.data import load_corpus
from shared.tokenizer import (
    EOT,
    EOT_ID,
    N_VOCAB,
    PAT_STR,
    get_tokenizer,
    load_tiktoken,
    main,
    make_encoding,
    parse_tiktoken,
    save_tiktoken,
    train_bpe,
)

# code-point ranges for random strings: ASCII, Latin-1 and its controls, combining marks, Greek,
# Cyrillic, Hebrew, Arabic, Devanagari, CJK, Hangul, zero-width joiners / RTL marks, private use, emoji
RANGES = [(0x00, 0x7F), (0x80, 0xFF), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x5FF),
          (0x600, 0x6FF), (0x900, 0x97F), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x200B, 0x200F),
          (0xE000, 0xF8FF), (0x1F300, 0x1FAFF), (0x1F1E6, 0x1F1FF), (0x10000, 0x10FFFF)]


def random_text(rng: random.Random, n: int) -> str:
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(RANGES)
        cp = rng.randint(lo, hi)
        chars.append(chr(cp) if not 0xD800 <= cp <= 0xDFFF else " ")
        if rng.random() < 0.2:
            chars.append(rng.choice([" ", "\n", "\t", "\r\n", "  ", "'s", "123"]))
    return "".join(chars)


@pytest.fixture(scope="module")
def enc() -> tiktoken.Encoding:
    return get_tokenizer()


@pytest.fixture(scope="module")
def committed_ranks(enc: tiktoken.Encoding) -> dict[bytes, int]:
    return {enc.decode_single_token_bytes(i): i for i in range(N_VOCAB - 1)}


def test_sizes_match_the_tiny_preset(enc):
    assert enc.name == "nano-infra-4k"
    assert enc.n_vocab == N_VOCAB == 4096 == PRESETS["tiny"].vocab_size
    assert enc.eot_token == EOT_ID == 4095 == PRESETS["tiny"].eos_token_id
    assert enc.special_tokens_set == {EOT}
    assert get_tokenizer() is enc  # cached


def test_special_token(enc):
    assert enc.encode(EOT, allowed_special={EOT}) == [EOT_ID]
    assert enc.encode("a" + EOT + "b", allowed_special="all")[1] == EOT_ID
    with pytest.raises(ValueError, match="disallowed special token"):
        enc.encode(EOT)  # tiktoken refuses special-token text unless allowed
    ordinary = enc.encode_ordinary(EOT)
    assert EOT_ID not in ordinary and enc.decode(ordinary) == EOT


def test_roundtrip_random_unicode(enc):
    rng = random.Random(0)
    for _ in range(300):
        s = random_text(rng, rng.randint(0, 60))
        ids = enc.encode(s)
        assert all(0 <= i < EOT_ID for i in ids)
        assert enc.decode(ids) == s
        assert enc.decode_bytes(enc.encode_ordinary(s)) == s.encode("utf-8")


def test_roundtrip_corpus_sample_and_compression(enc):
    text = load_corpus()[:200_000]
    ids = enc.encode(text, allowed_special={EOT})
    assert enc.decode(ids) == text
    # trained on this corpus, so it compresses well (~3.9 bytes/token; raw bytes would be 1.0)
    assert len(text.encode()) / len(ids) > 3.5


def test_roundtrip_random_bytes(enc):
    # tiktoken's str API cannot carry invalid UTF-8; byte-level BPE itself can, through the 256 byte
    # tokens: `_encode_bytes` is tiktoken's own bytes entry point.
    rng = random.Random(1)
    for _ in range(200):
        data = rng.randbytes(rng.randint(0, 64))
        ids = enc._encode_bytes(data)
        assert enc.decode_bytes(ids) == data
        assert enc.decode_bytes([enc.encode_single_token(bytes([b])) for b in data]) == data
        enc.decode(ids, errors="replace")  # never raises on invalid UTF-8


def test_committed_ranks_are_a_byte_level_bpe(committed_ranks):
    # ranks 0..255 are the bytes in order; every merged token splits into two earlier tokens
    assert [committed_ranks[bytes([i])] for i in range(256)] == list(range(256))
    assert sorted(committed_ranks.values()) == list(range(N_VOCAB - 1))
    for tok, rank in committed_ranks.items():
        if len(tok) > 1:
            assert any(committed_ranks.get(tok[:k], rank) < rank and committed_ranks.get(tok[k:], rank) < rank
                       for k in range(1, len(tok))), tok


def test_committed_ranks_come_from_the_trainer_on_the_corpus(committed_ranks):
    # Greedy BPE's first k merges do not depend on how many follow, so training a short prefix on the
    # embedded corpus must reproduce the committed file's first ranks exactly.
    prefix = train_bpe(load_corpus(), 256 + 300)
    assert prefix == {tok: r for tok, r in committed_ranks.items() if r < 256 + 300}


def test_train_bpe_known_example():
    # Sennrich et al.'s / Wikipedia's example: aa (4x) first; then the tie between (a, b) and (aa, a)
    # goes to the smaller byte pair, (a, b); then (aa, ab).
    ranks = train_bpe("aaabdaaabac", 259)
    assert {t: r for t, r in ranks.items() if r >= 256} == {b"aa": 256, b"ab": 257, b"aaab": 258}


def test_train_bpe_deterministic_and_order_free():
    docs = load_corpus().split(EOT)[:400]
    text = EOT.join(docs)
    a = train_bpe(text, 700)
    assert a == train_bpe(text, 700)
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    assert a == train_bpe(EOT.join(shuffled), 700)  # counts, not order, decide every merge
    assert sorted(a.values()) == list(range(700))
    assert not any(EOT.encode() in t for t in a)  # never merges across the document separator
    e = make_encoding(a)
    assert e.n_vocab == 701 and e.eot_token == 700
    assert e.decode(e.encode(text, allowed_special={EOT})) == text


def test_train_bpe_errors():
    with pytest.raises(ValueError, match="vocab_size must be >= 256"):
        train_bpe("abc", 255)
    with pytest.raises(ValueError, match="text too small"):
        train_bpe("abcabc", 300)


def test_save_load_roundtrip(tmp_path, enc, committed_ranks):
    path = tmp_path / "sub" / "mine.tiktoken"
    save_tiktoken(committed_ranks, path)
    loaded = load_tiktoken(path)
    assert loaded.name == "mine" and loaded.n_vocab == N_VOCAB and loaded.eot_token == EOT_ID
    text = "Return a new Tensor, 数 🙂\n\n  x = 1"
    assert loaded.encode(text) == enc.encode(text)
    other = load_tiktoken(path, pat_str=PAT_STR, special_tokens={"<|pad|>": 5000, EOT: 5001}, name="x")
    assert other.n_vocab == 5002 and other.eot_token == 5001


GOOD = "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))


@pytest.mark.parametrize(("content", "message"), [
    (GOOD + "YWI=\n", r"bad.tiktoken:257: expected 'base64_token rank'"),
    (GOOD + "!!!! 256\n", r"bad.tiktoken:257: malformed line"),
    (GOOD + "YWI= x\n", r"bad.tiktoken:257: malformed line"),
    (GOOD + "YWI= -3\n", r"bad.tiktoken:257: negative rank"),
    (GOOD + "YQ== 256\n", r"bad.tiktoken:257: token b'a' already has rank 97"),
    (GOOD + "YWI= 7\n", r"bad.tiktoken:257: rank 7 already used on line 8"),
    (GOOD.split("\n", 1)[1], r"1 single-byte tokens missing \(first: b'\\x00'\)"),
    ("\n", "empty rank file"),
], ids=["one-field", "bad-base64", "bad-rank", "negative-rank", "dup-token", "dup-rank", "missing-byte",
        "empty"])
def test_load_tiktoken_malformed(tmp_path, content, message):
    path = tmp_path / "bad.tiktoken"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_tiktoken(path)


def test_load_tiktoken_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.tiktoken"):
        load_tiktoken(tmp_path / "nope.tiktoken")
    path = tmp_path / "bytes.tiktoken"
    path.write_text(GOOD)
    with pytest.raises(ValueError, match="collides with a mergeable rank"):
        load_tiktoken(path, special_tokens={EOT: 3})
    assert parse_tiktoken(GOOD.encode()) == {bytes([i]): i for i in range(256)}
    assert load_tiktoken(path).n_vocab == 257


def test_cli(tmp_path, capsys):
    text = "Return the value of x"
    main(["encode", text])
    out = capsys.readouterr().out
    assert str(get_tokenizer().encode(text)) in out and "21 bytes -> 5 tokens" in out
    path = tmp_path / "small.tiktoken"
    main(["train", "--vocab-size", "300", "--out", str(path)])
    assert "299 ranks" in capsys.readouterr().out
    assert load_tiktoken(path).n_vocab == 300
