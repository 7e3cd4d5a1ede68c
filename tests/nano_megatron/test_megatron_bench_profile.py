"""nano_megatron.tools.bench_profile on CPU: the interval arithmetic behind "GPU busy %" and the idle-gap report,
and the timed pipeline schedule behind the measured bubble (no timing is asserted)."""

from __future__ import annotations

from types import SimpleNamespace

from nano_megatron.schedules import Action
from nano_megatron.tools.bench_profile import (
    TimedPipelineSchedule,
    busy_seconds,
    device_activity_seconds,
    print_idle_ops,
    print_top_kernels,
    timed_schedule,
    union_seconds,
)


def _ev(a, b, name="kernel"):
    return SimpleNamespace(time_range=SimpleNamespace(start=a, end=b), name=name)


def test_union_seconds_counts_overlaps_once():
    assert union_seconds([]) == 0.0
    assert union_seconds([(0, 2), (1, 3), (5, 6)]) == 4.0  # [0, 3] and [5, 6]
    assert union_seconds([(4, 5), (0, 10)]) == 10.0  # a kernel inside another stream's span
    assert device_activity_seconds(lambda: None, "cpu") is None


def test_idle_ops_charges_each_gpu_gap_to_the_innermost_host_op(capsys):
    # GPU busy [0,10] [100,110] [300,310]; gaps 10→100 (inside "wait") and 110→300 (inside "step" only)
    gpu = [_ev(0, 10), _ev(100, 110), _ev(300, 310)]
    host = [_ev(0, 400, "step"), _ev(5, 95, "wait"), _ev(102, 108, "launch")]
    print_idle_ops(gpu, host, top=5)
    out = capsys.readouterr().out
    assert "GPU idle 0.28 ms in 2 gaps" in out
    assert "0.09 ms      1 gaps  wait" in out and "0.19 ms      1 gaps  step" in out


def test_top_kernels_sums_device_time_per_name(capsys):
    print_top_kernels([_ev(0, 1000, "gemm"), _ev(2000, 2500, "nccl"), _ev(3000, 4000, "gemm")], top=1)
    assert capsys.readouterr().out.split() == ["2.00", "ms", "2", "calls", "gemm"]


def test_timed_schedule_records_each_action_into_its_own_timeline():
    first, second = [], []
    a, b = timed_schedule(first), timed_schedule(second)
    assert issubclass(a, TimedPipelineSchedule) and a.timeline is first and b.timeline is second
    assert busy_seconds([(Action("F", 0), 1.0, 1.5), (Action("B", 0), 2.0, 3.0)]) == 1.5
