"""Fused, memory-lean SiTU-GLU (spec 5.1) for the ``cudnn`` backend: Triton kernels with a torch twin.

Notable:
* The plain :func:`kernels_torch.moe.situ` is a chain of fp32 torch ops; under autograd it saves about six fp32
  ``[N, I]`` intermediates per call (for layer 0, I = 33792: about 1.3 MB per token) and runs ~12 kernels forward and
  ~20 backward. :func:`situ_glu` is one ``torch.autograd.Function`` that saves only its inputs ``a`` and ``b`` (in
  their own dtype) and recomputes the activation in backward: one kernel forward, one backward.
* Same numerics as the plain path: fp32 math (fp64 for fp64 input on the torch kernel), one rounding of ``out`` to
  ``a.dtype``, one rounding of each gradient (``da`` to ``a.dtype``, ``db`` to ``b.dtype``).
* Kernels (``kernel=``, or ``$KIMI_GLU_KERNEL``; ``kernels_torch.kernel_choice``, op ``glu``): ``triton`` (CUDA
  tensors of one dtype in bf16/fp16/fp32; CPU tensors too under ``TRITON_INTERPRET=1``, for tests) or ``torch``
  (any device, fp64 too; the readable twin, recompute with torch ops). ``auto`` takes Triton where it can run, else
  torch. Each call records the kernel that ran (``kernel_choice.used()``).
* Footgun: the Triton kernels compute tanh themselves (libdevice's is not available to the Triton interpreter, which
  the CPU tests use): the Cephes ``tanhf`` scheme, an odd polynomial for ``|x| < 0.625`` and
  ``1 - 2 / (exp(2|x|) + 1)`` above, which saturates to exactly +-1 (``exp`` overflows to inf, ``2 / inf = 0``) and
  so never makes NaN. The sigmoid is ``1 / (1 + exp(-x))``: 0 for very negative x, 1 for very positive x.

Derivatives (fp32), with ``t = tanh(a/beta)``, ``s = sigmoid(a)``, ``u = tanh(b/linear_beta)``:
``gate = beta·t·s``, ``d gate/da = (1 - t²)·s + gate·(1 - s)``; ``up = linear_beta·u``, ``d up/db = 1 - u²``;
``da = dout·up·d gate/da``, ``db = dout·gate·d up/db``. SiLU-GLU (``hidden_act='silu'``, Kimi-Linear):
``gate = a·s``, ``d gate/da = s·(1 + a·(1 - s))``, ``up = b``. ``linear_beta=None``: ``up = b``, ``d up/db = 1``.
"""

from __future__ import annotations

import os

import torch

from kernels_torch import kernel_choice
from kernels_torch.activations import situ
from kernels_torch.common import compute_dtype
from kernels_torch.ops.custom import own

try:  # Triton is optional: the CPU CI machine has none; the torch kernel works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None

__all__ = ["situ_glu", "glu_act_fused", "triton_available", "HIDDEN_ACTS", "TRITON_DTYPES", "TRITON_BLOCK"]

HIDDEN_ACTS = ("situ", "silu")
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TRITON_BLOCK = 2048  # elements per program (elementwise op; 4 warps, 16 elements per thread)


def triton_available() -> bool:
    """True when Triton imports (a CUDA machine with Triton, or the interpreter's CPU build)."""
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------------


def _check(a, b, beta, linear_beta, hidden_act):
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError(f"situ_glu: a and b must be tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.shape != b.shape:
        raise ValueError(f"situ_glu: a has shape {tuple(a.shape)} and b {tuple(b.shape)}, expected equal shapes")
    for name, x in (("a", a), ("b", b)):
        if not x.is_floating_point():
            raise ValueError(f"situ_glu: {name} has dtype {x.dtype}, expected a floating dtype")
    if a.device != b.device:
        raise ValueError(f"situ_glu: a is on {a.device} and b on {b.device}, expected one device")
    if hidden_act not in HIDDEN_ACTS:
        raise ValueError(f"hidden_act: got {hidden_act!r}, expected one of {list(HIDDEN_ACTS)}")
    if hidden_act == "situ" and not (isinstance(beta, (int, float)) and beta > 0):
        raise ValueError(f"situ_glu: beta got {beta!r}, expected a positive number (activation_situ_beta)")
    if linear_beta is not None and not (isinstance(linear_beta, (int, float)) and linear_beta > 0):
        raise ValueError(
            f"situ_glu: linear_beta got {linear_beta!r}, expected a positive number or None "
            "(activation_situ_linear_beta)"
        )


def _triton_refusal(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot take these inputs (None when it can)."""
    if triton is None:
        return "triton is not importable"
    if not (a.is_cuda or _interpreting()):
        return f"the tensors are on {a.device}, expected CUDA (or TRITON_INTERPRET=1)"
    if a.dtype != b.dtype:
        return f"a is {a.dtype} and b {b.dtype}, expected one dtype"
    if a.dtype not in TRITON_DTYPES:
        return f"dtype {a.dtype}, expected one of bfloat16, float16, float32"
    return None


# ----------------------------------------------------------------------------------------------------------
# torch kernel: the readable twin (same expressions, in the same order, as kernels_torch.moe.situ / glu_act)
# ----------------------------------------------------------------------------------------------------------


def _gate_up_torch(af, bf, hidden_act, beta, linear_beta):
    """fp32/fp64 ``gate``, ``up`` and their derivatives ``d gate/da``, ``d up/db`` (None for 1)."""
    if hidden_act == "situ":
        t, s = torch.tanh(af / beta), torch.sigmoid(af)
        gate = beta * t * s  # SiLU with x soft-capped to (-beta, beta)
        dgate = (1 - t * t) * s + gate * (1 - s)
    else:
        s = torch.sigmoid(af)
        gate = af * s
        dgate = s * (1 + af * (1 - s))
    if linear_beta is None:
        return gate, dgate, bf, None
    u = torch.tanh(bf / linear_beta)
    return gate, dgate, linear_beta * u, 1 - u * u


def _forward_torch(a, b, hidden_act, beta, linear_beta):
    if hidden_act == "situ":  # the plain op itself: bitwise the same output
        return situ(a, b, beta, linear_beta)
    cd = compute_dtype(a, b)
    af, bf = a.to(cd), b.to(cd)
    up = bf if linear_beta is None else linear_beta * torch.tanh(bf / linear_beta)
    return (torch.nn.functional.silu(af) * up).to(a.dtype)


def _backward_torch(dout, a, b, hidden_act, beta, linear_beta, need_da, need_db):
    cd = compute_dtype(a, b)
    af, bf, g = a.to(cd), b.to(cd), dout.to(cd)
    gate, dgate, up, dup = _gate_up_torch(af, bf, hidden_act, beta, linear_beta)
    da = (g * up * dgate).to(a.dtype) if need_da else None
    if not need_db:
        return da, None
    db = g * gate if dup is None else g * gate * dup
    return da, db.to(b.dtype)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _tanh(x):
        """fp32 tanh, Cephes ``tanhf``: odd polynomial below 0.625, ``1 - 2/(exp(2|x|)+1)`` above (saturates to 1)."""
        ax = tl.abs(x)
        xs = tl.where(ax < 0.625, x, 0.0)  # the polynomial's argument (no x*x overflow for huge |x|)
        z = xs * xs
        p = (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
        small = xs + xs * z * (p - 3.33332819422e-1)
        big = 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0)  # exp overflows to inf for large |x|: big = 1, never NaN
        big = tl.where(x < 0, -big, big)
        return tl.where(ax < 0.625, small, big)

    @triton.jit
    def _gate_up(af, bf, beta, linear_beta, SITU: tl.constexpr, HAS_LB: tl.constexpr):
        s = 1.0 / (1.0 + tl.exp(-af))  # sigmoid: exp(1e4) = inf gives exactly 0
        if SITU:
            t = _tanh(af / beta)
            gate = beta * t * s
            dgate = (1.0 - t * t) * s + gate * (1.0 - s)
        else:
            gate = af * s
            dgate = s * (1.0 + af * (1.0 - s))
        if HAS_LB:
            u = _tanh(bf / linear_beta)
            up = linear_beta * u
            dup = 1.0 - u * u
        else:
            up = bf
            dup = tl.full(bf.shape, 1.0, tl.float32)
        return gate, dgate, up, dup

    @triton.jit
    def _situ_glu_fwd_kernel(
        a_ptr, b_ptr, out_ptr, n, beta, linear_beta, SITU: tl.constexpr, HAS_LB: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: N·I can exceed 2^31
        mask = offs < n
        af = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        bf = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gate, dgate, up, dup = _gate_up(af, bf, beta, linear_beta, SITU, HAS_LB)
        tl.store(out_ptr + offs, (gate * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _situ_glu_bwd_kernel(
        dout_ptr,
        a_ptr,
        b_ptr,
        da_ptr,
        db_ptr,
        n,
        beta,
        linear_beta,
        SITU: tl.constexpr,
        HAS_LB: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        af = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        bf = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gate, dgate, up, dup = _gate_up(af, bf, beta, linear_beta, SITU, HAS_LB)
        tl.store(da_ptr + offs, (g * up * dgate).to(da_ptr.dtype.element_ty), mask=mask)
        tl.store(db_ptr + offs, (g * gate * dup).to(db_ptr.dtype.element_ty), mask=mask)


def _launch_args(hidden_act, beta, linear_beta):
    return dict(
        beta=float(beta),
        linear_beta=float(linear_beta if linear_beta is not None else 1.0),
        SITU=hidden_act == "situ",
        HAS_LB=linear_beta is not None,
        BLOCK=TRITON_BLOCK,
    )


def _forward_triton(a, b, hidden_act, beta, linear_beta):
    a_, b_ = a.contiguous(), b.contiguous()
    out = torch.empty_like(a_)
    n = a_.numel()
    if n:
        grid = (triton.cdiv(n, TRITON_BLOCK),)
        _situ_glu_fwd_kernel[grid](a_, b_, out, n, **_launch_args(hidden_act, beta, linear_beta), num_warps=4)
    return out


def _backward_triton(dout, a, b, hidden_act, beta, linear_beta):
    g, a_, b_ = dout.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a_), torch.empty_like(b_)
    n = a_.numel()
    if n:
        grid = (triton.cdiv(n, TRITON_BLOCK),)
        _situ_glu_bwd_kernel[grid](g, a_, b_, da, db, n, **_launch_args(hidden_act, beta, linear_beta), num_warps=4)
    return da, db


# ----------------------------------------------------------------------------------------------------------
# autograd Function and the public entry points
# ----------------------------------------------------------------------------------------------------------


class _SituGLU(torch.autograd.Function):
    """Saves ``a`` and ``b`` only (their own dtype); the backward recomputes gate, up and their derivatives."""

    @staticmethod
    def forward(ctx, a, b, hidden_act, beta, linear_beta, kernel):
        ctx.save_for_backward(a, b)
        ctx.args = (hidden_act, beta, linear_beta, kernel)
        if kernel == "triton":
            return _forward_triton(a, b, hidden_act, beta, linear_beta)
        return _forward_torch(a, b, hidden_act, beta, linear_beta)

    @staticmethod
    def backward(ctx, dout):
        a, b = ctx.saved_tensors
        hidden_act, beta, linear_beta, kernel = ctx.args
        need_da, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if kernel == "triton":
            da, db = _backward_triton(dout, a, b, hidden_act, beta, linear_beta)
            da, db = (da if need_da else None), (db if need_db else None)
        else:
            da, db = _backward_torch(dout, a, b, hidden_act, beta, linear_beta, need_da, need_db)
        return da, db, None, None, None, None


def situ_glu(
    a: torch.Tensor,
    b: torch.Tensor,
    beta: float = 4.0,
    linear_beta: float | None = 25.0,
    *,
    hidden_act: str = "situ",
    kernel: str | None = None,
) -> torch.Tensor:
    """SiTU-GLU (spec 5.1) ``[beta·tanh(a/beta)·sigmoid(a)] · [linear_beta·tanh(b/linear_beta)]``, fused.

    The memory-lean twin of :func:`kernels_torch.moe.situ` (``hidden_act='situ'``) and of the SiLU branch of
    :func:`kernels_torch.moe.glu_act` (``hidden_act='silu'``: ``silu(a)·up``; the plain path has no soft cap on b,
    so pass ``linear_beta=None`` for it; ``beta`` is then unused). ``linear_beta=None`` uses plain ``b``.

    Args:
        a, b: ``[..., I]`` gate / up pre-activations, one shape and device; bf16/fp16/fp32/fp64 (the Triton kernel
            takes one dtype of bf16/fp16/fp32).
        beta, linear_beta: the soft caps (``activation_situ_beta`` 4.0, ``activation_situ_linear_beta`` 25.0).
        hidden_act: ``'situ'`` or ``'silu'``.
        kernel: ``'auto'`` | ``'triton'`` | ``'torch'``; None reads ``$KIMI_GLU_KERNEL`` (default auto: Triton for
            CUDA tensors it takes, else torch).

    Returns:
        ``[..., I]`` in ``a.dtype`` (fp32 math, fp64 for fp64 input on the torch kernel; one rounding). Under
        autograd it saves only ``a`` and ``b``; ``da`` is in ``a.dtype``, ``db`` in ``b.dtype``.

    Raises:
        ValueError: shapes, devices or dtypes that differ or are not floating, ``beta <= 0`` (situ),
            ``linear_beta <= 0``, an unknown ``hidden_act`` or ``kernel``, or ``kernel='triton'`` on inputs it
            cannot take (no Triton, not CUDA, mixed or fp64 dtypes).
    """
    _check(a, b, beta, linear_beta, hidden_act)
    chosen = kernel_choice.resolve("glu", kernel)
    refusal = _triton_refusal(a, b)
    if chosen == "triton" and refusal is not None:
        raise ValueError(f"situ_glu: kernel='triton' cannot run: {refusal}")
    run = "triton" if chosen == "triton" or (chosen == "auto" and refusal is None) else "torch"
    if torch.compiler.is_compiling():  # Triton launches and a recomputing backward: one node for the compiler
        lb = None if linear_beta is None else float(linear_beta)
        return _situ_glu_op(a, b, hidden_act, float(beta), lb, run)
    kernel_choice.record("glu", run)
    return _SituGLU.apply(a, b, hidden_act, beta, linear_beta, run)


def glu_act_fused(a: torch.Tensor, b: torch.Tensor, config, kernel: str | None = None) -> torch.Tensor:
    """The fused twin of :func:`kernels_torch.moe.glu_act`: SiTU-GLU (``config.hidden_act == 'situ'``, with
    ``activation_situ_beta`` / ``activation_situ_linear_beta``) or SiLU-GLU ``silu(a)·b`` (``'silu'``).

    ``a``, ``b`` ``[..., I]`` -> ``[..., I]`` in ``a.dtype``; ``config`` a :class:`kimi.config.KimiConfig`.

    Raises:
        ValueError: an unknown ``hidden_act``, or the errors of :func:`situ_glu`.
    """
    if config.hidden_act == "situ":
        return situ_glu(
            a, b, config.activation_situ_beta, config.activation_situ_linear_beta, hidden_act="situ", kernel=kernel
        )
    if config.hidden_act == "silu":
        return situ_glu(a, b, 1.0, None, hidden_act="silu", kernel=kernel)
    raise ValueError(f"hidden_act: got {config.hidden_act!r}, expected 'situ' or 'silu'")


# ----------------------------------------------------------------------------------------------------------
# custom ops: situ_glu as one node for torch.compile (kernels_torch.ops.custom), with its closed-form backward
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("kimi::situ_glu", mutates_args=())
def _situ_glu_op(
    a: torch.Tensor, b: torch.Tensor, hidden_act: str, beta: float, linear_beta: float | None, kernel: str
) -> torch.Tensor:
    """:func:`situ_glu`'s forward on the kernel already chosen (``"triton"`` or ``"torch"``): ``[..., I]`` in
    ``a.dtype``, contiguous."""
    kernel_choice.record("glu", kernel)
    if kernel == "triton":
        return own(_forward_triton(a, b, hidden_act, beta, linear_beta), (a, b))
    return own(_forward_torch(a, b, hidden_act, beta, linear_beta), (a, b))


@_situ_glu_op.register_fake
def _(a, b, hidden_act, beta, linear_beta, kernel):
    return torch.empty(a.shape, dtype=a.dtype, device=a.device)


@torch.library.custom_op("kimi::situ_glu_backward", mutates_args=())
def _situ_glu_backward_op(
    dout: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    hidden_act: str,
    beta: float,
    linear_beta: float | None,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(da, db)`` of :func:`situ_glu` from the saved ``a``, ``b`` (the same kernels as the eager backward):
    ``da`` in ``a.dtype``, ``db`` in ``b.dtype``, both contiguous."""
    if kernel == "triton":
        da, db = _backward_triton(dout, a, b, hidden_act, beta, linear_beta)
    else:
        da, db = _backward_torch(dout, a, b, hidden_act, beta, linear_beta, True, True)
    return own(da, (dout, a, b)), own(db, (dout, a, b))


@_situ_glu_backward_op.register_fake
def _(dout, a, b, hidden_act, beta, linear_beta, kernel):
    return torch.empty(a.shape, dtype=a.dtype, device=a.device), torch.empty(b.shape, dtype=b.dtype, device=b.device)


def _situ_setup(ctx, inputs, output):
    a, b, hidden_act, beta, linear_beta, kernel = inputs
    ctx.save_for_backward(a, b)  # the inputs only, as the eager Function: the backward recomputes the activation
    ctx.args = (hidden_act, beta, linear_beta, kernel)


def _situ_backward(ctx, dout):
    a, b = ctx.saved_tensors
    da, db = _situ_glu_backward_op(dout, a, b, *ctx.args)
    return da, db, None, None, None, None


_situ_glu_op.register_autograd(_situ_backward, setup_context=_situ_setup)

CUSTOM_OPS = (_situ_glu_op, _situ_glu_backward_op)  # opcheck'd in tests
