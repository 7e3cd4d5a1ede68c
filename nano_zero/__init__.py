"""nano_zero: ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054) stages 0–3 with bf16 mixed precision.

`ZeroDataParallel` wraps any nn.Module; `ZeroEngine` trains shared.model with it under shared.train's loop;
`nano_zero.ledger` holds the memory and communication ledgers (§3.1, §7, Figure 1).
"""

from nano_zero.engine import ZeroEngine, init_like_build_model
from nano_zero.ledger import CommCounter, MemoryReport, figure1
from nano_zero.zero import ZeroDataParallel, default_units

__all__ = ["CommCounter", "MemoryReport", "ZeroDataParallel", "ZeroEngine", "default_units", "figure1",
           "init_like_build_model"]
