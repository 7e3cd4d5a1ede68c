"""BENCHMARKS.md's headline table against the JSON each row names.

Every row is one claim on one card: its card and date are the JSON's, and every number in its ours, peer
and ceiling cells is a number the bench wrote into that JSON (equal at the printed precision, as written
or scaled by 100, 1000 or 1/1000: a fraction printed as a percentage, ms as µs, TB/s as GB/s). A ratio is
the JSON's or the quotient of two numbers of the row's ours and peer cells. Numbers inside the JSON's
strings (hand-written notes) do not count, nor do JSONs transcribed from printed tables: such a number is
re-measured or leaves the table. A ceiling cell may also give the card's datasheet value
(shared.accounting.DATASHEETS) and a percentage that is the quotient of two of the row's numbers.
"""

from __future__ import annotations

import json
import re
from itertools import permutations
from pathlib import Path

import pytest

from shared.accounting import DATASHEETS

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "BENCHMARKS.md"
COLUMNS = ["package", "claim", "card", "date", "ours", "peer, same run", "ratio", "ceiling: fraction",
           "target", "JSON"]
# a number standing alone: not part of a word (16k, 8B, hd128), a version (5.17.0) or a date
NUMBER = re.compile(r"(?<![\w.\-/])\d[\d,]*(?:\.\d+)?(?![\w.]*\w)")


def headline_rows() -> list[dict[str, str]]:
    text = PAGE.read_text()
    section = text[text.index("## Headlines"):]
    section = section[: section.index("\n## ", 1)]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS, header
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == len(COLUMNS), line
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def numbers(cell: str) -> list[str]:
    """The numbers of a cell, as printed; text in backticks (code, peers' names) is not read."""
    return NUMBER.findall(re.sub(r"`[^`]*`", "", cell))


def json_numbers(value: object) -> list[float]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in json_numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in json_numbers(v)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)]
    return []


def close(printed: str, value: float) -> bool:
    """`value` rounds to `printed` (its decimals; a thousands separator is not a decimal)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(value - float(printed.replace(",", ""))) <= 0.5 * 10 ** -decimals * (1 + 1e-9)


def in_json(printed: str, values: list[float]) -> bool:
    return any(close(printed, v * scale) for v in values for scale in (1, 100, 1000, 1e-3))


ROWS = headline_rows()


def test_the_headline_table_has_rows():
    assert len(ROWS) >= 10


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['package']}: {r['claim'][:40]}" for r in ROWS])
def test_each_headline_number_is_in_the_json_its_row_names(row):
    link = re.fullmatch(r"\[[^\]]+\]\((docs/results/[\w.\-]+\.json)\)", row["JSON"])
    assert link, f"the JSON cell must link one file under docs/results/: {row['JSON']!r}"
    data = json.loads((ROOT / link.group(1)).read_text())
    assert "transcribed" not in str(data.get("source", "")), f"{link.group(1)} was transcribed"
    assert row["card"] in ("H100", "H200"), row["card"]
    cards = [str(data.get(k, "")) for k in ("gpu", "card", "device")] + [str(data.get("env", {}).get("device"))]
    assert any(f"NVIDIA {row['card']}" in c for c in cards), (row["card"], cards)
    dates = [str(data.get("date", "")), str(data.get("env", {}).get("date", ""))]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", row["date"]) and any(d.startswith(row["date"]) for d in dates), \
        (row["date"], dates)
    values = json_numbers(data)
    measured = [n for col in ("ours", "peer, same run") for n in numbers(row[col])]
    assert measured, "a row with no measured number"
    for n in measured:
        assert in_json(n, values), f"{n} is not in {link.group(1)}"
    for n in numbers(row["ratio"]):
        assert in_json(n, values) or any(close(n, r) for r in quotients(measured)), \
            f"ratio {n} is neither in {link.group(1)} nor a quotient of the row's numbers"
    sheet = [v / 1e9 for v in DATASHEETS[row["card"]]]  # GB/s, GFLOP/s (and TB/s, TFLOP/s scaled)
    ceiling = numbers(row["ceiling: fraction"])
    for n in ceiling:
        assert in_json(n, values) or in_json(n, sheet) or any(
            close(n, 100 * r) for r in quotients(measured + ceiling, sheet)), \
            f"ceiling {n} is not in {link.group(1)}, the datasheet or a quotient of the row's numbers"


def quotients(printed: list[str], extra: list[float] = ()) -> list[float]:
    """a / b for every two numbers (printed or not), each also scaled by 1000 (TB/s against GB/s)."""
    xs = [float(n.replace(",", "")) for n in printed] + list(extra)
    xs += [x * 1000 for x in xs]
    return [a / b for a, b in permutations(xs, 2) if b]


def test_the_page_stays_a_results_page():
    """≤ 40 KiB: rejected experiments and dated repeats leave it (git history keeps them)."""
    assert PAGE.stat().st_size <= 40 * 1024
