"""nano_vllm's performance layers: the same tokens as the paper path, faster. Each module registers into
an extension point of the paper path when imported (nano_vllm.config.REGISTRY loads them on first use, in
this order, each inside a guard: delete one and the rest runs).

| module | point | runs (default: where it applies) | switch |
|---|---|---|---|
| `cudagraph` | "graphs" | CUDA, unless `enforce_eager` | `enforce_eager`, `mixed_cudagraph_sizes` |
| `fused` | "runner" | CUDA | `fused_projections` |
| `gemv` | "runner" | CUDA, one-row steps | `gemv_max_tokens` (0: off) |
| `fused_decode` | "runner" | CUDA, one device, one-row decode steps of a 16-bit model (and of W4A16 where True) | `fused_decode` |
| `fused_sampling` | "runner" | CUDA | `fused_sampling` |
| `overlap` | "runner", "engine" | CUDA, one device, nano_vllm's runner / scheduler | `async_scheduling` |
| `warmup` | "engine" | CUDA | — |

A switch left None runs its layer where it applies, True asks for it (a ValueError where it is missing),
False turns it off; `performance_layers=False` turns them all off, with nano_flashattn's and nano_quant's.
`engine.layers_applied` names those that ran.
"""
