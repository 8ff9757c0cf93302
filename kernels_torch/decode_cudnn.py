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

Both run under ``torch.no_grad()`` (generation); ``tests/gpu/test_gpu_generate.py`` checks them against ``eager``.
"""

from __future__ import annotations

import torch

from kernels_torch.cache import cached_causal_mask, key_count, write_rows
from kernels_torch.common import effective_weight
from kernels_torch.common import linear as _linear  # the layers' projection rule (dtype, LoRA-wrapped layers)
from kernels_torch.indexer import indexer_scores, topk_indices
from kernels_torch.kda import KDACache, kda_gate, short_conv

__all__ = ["kda_decode_fla", "gated_mla_cached"]


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
        from kernels_torch.mla import mla_attention_absorbed

        o = mla_attention_absorbed(
            q_nope,
            q_pe,
            cache.c_kv[:, :S],
            cache.k_pe[:, :S],
            effective_weight(layer.kv_b_proj),
            mask,
            scale,
            backend="sdpa",
        )
    else:
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
