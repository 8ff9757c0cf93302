"""Kimi Delta Attention (KDA): the PyTorch twin of ``reference_jax/kda.py`` (spec section 2, ``docs/spec.md``).

Same functions, argument names, shapes and dtypes as the reference: ``kda_gate``, ``l2norm``, ``short_conv``,
``kda_recurrent`` (the equation, one token at a time), ``kda_chunk`` (the chunked WY algorithm, pure torch),
``gated_rms_norm`` (defined in ``kernels_torch.kda_functional``, below this module and ``kernels_torch.kda_cudnn``,
and re-exported here), ``KDACache`` and the module ``KimiDeltaAttention`` (the checkpoint's padded ``A_log`` is sliced by
the loader, ``kimi.checkpoint.slice_A_log``).

Shapes: q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``; state ``S`` ``[N, H, K, V]`` (K-first, fla
layout). Packed documents: ``cu_seqlens`` ``[N+1]`` with ``B == 1``.

Backends: ``eager`` and ``sdpa`` both run the pure-torch algorithm here (the backend only matters for attention
layers), also on CUDA, and never touch fla or cuDNN. ``cudnn`` (CUDA, bf16 activations, the ``gpu`` extra) runs the
chunk mode of the layer on GPU kernels: the layer hands it to ``kernels_torch.kda_cudnn`` (fla-core's short conv and
gated RMSNorm around the recurrence, the recurrence on cuDNN Frontend's KDA op or fla-core's ``chunk_kda``, chosen by
the layer's ``kda_kernel`` attribute or ``$KIMI_KDA_KERNEL``; that module's docstring has the pieces). This module
stays the oracle of that one. ``mode="recurrent"`` (decode) stays on the pure-torch recurrence.

Numerics: activations may be bf16; gates, beta, norms and the state are fp32 (fp64 for fp64 inputs). g and beta are
never narrowed to bf16 (a bf16 decay close to 1 rounds to 1, and the channel stops forgetting).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.utils.checkpoint
from torch import nn

from kernels_torch import kda_cudnn
from kernels_torch.common import (
    check_activation_dtype,
    compute_dtype,
    linear,
)
from kernels_torch.kda_functional import (
    gated_rms_norm,
    kda_chunk,
    kda_gate,
    kda_recurrent,
    l2norm,
    short_conv,
)
from kimi.config import KimiConfig
from kimi.kda_gate import A_LOG_MAX, G_MIN  # the gate's saturation bounds, with their reasons

__all__ = [
    "A_LOG_MAX",
    "G_MIN",
    "BACKENDS",
    "MODES",
    "kda_gate",
    "l2norm",
    "short_conv",
    "kda_recurrent",
    "kda_chunk",
    "gated_rms_norm",
    "KDACache",
    "ShortConvolution",
    "GatedRMSNorm",
    "KimiDeltaAttention",
]

BACKENDS = ("eager", "sdpa", "cudnn")
MODES = ("chunk", "recurrent")


# ------------------------------------------------------------------------------------------------ the layer


class KDACache(NamedTuple):
    """Decode cache of one KDA layer (spec 2.4): conv_q, conv_k, conv_v ``[N, P, W-1]`` the last ``W-1`` pre-conv
    projections; S ``[N, H, K, V]`` the recurrent state (fp32, fp64 for fp64 inputs)."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    S: torch.Tensor


class ShortConvolution(nn.Module):
    """Depthwise causal conv + SiLU; one parameter ``weight`` ``[P, 1, W]`` (checkpoint ``*_conv1d.weight``, fp32)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, 1, kernel_size) * kernel_size**-0.5)

    def forward(self, x, cu_seqlens=None, conv_state=None):
        return short_conv(x, self.weight, cu_seqlens, conv_state)


class GatedRMSNorm(nn.Module):
    """KDA ``o_norm``: :func:`gated_rms_norm` with ``weight`` ``[V]`` shared by all heads."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o, gate):
        return gated_rms_norm(o, gate, self.weight, self.eps)


class KimiDeltaAttention(nn.Module):
    """One KDA layer (spec 2.2), twin of ``reference_jax.kda.KimiDeltaAttention``.

    ``state_dict()`` keys are the canonical names under ``model.layers.{i}.self_attn.`` (``kimi.layout.param_layout``):
    ``q_proj.weight`` ... ``o_proj.weight``, ``q_conv1d.weight`` ``[P,1,W]``, ``dt_bias`` ``[P]``, ``A_log`` ``[H]``
    (sliced), ``o_norm.weight`` ``[K]``, and ``g_proj.weight`` or ``g_a_proj.weight`` + ``g_b_proj.weight``.

    ``forward(x, cu_seqlens=None, cache=None, mode="chunk") -> (out, new_cache)``: x ``[B, T, D]`` (bf16, fp32 or
    fp64), out ``[B, T, D]`` in ``x.dtype``, new_cache a :class:`KDACache` with N rows.

    Raises:
        ValueError: unknown ``backend`` or ``mode``, ``layer_idx`` not a KDA layer, bad shapes, ``x`` not a float
            tensor (bf16, fp16, fp32, fp64).
        RuntimeError: ``backend='cudnn'`` without the ``gpu`` extra (fla-core), CUDA tensors or bf16 activations (the
            message lists every missing one).
    """

    def __init__(self, config: KimiConfig, layer_idx: int, backend: str = "eager"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend: got {backend!r}, expected one of {list(BACKENDS)}")
        if config.layer_type(layer_idx) != "kda":
            raise ValueError(
                f"layer_idx: got {layer_idx} ({config.layer_type(layer_idx)}), expected a KDA layer {list(config.kda_layers)}"
            )
        self.config, self.layer_idx, self.backend = config, layer_idx, backend
        self.kda_kernel: str | None = None  # cudnn backend: recurrence kernel (kernels_torch.kernel_choice)
        self.kda_prep: str | None = None  # cudnn backend, cuDNN kernel: where the L2 norm / gate / beta sigmoid run
        self.kda_pieces: str | None = None  # cudnn backend, cuDNN kernel: the SM90 forward's sequence split
        self.short_conv_kernel: str | None = None  # cudnn backend: the q/k/v short convolutions (fla | cudnn)
        c = config
        H, K, D, W, R = c.kda_num_heads, c.kda_head_dim, c.hidden_size, c.short_conv_kernel_size, c.kda_gate_rank
        P = H * K
        lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = lin(D, P), lin(D, P), lin(D, P)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConvolution(P, W) for _ in range(3))
        self.f_a_proj, self.f_b_proj = lin(D, R), lin(R, P)
        self.dt_bias = nn.Parameter(torch.randn(P))
        self.A_log = nn.Parameter(torch.empty(H).uniform_(1.0, 16.0).log())  # canonical [H]; stored [128] is sliced
        self.b_proj = lin(D, H)
        if c.use_full_rank_gate:
            self.g_proj = lin(D, P)
        else:
            self.g_a_proj, self.g_b_proj = lin(D, R), lin(R, P)
        self.o_norm = GatedRMSNorm(K, c.rms_norm_eps)
        self.o_proj = lin(P, D)

    def forward(self, x, cu_seqlens=None, cache: KDACache | None = None, mode: str = "chunk"):
        check_activation_dtype(x, "KimiDeltaAttention")
        if mode not in MODES:
            raise ValueError(f"mode: got {mode!r}, expected one of {list(MODES)}")
        if self.backend == "cudnn":
            kda_cudnn.require_cudnn_backend(x)
            if mode == "chunk":  # the GPU kernels (kernels_torch.kda_cudnn); this method stays their oracle
                out, (cq, ck, cv, S) = kda_cudnn.kda_layer_forward(self, x, cu_seqlens, cache)
                return out, KDACache(cq, ck, cv, S)
            # mode="recurrent" (decode) stays on the pure-torch recurrence below, on the GPU.
        c = self.config
        B, T, _ = x.shape
        H, K = c.kda_num_heads, c.kda_head_dim
        S0 = None if cache is None else cache.S
        q, k, v, g, beta, (cq, ck, cv) = self.recurrence_inputs(x, cu_seqlens, cache)
        recurrence = kda_chunk if mode == "chunk" else kda_recurrent
        o, S = recurrence(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu_seqlens)
        gate = linear(x, self.g_proj) if c.use_full_rank_gate else linear(linear(x, self.g_a_proj), self.g_b_proj)
        y = self.o_norm(o, gate.reshape(B, T, H, K)).to(x.dtype).reshape(B, T, H * K)
        return linear(y, self.o_proj), KDACache(cq, ck, cv, S)

    def recurrence_inputs(self, x, cu_seqlens=None, cache: KDACache | None = None):
        """Spec 2.2 steps 1-6 on the pure-torch path, the inputs of the delta rule (``forward`` calls it; so does
        context parallelism, ``kernels_torch.parallel.context``, for the state summary of a shard).

        Args: as :meth:`forward` (``cache.S`` is not read).

        Returns:
            ``(q, k, v, g, beta, (conv_q, conv_k, conv_v))``: q, k ``[B, T, H, K]`` L2-normalised fp32 (fp64 for
            fp64 x), v ``[B, T, H, V]`` in x's dtype, g ``[B, T, H, K]`` and beta ``[B, T, H]`` fp32/fp64, and the
            new conv windows ``[N, P, W-1]``.
        """
        c = self.config
        B, T, _ = x.shape
        H, K = c.kda_num_heads, c.kda_head_dim
        cq, ck, cv = (None,) * 3 if cache is None else cache[:3]
        q, cq = self.q_conv1d(linear(x, self.q_proj), cu_seqlens, cq)  # [B,T,P]
        k, ck = self.k_conv1d(linear(x, self.k_proj), cu_seqlens, ck)
        v, cv = self.v_conv1d(linear(x, self.v_proj), cu_seqlens, cv)
        q, k, v = (t.reshape(B, T, H, K) for t in (q, k, v))  # v: [B,T,H,V] with V = K = head_dim
        f = linear(linear(x, self.f_a_proj), self.f_b_proj).reshape(B, T, H, K)
        g = kda_gate(f, self.A_log, self.dt_bias, c.gate_lower_bound)  # fp32: a bf16 decay close to 1 rounds to 1
        # [B,T,H]: the one sigmoid on beta (a second one in any path, often decode, breaks prefill == decode)
        beta = torch.sigmoid(linear(x, self.b_proj).to(compute_dtype(x)))
        return l2norm(q), l2norm(k), v, g, beta, (cq, ck, cv)
