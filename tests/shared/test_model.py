"""shared.model + shared.checkpoint against Hugging Face `transformers` (an implementation nobody here wrote).

Random-initialised small Llama / Qwen2 / Qwen3 models are saved with `save_pretrained`, loaded through
shared.checkpoint, and must give the same fp32 logits (max abs difference <= 1e-4); our own checkpoints must
load back in `transformers` with the same logits.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shared.checkpoint import INDEX_NAME, load_model, load_state_dict, save_checkpoint  # noqa: E402
from shared.config import ModelConfig  # noqa: E402
from shared.model import build_model, greedy_generate  # noqa: E402

ATOL = 1e-4  # fp32 end to end: differences come only from summation order

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=10000.0)

HF_CASES = {
    "llama-gqa-untied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama-mha-tied-llama3rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=4, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, num_key_value_heads=1)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF init leaves norms at 1 and biases at 0, which would hide a missing norm or bias: perturb all."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.08 * noise)


def _make_hf(tmp_path, case: str, seed: int = 0, **overrides):
    cfg_cls, model_cls, extra = HF_CASES[case]
    kwargs = {**BASE, **extra, **overrides}
    if "rope_scaling" in kwargs and transformers.__version__ >= "5":
        rs = kwargs.pop("rope_scaling")
        kwargs["rope_parameters"] = {"rope_theta": kwargs["rope_theta"], **rs}
    hf_cfg = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(hf_cfg).eval()
    _randomize(hf, seed)
    hf.save_pretrained(tmp_path / case)
    return hf, tmp_path / case


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=ids).logits


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_checkpoint_loads_with_same_logits(tmp_path, case):
    hf, path = _make_hf(tmp_path, case)
    ours = load_model(path).eval()
    assert ours.config.model_type == case.split("-")[0]
    ids = torch.randint(0, BASE["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = _hf_logits(hf, ids)
        out = ours(ids)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= ATOL


@pytest.mark.parametrize("preset_changes", [dict(), dict(qk_norm=False, tie_word_embeddings=False),
                                            dict(qk_norm=False, attention_bias=True)])
def test_our_checkpoint_loads_in_transformers(tmp_path, preset_changes):
    cfg = ModelConfig.from_name("tiny").replace(num_hidden_layers=2, **preset_changes)
    ours = build_model(cfg, seed=3).eval()
    _randomize(ours, 3)
    save_checkpoint(ours, cfg, tmp_path / "ckpt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "qwen3": "Qwen3ForCausalLM"}[cfg.model_type]
    ids = torch.randint(0, cfg.vocab_size, (2, 29), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(ids) - _hf_logits(hf, ids)).abs().max().item() <= ATOL
    # ... and round-trips through our own loader bit for bit
    again = load_model(tmp_path / "ckpt")
    for (n1, t1), (n2, t2) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2)


def test_sharded_save_writes_hf_index_and_loads(tmp_path):
    cfg = ModelConfig.from_name("tiny").replace(num_hidden_layers=2, tie_word_embeddings=False)
    ours = build_model(cfg, seed=5)
    save_checkpoint(ours, cfg, tmp_path / "c", max_shard_size=200_000)
    index = json.loads((tmp_path / "c" / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(index["weight_map"]) == set(ours.state_dict())
    again = load_model(tmp_path / "c")
    ids = torch.randint(0, cfg.vocab_size, (1, 11))
    with torch.no_grad():
        assert torch.equal(ours(ids), again(ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    with torch.no_grad():
        assert (ours(ids) - _hf_logits(hf, ids)).abs().max().item() <= ATOL


def test_greedy_generate_matches_transformers(tmp_path):
    hf, path = _make_hf(tmp_path, "qwen3-qknorm", seed=4)
    ours = load_model(path)
    prompt = [5, 17, 99, 3]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert greedy_generate(ours, prompt, 8) == ref


def test_attention_is_replaceable():
    cfg = ModelConfig.from_name("tiny").replace(num_hidden_layers=2)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    base = model(ids)
    seen = []

    def spy(q, k, v, layer_idx, ctx):
        from shared.model import sdpa_attention
        seen.append((layer_idx, ctx, tuple(q.shape), tuple(k.shape)))
        return sdpa_attention(q, k, v, layer_idx, ctx)

    model.set_attention(spy)
    assert torch.equal(model(ids, attn_ctx="step-ctx"), base)
    assert seen == [(i, "step-ctx", (2, 9, 4, 32), (2, 9, 2, 32)) for i in range(2)]


def test_meta_build_and_bf16_forward_backward():
    cfg = ModelConfig.from_name("tiny").replace(num_hidden_layers=2)
    model = build_model(cfg, dtype=torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ---------------------------------------------------------------------------------- bad inputs
def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unknown architecture"):
        load_model(tmp_path)


def test_missing_tensor(tmp_path):
    cfg = ModelConfig.from_name("tiny").replace(num_hidden_layers=1)
    sd = build_model(cfg).state_dict()
    del sd["model.layers.0.mlp.up_proj.weight"]
    save_checkpoint(sd, cfg, tmp_path)
    with pytest.raises(ValueError, match="missing tensor.*up_proj"):
        load_model(tmp_path)


def test_wrong_shape(tmp_path):
    cfg = ModelConfig.from_name("tiny").replace(num_hidden_layers=1)
    sd = build_model(cfg).state_dict()
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 128)
    save_checkpoint(sd, cfg, tmp_path)
    with pytest.raises(ValueError, match="k_proj.weight.*shape"):
        load_model(tmp_path)


def test_no_weights(tmp_path):
    cfg = ModelConfig.from_name("tiny")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_state_dict(tmp_path)


def test_bad_input_ids_shape():
    model = build_model(ModelConfig.from_name("tiny").replace(num_hidden_layers=1))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(5, dtype=torch.long))


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 64])  # both run the FlashAttention-2 kernel on CUDA
@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_cuda_bf16_model_error_within_twice_transformers_bf16_error(tmp_path, case, head_dim):
    """On CUDA the model runs the Triton kernels and FlashAttention; in bf16 its error against HF's fp32
    logits must stay within 2x the error of HF's own bf16 run, plus a small epsilon."""
    hf, path = _make_hf(tmp_path, case, head_dim=head_dim)
    ids = torch.randint(0, BASE["vocab_size"], (4, 200), generator=torch.Generator().manual_seed(7)).cuda()
    ref = _hf_logits(hf.cuda().float(), ids).double()
    hf_bf16 = _hf_logits(hf.to(torch.bfloat16), ids).double()
    ours = load_model(path, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = ours(ids).double()
    ref_err = (hf_bf16 - ref).abs().max().item()
    assert (out - ref).abs().max().item() <= 2 * ref_err + 1e-2


# ---------------------------------------------------------------------------------- attention routing
def _spy_flash(monkeypatch):
    """Wrap shared.model's FlashAttention entry so a test sees which head_dims reached the kernels."""
    import shared.model as model_mod

    seen, real = [], model_mod._flash_attn_func
    def spy(q, *args, **kwargs):
        seen.append(q.shape[-1])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(model_mod, "_flash_attn_func", spy)
    return model_mod, seen


def test_attention_routing_head_dims_follow_the_kernels(monkeypatch):
    """The kernels' set (multiples of 8 from 16 to 256) routes to FlashAttention on CUDA; on a CPU every
    head_dim, supported or not, runs torch SDPA."""
    from nano_flashattn import HEAD_DIMS

    model_mod, seen = _spy_flash(monkeypatch)
    assert tuple(model_mod._FLASH_HEAD_DIMS) == HEAD_DIMS == tuple(range(16, 257, 8))
    for d in (20, 96):
        q, k, v = (torch.randn(1, 7, 2, d) for _ in range(3))
        assert torch.equal(model_mod.default_attention(q, k, v), model_mod.sdpa_attention(q, k, v))
    assert seen == []


@pytest.mark.gpu
def test_cuda_attention_routes_every_supported_head_dim_to_flash(monkeypatch):
    """On CUDA the supported head_dims (padded ones included) run nano_flashattn, within 2x SDPA's fp16 error
    of an fp64 SDPA; a head_dim the kernels cannot tile (20, 264) falls back to SDPA on CUDA too."""
    model_mod, seen = _spy_flash(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(0)
    for d in (16, 40, 96, 128, 200, 20, 264):
        q, k, v = (torch.randn(2, 50, 4, d, device="cuda", dtype=torch.float16, generator=g)
                   for _ in range(3))
        ref = model_mod.sdpa_attention(q.double(), k.double(), v.double())
        err = (model_mod.default_attention(q, k, v).double() - ref).abs().max().item()
        sdpa_err = (model_mod.sdpa_attention(q, k, v).double() - ref).abs().max().item()
        assert err <= 2 * sdpa_err + 1e-3, (d, err, sdpa_err)  # FlashAttention's rule, fp64 oracle
    assert seen == [16, 40, 96, 128, 200]
