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

from typing import Any

import numpy as np

from kimi.arrays import dtype_name, is_torch_tensor, numpy_dtype, to_numpy, to_torch

__all__ = ["E2M1_VALUES", "GROUP_SIZE", "ZERO_GROUP_SCALE_BYTE", "dequantize_mxfp4", "quantize_mxfp4"]

GROUP_SIZE = 32
#: Magnitudes of the E2M1 codes 0..7 (codes 8..15 are the same values, negated).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Scale byte the quantizer writes for a group whose values are all zero.
ZERO_GROUP_SCALE_BYTE = 0
_E8M0_NAN = 255
_E8M0_BIAS = 127
_E2M1_EMAX = 2  # floor(log2(6))
_DEQUANT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def _check_group(group_size: int) -> None:
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size: got {group_size!r}, expected a positive even integer (MXFP4 uses 32)")


def _e8m0_to_float32(scale: np.ndarray) -> np.ndarray:
    """uint8 E8M0 bytes (0..254) -> exact float32 powers of two, built from the bit pattern (no pow rounding)."""
    b = scale.astype(np.uint32)
    normal = (b << 23).view(np.float32)  # exponent field = b: 2^(b-127) for b >= 1
    return np.where(b == 0, np.float32(2.0**-127), normal)  # b == 0: 2^-127 is an fp32 subnormal (exact)


def dequantize_mxfp4(
    weight_packed: Any,
    weight_scale: Any,
    dtype: Any = "bfloat16",
    group_size: int = GROUP_SIZE,
) -> Any:
    """Decode MXFP4 to a dense ``[R, C]`` array of ``dtype`` (computed in numpy).

    Args:
        weight_packed: uint8 ``[R, C/2]``, low nibble = even column (spec 6); a numpy array or a torch tensor.
        weight_scale: uint8 ``[R, C/group_size]``, E8M0 bytes ``2^(b-127)``; same kind as ``weight_packed``.
        dtype: output dtype, a name (``"bfloat16"``), a numpy dtype or a ``torch.dtype`` (bf16 by default; bf16,
            fp16 in range, fp32 and fp64 are exact).
        group_size: input columns per scale byte (32 for MXFP4).

    Returns:
        ``[R, C]`` of ``dtype``: a CPU torch tensor when ``weight_packed`` is a torch tensor, else a numpy array.

    Raises:
        ValueError: a non-uint8 or non-2-D input, mismatched shapes, a scale byte 255 (E8M0 NaN), or a value that
            overflows ``dtype`` (e.g. scale byte 254 with code 6 in bf16).
    """
    _check_group(group_size)
    torch_out = is_torch_tensor(weight_packed)
    for nm, t in (("weight_packed", weight_packed), ("weight_scale", weight_scale)):
        if not (isinstance(t, np.ndarray) or is_torch_tensor(t)):
            raise ValueError(f"{nm}: got {type(t).__name__}, expected a uint8 numpy array or torch tensor")
        if dtype_name(t) != "uint8":
            raise ValueError(f"{nm}: got dtype {dtype_name(t)}, expected uint8")
        if t.ndim != 2:
            raise ValueError(f"{nm}: got shape {list(t.shape)}, expected 2-D [R, ...]")
    out_dt = numpy_dtype(dtype)
    if out_dt.name not in _DEQUANT_DTYPES:
        raise ValueError(f"dtype: got {out_dt.name}, expected one of {list(_DEQUANT_DTYPES)}")
    packed, scale = to_numpy(weight_packed), to_numpy(weight_scale)
    R, half = packed.shape
    C = 2 * half
    if C % group_size:
        raise ValueError(
            f"weight_packed: got {half} bytes per row = {C} columns, expected a multiple of group_size={group_size}"
        )
    want = (R, C // group_size)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"weight_scale: got shape {list(scale.shape)}, expected {list(want)} for "
            f"weight_packed {list(packed.shape)} (one byte per {group_size} columns)"
        )
    if (scale == _E8M0_NAN).any():
        rows, groups = np.nonzero(scale == _E8M0_NAN)
        raise ValueError(
            f"weight_scale: byte 255 (E8M0 NaN) at (row, group) ({int(rows[0])}, {int(groups[0])})"
            f" and {len(rows) - 1} more; expected 0..254"
        )
    codes = np.stack((packed & 0xF, packed >> 4), axis=-1).reshape(R, C)  # [R, C/2, 2] -> [R, C]: low nibble first
    table = np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=np.float32)
    vals = table[codes].reshape(R, C // group_size, group_size)
    with np.errstate(over="ignore"):  # overflow gives inf, refused just below
        out = (vals * _e8m0_to_float32(scale)[..., None]).reshape(R, C).astype(out_dt)  # exact in fp32 (or inf)
    if not np.isfinite(out).all():
        raise ValueError(
            f"weight_scale: a scale byte up to {int(scale.max())} overflows {out_dt.name} "
            "(the decoded value is not finite)"
        )
    return to_torch(out) if torch_out else out


def quantize_mxfp4(w: Any, group_size: int = GROUP_SIZE) -> tuple[Any, Any]:
    """Encode ``w`` ``[R, C]`` (any float dtype) to MXFP4 with the OCP MX rule (computed in numpy).

    Per group of ``group_size`` consecutive columns: ``e = floor(log2(amax)) - 2``, scale byte ``e + 127`` clamped
    to ``[0, 254]``; each element ``x / 2^e`` rounded to the nearest E2M1 value, ties to even, clamped to +-6. A
    group of zeros gets scale byte :data:`ZERO_GROUP_SCALE_BYTE` (0). Zero magnitudes are encoded as +0 (code 0).

    Args:
        w: floating ``[R, C]``, a numpy array or a torch tensor; C a multiple of ``group_size``. Computed exactly,
            in float32 for inputs of up to 32 bits and in float64 for fp64 (a wider float is rounded to fp64 first).

    Returns:
        ``(weight_packed uint8 [R, C/2], weight_scale uint8 [R, C/group_size])``: CPU torch tensors for a torch
        ``w``, else numpy arrays.

    Raises:
        ValueError: not a 2-D floating array, C not a multiple of ``group_size``, or a non-finite element.
    """
    _check_group(group_size)
    floating = (isinstance(w, np.ndarray) and dtype_name(w).startswith(("float", "bfloat"))) or (
        is_torch_tensor(w) and w.is_floating_point()
    )
    if not floating:
        raise ValueError(f"w: got {getattr(w, 'dtype', type(w).__name__)}, expected a floating array or tensor")
    if w.ndim != 2:
        raise ValueError(f"w: got shape {list(w.shape)}, expected 2-D [R, C]")
    R, C = w.shape
    if C % group_size:
        raise ValueError(f"w: got {C} columns, expected a multiple of group_size={group_size}")
    x = to_numpy(w)
    # float32 is exact for inputs of at most float32's precision (bf16, fp16, fp32): scaling by a power of two is
    # exact and a value that underflows is far below the smallest midpoint either way; fp64 stays float64
    work = np.float64 if x.dtype.itemsize > 4 else np.float32
    x = x.astype(work).reshape(R, C // group_size, group_size)
    if not np.isfinite(x).all():
        raise ValueError("w: got a non-finite element (inf or NaN), expected finite values")
    amax = np.abs(x).max(axis=-1)  # [R, G]
    _, ex = np.frexp(amax)  # amax = m * 2^ex with m in [0.5, 1): floor(log2(amax)) = ex - 1 (exact)
    e = ex.astype(np.int32) - 1 - _E2M1_EMAX
    byte = np.clip(e + _E8M0_BIAS, 0, 254)
    byte = np.where(amax == 0, ZERO_GROUP_SCALE_BYTE, byte)
    # x / 2^e as x * 2^-e, exact (a power of two): 2^-e is a normal number in the working dtype (in fp32, byte <= 252
    # since amax < 2^128), whereas 2^e at byte 0 (2^-127) is an fp32 subnormal, flushed to zero where denormals are off
    q = x * np.ldexp(work(1.0), (_E8M0_BIAS - byte).astype(np.int32))[..., None]
    a = np.abs(q)  # in [0, 8): amax / 2^e is in [4, 8) (smaller where the scale byte was clamped at 0)
    # Nearest E2M1 magnitude, ties to even: the magnitudes are evenly spaced within each binade ({0, .5, 1, 1.5} by
    # 0.5, {2, 3} by 1, {4, 6} by 2) and an even code is an even multiple of the binade's step, so rint (ties to even)
    # on a / step picks the code the OCP rule picks; above 6 it saturates.
    v = np.where(a < 2, np.rint(a * 2) * 0.5, np.where(a < 4, np.rint(a), np.minimum(np.rint(a * 0.5) * 2, 6)))
    mag = np.where(v < 2, v * 2, np.where(v < 4, v + 2, v * 0.5 + 4)).astype(np.uint8)  # magnitude -> code 0..7
    code = np.where((q < 0) & (mag > 0), mag | 8, mag).reshape(R, C)
    packed = np.ascontiguousarray((code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8))
    scale = np.ascontiguousarray(byte.astype(np.uint8))
    if is_torch_tensor(w):
        return to_torch(packed), to_torch(scale)
    return packed, scale
