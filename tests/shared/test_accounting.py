"""The ledger's numbers against the published ones (LLaMA-2 paper, ZeRO paper, Qwen3 / Llama-3 model cards)
and the inference accounting against byte and FLOP counts worked out by hand."""

import subprocess
import sys

import pytest

from shared.accounting import (
    MBU_DATASHEET,
    MBU_MEASURED,
    MFU_DATASHEET,
    MFU_MEASURED,
    Ceilings,
    datasheet_for,
    decode_bytes,
    decode_flops,
    decode_roofline,
    flops_per_token,
    forward_flops,
    kv_cache_bytes,
    param_count,
    serving_roofline,
    training_memory,
)
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


# ------------------------------------------------------------------ inference: bytes read, FLOPs, rooflines
# llama3-8b, per layer: q 4096·4096 + k, v 4096·1024 each + o 4096·4096 = 41,943,040; MLP 3·4096·14336 =
# 176,160,768; two norms 8,192 → 218,112,000 × 32 layers + final norm 4,096 = 6,979,588,096; LM head (untied)
# 128256·4096 = 525,336,576 → 7,504,924,672 parameters read, × 2 bytes. The untied input-embedding table
# (another 525,336,576 parameters, 1.05 GB) is only gathered from. K/V per key: 2 · 32 · 8 · 128 · 2 bytes.
LLAMA3_WEIGHT_BYTES = 15_009_849_344
LLAMA3_TABLE_BYTES = 1_050_673_152
LLAMA3_KV_PER_KEY = 131_072
# qwen3-0.6b, per layer: q 1024·2048 + k, v 1024·1024 each + o 2048·1024 = 6,291,456; q/k norms 256; MLP
# 3·1024·3072 = 9,437,184; two norms 2,048 → 15,730,944 × 28 + 1,024 = 440,467,456; the tied table
# 151936·1024 = 155,582,464 is the LM head, read once → 596,049,920 parameters, × 2 bytes.
QWEN3_WEIGHT_BYTES = 1_192_099_840
QWEN3_KV_PER_KEY = 114_688  # 2 · 28 · 8 · 128 · 2


def test_llama3_8b_batch1_decode_reads_weights_one_row_and_the_kv_not_the_embedding_table():
    cfg = ModelConfig.from_name("llama3-8b")
    got = decode_bytes(cfg, 640)  # a 128-token prompt after 512 decode steps
    assert got.weights == LLAMA3_WEIGHT_BYTES
    assert got.embedding_rows == 4096 * 2
    assert got.kv == 640 * LLAMA3_KV_PER_KEY == 83_886_080
    assert got.total == 15_093_743_616
    assert 2 * param_count(cfg) - got.weights == LLAMA3_TABLE_BYTES  # what counting every parameter adds


def test_qwen3_0_6b_batch4_decode_counts_the_tied_table_once():
    cfg = ModelConfig.from_name("qwen3-0.6b")
    got = decode_bytes(cfg, [100, 200, 300, 400])
    assert got.weights == QWEN3_WEIGHT_BYTES == 2 * param_count(cfg)
    assert got.embedding_rows == 4 * 1024 * 2
    assert got.kv == 1000 * QWEN3_KV_PER_KEY
    assert got.total == 1_306_796_032
    assert decode_bytes(cfg, [100, 200, 300, 400], kv_dtype_bytes=1).kv == 1000 * QWEN3_KV_PER_KEY // 2


def test_prefill_and_decode_flops():
    qwen, llama = ModelConfig.from_name("qwen3-0.6b"), ModelConfig.from_name("llama3-8b")
    # 128-token prefill: 2 · 440,467,456 · 128 (layers) + 2 · 155,582,464 (LM head, last row only)
    # + 4 · 28 · 16 · 128 · (128 · 129 / 2) (QKᵀ and PV over the causal pairs)
    assert forward_flops(qwen, 128) == 112_759_668_736 + 311_164_928 + 1_893_728_256
    # batch-1 decode step at 640 keys: 2N + 4 · 32 · 32 · 128 · 640
    assert decode_flops(llama, 640) == 15_009_849_344 + 335_544_320
    assert decode_flops(llama, [640, 10]) == decode_flops(llama, 640) + decode_flops(llama, 10)


@pytest.mark.parametrize("prompt", [1, 7, 300])
def test_prefill_then_decode_equals_one_pass_sampling_two_rows(prompt):
    cfg = ModelConfig.from_name("qwen3-0.6b")
    one_pass = forward_flops(cfg, prompt + 1, logits=2)
    assert forward_flops(cfg, prompt) + decode_flops(cfg, prompt + 1) == one_pass


def test_decode_roofline_batch1_is_bandwidth_over_bytes():
    cfg = ModelConfig.from_name("llama3-8b")
    r = decode_roofline(cfg, 640, bandwidth=3.808e12, peak_flops=787e12)
    assert r["bound"] == "memory" and r["bytes_per_step"] == 15_093_743_616
    assert r["tokens_per_s"] == pytest.approx(3.808e12 / 15_093_743_616)  # ≈ 252.3 tok/s
    big = decode_roofline(cfg, [1] * 4096, bandwidth=3.808e12, peak_flops=787e12)
    assert big["bound"] == "compute"
    assert big["tokens_per_s"] == pytest.approx(4096 * 787e12 / decode_flops(cfg, [1] * 4096))


def test_serving_roofline_decode_time_on_a_hand_counted_workload():
    # tiny: 1,312,128 parameters (tied) → 2,624,256 bytes per step; 1024 bytes of K/V per key; hidden 128.
    # Requests (prompt 3, 2 outputs) and (prompt 5, 4 outputs): the prefill yields each first token; step 1
    # decodes both (4 and 6 keys), steps 2 and 3 only the second (7, 8 keys): 3 weight reads, 4 rows, 25 keys.
    cfg = ModelConfig.from_name("tiny")
    r = serving_roofline(cfg, [3, 5], [2, 4], 2, bandwidth=1.0, peak_flops=1e30)
    assert r["decode_bound_s"] == 3 * 2_624_256 + 4 * 128 * 2 + 25 * 1024 == 7_899_392
    assert r["decode_memory_bound_frac"] == 1.0
    assert r["prefill_bound_s"] == pytest.approx((forward_flops(cfg, 3) + forward_flops(cfg, 5)) / 1e30)
    assert r["roofline_tok_per_s"] == pytest.approx(6 / (r["prefill_bound_s"] + r["decode_bound_s"]))


def test_inference_accounting_rejects_bad_inputs():
    cfg = ModelConfig.from_name("tiny")
    for bad in (0, -3, [4, 0], [True]):
        with pytest.raises(ValueError, match="context_lens"):
            decode_bytes(cfg, bad)
    with pytest.raises(ValueError, match="dtype_bytes"):
        decode_bytes(cfg, 4, dtype_bytes=0)
    with pytest.raises(ValueError, match="new_tokens"):
        forward_flops(cfg, 0)
    with pytest.raises(ValueError, match="logits"):
        forward_flops(cfg, 2, logits=3)
    with pytest.raises(ValueError, match="bandwidth"):
        decode_roofline(cfg, 4, bandwidth=0, peak_flops=1.0)
    with pytest.raises(ValueError, match="prompt_lens and output_lens"):
        serving_roofline(cfg, [3], [2, 4], 2, 1.0, 1.0)
    with pytest.raises(ValueError, match="peak_flops"):
        serving_roofline(cfg, [3], [2], 2, 1.0, 0.0)


# ------------------------------------------------------------------ ceilings: measured and datasheet
def test_datasheet_lookup_by_device_name():
    assert datasheet_for("NVIDIA H200") == (4.8e12, 989e12)
    assert datasheet_for("NVIDIA H100 80GB HBM3") == (3.35e12, 989e12)
    assert datasheet_for("NVIDIA H100 PCIe") == (2.0e12, 756e12)
    assert datasheet_for("NVIDIA GeForce RTX 4090") is None


def test_ceilings_label_mfu_and_mbu_against_both_peaks():
    c = Ceilings("NVIDIA H200", 4.24e12, 797e12, *datasheet_for("NVIDIA H200"))
    assert c.mfu(345.1e12) == pytest.approx({MFU_MEASURED: 43.3, MFU_DATASHEET: 34.89}, abs=0.01)
    assert c.mbu(4.058e12) == pytest.approx({MBU_MEASURED: 95.71, MBU_DATASHEET: 84.54}, abs=0.01)
    d = c.as_dict()
    assert d == pytest.approx({"device": "NVIDIA H200", "copy_GBps": 4240, "read_GBps": None,
                               "matmul_TFLOPs": 797, "datasheet_GBps": 4800, "datasheet_TFLOPs": 989})
    assert c.describe() == ("ceilings on NVIDIA H200: measured copy 4.24 TB/s (read + write), matmul 797 "
                            "TFLOP/s; datasheet 4.8 TB/s, 989 TFLOP/s bf16 dense")
    cpu = Ceilings("cpu", 2.51e10, 4.3e10)  # a CPU's matmul reads in GFLOP/s, not "0.0 TFLOP/s"
    assert cpu.mfu(1e10)[MFU_DATASHEET] is None
    assert cpu.describe() == ("ceilings on cpu: measured copy 25.1 GB/s (read + write), matmul 43 GFLOP/s; "
                              "no datasheet values for this device")


def test_format_rate_keeps_three_digits_and_picks_the_prefix():
    from shared.accounting import format_rate

    assert [format_rate(v, "FLOP/s") for v in (989e12, 4.3e10, 1.234e9, 999.6e12, 12.0, None)] == [
        "989 TFLOP/s", "43 GFLOP/s", "1.23 GFLOP/s", "1 PFLOP/s", "12 FLOP/s", "n/a"]
    assert format_rate(3.35e12, "B/s") == "3.35 TB/s"


def test_ceilings_are_measured_once_per_process(monkeypatch):
    import shared.bench

    calls = []
    monkeypatch.setattr(shared.bench, "_CEILINGS", {})
    monkeypatch.setattr(shared.bench, "measure_copy_bandwidth", lambda dev: calls.append("copy") or 2e10)
    monkeypatch.setattr(shared.bench, "measure_matmul_flops", lambda dev: calls.append("mm") or 3e11)
    monkeypatch.setattr(shared.bench, "measure_read_bandwidth", lambda dev: calls.append("read") or 1.2e10)
    first = shared.bench.measure_ceilings("cpu")
    assert first is shared.bench.measure_ceilings("cpu") and calls == ["copy", "mm", "read"]
    assert (first.copy_bytes_per_s, first.matmul_flops_per_s, first.read_bytes_per_s) == (2e10, 3e11, 1.2e10)
    assert first.datasheet_flops_per_s is None
    assert first.as_dict()["read_GBps"] == 12.0 and "read-only stream 12 GB/s" in first.describe()
    # read-bound work is held to the read-only stream where it is measured
    assert first.stream_bytes_per_s == 1.2e10 and Ceilings("cpu", 2e10, 3e11).stream_bytes_per_s == 2e10
    assert shared.bench.measure_ceilings("cpu", refresh=True) is not first and len(calls) == 6


def test_ceilings_measure_through_shared_bench_on_cpu(monkeypatch):
    import shared.bench

    monkeypatch.setattr(shared.bench, "_CEILINGS", {})
    c = shared.bench.measure_ceilings("cpu")
    assert c.device == "cpu" and c.copy_bytes_per_s > 0 and c.matmul_flops_per_s > 0 and c.read_bytes_per_s > 0


def test_cli_prints_the_decode_bytes():
    out = subprocess.run([sys.executable, "-m", "shared.accounting", "llama3-8b", "--batch", "1", "--seq-len",
                          "640"], capture_output=True, text=True, check=True).stdout
    assert "decode step reads       14.06 GiB at batch 1" in out
    assert "the input-embedding table is not read" in out


def test_decode_bytes_count_what_a_quantized_model_and_cache_store():
    cfg = ModelConfig.from_name("llama3-8b")
    full = decode_bytes(cfg, [1024])
    q = decode_bytes(cfg, [1024], weight_bytes=full.weights * 0.265, kv_dtype_bytes=1)
    assert q.weights == full.weights * 0.265 and q.kv == full.kv // 2 and q.embedding_rows == full.embedding_rows
    assert decode_bytes(cfg, [1024], kv_dtype_bytes=0.375).kv == round(full.kv * 0.375 / 2)
    with pytest.raises(ValueError, match="weight_bytes"):
        decode_bytes(cfg, [8], weight_bytes=0)
