"""Pipeline schedules and the simulator (pure Python), and the grid's rank arithmetic (no processes)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from nano_megatron.grid import GridShape
from nano_megatron.schedules import (
    Action,
    bubble_fraction_formula,
    gpipe,
    one_f_one_b,
    schedule_actions,
)
from nano_megatron.tools.simulator import interleaved_1f1b, simulate
from nano_megatron.tools.simulator import main as simulator_main

PM = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), PM)
def test_simulated_bubble_equals_formula(schedule, p, m):
    res = simulate(schedule, p, m, t_f=1, t_b=2)
    expected = Fraction(p - 1, m + p - 1)
    assert res.bubble == [expected] * p  # every stage idles the same (p−1)(t_f+t_b)
    assert res.makespan == (m + p - 1) * 3
    assert bubble_fraction_formula(p, m) == pytest.approx(float(expected))


@pytest.mark.parametrize(("t_f", "t_b"), [(1, 1), (2, 3), (1, 3)])
def test_bubble_formula_holds_for_any_costs(t_f, t_b):
    for p, m in [(2, 8), (4, 4), (4, 16)]:
        for schedule in ("gpipe", "1f1b"):
            assert max(simulate(schedule, p, m, t_f, t_b).bubble) == Fraction(p - 1, m + p - 1)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 6, 3), (4, 16, 2)])
def test_interleaved_bubble_shrinks_by_chunks(p, m, v):
    res = simulate("interleaved", p, m, num_chunks=v)
    assert max(res.bubble) == Fraction(p - 1, v * m + p - 1)


@pytest.mark.parametrize(("p", "m"), PM)
def test_schedules_run_every_micro_batch_once_and_bound_memory(p, m):
    for stage in range(p):
        for actions in (gpipe(p, m, stage), one_f_one_b(p, m, stage)):
            assert sorted(a.micro for a in actions if a.kind == "F") == list(range(m))
            assert sorted(a.micro for a in actions if a.kind == "B") == list(range(m))
        # 1F1B: at most p − stage micro-batches in flight (its point, 2104.04473 §2.2.1); GPipe: all m
        in_flight = peak = 0
        for a in one_f_one_b(p, m, stage):
            in_flight += 1 if a.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(p - stage, m)


def test_one_f_one_b_order():
    assert [str(a) for a in one_f_one_b(4, 6, 1)] == \
        ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "F5", "B3", "B4", "B5"]
    assert [str(a) for a in one_f_one_b(4, 6, 3)][:4] == ["F0", "B0", "F1", "B1"]
    assert interleaved_1f1b(2, 2, 0, 2)[:4] == [Action("F", 0, 0), Action("F", 1, 0), Action("F", 0, 1),
                                                 Action("F", 1, 1)]


def test_bad_schedule_arguments():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        schedule_actions("zigzag", 2, 4, 0)
    with pytest.raises(ValueError, match="stage 2 is outside"):
        gpipe(2, 4, 2)
    with pytest.raises(ValueError, match="num_micro % num_stages == 0"):
        interleaved_1f1b(4, 6, 0, 2)


def test_simulator_cli_prints_timelines(capsys):
    simulator_main(["--stages", "2", "--micro", "3", "--schedule", "1f1b"])
    out = capsys.readouterr().out
    assert "stage 0: F0 F1 .. .. B0 B0 F2 B1 B1 .. B2 B2" in out
    assert "stage 1: .. F0 B0 B0 F1 B1 B1 F2 B2 B2 .. .." in out
    assert "formula (p-1)/(v·m+p-1) = 0.2500" in out and "simulated 0.2500" in out


# --------------------------------------------------------------------------- the grid, as arithmetic
@pytest.mark.parametrize(("tp", "pp", "dp"), [(2, 2, 2), (4, 1, 2), (1, 4, 2), (2, 3, 1)])
def test_grid_tp_fastest_and_groups_partition_the_world(tp, pp, dp):
    shape = GridShape(tp, pp, dp)
    n = shape.world_size
    for rank in range(n):
        d, p, t = shape.coords(rank)
        assert rank == shape.rank_of(d, p, t) == (d * pp + p) * tp + t
    assert shape.tp_groups()[0] == list(range(tp))  # tensor-parallel ranks are adjacent
    for groups, size in ((shape.tp_groups(), tp), (shape.pp_groups(), pp), (shape.dp_groups(), dp)):
        assert sorted(r for g in groups for r in g) == list(range(n))
        assert all(len(g) == size for g in groups)
    for g in shape.pp_groups():  # a pipeline group: same (dp, tp), stages in order
        assert [shape.coords(r)[1] for r in g] == list(range(pp))
        assert len({shape.coords(r)[0::2] for r in g}) == 1
    for first, last in shape.embedding_groups():
        assert shape.coords(first)[1] == 0 and shape.coords(last)[1] == pp - 1
