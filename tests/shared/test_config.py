"""ModelConfig: HF field names, from_hf for Llama / Qwen2 / Qwen3 (transformers' own configs), presets."""

import json

import pytest

from shared.config import PRESETS, ModelConfig, resolve_model_config

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("cls,model_type", [("LlamaConfig", "llama"), ("Qwen2Config", "qwen2"),
                                            ("Qwen3Config", "qwen3")])
def test_from_hf_reads_transformers_configs(tmp_path, cls, model_type):
    hf = getattr(transformers, cls)(vocab_size=300, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                                    max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=5e5)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg.model_type == model_type
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (300, 64, 128, 3)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (8, 2, 512)
    assert cfg.head_dim == (hf.head_dim if getattr(hf, "head_dim", None) else 8)
    assert cfg.rope_theta == 5e5 and cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text())) == cfg


def test_to_hf_round_trip():
    for name, cfg in PRESETS.items():
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg, name


def test_presets():
    assert set(PRESETS) >= {"tiny", "qwen3-0.6b", "llama2-7b", "llama3-8b"}
    assert ModelConfig.from_name("qwen3-0.6b").head_dim == 128
    assert resolve_model_config("tiny") == ModelConfig.from_name("tiny")


@pytest.mark.parametrize("d,match", [
    ({"model_type": "gpt2"}, "unknown architecture"),
    ({"architectures": ["MistralForCausalLM"]}, "unknown architecture"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
])
def test_from_hf_rejects_unsupported(d, match):
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**base, **d})


def test_bad_fields():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig(hidden_size=10, num_attention_heads=4)
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig(vocab_size=0)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.from_name("gpt5")
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf("/nonexistent/dir")
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0})
