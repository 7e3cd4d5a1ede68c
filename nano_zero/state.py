"""ZeroDataParallel's model states in and out: the consolidated fp32 weights (an HF checkpoint on rank 0),
each rank's shard of master weights and AdamW moments (a resume checkpoint), and the bytes each buffer
holds beside §3.1's formula (nano_zero.ledger). Bookkeeping around the paper's mechanism, not part of it."""

from __future__ import annotations

import torch

from nano_zero.ledger import MemoryReport, formula_for


class ZeroStateMixin:
    """State dicts and the memory report of ZeroDataParallel (its `units`, `stage`, `world`, `comm`, ...)."""

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """fp32 master weights under the module's state_dict names on rank 0, None elsewhere (collective)."""
        values: dict[str, torch.Tensor] = {}
        for u in self.units:
            flat = u.master
            if self.stage >= 1:
                flat = torch.empty(u.padded, dtype=torch.float32, device=self.device)
                self.comm.all_gather(flat, u.master, count=False)
            if self.rank == 0:
                values.update({k: v.cpu() for k, v in u.unflatten(flat).items()})
        if self.rank != 0:
            return None
        name_of = {id(s.param): s.name for u in self.units for s in u.slots}
        out = {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            out[key] = values[name_of[id(t)]] if id(t) in name_of else t.detach().cpu().clone()
        return out

    def _geometry(self) -> list[tuple[str, int, int]]:
        return [(u.name, u.numel, u.padded) for u in self.units]

    def shard_state_dict(self) -> dict:
        """This rank's fp32 master shard and AdamW moments (what a sharded resume checkpoint holds)."""
        return {"stage": self.stage, "world": self.world, "adam_step": self.adam_step, "geometry": self._geometry(),
                "units": [{"master": u.master.cpu().clone(), "exp_avg": u.exp_avg.cpu(),
                           "exp_avg_sq": u.exp_avg_sq.cpu()} for u in self.units]}

    @torch.no_grad()
    def load_shard_state_dict(self, state: dict) -> None:
        mine = {"stage": self.stage, "world": self.world, "geometry": self._geometry()}
        for key, value in mine.items():
            saved = state[key] if key != "geometry" else [tuple(g) for g in state[key]]
            if saved != value:
                raise ValueError(f"resume state was saved with {key}={saved!r}, this run has {value!r}: "
                                 "resume with the same stage, world size and model")
        self.adam_step = int(state["adam_step"])
        for u, s in zip(self.units, state["units"]):
            u.master.copy_(s["master"])
            u.exp_avg.copy_(s["exp_avg"])
            u.exp_avg_sq.copy_(s["exp_avg_sq"])
        self._publish_params(count=False)

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, measured from its buffers, beside §3.1's formula (see nano_zero.ledger)."""
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        params = grads = master = moments = buffers = 0
        for u in self.units:
            if self.stage == 3:
                params += nbytes(u.param_shard)
                buffers += u.full.untyped_storage().nbytes() + nbytes(u.grad_full)
            else:
                params += nbytes(u.full)
            if self.stage in (0, 1):
                grads += nbytes(u.grad_full)
            else:
                grads += nbytes(u.grad_shard)
                if self.stage == 2:
                    buffers += nbytes(u.grad_full)
            master += 0 if self._alias else nbytes(u.master)
            moments += nbytes(u.exp_avg) + nbytes(u.exp_avg_sq)
        psi = sum(u.numel for u in self.units)
        return MemoryReport(self.stage, self.world, psi, params, grads, master, moments, buffers,
                            formula_for(psi, self.stage, self.world, self.dtype))
