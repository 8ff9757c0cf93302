"""Gated MLA with NoPE (Kimi K3) and its DSA-sparse variant (K3.1 Pro): the dense-mask reference.

Spec: ``../shared/spec/architecture.md`` 3.1-3.4 (MLA), 4.3 (how the indexer's top-k feeds the attention), 9.
Notable:

* **NoPE**: the 64-dim (``qk_rope_head_dim``) ``k_pe`` is never rotated and never normalised; one ``k_pe`` per token is
  broadcast to all heads. ``q_pe`` is just the last ``qk_rope_head_dim`` columns of each query head.
* **Softmax scale** is ``(qk_nope + qk_rope)^-1/2`` (192^-1/2 for K3) in the expanded *and* the absorbed form, never
  ``(kv_lora_rank + qk_rope)^-1/2`` (case 15).
* **Output gate** ``o * sigmoid(g_proj(x))`` reads the same normalised layer input x as ``q_a_proj``. In MLA layers
  ``g_proj`` is this ``[H*V, D]`` output gate; in KDA layers a tensor with the same name is KDA's output gate (case 18).
* **DSA**: attention mask = causal & same document & selected. The causal mask is re-applied after selection (spec 4.3:
  a dense top-k may return masked slots); with T <= index_topk every visible key is selected and the layer equals dense
  causal MLA exactly.
* A query row with no visible key gives 0, never NaN. Softmax, norms and the gate run in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kimi.config import KimiConfig
from reference_jax.common import (
    Linear,
    RMSNorm,
    Weight,
    causal_document_mask,
    check_activation_dtype,
    check_cu_seqlens,
    compute_dtype,
    linear,
)
from reference_jax.indexer import Indexer, sparse_mask
from reference_jax.kv_cache import MLACache, cached_causal_mask, write_rows

__all__ = ["mla_attention", "mla_attention_absorbed", "GatedMLA"]

_HI = jax.lax.Precision.HIGHEST
_FORMS = ("expanded", "absorbed")


def _masked_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis of ``logits`` ``[B, H, T, S]`` where ``mask`` ``[B, 1, T, S]`` is True.

    Masked entries are exactly 0; a row with no True entry is all 0 (not NaN: its max would be -inf)."""
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom > 0, denom, 1.0)


# Long sequences are attended in blocks of query rows. The math is unchanged (rows are independent); it only keeps
# the [B, H, T, S] fp32 logits from existing all at once (at T = S = 8192 and H = 96 that is 26 GB per temporary).
_ROW_BLOCK = 2048


def _row_blocks(T: int) -> list[slice]:
    return [slice(t0, min(t0 + _ROW_BLOCK, T)) for t0 in range(0, T, _ROW_BLOCK)]


def _mask4(mask: jax.Array, B: int, T: int, S: int) -> jax.Array:
    """``[T, S]`` or ``[B, T, S]`` bool -> ``[B, 1, T, S]``; ValueError on any other shape."""
    if mask.shape not in ((T, S), (B, T, S)):
        raise ValueError(f"mask: got shape {tuple(mask.shape)}, expected {(T, S)} or {(B, T, S)}")
    return jnp.broadcast_to(mask.astype(jnp.bool_), (B, T, S))[:, None]


def mla_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Expanded-form MLA attention: dense masked softmax attention with per-head keys (spec 3.2 step 5).

    Args:
        q: ``[B, T, H, K]`` queries ``[q_nope ‖ q_pe]``; k: ``[B, S, H, K]`` keys ``[k_nope ‖ k_pe]``;
        v: ``[B, S, H, V]`` (V may differ from K).
        mask: ``[T, S]`` or ``[B, T, S]`` bool, True = attend.
        scale: softmax scale, ``config.mla_softmax_scale`` = (qk_nope + qk_rope)^-1/2.

    Returns:
        ``o`` ``[B, T, H, V]`` in ``v.dtype``; logits and softmax in fp32 (fp64 for fp64 inputs). Rows with no visible
        key are 0.

    Raises:
        ValueError: a mask of the wrong shape.
    """
    B, T, H, _ = q.shape
    S = k.shape[1]
    dt = compute_dtype(q, v)
    mask4 = _mask4(mask, B, T, S)
    k, v = k.astype(dt), v.astype(dt)
    out = []
    for rows in _row_blocks(T):  # query rows are independent: one block unless T > _ROW_BLOCK
        logits = jnp.einsum("bthk,bshk->bhts", q[:, rows].astype(dt), k, precision=_HI) * scale  # [B, H, t, S]
        p = _masked_softmax(logits, mask4[:, :, rows])  # [B, H, t, S]
        out.append(jnp.einsum("bhts,bshv->bthv", p, v, precision=_HI))
    return jnp.concatenate(out, axis=1).astype(v.dtype)


def mla_attention_absorbed(
    q_nope: jax.Array,
    q_pe: jax.Array,
    c_kv: jax.Array,
    k_pe: jax.Array,
    kv_b_weight: jax.Array,
    mask: jax.Array,
    scale: float,
) -> jax.Array:
    """Absorbed (MQA-over-latent) MLA attention (spec 3.3), equal to :func:`mla_attention` in exact arithmetic.

    Per head h, with ``W_UK_h``/``W_UV_h`` the first ``K_nope``/last ``V`` rows of ``kv_b_weight`` viewed as
    ``[H, K_nope + V, L]``: query ``[W_UK_hᵀ q_nope_h ‖ q_pe_h]`` (L + R wide) against the shared key ``[c_s ‖ k_pe_s]``,
    values ``c_s`` (L wide), result up-projected by ``W_UV_h``.

    Args:
        q_nope: ``[B, T, H, K_nope]``; q_pe: ``[B, T, H, R]``.
        c_kv: ``[B, S, L]`` the latent after ``kv_a_layernorm``; k_pe: ``[B, S, R]`` (raw, not rotated).
        kv_b_weight: ``kv_b_proj.weight`` ``[H * (K_nope + V), L]``.
        mask: ``[T, S]`` or ``[B, T, S]`` bool, True = attend.
        scale: **still** ``(K_nope + R)^-1/2`` (192^-1/2), not ``(L + R)^-1/2`` (case 15).

    Returns:
        ``o`` ``[B, T, H, V]`` in ``c_kv.dtype``; rows with no visible key are 0.

    Raises:
        ValueError: a mask of the wrong shape or a ``kv_b_weight`` that does not match the head widths.
    """
    B, T, H, Kn = q_nope.shape
    S, L = c_kv.shape[1:]
    rows = kv_b_weight.shape[0]
    if rows % H or rows // H <= Kn or kv_b_weight.shape[1] != L:
        raise ValueError(
            f"kv_b_weight: got shape {tuple(kv_b_weight.shape)}, expected [H*(K_nope+V), L] with "
            f"H={H}, K_nope={Kn}, L={L}"
        )
    dt = compute_dtype(q_nope, c_kv)
    w = kv_b_weight.astype(dt).reshape(H, rows // H, L)
    w_uk, w_uv = w[:, :Kn], w[:, Kn:]  # [H, K_nope, L], [H, V, L]
    q_lat = jnp.einsum("bthk,hkl->bthl", q_nope.astype(dt), w_uk, precision=_HI)  # [B, T, H, L]
    q_abs = jnp.concatenate([q_lat, q_pe.astype(dt)], axis=-1)  # [B, T, H, L+R]
    k_abs = jnp.concatenate([c_kv.astype(dt), k_pe.astype(dt)], axis=-1)  # [B, S, L+R], one KV head
    mask4 = _mask4(mask, B, T, S)
    o_lat = []
    for rows in _row_blocks(T):  # query rows are independent: one block unless T > _ROW_BLOCK
        logits = jnp.einsum("bthk,bsk->bhts", q_abs[:, rows], k_abs, precision=_HI) * scale  # [B, H, t, S]
        p = _masked_softmax(logits, mask4[:, :, rows])
        o_lat.append(jnp.einsum("bhts,bsl->bthl", p, c_kv.astype(dt), precision=_HI))  # [B, t, H, L]
    o_lat = jnp.concatenate(o_lat, axis=1)  # [B, T, H, L]
    return jnp.einsum("bthl,hvl->bthv", o_lat, w_uv, precision=_HI).astype(c_kv.dtype)  # [B, T, H, V]


class GatedMLA(nn.Module):
    """Gated NoPE MLA layer (spec 3.2), with the DSA indexer (spec 4) when ``config.layer_type(layer_idx) == "dsa"``.

    Params (``self_attn.``-relative checkpoint names, see ``kimi.layout.param_layout``): ``q_a_proj``,
    ``q_a_layernorm`` (RMSNorm, eps ``mla_norm_eps``), ``q_b_proj`` -- or ``q_proj`` when ``q_lora_rank`` is None --,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm`` (eps ``mla_norm_eps``), ``kv_b_proj``, ``g_proj`` (when
    ``mla_use_output_gate``), ``o_proj``, ``indexer`` (DSA layers).

    Call ``(x, cu_seqlens=None, form="expanded", return_aux=False, cache=None, cache_pos=None, lengths=None)``:
        x: ``[B, T, D]`` the normalised layer input; cu_seqlens: ``[N+1]`` packed-document offsets (B = 1) or None;
        form: "expanded" (HF/training) or "absorbed" (MQA over the latent; same mask and scale).
        Returns ``out`` ``[B, T, D]`` in ``x.dtype``; with ``return_aux`` also a dict, holding ``topk_indices``
        ``[B, T, min(index_topk, T)]`` int32 and ``index_scores`` ``[B, T, T]`` fp32 for DSA layers (empty otherwise).
        With ``cache`` (a ``reference_jax.cache.MLACache``, ``cache_pos`` and ``lengths`` ``[B]`` ints) the keys are
        the cached rows plus this call's (S = ``S_max``, the capacity, with the causal mask), and the call returns ``(out, new_cache)``
        (``(out, aux, new_cache)`` with ``return_aux``).

    Raises:
        ValueError: ``layer_idx`` is a KDA layer, an unknown ``form``, malformed ``cu_seqlens``, ``x`` not a float
            array (bf16, fp16, fp32, fp64).
    """

    config: KimiConfig
    layer_idx: int

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        cu_seqlens=None,
        form: str = "expanded",
        return_aux: bool = False,
        cache: MLACache | None = None,
        cache_pos=None,
        lengths=None,
    ):
        c = self.config
        kind = c.layer_type(self.layer_idx)
        if kind == "kda":
            raise ValueError(
                f"layer_idx: got {self.layer_idx}, a KDA layer; GatedMLA needs an 'mla' or 'dsa' layer "
                "(g_proj means the KDA output gate there, case 18)"
            )
        check_activation_dtype(x, "GatedMLA")
        if form not in _FORMS:
            raise ValueError(f"form: got {form!r}, expected one of {list(_FORMS)}")
        B, T, D = x.shape
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, T, B)
        H, Kn, R, V, L = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank

        # 1. queries (spec 3.2 step 1); c_q also feeds the indexer's wq_b
        if c.q_lora_rank is None:
            c_q = x
            q = Linear(H * (Kn + R), D, name="q_proj")(x)
        else:
            c_q = RMSNorm(c.q_lora_rank, c.mla_norm_eps, name="q_a_layernorm")(
                Linear(c.q_lora_rank, D, name="q_a_proj")(x)
            )  # [B, T, q_lora_rank]
            q = Linear(H * (Kn + R), c.q_lora_rank, name="q_b_proj")(c_q)
        q = q.reshape(B, T, H, Kn + R)  # [B, T, H, Kn+R]
        q_nope, q_pe = q[..., :Kn], q[..., Kn:]

        # 2. latent and the shared k_pe (NoPE: k_pe is neither normalised nor rotated)
        kv = Linear(L + R, D, name="kv_a_proj_with_mqa")(x)  # [B, S, L+R]
        c_kv = RMSNorm(L, c.mla_norm_eps, name="kv_a_layernorm")(kv[..., :L])  # [B, S, L]
        k_pe = kv[..., L:]  # [B, S, R]
        w_kv_b = Weight((H * (Kn + V), L), nn.initializers.normal(L**-0.5), name="kv_b_proj")()  # [H*(Kn+V), L]

        # mask: causal & same document, & selected for DSA layers
        if cache is None:  # keys = this call's tokens
            S, keys_c_kv, keys_k_pe = T, c_kv, k_pe
            mask = causal_document_mask(T, cu_seqlens)[None]  # [1, T, S]
        else:  # keys = the cached rows then this call's (reference_jax.cache): query t of row n sits at pos[n] + t
            cache = cache._replace(
                c_kv=write_rows(cache.c_kv, c_kv, cache_pos, lengths),
                k_pe=write_rows(cache.k_pe, k_pe, cache_pos, lengths),
            )
            S = cache.c_kv.shape[1]  # the whole capacity, masked: static shapes from step to step
            keys_c_kv, keys_k_pe = cache.c_kv, cache.k_pe  # [B, S, L], [B, S, R]
            mask = cached_causal_mask(cache_pos, T, S)  # [B, T, S]
        aux: dict = {}
        if kind == "dsa":
            if cache is None:
                topk, scores = Indexer(c, name="indexer")(x, c_q, cu_seqlens)
            else:
                topk, scores, index_k = Indexer(c, name="indexer")(x, c_q, None, cache.index_k, cache_pos, lengths)
                cache = cache._replace(index_k=index_k)
            # Re-apply the causal/document mask after selection (spec 4.3), never trust the indices alone.
            mask = mask & sparse_mask(topk, S)  # [B, T, S]
            aux = {"topk_indices": topk, "index_scores": scores}

        mask = jnp.broadcast_to(mask, (B, T, S))
        scale = c.mla_softmax_scale  # (Kn + R)^-1/2 in both forms (case 15)
        if form == "expanded":
            kvb = linear(keys_c_kv, w_kv_b).reshape(B, S, H, Kn + V)  # 3. [B, S, H, Kn+V]
            k_nope, v = kvb[..., :Kn], kvb[..., Kn:]
            k = jnp.concatenate([k_nope, jnp.broadcast_to(keys_k_pe[:, :, None, :], (B, S, H, R))], axis=-1)  # 4.
            o = mla_attention(q, k, v, mask, scale)  # 5. [B, T, H, V]
        else:
            o = mla_attention_absorbed(q_nope, q_pe, keys_c_kv, keys_k_pe, w_kv_b, mask, scale)  # [B, T, H, V]
        o = o.reshape(B, T, H * V)  # 6.

        if c.mla_use_output_gate:  # 7. sigmoid gate on the same x, in fp32
            g = Linear(H * V, D, name="g_proj")(x)
            dt = compute_dtype(o)
            o = (o.astype(dt) * jax.nn.sigmoid(g.astype(dt))).astype(x.dtype)
        out = Linear(D, H * V, name="o_proj")(o.astype(x.dtype))  # 8. [B, T, D]
        if cache is not None:
            return (out, aux, cache) if return_aux else (out, cache)
        return (out, aux) if return_aux else out
