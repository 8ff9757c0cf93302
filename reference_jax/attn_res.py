"""Block Attention Residuals (AttnRes): the depth-mixing operator, JAX reference (spec 5.4).

Only the operator lives here. The block recurrence, and the per-layer parameters
``self_attention_res_norm.weight`` ``[D]`` / ``self_attention_res_proj.weight`` ``[1, D]`` (and ``mlp_res_*``,
``model.output_attn_res_*``), belong to the model assembler, which calls :func:`attn_res_mix`.

The recurrence (spec 5.4), with ``blocks`` an empty list and ``p`` the token embedding at the start, for every layer
``l``:

1. ``h = Mix(blocks + [p]; self_attention_res_*)`` (``h = p`` while ``blocks`` is empty);
2. if ``l % attn_res_block_size == 0``: append ``p`` to ``blocks`` and restart ``p`` (empty);
3. ``a = Attn(input_layernorm(h))``; 4. ``p = a`` after a restart, else ``p = p + a``;
5. ``h' = Mix(blocks + [p]; mlp_res_*)``; 6. ``m = MLP(post_attention_layernorm(h'))``; 7. ``p = p + m``.

After the last layer ``h_out = Mix(blocks + [p]; output_attn_res_*)``, then ``model.norm`` and ``lm_head``.

Worked example, the ``tiny`` preset (9 layers, block size 4): the block-write layers are 0, 4 and 8.

* layer 0: attention input = the embedding ``x`` (one source); ``blocks = [x]``; ``p = a0``; MLP input =
  ``Mix([x, a0])``; ``p = a0 + m0``;
* layers 1-3: both mixes see ``[x, p]`` with ``p`` the running sum of the outputs of layers 0..l;
* layer 4: attention input = ``Mix([x, p_0..3])``, then ``blocks = [x, p_0..3]`` and ``p`` restarts at ``a4``;
  the MLP mix sees ``[x, p_0..3, a4]``;
* layer 8: ``blocks = [x, p_0..3, p_4..7]``, ``p`` restarts at ``a8``;
* the output mix sees 4 sources ``[x, p_0..3, p_4..7, p_8]``.

K3 (93 layers, block size 12) writes at 0, 12, ..., 84: 8 stored blocks and 9 sources in the output mix.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from reference_jax.common import compute_dtype

__all__ = ["attn_res_weights", "attn_res_mix"]


def _stack(sources: Sequence[jax.Array] | jax.Array) -> jax.Array:
    if isinstance(sources, (list, tuple)):
        if not sources:
            raise ValueError("attn_res_mix: got no sources, expected at least one [B, T, D] tensor")
        shapes = {tuple(s.shape) for s in sources}
        dtypes = {jnp.dtype(s.dtype) for s in sources}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(
                f"attn_res_mix: sources have shapes {sorted(shapes)} and dtypes {sorted(map(str, dtypes))}, "
                "expected one shape and one dtype"
            )
        return jnp.stack(sources)  # [M, B, T, D]
    if sources.ndim < 2 or sources.shape[0] < 1:
        raise ValueError(f"attn_res_mix: stacked sources have shape {sources.shape}, expected [M >= 1, ..., D]")
    return sources


def attn_res_weights(
    sources: Sequence[jax.Array] | jax.Array, norm_weight: jax.Array, proj_weight: jax.Array, eps: float = 1e-5
) -> jax.Array:
    """The depth-softmax ``π`` of :func:`attn_res_mix`: ``[M, B, T]`` in fp32 (fp64 for fp64 sources), summing to 1
    over M. Arguments and errors as :func:`attn_res_mix`."""
    V = _stack(sources)  # [M, B, T, D]
    D = V.shape[-1]
    if tuple(norm_weight.shape) != (D,) or tuple(proj_weight.shape) not in ((1, D), (D,)):
        raise ValueError(
            f"attn_res_mix: norm_weight {tuple(norm_weight.shape)} and proj_weight "
            f"{tuple(proj_weight.shape)}, expected ({D},) and (1, {D})"
        )
    cd = compute_dtype(V)
    Vf = V.astype(cd)
    key = Vf * jax.lax.rsqrt(jnp.mean(Vf * Vf, axis=-1, keepdims=True) + eps)  # [M, B, T, D], RMS-normalised, no weight
    query = norm_weight.astype(cd) * proj_weight.reshape(D).astype(cd)  # [D], the learned pseudo-query n ⊙ p
    score = jnp.einsum("m...d,d->m...", key, query)  # [M, B, T]; no temperature, no 1/sqrt(D)
    return jax.nn.softmax(score, axis=0)  # over depth


def attn_res_mix(
    sources: Sequence[jax.Array] | jax.Array, norm_weight: jax.Array, proj_weight: jax.Array, eps: float = 1e-5
) -> jax.Array:
    """AttnRes ``Mix(V; n, p)`` (spec 5.4): a learned softmax over depth of the candidate sources.

    ``key_i = v_i · rsqrt(mean(v_i²) + eps)``; ``score_i = ⟨key_i, n ⊙ p⟩``; ``π = softmax_i(score_i)``;
    ``out = Σ_i π_i · v_i`` (the raw, un-normalised sources). All in fp32 (fp64 for fp64 sources), cast back.

    Args:
        sources: a list of M tensors ``[B, T, D]`` (the stored blocks, then the current partial sum last), or one
            stacked ``[M, B, T, D]`` array; one dtype.
        norm_weight: ``[D]`` (``*_res_norm.weight``).
        proj_weight: ``[1, D]`` (``*_res_proj.weight``; ``[D]`` accepted).
        eps: the key RMS-norm eps (``rms_norm_eps``, 1e-5).

    Returns:
        ``[B, T, D]`` in the sources' dtype. With one source it is that source, unchanged.

    Raises:
        ValueError: no sources, sources of different shapes/dtypes, or weights not ``[D]`` / ``[1, D]``.
    """
    V = _stack(sources)  # [M, B, T, D]
    pi = attn_res_weights(V, norm_weight, proj_weight, eps)  # [M, B, T]
    if V.shape[0] == 1:
        return V[0]
    out = jnp.einsum("m...,m...d->...d", pi, V.astype(pi.dtype))  # [B, T, D]
    return out.astype(V.dtype)
