"""`SpecModelRunner`: nano_vllm's runner, returning the logits of every verified row and verifying them.

A sequence with k drafts computes `[last token, d_1 .. d_k]` as one chunk over the paged KV cache
(nano_vllm's `prepare` packs it like a prefill chunk; attention is causal within it, so row i sees the
cached prefix and d_1 .. d_i). Its k + 1 rows all give logits: row i is the target's distribution after
the first i drafts (Leviathan §3: "run M_p in parallel" on the k + 1 prefixes), which is
`target_probs[i]` of `sampling.verify_chains`. Each sequence is then verified by the rule its request
asks for:

* greedy: `verify_chains_greedy` on the rows' argmax — drafts kept while they equal it;
* temperature > 0: speculative sampling (`verify_chains`, Leviathan Algorithm 1, Chen Algorithm 2) with
  p from the target's rows and q from the draft (one-hot for prompt lookup), both after temperature,
  top-k and top-p exactly as nano_vllm's sampler applies them, and the draws from the request's own
  generator when it has a seed.

Rows without drafts (prefill chunks that end their prompt, decodes without a proposal) are sampled by
nano_vllm's sampler, the same draw as in a plain step.

A proposer that drafts from the target's hidden states (Medusa's heads, EAGLE's draft layer) is set as
`proposer`; every step then hands it the hidden states of each sequence's tokens — all rows of a
prefill chunk or plain decode, the accepted rows of a verification. A forward hook on the decoder stack
copies every row's final hidden state into one buffer (`keeps_hidden`); the copy runs in eager steps
and is captured inside nano_vllm's CUDA graphs with the forward, so these steps replay graphs like
plain ones.
"""

from __future__ import annotations

import torch

from nano_specdec.proposers import request_probs
from nano_specdec.sampling import verify_chains, verify_chains_greedy
from nano_vllm.logprobs import StepLogprobs
from nano_vllm.model_runner import ModelRunner, StepInputs
from nano_vllm.sampler import SamplingTensors
from nano_vllm.scheduler import SchedulerOutput


class SpecModelRunner(ModelRunner):
    """nano_vllm's runner with verification (module docstring); `execute` returns, per scheduled
    sequence, the tokens it emits."""

    proposer = None  # one with `observe`: it gets the target's hidden states every step
    # Set by SpecDecodeEngine where the drafter runs a model on its own paged pool, one draft block per
    # target block: the draft's weights' bytes and its KV bytes per block. §5's sizing then gives the
    # memory to both pools (and the draft's weights) at once, as vLLM sizes a draft's layers with the
    # target's, so loading the draft after the target cannot run past `gpu_memory_utilization`.
    draft_bytes: tuple[int, int] = (0, 0)
    # Set by SpecDecodeEngine: whether the proposer reads the target's hidden states, and k + 1, the
    # logits rows a sequence that nano_vllm's graphs keep.
    keeps_hidden = False
    sample_rows_per_seq = 1

    def __init__(self, *args, **kwargs):
        cfg = args[0]
        self.sizing = True  # until the pool is sized, a block costs a draft block too
        profiled = cfg.torch_device.type == "cuda" and cfg.num_kv_blocks is None and \
            cfg.kv_cache_memory_bytes is None
        # the draft's weights as one placeholder, which the profile counts as used
        held = torch.empty(self.draft_bytes[0] * profiled, dtype=torch.uint8,
                           device=cfg.torch_device)
        super().__init__(*args, **kwargs)
        self.sizing = False
        del held

    def load_model(self) -> torch.nn.Module:
        model, cfg = super().load_model(), self.config
        if self.keeps_hidden:  # every row of a step: max_num_seqs and mixed graph sizes are no more
            rows = cfg.max_num_batched_tokens
            self.hidden_buf = model.lm_head.weight.new_empty(rows, self.model_config.hidden_size)
            model.model.register_forward_hook(self._keep_hidden)
        return model

    def _keep_hidden(self, module: torch.nn.Module, args: object, hidden: torch.Tensor) -> None:
        # decode (B, 1, H) or packed (1, N, H): the tokens' order
        flat = hidden.reshape(-1, hidden.shape[-1])
        self.hidden_buf[: len(flat)].copy_(flat)

    @property
    def block_bytes(self) -> int:
        return self.own_block_bytes + self.draft_bytes[1] * self.sizing

    @block_bytes.setter
    def block_bytes(self, value: int) -> None:
        self.own_block_bytes = value

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """nano_vllm's packed batch; a sequence with drafts returns the logits of all its k + 1 rows."""
        inputs = super().prepare(out)
        drafts = getattr(out, "drafts", None)
        if drafts and any(drafts):
            cu = inputs.cu_seqlens_q
            inputs.sample_rows = [row for i, s in enumerate(out.samples) if s
                                  for row in range(cu[i + 1] - 1 - len(drafts[i]), cu[i + 1])]
        return inputs

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        logits = super().run(inputs)
        if self.keeps_hidden:  # this step's rows (a graph pads past them), read before the next
            self.hidden = self.hidden_buf[: len(inputs.token_ids)]
        return logits

    def execute(self, out: SchedulerOutput) -> list[list[int]]:
        drafts = getattr(out, "drafts", None)
        if not (drafts and any(drafts)):  # a plain step
            tokens = iter(super().execute(out))
            emitted = [[next(tokens)] if s else [] for s in out.samples]
        else:
            logits = self.run(self.prepare(out))
            scores = StepLogprobs.of(self, out, None, None)  # prompt log-probabilities, if any
            if scores is not None:
                scores.attach()
            emitted = self.verify(logits, out)
        if self.proposer is not None:
            row = 0  # a verification's accepted rows: its last token and the accepted drafts
            for seq, n, d, e in zip(out.seqs, out.num_new_tokens, drafts or out.seqs, emitted):
                valid = len(e) if drafts and d else n
                self.proposer.observe(seq, seq.num_computed_tokens, self.hidden[row : row + valid])
                row += n
        return emitted

    def verify(self, logits: torch.Tensor, out: SchedulerOutput) -> list[list[int]]:
        """The emitted tokens of every scheduled sequence, from its rows of `logits`."""
        picked = [i for i, s in enumerate(out.samples) if s]
        starts, row = [], 0
        for i in picked:
            starts.append(row)
            row += len(out.drafts[i]) + 1
        emitted: dict[int, list[int]] = {}
        plain = [(i, start) for i, start in zip(picked, starts) if not out.drafts[i]]
        if plain:  # nano_vllm's own draw for rows without drafts
            seqs = [out.seqs[i] for i, _ in plain]
            st = SamplingTensors.build([s.sampling_params for s in seqs],
                                       [self._generator(s) for s in seqs], self.vocab_size,
                                       self.device)
            rows = torch.tensor([start for _, start in plain], device=logits.device)
            for (i, _), t in zip(plain, self.sampler.sample(logits[rows], st).tolist()):
                emitted[i] = [t]
        greedy = [(i, start) for i, start in zip(picked, starts)
                  if out.drafts[i] and out.seqs[i].sampling_params.greedy]
        if greedy:  # every greedy chain at once, padded with -1 (never an argmax): one read-back
            # of the rows' argmax, then the rule on the host — a few ints, where on the device its
            # small kernels and two host-to-device copies would each cost more than the comparison
            k = max(len(out.drafts[i]) for i, _ in greedy)
            tokens = [out.drafts[i] + [-1] * (k - len(out.drafts[i])) for i, _ in greedy]
            rows = [[s + min(j, len(out.drafts[i])) for j in range(k + 1)] for i, s in greedy]
            argmax = logits.argmax(-1).cpu()[torch.tensor(rows)]
            n, nxt = verify_chains_greedy(torch.tensor(tokens), argmax)
            for (i, _), a, t in zip(greedy, *torch.stack([n, nxt]).tolist()):
                emitted[i] = [*out.drafts[i][:a], t]
        for i, start in zip(picked, starts):
            d, seq = out.drafts[i], out.seqs[i]
            if not d or seq.sampling_params.greedy:
                continue
            k, q = len(d), out.draft_probs[i]
            p = request_probs(logits[start : start + k + 1], seq.sampling_params)
            q = None if q is None else q[None].to(p)
            drafts = torch.tensor([d], device=p.device)
            n, nxt = verify_chains(drafts, q, p[None], self._generator(seq))
            emitted[i] = [*d[: int(n)], int(nxt)]
        return [emitted.get(i, []) for i in range(len(out.seqs))]
