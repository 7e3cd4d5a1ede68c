"""The one performance-layer mechanism (nano_flashattn/registry.py), on a made-up package: guarded lazy
loading (a deleted or broken layer is skipped and named), the registry's order, removal, snapshots, the
`performance_layers` switch and explicit requests."""

from __future__ import annotations

import importlib
import sys

import pytest

from nano_flashattn.registry import Registry, layers_enabled, performance_layers

POINTS = '''
from nano_flashattn.registry import Registry
REGISTRY = Registry("fakepkg", points=("forward", "hook"), modules=("fast", "faster", "broken", "deleted"))
'''
LAYER = '''
from fakepkg.points import REGISTRY
def {name}(x):
    return "{name}"
REGISTRY.register("forward", {name}, applies=lambda x: x > {threshold})
REGISTRY.register("hook", {name})
'''


@pytest.fixture
def fakepkg(tmp_path, monkeypatch):
    pkg = tmp_path / "fakepkg"
    (pkg / "layers").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "points.py").write_text(POINTS)
    (pkg / "layers" / "__init__.py").write_text("")
    (pkg / "layers" / "fast.py").write_text(LAYER.format(name="fast", threshold=0))
    (pkg / "layers" / "faster.py").write_text(LAYER.format(name="faster", threshold=10))
    (pkg / "layers" / "broken.py").write_text("import no_such_dependency_of_this_layer\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("fakepkg.points").REGISTRY
    for name in [m for m in sys.modules if m.split(".")[0] == "fakepkg"]:
        del sys.modules[name]


def test_lazy_guarded_loading_and_the_order(fakepkg):
    assert "fakepkg.layers.fast" not in sys.modules  # nothing loads before the first lookup
    assert fakepkg.select("forward", 20).__name__ == "fast"  # the order of `modules`, not of arrival
    assert fakepkg.select("forward", 5).__name__ == "fast" and fakepkg.select("forward", -1) is None
    assert [f.__name__ for f in fakepkg.active("hook", 0)] == ["fast", "faster"]
    assert set(fakepkg.missing) == {"broken", "deleted"}
    assert "No module named 'no_such_dependency_of_this_layer'" in fakepkg.missing["broken"]
    assert fakepkg.present("fast") and not fakepkg.present("deleted")


def test_remove_and_enable_again_keep_the_order(fakepkg):
    fakepkg.load()
    fakepkg.remove("forward", "fakepkg.layers.fast")
    assert not fakepkg.registered("forward", "fakepkg.layers.fast")
    assert fakepkg.select("forward", 20).__name__ == "faster" and fakepkg.select("forward", 5) is None
    fast = sys.modules["fakepkg.layers.fast"].fast
    remove = fakepkg.register("forward", fast)
    assert [layer.impl.__name__ for layer in fakepkg.layers("forward")] == ["fast", "faster"]
    assert fakepkg.register("forward", fast) is not None and len(fakepkg.layers("forward")) == 2  # no-op
    remove()
    remove()  # twice: harmless
    assert [layer.impl.__name__ for layer in fakepkg.layers("forward")] == ["faster"]
    other = fakepkg.register("forward", len)  # a module the registry does not list: after the listed
    assert [layer.impl for layer in fakepkg.layers("forward")][-1] is len
    other()


def test_snapshot_and_restore(fakepkg):
    saved = fakepkg.snapshot()
    fakepkg.restore({})
    assert fakepkg.select("forward", 20) is None and fakepkg.active("hook", 0) == []
    fakepkg.restore(saved)
    assert fakepkg.select("forward", 20).__name__ == "fast"
    with pytest.raises(ValueError, match=r"^fakepkg has no extension points \['decode'\]"):
        fakepkg.restore({"decode": ()})


def test_the_switch(fakepkg):
    assert layers_enabled()
    with performance_layers(False):
        assert not layers_enabled()
        assert fakepkg.select("forward", 20) is None and fakepkg.active("hook", 0) == []
        with performance_layers(True):
            assert fakepkg.select("forward", 20).__name__ == "fast"
    assert layers_enabled() and fakepkg.select("forward", 20).__name__ == "fast"
    with pytest.raises(TypeError, match=r"^performance_layers must be a bool, got str"), \
            performance_layers("no"):
        pass


def test_an_explicit_request_names_the_missing_layer(fakepkg):
    fakepkg.require("fast", "engine.fast=true")
    with pytest.raises(ValueError, match=r"^engine.deleted=true needs the performance layer "
                                         r"fakepkg.layers.deleted, which is not present \(ModuleNotFoundError"):
        fakepkg.require("deleted", "engine.deleted=true")
    with pytest.raises(ValueError, match=r"^fakepkg has no performance layer 'nope'"):
        fakepkg.require("nope", "engine.nope=true")


def test_an_unknown_point():
    registry = Registry("fakepkg", points=("forward",))
    with pytest.raises(ValueError, match=r"^fakepkg has no extension point 'decode'; its points are"):
        registry.register("decode", len)
