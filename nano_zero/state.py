"""ZeroDataParallel's model states in and out: the consolidated fp32 weights (an HF checkpoint on rank 0)
and each rank's shard of master weights and AdamW moments (a resume checkpoint). Bookkeeping around the
paper's mechanism, not part of it; what the buffers hold beside §3.1's formula is
`nano_zero.ledger.memory_report`."""

from __future__ import annotations

import torch


class ZeroStateMixin:
    """State dicts of ZeroDataParallel (its `units`, `stage`, `world`, `comm`, ...)."""

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """fp32 master weights under the module's state_dict names on rank 0, None elsewhere (collective)."""
        values: dict[str, torch.Tensor] = {}
        for u in self.units:
            flat = u.master
            if self.stage >= 1:
                flat = torch.empty(u.padded, dtype=torch.float32, device=self.device)
                self.comm.all_gather(flat, u.master)
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
        return {"stage": self.stage, "world": self.world, "adam_step": self.adam_step,
                "geometry": self._geometry(),
                "units": [{"master": u.master.cpu().clone(), "exp_avg": u.exp_avg.cpu(),
                           "exp_avg_sq": u.exp_avg_sq.cpu()} for u in self.units]}

    @torch.no_grad()
    def load_shard_state_dict(self, state: dict) -> None:
        mine = {"stage": self.stage, "world": self.world, "geometry": self._geometry()}
        for key, value in mine.items():
            saved = state[key] if key != "geometry" else [tuple(g) for g in state[key]]
            if saved != value:
                raise ValueError(f"resume state was saved with {key}={saved!r}, this run has "
                                 f"{value!r}: resume with the same stage, world size and model")
        self.adam_step = int(state["adam_step"])
        for u, s in zip(self.units, state["units"]):
            u.master.copy_(s["master"])
            u.exp_avg.copy_(s["exp_avg"])
            u.exp_avg_sq.copy_(s["exp_avg_sq"])
        self._publish_params()
