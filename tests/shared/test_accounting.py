"""The ledger's numbers against the published ones (LLaMA-2 paper, ZeRO paper, Qwen3 / Llama-3 model cards)."""

import subprocess
import sys

import pytest

from shared.accounting import flops_per_token, kv_cache_bytes, param_count, training_memory
from shared.config import ModelConfig
from shared.model import build_model


def test_llama2_7b_has_6_7b_parameters():
    assert param_count(ModelConfig.from_name("llama2-7b")) == 6_738_415_616  # ≈ 6.7B (LLaMA-2 Table 1)


@pytest.mark.parametrize("name,expected", [("qwen3-0.6b", 596_049_920), ("llama3-8b", 8_030_261_248)])
def test_published_parameter_counts(name, expected):
    assert param_count(ModelConfig.from_name(name)) == expected


@pytest.mark.parametrize("changes", [dict(), dict(tie_word_embeddings=False, qk_norm=False),
                                     dict(qk_norm=False, attention_bias=True)])
def test_param_count_matches_the_model(changes):
    cfg = ModelConfig.from_name("tiny").replace(**changes)
    assert param_count(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


def test_llama2_7b_kv_cache_4096_tokens_batch_16_fp16_is_32_gib():
    assert kv_cache_bytes(ModelConfig.from_name("llama2-7b"), 4096, 16, dtype_bytes=2) == 32 * 2**30


def test_adamw_mixed_precision_is_16_bytes_per_param_12_of_them_optimizer_state():
    m = training_memory(1_000_000, zero_stage=0, dp=1)
    assert m.bytes_per_param == 16
    assert (m.master_weights + m.optimizer_states) / m.num_params == 12


@pytest.mark.parametrize("stage,formula", [(0, lambda n: 16), (1, lambda n: 4 + 12 / n),
                                           (2, lambda n: 2 + 14 / n), (3, lambda n: 16 / n)])
@pytest.mark.parametrize("dp", [1, 8, 64])
def test_zero_stage_formulas(stage, formula, dp):
    assert training_memory(7_500_000_000, stage, dp).bytes_per_param == pytest.approx(formula(dp))


def test_zero_paper_figure1_example():
    # ZeRO Figure 1: Ψ = 7.5B, N = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
    got = [training_memory(7_500_000_000, s, 64).total / 1e9 for s in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.05)


def test_flops_per_token_formula():
    cfg = ModelConfig.from_name("llama2-7b")
    n = param_count(cfg) - cfg.vocab_size * cfg.hidden_size  # the input embedding is a lookup
    assert flops_per_token(cfg, 4096) == 6 * n + 12 * 32 * 4096 * 4096


def test_bad_arguments():
    with pytest.raises(ValueError, match="zero_stage"):
        training_memory(10, zero_stage=4)
    with pytest.raises(ValueError, match="dp"):
        training_memory(10, dp=0)
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(ModelConfig.from_name("tiny"), 0)


def test_cli_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "shared.accounting", "llama2-7b"], capture_output=True,
                         text=True, check=True).stdout
    assert "6,738,415,616" in out and "32.00 GiB" in out and "16.00" in out
