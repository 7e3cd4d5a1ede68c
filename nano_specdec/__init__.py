"""nano_specdec: speculative decoding — a draft proposes, the target verifies in one forward.

`sampling.py` holds the verification rules — speculative sampling (Leviathan et al.
2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318) for a chain of drafts, SpecInfer's
multi-step speculative sampling (arXiv 2305.09781) for a draft tree, and their greedy cases:

    from nano_specdec import verify_chain, verify_tree
    emitted = verify_chain(draft_tokens, draft_probs, target_probs)          # [k], [k, V], [k + 1, V]
    emitted, nodes = verify_tree(parents, tokens, draft_probs, target_probs)  # [n], [n], [n, V], [n + 1, V]

`verify_chains` / `verify_trees` (and `*_greedy`) are the batched forms an engine calls.

In nano_vllm's engine, for draft chains proposed by prompt lookup (Saxena 2023) or a draft model
(engine.py, scheduler.py, proposers.py, model_runner.py):

    llm = LLM(model, speculative_config={"method": "ngram" | "draft_model", "num_speculative_tokens": k,
                                         "prompt_lookup_max": 4, "prompt_lookup_min": 1, "model": DIR})
    engine = SpecDecodeEngine(EngineConfig(model=model), speculative_config)
"""

from .config import SpeculativeConfig
from .engine import LLM, SpecDecodeEngine
from .proposers import DraftModelProposer, NgramProposer, Proposer
from .sampling import (
    residual,
    verify_chain,
    verify_chain_greedy,
    verify_chains,
    verify_chains_greedy,
    verify_tree,
    verify_tree_greedy,
    verify_trees,
    verify_trees_greedy,
)

__all__ = [
    "LLM",
    "DraftModelProposer",
    "NgramProposer",
    "Proposer",
    "SpecDecodeEngine",
    "SpeculativeConfig",
    "residual",
    "verify_chain",
    "verify_chain_greedy",
    "verify_chains",
    "verify_chains_greedy",
    "verify_tree",
    "verify_tree_greedy",
    "verify_trees",
    "verify_trees_greedy",
]
