"""Input preparation of the KDA recurrence in Triton: the q/k L2 norm and the lower-bound gate, each one launch forward
and one backward, for the cuDNN KDA path (``kernels_torch.kda_cudnn.kda_layer_forward`` with ``kda_prep='triton'``,
opt-in). Measured on the H200 (2026-12-01, ``benchmarks/results/kda_layer_pass8.json``) they are no faster than fla's
``l2norm`` and ``fused_kda_gate``, which the default (``auto`` = ``outside``) keeps: fwd+bwd at 8K tokens, 96 heads,
norms 0.57 against 0.77 ms, gate 0.74 against 0.73 ms, the whole layer 42.4 against 40.5 ms (run-to-run spread about 2
ms).

Notable:
* :func:`l2norm_qk` normalises q **and** k in one launch (grid axis 1 picks the tensor) and computes both gradients in
  one launch. Math as ``kernels_torch.kda.l2norm`` and fla's ``l2norm`` (spec 2.2 step 4): ``y = x * rsqrt(sum(x^2) +
  1e-6)`` over the last axis in fp32, y stored in x's dtype (bf16 in the layer). Backward: ``dx = (dy - y * sum(dy *
  y)) * rstd`` with **y as stored** (bf16-rounded in the layer, as fla does) and ``rstd`` ``[rows]`` fp32: the
  Function saves y and rstd only. y is what the cuDNN op keeps for its own backward anyway, so saving it costs no
  memory, while saving x (the conv output) would keep another ``[B, T, H, K]`` bf16 tensor alive per tensor and layer.
  The price: the bf16 rounding of y (2^-9 relative) enters dx, the bf16 pipeline's level.
* :func:`kda_gate_lb` is ``kernels_torch.kda.kda_gate`` with a lower bound (spec 2.2 step 5; fla ``fused_kda_gate``):
  ``g = lb * sigmoid(exp(min(A_log[h], A_LOG_MAX)) * (f + dt_bias))`` in fp32, g fp32. Backward: one launch writes df
  (f's dtype) and per-program partial sums of ``dz * a`` (-> ddt_bias ``[H*K]``) and ``dz * x`` (-> dA_log ``[H]``),
  ``z = a * x``, ``dz = dg * lb * s * (1 - s)``; torch sums the partials (no atomics: bitwise reproducible). dA_log
  is ``sum(dz * x) * a`` in that order, as autograd through the eager gate computes it (``dz * x`` first: where
  ``a * x`` overflows to inf, s(1 - s) = 0 and the product stays 0, never ``0 * inf``), and 0 where ``A_log`` is past
  the cap (``clamp``'s gradient, as the eager gate).
* The beta sigmoid stays in torch (``[B, T, H]``: a 0.1 % of the gate's traffic).
* Layout: ``[B, T, H, K]`` contiguous (any leading shape ``[..., H, K]``; non-contiguous inputs are copied first).
* CUDA tensors; CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported), which
  is how the CPU tests run these kernels.

Launch shapes (:data:`TRITON_CONFIG`, read at each call so a benchmark can sweep them): the L2 norm runs
``l2_block_m`` rows of K per program; the gate runs ``gate_block_m`` tokens of one head per program forward, and
``gate_block_m * gate_tiles`` tokens per program backward (its partial sums are ``[cdiv(B*T, that), H*K]`` fp32).
"""

from __future__ import annotations

import os

import torch

from kimi.kda_gate import A_LOG_MAX

try:  # Triton is optional: the CPU CI machine has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None

__all__ = ["l2norm_qk", "kda_gate_lb", "triton_prep_unavailable", "TRITON_CONFIG", "L2NORM_EPS"]

L2NORM_EPS = 1e-6  # spec 2.2 step 4 (fla's l2norm, cuDNN's in-kernel norm and kernels_torch.kda.l2norm)
TRITON_CONFIG = dict(l2_block_m=16, l2_warps=4, gate_block_m=32, gate_tiles=8, gate_warps=4)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_prep_unavailable(x: torch.Tensor) -> str | None:
    """Why these kernels cannot run on ``x``'s device (a sentence), or None where they can: Triton must import, and
    ``x`` be a CUDA tensor (or any tensor under ``TRITON_INTERPRET=1``)."""
    if triton is None:
        return "triton does not import"
    if not x.is_cuda and not _interpreting():
        return f"x is on {x.device} (a CUDA tensor is needed, or TRITON_INTERPRET=1)"
    return None


def _check_device(name: str, x: torch.Tensor) -> None:
    why = triton_prep_unavailable(x)
    if why is not None:
        raise RuntimeError(f"{name}: the Triton KDA preparation cannot run: {why}")


# ------------------------------------------------------------------------------------------------ kernels

if triton is not None:

    @triton.jit
    def _l2_fwd_rows(x_ptr, y_ptr, rstd_ptr, M, K, eps, pid, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
        cols = tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        offs = rows[:, None] * K + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps)  # [BLOCK_M]
        tl.store(y_ptr + offs, (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=rows < M)

    @triton.jit
    def _l2_fwd_kernel(
        q_ptr, k_ptr, qn_ptr, kn_ptr, rq_ptr, rk_ptr, M, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        pid = tl.program_id(0)
        if tl.program_id(1) == 0:  # grid axis 1: 0 = q, 1 = k
            _l2_fwd_rows(q_ptr, qn_ptr, rq_ptr, M, K, eps, pid, BLOCK_M, BLOCK_K)
        else:
            _l2_fwd_rows(k_ptr, kn_ptr, rk_ptr, M, K, eps, pid, BLOCK_M, BLOCK_K)

    @triton.jit
    def _l2_bwd_rows(dy_ptr, y_ptr, rstd_ptr, dx_ptr, M, K, pid, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        offs = rows[:, None] * K + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
        dot = tl.sum(dy * y, axis=1)  # [BLOCK_M]
        dx = (dy - y * dot[:, None]) * rstd[:, None]
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _l2_bwd_kernel(
        dq_out_ptr,
        dk_out_ptr,
        qn_ptr,
        kn_ptr,
        rq_ptr,
        rk_ptr,
        dq_ptr,
        dk_ptr,
        M,
        K,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if tl.program_id(1) == 0:
            _l2_bwd_rows(dq_out_ptr, qn_ptr, rq_ptr, dq_ptr, M, K, pid, BLOCK_M, BLOCK_K)
        else:
            _l2_bwd_rows(dk_out_ptr, kn_ptr, rk_ptr, dk_ptr, M, K, pid, BLOCK_M, BLOCK_K)

    @triton.jit
    def _gate_fwd_kernel(
        f_ptr, a_ptr, dt_ptr, g_ptr, M, H, K, lower_bound, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        pid_m, h = tl.program_id(0), tl.program_id(1)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # tokens (B*T flattened)
        cols = tl.arange(0, BLOCK_K)
        cmask = cols < K
        mask = (rows < M)[:, None] & cmask[None, :]
        offs = rows[:, None] * (H * K) + h * K + cols[None, :]
        a = tl.load(a_ptr + h)  # exp(min(A_log[h], A_LOG_MAX)), fp32
        dt = tl.load(dt_ptr + h * K + cols, mask=cmask, other=0.0).to(tl.float32)
        x = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32) + dt[None, :]
        g = lower_bound * tl.sigmoid(a * x)
        tl.store(g_ptr + offs, g, mask=mask)

    @triton.jit
    def _gate_bwd_kernel(
        f_ptr,
        a_ptr,
        dt_ptr,
        dg_ptr,
        df_ptr,
        ddt_part_ptr,
        dzx_part_ptr,
        M,
        H,
        K,
        lower_bound,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        TILES: tl.constexpr,
    ):
        pid_m, h = tl.program_id(0), tl.program_id(1)
        cols = tl.arange(0, BLOCK_K)
        cmask = cols < K
        a = tl.load(a_ptr + h)
        dt = tl.load(dt_ptr + h * K + cols, mask=cmask, other=0.0).to(tl.float32)
        ddt = tl.zeros([BLOCK_K], dtype=tl.float32)  # sum over tokens of dz * a
        dzx = tl.zeros([BLOCK_K], dtype=tl.float32)  # sum over tokens of dz * x
        for i in range(TILES):
            rows = (pid_m * (BLOCK_M * TILES) + i * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            mask = (rows < M)[:, None] & cmask[None, :]
            offs = rows[:, None] * (H * K) + h * K + cols[None, :]
            x = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32) + dt[None, :]
            dg = tl.load(dg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            s = tl.sigmoid(a * x)
            dz = dg * lower_bound * s * (1.0 - s)  # masked entries: dg = 0
            dx = dz * a
            tl.store(df_ptr + offs, dx.to(df_ptr.dtype.element_ty), mask=mask)
            ddt += tl.sum(dx, axis=0)
            dzx += tl.sum(tl.where(mask, dz * x, 0.0), axis=0)
        tl.store(ddt_part_ptr + pid_m * (H * K) + h * K + cols, ddt, mask=cmask)
        tl.store(dzx_part_ptr + pid_m * H + h, tl.sum(dzx, axis=0))


# ------------------------------------------------------------------------------------------------ autograd


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` as a contiguous ``[rows, K]`` view (a copy only when ``x`` is not contiguous)."""
    return x.contiguous().view(-1, x.shape[-1])


class _L2NormQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, eps):
        q2, k2 = _rows(q), _rows(k)
        M, K = q2.shape
        qn, kn = torch.empty_like(q2), torch.empty_like(k2)
        rq = torch.empty(M, dtype=torch.float32, device=q.device)
        rk = torch.empty(M, dtype=torch.float32, device=q.device)
        cfg = TRITON_CONFIG
        if M > 0:
            grid = (triton.cdiv(M, cfg["l2_block_m"]), 2)
            _l2_fwd_kernel[grid](
                q2,
                k2,
                qn,
                kn,
                rq,
                rk,
                M,
                K,
                float(eps),
                BLOCK_M=cfg["l2_block_m"],
                BLOCK_K=triton.next_power_of_2(K),
                num_warps=cfg["l2_warps"],
            )
        ctx.save_for_backward(qn, kn, rq, rk)
        ctx.shape = q.shape
        return qn.view(q.shape), kn.view(k.shape)

    @staticmethod
    def backward(ctx, dqn, dkn):
        qn, kn, rq, rk = ctx.saved_tensors
        need_q, need_k = ctx.needs_input_grad[:2]
        if not (need_q or need_k):
            return None, None, None
        shape = ctx.shape
        dqn = torch.zeros_like(qn) if dqn is None else _rows(dqn)
        dkn = torch.zeros_like(kn) if dkn is None else _rows(dkn)
        M, K = qn.shape
        dq, dk = torch.empty_like(qn), torch.empty_like(kn)
        cfg = TRITON_CONFIG
        if M > 0:
            grid = (triton.cdiv(M, cfg["l2_block_m"]), 2)
            _l2_bwd_kernel[grid](
                dqn,
                dkn,
                qn,
                kn,
                rq,
                rk,
                dq,
                dk,
                M,
                K,
                BLOCK_M=cfg["l2_block_m"],
                BLOCK_K=triton.next_power_of_2(K),
                num_warps=cfg["l2_warps"],
            )
        return (dq.view(shape) if need_q else None), (dk.view(shape) if need_k else None), None


def l2norm_qk(q: torch.Tensor, k: torch.Tensor, eps: float = L2NORM_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 norm of q and k over the last axis, one Triton launch forward and one backward (spec 2.2 step 4).

    Args:
        q, k: ``[..., K]`` of the same shape and dtype (the layer: ``[B, T, H, K]`` bf16), on CUDA (or CPU under
            ``TRITON_INTERPRET=1``).
        eps: added under the square root (1e-6: fla, cuDNN and ``kernels_torch.kda.l2norm``).

    Returns:
        ``(q * rsqrt(sum(q^2) + eps), k * rsqrt(sum(k^2) + eps))``, fp32 math, in q's dtype, contiguous. Autograd:
        ``dx = (dy - y * sum(dy * y)) * rstd`` with the stored y (see the module docstring).

    Raises:
        ValueError: q and k differ in shape or dtype, or are not floating point.
        RuntimeError: Triton missing, or the tensors are not on CUDA (outside the interpreter).
    """
    if q.shape != k.shape or q.dtype != k.dtype or q.device != k.device:
        raise ValueError(
            f"q, k: got {tuple(q.shape)} {q.dtype} on {q.device} and {tuple(k.shape)} {k.dtype} on {k.device}, "
            "expected the same shape, dtype and device"
        )
    if not q.is_floating_point() or q.ndim < 1:
        raise ValueError(f"q: got dtype {q.dtype}, shape {tuple(q.shape)}, expected a floating [..., K] tensor")
    _check_device("l2norm_qk", q)
    return _L2NormQK.apply(q, k, eps)


class _GateLB(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, A_log, dt_bias, lower_bound, a_log_max):
        H, K = f.shape[-2:]
        f2 = f.contiguous().view(-1, H * K)
        M = f2.shape[0]
        a = torch.exp(A_log.detach().float().clamp(max=a_log_max)).contiguous()  # [H] rate per head
        dt = dt_bias.detach().float().contiguous()
        g = torch.empty(f2.shape, dtype=torch.float32, device=f.device)
        cfg = TRITON_CONFIG
        if M > 0:
            grid = (triton.cdiv(M, cfg["gate_block_m"]), H)
            _gate_fwd_kernel[grid](
                f2,
                a,
                dt,
                g,
                M,
                H,
                K,
                float(lower_bound),
                BLOCK_M=cfg["gate_block_m"],
                BLOCK_K=triton.next_power_of_2(K),
                num_warps=cfg["gate_warps"],
            )
        ctx.save_for_backward(f2, a, dt, A_log)
        ctx.lower_bound, ctx.a_log_max, ctx.shape = float(lower_bound), a_log_max, f.shape
        ctx.dtypes = (A_log.dtype, dt_bias.dtype)
        return g.view(f.shape)

    @staticmethod
    def backward(ctx, dg):
        f2, a, dt, A_log = ctx.saved_tensors
        H, K = ctx.shape[-2:]
        M = f2.shape[0]
        cfg = TRITON_CONFIG
        rows = cfg["gate_block_m"] * cfg["gate_tiles"]
        P = triton.cdiv(M, rows) if M > 0 else 0
        dg2 = dg.contiguous().view(-1, H * K)
        df = torch.empty_like(f2)
        ddt_part = torch.zeros(P, H * K, dtype=torch.float32, device=f2.device)
        dzx_part = torch.zeros(P, H, dtype=torch.float32, device=f2.device)
        if M > 0:
            _gate_bwd_kernel[(P, H)](
                f2,
                a,
                dt,
                dg2,
                df,
                ddt_part,
                dzx_part,
                M,
                H,
                K,
                ctx.lower_bound,
                BLOCK_M=cfg["gate_block_m"],
                BLOCK_K=triton.next_power_of_2(K),
                TILES=cfg["gate_tiles"],
                num_warps=cfg["gate_warps"],
            )
        ddt = ddt_part.sum(0)
        # dA_log = sum(dz * x) * exp(A_log): exp's gradient, then clamp's (0 past the cap, as torch's clamp)
        dA = dzx_part.sum(0) * a * (A_log.detach().float() <= ctx.a_log_max)
        dA_t, ddt_t = ctx.dtypes
        return df.view(ctx.shape), dA.to(dA_t), ddt.to(ddt_t), None, None


def kda_gate_lb(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """The KDA lower-bound gate ``g = lb * sigmoid(exp(min(A_log[h], A_LOG_MAX)) * (f + dt_bias))`` in one Triton
    launch forward and one backward (spec 2.2 step 5; twin of ``kernels_torch.kda.kda_gate`` with ``lower_bound``
    set; fla ``fused_kda_gate``).

    Args:
        f: ``[..., H, K]`` raw gate input (the layer: ``[B, T, H, K]`` bf16), on CUDA (or CPU under the interpreter).
        A_log: ``[H]`` (canonical, sliced; capped at ``kimi.kda_gate.A_LOG_MAX`` here). dt_bias: ``[H*K]``.
        lower_bound: ``gate_lower_bound`` (K3: -5.0), a finite negative float.

    Returns:
        g ``[..., H, K]`` fp32, contiguous. Autograd: df in f's dtype, dA_log and ddt_bias in their own dtypes
        (reduced in fp32), 0 gradient for A_log past the cap.

    Raises:
        ValueError: shapes, or ``lower_bound`` not a finite negative number.
        RuntimeError: Triton missing, or f not on CUDA (outside the interpreter).
    """
    if f.ndim < 2 or not f.is_floating_point():
        raise ValueError(f"f: got shape {tuple(f.shape)}, dtype {f.dtype}, expected a floating [..., H, K] tensor")
    H, K = f.shape[-2:]
    if tuple(A_log.shape) != (H,):
        raise ValueError(f"A_log: got shape {tuple(A_log.shape)}, expected [H]=[{H}]")
    if tuple(dt_bias.shape) != (H * K,):
        raise ValueError(f"dt_bias: got shape {tuple(dt_bias.shape)}, expected [H*K]=[{H * K}]")
    if lower_bound is None or not (float("-inf") < float(lower_bound) < 0):
        raise ValueError(f"lower_bound: got {lower_bound}, expected a finite negative gate_lower_bound")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.device != f.device:
            raise ValueError(f"{name}: on {t.device}, expected f's device {f.device}")
    _check_device("kda_gate_lb", f)
    return _GateLB.apply(f, A_log, dt_bias, float(lower_bound), A_LOG_MAX)
