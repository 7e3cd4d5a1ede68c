"""`kv_cache_dtype="kivi2" | "kivi4"`: the engine's KIVI cache on a CPU (nano_vllm.kivi).

Greedy output equals the same engine's output through the torch reference of the quantized cache
(kivi_reference.py: a 16-bit cache holding nano_quant.kv's round trips of K/V), with chunked prefill,
prefix-cache hits and preemption, on the paper path and with the layers; the KIVI pool, dequantized, holds
the reference cache's values. §5's sizing counts the quantized block's bytes (and the 16-bit residual),
every block and residual entry comes back after aborts, copy-on-write copies a block's residual with it,
blocks move between instances with their residual, and bad configurations are a ValueError at
construction.
"""

from __future__ import annotations

import types

import pytest
import torch
from kivi_reference import reference_llm
from test_kv_cache_dtype import run  # the FP8 tests' workload, twice, every block back at the end
from vllm_checkpoints import random_prompts

from nano_flashattn.kivi import dequantize_kivi_pages
from nano_vllm import LLM, SamplingParams
from nano_vllm.config import EngineConfig
from nano_vllm.kv_cache import kv_block_bytes, kv_cache_summary
from nano_vllm.sequence import Sequence, SequenceStatus

CASES = {
    "chunked_prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "prefix_cache": {},
    "preemption": {"num_kv_blocks": 8},  # 128 token slots for requests of up to 84 tokens
}


@pytest.fixture(autouse=True)
def no_window(monkeypatch):
    """These tests check the packed blocks and the open group against a reference that holds each
    token's round trip from its write on: no 16-bit window (kv_cache_residual=0 unless a test passes
    one; the window's own tests are test_kivi_window_*)."""
    monkeypatch.setattr("nano_vllm.config.KIVI_RESIDUAL", 0)


def dequantized_pool(runner) -> torch.Tensor:
    """Every block of every layer, read as attention reads a full block (no open group): K, V as
    (2, layers, blocks, block_size, heads, dim)."""
    pool, n = runner.kv_pool, runner.num_blocks
    table = torch.arange(n, dtype=torch.int32)[None]
    lens = torch.tensor([n * runner.block_size], dtype=torch.int32)
    out = []
    for layer in range(runner.model_config.num_hidden_layers):
        k, v, _ = dequantize_kivi_pages(runner.kv_cache[0, layer], runner.kv_cache[1, layer],
                                        pool.k_tail[layer], table, lens, pool.tail_of_block, pool.bits,
                                        pool.group_size, torch.float32)
        out.append(torch.stack([k[:n], v[:n]]))
    return torch.stack(out, 1)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["kivi2", "kivi4"])
def test_kivi_engine_equals_the_torch_reference(llama_ckpt, dtype, case, layer_args, monkeypatch):
    args = dict(max_model_len=128, **CASES[case], **layer_args)
    llm = LLM(llama_ckpt, kv_cache_dtype=dtype, **args)
    runner = llm.engine.model_runner
    G = runner.config.kv_cache_group_size
    assert G == 16 and runner.kv_cache.dtype == torch.uint8 and runner.kv_scales is None
    ref = reference_llm(llama_ckpt, monkeypatch, dtype, G, **args)
    assert runner.num_blocks == ref.engine.model_runner.num_blocks
    outs = run(llm)
    assert outs == run(ref)
    assert len({t for o in outs for c in o for t in c}) > 3
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions == ref.engine.scheduler.num_preemptions > 0
    # the same steps wrote the same slots: values everywhere, keys of every closed group
    kv = dequantized_pool(runner)
    want = ref.engine.model_runner.kv_cache[:, :, : runner.num_blocks]
    assert torch.equal(kv[1], want[1])
    closed = ref.kivi_reference.closed[: runner.num_blocks * runner.block_size // G]
    groups = closed.repeat_interleave(G).view(runner.num_blocks, -1)[None, :, :, None, None]
    groups = groups.expand_as(want[0])
    assert groups.any() and torch.equal(kv[0][groups], want[0][groups])


def test_kivi_qwen3_chunked_prefix_hits(qwen3_ckpt, monkeypatch):
    """q/k norms and tied embeddings: the same equality, chunked prefill with prefix hits."""
    args = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4, performance_layers=False)
    llm = LLM(qwen3_ckpt, kv_cache_dtype="kivi2", **args)
    ref = reference_llm(qwen3_ckpt, monkeypatch, "kivi2", 16, **args)
    assert run(llm) == run(ref)


def test_kivi_holds_more_tokens_in_the_same_memory(llama_ckpt):
    """§5's sizing: a token costs its codes and its share of the scales and zeros; the residual (one open
    group per sequence, 16 bits) comes out of the same memory; the summary reports both."""
    args = dict(max_model_len=64, kv_cache_memory_bytes=1 << 20, block_size=32, dtype="bfloat16",
                max_num_seqs=8)
    runners = {c: LLM(llama_ckpt, kv_cache_dtype=c, **args).engine.model_runner
               for c in ("auto", "kivi2", "kivi4")}
    mc = runners["auto"].model_config  # 2 layers, 1 kv head, head_dim 32
    for c, bits in (("kivi2", 2), ("kivi4", 4)):
        r = runners[c]
        assert r.config.kv_cache_group_size == 32
        width = 32 * bits // 8 + 4 * 32 // 32  # codes + fp16 scale and zero per group of 32
        assert r.block_bytes == 2 * 2 * 32 * 1 * width == kv_block_bytes(mc, 32, 1, r.config)
        assert r.kv_cache.shape == (2, 2, r.num_blocks + 1, 32, 1, width)
        tail = r.kv_pool.k_tail
        assert tail.shape == (2, 9, 32, 1, 32) and tail.dtype == torch.bfloat16
        assert r.num_blocks == ((1 << 20) - 2 * 9 * 32 * 32 * 2) // r.block_bytes
        per_gib = round(r.num_blocks * 32 * 2**30 / (r.num_blocks * r.block_bytes + tail.nbytes))
        summary = kv_cache_summary(r)
        assert f"KV cache ({c}: {bits}-bit codes, groups of 32" in summary
        assert f"{per_gib} tokens per GiB" in summary
    blocks = {c: r.num_blocks for c, r in runners.items()}
    assert blocks["kivi2"] > 4 * blocks["auto"] and blocks["kivi4"] > 2.5 * blocks["auto"]


def test_every_block_and_entry_comes_back_after_aborts(llama_ckpt):
    """Requests aborted mid-prompt and mid-decode free their blocks; their residual entries are
    reclaimed once the entries run out, so later requests still run."""
    llm = LLM(llama_ckpt, kv_cache_dtype="kivi2", max_model_len=128, max_num_batched_tokens=16,
              max_num_seqs=2)
    engine, pool = llm.engine, llm.engine.model_runner.kv_pool
    params = SamplingParams(temperature=0.0, max_tokens=30)
    for round_ in range(3):
        for i, prompt in enumerate(random_prompts(10 + round_, [37, 5, 21])):
            engine.add_request(prompt, params, request_id=f"{round_}-{i}")
        for _ in range(4):
            engine.step()
        for i in range(3):
            engine.abort_request(f"{round_}-{i}")
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert len(pool.free) + len(pool.entry_of) == pool.num_entries
    outs = llm.generate(random_prompts(20, [19, 33]), params, use_tqdm=False)
    assert all(len(o.token_ids) == 30 for o in outs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_copy_on_write_copies_the_residual(llama_ckpt):
    """A forked sequence (nano_sglang's `fork`) shares its parent's partial block; the first write into
    it copies the block and, with it, the 16-bit keys of its open group: both continue as one would."""
    # no prefix cache: the second prefill must attend to fresh K/V like the first (a hit reads codes)
    llm = LLM(llama_ckpt, kv_cache_dtype="kivi2", max_model_len=128, enable_prefix_caching=False)
    engine = llm.engine
    prompt = random_prompts(3, [23])[0]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    parent = engine.add_request(prompt, params, request_id="parent")
    engine.step()  # the prompt: 23 tokens, an open group of 7 in its second block
    child = Sequence(parent.token_ids, params, "child")
    engine.block_manager.fork(parent, child)
    child.status = SequenceStatus.RUNNING
    engine.scheduler.running.append(child)
    while engine.has_unfinished_requests():
        engine.step()
    # the child's prompt holds the parent's first token: its 6 tokens continue from there
    assert parent.output_token_ids == alone and child.output_token_ids[:5] == alone[1:]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_plan_moves_and_frees_residual_entries(llama_ckpt):
    """`KIVIPool.plan` by hand: an entry follows a sequence's open group from block to block, is freed
    when a step closes it, and a block whose old owner left keeps no entry."""
    runner = LLM(llama_ckpt, kv_cache_dtype="kivi2", max_model_len=128, max_num_seqs=2).engine.model_runner
    pool = runner.kv_pool
    seq = Sequence(list(range(40)))
    seq.block_table, seq.status = [5, 2, 7], SequenceStatus.RUNNING
    step = types.SimpleNamespace(seqs=[seq], num_new_tokens=[10], copies=[])
    pool.plan(step)  # tokens 0..9: group 0 open in block 5
    assert pool.entry_of == {5: 0} and pool.free == [1]
    seq.num_computed_tokens = 10
    step.num_new_tokens = [9]
    pool.plan(step)  # tokens 10..18: group 0 closes, group 1 opens in block 2
    assert pool.entry_of == {2: 0}
    seq.num_computed_tokens = 19
    step.num_new_tokens = [13]
    pool.plan(step)  # 19..31: group 1 closes, nothing open
    assert pool.entry_of == {} and sorted(pool.free) == [0, 1]
    assert pool.tail_of_block[[5, 2]].tolist() == [0, 0]  # on the device (a closed group's: stale)


@pytest.mark.parametrize("args, match", [
    ({"kv_cache_dtype": "kivi2", "kv_cache_group_size": 32}, r"kv_cache_group_size \(32\) must divide "
                                                                 r"block_size \(16\)"),
    ({"kv_cache_dtype": "kivi4", "kv_cache_group_size": 24, "block_size": 64}, "must be a power of two"),
    ({"kv_cache_dtype": "kivi2", "kv_cache_group_size": 8}, r"power of two >= 16 \(whole int32 words"),
    ({"kv_cache_dtype": "fp8", "kv_cache_group_size": 16}, "kv_cache_group_size=16 is KIVI's"),
    ({"kv_cache_dtype": "kivi2", "mixed_cudagraph_sizes": (64,)}, "captures decode steps only"),
    ({"kv_cache_dtype": "kivi4", "tensor_parallel_size": 2}, "runs on one device"),
    ({"kv_cache_dtype": "kivi2", "kv_cache_group_size": "16"}, "kv_cache_group_size must be"),
])
def test_bad_kivi_configuration_is_a_value_error(llama_ckpt, args, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=llama_ckpt, device="cpu", **args)


def test_kivi_group_wider_than_the_head_is_a_value_error(llama_ckpt):
    """Values are quantized in groups of G channels: head_dim 32 takes no G = 64."""
    with pytest.raises(ValueError, match=r"head_dim \(32\) must be a multiple of group_size \(64\)"):
        LLM(llama_ckpt, kv_cache_dtype="kivi2", kv_cache_group_size=64, block_size=64, max_model_len=64)


def test_kivi_blocks_move_between_instances(llama_ckpt):
    """nano_distserve's transfer: a prompt's blocks and its open group's 16-bit keys, imported by
    another instance, decode as the instance that computed them would."""
    kv_message = pytest.importorskip("nano_distserve.kv_message")
    a, b = (LLM(llama_ckpt, kv_cache_dtype="kivi2", max_model_len=64, enable_prefix_caching=False)
            for _ in range(2))
    prompt, params = random_prompts(4, [21])[0], SamplingParams(temperature=0.0, max_tokens=5)
    want = a.generate([prompt], params, use_tqdm=False)[0].token_ids
    src = a.engine.add_request(prompt, params, request_id="p")
    a.engine.step()  # prefill only: the prompt's K/V, an open group of 5 keys
    buf = kv_message.export_kv(a.engine.model_runner, src.block_table, len(prompt))
    a.engine.abort_request("p")
    seq = Sequence(prompt, params, "d")
    assert b.engine.block_manager.allocate_slots(seq, len(prompt), (), num_computed_tokens=0)
    kv_message.import_kv(b.engine.model_runner, seq.block_table, buf, len(prompt), seq)
    seq.append_token(src.output_token_ids[0])
    seq.num_computed_tokens, seq.status = len(prompt), SequenceStatus.RUNNING
    b.engine.scheduler.running.append(seq)
    while b.engine.has_unfinished_requests():
        b.engine.step()
    assert seq.output_token_ids == want


def random_operations(llm: LLM, ref: LLM, gen: torch.Generator, prompt, check, steps: int = 60) -> None:
    """Random arrivals (`prompt(step, n)` gives n prompt tokens) and aborts on both engines, one step each
    at a time: after every step both have produced the same tokens and `check()` holds; some request
    was preempted by the end."""
    seqs: dict[str, list] = {}
    for step in range(steps):
        if torch.rand(1, generator=gen) < 0.5:
            tokens = prompt(step, int(torch.randint(1, 40, (1,), generator=gen)))
            params = SamplingParams(temperature=0.0, max_tokens=int(torch.randint(1, 50, (1,), generator=gen)))
            seqs[str(step)] = [e.add_request(tokens, params, request_id=str(step)) for e in (llm.engine, ref.engine)]
        if seqs and torch.rand(1, generator=gen) < 0.1:
            rid = list(seqs)[int(torch.randint(0, len(seqs), (1,), generator=gen))]
            for e in (llm.engine, ref.engine):
                e.abort_request(rid)
        if llm.engine.has_unfinished_requests():
            llm.engine.step(), ref.engine.step()
        for ours, want in seqs.values():
            assert ours.token_ids == want.token_ids
        check()
    assert llm.engine.scheduler.num_preemptions > 0


def test_random_operations_match_the_reference(llama_ckpt, monkeypatch):
    """Random arrivals and aborts over a small pool (preemption, chunks, prefix hits, entries reclaimed):
    after every step both engines have produced the same tokens, and the residual's bookkeeping holds
    (an entry is free or names one block, never both)."""
    args = dict(max_model_len=96, max_num_batched_tokens=24, max_num_seqs=3, num_kv_blocks=8,
                performance_layers=False)
    llm = LLM(llama_ckpt, kv_cache_dtype="kivi2", **args)
    ref = reference_llm(llama_ckpt, monkeypatch, "kivi2", 16, **args)
    pool, gen = llm.engine.model_runner.kv_pool, torch.Generator().manual_seed(11)
    base = random_prompts(12, [40])[0]

    def prompt(step: int, n: int) -> list[int]:  # a shared prefix half of the time
        return base[:n] if torch.rand(1, generator=gen) < 0.5 else random_prompts(step, [n])[0]

    def check() -> None:
        assert not set(pool.free) & set(pool.entry_of.values())
        assert len(set(pool.entry_of.values())) == len(pool.entry_of)

    random_operations(llm, ref, gen, prompt, check)


def test_fused_rope_store_skips_a_kivi_cache(llama_ckpt, monkeypatch):
    """layers/fused.py's RoPE + store kernel writes 16-bit K/V: with a KIVI cache the KIVI write runs,
    even where the kernel would apply (use_triton forced on here)."""
    import nano_vllm.layers.fused as fused

    def refuse(*args, **kwargs):
        raise AssertionError("rope_and_store must not write into a KIVI cache")

    monkeypatch.setattr(fused, "use_triton", lambda t: True)
    monkeypatch.setattr(fused, "rope_and_store", refuse)
    llm = LLM(llama_ckpt, kv_cache_dtype="kivi4", max_model_len=64, fused_projections=True)
    assert "fused" in llm.engine.model_runner.layers_applied
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].token_ids) == 4


@pytest.mark.parametrize("case", ["plain", "preemption"])
def test_kivi_window_covering_every_token_decodes_the_16_bit_tokens(llama_ckpt, case):
    """KIVI §3.3's window (kv_cache_residual R) as wide as a sequence: every decode reads its keys and
    values from the 16-bit rings, so greedy output is the 16-bit cache's, token for token — also when a
    preempted sequence is recomputed and its window starts again (no prefix caching: a prefix hit's
    tokens are not in the new sequence's ring, and are read from their codes)."""
    args = dict(max_model_len=128, enable_prefix_caching=False, max_num_seqs=4)
    if case == "preemption":
        args["num_kv_blocks"] = 8  # 128 token slots for the workload's longer requests
    prompts, params = random_prompts(6, [5, 30, 70]), SamplingParams(temperature=0.0, max_tokens=24)
    want = LLM(llama_ckpt, **args).generate(prompts, params, use_tqdm=False)
    llm = LLM(llama_ckpt, kv_cache_dtype="kivi2", kv_cache_residual=128, **args)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    narrow = LLM(llama_ckpt, kv_cache_dtype="kivi2", kv_cache_residual=0, **args)
    assert [o.token_ids for o in narrow.generate(prompts, params, use_tqdm=False)] != \
        [o.token_ids for o in want]  # 2-bit codes read back do change the output here


def test_kivi_window_sizing_and_bad_values(llama_ckpt):
    """The rings (R + G - 1 rows rounded to whole groups, K and V, one entry a sequence and a scratch
    entry) come out of the KV memory like the open group's tail; R is KIVI's only and an int >= 0."""
    args = dict(max_model_len=64, kv_cache_memory_bytes=1 << 21, max_num_seqs=4)
    runners = {r: LLM(llama_ckpt, kv_cache_dtype="kivi2", kv_cache_residual=r, **args).engine.model_runner
               for r in (0, 40)}
    pool = runners[40].kv_pool
    G = pool.group_size
    assert pool.rows == 64 and pool.k_win.shape[1:3] == (5, 64) and runners[0].kv_pool.residual == 0
    assert pool.tail_bytes == pool.k_tail.nbytes + pool.tail_of_block.nbytes + 2 * pool.k_win.nbytes
    assert runners[40].num_blocks < runners[0].num_blocks and G == 16
    for bad, match in (({"kv_cache_residual": -1}, "kv_cache_residual must be an int >= 0"),
                       ({"kv_cache_residual": 8, "kv_cache_dtype": "fp8"}, "kv_cache_residual=8 is KIVI's")):
        with pytest.raises(ValueError, match=match):
            LLM(llama_ckpt, **{"kv_cache_dtype": "kivi2", **args, **bad})


def test_kivi_window_random_operations_match_the_16_bit_engine(llama_ckpt):
    """Random arrivals and aborts over a small pool (preemption, ring entries reclaimed and restarted),
    a window as wide as a sequence, whole prompts in one step and no prefix caching (so that nothing is
    read from codes): after every step the KIVI engine has produced the 16-bit engine's tokens, and no
    ring entry is both free and held or held twice."""
    args = dict(max_model_len=96, max_num_batched_tokens=96, max_num_seqs=3, num_kv_blocks=8,
                enable_prefix_caching=False, performance_layers=False)
    llm = LLM(llama_ckpt, kv_cache_dtype="kivi2", kv_cache_residual=96, **args)
    ref = LLM(llama_ckpt, **args)
    pool, gen = llm.engine.model_runner.kv_pool, torch.Generator().manual_seed(12)

    def check() -> None:
        held = [h[0] for h in pool.win_held.values()]
        assert len(set(held)) == len(held) and not set(held) & set(pool.win_free)

    random_operations(llm, ref, gen, lambda step, n: random_prompts(step, [n])[0], check)
