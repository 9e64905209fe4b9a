"""Tests for runtime.numerics, the FP8/MXFP4 reference the GPU kernels are checked against.

Besides golden vectors, the rounding is cross-checked against independent
brute-force oracles that work on exact rationals (``fractions.Fraction``) and
hand-written bit-field decoders, so a bug shared with torch's casts or with the
vectorized formulation would still be caught.
"""

from __future__ import annotations

import bisect
import math
import struct
from fractions import Fraction

import pytest
import torch

from runtime.numerics import (
    E2M1_GRID,
    FP8_FORMATS,
    canonical_nan_bits,
    dequantize_fp4,
    dequantize_fp8,
    fp8_decode,
    fp8_encode,
    quantize_fp4,
    quantize_fp8,
)

FMTS = ("ocp", "fnuz")
INF = float("inf")
NAN = float("nan")


# --------------------------------------------------------------------------
# independent helpers
# --------------------------------------------------------------------------

def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def f32_from_bits(bits) -> torch.Tensor:
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits],
                        dtype=torch.int32).view(torch.float32)


def f32_bits(x: torch.Tensor) -> list[int]:
    return [b & 0xFFFFFFFF for b in x.reshape(-1).view(torch.int32).tolist()]


def bf16_bits(x: torch.Tensor) -> list[int]:
    return [b & 0xFFFF for b in x.reshape(-1).view(torch.int16).tolist()]


def next_up(v: float) -> float:
    """Next float32 above positive float32 ``v``."""
    (b,) = struct.unpack("<I", struct.pack("<f", v))
    return struct.unpack("<f", struct.pack("<I", b + 1))[0]


def next_down(v: float) -> float:
    """Next float32 below positive float32 ``v``."""
    (b,) = struct.unpack("<I", struct.pack("<f", v))
    return struct.unpack("<f", struct.pack("<I", b - 1))[0]


def hand_fp8_value(byte: int, fmt: str) -> float:
    """Value of an e4m3 byte from its bit fields (no torch involved)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if fmt == "ocp":
        bias = 7
        if exp == 0xF and man == 0x7:
            return NAN
    else:
        bias = 8
        if byte == 0x80:
            return NAN
    if exp == 0:
        return sign * man / 8 * 2.0 ** (1 - bias)
    return sign * (1 + man / 8) * 2.0 ** (exp - bias)


def _fp8_positive_table(fmt: str) -> list[tuple[Fraction, int]]:
    """(exact value, byte) of every non-negative, non-NaN e4m3 byte, ascending."""
    table = []
    for byte in range(128):
        val = hand_fp8_value(byte, fmt)
        if not math.isnan(val):
            table.append((Fraction(val), byte))
    return sorted(table)


_FP8_TABLES = {fmt: _fp8_positive_table(fmt) for fmt in ("ocp", "fnuz")}


def brute_fp8_byte(v: float, fmt: str) -> int:
    """Saturating RNE encode of a finite python float from the exact value table."""
    table = _FP8_TABLES[fmt]
    fmax = FP8_FORMATS[fmt][1]
    mag = Fraction(min(abs(v), fmax))
    i = bisect.bisect_left(table, (mag, -1))
    candidates = table[max(i - 1, 0):i + 1]
    # nearest; on a tie the even mantissa (byte LSB) wins
    _, byte = min(candidates, key=lambda vb: (abs(vb[0] - mag), vb[1] & 1))
    if math.copysign(1.0, v) < 0 and not (fmt == "fnuz" and byte == 0):
        byte |= 0x80  # fnuz has no negative zero
    return byte


def brute_e2m1_code(mag: Fraction) -> int:
    """Nearest e2m1 code for a non-negative rational, ties to the even code."""
    if mag > 6:
        return 7
    dists = [(abs(mag - Fraction(g)), code & 1, code) for code, g in enumerate(E2M1_GRID)]
    return min(dists)[2]


def unpack_nibbles(packed: torch.Tensor) -> list[int]:
    out = []
    for b in packed.reshape(-1).tolist():
        out += [b & 0xF, b >> 4]
    return out


def fp4_block(values, fill=0.0) -> torch.Tensor:
    """One 32-element block: ``values`` followed by ``fill``."""
    values = list(values)
    return f32(values + [fill] * (32 - len(values)))


# --------------------------------------------------------------------------
# FP8 encode / decode
# --------------------------------------------------------------------------

def fp8_probe_values(fmt: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    fmax = FP8_FORMATS[fmt][1]
    min_sub = 2.0 ** -9 if fmt == "ocp" else 2.0 ** -10
    parts = [torch.randn(512, generator=gen) * 10.0 ** k for k in range(-6, 7)]
    parts.append(torch.rand(512, generator=gen) * 16 * min_sub * 2 - 16 * min_sub)  # subnormals
    parts.append(torch.arange(-40, 41, dtype=torch.float32) * (min_sub / 4))  # subnormal ties
    special = [447, 448, 449, 464, 480, 1e9, 232, 236, 239, 240, 241, 248, 250,
               INF, -INF, 0.0, -0.0, NAN, -NAN, 3.4e38, 1e-45, -1e-45]
    parts.append(f32(special + [-v for v in special]))
    parts.append(f32([fmax * 0.999, fmax * 1.001]))
    return torch.cat(parts)


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_encode_matches_torch_cast_of_clamped_input(fmt):
    dtype, fmax = FP8_FORMATS[fmt]
    x = fp8_probe_values(fmt)
    got = fp8_encode(x, fmt)
    assert got.dtype == torch.uint8 and got.shape == x.shape
    ref = x.clamp(-fmax, fmax).to(dtype).view(torch.uint8)
    nan = torch.isnan(x)
    assert torch.equal(got[~nan], ref[~nan])
    assert (got[nan] == canonical_nan_bits(fmt)).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_encode_matches_brute_force_rne(fmt):
    """Every probe value (NaN aside) vs an exact nearest-even search."""
    x = fp8_probe_values(fmt)
    x = x[~torch.isnan(x)]
    # midpoints between adjacent non-negative fp8 values, and one float32 ulp either side
    vals = [float(v) for v, _ in _FP8_TABLES[fmt]]
    mids = [(a + b) / 2 for a, b in zip(vals, vals[1:])]
    probes = mids + [next_up(m) for m in mids] + [next_down(m) for m in mids]
    x = torch.cat([x, f32(probes), -f32(probes)])
    got = fp8_encode(x, fmt).tolist()
    for v, byte in zip(x.tolist(), got):
        assert byte == brute_fp8_byte(v, fmt), (fmt, v, hex(byte))


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_decode_matches_hand_bit_fields(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    got = fp8_decode(codes, fmt)
    assert got.dtype == torch.float32
    for byte, v in enumerate(got.tolist()):
        want = hand_fp8_value(byte, fmt)
        if math.isnan(want):
            assert math.isnan(v), byte
        else:
            assert v == want and math.copysign(1, v) == math.copysign(1, want), byte


def test_fp8_specials():
    x = f32([INF, -INF, 0.0, -0.0, NAN, -NAN, 449, 464, 480, 1e9, -1e9, 1e-9, -1e-9])
    assert fp8_encode(x, "ocp").tolist() == [
        0x7E, 0xFE, 0x00, 0x80, 0x7F, 0x7F, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x00, 0x80]
    # fnuz: no negative zero (0x80 is NaN), so -0 and negative underflow give 0x00
    assert fp8_encode(x, "fnuz").tolist() == [
        0x7F, 0xFF, 0x00, 0x00, 0x80, 0x80, 0x7F, 0x7F, 0x7F, 0x7F, 0xFF, 0x00, 0x00]
    assert canonical_nan_bits("ocp") == 0x7F
    assert canonical_nan_bits("fnuz") == 0x80
    # whatever sign/payload a NaN has, it encodes canonically
    nans = f32_from_bits([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF])
    for fmt in FMTS:
        assert fp8_encode(nans, fmt).tolist() == [canonical_nan_bits(fmt)] * 5


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_round_trip_relative_error(fmt):
    _, fmax = FP8_FORMATS[fmt]
    min_normal = 2.0 ** -6 if fmt == "ocp" else 2.0 ** -7
    gen = torch.Generator().manual_seed(7)
    log_mag = torch.rand(20000, generator=gen) * (math.log2(fmax) - math.log2(min_normal))
    x = torch.exp2(log_mag + math.log2(min_normal)).clamp(min_normal, fmax)
    x = torch.where(torch.rand(20000, generator=gen) < 0.5, -x, x)
    y = fp8_decode(fp8_encode(x, fmt), fmt)
    rel = ((y - x).abs() / x.abs()).max().item()
    assert rel <= 2.0 ** -4


def test_fp8_bf16_input_is_widened_exactly():
    gen = torch.Generator().manual_seed(3)
    xb = (torch.randn(1024, generator=gen) * 50).to(torch.bfloat16)
    for fmt in FMTS:
        assert torch.equal(fp8_encode(xb, fmt), fp8_encode(xb.float(), fmt))


def test_fp8_direct_cast_mode():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 5, 7, generator=gen) * 100
    for fmt in FMTS:
        q, scales = quantize_fp8(x, fmt, "fp8_direct_cast")
        assert scales is None
        assert torch.equal(q, fp8_encode(x, fmt))
        y = dequantize_fp8(q, None, fmt, "fp8_direct_cast", torch.float32)
        assert torch.equal(y, fp8_decode(q, fmt))
        yb = dequantize_fp8(q, None, fmt, "fp8_direct_cast", torch.bfloat16)
        assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.to(torch.bfloat16))


# --------------------------------------------------------------------------
# FP8 blockwise
# --------------------------------------------------------------------------

def blockwise_input(gen, shape) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen)
    # a different magnitude per 128-block
    block_scale = 10.0 ** (torch.rand(*shape[:-1], shape[-1] // 128, generator=gen) * 12 - 6)
    return x * block_scale.repeat_interleave(128, dim=-1)


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_blockwise_scales_and_codes(fmt):
    _, fmax = FP8_FORMATS[fmt]
    gen = torch.Generator().manual_seed(5)
    x = blockwise_input(gen, (4, 3, 384))
    q, scales = quantize_fp8(x, fmt, "fp8_blockwise")
    assert q.shape == x.shape and q.dtype == torch.uint8
    assert scales.shape == (4, 3, 3) and scales.dtype == torch.float32
    blocks = x.reshape(4, 3, 3, 128)
    # float64 then float32 rounding of a quotient of float32s is exact (53 >= 2*24+2)
    amax = blocks.abs().amax(-1)
    want_scales = (amax.double() / fmax).float()
    assert torch.equal(scales, want_scales)
    want_q = fp8_encode((blocks.double() / want_scales.double().unsqueeze(-1)).float(), fmt)
    assert torch.equal(q, want_q.reshape(x.shape))
    # the block max lands exactly on +-max
    idx = blocks.abs().argmax(-1, keepdim=True)
    top = fp8_decode(q.reshape(4, 3, 3, 128).gather(-1, idx), fmt)
    assert (top.abs() == fmax).all()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_fp8_blockwise_round_trip(fmt, in_dtype):
    gen = torch.Generator().manual_seed(9)
    x = blockwise_input(gen, (8, 512)).to(in_dtype)
    q, scales = quantize_fp8(x, fmt, "fp8_blockwise")
    y = dequantize_fp8(q, scales, fmt, "fp8_blockwise", torch.float32)
    xf = x.float().reshape(8, 4, 128)
    yf = y.reshape(8, 4, 128)
    amax = xf.abs().amax(-1, keepdim=True)
    big = xf.abs() > amax / 2 ** 6
    rel = (yf - xf).abs() / xf.abs()
    assert big.sum() > 1000
    assert (rel[big] <= 2.0 ** -3).all()
    # dequant is exactly decode * scale, and bf16 output is its RNE rounding
    want = fp8_decode(q, fmt).reshape(8, 4, 128) * scales.unsqueeze(-1)
    assert torch.equal(y, want.reshape(8, 512))
    yb = dequantize_fp8(q, scales, fmt, "fp8_blockwise", torch.bfloat16)
    assert torch.equal(yb, y.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_blockwise_uses_true_division(fmt):
    """x / scale must be an IEEE float32 division, not x * (1 / scale).

    With scale = 7 (amax = 7 * max) every x = 7 * m, m an fp8 rounding midpoint,
    is exact and x / 7 = m is an exact tie, while x * fl(1/7) is often off the
    tie and can round the other way.
    """
    _, fmax = FP8_FORMATS[fmt]
    vals = [float(v) for v, _ in _FP8_TABLES[fmt]]
    mids = [(a + b) / 2 for a, b in zip(vals, vals[1:])]
    x = torch.zeros(2, 128)
    x[:, 0] = 7 * fmax
    body = torch.zeros(2, 127)
    body.view(-1)[: len(mids)] = f32(mids) * 7
    x[:, 1:] = body
    q, scales = quantize_fp8(x, fmt, "fp8_blockwise")
    assert scales.tolist() == [[7.0], [7.0]]
    want = torch.cat([f32([fmax]).expand(2, 1), body / 7], dim=1)
    assert torch.equal(want * 7, x)  # all exact, so the quotients are the ties
    assert torch.equal(q, fp8_encode(want, fmt))
    # the reciprocal formulation really does differ here, so this test has teeth
    assert not torch.equal(fp8_encode(x * (1 / scales.unsqueeze(-1)), fmt), q)


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_blockwise_zero_and_nan_blocks(fmt):
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(3, 128, generator=gen) * 30
    x[0] = 0.0
    x[1, 0] = -0.0
    x_nan = x.clone()
    x_nan[2, 17] = NAN
    x_nan[2, 90] = -NAN
    q, scales = quantize_fp8(x, fmt, "fp8_blockwise")
    qn, scales_n = quantize_fp8(x_nan, fmt, "fp8_blockwise")
    assert scales[0, 0].item() == 1.0
    assert (q[0] == 0).all()
    assert (dequantize_fp8(q, scales, fmt, "fp8_blockwise")[0] == 0).all()
    # NaN does not take part in amax, it only becomes the canonical NaN byte
    assert torch.equal(scales_n, scales)
    assert qn[2, 17].item() == qn[2, 90].item() == canonical_nan_bits(fmt)
    mask = torch.ones_like(q, dtype=torch.bool)
    mask[2, 17] = mask[2, 90] = False
    assert torch.equal(qn[mask], q[mask])
    y = dequantize_fp8(qn, scales_n, fmt, "fp8_blockwise", torch.float32)
    assert y[2].isnan().sum().item() == 2 and y[2, 17].isnan()
    yb = dequantize_fp8(qn, scales_n, fmt, "fp8_blockwise", torch.bfloat16)
    assert bf16_bits(yb[2, 17:18]) == bf16_bits(yb[2, 90:91]) == [0x7FC0]
    assert f32_bits(y[2, 17:18]) == [0x7FC00000]


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_blockwise_inf_block(fmt):
    # scale = inf: finite elements encode to (signed) zero, inf to NaN,
    # and the whole block dequantizes to NaN (0 * inf).
    x = torch.ones(256)
    x[5] = INF
    x[6] = -3.0
    q, scales = quantize_fp8(x, fmt, "fp8_blockwise")
    assert scales[0].item() == INF
    assert scales[1].item() == struct.unpack("<f", struct.pack("<f", 1.0 / FP8_FORMATS[fmt][1]))[0]
    assert q[5].item() == canonical_nan_bits(fmt)
    assert q[0].item() == 0 and q[6].item() == (0x80 if fmt == "ocp" else 0x00)
    y = dequantize_fp8(q, scales, fmt, "fp8_blockwise")
    assert y[:128].isnan().all() and (y[128:] == 1.0).all()


def rne_bf16_bits(x: torch.Tensor) -> list[int]:
    """float32 -> bfloat16 round-to-nearest-even on the bits (finite inputs)."""
    out = []
    for b in f32_bits(x):
        out.append(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF)
    return out


def test_bf16_output_is_round_to_nearest_even():
    # scales 1 + k/256 put decode * scale exactly on, or next to, bf16 midpoints
    q = fp8_encode(f32([1.0, 1.125, -1.5, 3.0, 0.0, -0.0, 448.0, 2.0 ** -9] * 16), "ocp")
    q = q.reshape(1, 128).repeat(6, 1)
    scales = f32([1 + k / 256 for k in (1, 3, 5, 7)] + [next_up(1 + 1 / 256), 1 / 3]).reshape(6, 1)
    y32 = dequantize_fp8(q, scales, "ocp", "fp8_blockwise", torch.float32)
    y16 = dequantize_fp8(q, scales, "ocp", "fp8_blockwise", torch.bfloat16)
    assert bf16_bits(y16) == rne_bf16_bits(y32)
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(64, 128, generator=gen) * 1e3
    packed, e8m0 = quantize_fp4(x)
    y32 = dequantize_fp4(packed, e8m0, torch.float32)
    assert bf16_bits(dequantize_fp4(packed, e8m0, torch.bfloat16)) == rne_bf16_bits(y32)


def test_fp8_argument_errors():
    x = torch.zeros(4, 200)
    with pytest.raises(ValueError, match="multiple of the block size 128"):
        quantize_fp8(x, "ocp", "fp8_blockwise")
    with pytest.raises(ValueError, match="multiple of the block size 128"):
        dequantize_fp8(torch.zeros(4, 200, dtype=torch.uint8), torch.ones(4, 1), "ocp",
                       "fp8_blockwise")
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_fp8(torch.zeros(4, 256, dtype=torch.uint8), torch.ones(4, 3), "ocp",
                       "fp8_blockwise")
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_fp8(torch.zeros(4, 256, dtype=torch.uint8), None, "ocp", "fp8_blockwise")
    with pytest.raises(ValueError, match="unknown FP8 format"):
        quantize_fp8(x, "e5m2", "fp8_direct_cast")
    with pytest.raises(ValueError, match="unknown FP8 quant mode"):
        quantize_fp8(x, "ocp", "fp4_blockwise")
    with pytest.raises(ValueError):
        dequantize_fp8(torch.zeros(4, dtype=torch.uint8), None, "ocp", "fp8_direct_cast",
                       torch.float16)
    with pytest.raises(TypeError):
        fp8_encode(torch.zeros(4, dtype=torch.float64), "ocp")


# --------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------

def test_fp4_golden_ties_and_saturation():
    # 4.0 pins amax to [4, 8) -> e = 0, so the block's q values equal x.
    vals = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 6.0, 7.9,
            0.2499, 0.2501, 2.4999, 2.5001, 4.9999, 5.0001, 7.0, 5.5,
            -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -7.9]
    packed, scales = quantize_fp4(f32(vals))
    assert scales.tolist() == [127]
    assert unpack_nibbles(packed) == [
        0x6, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6,
        0x0, 0x1, 0x2, 0x3, 0x4, 0x5, 0x7, 0x7,
        0x0, 0x1, 0x4, 0x5, 0x6, 0x7, 0x7, 0x7,
        0x8, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE, 0xF]


def test_fp4_sign_zero_and_nan():
    vals = [4.0, -0.0, -0.1, 0.1, NAN, -NAN, 1.0]
    packed, scales = quantize_fp4(fp4_block(vals))
    nib = unpack_nibbles(packed)
    assert scales.tolist() == [127]  # NaN ignored for amax
    assert nib[:7] == [0x6, 0x8, 0x8, 0x0, 0x7, 0xF, 0x2]
    assert nib[7:] == [0] * 25
    y = dequantize_fp4(packed, scales)
    assert f32_bits(y[1:3]) == [0x80000000, 0x80000000]  # -0.0 decodes to -0.0
    assert y[4].item() == 6.0 and y[5].item() == -6.0


def test_fp4_scale_exponent_rules():
    cases = [
        # (block values, expected e8m0 byte)
        ([0.0], 0),                       # zero block
        ([-0.0, NAN], 0),                 # NaN counts as 0
        ([INF], 254),                     # inf -> e = 127
        ([1.0, -INF], 254),
        ([1.0], 125),                     # floor(log2 1) - 2 = -2
        ([next_down(8.0)], 127),          # just below a power of two: no round-up
        ([8.0], 128),
        ([3.4e38], 125 + 127),            # largest finite: floor(log2) = 127
        ([2.0 ** -125], 0),               # e = -127 exactly
        ([2.0 ** -124], 1),               # e = -126
        ([2.0 ** -126], 0),               # e = -128 clamps to -127
        ([1e-40], 0),                     # subnormal amax clamps
        ([1.4e-45], 0),
    ]
    x = torch.stack([fp4_block(v) for v, _ in cases])
    _, scales = quantize_fp4(x)
    assert scales.reshape(-1).tolist() == [b for _, b in cases]


def test_fp4_extreme_exponents_elements():
    # e = 127 (inf in the block): q = x * 2^-127, everything finite rounds to 0 or small codes
    packed, scales = quantize_fp4(fp4_block([INF, -INF, 3.0e38, 1.0, -2.0 ** 127]))
    assert scales.tolist() == [254]
    # 3e38 * 2^-127 = 1.76 -> 2.0 (code 4); 2^127 * 2^-127 = 1 (code 2)
    assert unpack_nibbles(packed)[:5] == [0x7, 0xF, 0x4, 0x0, 0xA]
    y = dequantize_fp4(packed, scales)
    assert y[0].item() == INF and y[1].item() == -INF  # 6 * 2^127 overflows
    assert y[2].item() == INF  # 2 * 2^127 = 2^128 overflows too
    assert y[4].item() == -(2.0 ** 127)
    # e = -127 with subnormal inputs: x * 2^127 is exact
    tiny = 2.0 ** -128
    packed, scales = quantize_fp4(fp4_block([tiny * 3, -tiny, tiny / 2, 2.0 ** -149]))
    assert scales.tolist() == [0]
    assert unpack_nibbles(packed)[:4] == [0x3, 0x9, 0x0, 0x0]  # 1.5, -0.5, 0.25 -> 0, ~0
    y = dequantize_fp4(packed, scales)
    assert y[:2].tolist() == [tiny * 3, -tiny]


def test_fp4_packing_order():
    # e = 0 block; element 2i -> low nibble, element 2i+1 -> high nibble
    vals = [4.0, 0.5, 1.0, -6.0] + [0.0] * 28
    packed, _ = quantize_fp4(f32(vals).reshape(1, 32))
    assert packed.shape == (1, 16)
    assert packed[0, :2].tolist() == [0x16, 0xF2]
    # and dequantize reads the nibbles back in the same order
    assert dequantize_fp4(packed, torch.tensor([[127]], dtype=torch.uint8))[0, :4].tolist() == [
        4.0, 0.5, 1.0, -6.0]


def test_fp4_leading_dims():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 64, generator=gen)
    packed, scales = quantize_fp4(x)
    assert packed.shape == (2, 3, 32) and scales.shape == (2, 3, 2)
    flat_packed, flat_scales = quantize_fp4(x.reshape(6, 64))
    assert torch.equal(packed.reshape(6, 32), flat_packed)
    assert torch.equal(scales.reshape(6, 2), flat_scales)
    y = dequantize_fp4(packed, scales)
    assert y.shape == x.shape
    assert torch.equal(y.reshape(6, 64), dequantize_fp4(flat_packed, flat_scales))


def test_fp4_decode_table():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    codes = list(range(16))
    packed_row = torch.tensor([codes[i] | (codes[i + 1] << 4) for i in range(0, 16, 2)] * 2,
                              dtype=torch.uint8)
    scale_bytes = [0, 1, 100, 125, 127, 128, 130, 200, 254]
    packed = packed_row.repeat(len(scale_bytes), 1)
    scales = torch.tensor(scale_bytes, dtype=torch.uint8).reshape(-1, 1)
    y = dequantize_fp4(packed, scales, torch.float32)
    for row, byte in enumerate(scale_bytes):
        for col in range(32):
            code = col % 16
            mag = Fraction(grid[code & 7]) * Fraction(2) ** (byte - 127)
            want = float(mag) if mag < Fraction(2) ** 128 else INF  # f32 overflow
            want = -want if code & 8 else want
            got = y[row, col].item()
            assert got == want and math.copysign(1, got) == math.copysign(1, want), (byte, code)


def test_fp4_nan_scale_byte():
    packed = torch.full((2, 32), 0x21, dtype=torch.uint8)
    scales = torch.tensor([[127, 255], [255, 126]], dtype=torch.uint8)
    y = dequantize_fp4(packed, scales, torch.float32)
    assert y[0, :32].tolist() == [0.5, 1.0] * 16 and y[0, 32:].isnan().all()
    assert y[1, :32].isnan().all() and y[1, 32:].tolist() == [0.25, 0.5] * 16
    assert set(f32_bits(y[0, 32:])) == {0x7FC00000}
    yb = dequantize_fp4(packed, scales, torch.bfloat16)
    assert set(bf16_bits(yb[1, :32])) == {0x7FC0}
    assert torch.equal(yb[0, :32], y[0, :32].to(torch.bfloat16))


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_fp4_round_trip_error_bound(in_dtype):
    # With amax in [2^(e+2), 2^(e+3)), q = x/2^e has |q| < 8. The error in units
    # of 2^e is at most half the local grid step: 0.25 for |q| <= 2, 0.5 for
    # |q| <= 4, 1 for |q| <= 6, and < 2 where |q| in (6, 8) saturates to 6.
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(16, 8, 32, generator=gen)
    x = x * 2.0 ** torch.randint(-60, 60, (16, 8, 1), generator=gen).float()
    x = x.reshape(16, 256).to(in_dtype)
    packed, scales = quantize_fp4(x)
    assert packed.shape == (16, 128) and scales.shape == (16, 8)
    y = dequantize_fp4(packed, scales, torch.float32).reshape(16, 8, 32)
    xf = x.float().reshape(16, 8, 32)
    unit = 2.0 ** (scales.double() - 127).unsqueeze(-1)
    q = xf.double() / unit
    err = (y.double() - xf.double()).abs() / unit
    bound = torch.where(q.abs() <= 2, 0.25,
                        torch.where(q.abs() <= 4, 0.5, torch.where(q.abs() <= 6, 1.0, 2.0)))
    assert (q.abs() < 8).all()
    assert (err <= bound).all()
    assert (err[q.abs() > 6] < 2).all()
    assert (err <= 2.0).all()  # the simple uniform bound: |dq - x| <= 2^(e+1)
    # bf16 output is the RNE rounding of the float32 result
    yb = dequantize_fp4(packed, scales, torch.bfloat16)
    assert torch.equal(yb, y.reshape(16, 256).to(torch.bfloat16))


def test_fp4_shape_errors():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        quantize_fp4(torch.zeros(2, 48))
    with pytest.raises(ValueError):
        quantize_fp4(torch.tensor(1.0))
    with pytest.raises(ValueError, match="multiple of 16"):
        dequantize_fp4(torch.zeros(2, 24, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_fp4(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(TypeError):
        dequantize_fp4(torch.zeros(2, 16, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        dequantize_fp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8),
                       torch.float16)


@pytest.mark.parametrize("exp_shift", [0, 5, -20])
def test_fp4_rounding_matches_brute_force(exp_shift):
    """Nearest/ties-to-even-code vs an exact Fraction search, a few hundred scalars.

    Each block holds one 4.0 * 2^shift (so e = shift and q = x / 2^shift exactly)
    plus 31 probe values below 8 * 2^shift: every grid point, every midpoint,
    one float32 ulp either side of each midpoint, and random values.
    """
    grid = E2M1_GRID
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    probes = list(grid) + mids + [next_up(m) for m in mids] + [next_down(m) for m in mids]
    probes += [6.5, 7.0, next_down(8.0), 2.0 ** -140, 1e-30]
    gen = torch.Generator().manual_seed(100 + exp_shift)
    probes += (torch.rand(200, generator=gen) * 8).clamp(max=next_down(8.0)).tolist()
    probes += [-p for p in probes]

    per_block = 31
    blocks = []
    for i in range(0, len(probes), per_block):
        chunk = probes[i:i + per_block]
        blocks.append([4.0] + chunk + [0.0] * (per_block - len(chunk)))
    scale = 2.0 ** exp_shift
    x = f32(blocks) * scale
    packed, scales = quantize_fp4(x)
    assert (scales == 127 + exp_shift).all()
    nibbles = unpack_nibbles(packed)
    xs = x.reshape(-1).tolist()
    assert len(xs) > 300
    for v, nib in zip(xs, nibbles):
        q = Fraction(v) / Fraction(scale)
        want = brute_e2m1_code(abs(q)) | (8 if math.copysign(1, v) < 0 else 0)
        assert nib == want, (v, hex(nib), hex(want))
