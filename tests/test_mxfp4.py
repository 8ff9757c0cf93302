"""MXFP4 decode against hand-written bytes, the OCP encode rule, round trips, and refusals (spec section 6)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from kimi.mxfp4 import ZERO_GROUP_SCALE_BYTE, dequantize_mxfp4, quantize_mxfp4


def _pack(codes: list[list[int]]) -> torch.Tensor:
    """Hand packing: low nibble = even element, high nibble = odd element."""
    out = [[(row[2 * j] & 0xF) | ((row[2 * j + 1] & 0xF) << 4) for j in range(len(row) // 2)] for row in codes]
    return torch.tensor(out, dtype=torch.uint8)


def test_decode_hand_computed_bytes():
    # Two rows of 64 columns = two groups per row. Bytes written by hand.
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    packed[0, 0] = 0x21  # col 0: code 1 (+0.5, low nibble, even), col 1: code 2 (+1.0)
    packed[0, 1] = 0xF9  # col 2: code 9 (-0.5), col 3: code 15 (-6)
    packed[0, 16] = 0x7B  # col 32 (group 1): code 11 (-1.5), col 33: code 7 (+6)
    packed[1, 5] = 0x5C  # col 10: code 12 (-2), col 11: code 5 (+3)
    packed[1, 31] = 0xE6  # col 62: code 6 (+4), col 63: code 14 (-4)
    scale = torch.tensor([[128, 125], [127, 0]], dtype=torch.uint8)  # 2^1, 2^-2, 2^0, 2^-127
    expect = torch.zeros(2, 64, dtype=torch.float64)
    expect[0, 0], expect[0, 1], expect[0, 2], expect[0, 3] = 0.5 * 2, 1.0 * 2, -0.5 * 2, -6.0 * 2
    expect[0, 32], expect[0, 33] = -1.5 / 4, 6.0 / 4
    expect[1, 10], expect[1, 11] = -2.0, 3.0
    expect[1, 62], expect[1, 63] = 4.0 * 2.0**-127, -4.0 * 2.0**-127
    for dt in (torch.bfloat16, torch.float32, torch.float64):
        out = dequantize_mxfp4(packed, scale, dtype=dt)
        assert out.dtype == dt and out.shape == (2, 64)
        assert torch.equal(out.to(torch.float64), expect), dt


def test_decode_every_code_and_scale_exact():
    codes = list(range(16)) * 2  # 32 columns = one group, every code twice
    packed = _pack([codes] * 255)
    scale = torch.arange(255, dtype=torch.uint8).reshape(255, 1)
    table = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    vals = [(-1 if c & 8 else 1) * table[c & 7] for c in codes]
    out = dequantize_mxfp4(packed[:250], scale[:250], dtype=torch.bfloat16)  # 250..254 * 6 overflow bf16
    for b in (0, 1, 100, 127, 200, 249):
        assert out[b].to(torch.float64).tolist() == [v * 2.0 ** (b - 127) for v in vals]


def test_scale_255_refused():
    packed = torch.randint(0, 256, (3, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    scale = torch.tensor([[127], [255], [3]], dtype=torch.uint8)
    with pytest.raises(ValueError, match="255"):
        dequantize_mxfp4(packed, scale)


def test_overflow_refused():
    packed = torch.full((1, 16), 0x77, dtype=torch.uint8)  # code 7 = 6
    with pytest.raises(ValueError, match="overflow"):
        dequantize_mxfp4(packed, torch.tensor([[254]], dtype=torch.uint8))


@pytest.mark.parametrize(
    "packed, scale, match",
    [
        (torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8), "uint8"),
        (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.float32), "uint8"),
        (torch.zeros(16, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), "2-D"),
        (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), r"expected \[2, 1\]"),
        (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8), r"expected \[2, 1\]"),
        (torch.zeros(2, 10, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), "multiple of group_size"),
    ],
    ids=["packed-int8", "scale-float", "1d", "scale-cols", "scale-rows", "ragged-group"],
)
def test_decode_shape_dtype_errors(packed, scale, match):
    with pytest.raises(ValueError, match=match):
        dequantize_mxfp4(packed, scale)


def test_quantize_rule_ties_and_saturation():
    # amax 7.9 -> floor(log2) = 2 -> e = 0 -> scale byte 127; elements x / 1 rounded, ties to even, clamp at 6.
    x = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 7.9, -0.1, 0.3, -2.9, 6.0, 0.0, 1.0, -0.75]
    x = x + [0.0] * 16
    p, s = quantize_mxfp4(torch.tensor([x], dtype=torch.float32))
    assert s.tolist() == [[127]]
    got = dequantize_mxfp4(p, s, dtype=torch.float64)[0, :16].tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0, 0.0, 0.5, -3.0, 6.0, 0.0, 1.0, -1.0]
    assert p[0, 4].item() >> 4 == 0, "-0.1 (odd column 9, high nibble) rounds to +0 (code 0), never -0 (code 8)"


def test_quantize_shared_exponent():
    g = torch.Generator().manual_seed(1)
    for k in (-130, -100, -3, 0, 5, 100):
        w = (torch.rand(1, 32, generator=g, dtype=torch.float64) + 0.1) * 2.0**k
        amax = w.abs().max().item()
        e = math.floor(math.log2(amax)) - 2
        _, s = quantize_mxfp4(w)
        assert s.item() == max(0, e + 127), k


def test_zero_group_scale_byte():
    w = torch.zeros(2, 64)
    w[1, 40] = 3.0
    p, s = quantize_mxfp4(w)
    assert s.tolist() == [[ZERO_GROUP_SCALE_BYTE] * 2, [ZERO_GROUP_SCALE_BYTE, 126]]
    assert p.sum().item() == p[1, 20].item()


def _wide_random(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Normal values with per-row magnitudes from 2^-140 to 2^120, some zero groups, sign mix."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    w *= torch.pow(2.0, torch.randint(-140, 120, (rows, 1), generator=g).double())
    w[::7, :32] = 0.0
    w[::5, 1::3] *= 1e-3  # large spread inside a group: many codes round to 0
    return w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, cols", [(1, 32), (7, 96), (64, 256)])
def test_canonical_round_trip_bytes(dtype, rows, cols):
    w = _wide_random(rows, cols, seed=rows * cols).to(dtype)
    p, s = quantize_mxfp4(w)
    assert p.shape == (rows, cols // 2) and s.shape == (rows, cols // 32) and p.dtype == s.dtype == torch.uint8
    d = dequantize_mxfp4(p, s, dtype=dtype)
    p2, s2 = quantize_mxfp4(d)
    assert torch.equal(p2, p) and torch.equal(s2, s)
    # error bound of the OCP rule: half the top grid step (4 -> 6) is 2^e, saturation of x/2^e in [6, 8) < 2 * 2^e
    step = torch.pow(2.0, s.double() - 127).repeat_interleave(32, dim=1)
    assert bool(((d.double() - w.double()).abs() < 2 * step).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_narrow_inputs_encode_as_their_float64_values(dtype):
    """Inputs of up to 32 bits are encoded in float32, wider ones in float64: the same bytes for the same values,
    at every midpoint tie (both signs), at subnormals and at values far below their group's scale."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=torch.float64)
    ties = torch.cat([mids.repeat_interleave(4), -mids.repeat_interleave(4)]).reshape(2, 32)  # amax 6: e = 0
    w = _wide_random(64, 256, seed=3)
    if dtype == torch.float16:  # in range and above fp16's smallest subnormal (2^-24)
        w = w / w.abs().amax(dim=1, keepdim=True) * 2.0 ** torch.randint(-10, 15, (64, 1)).double()
    else:
        w[0, :32] = 2.0**-140  # an fp32 subnormal group (in bf16, whose smallest subnormal is 2^-133: zeros)
        w[0, 32:64] = torch.linspace(-(2.0**-126), 2.0**-126, 32)
    w[1:3, :32] = ties
    small, big = (2.0**-12, 2.0**14) if dtype == torch.float16 else (2.0**-30, 2.0**20)
    w[3, :32] = torch.linspace(-1.0, 1.0, 32) * small
    w[3, 0] = big  # the others fall far below the group's scale: code 0, never -0
    narrow = w.to(dtype)
    p, s = quantize_mxfp4(narrow)
    p64, s64 = quantize_mxfp4(narrow.double())
    assert torch.equal(p, p64) and torch.equal(s, s64)
    rounded = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0], dtype=torch.float64).repeat_interleave(4)
    assert torch.equal(dequantize_mxfp4(p[1:3, :16], s[1:3, :1], dtype=torch.float64), torch.stack([rounded, -rounded]))
    codes = torch.stack((p[3, :16] & 0xF, p[3, :16] >> 4), dim=-1).flatten()
    assert codes[0] == 6 and not codes[1:].any()  # 2^20 / 2^18 = 4; the rest round to +0, never -0 (code 8)


def test_fp64_inputs_keep_their_precision():
    """An fp64 value that fp32 cannot hold is rounded from its own value: 0.25 + 2^-40 in a group of amax 6 (scale
    1) is above the midpoint 0.25, so it is 0.5 (code 1); rounded to fp32 first it would tie to 0 (code 0)."""
    w = torch.zeros(1, 32, dtype=torch.float64)
    w[0, 0], w[0, 1] = 6.0, 0.25 + 2.0**-40
    p, s = quantize_mxfp4(w)
    assert s.item() == 127 and p[0, 0].item() == 7 | (1 << 4)
    p32, _ = quantize_mxfp4(w.float())
    assert p32[0, 0].item() == 7


def test_encoding_with_denormals_flushed():
    """Scale byte 0 (2^-127) is an fp32 subnormal: the encoder scales by ldexp, so flushing denormals to zero (a
    process-wide setting that some libraries turn on) does not change the codes of tiny or all-zero groups."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        zeros_p, zeros_s = quantize_mxfp4(torch.zeros(1, 32))
        tiny_p, tiny_s = quantize_mxfp4(torch.full((1, 32), 2.0**-126))  # amax 2^-126: e = -128, clamped to -127
    finally:
        torch.set_flush_denormal(False)
    assert not zeros_p.any() and not zeros_s.any()
    assert tiny_s.tolist() == [[0]] and set(tiny_p.flatten().tolist()) == {4 | (4 << 4)}  # 2^-126 / 2^-127 = 2


def test_noncanonical_reencodes_to_same_values():
    g = torch.Generator().manual_seed(3)
    p = torch.randint(0, 256, (40, 32), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 240, (40, 2), dtype=torch.uint8, generator=g)
    s[0, 0] = 200
    p[0, :16] = 0x88  # a "-0" group with a non-zero scale: non-canonical
    d = dequantize_mxfp4(p, s, dtype=torch.float32)
    p2, s2 = quantize_mxfp4(d)
    assert torch.equal(dequantize_mxfp4(p2, s2, dtype=torch.float32), d)
    assert s2[0, 0].item() == ZERO_GROUP_SCALE_BYTE and not torch.equal(p2, p)  # bytes may differ, values do not


@pytest.mark.parametrize(
    "w, match",
    [
        (torch.zeros(4, 33), "multiple of group_size"),
        (torch.zeros(32), "2-D"),
        (torch.zeros(2, 32, dtype=torch.int32), "floating"),
        (torch.tensor([[float("nan")] + [0.0] * 31]), "non-finite"),
        (torch.tensor([[float("inf")] + [0.0] * 31]), "non-finite"),
    ],
    ids=["cols", "1d", "int", "nan", "inf"],
)
def test_quantize_errors(w, match):
    with pytest.raises(ValueError, match=match):
        quantize_mxfp4(w)


def test_numpy_and_torch_inputs_agree():
    """The decoder and encoder run in numpy; torch tensors in give torch tensors out with the same bits."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(8, 64, generator=g) * 0.1).to(torch.bfloat16)
    p_t, s_t = quantize_mxfp4(w)
    p_n, s_n = quantize_mxfp4(w.float().numpy())
    assert isinstance(p_t, torch.Tensor) and isinstance(p_n, np.ndarray)
    assert np.array_equal(p_t.numpy(), p_n) and np.array_equal(s_t.numpy(), s_n)
    d_t = dequantize_mxfp4(p_t, s_t, dtype=torch.float32)
    d_n = dequantize_mxfp4(p_n, s_n, dtype="float32")
    assert d_t.dtype == torch.float32 and d_n.dtype == np.float32 and np.array_equal(d_t.numpy(), d_n)
    assert dequantize_mxfp4(p_n, s_n).dtype == ml_dtypes.bfloat16
    with pytest.raises(ValueError, match="dtype: got int32"):
        dequantize_mxfp4(p_n, s_n, dtype="int32")
