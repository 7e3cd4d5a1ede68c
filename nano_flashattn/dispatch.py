"""nano_flashattn's extension points: where a performance layer (a module of `layers/`) stands in for the
paper path, through the one mechanism of `registry.py`.

    "forward", "backward", "decode"   a launcher taking the paper launcher's keyword arguments
                                      (`interface.run_kernel`; else forward.py, backward.py, decode.py)
    "pdl"                             the launch options of a kernel that takes `PDL` on a device
                                      (`launch.pdl_args`; else none: no launch overlap)

The layers, in the order they are tried where several apply: `hopper_ws` (FA3's warp-specialised forward
and backward in Gluon), `hopper` (TMA loads on sm_90), `split_head` (head_dims of two power-of-two parts),
`pdl` (programmatic dependent launch). Each registers on import with a predicate saying where it applies;
they load at the first lookup, and a deleted one is skipped (`REGISTRY.missing`). `performance_layers(False)`
runs the paper path alone.
"""

from __future__ import annotations

from .registry import Registry, layers_enabled, performance_layers

__all__ = ["REGISTRY", "layers_enabled", "load_layers", "performance_layers"]

REGISTRY = Registry("nano_flashattn", points=("forward", "backward", "decode", "pdl"),
                    modules=("hopper_ws", "hopper", "split_head", "pdl"))


def load_layers() -> dict[str, str]:
    """Load every layer now (a lookup would, later) and return the missing ones: {name: why}. A layer that
    loaded runs wherever its predicate accepts a call (the device, the dtype, the shape)."""
    REGISTRY.load()
    return dict(REGISTRY.missing)
