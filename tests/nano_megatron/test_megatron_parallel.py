"""nano_megatron against a single process (shared.train.LocalEngine) and against torch's own tensor
parallelism (DTensor `parallelize_module`), on gloo, fp32.

Spawning torch processes costs seconds on a 2-core CI box, so each world size runs ONE job that builds
grid after grid in the same processes and returns everything; the tests below only compare. The
one-rank case runs in the test process itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron_cases import (
    VOCAB,
    global_batches,
    local_rows,
    make_engine,
    max_abs_diff,
    model_config,
    parallel_grads,
    parallel_run,
    reference_run,
    train_config,
)

from nano_megatron.engine import MegatronEngine, ParallelConfig
from nano_megatron.grid import GridShape, ParallelGrid
from nano_megatron.sequence_parallel import (
    gather_from_sequence_parallel,
    reduce_scatter_to_sequence_parallel,
    split_sequence,
)
from nano_megatron.tensor_parallel import (
    VocabParallelEmbedding,
    copy_to_tp,
    padded_vocab_size,
    reduce_from_tp,
    vocab_parallel_cross_entropy,
)
from shared.dist import DistributedError, destroy_distributed, init_distributed, run_distributed
from shared.model import build_model
from shared.train import LocalEngine, micro_batches_of

# multi-process runs shared by the module's tests: the forkability test leaves them to the repository run
pytestmark = pytest.mark.slow

TOL = 1e-5  # the bound for loss and parameters after 5 AdamW steps

# (tp, pp, dp) cases per world size; variants switch on SP, GPipe, checkpointing, biases, untied heads.
TWO_RANK_CASES = {
    "tp2": dict(parallel=dict(tp=2)),
    "tp2-sp": dict(parallel=dict(tp=2, sequence_parallel=True)),
    "tp2-qwen2-bias": dict(parallel=dict(tp=2), model=dict(attention_bias=True, qk_norm=False)),
    "pp2-1f1b": dict(parallel=dict(pp=2)),
    "pp2-gpipe": dict(parallel=dict(pp=2, schedule="gpipe")),
    "dp2": dict(parallel=dict(dp=2, bucket_mb=0.01)),  # several buckets
    # the overlap layer (each block's backward collective under its dW GEMMs, nano_megatron/layers/overlap.py),
    # with SP and under activation checkpointing (the saved weights come back from recomputation)
    "tp2-ckpt-overlap": dict(parallel=dict(tp=2, activation_checkpointing=True, tp_comm_overlap=True)),
    "tp2-sp-overlap": dict(parallel=dict(tp=2, sequence_parallel=True, tp_comm_overlap=True)),
    # micro-batches two at a time, interleaved layer by layer (on a GPU each on its own stream)
    "tp2-sp-pairs": dict(parallel=dict(tp=2, sequence_parallel=True, overlap_micro_batches=True)),
}
FOUR_RANK_CASES = {
    "tp2-pp2": dict(parallel=dict(tp=2, pp=2)),
    "tp2-dp2": dict(parallel=dict(tp=2, dp=2, bucket_mb=0.01)),
    "pp2-dp2": dict(parallel=dict(pp=2, dp=2, bucket_mb=0.01)),
    "tp2-pp2-sp-gpipe-ckpt": dict(parallel=dict(tp=2, pp=2, sequence_parallel=True, schedule="gpipe",
                                               activation_checkpointing=True)),
    "tp2-pp2-sp-untied": dict(parallel=dict(tp=2, pp=2, sequence_parallel=True),
                              model=dict(tie_word_embeddings=False)),
    "tp2-dp2-pairs-ckpt": dict(parallel=dict(tp=2, dp=2, bucket_mb=0.01, overlap_micro_batches=True,
                                             activation_checkpointing=True), train=dict(micro_batch_size=1)),
}
# Micro-batch invariance: global batch 4 as 1, 2 or 4 micro-batches (micro-batch size 4, 2, 1).
MICRO_SIZES = (4, 2, 1)

BAD_INPUTS = {  # name -> (case, expected message fragment), checked on 2 ranks
    "world": (dict(parallel=dict(tp=2, pp=2)), "world size 2 != tp × pp × dp = 2 × 2 × 1 = 4"),
    "heads": (dict(parallel=dict(tp=2), model=dict(num_attention_heads=3, num_key_value_heads=1)),
              "num_attention_heads (3) is not divisible by tp=2"),
    "kv_heads": (dict(parallel=dict(tp=2), model=dict(num_key_value_heads=1)),
                 "num_key_value_heads (1) is not divisible by tp=2"),
    "layers": (dict(parallel=dict(pp=2), model=dict(num_hidden_layers=3)),
               "num_hidden_layers (3) is not divisible by pp=2"),
    "batch": (dict(parallel=dict(dp=2), train=dict(global_batch_size=6, micro_batch_size=2)),
              "global_batch_size (6) must be divisible by micro_batch_size (2) x data-parallel size (2)"),
    "sp_seq": (dict(parallel=dict(tp=2, sequence_parallel=True), train=dict(seq_len=15)),
               "sequence parallelism needs seq_len (15) divisible by tp=2"),
    "schedule": (dict(parallel=dict(pp=2, schedule="zigzag")), "unknown pipeline schedule 'zigzag'"),
    "graph_pp": (dict(parallel=dict(pp=2, cuda_graph=True)),
                 "parallel.cuda_graph supports tensor (and sequence) parallelism only: pp and dp must be 1, got pp=2"),
    "graph_cpu": (dict(parallel=dict(tp=2, cuda_graph=True)), "parallel.cuda_graph needs a CUDA device"),
    "pairs_odd": (dict(parallel=dict(tp=2, overlap_micro_batches=True), train=dict(micro_batch_size=4)),
                  "micro_batch_size (4) x dp (1)) = 1 must be even"),
    "pairs_pp": (dict(parallel=dict(pp=2, overlap_micro_batches=True)), "parallel.overlap_micro_batches needs pp=1"),
}


# --------------------------------------------------------------------------- operator checks (2 ranks)
def _operator_checks() -> dict[str, float]:
    """f, g, the SP pair, the vocab-parallel embedding and loss against their unsharded definitions;
    returns max errors (every rank computes the full reference from the same seed)."""
    grid = ParallelGrid(GridShape(tp=2))
    r, group = grid.tp_rank, grid.tp_group
    torch.manual_seed(0)
    out: dict[str, float] = {}
    # f then a rank-dependent op: dL/dx must be the sum of both ranks' contributions.
    x = torch.randn(3, 4, requires_grad=True)
    (copy_to_tp(x, group) * (r + 1)).sum().backward()
    out["f_backward"] = (x.grad - 3.0).abs().max().item()
    # g: forward sums, backward passes the gradient through unchanged.
    y = torch.full((2,), float(r + 1), requires_grad=True)
    s = reduce_from_tp(y, group)
    (s * 2).sum().backward()
    out["g_forward"] = (s - 3.0).abs().max().item()
    out["g_backward"] = (y.grad - 2.0).abs().max().item()
    # SP: gather then reduce-scatter of a (b, s, h) tensor; gradients through both.
    full = torch.randn(2, 8, 3)
    shard = split_sequence(full, r, 2).clone().requires_grad_()
    gathered = gather_from_sequence_parallel(shard, group)
    out["sp_gather"] = (gathered - full).abs().max().item()
    scattered = reduce_scatter_to_sequence_parallel(gathered * (r + 1), group)
    out["sp_reduce_scatter"] = (scattered - 3 * split_sequence(full, r, 2)).abs().max().item()
    scattered.sum().backward()  # d/dshard = Σ_ranks (rank+1) = 3, after gather's reduce-scatter
    out["sp_backward"] = (shard.grad - 3.0).abs().max().item()
    # Vocab-parallel embedding (vocab 1001 padded to 1002) against nn.Embedding.
    emb = torch.nn.Embedding(VOCAB, 5)
    ids = torch.tensor([[0, 500, 501, 1000, 7, 999]])
    vpe = VocabParallelEmbedding(emb, grid, padded_vocab_size(VOCAB, 2))
    out["embedding"] = (vpe(ids) - emb(ids)).abs().max().item()
    # Vocab-parallel cross-entropy against F.cross_entropy, value and gradient.
    logits = torch.randn(6, VOCAB, dtype=torch.float64).float().requires_grad_()
    targets = torch.tensor([0, 500, 501, 1000, 3, 777])
    ref = F.cross_entropy(logits, targets, reduction="none")
    ref.sum().backward()
    per_rank = padded_vocab_size(VOCAB, 2) // 2
    local = F.pad(logits.detach(), (0, 1)).chunk(2, dim=-1)[r].clone().requires_grad_()
    ce = vocab_parallel_cross_entropy(local, targets, r * per_rank, VOCAB, group)
    ce.sum().backward()
    out["ce_value"] = (ce - ref).abs().max().item()
    out["ce_grad"] = (local.grad[:, :VOCAB - r * per_rank] - logits.grad[:, r * per_rank:][:, :per_rank]
                      ).abs().max().item()
    out["ce_padding_grad"] = local.grad[:, VOCAB - r * per_rank:].abs().max().item() if r == 1 else 0.0
    grid.destroy()
    return out


def _dtensor_vs_ours(steps: int = 3) -> dict:
    """torch's DTensor TP on the same model and data next to ours (tp=2, no SP): untied embeddings and
    no q/k norms, the configuration torch's plain ColwiseParallel/RowwiseParallel plan shards
    correctly. Vocabulary sharded on both sides (RowwiseParallel embedding, loss_parallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )
    from torch.distributed.tensor.placement_types import Replicate

    from shared.train import clip_coefficient, decays

    case = dict(parallel=dict(tp=2), model=dict(tie_word_embeddings=False, qk_norm=False),
                train=dict(lr=1e-4, micro_batch_size=2))
    ours_losses, ours = parallel_run(case, steps)

    mc, cfg = model_config(**case["model"]), train_config(**case["train"])
    model = build_model(mc, seed=cfg.seed)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(mc.num_hidden_layers):
        for name, style in (("self_attn.q_proj", ColwiseParallel), ("self_attn.k_proj", ColwiseParallel),
                            ("self_attn.v_proj", ColwiseParallel), ("self_attn.o_proj", RowwiseParallel),
                            ("mlp.gate_proj", ColwiseParallel), ("mlp.up_proj", ColwiseParallel),
                            ("mlp.down_proj", RowwiseParallel)):
            plan[f"model.layers.{i}.{name}"] = style()
    parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if decays(p)], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    theirs_losses = []
    for x, y in global_batches(cfg, steps):
        total = 0.0
        for xm, ym in micro_batches_of(x, y, cfg.micro_batch_size):
            with loss_parallel():
                logits = model(xm)
                loss = F.cross_entropy(logits.flatten(0, 1), ym.flatten(), reduction="sum") / y.numel()
                loss.backward()
            total += loss.full_tensor().item()
        # clip_grad_norm_ refuses a mix of DTensor and plain (replicated norm) gradients: same formula by hand
        sq = sum((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).pow(2).sum() for p in params)
        coef = clip_coefficient(sq.sqrt(), cfg.grad_clip)
        for p in params:
            p.grad.mul_(coef)
        opt.step()
        opt.zero_grad()
        theirs_losses.append(total)
    theirs = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
              for k, v in model.state_dict().items()}
    return {"ours": (ours_losses, ours), "dtensor": (theirs_losses, theirs)}


def _dtensor_peers(steps: int = 3) -> dict[bool, list[float]]:
    """The bench's DTensor peer (nano_megatron.tools.bench_peers), without and with SequenceParallel: its
    gradient norms per step (a function of every gradient of the model)."""
    from nano_megatron.tools.bench_peers import DTensorTP

    mc, cfg = model_config(tie_word_embeddings=False, qk_norm=False), train_config(micro_batch_size=2)
    out = {}
    for sp in (False, True):
        peer = DTensorTP(mc, cfg, torch.device("cpu"), sequence_parallel=sp)
        out[sp] = [peer.train_step(micro_batches_of(x, y, 2), cfg.lr).grad_norm for x, y in global_batches(cfg, steps)]
    return out


def _bad_inputs() -> dict[str, str]:
    """Each bad configuration must raise on every rank before any collective: if one rank entered a
    collective (new_group included) the next case would hang or mismatch."""
    messages = {}
    for name, (case, _) in BAD_INPUTS.items():
        try:
            make_engine(case)
        except ValueError as e:
            messages[name] = str(e)
        else:
            messages[name] = "no error"
    return messages


def _bucket_overlap() -> dict[str, int]:
    """How many dp buckets started their all-reduce from a gradient hook, i.e. during backward."""
    engine = make_engine(dict(parallel=dict(dp=2, bucket_mb=0.01), train=dict(micro_batch_size=1)))
    x, y = global_batches(engine.cfg, 1)[0]
    x, y = (local_rows(t, engine.dp_rank, 2) for t in (x, y))
    engine.forward_backward(micro_batches_of(x, y, 1))
    out = {"buckets": engine.reducer.num_buckets, "launched_by_hooks": engine.reducer.launched_by_hooks}
    engine.close()
    return out


def _two_rank_job() -> dict:
    results: dict = {"bad": _bad_inputs(), "ops": _operator_checks(), "overlap": _bucket_overlap()}
    results["train"] = {name: parallel_run(case) for name, case in TWO_RANK_CASES.items()}
    results["micro"] = {mb: parallel_grads(dict(parallel=dict(pp=2), train=dict(micro_batch_size=mb)))
                        for mb in MICRO_SIZES}
    results["dtensor"] = _dtensor_vs_ours()
    results["peers"] = _dtensor_peers()
    return results


BF16_CASE = dict(parallel=dict(tp=2, pp=2, sequence_parallel=True), train=dict(dtype="bf16"))


def _four_rank_job() -> dict:
    results: dict = {"train": {name: parallel_run(case) for name, case in FOUR_RANK_CASES.items()}}
    results["bf16"] = parallel_run(BF16_CASE)
    results["micro"] = {mb: parallel_grads(dict(parallel=dict(tp=2, pp=2, sequence_parallel=True),
                                                 train=dict(micro_batch_size=mb)))
                        for mb in MICRO_SIZES}
    return results


@pytest.fixture(scope="module")
def two_rank():
    return run_distributed(_two_rank_job, 2, timeout_s=240.0)


@pytest.fixture(scope="module")
def four_rank():
    return run_distributed(_four_rank_job, 4, timeout_s=240.0)


@pytest.fixture(scope="module")
def one_thread():
    # Tiny models on a small shared CI box: one intra-op thread is ~100x faster than two busy ones.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def references(one_thread):
    cases = {**TWO_RANK_CASES, **FOUR_RANK_CASES, "one-rank": dict(parallel=dict()), "bf16": BF16_CASE}
    return {name: reference_run(case) for name, case in cases.items()}


# --------------------------------------------------------------------------- tests
def _check_against_reference(result, reference, name):
    (losses, state), (ref_losses, ref_state) = result, reference
    assert state is not None, f"{name}: rank 0 returned no consolidated state"
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL, (name, losses, ref_losses)
    err = max_abs_diff(state, ref_state)
    assert err < TOL, f"{name}: parameters differ from the single process by {err:.2e}"


def test_one_rank_engine_equals_local_engine(references, one_thread):
    created = not dist.is_initialized()  # a 1-rank group in this process (another test's is kept)
    init_distributed()
    try:
        result = parallel_run(dict(parallel=dict()))
    finally:
        if created:
            destroy_distributed()
    _check_against_reference(result, references["one-rank"], "one-rank")


@pytest.mark.parametrize("name", list(TWO_RANK_CASES))
def test_two_ranks_equal_single_process(two_rank, references, name):
    _check_against_reference(two_rank[0]["train"][name], references[name], name)
    assert two_rank[1]["train"][name][1] is None  # only rank 0 holds the consolidated weights


@pytest.mark.parametrize("name", list(FOUR_RANK_CASES))
def test_four_ranks_equal_single_process(four_rank, references, name):
    _check_against_reference(four_rank[0]["train"][name], references[name], name)


def test_bf16_mixed_precision_stays_within_bf16_rounding(four_rank, references):
    """bf16 model + fp32 master weights against LocalEngine's same recipe: only bf16 rounding differs
    (bf16 vs fp32 LocalEngine differ by ~4e-3 on these parameters), so this is a smoke test of the
    bf16 paths (boundaries, buckets, master copies), not an exactness test."""
    (losses, state), (ref_losses, ref_state) = four_rank[0]["bf16"], references["bf16"]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 2e-3
    assert max_abs_diff(state, ref_state) < 1e-2
    assert all(t.dtype == torch.float32 for t in state.values())  # the fp32 master weights


def test_every_rank_reports_the_same_loss(two_rank, four_rank):
    for res in (two_rank, four_rank):
        for name in res[0]["train"]:
            assert all(r["train"][name][0] == res[0]["train"][name][0] for r in res), name


@pytest.mark.parametrize("world", [2, 4])
def test_gradients_do_not_depend_on_micro_batch_count(two_rank, four_rank, world):
    grads = (two_rank if world == 2 else four_rank)[0]["micro"]
    for mb in MICRO_SIZES[1:]:
        err = max_abs_diff(grads[mb], grads[MICRO_SIZES[0]])
        assert err < 1e-7, f"{4 // mb} micro-batches vs 1: gradients differ by {err:.2e}"


def test_sequence_parallel_on_and_off_agree(two_rank):
    (_, on), (_, off) = two_rank[0]["train"]["tp2-sp"], two_rank[0]["train"]["tp2"]
    assert max_abs_diff(on, off) < 1e-6


def test_operators_match_their_definitions(two_rank):
    for rank_result in two_rank:
        for name, err in rank_result["ops"].items():
            assert err < 1e-6, f"{name}: {err:.2e}"


def test_tensor_parallel_matches_torch_parallelize_module(two_rank):
    res = two_rank[0]["dtensor"]
    (ours_losses, ours), (their_losses, theirs) = res["ours"], res["dtensor"]
    assert max(abs(a - b) for a, b in zip(ours_losses, their_losses)) < 1e-6
    assert max_abs_diff(ours, theirs) < 1e-6
    initial = build_model(model_config(tie_word_embeddings=False, qk_norm=False), seed=0).state_dict()
    assert max_abs_diff(ours, dict(initial)) > 1e-4  # the 3 steps did move the weights


def test_bench_dtensor_peers_equal_the_single_process(two_rank):
    """The bench's DTensor peers compute what the model computes: their gradient norms equal LocalEngine's
    over 3 steps (clipping and AdamW in between), with and without SequenceParallel."""
    mc, cfg = model_config(tie_word_embeddings=False, qk_norm=False), train_config(micro_batch_size=2)
    engine = LocalEngine(mc, cfg)
    ref = [engine.train_step(micro_batches_of(x, y, 2), cfg.lr).grad_norm for x, y in global_batches(cfg, 3)]
    for sp, norms in two_rank[0]["peers"].items():
        assert norms == pytest.approx(ref, rel=1e-5), (sp, norms, ref)


def test_data_parallel_buckets_reduce_during_backward(two_rank):
    for rank_result in two_rank:
        overlap = rank_result["overlap"]
        assert overlap["buckets"] > 3
        # every bucket but those holding the first layers' parameters starts before backward ends;
        # the embedding's bucket is the last gradient produced, also from its hook
        assert overlap["launched_by_hooks"] == overlap["buckets"]


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_on_every_rank(two_rank, name):
    expected = BAD_INPUTS[name][1]
    for rank_result in two_rank:
        assert expected in rank_result["bad"][name], rank_result["bad"][name]


def test_bad_world_size_single_process():
    with pytest.raises(ValueError, match=r"world size 1 != tp × pp × dp = 2 × 1 × 1 = 2"):
        GridShape(tp=2).check_world_size(1)
    with pytest.raises(ValueError, match="parallel.pp must be a positive int"):
        GridShape(pp=0)


# --------------------------------------------------------------------------- a rank that dies
def _rank1_fails_mid_step() -> None:
    engine = make_engine(dict(parallel=dict(pp=2)))
    if engine.grid.rank == 1:  # the last stage raises in its 2nd forward, while stage 0 waits on it
        calls = {"n": 0}
        forward = engine._forward

        def failing_forward(x):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected failure on the last pipeline stage")
            return forward(x)

        engine._forward = failing_forward
    for x, y in global_batches(engine.cfg, 2):
        engine.train_step(micro_batches_of(x, y, 1), 1e-3)
    dist.barrier()


def test_failing_rank_stops_the_others_without_hanging():
    """Rank 1 raises in its 2nd forward while rank 0 waits on it in the pipeline: the job ends with rank 1's
    error (DistributedError naming it first), and rank 0 is stopped rather than left waiting. A rank left
    hanging would end the job at the generous deadline instead, as a TimeoutError naming the ranks that
    never finished; no wall-clock bound, which a loaded machine breaks."""
    with pytest.raises(DistributedError, match="injected failure on the last pipeline stage") as info:
        run_distributed(_rank1_fails_mid_step, 2, timeout_s=600.0)
    assert info.value.rank == 1
    assert "injected failure" not in info.value.failures.get(0, "")  # rank 0 only ever waited on rank 1


def test_engine_requires_global_batch_rows():
    # not a distributed test: the engine's own validation is plain Python
    from nano_megatron.engine import validate

    with pytest.raises(ValueError, match="num_key_value_heads"):
        validate(model_config(num_key_value_heads=1), ParallelConfig(tp=2), train_config(), 2)


__all__ = ["MegatronEngine", "local_rows"]
