"""Quantized models through nano_vllm on a CUDA GPU (marker `gpu`; run by hand:
`pytest tests/nano_vllm/test_gpu_quantized.py -m gpu`): nano_quant's Triton kernels inside captured CUDA
graphs give the eager steps' tokens, and the memory quantized weights free goes to KV blocks.

Graphs and eager steps run the same kernels on the same row counts only when every decode step has a
captured batch size (1, 2, 4, 8, 16, ...): the four requests here decode together from the first token to
the last, so each replay is bit for bit the eager step it stands for.
"""

from __future__ import annotations

import gc

import pytest
import torch
from quant_checkpoints import save_ours

from nano_vllm import LLM, SamplingParams
from nano_vllm.bench.step_timing import StepTimer
from nano_vllm.kv_cache import weight_bytes

pytestmark = pytest.mark.gpu
PROMPTS = [[17, 400, 9, 2211, 5], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], list(range(100, 123)), [7] * 40]
ENGINE = {"device": "cuda", "max_model_len": 128, "num_kv_blocks": 256, "max_num_seqs": 8}
# nano_vllm's layers off but its decode graphs (what the graphed-vs-eager comparison needs); {} is the
# default, every layer.
GRAPHS_ONLY = {"async_scheduling": False, "fused_projections": False, "fused_sampling": False,
               "gemv_max_tokens": 0, "mixed_cudagraph_sizes": ()}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized_gpu")
    return {m: save_ours(root / m, m) for m in ("awq", "smoothquant", "smoothquant-fp8")}


def run(path, eager: bool, layers: dict) -> tuple[list[list[int]], StepTimer]:
    llm = LLM(str(path), enforce_eager=eager, **ENGINE, **layers).engine
    timer = StepTimer(llm)
    for i, p in enumerate(PROMPTS):
        llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), request_id=str(i))
    outs: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for seq in llm.step()[1]:
            outs[seq.request_id] = seq.output_token_ids
    timer.remove()
    return [outs[str(i)] for i in range(len(PROMPTS))], timer


@pytest.mark.parametrize("layers", [GRAPHS_ONLY, {}], ids=["graphs_only", "layers"])
@pytest.mark.parametrize("method", ["awq", "smoothquant", "smoothquant-fp8"])
def test_cuda_graphs_equal_eager_steps(ckpts, method, layers):
    graphed, timer = run(ckpts[method], eager=False, layers=layers)
    eager, eager_timer = run(ckpts[method], eager=True, layers=layers)
    assert graphed == eager and all(len(o) == 24 for o in graphed)
    assert timer.num_eager_steps < timer.num_steps // 2  # the decode steps replayed graphs
    assert eager_timer.num_eager_steps == eager_timer.num_steps


@pytest.mark.parametrize("method", ["rtn-w4", "naive-w8a8", "naive-fp8"])
def test_quantized_weights_leave_their_memory_to_kv_blocks(method, gpu_of_this_process):
    """§5's sizing on the qwen3-0.6b shape: the bytes the quantized weights no longer take come back as KV
    blocks (less what the quantized layers' temporaries add to the profiled peak). Both engines are sized
    on a card only this process uses (`gpu_of_this_process`), so memory other processes take or give back
    between the two sizings cannot count as the weights'."""
    sizes = {}
    for quantization in (None, method):
        llm = LLM("qwen3-0.6b", device="cuda", gpu_memory_utilization=0.9, max_model_len=256, max_num_seqs=16,
                  max_num_batched_tokens=2048, enforce_eager=True, quantization=quantization)
        r = llm.engine.model_runner
        sizes[quantization] = (weight_bytes(r.model), r.num_blocks, r.block_bytes)
        del llm, r
        gc.collect()
        torch.cuda.empty_cache()
    (w16, blocks16, block_bytes), (wq, blocksq, _) = sizes[None], sizes[method]
    assert blocks16 * block_bytes < 0.9 * gpu_of_this_process - w16  # sized from this process's card
    assert wq < 0.75 * w16
    freed_blocks = (w16 - wq) / block_bytes
    assert blocksq - blocks16 >= 0.75 * freed_blocks, (sizes, freed_blocks)
