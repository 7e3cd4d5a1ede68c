"""Random small HF checkpoints (made with transformers, never by us) and their greedy outputs.

Every engine test compares against `transformers` `generate` (greedy, fp32) on these checkpoints: one
Llama (untied embeddings, GQA) and one Qwen3 (q/k norm, tied embeddings), 2 layers, hidden 64, head_dim
32. Norm weights are perturbed away from 1 and the init scale raised so that the argmax is decisive
(a near-tie between two logits would make "token for token" a coin flip under fp32 reordering).
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vllm_checkpoints import LAYERS, VOCAB, make_checkpoint, random_prompts  # noqa: E402,F401


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def ckpt(request):
    return request.getfixturevalue(f"{request.param}_ckpt")


@functools.cache
def _hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def _hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = _hf_model(path)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


@pytest.fixture(params=["paper_path", "layers"])
def layer_args(request):
    """Engine arguments of each configuration the engine tests run: the paper path alone
    (`performance_layers=False`), and with every layer the engine runs by default on CUDA (`LAYERS`)."""
    return {"performance_layers": False} if request.param == "paper_path" else dict(LAYERS)


@functools.cache
def _hf_logprobs(path: str, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return _hf_model(path)(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


@pytest.fixture
def hf_logprobs():
    """hf_logprobs(path, ids) -> log_softmax of transformers' logits over `ids` (fp32, CPU): row i is the
    distribution of token i + 1."""
    return lambda path, ids: _hf_logprobs(path, tuple(ids))


@pytest.fixture
def hf_greedy():
    """hf_greedy(path, prompt_ids, n) -> the n tokens transformers' greedy generate produces."""
    return lambda path, prompt, n: list(_hf_greedy(path, tuple(prompt), n))


@pytest.fixture(autouse=True)
def free_cuda_memory():
    """An engine sizes its KV cache from the GPU memory left free. Engines of earlier tests may still be
    held by reference cycles (the step timer and the layers wrap methods of the instances they serve)
    until the collector runs: collect them, so every GPU test starts with the device's memory free."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


GPU_OF_THIS_PROCESS_BYTES = 6 * 2**30


@pytest.fixture
def gpu_of_this_process(monkeypatch) -> int:
    """A GPU of GPU_OF_THIS_PROCESS_BYTES that only this process uses, as §5's KV sizing sees it:
    `torch.cuda.mem_get_info` reports this process's reserved memory as all that is in use. The GPU tests
    run in parallel processes on one card (`pytest -m gpu -n 8`), which take and give back memory at any
    moment, so a test that asserts on KV blocks sized from free memory sizes them from this (and takes no
    more than its size). Returns the size."""
    total = GPU_OF_THIS_PROCESS_BYTES

    def mem_get_info(device=None) -> tuple[int, int]:
        return total - torch.cuda.memory_reserved(device), total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return total


@pytest.fixture(autouse=True)
def no_api_key_from_the_shell(monkeypatch):
    """A NANO_VLLM_API_KEY set where the tests run would turn every server test's request into a 401."""
    monkeypatch.delenv("NANO_VLLM_API_KEY", raising=False)


@pytest.fixture(autouse=True)
def one_thread():
    """The models here are tiny: one intra-op thread is fastest, and immune to a busy CI box (OpenMP
    threads spinning against other processes slow tiny matmuls down 50x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
