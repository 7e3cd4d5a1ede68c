"""The quantized KV cache's quality on a trained model: each `kv_cache_dtype` against the 16-bit cache.

    python -m nano_quant.kv_quality model=outputs/llama-100m/checkpoint

For every entry of `kv_cache_dtypes` (auto, fp8, kivi2, kivi4):

1. **Held-out perplexity** of the stdlib modules, windows at the model's longest context, through
   `DecodeCacheAttention` (a `shared.model` attention function): query i reads K and V as the cache holds
   them when token i is decoded — KIVI's evaluation quantizes the cache the decoding reads (§4). With
   KIVI (§3.3, Algorithm 1) the newest R tokens are 16-bit, older values quantized per token, older keys
   per channel in whole groups of G tokens counted from the sequence's first token (as a paged pool whose
   block size G divides stores them). R = `kivi.residual`, the paper's 128 by default, is also the
   engine's (`kv_cache_residual`), so the three measures describe one cache;
   `perplexity.other_residual` adds rows at another R (0: only the open key group in 16 bits). With
   FP8 every key and value, the current one too, is E4M3(x / scale) · scale (the engine's scale, 1.0 by
   default). The codes come from `nano_quant.kv`. This is every position decoded: a prompt's own queries
   read the fresh 16-bit K/V in a prefill (the engine does so), so perplexity measured here bounds the
   loss a served prompt sees from above. "auto" runs the same function without quantization; its
   perplexity is also measured through the model's own attention as a check of the function.
2. **Retrieval probe**: a name or signature defined early in a long held-out stdlib file (`NAME = value`,
   `def name(args):`), the file continued to the context length, then the line's start asked for again;
   correct when the greedy completion reproduces the rest of the line. Only lines whose start and whose
   answer occur once in the prompt are used, so the answer must come from the definition.
3. **Greedy agreement** with the 16-bit cache: held-out prompts, 128 greedy tokens each; the fraction of
   positions with the same token and the first position that differs.

(2) and (3) run a serving engine with the real `kv_cache_dtype`, through vLLM's offline API (`LLM(model,
kv_cache_dtype=..., **engine_args).generate(prompts, SamplingParams)`): nano_vllm by default, named by
`engine_api` and imported by that name at run time — nano_quant does not import nano_vllm (the import rule
of docs/ARCHITECTURE.md: nano_vllm stands on nano_quant), and a fork without an engine measures the
perplexity and says why the rest was not run. A dtype the engine refuses is recorded with its message.
Writes `kv_quality.json` to the run directory after every dtype of every stage.
"""

from __future__ import annotations

import importlib
import math
import re
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from nano_flashattn.registry import performance_layers
from shared.bench import print_table, release_memory, write_json
from shared.checkpoint import load_model
from shared.config import resolve_model_config
from shared.data import corpus_tokens, read_source, stdlib_files, stdlib_root, stdlib_split
from shared.hydra_utils import hydra_run_dir
from shared.model import default_attention
from shared.tokenizer import get_tokenizer

from .kv import (
    KEY_AXIS,
    VALUE_AXIS,
    KVCacheSpec,
    dequantize,
    dequantize_fp8,
    parse_kv_cache_dtype,
    quantize,
    quantize_fp8,
)
from .perplexity import config_record, perplexity, resolve_device, resolve_dtype

ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # vLLM's spelling
TARGETS = {"fp8": {"ppl": 0.005, "probe_points": 2.0}, "kivi2": {"ppl": 0.03, "probe_points": 2.0}}


class DecodeCacheAttention:
    """Causal attention (`CausalLM.set_attention`) in which query i reads the K/V of tokens 0..i as a
    `kv_cache_dtype` cache holds them when token i decodes; scores, softmax and sums in fp32, computed
    for `query_chunk` queries at a time."""

    def __init__(self, spec: KVCacheSpec, fp8_scale: float = 1.0, query_chunk: int = 512):
        if not isinstance(fp8_scale, (int, float)) or not fp8_scale > 0:
            raise ValueError(f"fp8_scale must be a positive number, got {fp8_scale!r}")
        if type(query_chunk) is not int or query_chunk < 1:
            raise ValueError(f"query_chunk must be a positive int, got {query_chunk!r}")
        self.spec, self.fp8_scale, self.query_chunk = spec, float(fp8_scale), query_chunk

    def quantized_counts(self, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """For each query i < n: how many of the oldest keys and values it reads quantized."""
        seen = torch.arange(1, n + 1, device=device)  # decoding token i, the cache holds tokens 0..i
        if self.spec.name == "auto":
            return seen * 0, seen * 0
        if self.spec.name == "fp8":
            return seen, seen
        old = (seen - self.spec.residual).clamp(min=0)  # older than the 16-bit window
        return old // self.spec.group_size * self.spec.group_size, old  # keys: whole groups only

    def dequantized(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Every token's K and V (batch, tokens, kv_heads, head_dim) as read back from the codes, fp32
        (keys of a last, incomplete group stay exact: no query reads them quantized)."""
        k, v = k.float(), v.float()
        if self.spec.name == "fp8":
            scale = torch.tensor(self.fp8_scale, device=k.device)
            return tuple(dequantize_fp8(quantize_fp8(x, scale), scale) for x in (k, v))
        if self.spec.name == "auto":
            return k, v
        bits, g = self.spec.bits, self.spec.group_size
        if k.shape[-1] % g:
            raise ValueError(f"head_dim {k.shape[-1]} is not a multiple of the KIVI group size {g} "
                             "(values are quantized in groups of G channels)")
        n = k.shape[1] // g * g
        kq = k.clone()
        if n:
            kq[:, :n] = dequantize(*quantize(k[:, :n], bits, g, 1 + KEY_AXIS), bits, g, 1 + KEY_AXIS)
        return kq, dequantize(*quantize(v, bits, g, VALUE_AXIS), bits, g, VALUE_AXIS)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer_idx: int = 0, ctx: Any = None) -> Tensor:
        b, s, hq, d = q.shape
        hk = k.shape[2]
        if q.shape[1] != k.shape[1]:
            raise ValueError("DecodeCacheAttention is a teacher-forced forward: q and k must have the same "
                             f"length, got {q.shape[1]} and {k.shape[1]}")
        kf, vf = k.float(), v.float()
        kq, vq = self.dequantized(k, v)
        nk, nv = self.quantized_counts(s, q.device)
        qf = q.float().reshape(b, s, hk, hq // hk, d)  # GQA: each kv head's query heads side by side
        j = torch.arange(s, device=q.device)
        out = torch.empty_like(qf)
        for lo in range(0, s, self.query_chunk):
            hi = min(s, lo + self.query_chunk)
            qc = qf[:, lo:hi] / math.sqrt(d)
            exact = torch.einsum("bchgd,bjhd->bhgcj", qc, kf)
            coded = torch.einsum("bchgd,bjhd->bhgcj", qc, kq)
            scores = torch.where(j < nk[lo:hi, None], coded, exact)
            scores = scores.masked_fill(j > torch.arange(lo, hi, device=q.device)[:, None], float("-inf"))
            p = scores.softmax(-1)
            from_codes = j < nv[lo:hi, None]
            out[:, lo:hi] = (torch.einsum("bhgcj,bjhd->bchgd", p * from_codes, vq)
                             + torch.einsum("bhgcj,bjhd->bchgd", p * ~from_codes, vf))
        return out.view(b, s, hq, d).to(q.dtype)


# ---------------------------------------------------------------------------------------------- the probe
ASSIGN = re.compile(r"^(?P<key>[ \t]*[A-Za-z_][\w.]*[ \t]+=)(?P<answer>[ \t]+[^=\s].*?)[ \t]*$")
DEF = re.compile(r"^(?P<key>[ \t]*(?:async[ \t]+)?def[ \t]+\w+)(?P<answer>\(.*:)[ \t]*$")
KEY_TOKENS = 16  # room left for the question (a definition's start) after the file's text
TRIVIAL = {"None", "True", "False", "0", "1", "-1", "''", '""', "[]", "{}", "()", "self", "cls"}


@dataclass
class Probe:
    """One question: `prompt` (token ids) ends where the rest of the defining line must follow."""
    file: str
    line: int
    kind: str
    question: str
    answer: str
    prompt: list[int]
    answer_tokens: int
    distance: int  # tokens from the definition to the end of the prompt


def _balanced(text: str) -> bool:
    return all(text.count(a) == text.count(b) for a, b in ("()", "[]", "{}")) and not text.endswith("\\")


def candidates(text: str) -> list[tuple[int, int, str, str, str]]:
    """(character offset, line number, kind, key, answer) of every line that defines a name on one line."""
    found, offset = [], 0
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        body = line.rstrip("\r\n")
        for kind, pattern in (("assign", ASSIGN), ("def", DEF)):
            m = pattern.match(body)
            answer = m.group("answer").strip() if m else ""
            if m and answer not in TRIVIAL and len(answer) >= 3 and _balanced(answer) \
                    and not answer.startswith("#") and not answer.endswith(","):
                found.append((offset, number, kind, m.group("key"), m.group("answer")))
                break
        offset += len(line)
    return found


def build_probes(documents: list[tuple[str, str]], context: int, num: int, per_file: int = 2,
                 early: float = 0.25, max_answer_tokens: int = 24) -> list[Probe]:
    """Up to `num` probes from (name, text) documents, `per_file` at most from one file: the file from its
    start up to a line end (at least 90% of the context), a definition in its first `early` fraction,
    then the definition's key on a new line; prompt and answer within `context` tokens."""
    enc = get_tokenizer()
    probes: list[Probe] = []
    room = context - max_answer_tokens - 2 - KEY_TOKENS  # for the file's text
    for name, text in documents:
        ids = enc.encode(text, disallowed_special=())
        if len(probes) >= num or len(ids) <= room:
            continue
        _, offsets = enc.decode_with_offsets(ids[: room + 1])
        cut = text.rfind("\n", 0, offsets[-1]) + 1  # whole lines of at most `room` tokens
        window, taken = text[:cut], 0
        for offset, number, kind, key, answer in candidates(window):
            if taken >= per_file or len(probes) >= num:
                break
            if window.count(key) != 1 or window.count(answer.strip()) != 1:
                continue  # the question or its answer appears elsewhere: not one definition to find
            prompt = enc.encode(window + key, disallowed_special=())
            where = len(enc.encode(window[:offset], disallowed_special=()))
            n_answer = len(enc.encode(answer, disallowed_special=()))
            if (n_answer > max_answer_tokens or len(prompt) + n_answer + 2 > context
                    or len(prompt) < 0.9 * room or where > early * len(prompt)):
                continue
            probes.append(Probe(name, number, kind, key.strip(), answer.strip(), prompt, n_answer,
                                len(prompt) - where))
            taken += 1
    return probes


def heldout_documents(root: str | None = None, split: str = "val") -> list[tuple[str, str]]:
    """(relative path, text) of the stdlib files of `split` (the held-out modules), sorted by path."""
    base = Path(root) if root else stdlib_root()
    return [(rel, read_source(base / rel)) for rel in stdlib_files(base) if stdlib_split(rel) == split]


def grade(probe: Probe, text: str) -> bool:
    """A completion is right when its first line, stripped, is the definition's rest."""
    return text.split("\n", 1)[0].strip() == probe.answer


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict[str, float]:
    """Per prompt: the fraction of positions with the reference's token, the first that differs (the
    length when none does); their means, and the share of prompts generated identically."""
    same, first = [], []
    for ref, out in zip(reference, tokens):
        n = max(len(ref), 1)
        same.append(sum(a == b for a, b in zip(ref, out)) / n)
        first.append(next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out))))
    return {"identical token fraction": statistics.fmean(same),
            "first divergence mean": statistics.fmean(first),
            "first divergence median": statistics.median(first),
            "identical prompts": statistics.fmean(f == len(r) for f, r in zip(first, reference))}


# ------------------------------------------------------------------------------------------------- stages
def perplexity_rows(cfg: DictConfig, model_dir: Path, device: torch.device, specs: dict[str, KVCacheSpec],
                    seq_len: int) -> Iterator[tuple[str, dict]]:
    """(dtype, held-out perplexity through `DecodeCacheAttention`) in turn; "auto" also through the
    model's own attention."""
    p = cfg.perplexity
    tokens = corpus_tokens("val", corpus=str(p.corpus))
    if p.max_tokens:
        tokens = tokens[: int(p.max_tokens) + 1]
    model = load_model(model_dir, device=device, dtype=resolve_dtype(str(cfg.dtype))).eval()
    for name, spec in specs.items():
        t0 = time.perf_counter()
        model.set_attention(DecodeCacheAttention(spec, float(cfg.fp8_scale), int(p.query_chunk)))
        row = perplexity(model, tokens, seq_len, int(p.batch_size))
        if name == "auto":
            model.set_attention(default_attention)
            row["ppl, model's attention"] = perplexity(model, tokens, seq_len, int(p.batch_size))["ppl"]
        row["seconds"] = time.perf_counter() - t0
        print(f"{name}: held-out perplexity {row['ppl']:.4f} ({row['tokens']:,} tokens, windows of "
              f"{seq_len})", flush=True)
        yield name, row
    del model
    release_memory()


def load_engine_api(name: str) -> ModuleType | None:
    """The module of the engine the engine stages run on (`LLM`, `SamplingParams`: vLLM's offline API),
    or None where it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def engine_cache(llm: Any) -> dict[str, int] | None:
    """The KV cache an engine's sizing made (blocks, tokens a block, bytes a block): nano_vllm's runner;
    None for an engine that does not expose one."""
    runner = getattr(getattr(llm, "engine", None), "model_runner", None)
    if runner is None or not hasattr(runner, "block_bytes"):
        return None
    return {"blocks": runner.num_blocks, "block_size": runner.block_size, "block_bytes": runner.block_bytes}


def engine_rows(cfg: DictConfig, api: ModuleType, model_dir: Path, dtypes: list[str], probes: list[Probe],
                prompts: list[list[int]], context: int) -> Iterator[tuple[str, dict]]:
    """(dtype, row) in turn, one engine each, the 16-bit one first: the probe's accuracy and greedy
    agreement on `prompts`; a dtype the engine refuses gives its message. KIVI's group size G is the
    simulation's (nano_vllm's `kv_cache_group_size`), the block size the smallest that holds whole groups."""
    enc, reference = get_tokenizer(), None
    kivi = any(parse_kv_cache_dtype(d).bits < 8 for d in dtypes)  # a block holds whole key groups
    args = {"max_model_len": context, "enable_prefix_caching": False, "dtype": ENGINE_DTYPES[str(cfg.dtype)],
            "max_num_seqs": max(len(probes), len(prompts), 1),
            "block_size": max(16, int(cfg.kivi.group_size)) if kivi else 16,
            **({"device": str(cfg.device)} if cfg.device else {}),
            **(OmegaConf.to_container(cfg.engine, resolve=True) or {})}
    for name in ["auto", *[d for d in dtypes if d != "auto"]]:
        group = {"kv_cache_group_size": args["block_size"],
                 "kv_cache_residual": int(cfg.kivi.residual)} if parse_kv_cache_dtype(name).bits < 8 else {}
        try:
            llm = api.LLM(str(model_dir), kv_cache_dtype=name, **group, **args)
        except ValueError as e:
            if name == "auto":
                raise
            print(f"skipped {name}: the engine refuses it: {e}", flush=True)
            yield name, {"skipped": f"the engine refuses kv_cache_dtype={name!r}: {e}"}
            continue
        row: dict[str, Any] = {}
        cache = engine_cache(llm)
        if cache is not None:
            print(f"{name}: KV cache of {cache['blocks']} blocks x {cache['block_size']} tokens", flush=True)
        if probes:
            params = [api.SamplingParams(temperature=0.0, max_tokens=p.answer_tokens + 2) for p in probes]
            outs = llm.generate([{"prompt_token_ids": p.prompt} for p in probes], params, use_tqdm=False)
            texts = [enc.decode([t for t in o.outputs[0].token_ids if t != enc.eot_token]) for o in outs]
            right = [grade(p, text) for p, text in zip(probes, texts)]
            row["probe accuracy"], row["probe right"] = statistics.fmean(right), right
        if prompts:
            params = api.SamplingParams(temperature=0.0, max_tokens=int(cfg.agreement.max_tokens),
                                        ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            reference = tokens if name == "auto" else reference
            row.update(agreement(reference, tokens))
        getattr(llm, "shutdown", lambda: None)()
        del llm
        release_memory()
        yield name, row


def agreement_prompts(cfg: DictConfig, context: int) -> list[list[int]]:
    """`num_prompts` held-out windows of `prompt_len` tokens, evenly spaced over the split."""
    a = cfg.agreement
    n, max_tokens = int(a.num_prompts), int(a.max_tokens)
    prompt_len = int(a.prompt_len or context - max_tokens)
    if prompt_len < 1 or prompt_len + max_tokens > context:
        raise ValueError(f"agreement.prompt_len ({prompt_len}) + max_tokens ({max_tokens}) must fit the "
                         f"context ({context})")
    tokens = corpus_tokens("val", corpus=str(cfg.perplexity.corpus))
    if tokens.numel() < prompt_len:
        raise ValueError(f"the held-out split has {tokens.numel()} tokens, fewer than prompt_len "
                         f"{prompt_len}")
    starts = torch.linspace(0, tokens.numel() - prompt_len, n).long().tolist() if n else []
    return [tokens[s: s + prompt_len].tolist() for s in starts]


def run(cfg: DictConfig) -> dict:
    """Everything `main` does, callable without Hydra (tests); the JSON is rewritten after every dtype of
    every stage, so a run cut short keeps what it measured."""
    with performance_layers(cfg.get("performance_layers", True)):
        if not cfg.get("model"):
            raise ValueError("model=DIR is required: the trained checkpoint (nano_megatron's "
                             "<run>/checkpoint)")
        model_dir, device = Path(str(cfg.model)), resolve_device(cfg.device)
        dtypes = [str(d) for d in cfg.kv_cache_dtypes]
        group = int(cfg.kivi.group_size)
        specs = {d: parse_kv_cache_dtype(d, None, group, int(cfg.kivi.residual)) for d in dtypes}
        if "auto" not in specs:
            raise ValueError(f"kv_cache_dtypes must include 'auto' (the 16-bit reference), got {dtypes}")
        other = cfg.perplexity.get("other_residual")
        if other is not None and int(other) != int(cfg.kivi.residual):  # perplexity rows at another R
            specs |= {f"{d}, R={int(other)}": parse_kv_cache_dtype(d, None, group, int(other))
                      for d in dtypes if specs[d].group_size}
        max_len = resolve_model_config(str(model_dir)).max_position_embeddings
        seq_len = int(cfg.perplexity.seq_len or max_len)
        context = int(cfg.probe.context or max_len)
        prompts = agreement_prompts(cfg, context) if cfg.agreement.enabled else []
        out = Path(hydra_run_dir()) / "kv_quality.json"
        rows = {d: {"kv_cache_dtype": d} for d in ["auto", *[d for d in specs if d != "auto"]]}
        record: dict[str, Any] = {"model": str(model_dir), "kv_cache_dtypes": dtypes, "seq_len": seq_len,
                                  "context": context, "engine_api": str(cfg.engine_api),
                                  "rows": list(rows.values()), "probes": [], "notes": [],
                                  "config": config_record(cfg)}

        def save() -> None:
            auto = rows["auto"]
            for r in rows.values():
                if r.get("ppl") is not None and auto.get("ppl") is not None:
                    r["ppl vs auto"] = r["ppl"] / auto["ppl"] - 1
                if r.get("probe accuracy") is not None and auto.get("probe accuracy") is not None:
                    r["probe vs auto (points)"] = 100 * (r["probe accuracy"] - auto["probe accuracy"])
            record["targets"] = targets(rows)
            write_json(out, record)

        if cfg.perplexity.enabled:
            for d, r in perplexity_rows(cfg, model_dir, device, specs, seq_len):
                rows[d].update({"ppl": r.pop("ppl"), "ppl vs auto": None, **r})
                save()
        probes = []
        if cfg.probe.enabled:
            pc = cfg.probe
            probes = build_probes(heldout_documents(pc.root, str(pc.split)), context, int(pc.num),
                                  int(pc.per_file), float(pc.early), int(pc.max_answer_tokens))
            record["probes"] = [{k: v for k, v in asdict(p).items() if k != "prompt"} for p in probes]
            print(f"retrieval probe: {len(probes)} questions from {len({p.file for p in probes})} files, "
                  f"definitions {min((p.distance for p in probes), default=0)}+ tokens before the question",
                  flush=True)
        api = load_engine_api(str(cfg.engine_api)) if probes or prompts else None
        if (probes or prompts) and api is None:
            record["notes"].append(f"the retrieval probe and greedy agreement need a serving engine: "
                                   f"engine_api={cfg.engine_api!r} is not installed")
            print(f"note: {record['notes'][-1]}", flush=True)
        if api is not None:
            for d, r in engine_rows(cfg, api, model_dir, dtypes, probes, prompts, context):
                for p, right in zip(record["probes"], r.pop("probe right", [])):
                    p[d] = right
                rows[d].update(r)
                save()
        save()
        print_table([{k: v for k, v in r.items() if k not in ("tokens", "seconds", "skipped", "nll")}
                     for r in rows.values()], title=f"KV cache quality: {model_dir}, context {context}")
        for r in rows.values():
            if r.get("skipped"):
                print(f"note: {r['skipped']}", flush=True)
        print("targets:", record["targets"], flush=True)
        print(f"wrote {out}", flush=True)
        return record


def targets(rows: dict[str, dict]) -> dict[str, bool | None]:
    """The quality targets: perplexity within 0.5% (FP8) / 3% (KIVI-2) of 16 bits, the probe within 2
    points; None where not measured."""
    found = {}
    for name, t in TARGETS.items():
        r = rows.get(name, {})
        ppl, probe = r.get("ppl vs auto"), r.get("probe vs auto (points)")
        found[f"{name} ppl within {t['ppl']:.1%}"] = None if ppl is None else ppl <= t["ppl"]
        found[f"{name} probe within {t['probe_points']:g} points"] = None if probe is None else \
            probe >= -t["probe_points"]
    return found


@hydra.main(version_base=None, config_path="configs", config_name="kv_quality")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
