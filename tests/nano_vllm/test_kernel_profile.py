"""The bench's per-kernel breakdown (nano_vllm.bench.kernel_profile.summarize) on hand-made kernel records."""

from __future__ import annotations

import pytest
import torch

from nano_vllm.bench.kernel_profile import profile_decode, short_name, summarize


def test_a_kernel_counts_what_it_adds_to_the_step_and_bubbles_have_names():
    # b starts (PDL) while a runs: only its end past a's end is its own; a gap of 2 us before the second a
    records = [("a", 0.0, 10.0), ("b(int)", 5.0, 12.0), ("a", 14.0, 20.0), ("a", 20.0, 26.0)]
    p = summarize(records, steps=2, bytes_per_launch={"a": 8000})
    assert p["device span us/step"] == 13.0 and p["device busy us/step"] == 12.0
    assert p["bubbles us/step"] == 1.0
    a, b = p["kernels"]
    assert (a["kernel"], a["launches/step"], a["us/launch"], a["us/step"]) == ("a", 1.5, 22 / 3, 11.0)
    assert a["GB/s"] == pytest.approx(8000 / (22 / 3) / 1e3)
    assert (b["kernel"], b["us/launch"]) == ("b", 2.0) and "GB/s" not in b
    assert p["gaps"] == [{"between": "b -> a", "count/step": 0.5, "us each": 2.0, "us/step": 1.0}]


def test_names_and_empty_profiles():
    assert short_name("void at::native::reduce_kernel<512, 1>(float*)") == "at::native::reduce_kernel"
    assert summarize([], steps=4)["available"] is False
    if not torch.cuda.is_available():
        assert profile_decode(None, [1, 2]) == {"available": False, "why": "no CUDA device"}
