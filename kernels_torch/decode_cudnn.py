"""Cached calls (chunked prefill and decode) of the ``cudnn`` backend: KDA through fla's recurrent kernel, DSA through
the indexer over the cached keys and sparse MLA over the selected latent rows. GPU path of ``kernels_torch.cache``.

Pieces (spec 2.2 and 2.4 for KDA; 3.3, 4.2, 4.3 and 9 for MLA/DSA):

* :func:`kda_decode_fla` (``T == 1``): short conv + SiLU from the cached window (torch, fp32), the gate
  (``kda_gate``, fp32) and beta, then fla's ``fused_recurrent_kda`` with the q/k L2 norm in the kernel, from the
  cached state ``S`` ``[N, H, K, V]`` fp32 (fla's K-first layout, as ``chunk_kda``), then the gated RMSNorm and
  ``o_proj``. Longer calls (chunked prefill) run the layer's own chunk path (fla's ``chunk_kda``) with the cache.
* :func:`gated_mla_cached`: the new latent rows ``[c_kv ‖ k_pe]`` and, on DSA layers, indexer keys are written into
  the cache in place; the indexer scores every cached key (``indexer_scores``, fp32, query-row chunks) under the
  cached causal mask and picks the canonical top-k (``topk_indices``: score descending, ties to the larger key
  index, spec 9); the absorbed queries attend over the selected rows with :func:`kernels_torch.dsa_cudnn.sparse_mla`
  (``sparse_mla_fwd`` for the real 576/512 dims in bf16: FlashMLA's sparse kernel where it runs, else our Triton
  kernel, as ``kernel_choice`` picks; its torch twin otherwise). FlashMLA's own sparse decode kernel reads only an
  FP8 KV cache, and this cache is bf16, so decode rows go through the same sparse kernel as prefill. Decode gathers only
  the selected rows (``[N*T*k, 576]``); long prefill chunks hand the kernel each sequence's rows once with global ids
  (whichever is fewer rows). MLA layers without an indexer attend densely in the absorbed form with SDPA.
  The softmax scale stays ``config.mla_softmax_scale`` (192^-1/2), never 576^-1/2 (case 15).

Static-shape decode (``kernels_torch.decode``: one token per row, positions on the device, capturable):

* :func:`kda_decode_inplace`: the layer's projections (cuBLAS), then one of (``kda_kernel``): ``triton``, our fused
  kernel ``kernels_torch.ops.kda_decode`` (conv update + SiLU, L2 norms, gate, beta, delta rule and gated RMSNorm in
  one launch; no library has that fusion for this layout: fla 0.6 has the recurrence with the gate, beta and norms in
  ``fused_recurrent_kda_fwd`` and a separate conv update over ``[N, D, W]`` windows, cuDNN FE no KDA decode);
  ``fla``, the conv in torch and fla's ``fused_recurrent_kda_fwd`` with the gate, beta and q/k norms in the kernel
  and the state updated in place; ``torch``, the layer's own recurrence; ``auto``, Triton where it runs, else fla.
  Then the gated RMSNorm (except on ``triton``) and ``o_proj``. Windows and state are written in place.
* :func:`gated_mla_decode_static`: the new latent row ``[c_kv ‖ k_pe]`` and indexer key written at ``pos``, the
  indexer over all ``S_max`` cached keys under the mask ``s <= pos``, the canonical top-k, then the sparse kernel over
  the cache's latent buffer in place (ids ``n * S_max + s``: no gather); MLA layers without an indexer attend densely
  (SDPA, absorbed form).

All run under ``torch.no_grad()`` (generation); ``tests/gpu/test_gpu_generate.py`` checks them against ``eager`` and
``tests/gpu/test_gpu_generate_captured.py`` the captured step against the uncaptured one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels_torch.common import effective_weight
from kernels_torch.indexer import indexer_scores, topk_indices
from kernels_torch.kda import A_LOG_MAX, G_MIN, KDACache, kda_gate, short_conv
from kernels_torch.kv_cache import cached_causal_mask, key_count, write_rows, write_token

__all__ = ["kda_decode_fla", "gated_mla_cached", "kda_decode_inplace", "gated_mla_decode_static"]


def _linear(x: torch.Tensor, layer) -> torch.Tensor:
    """``x Wᵀ`` in the activation dtype (the weight follows ``x.dtype``), as the KDA layer projects; a LoRA-wrapped
    layer (peft ``LoraLayer``, whose ``.weight`` is the base weight alone) runs its own forward."""
    if hasattr(layer, "base_layer"):
        return layer(x)
    return F.linear(x, layer.weight.to(x.dtype))


def kda_decode_fla(layer, x: torch.Tensor, cache: KDACache) -> tuple[torch.Tensor, KDACache]:
    """One decode token of a ``KimiDeltaAttention`` on fla's ``fused_recurrent_kda``.

    Args:
        layer: the KDA layer (its weights); x ``[N, 1, D]`` (bf16 on CUDA for the real path); cache: a ``KDACache``
            with ``N`` rows (conv windows ``[N, P, W-1]``, ``S`` ``[N, H, K, V]`` fp32).

    Returns:
        ``(out [N, 1, D] in x.dtype, new KDACache)``; fla may update ``cache.S`` in place (``inplace_final_state``).

    Raises:
        ValueError: ``x`` with ``T != 1``.
    """
    from fla.ops.kda import fused_recurrent_kda

    c = layer.config
    N, T, _ = x.shape
    if T != 1:
        raise ValueError(f"x: got {T} tokens, expected 1 (decode); longer calls run the chunk path")
    H, K = c.kda_num_heads, c.kda_head_dim
    q, cq = short_conv(_linear(x, layer.q_proj), layer.q_conv1d.weight, None, cache.conv_q)  # [N, 1, P]
    k, ck = short_conv(_linear(x, layer.k_proj), layer.k_conv1d.weight, None, cache.conv_k)
    v, cv = short_conv(_linear(x, layer.v_proj), layer.v_conv1d.weight, None, cache.conv_v)
    q, k, v = (t.reshape(N, 1, H, K) for t in (q, k, v))  # v: [N, 1, H, V], V = K
    f = _linear(_linear(x, layer.f_a_proj), layer.f_b_proj).reshape(N, 1, H, K)
    g = kda_gate(f, layer.A_log, layer.dt_bias, c.gate_lower_bound)  # fp32 (case 2)
    beta = torch.sigmoid(_linear(x, layer.b_proj).float())  # [N, 1, H]: the one sigmoid on beta (case 3)
    o, S = fused_recurrent_kda(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=K**-0.5,
        initial_state=cache.S.float().contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # o [N, 1, H, V], S [N, H, K, V] fp32
    gate = _linear(x, layer.g_proj) if c.use_full_rank_gate else _linear(_linear(x, layer.g_a_proj), layer.g_b_proj)
    y = layer.o_norm(o, gate.reshape(N, 1, H, K)).to(x.dtype).reshape(N, 1, H * K)
    return _linear(y, layer.o_proj), KDACache(cq, ck, cv, S)


def gated_mla_cached(layer, x: torch.Tensor, cache, cache_pos: torch.Tensor, lengths: torch.Tensor, return_aux=False):
    """``GatedMLA.forward`` with a cache under ``backend="cudnn"`` (see the module docstring).

    Args:
        layer: the ``GatedMLA``; x ``[N, T, D]``; cache: its ``MLACache`` (written in place); cache_pos, lengths:
            ``[N]`` int64 (``kernels_torch.cache``).

    Returns:
        ``(out [N, T, D], cache)``, or ``(out, aux, cache)`` with ``return_aux`` (``topk_indices`` ``[N, T, k]``
        int32 on DSA layers, ``index_scores`` None).
    """
    from kernels_torch.dsa_cudnn import sparse_mla

    c = layer.config
    N, T, _ = x.shape
    H, Kn, V, L = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    scale = c.mla_softmax_scale  # (Kn + R)^-1/2 (case 15)
    c_q, q, q_nope, q_pe, c_kv, k_pe = layer.project(x)
    write_rows(cache.c_kv, c_kv, cache_pos, lengths)
    write_rows(cache.k_pe, k_pe, cache_pos, lengths)
    S = key_count(cache_pos, lengths)
    mask = cached_causal_mask(cache_pos, T, S, device=x.device)  # [N, T, S]
    w = effective_weight(layer.kv_b_proj).view(H, Kn + V, L)
    w_uk, w_uv = w[:, :Kn], w[:, Kn:]  # [H, Kn, L], [H, V, L]
    aux: dict = {}
    if layer.kind != "dsa":
        o = _absorbed_sdpa(q_nope, q_pe, cache.c_kv[:, :S], cache.k_pe[:, :S], w_uk, w_uv, mask, scale)
    else:
        _refuse_indexer_rope(c)
        q_I, k_I, weights = layer.indexer.projections(x, c_q)
        write_rows(cache.index_k, k_I, cache_pos, lengths)
        scores = indexer_scores(q_I, cache.index_k[:, :S], weights)  # [N, T, S] fp32
        idx = topk_indices(scores, mask, c.index_topk)  # [N, T, k] int32, -1 last
        k = idx.shape[-1]
        q_abs = torch.cat([torch.einsum("nthk,hkl->nthl", q_nope, w_uk.to(q.dtype)), q_pe], dim=-1)  # [N,T,H,L+R]
        if T * k <= S:  # decode: gather the selected rows only, [N*T*k, L+R], ids local to that gather
            b = torch.arange(N, device=x.device)[:, None, None]
            sel = idx.clamp_min(0).long()
            rows = torch.cat([cache.c_kv[b, sel], cache.k_pe[b, sel]], dim=-1).reshape(N * T * k, -1)
            ids = torch.arange(N * T * k, device=x.device, dtype=torch.int32).view(N, T, k)
        else:  # long prefill chunks: each sequence's rows once, [N*S, L+R], ids offset by row
            rows = torch.cat([cache.c_kv[:, :S], cache.k_pe[:, :S]], dim=-1).reshape(N * S, -1)
            ids = idx + (torch.arange(N, device=x.device, dtype=torch.int32) * S)[:, None, None]
        ids = torch.where(idx >= 0, ids, -1).to(torch.int32).reshape(N * T, k)
        tlen = (idx >= 0).sum(-1).to(torch.int32).reshape(N * T)
        kernel = getattr(layer, "sparse_kernel", None)  # kernels_torch.kernel_choice
        o_lat = sparse_mla(q_abs.reshape(N * T, H, -1).contiguous(), rows.contiguous(), ids, tlen, scale, L, kernel)
        o = torch.einsum("nhl,hvl->nhv", o_lat, w_uv.to(o_lat.dtype)).view(N, T, H, V)
        aux = {"topk_indices": idx, "index_scores": None}
    out = layer.gate_and_project_out(o, x)
    return (out, aux, cache) if return_aux else (out, cache)


def _absorbed_sdpa(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, mask, scale):
    """Dense absorbed MLA (spec 3.3) on SDPA, as ``kernels_torch.mla.mla_attention_absorbed(backend="sdpa")``:
    q_nope ``[N, T, H, Kn]``, q_pe ``[N, T, H, R]``, c_kv ``[N, S, L]``, k_pe ``[N, S, R]``, w_uk ``[H, Kn, L]``,
    w_uv ``[H, V, L]``, mask ``[N, T, S]`` -> ``[N, T, H, V]`` in c_kv's dtype; rows with no visible key give 0."""
    H = q_nope.shape[2]
    dt = q_nope.dtype
    q_lat = torch.einsum("nthk,hkl->nhtl", q_nope, w_uk.to(dt))  # [N, H, T, L]
    q_abs = torch.cat([q_lat, q_pe.to(dt).transpose(1, 2)], dim=-1)  # [N, H, T, L+R]
    k_abs = torch.cat([c_kv.to(dt), k_pe.to(dt)], dim=-1)[:, None].expand(-1, H, -1, -1)  # one shared KV head
    m = mask[:, None]  # [N, 1, T, S]
    empty = ~m.any(-1, keepdim=True)  # a row with no key: let it see everything, then zero it (some SDPA give NaN)
    o = F.scaled_dot_product_attention(
        q_abs, k_abs, c_kv.to(dt)[:, None].expand(-1, H, -1, -1), attn_mask=m | empty, scale=scale
    ).masked_fill(empty, 0.0)  # [N, H, T, L]
    return torch.einsum("nhtl,hvl->nthv", o.to(w_uv.dtype), w_uv).to(c_kv.dtype)


def _refuse_indexer_rope(c) -> None:
    if c.indexer_rope != "none":  # as the eager Indexer with a cache: keys would need their absolute positions
        raise NotImplementedError(
            f"indexer_rope={c.indexer_rope!r} with a decode cache: the cached keys would need their absolute "
            "positions; run without a cache (a full forward), or with indexer_rope='none' (K3.1)"
        )


def _kda_projections(layer, x: torch.Tensor):
    """The raw projections of one KDA decode token, ``[N, P]`` (``b``: ``[N, H]``), in the activation dtype."""
    c = layer.config
    f = _linear(_linear(x, layer.f_a_proj), layer.f_b_proj)
    gate = _linear(x, layer.g_proj) if c.use_full_rank_gate else _linear(_linear(x, layer.g_a_proj), layer.g_b_proj)
    raw = (_linear(x, layer.q_proj), _linear(x, layer.k_proj), _linear(x, layer.v_proj), f, _linear(x, layer.b_proj))
    return [t[:, 0] for t in raw] + [gate[:, 0]]


def kda_decode_inplace(layer, x: torch.Tensor, cache: KDACache, kernel: str = "auto") -> torch.Tensor:
    """One decode token of a ``KimiDeltaAttention`` with its cache updated in place (module docstring).

    Args:
        layer: the KDA layer; x ``[N, 1, D]``; cache: its ``KDACache`` (windows ``[N, P, W-1]`` and ``S`` ``[N, H,
            K, V]`` fp32, contiguous: ``kernels_torch.decode.DecodeCache``); kernel: ``auto`` | ``triton`` | ``fla``
            | ``torch``.

    Returns:
        ``[N, 1, D]`` in x's dtype.

    Raises:
        ValueError: ``x`` with ``T != 1``; ``kernel="triton"`` where it cannot run.
    """
    from kernels_torch.ops.kda_decode import KDADecodeWeights, kda_decode_triton, triton_unavailable

    c = layer.config
    N, T, _ = x.shape
    if T != 1:
        raise ValueError(f"x: got {T} tokens, expected 1 (decode)")
    H, K = c.kda_num_heads, c.kda_head_dim
    if kernel == "auto":
        kernel = "triton" if triton_unavailable(x, K) is None else "fla"
    if kernel == "torch":
        out, new = layer(x, cache=cache, mode="recurrent")  # the readable recurrence (pure torch on every backend)
        for dst, src in zip(cache, new):
            dst.copy_(src)
        return out
    q_raw, k_raw, v_raw, f, b, gate = _kda_projections(layer, x)
    if kernel == "triton":
        weights = KDADecodeWeights(
            layer.q_conv1d.weight,
            layer.k_conv1d.weight,
            layer.v_conv1d.weight,
            layer.A_log,
            layer.dt_bias,
            layer.o_norm.weight,
            layer.o_norm.eps,
            c.gate_lower_bound,
            A_LOG_MAX,
            G_MIN,
        )
        y = kda_decode_triton(q_raw, k_raw, v_raw, f, b, gate, cache[:3], weights, cache.S)  # [N, P]
        return _linear(y[:, None], layer.o_proj)
    if kernel != "fla":
        raise ValueError(f"kernel: got {kernel!r}, expected 'auto', 'triton', 'fla' or 'torch'")
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    convs = []
    for raw, win, conv in zip((q_raw, k_raw, v_raw), cache[:3], (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)):
        y, new = short_conv(raw[:, None], conv.weight, None, win)  # [N, 1, P] in x's dtype
        win.copy_(new)
        convs.append(y.reshape(N, 1, H, K))
    q, k, v = convs
    o, _ = fused_recurrent_kda_fwd(
        q=q,
        k=k,
        v=v,
        g=f.reshape(N, 1, H, K),  # raw: the gate lb * sigmoid(exp(A_log) (f + dt_bias)) runs in the kernel
        beta=b.reshape(N, 1, H),  # raw: its sigmoid runs in the kernel
        A_log=layer.A_log.float(),
        dt_bias=layer.dt_bias.float(),
        initial_state=cache.S,
        inplace_final_state=True,
        scale=K**-0.5,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        lower_bound=c.gate_lower_bound,
    )  # o [N, 1, H, V] in v's dtype; S updated in place
    y = layer.o_norm(o, gate.reshape(N, 1, H, K)).to(x.dtype).reshape(N, 1, H * K)
    return _linear(y, layer.o_proj)


def gated_mla_decode_static(layer, x: torch.Tensor, cache, pos: torch.Tensor, latent: torch.Tensor | None):
    """One decode token of a ``GatedMLA`` under ``backend="cudnn"`` with static shapes (module docstring).

    Args:
        layer: the ``GatedMLA``; x ``[N, 1, D]``; cache: its ``MLACache`` (``c_kv`` / ``k_pe`` views of ``latent``
            ``[N, S_max, L + R]``, or separate buffers when ``latent`` is None), written in place at ``pos`` ``[N]``
            int64 (device).

    Returns:
        ``[N, 1, D]`` in x's dtype.
    """
    from kernels_torch.dsa_cudnn import sparse_mla

    c = layer.config
    N, T, _ = x.shape
    S = cache.c_kv.shape[1]
    H, Kn, V, L = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    scale = c.mla_softmax_scale  # (Kn + R)^-1/2, never (L + R)^-1/2
    c_q, q, q_nope, q_pe, c_kv, k_pe = layer.project(x)
    if latent is not None:
        write_token(latent, torch.cat([c_kv, k_pe], dim=-1), pos)
    else:
        write_token(cache.c_kv, c_kv, pos)
        write_token(cache.k_pe, k_pe, pos)
    mask = cached_causal_mask(pos, T, S, device=x.device)  # [N, 1, S]
    w = effective_weight(layer.kv_b_proj).view(H, Kn + V, L)
    w_uk, w_uv = w[:, :Kn], w[:, Kn:]  # [H, Kn, L], [H, V, L]
    if layer.kind != "dsa":
        o = _absorbed_sdpa(q_nope, q_pe, cache.c_kv, cache.k_pe, w_uk, w_uv, mask, scale)
        return layer.gate_and_project_out(o, x)
    _refuse_indexer_rope(c)
    q_I, k_I, weights = layer.indexer.projections(x, c_q)
    write_token(cache.index_k, k_I, pos)
    idx = topk_indices(indexer_scores(q_I, cache.index_k, weights), mask, c.index_topk)  # [N, 1, k] int32, -1 last
    k = idx.shape[-1]
    q_abs = torch.cat([torch.einsum("nthk,hkl->nthl", q_nope, w_uk.to(q.dtype)), q_pe], dim=-1)  # [N, 1, H, L+R]
    if latent is not None:  # the cache's rows in place: [N*S_max, L+R], ids offset by row
        rows = latent.view(N * S, -1)
        ids = idx + (torch.arange(N, device=x.device, dtype=torch.int32) * S)[:, None, None]
    else:  # gather the selected rows, [N*k, L+R]
        b = torch.arange(N, device=x.device)[:, None, None]
        sel = idx.clamp_min(0).long()
        rows = torch.cat([cache.c_kv[b, sel], cache.k_pe[b, sel]], dim=-1).reshape(N * k, -1)
        ids = torch.arange(N * k, device=x.device, dtype=torch.int32).view(N, 1, k)
    ids = torch.where(idx >= 0, ids, -1).to(torch.int32).reshape(N, k)
    tlen = (idx >= 0).sum(-1).to(torch.int32).reshape(N)
    kernel = getattr(layer, "sparse_kernel", None)  # kernels_torch.kernel_choice
    o_lat = sparse_mla(q_abs.reshape(N, H, -1).contiguous(), rows, ids, tlen, scale, L, kernel)  # [N, H, L]
    o = torch.einsum("nhl,hvl->nhv", o_lat, w_uv.to(o_lat.dtype)).view(N, 1, H, V)
    return layer.gate_and_project_out(o, x)
