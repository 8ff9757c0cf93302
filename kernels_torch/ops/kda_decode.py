"""One KDA decode token in one kernel: conv update + SiLU, the q/k L2 norms, the gate, beta, the delta rule and the
gated RMSNorm (spec 2.2 steps 2-8 for T = 1), with the conv windows and the state updated in place.

Notable:
* Inputs are the raw projections of one token per row (what the layer's GEMMs give): ``q_raw``, ``k_raw``,
  ``v_raw``, ``f`` (``f_b(f_a(x))``), ``gate`` (the output gate's projection) ``[N, P]`` and ``b`` ``[N, H]`` in the
  activation dtype; the output ``y`` ``[N, P]`` (activation dtype) goes to ``o_proj``. P = H K, and K = V.
* Same numerics and roundings as the layer's readable path (``KimiDeltaAttention`` with ``mode="recurrent"``):
  the conv in fp32 over the window in the activation dtype, its SiLU output rounded to the activation dtype (as
  ``short_conv`` returns it), then in fp32 the L2 norms (eps 1e-6 under the root), ``g = lb sigmoid(exp(A_log)
  (f + dt_bias))`` (or the softplus form with its floor, :func:`kernels_torch.kda.kda_gate`), ``beta = sigmoid(b)``,
  ``S <- S exp(g)``, ``S <- S + k (beta (v - k S))``, ``o = (q K^-1/2) S`` rounded to the activation dtype (as
  ``kda_recurrent`` returns it), ``rmsnorm(o) w sigmoid(gate)``. Sums run in another order than torch's: equal to
  fp32 rounding, which can move a bf16 output by one unit in the last place.
* One Triton program per (row, head) holds the head's whole ``[K, V]`` state tile (K = V a power of two, as K3's
  128). CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (the tests). No host read, no shape that depends
  on a value: capturable in a CUDA graph. The readable twin is the layer itself (``kernels_torch.decode_cudnn``
  picks between them; ops import no layer).
* Footgun: the windows ``[N, P, W-1]`` keep the last ``W-1`` *pre-conv* projections, oldest first (spec 2.4).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

try:  # Triton is optional: the CPU CI machine has none; the torch twin works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None

__all__ = ["KDADecodeWeights", "kda_decode_triton", "triton_unavailable", "TRITON_NUM_WARPS"]

TRITON_NUM_WARPS = (
    16  # a [128, 128] fp32 state tile over 512 threads: 32 registers a thread (fla's 128 x 32 on 4 warps)
)


class KDADecodeWeights(NamedTuple):
    """The per-layer constants of the fused step: conv weights ``conv_q``, ``conv_k``, ``conv_v`` ``[P, 1, W]`` or
    ``[P, W]`` (fp32), ``A_log`` ``[H]``, ``dt_bias`` ``[P]``, ``norm`` ``[K]`` (``o_norm.weight``), ``eps``
    (``o_norm.eps``), ``lower_bound`` (``gate_lower_bound``; None: the softplus gate), and the gate's saturation
    constants ``a_log_max`` / ``g_min`` (``kernels_torch.kda.A_LOG_MAX`` / ``G_MIN``)."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    eps: float
    lower_bound: float | None
    a_log_max: float
    g_min: float


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_unavailable(x: torch.Tensor, K: int) -> str | None:
    """Why the Triton kernel cannot take activations ``x`` with head dim ``K`` (None when it can)."""
    if triton is None:
        return "Triton is not installed"
    if not (x.is_cuda or _interpreting()):
        return f"x is on {x.device} (Triton needs CUDA, or TRITON_INTERPRET=1 on a CPU)"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"x is {x.dtype}, expected bf16, fp16 or fp32"
    if K < 16 or K & (K - 1):
        return f"head dim {K} is not a power of two >= 16"
    return None


def _check(q_raw, k_raw, v_raw, f, b, gate, windows, weights, S) -> tuple[int, int, int, int]:
    if q_raw.ndim != 2:
        raise ValueError(f"q_raw: got shape {tuple(q_raw.shape)}, expected [N, P]")
    N, P = q_raw.shape
    if S.ndim != 4 or S.shape[0] != N or S.shape[2] * S.shape[1] != P or S.shape[2] != S.shape[3]:
        raise ValueError(f"S: got shape {tuple(S.shape)}, expected [N, H, K, V] with N={N}, H*K={P} and K = V")
    H, K = S.shape[1], S.shape[2]
    for name, t in (("k_raw", k_raw), ("v_raw", v_raw), ("f", f), ("gate", gate)):
        if tuple(t.shape) != (N, P):
            raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected [N, P]=[{N}, {P}]")
    if tuple(b.shape) != (N, H):
        raise ValueError(f"b: got shape {tuple(b.shape)}, expected [N, H]=[{N}, {H}]")
    W = weights.conv_q.shape[-1]
    for name, t in zip(("conv_q", "conv_k", "conv_v"), windows):
        if tuple(t.shape) != (N, P, W - 1) or not t.is_contiguous():
            raise ValueError(
                f"windows.{name}: got shape {tuple(t.shape)}, expected a contiguous [N, P, W-1]=[{N}, {P}, {W - 1}]"
            )
    if S.dtype != torch.float32 or not S.is_contiguous():
        raise ValueError(f"S: got dtype {S.dtype}, expected a contiguous float32 state (updated in place)")
    return N, P, H, K


if triton is not None:

    @triton.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _conv_update(X, C, Wt, row, c, P, W: tl.constexpr, BW: tl.constexpr):
        """SiLU(conv) of channel block ``c`` of row ``row`` (fp32, rounded to X's dtype) and the window shifted in
        place: ``C`` ``[N, P, W-1]``, ``Wt`` ``[P, W]``; tap W-1 is the new token."""
        taps = tl.arange(0, BW)
        x = tl.load(X + row * P + c)  # [K] activation dtype
        base = (row * P + c)[:, None] * (W - 1)
        old = tl.load(C + base + taps[None, :], mask=taps[None, :] < W - 1, other=0.0)  # [K, BW]
        wt = tl.load(Wt + c[:, None] * W + taps[None, :], mask=taps[None, :] < W, other=0.0).to(tl.float32)
        xe = tl.where(taps[None, :] == W - 1, x.to(tl.float32)[:, None], old.to(tl.float32))
        y = tl.sum(wt * xe, 1)
        y = y * _sigmoid(y)
        shifted = tl.load(C + base + taps[None, :] + 1, mask=taps[None, :] + 1 < W - 1, other=0.0)
        new = tl.where(taps[None, :] == W - 2, x[:, None].to(C.dtype.element_ty), shifted)
        tl.store(C + base + taps[None, :], new, mask=taps[None, :] < W - 1)
        return y.to(X.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _kda_decode_kernel(
        Qr,
        Kr,
        Vr,
        F,
        B,
        G,
        CQ,
        CK,
        CV,
        WQ,
        WK,
        WV,
        A_LOG,
        DT_BIAS,
        NORM,
        S,
        Y,
        lower_bound,
        eps,
        scale,
        H: tl.constexpr,
        K: tl.constexpr,
        W: tl.constexpr,
        BW: tl.constexpr,
        USE_LOWER_BOUND: tl.constexpr,
        A_MAX: tl.constexpr,
        G_FLOOR: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row = pid // H
        h = pid % H
        P = H * K
        offs = tl.arange(0, K)
        c = h * K + offs
        q = _conv_update(Qr, CQ, WQ, row, c, P, W, BW)
        k = _conv_update(Kr, CK, WK, row, c, P, W, BW)
        v = _conv_update(Vr, CV, WV, row, c, P, W, BW)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + 1e-6)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + 1e-6))
        f = tl.load(F + row * P + c).to(tl.float32) + tl.load(DT_BIAS + c).to(tl.float32)
        a = tl.exp(tl.minimum(tl.load(A_LOG + h).to(tl.float32), A_MAX))
        if USE_LOWER_BOUND:
            g = lower_bound * _sigmoid(a * f)
        else:  # -a softplus(f), softplus = max(f, 0) + log(1 + exp(-|f|)), floored
            g = tl.maximum(-a * (tl.maximum(f, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(f)))), G_FLOOR)
        beta = _sigmoid(tl.load(B + row * H + h).to(tl.float32))
        p_s = S + ((row * H + h) * K + offs[:, None]) * K + offs[None, :]  # [K, V], K-first
        s = tl.load(p_s) * tl.exp(g)[:, None]
        e = v - tl.sum(s * k[:, None], 0)  # [V]
        s = s + k[:, None] * (beta * e)[None, :]
        tl.store(p_s, s)
        o = tl.sum(s * q[:, None], 0)  # [V]
        o = o.to(Vr.dtype.element_ty).to(tl.float32)
        o = o * (1.0 / tl.sqrt(tl.sum(o * o, 0) / K + eps))
        gate = tl.load(G + row * P + c).to(tl.float32)
        y = o * tl.load(NORM + offs).to(tl.float32) * _sigmoid(gate)
        tl.store(Y + row * P + c, y.to(Y.dtype.element_ty))


def kda_decode_triton(q_raw, k_raw, v_raw, f, b, gate, windows, weights: KDADecodeWeights, S) -> torch.Tensor:
    """One decode token of a KDA layer from its raw projections (module docstring), in place on the cache.

    Args:
        q_raw, k_raw, v_raw, f, gate: ``[N, P]`` in the activation dtype; b: ``[N, H]``.
        windows: ``(conv_q, conv_k, conv_v)`` ``[N, P, W-1]``, contiguous (the cache's; updated in place).
        weights: :class:`KDADecodeWeights`. S: ``[N, H, K, V]`` fp32, contiguous (updated in place).

    Returns:
        ``y`` ``[N, P]`` in ``q_raw.dtype``: the gated RMSNorm of the heads' outputs, the input of ``o_proj``.

    Raises:
        ValueError: shapes that disagree, a state that is not fp32, non-contiguous cache tensors, or inputs the
            kernel cannot take (:func:`triton_unavailable`).
    """
    N, P, H, K = _check(q_raw, k_raw, v_raw, f, b, gate, windows, weights, S)
    why = triton_unavailable(q_raw, K)
    if why is not None:
        raise ValueError(f"kda_decode_triton: cannot run: {why}")
    W = weights.conv_q.shape[-1]
    conv = [w.reshape(P, W).contiguous() for w in (weights.conv_q, weights.conv_k, weights.conv_v)]
    y = torch.empty_like(q_raw)
    lb = weights.lower_bound
    ins = [t.contiguous() for t in (q_raw, k_raw, v_raw, f, b, gate)]
    _kda_decode_kernel[(N * H,)](
        *ins,
        *windows,
        *conv,
        weights.A_log,
        weights.dt_bias,
        weights.norm,
        S,
        y,
        0.0 if lb is None else float(lb),
        float(weights.eps),
        float(K**-0.5),
        H=H,
        K=K,
        W=W,
        BW=triton.next_power_of_2(W),
        USE_LOWER_BOUND=lb is not None,
        A_MAX=float(weights.a_log_max),
        G_FLOOR=float(weights.g_min),
        num_warps=TRITON_NUM_WARPS,
    )
    return y
