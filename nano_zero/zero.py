"""ZeRO stages 0–3 as one wrapper for any nn.Module (Rajbhandari et al. 2019, arXiv 1910.02054 §5).

    model = ZeroDataParallel(module, stage=2, dtype=torch.bfloat16, weight_decay=0.1)
    for i, (x, y) in enumerate(micro_batches):
        with model.no_sync() if i < len(micro_batches) - 1 else nullcontext():
            loss_fn(model(x), y).backward()
    grad_norm = model.step(lr, max_norm=1.0)

The stages differ only in which model states a rank keeps whole and which it keeps as a 1/N shard, and
therefore in when it communicates (flat buffers and shards: nano_zero.flat):

| stage | params (bf16) | grads (bf16) | fp32 master + AdamW m, v | communication per step           |
|-------|---------------|--------------|--------------------------|----------------------------------|
| 0     | full          | full         | full                     | all-reduce grads (2Ψ)            |
| 1 Pos | full          | full         | shard                    | reduce-scatter grads + all-gather params (2Ψ) |
| 2 +g  | full          | shard        | shard                    | same, the reduce-scatter overlapping backward |
| 3 +p  | shard         | shard        | shard                    | all-gather fwd + bwd, reduce-scatter (3Ψ) |

Gradients are SUMMED over ranks: the loss is already normalised by the global batch (shared.train).
Stage 3 re-gathers each unit before its backward and reduce-scatters after every micro-step's backward,
so its gradients stay 2Ψ/N; stages 0–2 accumulate full gradients locally under `no_sync()` and reduce
once, on the last micro-step (the accumulation boundary).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from nano_zero.collectives import Collectives
from nano_zero.flat import FlatUnit, adamw_
from nano_zero.stage3 import Stage3Mixin
from nano_zero.state import ZeroStateMixin
from shared.train import clip_coefficient, weak_hook

InitFn = Callable[[nn.Module, torch.Generator], None]


def default_units(module: nn.Module) -> list[nn.Module]:
    """The blocks of a Transformer: every element of every nn.ModuleList (shared.model's `layers`)."""
    return [m for sub in module.modules() if isinstance(sub, nn.ModuleList) for m in sub]


class ZeroDataParallel(Stage3Mixin, ZeroStateMixin, nn.Module):
    """Train `module` with ZeRO `stage` over the ranks of `group` (default: the world).

    units: the modules whose parameters are gathered/reduced together (default `default_units`); the
        parameters outside them form the root unit. Stage 3 gathers a unit before its forward, frees it
        after, re-gathers it before its backward, and prefetches the next unit meanwhile (`prefetch`).
    dtype: the compute dtype of parameters and gradients (bf16: mixed precision with fp32 master weights
        and moments, §3.1; fp32: the master weights are the parameters).
    init_fn: for a module on the meta device, `init_fn(submodule, generator)` initialises each submodule's
        own parameters, in `module.modules()` order, one unit at a time; only the shard is kept (stage 3
        never holds the whole model). A materialised module's current values are used instead (every
        rank must hold the same values).

    Errors (ValueError): stage not in 0..3, a frozen parameter, mixed parameter dtypes or devices, a
    parameter shared by two units, nested units. A unit module called twice per forward works in every
    stage (stage 3 gathers it once per call).
    """

    def __init__(self, module: nn.Module, stage: int, *, units: list[nn.Module] | None = None,
                 dtype: torch.dtype = torch.float32, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 group: dist.ProcessGroup | None = None, init_fn: InitFn | None = None,
                 seed: int = 0, prefetch: bool = True,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        self.module, self.stage, self.dtype = module, stage, dtype
        self.betas, self.eps, self.weight_decay, self.prefetch = betas, eps, weight_decay, prefetch
        self.comm = Collectives(group)  # plain; nano_zero.ledger.count_communication counts them
        self.rank, self.world = self.comm.rank, self.comm.world
        self.adam_step = 0
        self._sync = True
        self._callback_queued = False
        self._pending: list[tuple[object | None, Callable[[], None]]] = []
        self._alias = dtype == torch.float32  # fp32: master weights are (a slice of) the parameters
        units = units if units is not None else default_units(module)
        self.blocks, self.root, self.device = self._partition(units, device)
        self.units = [self.root, *self.blocks]
        self._unit_of = {id(s.param): u for u in self.units for s in u.slots}
        self._materialize(init_fn, seed)
        if stage >= 2:
            for u in self.units:
                for s in u.slots:
                    s.param.register_post_accumulate_grad_hook(weak_hook(self._on_param_grad))
        if stage == 2:
            module.register_forward_pre_hook(lambda m, a: self._ensure_grad_buckets())
        if stage == 3:
            self._install_stage3_hooks()

    # =============================================================== setup
    def _partition(self, unit_modules: list[nn.Module], device: torch.device | str | None
                   ) -> tuple[list[FlatUnit], FlatUnit, torch.device]:
        names = {id(m): n for n, m in self.module.named_modules()}
        params = dict(self.module.named_parameters())
        for name, p in params.items():
            if not p.requires_grad:
                raise ValueError(f"parameter {name!r} is frozen (requires_grad=False): ZeRO "
                                 "partitions trainable parameters only; make it a buffer or drop "
                                 "it from the module")
        dtypes = {p.dtype for p in params.values()}
        if len(dtypes) > 1:
            raise ValueError(f"parameters have mixed dtypes {sorted(map(str, dtypes))}: ZeRO keeps "
                             "one flat buffer per unit; give the module one dtype (`dtype=` sets "
                             "the compute dtype)")
        devices = {p.device for p in params.values()}
        if len(devices) > 1:
            raise ValueError(f"parameters are on several devices {sorted(map(str, devices))}")
        if device is None:
            device = next(iter(devices), torch.device("cpu"))
            if device.type == "meta":  # materialise where the compute runs
                cuda = torch.cuda.is_available()
                device = torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"
        owner: dict[int, str] = {}
        blocks = []
        for m in unit_modules:
            if id(m) not in names or m is self.module:
                raise ValueError("every unit must be a proper submodule of the wrapped module")
            qual = names[id(m)]
            for other in unit_modules:
                if other is not m and any(sub is m for sub in other.modules()):
                    raise ValueError(f"unit {qual!r} is nested inside unit {names[id(other)]!r}")
            named = list(m.named_parameters(prefix=qual))
            for pname, p in named:
                if id(p) in owner:
                    raise ValueError(f"parameter {pname!r} is shared by units {owner[id(p)]!r} "
                                     f"and {qual!r}: a parameter must belong to one unit (put both "
                                     "users in one unit)")
                owner[id(p)] = qual
            blocks.append(FlatUnit(qual, named, self.rank, self.world))
        root = [(n, p) for n, p in params.items() if id(p) not in owner]
        return blocks, FlatUnit("<root>", root, self.rank, self.world), torch.device(device)

    @torch.no_grad()
    def _materialize(self, init_fn: InitFn | None, seed: int) -> None:
        """Fill each unit's buffers, one unit at a time, keeping only what the stage keeps: a module built
        on the meta device is initialised unit by unit and sharded at once, so in stage 3 (§5.3) the full
        model never exists on one rank."""
        on_meta = [s.param.is_meta for u in self.units for s in u.slots]
        if not any(on_meta):
            for u in self.units:
                self._adopt(u, u.flatten_params(torch.float32).to(self.device))
            return
        if not all(on_meta):
            raise ValueError("the module is partly on the meta device: materialise it fully or not "
                             "at all")
        if init_fn is None:
            raise ValueError("a module on the meta device needs init_fn to initialise its "
                             "parameters")
        self._replace_meta_params()
        gen = torch.Generator(device=self.device).manual_seed(seed)
        def own(m: nn.Module) -> list[nn.Parameter]:
            return list(m.parameters(recurse=False))

        order = [m for m in self.module.modules() if own(m)]
        last = {id(self._unit_of[id(p)]): i for i, m in enumerate(order) for p in own(m)}
        staging: dict[int, torch.Tensor] = {}
        for i, m in enumerate(order):
            for u in {id(self._unit_of[id(p)]): self._unit_of[id(p)] for p in own(m)}.values():
                if id(u) not in staging:  # open the unit: an fp32 buffer its parameters view
                    staging[id(u)] = torch.zeros(u.padded, dtype=torch.float32, device=self.device)
                    u.point_params_at(staging[id(u)])
            init_fn(m, gen)
            for p in own(m):
                u = self._unit_of[id(p)]
                # the unit's last module: keep the shard, drop the rest
                if last[id(u)] == i and id(u) in staging:
                    self._adopt(u, staging.pop(id(u)))
        for u in self.units:  # a unit with no parameters
            if u.master is None:
                self._adopt(u, torch.zeros(u.padded, dtype=torch.float32, device=self.device))

    def _replace_meta_params(self) -> None:
        """Swap each meta Parameter for an empty one on the device (a meta tensor's data cannot be
        re-pointed), in every module that holds it, so tied parameters stay tied."""
        fresh = {}
        for u in self.units:
            for s in u.slots:
                empty = torch.empty(0, dtype=s.param.dtype, device=self.device)
                fresh[id(s.param)] = nn.Parameter(empty)
                s.param = fresh[id(s.param)]
        for m in self.module.modules():
            for k, p in m._parameters.items():
                if p is not None and id(p) in fresh:
                    m._parameters[k] = fresh[id(p)]
        self._unit_of = {id(s.param): u for u in self.units for s in u.slots}

    def _adopt(self, u: FlatUnit, values: torch.Tensor) -> None:
        """Turn a unit's fp32 values (padded, flat) into the stage's buffers."""
        sl = u.shard_slice()
        if self.stage == 0:
            u.master = values
            u.full = values if self._alias else values.to(self.dtype)
        elif self.stage in (1, 2):
            u.full = values if self._alias else values.to(self.dtype)
            u.master = u.full[sl] if self._alias else values[sl].clone()
        else:
            u.master = values[sl].clone()
            u.param_shard = u.master if self._alias else u.master.to(self.dtype)
            u.full = torch.empty(u.padded, dtype=self.dtype, device=self.device)
        u.point_params_at(u.full)
        if self.stage == 3:
            u.full.untyped_storage().resize_(0)  # at rest a stage-3 rank holds only its shard
        u.exp_avg, u.exp_avg_sq = torch.zeros_like(u.master), torch.zeros_like(u.master)
        if self.stage in (0, 1):
            u.grad_full = torch.zeros(u.padded, dtype=self.dtype, device=self.device)
            u.point_grads_at(u.grad_full)
        else:
            u.grad_shard = torch.zeros(u.shard_numel, dtype=self.dtype, device=self.device)

    # =============================================================== forward / backward
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation without communication (stages 0–2; stage 3 reduces every micro-step)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def _ensure_grad_buckets(self) -> None:
        if torch.is_grad_enabled():
            for u in self.units:
                if u.grad_full is None:
                    u.grad_full = torch.zeros(u.padded, dtype=self.dtype, device=self.device)
                    u.point_grads_at(u.grad_full)

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_param_grad(self, param: torch.Tensor) -> None:
        # The hook finds the unit here rather than holding it: the unit holds the parameter, and a hook
        # (kept by autograd in C++) holding the unit would keep every buffer alive after the engine died.
        self._on_grad(self._unit_of[id(param)], param)

    def _on_grad(self, u: FlatUnit, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook (stages 2, 3): when a unit's last gradient lands, reduce-scatter it."""
        if self.stage == 2 and not self._sync:
            return
        self._queue_final_callback()
        u.ready += 1
        if u.ready == len(u.slots) and not u.reduced:
            self._reduce(u)

    def _reduce(self, u: FlatUnit) -> None:
        """§5.2 (Pos+g): reduce-scatter one bucket while backward continues, then free its full gradients."""
        u.reduced = True
        if self.stage == 2:
            work = self.comm.reduce_scatter(u.grad_shard, u.grad_full, async_op=True)

            def done(u: FlatUnit = u) -> None:
                u.drop_grads()
                u.grad_full = None
        else:
            out = torch.empty_like(u.grad_shard)
            work = self.comm.reduce_scatter(out, u.grad_full, async_op=True)
            self._reshard(u)  # this unit's backward is over: its parameters can go

            def done(u: FlatUnit = u, out: torch.Tensor = out) -> None:
                u.grad_shard.add_(out)  # accumulate micro-steps into the 2Ψ/N shard
                u.drop_grads()
                u.grad_full = None
        self._pending.append((work, done))
        self._drain(keep=1)  # at most two buckets of full gradients alive

    def _drain(self, keep: int = 0) -> None:
        while len(self._pending) > keep:
            work, done = self._pending.pop(0)
            if work is not None:
                work.wait()
            done()

    def _end_of_backward(self) -> None:
        """Runs once when autograd finishes a backward pass: reduce what the hooks did not (a parameter
        without a gradient this pass), wait for every reduce-scatter, release stage 3's gathered units."""
        self._callback_queued = False
        for u in self.units:
            needs = self.stage == 2 or u.ready > 0 or u.grad_full is not None
            if not u.reduced and needs and u.grad_full is not None:
                self._reduce(u)
        self._drain(keep=0)
        for u in self.units:
            u.ready, u.reduced = 0, False
            if self.stage == 3:
                self._reshard(u)
                if u.grad_full is not None:  # re-gathered after its reduction (nothing left to add)
                    u.drop_grads()
                    u.grad_full = None

    # =============================================================== optimizer step
    @torch.no_grad()
    def step(self, lr: float, max_norm: float = 0.0) -> float:
        """Reduce (stages 0, 1), clip by the global gradient norm, AdamW on this rank's shard, and bring
        the bf16 parameters up to date (stages 1, 2: all-gather; stage 3: refresh the local shard).
        Returns the global L2 gradient norm before clipping."""
        self._drain(keep=0)
        sl_grads = []
        for u in self.units:
            if self.stage == 0:
                self.comm.all_reduce(u.grad_full)
                sl_grads.append(u.grad_full)
            elif self.stage == 1:
                g = u.grad_full[u.shard_slice()]
                # in place: my shard of the sum lands in my slice
                self.comm.reduce_scatter(g, u.grad_full)
                sl_grads.append(g)
            else:
                sl_grads.append(u.grad_shard)
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        # fp32 reductions over 1e5+ elements on CPU drift by ~1e-5 relative, so a sharded sum would not
        # match an unsharded one: accumulate in fp64 there (CUDA's tree reductions are exact enough)
        acc = torch.float64 if self.device.type == "cpu" else torch.float32
        for g in sl_grads:
            sq += torch.linalg.vector_norm(g, dtype=acc).double() ** 2
        if self.stage >= 1:
            # each rank holds a disjoint shard: the sums of squares add up
            self.comm.all_reduce_scalar(sq)
        norm = float(sq.sqrt())
        coef = clip_coefficient(norm, max_norm)
        self.adam_step += 1
        beta1, beta2 = self.betas
        for u, g in zip(self.units, sl_grads):
            g32 = g.float() * coef if coef < 1.0 else g.float()
            decay = u.decay_numel if self.stage == 0 else u.decay_numel_in_shard()
            adamw_(u.master, g32, u.exp_avg, u.exp_avg_sq, step=self.adam_step, lr=lr, beta1=beta1,
                   beta2=beta2, eps=self.eps, weight_decay=self.weight_decay, decay_numel=decay)
        self._publish_params()
        for u in self.units:
            (u.grad_full if self.stage in (0, 1) else u.grad_shard).zero_()
        return norm

    def _publish_params(self) -> None:
        """Copy updated master weights into the compute-dtype parameters (all-gather in stages 1, 2)."""
        for u in self.units:
            if self.stage == 0:
                if not self._alias:
                    u.full.copy_(u.master)
            elif self.stage in (1, 2):
                mine = u.full[u.shard_slice()]
                if not self._alias:
                    mine.copy_(u.master)
                self.comm.all_gather(u.full, mine)
            elif not self._alias:
                u.param_shard.copy_(u.master)


__all__ = ["ZeroDataParallel", "default_units"]
