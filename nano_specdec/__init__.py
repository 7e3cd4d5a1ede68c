"""nano_specdec: speculative decoding — a draft proposes, the target verifies in one forward.

`sampling.py` holds the verification rules — speculative sampling (Leviathan et al.
2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318) for a chain of drafts, SpecInfer's
multi-step speculative sampling (arXiv 2305.09781) for a draft tree, and their greedy cases:

    from nano_specdec import verify_chain, verify_tree
    emitted = verify_chain(draft_tokens, draft_probs, target_probs)          # [k], [k, V], [k + 1, V]
    emitted, nodes = verify_tree(parents, tokens, draft_probs, target_probs)  # [n], [n], [n, V], [n + 1, V]

`verify_chains` / `verify_trees` (and `*_greedy`) are the batched forms an engine calls.

In nano_vllm's engine, for draft chains proposed by prompt lookup (Saxena 2023), a draft model, Medusa's
heads (arXiv 2401.10774) or EAGLE's draft layer (arXiv 2401.15077) (engine.py, scheduler.py, proposers.py,
medusa.py, eagle.py, model_runner.py):

    llm = LLM(model, speculative_config={"method": "ngram" | "draft_model" | "medusa" | "eagle",
                                         "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                         "prompt_lookup_min": 1, "model": DIR})
    engine = SpecDecodeEngine(EngineConfig(model=model), speculative_config)

Drafts are trained here (`python -m nano_specdec.train target=DIR method=eagle|medusa|draft_model out=DIR`),
served with `python -m nano_specdec.serve` and measured with `python -m nano_specdec.bench`.
"""

from .config import SpeculativeConfig
from .eagle import EagleProposer
from .engine import LLM, SpecDecodeEngine
from .medusa import MedusaProposer
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
    "EagleProposer",
    "MedusaProposer",
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
