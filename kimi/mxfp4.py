"""MXFP4 (OCP Microscaling FP4) encode and decode for the routed experts (spec section 6).

Storage format (compressed-tensors ``mxfp4-pack-quantized``, as in the K3 checkpoint):

* ``weight_packed`` uint8 ``[R, C/2]``: two E2M1 codes per byte, the **low nibble is the even element**
  (column ``2j``) and the high nibble the odd one (column ``2j+1``). This is the only difference from ggml's MXFP4.
* E2M1 code (4 bits): bit 3 is the sign, bits 0..2 index the magnitude table ``{0, .5, 1, 1.5, 2, 3, 4, 6}``.
* ``weight_scale`` uint8 ``[R, C/32]``: one E8M0 byte per group of 32 consecutive input columns,
  value ``2^(byte - 127)``; byte 255 is NaN in E8M0 and is refused.

Decoding is exact: an E2M1 value times a power of two has at most two significant bits, so it is representable in
bf16 and fp32 whenever it is in range (``0.5 * 2^-127`` is a bf16/fp32 subnormal; only scale bytes >= 253 can
overflow). Encoding follows the OCP MX v1.0 rule: shared exponent ``floor(log2(amax)) - 2`` (2 = emax of E2M1),
elements rounded to the nearest E2M1 value with ties to even, saturated at +-6.

Canonical encodings: :func:`quantize_mxfp4` never emits negative zero (code 8) and gives an all-zero group scale
byte 0 (``floor(log2(0)) = -inf`` clamped to the smallest exponent). Hence ``quantize(dequantize(p, s)) == (p, s)``
byte for byte for every ``(p, s)`` the quantizer produced. A non-canonical encoding of the same values (say a
group stored with a larger scale and smaller codes, ``-0`` codes, or a non-zero scale on an all-zero group) decodes
to the same numbers but re-encodes to the canonical bytes, not to the original ones.
"""

from __future__ import annotations

import torch

__all__ = ["E2M1_VALUES", "GROUP_SIZE", "ZERO_GROUP_SCALE_BYTE", "dequantize_mxfp4", "quantize_mxfp4"]

GROUP_SIZE = 32
#: Magnitudes of the E2M1 codes 0..7 (codes 8..15 are the same values, negated).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Scale byte the quantizer writes for a group whose values are all zero.
ZERO_GROUP_SCALE_BYTE = 0
_E8M0_NAN = 255
_E8M0_BIAS = 127
_E2M1_EMAX = 2  # floor(log2(6))
# Midpoints between consecutive magnitudes; a tie goes to the even code (ties-to-even on the mantissa bit).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _check_group(group_size: int) -> None:
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size: got {group_size!r}, expected a positive even integer (MXFP4 uses 32)")


def _e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes (0..254) -> exact float32 powers of two, built from the bit pattern (no pow rounding)."""
    b = scale.to(torch.int32)
    normal = (b << 23).view(torch.float32)  # exponent field = b: 2^(b-127) for b >= 1
    sub = torch.full_like(normal, 2.0**-127)  # b == 0: 2^-127 is an fp32 subnormal (exact)
    return torch.where(b == 0, sub, normal)


def dequantize_mxfp4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    group_size: int = GROUP_SIZE,
) -> torch.Tensor:
    """Decode MXFP4 to a dense ``[R, C]`` tensor of ``dtype``.

    Args:
        weight_packed: uint8 ``[R, C/2]``, low nibble = even column (spec 6).
        weight_scale: uint8 ``[R, C/group_size]``, E8M0 bytes ``2^(b-127)``.
        dtype: output dtype (bf16 by default; bf16 and fp32 are exact).
        group_size: input columns per scale byte (32 for MXFP4).

    Returns:
        ``[R, C]`` tensor of ``dtype``.

    Raises:
        ValueError: a non-uint8 or non-2-D input, mismatched shapes, a scale byte 255 (E8M0 NaN), or a value that
            overflows ``dtype`` (e.g. scale byte 254 with code 6 in bf16).
    """
    _check_group(group_size)
    for nm, t in (("weight_packed", weight_packed), ("weight_scale", weight_scale)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{nm}: got {type(t).__name__}, expected a torch uint8 tensor")
        if t.dtype != torch.uint8:
            raise ValueError(f"{nm}: got dtype {t.dtype}, expected torch.uint8")
        if t.dim() != 2:
            raise ValueError(f"{nm}: got shape {list(t.shape)}, expected 2-D [R, ...]")
    R, half = weight_packed.shape
    C = 2 * half
    if C % group_size:
        raise ValueError(
            f"weight_packed: got {half} bytes per row = {C} columns, expected a multiple of group_size={group_size}"
        )
    want = (R, C // group_size)
    if tuple(weight_scale.shape) != want:
        raise ValueError(
            f"weight_scale: got shape {list(weight_scale.shape)}, expected {list(want)} for "
            f"weight_packed {list(weight_packed.shape)} (one byte per {group_size} columns)"
        )
    if bool((weight_scale == _E8M0_NAN).any()):
        rows, groups = torch.nonzero(weight_scale == _E8M0_NAN, as_tuple=True)
        raise ValueError(
            f"weight_scale: byte 255 (E8M0 NaN) at (row, group) ({int(rows[0])}, {int(groups[0])})"
            f" and {len(rows) - 1} more; expected 0..254"
        )
    p = weight_packed.to(torch.int64)
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(R, C)  # [R, C/2, 2] -> [R, C]: low nibble first
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    vals = table[codes].reshape(R, C // group_size, group_size)
    out = (vals * _e8m0_to_float32(weight_scale)[..., None]).reshape(R, C)  # exact in fp32 (or inf)
    out = out.to(dtype)
    if not bool(torch.isfinite(out).all()):
        raise ValueError(
            f"weight_scale: a scale byte up to {int(weight_scale.max())} overflows {dtype} "
            "(the decoded value is not finite)"
        )
    return out


def quantize_mxfp4(w: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``w`` ``[R, C]`` (any float dtype) to MXFP4 with the OCP MX rule.

    Per group of ``group_size`` consecutive columns: ``e = floor(log2(amax)) - 2``, scale byte ``e + 127`` clamped
    to ``[0, 254]``; each element ``x / 2^e`` rounded to the nearest E2M1 value, ties to even, clamped to +-6. A
    group of zeros gets scale byte :data:`ZERO_GROUP_SCALE_BYTE` (0). Zero magnitudes are encoded as +0 (code 0).

    Args:
        w: float tensor ``[R, C]``; C a multiple of ``group_size``. Computed in float64 (exact for bf16/fp32 inputs).

    Returns:
        ``(weight_packed uint8 [R, C/2], weight_scale uint8 [R, C/group_size])``.

    Raises:
        ValueError: not a 2-D floating tensor, C not a multiple of ``group_size``, or a non-finite element.
    """
    _check_group(group_size)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError(f"w: got {getattr(w, 'dtype', type(w).__name__)}, expected a floating torch tensor")
    if w.dim() != 2:
        raise ValueError(f"w: got shape {list(w.shape)}, expected 2-D [R, C]")
    R, C = w.shape
    if C % group_size:
        raise ValueError(f"w: got {C} columns, expected a multiple of group_size={group_size}")
    x = w.detach().cpu().to(torch.float64).reshape(R, C // group_size, group_size)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("w: got a non-finite element (inf or NaN), expected finite values")
    amax = x.abs().amax(dim=-1)  # [R, G]
    _, ex = torch.frexp(amax)  # amax = m * 2^ex with m in [0.5, 1): floor(log2(amax)) = ex - 1 (exact)
    e = ex.to(torch.int64) - 1 - _E2M1_EMAX
    byte = (e + _E8M0_BIAS).clamp(0, 254)
    byte = torch.where(amax == 0, torch.full_like(byte, ZERO_GROUP_SCALE_BYTE), byte)
    q = x / torch.pow(torch.tensor(2.0, dtype=torch.float64), (byte - _E8M0_BIAS).to(torch.float64))[..., None]
    a = q.abs()
    mag = torch.zeros_like(a, dtype=torch.int64)
    for i, m in enumerate(_MIDPOINTS):  # crossing midpoint i moves to code i+1; a tie only if i+1 is even
        up = (a > m) | ((a == m) & ((i + 1) % 2 == 0))
        mag += up.to(torch.int64)
    code = torch.where((q < 0) & (mag > 0), mag | 8, mag).reshape(R, C)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), byte.to(torch.uint8).contiguous()
