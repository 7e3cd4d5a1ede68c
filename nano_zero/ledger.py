"""ZeRO's two ledgers: bytes of model state per rank (§3.1, §5, Figure 1) and bytes moved per step (§7).

Memory (§3.1): mixed-precision Adam keeps 2Ψ bytes of bf16/fp16 parameters, 2Ψ of gradients and KΨ of
optimizer state, K = 12 (fp32 master 4Ψ, momentum 4Ψ, variance 4Ψ). Stage 1 (Pos) divides the K part by
N, stage 2 (Pos+g) also the gradients, stage 3 (Pos+g+p) also the parameters:
16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N. The formula is `shared.accounting.training_memory`; `memory_report`
measures what an engine actually holds (storage bytes of its buffers) and prints the two side by side.

Communication (§7.2): data parallelism's all-reduce is a reduce-scatter plus an all-gather, 2Ψ elements
per rank per step; stages 1 and 2 do exactly that (reduce-scatter the gradients, all-gather the updated
parameters): 2Ψ. Stage 3 all-gathers the parameters twice (forward and backward) and reduce-scatters the
gradients once: 3Ψ. `CommCounter` counts the elements (and bytes) each collective moves, in that unit;
`count_communication(model)` wraps a ZeroDataParallel's plain collectives (nano_zero.collectives) so they
count. The engine asks for it (`ZeroEngine.last_step_comm`); the paper path imports none of this.

    python -m nano_zero.ledger          # Figure 1 for the paper's Ψ = 7.5B, N = 64, K = 12
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nano_zero.collectives import Collectives
from shared.accounting import TrainingMemory, training_memory

if TYPE_CHECKING:
    from nano_zero.zero import ZeroDataParallel

GB = 1e9  # the paper's Figure 1 uses decimal gigabytes


@dataclass
class CommCounter:
    """Elements and bytes of parameter/gradient collectives, the way §7 counts them.

    An all-gather or reduce-scatter of a buffer of n elements counts n (what each rank sends/receives up
    to a factor (N-1)/N that the paper drops); an all-reduce counts 2n (reduce-scatter + all-gather).
    Scalars (the loss, the gradient norm) are not counted: they do not scale with Ψ.
    """

    elements: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, op: str, numel: int, element_size: int) -> None:
        self.elements[op] += numel
        self.bytes[op] += numel * element_size

    @property
    def total_elements(self) -> int:
        return sum(self.elements.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def snapshot(self) -> tuple[int, int]:
        return self.total_elements, self.total_bytes

    def reset(self) -> None:
        self.elements.clear()
        self.bytes.clear()


class CountedCollectives:
    """`collectives.Collectives` that add each collective's elements to `counter` (§7's unit) and run it.

    An all-gather or reduce-scatter counts the size of the full buffer, an all-reduce twice its size;
    scalar sums (`all_reduce_scalar`) pass through uncounted."""

    def __init__(self, inner: Collectives, counter: CommCounter) -> None:
        self.inner, self.counter = inner, counter
        self.group, self.distributed = inner.group, inner.distributed
        self.rank, self.world = inner.rank, inner.world

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        self.counter.add("all_gather", out.numel(), out.element_size())
        return self.inner.all_gather(out, shard, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        self.counter.add("reduce_scatter", full.numel(), full.element_size())
        return self.inner.reduce_scatter(out, full, async_op=async_op)

    def all_reduce(self, t: torch.Tensor) -> None:
        self.counter.add("all_reduce", 2 * t.numel(), t.element_size())
        self.inner.all_reduce(t)

    def all_reduce_scalar(self, t: torch.Tensor) -> torch.Tensor:
        return self.inner.all_reduce_scalar(t)


def count_communication(model: ZeroDataParallel) -> CommCounter:
    """Count every collective `model` runs from now on, checkpoint gathers included (it wraps
    `model.comm`); the counter, the same one when asked twice. `ZeroEngine.last_step_comm` is one step's."""
    if isinstance(model.comm, CountedCollectives):
        return model.comm.counter
    model.comm = CountedCollectives(model.comm, CommCounter())
    return model.comm.counter


# ---------------------------------------------------------------------------------------------------
# Memory.


@dataclass
class MemoryReport:
    """Per-rank bytes an engine holds next to §3.1's formula for the same Ψ, stage, N and dtypes.

    `buffers` are transient bytes outside the ledger at the time of measurement (stage 3's gathered
    units, stage 2's unreduced gradient buckets); the measured columns include padding to N.
    """

    stage: int
    dp: int
    num_params: int
    params: int
    grads: int
    master_weights: int
    optimizer_states: int
    buffers: int
    formula: TrainingMemory

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master_weights + self.optimizer_states

    def rows(self) -> list[dict]:
        f = self.formula
        out = []
        for name, measured, formula in (("parameters", self.params, f.params), ("gradients", self.grads, f.grads),
                                        ("fp32 master weights", self.master_weights, f.master_weights),
                                        ("AdamW moments", self.optimizer_states, f.optimizer_states),
                                        ("total", self.total, f.total)):
            out.append({"state": name, "measured MB": measured / 2**20, "formula MB": formula / 2**20,
                        "ratio": measured / formula if formula else None})
        return out

    def format(self, rank: int = 0) -> str:
        from shared.bench import format_table

        title = (f"rank {rank}: ZeRO stage {self.stage}, N = {self.dp}, Ψ = {self.num_params:,} "
                 f"(formula {self.formula.bytes_per_param:.2f} bytes/param; transient buffers "
                 f"{self.buffers / 2**20:.2f} MB)")
        return format_table(self.rows(), title=title)


def formula_for(num_params: int, stage: int, dp: int, compute_dtype: torch.dtype) -> TrainingMemory:
    """§3.1's ledger for our layout: in fp32 the master weights *are* the parameters (K = 8, not 12)."""
    size = torch.empty(0, dtype=compute_dtype).element_size()
    master = 0 if compute_dtype == torch.float32 else 4
    return training_memory(num_params, stage, dp, param_bytes=size, grad_bytes=size, master_bytes=master,
                           moment_bytes=8)


def memory_report(model: ZeroDataParallel) -> MemoryReport:
    """Bytes `model` holds on this rank, measured from its buffers, beside §3.1's formula."""
    def nbytes(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    params = grads = master = moments = buffers = 0
    for u in model.units:
        if model.stage == 3:
            params += nbytes(u.param_shard)
            buffers += u.full.untyped_storage().nbytes() + nbytes(u.grad_full)
        else:
            params += nbytes(u.full)
        if model.stage in (0, 1):
            grads += nbytes(u.grad_full)
        else:
            grads += nbytes(u.grad_shard)
            if model.stage == 2:
                buffers += nbytes(u.grad_full)
        master += 0 if model.dtype == torch.float32 else nbytes(u.master)  # fp32: the master is the param
        moments += nbytes(u.exp_avg) + nbytes(u.exp_avg_sq)
    psi = sum(u.numel for u in model.units)
    return MemoryReport(model.stage, model.world, psi, params, grads, master, moments, buffers,
                        formula_for(psi, model.stage, model.world, model.dtype))


def figure1(num_params: float = 7.5e9, dp: int = 64, k: int = 12) -> list[dict]:
    """Figure 1 of the paper: per-device model-state memory for Ψ parameters on N devices, in GB."""
    psi = int(num_params)
    rows = []
    for stage, name in ((0, "baseline"), (1, "Pos"), (2, "Pos+g"), (3, "Pos+g+p")):
        m = training_memory(psi, stage, dp, master_bytes=4, moment_bytes=k - 4)
        rows.append({"stage": stage, "ZeRO": name, "params GB": m.params / GB, "grads GB": m.grads / GB,
                     "optimizer GB": (m.master_weights + m.optimizer_states) / GB, "total GB": m.total / GB})
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m nano_zero.ledger`."""
    p = argparse.ArgumentParser(prog="python -m nano_zero.ledger", description="ZeRO Figure 1")
    p.add_argument("--params", type=float, default=7.5e9, help="Ψ (default: the paper's 7.5B)")
    p.add_argument("--dp", type=int, default=64, help="N data-parallel devices (default 64)")
    return p


def main(argv: list[str] | None = None) -> None:
    from shared.bench import print_table

    args = build_parser().parse_args(argv)
    print_table(figure1(args.params, args.dp), title=f"ZeRO Figure 1: Ψ = {args.params:.3g}, N = {args.dp}, K = 12")


if __name__ == "__main__":
    main()
