"""Performance layers: the one way a faster implementation plugs into a paper path, in every package.

A package's paper path runs the paper's mechanism and names the places where something faster may stand in
— its *extension points* ("forward", "decode", "runner", ...) — in one `Registry`. A performance layer is a
module in the package's `layers/` folder that registers, when imported, what it offers for a point and a
predicate saying when it applies:

    REGISTRY.register("decode", launch_with_pdl, applies=lambda q, **_: q.is_cuda)

A point is used in one of two ways. A dispatch takes the first layer that applies and falls back to the
paper path (`impl = REGISTRY.select("decode", **args) or decode_forward`); a hook applies every layer that
applies (`for layer in REGISTRY.active("runner", runner): layer(runner)`). Either way the layers are tried
in the order the registry lists their modules.

Fast by default: the first lookup imports every layer module the registry lists, each inside a guard, so a
module that is absent (a fork deleted it) or whose own imports fail (a Triton without Gluon, say) is skipped
and remembered (`missing`), and the paper path runs in its place. A layer that does not apply to the device
or the shape says so through its predicate. Asked for explicitly, a missing layer is an error
(`require`). One switch runs the paper path alone, for readers and A/B runs:

    with performance_layers(False):   # every lookup in this context returns nothing
        ...

The switch is a context variable, so two engines in one process (or one engine per thread) may differ.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

_ENABLED: ContextVar[bool] = ContextVar("performance_layers", default=True)


@contextmanager
def performance_layers(enabled: bool = True) -> Iterator[None]:
    """Run the block with the performance layers on (the default) or off (the paper path alone)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"performance_layers must be a bool, got {type(enabled).__name__}")
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def layers_enabled() -> bool:
    """Whether lookups in the current context may return layers (False inside `performance_layers(False)`)."""
    return _ENABLED.get()


@dataclass(frozen=True)
class Layer:
    """One registration: `impl` stands in at `point` wherever `applies(...)` is true."""

    point: str
    impl: Callable
    applies: Callable[..., bool]
    module: str


def _always(*args: Any, **kwargs: Any) -> bool:
    return True


def _module_of(impl: Callable) -> str:
    """The module that defines `impl` (through functools.partial)."""
    while isinstance(impl, functools.partial):
        impl = impl.func
    return getattr(impl, "__module__", None) or "?"


class Registry:
    """One package's extension points and the performance layers registered into them.

    package: the package name ("nano_vllm"); modules: the names of its layer modules, in the order they
    load and so the order their registrations are tried (`{package}.layers.{name}`)."""

    def __init__(self, package: str, points: Iterable[str], modules: Iterable[str] = ()):
        self.package = package
        self.modules = tuple(modules)
        self._layers: dict[str, tuple[Layer, ...]] = {p: () for p in points}
        self.missing: dict[str, str] = {}  # layer module -> why it is not loaded
        self._loaded = self._loading = False
        self._lock = threading.RLock()

    def module_name(self, name: str) -> str:
        return f"{self.package}.layers.{name}"

    def register(self, point: str, impl: Callable, applies: Callable[..., bool] | None = None
                 ) -> Callable[[], None]:
        """Let `impl` stand in at `point` wherever `applies` (called with the point's arguments) is true.
        Registrations are tried in the order of `modules` (the layer module that defines `impl`; those of
        other modules, a test's say, after them in the order they came), so a layer that is disabled and
        enabled again keeps its place. Returns a function that removes the registration. Registering the
        same impl twice is a no-op."""
        if point not in self._layers:
            raise ValueError(f"{self.package} has no extension point {point!r}; "
                             f"its points are {sorted(self._layers)}")
        if not callable(impl) or (applies is not None and not callable(applies)):
            raise TypeError(f"impl and applies must be callables, got {type(impl).__name__} and "
                            f"{type(applies).__name__}")
        layer = Layer(point, impl, applies or _always, _module_of(impl))
        with self._lock:
            entries = self._layers[point]
            if not any(e.impl is impl for e in entries):
                rank = self._rank(layer.module)
                at = next((i for i, e in enumerate(entries) if self._rank(e.module) > rank), len(entries))
                self._layers[point] = (*entries[:at], layer, *entries[at:])  # readers never see a half

        def remove() -> None:
            with self._lock:
                self._layers[point] = tuple(e for e in self._layers[point] if e is not layer)

        return remove

    def remove(self, point: str, module: str) -> None:
        """Remove every registration at `point` whose impl `module` defines (a layer's `disable`)."""
        with self._lock:
            self._layers[point] = tuple(e for e in self._layers[point] if e.module != module)

    def registered(self, point: str, module: str) -> bool:
        """Whether `module` has a registration at `point` (a layer's `enabled`)."""
        return any(e.module == module for e in self.layers(point))

    def _rank(self, module: str) -> int:
        names = [self.module_name(name) for name in self.modules]
        return names.index(module) if module in names else len(names)

    def load(self) -> None:
        """Import every layer module once; an absent one, or one whose imports fail, is skipped."""
        if self._loaded:
            return
        with self._lock:  # other threads wait here; a layer being imported may look things up (re-entrant)
            if self._loaded or self._loading:
                return
            self._loading = True
            try:
                for name in self.modules:
                    try:
                        importlib.import_module(self.module_name(name))
                    except ImportError as e:  # deleted, or a dependency it needs is not installed
                        self.missing[name] = f"{type(e).__name__}: {e}"
            finally:
                self._loaded, self._loading = True, False

    def layers(self, point: str) -> list[Layer]:
        """Every registration at `point`, in order (loads the layers first)."""
        self.load()
        return list(self._layers[point])

    def select(self, point: str, *args: Any, **kwargs: Any) -> Callable | None:
        """The first layer at `point` that applies to these arguments, or None (the paper path runs)."""
        if not _ENABLED.get():
            return None
        self.load()
        for layer in self._layers[point]:  # a tuple, replaced (never changed) by register / remove
            if layer.applies(*args, **kwargs):
                return layer.impl
        return None

    def active(self, point: str, *args: Any, **kwargs: Any) -> list[Callable]:
        """Every layer at `point` that applies to these arguments, in order."""
        if not _ENABLED.get():
            return []
        self.load()
        return [layer.impl for layer in self._layers[point] if layer.applies(*args, **kwargs)]

    def snapshot(self) -> dict[str, tuple[Layer, ...]]:
        """Every point's registrations now (after loading the layers), for `restore`."""
        self.load()
        return dict(self._layers)

    def restore(self, snapshot: dict[str, tuple[Layer, ...]]) -> None:
        """Make the registrations those of `snapshot` (`{}`: none, the paper path everywhere). A test's
        fixture clears and restores them; a worker process takes its parent's (Layer pickles where its
        impl and predicate do)."""
        self.load()
        unknown = set(snapshot) - set(self._layers)
        if unknown:
            raise ValueError(f"{self.package} has no extension points {sorted(unknown)}")
        with self._lock:
            self._layers = {p: tuple(snapshot.get(p, ())) for p in self._layers}

    def present(self, name: str) -> bool:
        """Whether the layer module `name` loaded."""
        self.load()
        return name in self.modules and name not in self.missing

    def require(self, name: str, switch: str) -> None:
        """An explicit request for layer `name` (the setting `switch`): ValueError if it is not present."""
        if name not in self.modules:
            raise ValueError(f"{self.package} has no performance layer {name!r}")
        if not self.present(name):
            raise ValueError(f"{switch} needs the performance layer {self.module_name(name)}, which is not "
                             f"present ({self.missing[name]})")
