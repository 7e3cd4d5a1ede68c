"""nano_specdec's performance layers: the same drafts and tokens as the paper path, faster. Each module
registers into an extension point of the paper path when imported (nano_specdec.config.REGISTRY loads
them on first use, each inside a guard: delete one and the rest runs).

| module | point | runs (default: where it applies) |
|---|---|---|
| `draft_chain` | "proposer" | a draft model or EAGLE's layer whose runner has nano_vllm's decode CUDA graphs |

nano_vllm's own layers apply to the target and to the drafts' runners; `performance_layers=False` turns
these off with them. `engine.layers_applied` names those that ran.
"""
