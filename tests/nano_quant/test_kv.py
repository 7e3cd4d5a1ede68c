"""nano_quant.kv: KIVI's 2/4-bit KV cache and the FP8 KV cache against the papers' equations.

The references here are written from KIVI (arXiv 2402.02750) §3 directly, group by group in plain loops,
without kv.py's helpers: per group `scale = (max - min) / (2^b - 1)` and `zero = min`, both stored in
fp16, `code = clamp(round((x - zero) / scale), 0, 2^b - 1)`, read back as `code * scale + zero`; keys
grouped along tokens within a channel, values along channels within a token; codes packed into int32
words with code i at bits [b·i, b·i + b) (the test's own packer works on Python ints).
"""

from __future__ import annotations

import pytest
import torch

from nano_quant.kv import (
    KEY_AXIS,
    VALUE_AXIS,
    KIVICache,
    KVCacheSpec,
    dequantize,
    dequantize_fp8,
    fp8_scale,
    kv_bytes_per_token,
    pack,
    parse_kv_cache_dtype,
    quantize,
    quantize_fp8,
    unpack,
)


# ----------------------------------------------------------------------------- the independent reference
def ref_group(x: torch.Tensor, bits: int) -> tuple[list[int], float, float, torch.Tensor]:
    """One group (1-D): its codes, fp16 scale and zero (as floats) and its dequantized values (fp32)."""
    qmax = 2**bits - 1
    scale = torch.tensor(float(x.max() - x.min()) / qmax).half().float()
    zero = x.min().half().float()
    codes = [min(max(int(torch.round((xi - zero) / scale)), 0), qmax) for xi in x.float()]
    return codes, float(scale), float(zero), torch.tensor(codes).float() * scale + zero


def ref_pack(codes: list[int], bits: int) -> list[int]:
    """Python-int packing: code i of each word at bits [b·i, b·i + b), read back as a signed int32."""
    per = 32 // bits
    words = []
    for w in range(len(codes) // per):
        word = sum(c << (bits * i) for i, c in enumerate(codes[w * per:(w + 1) * per]))
        words.append(word - 2**32 if word >= 2**31 else word)
    return words


def ref_keys(k: torch.Tensor, bits: int, G: int):
    """Per channel: for each head h, channel d and run of G tokens, one group. Returns the dequantized
    keys, the codes (T, H, D), scale and zero (T / G, H, D) and the packed words (T / (32 / b), H, D)."""
    T, H, D = k.shape
    out, codes = torch.empty(T, H, D), torch.empty(T, H, D, dtype=torch.long)
    scale, zero = torch.empty(T // G, H, D), torch.empty(T // G, H, D)
    words = torch.empty(T // (32 // bits), H, D, dtype=torch.int32)
    for h in range(H):
        for d in range(D):
            for g in range(T // G):
                c, s, z, deq = ref_group(k[g * G:(g + 1) * G, h, d], bits)
                codes[g * G:(g + 1) * G, h, d], out[g * G:(g + 1) * G, h, d] = torch.tensor(c), deq
                scale[g, h, d], zero[g, h, d] = s, z
            words[:, h, d] = torch.tensor(ref_pack(codes[:, h, d].tolist(), bits), dtype=torch.int32)
    return out, codes, scale, zero, words


def ref_values(v: torch.Tensor, bits: int, G: int):
    """Per token: for each token t, head h and run of G channels, one group (shapes as `ref_keys`, with
    scale and zero (T, H, D / G) and words (T, H, D / (32 / b)))."""
    T, H, D = v.shape
    out, codes = torch.empty(T, H, D), torch.empty(T, H, D, dtype=torch.long)
    scale, zero = torch.empty(T, H, D // G), torch.empty(T, H, D // G)
    words = torch.empty(T, H, D // (32 // bits), dtype=torch.int32)
    for t in range(T):
        for h in range(H):
            for g in range(D // G):
                c, s, z, deq = ref_group(v[t, h, g * G:(g + 1) * G], bits)
                codes[t, h, g * G:(g + 1) * G], out[t, h, g * G:(g + 1) * G] = torch.tensor(c), deq
                scale[t, h, g], zero[t, h, g] = s, z
            words[t, h] = torch.tensor(ref_pack(codes[t, h].tolist(), bits), dtype=torch.int32)
    return out, codes, scale, zero, words


def half_step_bound(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, G: int, dim: int):
    """Each element's bound: half its group's step, plus what storing the group's min in fp16 moved the
    zero point (|min - fp16(min)|, half an fp16 ulp), plus fp32 slack."""
    group_min = x.float().movedim(dim, -1).unflatten(-1, (-1, G)).amin(-1).movedim(-1, dim)
    moved = (group_min - zero).abs()
    per_group = scale / 2 + moved + 1e-6 * (1 + zero.abs())
    return per_group.repeat_interleave(G, dim)


def data(T: int, H: int, D: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, D, generator=g) * 2 + torch.randn(1, H, D, generator=g)  # channel offsets


# ----------------------------------------------------------------------------- quantize / dequantize
@pytest.mark.parametrize("bits", [2, 4])
def test_keys_per_channel_equal_the_reference_within_half_a_step(bits):
    k, G = data(64, 2, 8), 32
    want, codes, scale, zero, words = ref_keys(k, bits, G)
    got_words, got_scale, got_zero = quantize(k, bits, G, KEY_AXIS)
    assert got_scale.dtype == got_zero.dtype == torch.float16 and got_words.dtype == torch.int32
    assert torch.equal(unpack(got_words, bits, KEY_AXIS).long(), codes)
    assert torch.equal(got_words, words)  # codes, their grouping and the packing, bit for bit
    assert torch.equal(got_scale.float(), scale) and torch.equal(got_zero.float(), zero)
    got = dequantize(got_words, got_scale, got_zero, bits, G, KEY_AXIS)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert ((got - k).abs() <= half_step_bound(k, scale, zero, G, 0)).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_values_per_token_equal_the_reference_within_half_a_step(bits):
    v, G = data(5, 2, 64, seed=1), 32
    want, codes, scale, zero, words = ref_values(v, bits, G)
    got_words, got_scale, got_zero = quantize(v, bits, G, VALUE_AXIS)
    assert torch.equal(unpack(got_words, bits, VALUE_AXIS).long(), codes)
    assert torch.equal(got_words, words)
    assert torch.equal(got_scale.float(), scale) and torch.equal(got_zero.float(), zero)
    got = dequantize(got_words, got_scale, got_zero, bits, G, VALUE_AXIS)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert ((got - v).abs() <= half_step_bound(v, scale, zero, G, -1)).all()


def test_a_constant_group_comes_back_exactly():
    x = torch.full((32, 1, 4), 0.75)
    x[:, 0, 1] = -3.0
    words, scale, zero = quantize(x, 2, 32, KEY_AXIS)
    assert torch.equal(unpack(words, 2, KEY_AXIS), torch.zeros(32, 1, 4, dtype=torch.uint8))
    assert torch.equal(dequantize(words, scale, zero, 2, 32, KEY_AXIS), x)


def test_an_outlier_channel_stays_in_its_key_groups_and_an_outlier_token_in_its_value_groups():
    """Swapping the axes (keys per token, values per channel) fails here: the outlier's range would set
    the step of every group it shares."""
    x = data(64, 1, 64, seed=2) * 0.1
    k, v = x.clone(), x.clone()
    k[:, 0, 5] *= 200  # an outlier key channel (KIVI §3.2)
    v[7] *= 200  # an outlier value token
    kk, sk, zk = quantize(k, 2, 32, KEY_AXIS)
    vv, sv, zv = quantize(v, 2, 32, VALUE_AXIS)
    assert sk.shape == (2, 1, 64) and sv.shape == (64, 1, 2)  # (T / G, H, D) and (T, H, D / G)
    k_err = (dequantize(kk, sk, zk, 2, 32, KEY_AXIS) - k).abs()
    v_err = (dequantize(vv, sv, zv, 2, 32, VALUE_AXIS) - v).abs()
    plain = x.abs().max()  # the largest ordinary value: a half step of its own groups is below it
    assert k_err[:, :, torch.arange(64) != 5].max() < plain / 2
    assert v_err[torch.arange(64) != 7].max() < plain / 2
    assert k_err[:, :, 5].max() > plain and v_err[7].max() > plain  # the outliers pay their own step


@pytest.mark.parametrize("bits", [2, 4])
def test_per_channel_keys_beat_per_token_keys_with_outlier_channels(bits):
    """KIVI §3.2: a few key channels hold large values, token after token; grouping along tokens
    within a channel (per channel) leaves each its own small range, grouping along channels within a
    token (per token) puts their magnitude into the range of every channel beside them. On this data
    per channel is ~20x better at 2 and 4 bits."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(256, 2, 128, generator=g)
    outliers = [3, 40, 77, 100]
    k[:, :, outliers] = k[:, :, outliers] * 2 + torch.tensor([15.0, -12.0, 20.0, -18.0])
    per_channel = dequantize(*quantize(k, bits, 32, 0), bits, 32, 0)
    per_token = dequantize(*quantize(k, bits, 32, -1), bits, 32, -1)
    mse_channel, mse_token = ((per_channel - k) ** 2).mean(), ((per_token - k) ** 2).mean()
    assert mse_channel < mse_token / 5, (float(mse_channel), float(mse_token))


# ----------------------------------------------------------------------------- packing
def test_packing_order_hand_written_words():
    two_bit = torch.tensor([[1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3]], dtype=torch.uint8)
    # 1 | 2 << 2 | 3 << 4 | 3 << 30 = 0xC0000039, an int32 with its sign bit set
    assert pack(two_bit, 2).tolist() == [[0xC0000039 - 2**32]]
    four_bit = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 15, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    assert pack(four_bit, 4).tolist() == [[0x87654321 - 2**32, 0x0000000F]]
    assert torch.equal(unpack(pack(two_bit, 2), 2), two_bit)
    assert torch.equal(unpack(pack(four_bit, 4), 4), four_bit)
    # along dim 0 (keys: a word holds 16 consecutive tokens of one channel)
    column = two_bit.T.contiguous()  # (16, 1)
    assert pack(column, 2, dim=0).tolist() == [[0xC0000039 - 2**32]]
    assert torch.equal(unpack(pack(column, 2, dim=0), 2, dim=0), column)


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_round_trip_on_every_axis(bits):
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 2**bits, (32, 3, 64), generator=g, dtype=torch.uint8)
    for dim in (0, -1):
        words = pack(codes, bits, dim)
        assert words.dtype == torch.int32 and words.shape[dim] == codes.shape[dim] * bits // 32
        assert torch.equal(unpack(words, bits, dim), codes)


# ----------------------------------------------------------------------------- the residual window
def filled(spec: KVCacheSpec, k: torch.Tensor, v: torch.Tensor, prompt: int) -> KIVICache:
    """Algorithm 1: a prefill of `prompt` tokens, then the rest decoded one token at a time."""
    cache = KIVICache(spec)
    cache.append(k[:prompt], v[:prompt])
    for t in range(prompt, len(k)):
        cache.append(k[t:t + 1], v[t:t + 1])
    return cache


@pytest.mark.parametrize("n", [127, 128, 159, 160, 191, 192, 300])
def test_residual_window_boundary(n):
    """G = 32, R = 128: at R + G - 1 tokens no key is quantized yet (31 have left the window, not a whole
    group) and 31 values are; at R + G the first key group and 32 values are. The newest R tokens are
    always exact, keys R to R + G - 1 of them."""
    spec = parse_kv_cache_dtype("kivi2", block_size=32)
    assert (spec.group_size, spec.residual) == (32, 128)
    k, v = data(n, 2, 64, seed=5), data(n, 2, 64, seed=6)
    quantized_keys = max(n - 128, 0) // 32 * 32
    quantized_values = max(n - 128, 0)
    for prompt in {n, 1, min(n, 140)}:  # all at once, token by token, and a prefill then decoding
        cache = filled(spec, k, v, prompt)
        assert sum(w.shape[0] * 16 for w, _, _ in cache.key_groups) == quantized_keys
        assert sum(w.shape[0] for w, _, _ in cache.value_groups) == quantized_values
        assert len(cache.key_residual) == n - quantized_keys and len(cache.value_residual) == min(n, 128)
        K, V = cache.dequantize()
        assert torch.equal(K[quantized_keys:], k[quantized_keys:])
        assert torch.equal(V[quantized_values:], v[quantized_values:])
        if quantized_keys:
            torch.testing.assert_close(K[:quantized_keys], ref_keys(k[:quantized_keys], 2, 32)[0],
                                       rtol=0, atol=1e-6)
        if quantized_values:
            torch.testing.assert_close(V[:quantized_values], ref_values(v[:quantized_values], 2, 32)[0],
                                       rtol=0, atol=1e-6)
    if n == 159:
        assert quantized_keys == 0 and quantized_values == 31
    if n == 160:
        assert quantized_keys == 32 and quantized_values == 32


@pytest.mark.parametrize("name,bits", [("kivi2", 2), ("kivi4", 4)])
def test_groups_that_fill_exactly(name, bits):
    """R + 2G tokens: two whole key groups leave, the window is exactly R; with R = 0 every token is
    quantized and the window is empty."""
    spec = parse_kv_cache_dtype(name, block_size=64, group_size=16, residual=32)
    k, v = data(64, 1, 32, seed=7), data(64, 1, 32, seed=8)
    cache = filled(spec, k, v, 64)
    assert len(cache.key_residual) == len(cache.value_residual) == 32
    assert [w.shape[0] for w, _, _ in cache.key_groups] == [32 * bits // 32]  # 32 tokens in one flush
    K, V = cache.dequantize()
    torch.testing.assert_close(K[:32], ref_keys(k[:32], bits, 16)[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(V[:32], ref_values(v[:32], bits, 16)[0], rtol=0, atol=1e-6)
    assert torch.equal(K[32:], k[32:]) and torch.equal(V[32:], v[32:])

    none_kept = KIVICache(parse_kv_cache_dtype(name, group_size=16, residual=0))
    none_kept.append(k[:16], v[:16])
    assert len(none_kept.key_residual) == len(none_kept.value_residual) == 0
    K, V = none_kept.dequantize()
    torch.testing.assert_close(K, ref_keys(k[:16], bits, 16)[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(V, ref_values(v[:16], bits, 16)[0], rtol=0, atol=1e-6)


def test_bf16_cache_keeps_the_window_exact_and_reads_bf16():
    spec = parse_kv_cache_dtype("kivi2")
    k, v = data(200, 2, 64, seed=9).bfloat16(), data(200, 2, 64, seed=10).bfloat16()
    cache = filled(spec, k, v, 150)
    K, V = cache.dequantize()
    assert K.dtype == V.dtype == torch.bfloat16 and K.shape == V.shape == k.shape
    assert torch.equal(K[-128:], k[-128:]) and torch.equal(V[-128:], v[-128:])
    want = ref_keys(k[:64].float(), 2, 32)[0].bfloat16()
    assert torch.equal(K[:64], want)


# ----------------------------------------------------------------------------- FP8
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_equals_torchs_own_cast_with_the_scale(per_head):
    x = data(40, 4, 64, seed=11)
    x[:, 2] *= 30  # a head of large values: per head, the others keep a smaller scale
    scale = fp8_scale(x, per_head=per_head)
    amax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax()
    torch.testing.assert_close(scale.flatten(), (amax / 448).flatten(), rtol=1e-6, atol=0)
    s = scale.reshape(1, 4, 1) if per_head else scale
    q = quantize_fp8(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    want_q = (x / s).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    back = dequantize_fp8(q, scale, torch.float32)
    torch.testing.assert_close(back, want_q.float() * s, rtol=0, atol=0)
    normal = (x / s).abs() >= 2**-6  # E4M3's normal range: 3 mantissa bits, half an ulp is 2^-4
    assert ((back - x).abs()[normal] <= 2**-4 * x.abs()[normal] + 1e-7).all()


def test_fp8_clamps_instead_of_overflowing_to_nan():
    x = torch.tensor([1000.0, -1000.0, 1.0])
    q = quantize_fp8(x, torch.tensor(1.0))
    assert q.float().tolist() == [448.0, -448.0, 1.0]


# ----------------------------------------------------------------------------- names and bytes
def test_parse_kv_cache_dtype_specs():
    assert parse_kv_cache_dtype("auto") == KVCacheSpec("auto", 16, 0, 0)
    assert parse_kv_cache_dtype("fp8", block_size=16) == KVCacheSpec("fp8", 8, 0, 0)
    assert parse_kv_cache_dtype("kivi2") == KVCacheSpec("kivi2", 2, 32, 128)
    assert parse_kv_cache_dtype("kivi4", block_size=16, group_size=8, residual=64) == (
        KVCacheSpec("kivi4", 4, 8, 64))


def test_bytes_per_token_arithmetic():
    """llama3-8b's cache shape: 32 layers, 8 KV heads of 128. Per token, head and layer, K and V:
    16 bits 2·256 B; FP8 2·128 B; KIVI-2 (G = 32) 2·(128·2/8 codes + 128·4/32 scale+zero) = 2·(32 + 16) B;
    KIVI-4 2·(64 + 16) B."""
    shape = dict(num_layers=32, num_kv_heads=8, head_dim=128)
    per_vector = {"auto": 256, "fp8": 128, "kivi2": 32 + 16, "kivi4": 64 + 16}
    for name, nbytes in per_vector.items():
        assert kv_bytes_per_token(parse_kv_cache_dtype(name), **shape) == 2 * 32 * 8 * nbytes
    auto = kv_bytes_per_token(parse_kv_cache_dtype("auto"), **shape)
    assert auto == 131072  # 128 KiB
    assert auto / kv_bytes_per_token(parse_kv_cache_dtype("kivi2"), **shape) == pytest.approx(16 / 3)
    # G = 128 halves nothing but the scales: 2·(32 + 4) B
    assert kv_bytes_per_token(parse_kv_cache_dtype("kivi2", group_size=128), 1, 1, 128) == 72
    # head_dim 64 (llama-100m): 2·(16 + 8) B for KIVI-2
    assert kv_bytes_per_token(parse_kv_cache_dtype("kivi2"), 1, 1, 64) == 48


@pytest.mark.parametrize("kwargs,argument", [
    (dict(value="int3"), "kv_cache_dtype"),
    (dict(value="FP8"), "kv_cache_dtype"),
    (dict(value=None), "kv_cache_dtype"),
    (dict(value=8), "kv_cache_dtype"),
    (dict(value="kivi2", block_size=16), "block_size"),  # G = 32 does not divide a 16-token block
    (dict(value="kivi2", block_size=48, group_size=32), "block_size"),
    (dict(value="kivi2", group_size=24), "group_size"),  # not whole int32 words of 2-bit codes
    (dict(value="kivi4", group_size=4), "group_size"),
    (dict(value="kivi2", group_size=0), "group_size"),
    (dict(value="kivi2", group_size=32.0), "group_size"),
    (dict(value="kivi2", residual=-1), "residual"),
])
def test_parse_kv_cache_dtype_rejects_bad_input(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        parse_kv_cache_dtype(**kwargs)


def test_kivi_cache_rejects_bad_input():
    with pytest.raises(ValueError, match="spec"):
        KIVICache(parse_kv_cache_dtype("fp8"))
    cache = KIVICache(parse_kv_cache_dtype("kivi2"))
    with pytest.raises(ValueError, match="k, v"):
        cache.append(torch.zeros(4, 64), torch.zeros(4, 64))  # no head axis
    with pytest.raises(ValueError, match="k, v"):
        cache.append(torch.zeros(4, 2, 64), torch.zeros(4, 2, 32))  # K and V differ
    with pytest.raises(ValueError, match="k, v"):
        cache.append(torch.zeros(4, 2, 48), torch.zeros(4, 2, 48))  # head_dim not a multiple of G


def test_an_empty_cache_says_so():
    from nano_quant.kv import KIVICache, parse_kv_cache_dtype

    with pytest.raises(ValueError, match="empty"):
        KIVICache(parse_kv_cache_dtype("kivi2")).dequantize()
