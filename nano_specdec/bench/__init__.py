"""`python -m nano_specdec.bench` — speculative decoding against nano_vllm's plain decode of the same target
(a Hydra app: nano_specdec/configs/bench.yaml).

For each method of `methods` (prompt lookup `ngram`, a `draft_model`; the keys of each one's
speculative_config under `speculative:`), on each workload of held-out stdlib files (workloads.py: `code`
continuation, `text` from docstrings, `edit` — a file rewritten, where prompt lookup shines), at each
batch size (1, 4, 16, 64) and temperature (0, 1): output tok/s against nano_vllm's plain decode of the
same target on the same prompts in the same process (every performance layer on for both, or
`performance_layers=false` for both), τ (mean tokens emitted per target forward of a decoding
sequence), acceptance by draft position, and the draft's cost per step (its host time, a draft model's
forwards included, against the run's). Greedy runs also say how many requests gave the plain engine's
tokens. Both engines get the same KV pool, sized for the largest batch (not from free memory: the draft
model's pool comes on top of the target's). speedup.py says how a run is timed, probe.py what it counts.

`cost=true` adds the cost side at a large target's shape (cost.py): on llama3-8b random weights, the step
time of k + 1 tokens per sequence against one, and of a draft's step (Llama-3.2-1B's shape), and the
speedup those costs and the measured τ imply — labelled a projection.

    python -m nano_specdec.bench                                 # GPU: llama-100m shape, 512-token prompts
    python -m nano_specdec.bench model=outputs/llama-100m/checkpoint speculative.draft_model.model=DIR
    python -m nano_specdec.bench methods=[ngram] workloads=[edit] batch_sizes=[1,16]
    python -m nano_specdec.bench cost=true                       # + the llama3-8b projection
    python -m nano_specdec.bench quick=true                      # a CPU-sized run (automatic without CUDA)
    python -m shared.report --results DIR --only specdec          # its figure, from DIR/bench.json

Prints the runs, then (with cost=true) the step costs and the projection, writes `bench.json` in the Hydra
run directory, and prints a short table of speedups last. The figure: `python -m shared.report`
(specdec_speedup.png).
"""

from nano_specdec.bench.speedup import run

__all__ = ["run"]
