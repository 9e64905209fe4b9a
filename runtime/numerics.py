"""Reference FP8 / MXFP4 quantizers: the bit-exact oracle for the GPU kernels.

Everything here is plain, vectorized torch and runs on CPU. The GPU kernels
must reproduce these encodings bit for bit, so every rounding step is spelled
out below and done in float32 with IEEE round-to-nearest-even (divisions are
true divisions, not reciprocal multiplies).

FP8 (e4m3), formats ``"ocp"`` (``torch.float8_e4m3fn``, max 448) and
``"fnuz"`` (``torch.float8_e4m3fnuz``, max 240):

* encode: clamp to ``[-max, max]`` (NaN passes through), cast with torch
  (round to nearest even), view the bits as ``uint8``. ``+-inf`` saturate to
  ``+-max``. Every NaN becomes the format's canonical NaN byte (``0x7F`` for
  ocp, ``0x80`` for fnuz); the sign of a NaN is *not* kept. fnuz has no
  negative zero, so ``-0.0`` and negative values that round to zero encode
  to ``0x00``.
* ``fp8_direct_cast``: ``q = fp8_encode(x)``, no scales.
* ``fp8_blockwise``: blocks of 128 along the last dim. ``amax`` is the block's
  max ``|x|`` with NaN counted as 0 (inf counts as inf);
  ``scale = amax / max`` if ``amax > 0`` else ``1.0``;
  ``q = fp8_encode(x / scale)``; dequant is ``fp8_decode(q) * scale``. A block
  holding an inf gets ``scale = inf``: its finite elements encode to zero,
  the inf elements to NaN, and the whole block dequantizes to NaN.

MXFP4 (OCP MX, e2m1 elements, one e8m0 scale per 32 elements):

* ``amax`` as above; ``e = clamp(floor(log2(amax)) - 2, -127, 127)`` with
  ``amax == 0 -> -127`` and ``amax == inf -> 127``; scale byte ``e + 127``.
* element: ``q = x * 2**-e`` in float32, rounded to the nearest magnitude of
  ``E2M1_GRID`` with ties to the even code, ``|q| > 6`` (and NaN) saturating
  to code 7. The sign nibble bit (bit 3) is the sign bit of ``x``.
* packing: element ``2i`` in the low nibble, ``2i + 1`` in the high nibble
  (the ``torch.float4_e2m1fn_x2`` convention).
* decode: ``sign * E2M1_GRID[code] * 2**(byte - 127)`` in float32 (may
  overflow to inf for byte 254); byte ``0xFF`` decodes the block to NaN.

Dequantized outputs are converted to ``out_dtype`` (float32 or bfloat16) by
round-to-nearest-even, and every NaN is written as the canonical positive
quiet NaN (``0x7FC00000`` / ``0x7FC0``). Torch's own CPU ``.to(bfloat16)``
writes ``0xFFFF`` for NaN in non-scalar tensors, so the canonical bits are
set explicitly here.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_FORMATS",
    "FP8_BLOCK",
    "FP8_MODES",
    "FP4_BLOCK",
    "E2M1_GRID",
    "canonical_nan_bits",
    "fp8_encode",
    "fp8_decode",
    "quantize_fp8",
    "dequantize_fp8",
    "quantize_fp4",
    "dequantize_fp4",
]

#: FP8 format name -> (torch dtype, largest finite magnitude).
FP8_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "ocp": (torch.float8_e4m3fn, 448.0),
    "fnuz": (torch.float8_e4m3fnuz, 240.0),
}

#: Canonical NaN byte of each FP8 format.
_FP8_NAN_BITS = {"ocp": 0x7F, "fnuz": 0x80}

#: Elements per float32 scale in ``fp8_blockwise`` mode.
FP8_BLOCK = 128
FP8_MODES = ("fp8_direct_cast", "fp8_blockwise")

#: Elements per e8m0 scale in MXFP4.
FP4_BLOCK = 32
#: Magnitude of each e2m1 code 0..7 (bit 3 of a nibble is the sign).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MAX = 6.0
_E8M0_NAN = 0xFF
_E8M0_BIAS = 127

_INPUT_DTYPES = (torch.float32, torch.bfloat16)
_OUTPUT_DTYPES = (torch.float32, torch.bfloat16)
_CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0}
_BITS_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def _fp8_format(fmt: str) -> tuple[torch.dtype, float]:
    try:
        return FP8_FORMATS[fmt]
    except KeyError:
        raise ValueError(
            f"unknown FP8 format {fmt!r}; expected one of {sorted(FP8_FORMATS)}"
        ) from None


def _as_float32(x: torch.Tensor) -> torch.Tensor:
    """Widen a float32/bfloat16 tensor to float32 (exact)."""
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"expected a float32 or bfloat16 tensor, got {x.dtype}")
    return x.to(torch.float32)


def _check_uint8(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.uint8:
        raise TypeError(f"{what} must be uint8, got {t.dtype}")


def _check_last_dim(x: torch.Tensor, block: int, what: str) -> int:
    """Return the number of blocks along the last dim, or raise ValueError."""
    if x.dim() == 0:
        raise ValueError(f"{what}: expected at least one dimension, got a scalar")
    n = x.shape[-1]
    if n % block:
        raise ValueError(
            f"{what}: last dimension ({n}) must be a multiple of the block size {block}"
        )
    return n // block


def _nan_as_zero_abs(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` with NaN replaced by 0 (inf kept)."""
    return torch.where(torch.isnan(x), torch.zeros_like(x), x.abs())


def _to_output(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Round float32 ``x`` to ``out_dtype`` (RNE); NaN -> canonical positive qNaN."""
    if out_dtype not in _OUTPUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.float32 or torch.bfloat16, got {out_dtype}")
    out = x.to(out_dtype)
    bits_dtype = _BITS_VIEW[out_dtype]
    # The canonical patterns fit the signed bits view (0x7FC0... is positive).
    nan_bits = torch.tensor(_CANONICAL_NAN[out_dtype], dtype=bits_dtype)
    bits = torch.where(torch.isnan(x), nan_bits, out.view(bits_dtype))
    return bits.view(out_dtype)


def _pow2_f32(k: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**k`` for integer ``k`` in [-149, 127], built from bits."""
    k = k.to(torch.int32)
    normal = (k + 127) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _sign_bit(x: torch.Tensor) -> torch.Tensor:
    """Sign bit of float32 ``x`` (True for -0.0 and negative NaN)."""
    return x.view(torch.int32) < 0


# --------------------------------------------------------------------------
# FP8
# --------------------------------------------------------------------------

def canonical_nan_bits(fmt: str) -> int:
    """The byte every NaN encodes to: 0x7F for ``"ocp"``, 0x80 for ``"fnuz"``."""
    _fp8_format(fmt)
    return _FP8_NAN_BITS[fmt]


def fp8_encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Saturating FP8 e4m3 encode of a float32 (or bfloat16) tensor to uint8 bits.

    Round to nearest even after clamping to ``[-max, max]``; +-inf saturate,
    NaN (of either sign) becomes ``canonical_nan_bits(fmt)``.
    """
    dtype, fmax = _fp8_format(fmt)
    x = _as_float32(x)
    bits = x.clamp(-fmax, fmax).to(dtype).view(torch.uint8)
    nan_byte = torch.tensor(_FP8_NAN_BITS[fmt], dtype=torch.uint8)
    return torch.where(torch.isnan(x), nan_byte, bits)


def fp8_decode(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """Exact float32 value of FP8 e4m3 bits stored as uint8."""
    dtype, _ = _fp8_format(fmt)
    _check_uint8(q, "fp8 codes")
    return q.view(dtype).to(torch.float32)


def _check_mode(mode: str) -> None:
    if mode not in FP8_MODES:
        raise ValueError(f"unknown FP8 quant mode {mode!r}; expected one of {FP8_MODES}")


def quantize_fp8(
    x: torch.Tensor, fmt: str, mode: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize ``x`` (float32/bfloat16) to FP8 bits.

    Returns ``(q, scales)``: ``q`` is uint8 with the shape of ``x``; ``scales``
    is ``None`` for ``"fp8_direct_cast"`` and a float32 tensor of shape
    ``[..., n / 128]`` for ``"fp8_blockwise"`` (``n`` = last dim of ``x``,
    which must then be a multiple of 128).
    """
    _, fmax = _fp8_format(fmt)
    _check_mode(mode)
    x = _as_float32(x)
    if mode == "fp8_direct_cast":
        return fp8_encode(x, fmt), None

    nblocks = _check_last_dim(x, FP8_BLOCK, "fp8_blockwise quantize")
    blocks = x.reshape(*x.shape[:-1], nblocks, FP8_BLOCK)
    amax = _nan_as_zero_abs(blocks).amax(dim=-1)
    scales = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    q = fp8_encode(blocks / scales.unsqueeze(-1), fmt)
    return q.reshape(x.shape), scales


def dequantize_fp8(
    q: torch.Tensor,
    scales: torch.Tensor | None,
    fmt: str,
    mode: str,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: decode, multiply by the block scale
    (float32, blockwise mode only), then round to ``out_dtype``."""
    _fp8_format(fmt)
    _check_mode(mode)
    values = fp8_decode(q, fmt)
    if mode == "fp8_blockwise":
        nblocks = _check_last_dim(q, FP8_BLOCK, "fp8_blockwise dequantize")
        expected = (*q.shape[:-1], nblocks)
        if scales is None or tuple(scales.shape) != expected:
            got = None if scales is None else tuple(scales.shape)
            raise ValueError(f"fp8_blockwise dequantize: scales shape {got}, expected {expected}")
        if scales.dtype != torch.float32:
            raise TypeError(f"fp8 scales must be float32, got {scales.dtype}")
        blocks = values.reshape(*expected, FP8_BLOCK) * scales.unsqueeze(-1)
        values = blocks.reshape(q.shape)
    elif scales is not None:
        raise ValueError("fp8_direct_cast dequantize: scales must be None")
    return _to_output(values, out_dtype)


# --------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------

def _e8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Shared exponent ``clamp(floor(log2(amax)) - 2, -127, 127)`` as int32.

    ``floor(log2)`` of a positive normal float32 is its unbiased exponent
    field, read straight from the bits. Zero and subnormal amax have a zero
    field, giving ``-127 - 2``, which clamps to -127 as required; inf has the
    all-ones field and is mapped to 127 explicitly.
    """
    field = (amax.view(torch.int32) >> 23) & 0xFF
    e = (field - _E8M0_BIAS - 2).clamp(-127, 127)
    return torch.where(torch.isinf(amax), torch.full_like(e, 127), e)


def _e2m1_codes(mag: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (0..7) for non-negative float32 magnitudes.

    Picks the grid value at minimum distance; on an exact tie (only possible
    between adjacent codes) the even code wins. ``mag > 6`` and NaN give 7.
    For a magnitude between two adjacent grid points both distances are exact
    in float32 (Sterbenz: adjacent points differ by at most a factor of 2),
    so ties are detected exactly.
    """
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
    clipped = mag.clamp(max=_E2M1_MAX)  # NaN stays NaN, handled below
    dist = (clipped.unsqueeze(-1) - grid).abs()
    nearest = dist == dist.amin(dim=-1, keepdim=True)
    # Among the nearest candidates prefer even codes: weight 2 vs 1, argmax.
    even_pref = torch.tensor([2, 1, 2, 1, 2, 1, 2, 1], dtype=torch.int8)
    codes = (nearest.to(torch.int8) * even_pref).argmax(dim=-1).to(torch.uint8)
    return torch.where(torch.isnan(mag), torch.full_like(codes, 7), codes)


def quantize_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantize ``x`` (float32/bfloat16) along its last dim.

    Returns ``(packed, scales)``: ``packed`` uint8 ``[..., n / 2]`` (element
    ``2i`` in the low nibble), ``scales`` uint8 e8m0 bytes ``[..., n / 32]``.
    The last dim ``n`` must be a multiple of 32.
    """
    x = _as_float32(x)
    nblocks = _check_last_dim(x, FP4_BLOCK, "fp4 quantize")
    blocks = x.reshape(*x.shape[:-1], nblocks, FP4_BLOCK)

    e = _e8m0_exponent(_nan_as_zero_abs(blocks).amax(dim=-1))
    scaled = blocks * _pow2_f32(-e).unsqueeze(-1)
    codes = _e2m1_codes(scaled.abs())
    nibbles = codes | (_sign_bit(blocks).to(torch.uint8) << 3)

    pairs = nibbles.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    scales = (e + _E8M0_BIAS).to(torch.uint8)
    return packed, scales


def dequantize_fp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp4`: ``sign * grid[code] * 2**(byte - 127)``
    in float32 (byte 0xFF: the whole block is NaN), rounded to ``out_dtype``."""
    _check_uint8(packed, "fp4 packed codes")
    _check_uint8(scales, "fp4 e8m0 scales")
    if packed.dim() == 0:
        raise ValueError("fp4 dequantize: expected at least one dimension, got a scalar")
    n = packed.shape[-1] * 2
    if n % FP4_BLOCK:
        raise ValueError(
            f"fp4 dequantize: packed last dimension ({packed.shape[-1]}) must be a "
            f"multiple of {FP4_BLOCK // 2}"
        )
    nblocks = n // FP4_BLOCK
    expected = (*packed.shape[:-1], nblocks)
    if tuple(scales.shape) != expected:
        raise ValueError(f"fp4 dequantize: scales shape {tuple(scales.shape)}, expected {expected}")

    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    nibbles = nibbles.reshape(*expected, FP4_BLOCK)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
    mag = grid[(nibbles & 0x7).long()]
    signed = torch.where((nibbles & 0x8) != 0, -mag, mag)

    exp = scales.to(torch.int32) - _E8M0_BIAS
    scale = _pow2_f32(exp.clamp(max=127))  # byte 0xFF is replaced by NaN below
    scale = torch.where(scales == _E8M0_NAN, torch.full_like(scale, float("nan")), scale)
    values = (signed * scale.unsqueeze(-1)).reshape(*packed.shape[:-1], n)
    return _to_output(values, out_dtype)
