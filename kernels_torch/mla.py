"""Gated NoPE MLA and DSA-sparse MLA, PyTorch twin of ``reference_jax.mla`` (same names, arguments, shape letters).

Spec: ``../shared/spec/architecture.md`` 3.1-3.4, 4.3, 9. Backends (one setting, same API):

* ``"eager"``: explicit matmuls, fp32 logits and softmax (fp64 for fp64 inputs), dense boolean mask. The readable one.
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` with the same dense boolean mask and ``scale=`` set
  explicitly (its default would be ``K^-1/2``: 24^-1/2 here, 576^-1/2 in the absorbed form -- both wrong).
  Fully masked rows are given a dummy all-True mask row and zeroed afterwards, so they give 0 on every SDPA kernel
  (some return NaN for them).
* ``"cudnn"`` (``GatedMLA`` only; CUDA, bf16, the ``gpu`` extra): DSA layers run the cuDNN indexer + top-k and the
  sparse absorbed MLA of ``kernels_torch.dsa_cudnn`` (the indexer frozen: ``requires_grad=False``, no
  ``index_scores`` in the aux); MLA layers without an indexer run SDPA in the expanded form. The free functions
  below take ``eager``/``sdpa`` only.

Footguns: the softmax scale is ``(qk_nope + qk_rope)^-1/2`` (192^-1/2 for K3) in the expanded **and** the absorbed
form (case 15); ``k_pe`` is never rotated (NoPE) and shared by all heads; the causal/document mask is re-applied after
the indexer's top-k; ``g_proj`` here is MLA's output gate ``[H*V, D]``, not KDA's (case 18).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels_torch.common import (
    RMSNorm,
    causal_document_mask,
    check_activation_dtype,
    check_cu_seqlens,
    compute_dtype,
    effective_weight,
)
from kernels_torch.indexer import Indexer, sparse_mask
from kernels_torch.kv_cache import MLACache, cached_causal_mask, key_count, write_rows
from kimi.config import KimiConfig

__all__ = ["BACKENDS", "mla_attention", "mla_attention_absorbed", "GatedMLA"]

BACKENDS = ("eager", "sdpa", "cudnn")
_FUNCTION_BACKENDS = ("eager", "sdpa")  # the dense-mask functions below; "cudnn" is a GatedMLA backend only
_FORMS = ("expanded", "absorbed")


def _check_backend(backend: str, allowed: tuple[str, ...] = _FUNCTION_BACKENDS) -> None:
    if backend not in allowed:
        raise ValueError(f"backend: got {backend!r}, expected one of {list(allowed)}")


def _mask4(mask: torch.Tensor, B: int, T: int, S: int) -> torch.Tensor:
    """``[T, S]`` or ``[B, T, S]`` bool -> ``[B, 1, T, S]``; ValueError on any other shape."""
    if tuple(mask.shape) not in ((T, S), (B, T, S)):
        raise ValueError(f"mask: got shape {tuple(mask.shape)}, expected {(T, S)} or {(B, T, S)}")
    return mask.to(torch.bool).expand(B, T, S)[:, None]


# Query-row block of the eager path (twin of reference_jax.mla._ROW_BLOCK): bounds the fp32 logits to
# [B, H, 2048, S] instead of [B, H, T, S] (26 GB per temporary at T = S = 8192, H = 96).
_ROW_BLOCK = 2048


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask4: torch.Tensor, scale: float, backend: str
) -> torch.Tensor:
    """Masked attention in head-first layout: q ``[B, H, T, K]``, k ``[B, H|1, S, K]``, v ``[B, H|1, S, V]``,
    mask4 ``[B, 1, T, S]`` -> ``[B, H, T, V]``; rows with no visible key are 0."""
    if backend == "eager":
        dt = compute_dtype(q, v)
        k, v = k.to(dt), v.to(dt)
        out = []
        for t0 in range(0, q.shape[2], _ROW_BLOCK):  # blocks of query rows, as the JAX twin: bounded memory
            rows, m = slice(t0, t0 + _ROW_BLOCK), mask4[:, :, t0 : t0 + _ROW_BLOCK]
            logits = torch.matmul(q[:, :, rows].to(dt), k.transpose(-1, -2)) * scale  # [B, H, t, S]
            logits = logits.masked_fill(~m, float("-inf"))
            row_max = logits.amax(-1, keepdim=True)
            row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
            p = torch.exp(logits - row_max).masked_fill(~m, 0.0)
            denom = p.sum(-1, keepdim=True)
            p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
            out.append(torch.matmul(p, v))
        return torch.cat(out, dim=2)
    # sdpa: a fully masked row may give NaN on some kernels; let it see everything, then zero it.
    empty = ~mask4.any(-1, keepdim=True)  # [B, 1, T, 1]
    safe = mask4 | empty
    H = q.shape[1]
    o = F.scaled_dot_product_attention(q, k.expand(-1, H, -1, -1), v.expand(-1, H, -1, -1), attn_mask=safe, scale=scale)
    return o.masked_fill(empty, 0.0)


def mla_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, *, backend: str = "eager"
) -> torch.Tensor:
    """Expanded-form MLA attention (spec 3.2 step 5); twin of ``reference_jax.mla.mla_attention``.

    Args:
        q: ``[B, T, H, K]``; k: ``[B, S, H, K]``; v: ``[B, S, H, V]`` (V may differ from K).
        mask: ``[T, S]`` or ``[B, T, S]`` bool, True = attend.
        scale: ``config.mla_softmax_scale`` = (qk_nope + qk_rope)^-1/2.
        backend: "eager" (fp32 softmax, fp64 for fp64 inputs) or "sdpa".

    Returns:
        ``[B, T, H, V]`` in ``v.dtype``; rows with no visible key are 0.

    Raises:
        ValueError: unknown ``backend`` or a mask of the wrong shape.
    """
    _check_backend(backend)
    B, T, H, _ = q.shape
    S = k.shape[1]
    m = _mask4(mask, B, T, S)
    o = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), m, scale, backend)  # [B, H, T, V]
    return o.transpose(1, 2).to(v.dtype)


def mla_attention_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    *,
    backend: str = "eager",
) -> torch.Tensor:
    """Absorbed (MQA-over-latent) MLA attention (spec 3.3); twin of ``reference_jax.mla.mla_attention_absorbed``.

    Args:
        q_nope: ``[B, T, H, K_nope]``; q_pe: ``[B, T, H, R]``; c_kv: ``[B, S, L]`` (after kv_a_layernorm);
        k_pe: ``[B, S, R]`` (raw); kv_b_weight: ``[H * (K_nope + V), L]`` (rows per head: W_UK then W_UV).
        mask: ``[T, S]`` or ``[B, T, S]`` bool. scale: **still** ``(K_nope + R)^-1/2``, not ``(L + R)^-1/2`` (case 15).
        backend: "eager" or "sdpa".

    Returns:
        ``[B, T, H, V]`` in ``c_kv.dtype``; rows with no visible key are 0.

    Raises:
        ValueError: unknown ``backend``, a mask of the wrong shape, or a mismatched ``kv_b_weight``.
    """
    _check_backend(backend)
    B, T, H, Kn = q_nope.shape
    S, L = c_kv.shape[1:]
    rows = kv_b_weight.shape[0]
    if rows % H or rows // H <= Kn or kv_b_weight.shape[1] != L:
        raise ValueError(
            f"kv_b_weight: got shape {tuple(kv_b_weight.shape)}, expected [H*(K_nope+V), L] with "
            f"H={H}, K_nope={Kn}, L={L}"
        )
    m = _mask4(mask, B, T, S)
    dt = compute_dtype(q_nope, c_kv) if backend == "eager" else q_nope.dtype
    w = kv_b_weight.to(dt).view(H, rows // H, L)
    w_uk, w_uv = w[:, :Kn], w[:, Kn:]  # [H, K_nope, L], [H, V, L]
    q_lat = torch.einsum("bthk,hkl->bhtl", q_nope.to(dt), w_uk)  # [B, H, T, L]
    q_abs = torch.cat([q_lat, q_pe.to(dt).transpose(1, 2)], dim=-1)  # [B, H, T, L+R]
    k_abs = torch.cat([c_kv.to(dt), k_pe.to(dt)], dim=-1)[:, None]  # [B, 1, S, L+R]: one shared KV head
    o_lat = _attend(q_abs, k_abs, c_kv.to(dt)[:, None], m, scale, backend)  # [B, H, T, L]
    o = torch.einsum("bhtl,hvl->bthv", o_lat.to(w_uv.dtype), w_uv)  # [B, T, H, V]
    return o.to(c_kv.dtype)


class GatedMLA(nn.Module):
    """Gated NoPE MLA layer (spec 3.2), with the DSA indexer (spec 4) on ``"dsa"`` layers; twin of the JAX module.

    Submodules (``state_dict`` keys = the ``self_attn.``-relative names of ``kimi.layout.param_layout``):
    ``q_a_proj``, ``q_a_layernorm`` (eps ``mla_norm_eps``), ``q_b_proj`` -- or ``q_proj`` when ``q_lora_rank`` is
    None --, ``kv_a_proj_with_mqa``, ``kv_a_layernorm`` (eps ``mla_norm_eps``), ``kv_b_proj``, ``g_proj`` (when
    ``mla_use_output_gate``), ``o_proj``, ``indexer`` (DSA layers).

    ``forward(x, cu_seqlens=None, form="expanded", return_aux=False)``: x ``[B, T, D]`` (fp32, fp64 or bf16),
    cu_seqlens ``[N+1]`` (B = 1) or None; returns ``[B, T, D]`` in ``x.dtype``, plus with ``return_aux`` a dict with
    ``topk_indices`` ``[B, T, min(index_topk, T)]`` int32 and ``index_scores`` ``[B, T, T]`` fp32 on DSA layers
    (None under ``"cudnn"``, which never forms the scores; ``form`` is ignored there: see
    :func:`kernels_torch.dsa_cudnn.gated_mla_forward`).

    Under ``"cudnn"`` the indexer's parameters are frozen (``requires_grad=False``): hard top-k gives them no gradient
    (the indexer distillation stages of ``kimi_tools.distill`` unfreeze them: their KL trains the indexer from the
    layer's detached input, outside the layer's forward). ``sparse_kl_aux`` (default False): under ``"cudnn"``, also
    return the sparse forward's rows and lse in the aux (:func:`kernels_torch.dsa_cudnn.gated_mla_forward`).

    Raises:
        ValueError: unknown ``backend`` (allowed: :data:`BACKENDS`), a KDA ``layer_idx``, an unknown ``form``,
            malformed ``cu_seqlens``, ``x`` not a float tensor (bf16, fp16, fp32, fp64).
        RuntimeError: ``"cudnn"`` at forward time without CUDA, bf16 activations or the ``gpu`` extra.
    """

    def __init__(self, config: KimiConfig, layer_idx: int, backend: str = "eager"):
        super().__init__()
        _check_backend(backend, BACKENDS)
        c = config
        kind = c.layer_type(layer_idx)
        if kind == "kda":
            raise ValueError(
                f"layer_idx: got {layer_idx}, a KDA layer; GatedMLA needs an 'mla' or 'dsa' layer "
                "(g_proj means the KDA output gate there, case 18)"
            )
        self.config, self.layer_idx, self.backend, self.kind = c, layer_idx, backend, kind
        self.sparse_kernel: str | None = None  # cudnn DSA: sparse forward kernel (kernels_torch.kernel_choice)
        self.sparse_kl_aux = False  # cudnn DSA: also return the sparse forward's rows and lse (dsa_cudnn, distill)
        D, H = c.hidden_size, c.num_attention_heads
        Kn, R, V, L = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * (Kn + R), bias=False)
        else:
            self.q_a_proj = nn.Linear(D, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.mla_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * (Kn + R), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, L + R, bias=False)
        self.kv_a_layernorm = RMSNorm(L, c.mla_norm_eps)
        self.kv_b_proj = nn.Linear(L, H * (Kn + V), bias=False)
        if c.mla_use_output_gate:
            self.g_proj = nn.Linear(D, H * V, bias=False)  # MLA output gate [H*V, D] (not KDA's g_proj)
        self.o_proj = nn.Linear(H * V, D, bias=False)
        if kind == "dsa":
            self.indexer = Indexer(c)
            if backend == "cudnn":  # hard top-k: no gradient reaches the indexer on the sparse path
                self.indexer.requires_grad_(False)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens=None,
        form: str = "expanded",
        return_aux: bool = False,
        cache: MLACache | None = None,
        cache_pos: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ):
        c = self.config
        check_activation_dtype(x, "GatedMLA")
        if form not in _FORMS:
            raise ValueError(f"form: got {form!r}, expected one of {list(_FORMS)}")
        if self.backend == "cudnn" and cache is not None:
            from kernels_torch.decode_cudnn import gated_mla_cached  # lazy: CPU machines never import the GPU path

            return gated_mla_cached(self, x, cache, cache_pos, lengths, return_aux)
        if self.backend == "cudnn":
            from kernels_torch.dsa_cudnn import gated_mla_forward  # lazy: CPU machines never import the GPU path

            return gated_mla_forward(self, x, cu_seqlens, return_aux)
        B, T, D = x.shape
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, T, B)
        H, Kn, R, V = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        c_q, q, q_nope, q_pe, c_kv, k_pe = self.project(x)  # 1.-2.

        if cache is None:  # keys = this call's tokens
            S, keys_c_kv, keys_k_pe = T, c_kv, k_pe
            mask = causal_document_mask(T, cu_seqlens, device=x.device)[None]  # [1, T, S]
        else:  # keys = the cached rows then this call's (kernels_torch.cache); the cache is written in place
            write_rows(cache.c_kv, c_kv, cache_pos, lengths)
            write_rows(cache.k_pe, k_pe, cache_pos, lengths)
            S = key_count(cache_pos, lengths)
            keys_c_kv, keys_k_pe = cache.c_kv[:, :S], cache.k_pe[:, :S]  # [B, S, L], [B, S, R]
            mask = cached_causal_mask(cache_pos, T, S, device=x.device)  # [B, T, S]
        aux: dict = {}
        if self.kind == "dsa":
            if cache is None:
                topk, scores = self.indexer(x, c_q, cu_seqlens)
            else:
                topk, scores = self.indexer(x, c_q, None, cache.index_k, cache_pos, lengths)
            mask = mask & sparse_mask(topk, S)  # re-apply causal/document after selection (spec 4.3)
            aux = {"topk_indices": topk, "index_scores": scores}

        mask = mask.expand(B, T, S)
        scale = c.mla_softmax_scale  # (Kn + R)^-1/2 in both forms (case 15)
        if form == "expanded":
            kvb = self.kv_b_proj(keys_c_kv).view(B, S, H, Kn + V)  # 3.
            k_nope, v = kvb[..., :Kn], kvb[..., Kn:]
            k = torch.cat([k_nope, keys_k_pe[:, :, None, :].expand(B, S, H, R)], dim=-1)  # 4. [B, S, H, Kn+R]
            o = mla_attention(q, k, v, mask, scale, backend=self.backend)  # 5. [B, T, H, V]
        else:
            o = mla_attention_absorbed(
                q_nope, q_pe, keys_c_kv, keys_k_pe, effective_weight(self.kv_b_proj), mask, scale, backend=self.backend
            )
        out = self.gate_and_project_out(o, x)  # 6.-8.
        if cache is not None:
            return (out, aux, cache) if return_aux else (out, cache)
        return (out, aux) if return_aux else out

    def project(self, x: torch.Tensor):
        """Steps 1-2 of spec 3.2, shared by every backend: x ``[B, T, D]`` -> ``(c_q, q, q_nope, q_pe, c_kv, k_pe)``:
        c_q ``[B, T, q_lora_rank]`` (x itself without q-LoRA; it also feeds the indexer), q ``[B, T, H, Kn+R]`` and
        its two parts, c_kv ``[B, T, L]`` (normalised latent), k_pe ``[B, T, R]`` (NoPE: never rotated or normalised)."""
        c = self.config
        B, T, _ = x.shape
        Kn, R, L = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        if c.q_lora_rank is None:
            c_q = x
            q = self.q_proj(x)
        else:
            c_q = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(c_q)
        q = q.view(B, T, c.num_attention_heads, Kn + R)
        kv = self.kv_a_proj_with_mqa(x)  # [B, S, L+R]
        return c_q, q, q[..., :Kn], q[..., Kn:], self.kv_a_layernorm(kv[..., :L]), kv[..., L:]

    def gate_and_project_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Steps 6-8 of spec 3.2, shared by every backend: heads ``[B, T, H, V]`` -> sigmoid output gate on the same
        x (fp32; when ``mla_use_output_gate``) -> ``o_proj`` -> ``[B, T, D]`` in ``x.dtype``."""
        B, T = o.shape[:2]
        o = o.reshape(B, T, -1)
        if self.config.mla_use_output_gate:
            dt = compute_dtype(o)
            o = (o.to(dt) * torch.sigmoid(self.g_proj(x).to(dt))).to(x.dtype)
        return self.o_proj(o.to(x.dtype))
