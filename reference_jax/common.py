"""Small pure helpers shared by every reference module: dtype policy, linear, RMSNorm, packed-document masks.

Dtype policy (whole reference): parameters and activations arrive in the run dtype (fp32 by default, fp64 under
``jax.enable_x64``); bf16 inputs are upcast to fp32 for the math (``compute_dtype``). Nothing here is jitted (the only ``jax.jit`` in the reference is a compile cache on a few KDA
helpers; see docs/design.md).
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "compute_dtype",
    "linear",
    "rms_norm",
    "check_cu_seqlens",
    "segment_ids",
    "causal_document_mask",
    "Linear",
    "RMSNorm",
    "ACTIVATION_DTYPES",
    "TOKEN_ID_DTYPES",
    "check_activation_dtype",
    "check_token_ids",
    "Weight",
]


def compute_dtype(*xs: jax.Array) -> jnp.dtype:
    """The dtype the math of a group of inputs runs in: fp64 if any input is fp64, else fp32 (bf16/fp16 upcast).

    The one dtype-promotion rule of the reference (the twin of ``kernels_torch.common.compute_dtype``).
    """
    dtypes = [x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype for x in xs]
    return jnp.dtype(jnp.float64 if any(d == jnp.float64 for d in dtypes) else jnp.float32)


def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``y = x Wᵀ`` with ``weight`` in the checkpoint's torch layout ``[out, in]``; x ``[..., in]`` -> ``[..., out]``."""
    return jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype))


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """Kimi/DeepSeek RMSNorm over the last axis: ``(x * rsqrt(mean(x²) + eps))`` in fp32 (fp64 for fp64 input),
    cast back to ``x.dtype``, **then** multiplied by ``weight`` (spec 3.4). ``weight=None``: no scale."""
    xf = x.astype(compute_dtype(x))
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return y if weight is None else y * weight.astype(x.dtype)


def check_cu_seqlens(cu_seqlens, T: int, B: int = 1) -> np.ndarray:
    """Validate packed-document boundaries and return them as an int64 numpy array.

    ``cu_seqlens``: [N+1] int, starts at 0, strictly increasing (no empty document), ends at ``T``; needs ``B == 1``.

    ``cu_seqlens`` must be concrete (a list, numpy array or concrete jax array), also under ``jax.jit``: the
    boundaries decide array shapes (the per-document loops), so a traced value cannot be honoured. Close over it,
    or mark it static (``jax.jit(f, static_argnames=...)`` with a tuple).

    Raises:
        ValueError: naming ``cu_seqlens``, the value and the expectation; a traced ``cu_seqlens`` (under ``jax.jit``,
            ``vmap`` or ``grad``) says it must be concrete.
    """
    if isinstance(cu_seqlens, jax.core.Tracer):
        raise ValueError(
            f"cu_seqlens: got a traced array ({cu_seqlens.aval}, e.g. an argument of jax.jit), expected a concrete "
            "one (a Python list or numpy array): the document boundaries set array shapes. Close over it or pass it "
            "as a static argument (a tuple)"
        )
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(
            f"cu_seqlens: got {cu.tolist()!r} ({cu.dtype}), expected a 1-D integer array [0, ..., T] of length >= 2"
        )
    if B != 1:
        raise ValueError(f"cu_seqlens: given with batch size {B}, expected batch size 1 (documents packed in one row)")
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens: got {cu.tolist()}, expected to start at 0 and end at T={T}")
    if np.any(np.diff(cu) <= 0):
        raise ValueError(f"cu_seqlens: got {cu.tolist()}, expected strictly increasing offsets (no empty document)")
    return cu.astype(np.int64)


def segment_ids(cu_seqlens, T: int) -> jax.Array:
    """Document index of every token, ``[T]`` int32; all zeros when ``cu_seqlens`` is None."""
    if cu_seqlens is None:
        return jnp.zeros((T,), jnp.int32)
    cu = check_cu_seqlens(cu_seqlens, T)
    return jnp.asarray(np.searchsorted(cu[1:], np.arange(T), side="right"), jnp.int32)


def causal_document_mask(T: int, cu_seqlens=None, S: int | None = None) -> jax.Array:
    """``[T, S]`` bool: query t may see key s iff ``s <= t`` and both lie in the same document (S defaults to T)."""
    S = T if S is None else S
    t = jnp.arange(T)[:, None]
    s = jnp.arange(S)[None, :]
    seg = segment_ids(cu_seqlens, T)
    return (s <= t) & (seg[:, None] == seg[None, :S])


class Linear(nn.Module):
    """Bias-free linear layer whose only parameter is ``weight`` ``[out, in]`` (torch layout, checkpoint name)."""

    features: int
    in_features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("weight", nn.initializers.normal(self.in_features**-0.5), (self.features, self.in_features))
        return linear(x, w)


class Weight(nn.Module):
    """A bare parameter named ``weight`` of ``shape`` (checkpoint name), returned by calling the module: AttnRes
    ``*_res_norm`` vectors ``[D]`` (init ones) and MLA's ``kv_b_proj`` ``[out, in]`` where the absorbed form needs it
    as a matrix (init as :class:`Linear`)."""

    shape: tuple[int, ...]
    initializer: Callable = nn.initializers.ones

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("weight", self.initializer, self.shape)


class RMSNorm(nn.Module):
    """RMSNorm with one parameter ``weight`` ``[dim]`` (checkpoint name); see :func:`rms_norm`."""

    dim: int
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.param("weight", nn.initializers.ones, (self.dim,)), self.eps)


ACTIVATION_DTYPES = ("bfloat16", "float16", "float32", "float64")  # what every layer accepts as x
TOKEN_ID_DTYPES = ("int32", "int64")  # what the model accepts as input_ids


def check_activation_dtype(x: jax.Array, where: str, name: str = "x") -> None:
    """Refuse a non-float activation on entry to a layer (twin of ``kernels_torch.common.check_activation_dtype``).

    Raises:
        ValueError: ``{where}: {name} has dtype ..., expected one of bfloat16, float16, float32, float64``.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None or jnp.dtype(dtype).name not in ACTIVATION_DTYPES:
        got = dtype if dtype is not None else type(x).__name__
        raise ValueError(f"{where}: {name} has dtype {got}, expected one of {', '.join(ACTIVATION_DTYPES)}")


def check_token_ids(input_ids, vocab_size: int) -> jax.Array:
    """Token ids ``[B, T]`` int32/int64 in ``[0, vocab_size)``; returns them as a jax array.

    Raises:
        ValueError: a wrong shape, a dtype other than int32/int64 (uint8, bool, float ... are refused), or ids out of
            range (checked for concrete ids; under ``jax.jit`` the ids are traced and the range is not known).
    """
    ids = jnp.asarray(input_ids)
    if ids.ndim != 2 or ids.size == 0:
        raise ValueError(f"input_ids: got shape {tuple(ids.shape)}, expected [B, T] with B, T >= 1")
    if ids.dtype.name not in TOKEN_ID_DTYPES:
        raise ValueError(f"input_ids: got dtype {ids.dtype}, expected integer token ids ({', '.join(TOKEN_ID_DTYPES)})")
    lo, hi = (0, 0) if isinstance(ids, jax.core.Tracer) else (int(ids.min()), int(ids.max()))  # unknown under jit
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"input_ids: got ids in [{lo}, {hi}], expected ids in [0, {vocab_size})")
    return ids
