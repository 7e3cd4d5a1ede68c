"""nano_zero: ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054) stages 0–3 with bf16 mixed precision.

`ZeroDataParallel` wraps any nn.Module; `ZeroEngine` trains shared.model with it under shared.train's loop;
`nano_zero.ledger` holds the memory and communication ledgers (§3.1, §7, Figure 1), which measure a
ZeroDataParallel from outside (`memory_report(model)`, `count_communication(model)`).
"""

import importlib
from typing import Any

# Imported on first use, so `python -m nano_zero.ledger` (or .train, .bench) does not import the module it
# runs twice.
_EXPORTS = {
    "ZeroEngine": "nano_zero.engine", "init_like_build_model": "nano_zero.engine",
    "CommCounter": "nano_zero.ledger", "MemoryReport": "nano_zero.ledger", "figure1": "nano_zero.ledger",
    "count_communication": "nano_zero.ledger", "memory_report": "nano_zero.ledger",
    "ZeroDataParallel": "nano_zero.zero", "default_units": "nano_zero.zero",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nano_zero' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
