"""The embedded corpus: the standard library's documentation (`stdlib_docs.txt.gz`, built by
`build_corpus.py`), shipped inside the package so training and the tokenizer need no download."""

from __future__ import annotations

import functools
import gzip
import importlib.resources

CORPUS_PACKAGE, CORPUS_FILE = "shared.corpus", "stdlib_docs.txt.gz"


@functools.lru_cache(maxsize=1)
def load_corpus() -> str:
    """The embedded corpus as one string (about 2 MB of UTF-8), documents joined by `<|endoftext|>`."""
    data = importlib.resources.files(CORPUS_PACKAGE).joinpath(CORPUS_FILE).read_bytes()
    return gzip.decompress(data).decode("utf-8")
