"""The ``cudnn`` backend of the KDA layer: the GPU kernels behind ``kernels_torch.kda.KimiDeltaAttention`` in chunk
mode.

``kernels_torch.kda`` is the readable twin of ``reference_jax.kda`` and the oracle of everything here; the layer calls
:func:`require_cudnn_backend` and :func:`kda_layer_forward` when ``backend='cudnn'`` and ``mode='chunk'``. This module
never imports the layer (it reads the layer's weights and kernel attributes), so the two have no import cycle; fla and
cuDNN Frontend are imported inside the functions that call them, so CPU machines import this module without the
``gpu`` extra. Math: docs/spec.md section 2.2 (the forward), 2.4 (packed documents and state); kernel facts and
timings: docs/kernels.md and ``kernels_torch.kernel_choice``.

The pieces, each with a reason-string probe (``*_unavailable``: None where it can run) and a seam the CPU tests replace
with a torch stand-in:

* short conv + SiLU: fla-core's ``causal_conv1d`` or cuDNN Frontend's ``cudnn.ops.causal_conv1d``
  (:func:`short_conv_cudnn`, its new conv state gathered here by :func:`conv_final_state`);
* the recurrence: cuDNN Frontend's KDA op (``torch.ops.cudnn.kimi_delta_attention_fwd``, SM90 engine
  ``kda_hopper_cuda``; :func:`kda_recurrence_cudnn` with autograd, :func:`kda_recurrence_cudnn_fused` forward only
  with the q/k norm, gate and beta sigmoid in the kernel) or fla-core's ``chunk_kda``; the SM90 forward's sequence
  split by :func:`cudnn_kda_pieces`;
* the choice of each (``kernels_torch.kernel_choice``: the layer's ``kda_kernel`` / ``kda_prep`` / ``kda_pieces`` /
  ``short_conv_kernel`` attributes or ``$KIMI_KDA_KERNEL`` ...; ``auto`` takes cuDNN where it imports and takes the
  shape, K = V = 128, else fla), recorded in ``kernel_choice.used()``;
* fla-core's gated RMSNorm around it all (``rms_norm_gated``, sigmoid).

Under ``torch.compile`` (``kernels_torch.compile``) :func:`kda_layer_forward` runs :func:`_kda_layer_forward_compiled`:
the kernels as ``kimi::`` ops (``kimi::kda_short_conv``, ``kimi::kda_cudnn`` with cuDNN's backward as
``kimi::kda_cudnn_backward``, ``kimi::kda_fla``), the q/k L2 norm, gate, beta sigmoid and output norm as their
torch twins for the compiler to fuse. Eager calls run the kernels directly, as described below.

Numerics: g and beta enter every recurrence kernel in fp32, never narrowed to bf16 (bf16 decays close to 1 round to
1 and channels stop forgetting over long sequences); beta's sigmoid is applied exactly once per path.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import threading

import torch
import torch.nn.functional as F
from torch import nn

from kernels_torch import kda_functional, kernel_choice
from kernels_torch.common import check_cu_seqlens, compute_dtype, depthwise_conv_weight, linear
from kernels_torch.ops.custom import autograd_inside_op, own, recompute_op, trace_constant
from kernels_torch.ops.linears import shared_input_linears
from kimi.kda_gate import A_LOG_MAX

__all__ = [
    "GPU_EXTRA_HINT",
    "CUDNN_CONV_WIDTH",
    "CUDNN_KDA_HEAD_DIM",
    "CUDNN_KDA_PLAN_SM90",
    "require_cudnn_backend",
    "cudnn_short_conv_unavailable",
    "conv_final_state",
    "short_conv_cudnn",
    "cudnn_kda_unavailable",
    "cudnn_kda_pieces",
    "kda_recurrence_cudnn",
    "kda_recurrence_cudnn_fused",
    "kda_layer_forward",
]

GPU_EXTRA_HINT = "pip install 'kimi-k3[gpu]' (fla-core>=0.6, nvidia-cudnn-frontend)"


def _cudnn_missing(x: torch.Tensor) -> list[str]:
    """What ``backend='cudnn'`` lacks for activations ``x``: the ``gpu`` extra (fla), CUDA tensors, bf16 activations."""
    missing = []
    if not _fla_importable():
        missing.append(f"the gpu extra (fla-core is not importable; {GPU_EXTRA_HINT})")
    if not x.is_cuda:
        missing.append(f"CUDA tensors (x is on {x.device})")
    if x.dtype != torch.bfloat16:
        missing.append(f"bfloat16 activations (x is {x.dtype})")
    return missing


@trace_constant  # under torch.compile: probed once, while tracing
def _fla_importable() -> bool:
    return importlib.util.find_spec("fla") is not None


def require_cudnn_backend(x: torch.Tensor) -> None:
    """Refuse ``backend='cudnn'`` for activations ``x`` where it cannot run, naming everything missing at once.

    Raises:
        RuntimeError: the ``gpu`` extra (fla-core) does not import, ``x`` is not on CUDA, or ``x`` is not bf16.
    """
    missing = _cudnn_missing(x)
    if missing:
        raise RuntimeError(
            "backend='cudnn' (KDA on cuDNN / fla kernels) needs "
            + "; ".join(missing)
            + "; use backend='eager' otherwise"
        )


def _fla_conv_state(state: torch.Tensor | None) -> torch.Tensor | None:
    """Our conv state ``[N, C, W-1]`` (last W-1 pre-conv inputs, oldest first) as fla's ``[N, C, W]``.

    Footgun: fla's ``causal_conv1d`` keeps a full kernel-width window and reads only its last ``W-1`` columns as the
    inputs before the sequence start (column 0 is never read), so we pad one zero column in front."""
    return None if state is None else F.pad(state, (1, 0))


_CUDNN_CONV_MODULE = "cudnn.ops"  # cudnn.ops.causal_conv1d: CuTe DSL (nvidia-cutlass-dsl), bf16, width 4, SiLU
CUDNN_CONV_WIDTH = 4  # the only kernel width cuDNN FE 1.32's causal_conv1d route takes


def _cudnn_causal_conv1d():
    """``cudnn.ops.causal_conv1d`` (cuDNN Frontend); a seam for the CPU tests, which replace it by a torch stand-in."""
    return importlib.import_module(_CUDNN_CONV_MODULE).causal_conv1d


def cudnn_short_conv_unavailable(x: torch.Tensor, W: int) -> str | None:
    """Why cuDNN's ``causal_conv1d`` cannot run KDA's short convolution on activations ``x`` with kernel width ``W``,
    as a reason string, or None when it can (as far as can be told before the call: the CuTe DSL route may still
    decline at the call with ``NotImplementedError``, e.g. without the CUTLASS DSL or on an unlisted device)."""
    return _short_conv_unavailable_on(x.device, x.dtype, W)


@trace_constant  # under torch.compile: probed once per (device, dtype, W), while tracing
def _short_conv_unavailable_on(device: torch.device, dtype: torch.dtype, W: int) -> str | None:
    """:func:`cudnn_short_conv_unavailable` for activations on ``device`` in ``dtype``."""
    if importlib.util.find_spec("cudnn") is None:
        return "nvidia-cudnn-frontend is not importable"
    if importlib.util.find_spec("cutlass") is None:  # the CuTe DSL route imports it at the first call
        return "the CUTLASS DSL (nvidia-cutlass-dsl, module cutlass) that its CuTe DSL route needs is not importable"
    try:
        _cudnn_causal_conv1d()
    except Exception as e:  # ImportError / AttributeError (another cuDNN FE version), or a broken install
        return f"cudnn.ops.causal_conv1d is not there ({type(e).__name__}: {e})"
    if device.type != "cuda":
        return f"x is on {device}"
    if dtype != torch.bfloat16:
        return f"x is {dtype}; cuDNN's route takes bfloat16 activations"
    if W != CUDNN_CONV_WIDTH:
        return f"kernel width W={W}; cuDNN's route takes W = {CUDNN_CONV_WIDTH}"
    return None


def conv_final_state(
    x: torch.Tensor, conv_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, W: int
) -> torch.Tensor:
    """The new conv state of :func:`kernels_torch.kda.short_conv`: the last ``W-1`` pre-conv inputs of each sequence
    or document, oldest first, ``[N, C, W-1]`` in ``x.dtype``; a position before a document's start reads that
    document's ``conv_state`` row (zeros without one). A gather of ``N * (W-1)`` rows, no sync.

    Args:
        x: ``[B, T, C]``; conv_state ``[N, C, W-1]`` or None; cu_seqlens ``[N+1]`` int on any device (B == 1, already
            validated) or None (B sequences of T).
    """
    B, T, C = x.shape
    x2 = x.reshape(B * T, C)
    if cu_seqlens is None:
        cu = torch.arange(0, B * T + 1, T, device=x.device)
    else:
        cu = torch.as_tensor(cu_seqlens).to(device=x.device, dtype=torch.int64)
    N = cu.numel() - 1
    start, end = cu[:-1, None], cu[1:, None]
    pos = end - (W - 1) + torch.arange(W - 1, device=x.device)  # [N, W-1]: the last W-1 positions, oldest first
    inside = pos >= start
    vals = x2[pos.clamp(min=0)].transpose(1, 2)  # [N, C, W-1]
    if conv_state is None:
        return vals.masked_fill(~inside[:, None, :], 0)
    j = (pos - start + (W - 1)).clamp(0, W - 2)  # position start - 1 is the state's last column, W - 2
    from_state = conv_state.to(x.dtype).gather(2, j[:, None, :].expand(N, C, W - 1))
    return torch.where(inside[:, None, :], vals, from_state)


def short_conv_cudnn(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels_torch.kda.short_conv` (depthwise causal conv1d without bias, then SiLU; spec 2.2 step 2) on cuDNN
    Frontend's ``cudnn.ops.causal_conv1d`` (CuTe DSL kernels, fp32 accumulation, with their own backward for x and the filter;
    the filter gradient accumulates with atomics unless ``torch.use_deterministic_algorithms`` is on).

    Args:
        x: ``[B, T, C]`` bf16 CUDA, channel-last (passed as its zero-copy ``[B, C, T]`` transpose, the op's layout).
        weight: ``[C, 1, W]`` or ``[C, W]``, fp32 or bf16, W = 4.
        cu_seqlens: ``[N+1]`` (B == 1, packed documents; validated by the caller; taken as int32 on x's device) or
            None. conv_state: ``[N, C, W-1]`` (the last ``W-1`` inputs before each document, oldest first) or None.

    Returns:
        ``(y [B, T, C] bf16, new_conv_state [N, C, W-1] bf16)`` as :func:`kernels_torch.kda.short_conv`; the new state
        is gathered from x here (:func:`conv_final_state`), not by the op.

    Raises:
        ValueError: shapes; NotImplementedError from cuDNN where its route declines (the layer then runs fla's).
    """
    B, T, C = x.shape
    w = depthwise_conv_weight(weight, C).contiguous()
    W = w.shape[1]
    cu = None if cu_seqlens is None else torch.as_tensor(cu_seqlens).to(device=x.device, dtype=torch.int32)
    N = B if cu is None else cu.numel() - 1
    if conv_state is not None:
        if tuple(conv_state.shape) != (N, C, W - 1):
            raise ValueError(
                f"conv_state: got shape {tuple(conv_state.shape)}, expected [N, C, W-1]=[{N}, {C}, {W - 1}]"
            )
        conv_state = conv_state.to(x.dtype)
    y = _cudnn_causal_conv1d()(
        x.contiguous().transpose(1, 2), w, activation="silu", cu_seqlens=cu, initial_states=conv_state
    )
    return y.transpose(1, 2), conv_final_state(x, conv_state, cu, W)


CUDNN_KDA_HEAD_DIM = 128  # kda_hopper_cuda: K = V = 128, default scale K^-1/2
CUDNN_KDA_PLAN_SM90 = "kda_hopper_cuda"  # the only SM90 KDA engine with a backward (NVRTC: needs CUDA headers)
_CUDNN_KDA_OP = "cudnn.linear_attention.ops.kda"  # importing it registers torch.ops.cudnn.kimi_delta_attention_fwd


def _cudnn_kda_op():
    """``torch.ops.cudnn.kimi_delta_attention_fwd`` (importing cuDNN FE's KDA module registers it); a seam for the
    CPU tests, which replace it by a torch stand-in."""
    importlib.import_module(_CUDNN_KDA_OP)
    return torch.ops.cudnn.kimi_delta_attention_fwd


def cudnn_kda_unavailable(x: torch.Tensor, K: int, V: int, lower_bound: float | None = -5.0) -> str | None:
    """Why the cuDNN KDA op cannot run the recurrence for activations ``x`` with head dims K, V and the gate's
    ``lower_bound`` (``gate_lower_bound``; None = the unbounded softplus gate), as a reason string, or None when it
    can. The SM90 engine is validated at the bounded gate only: with the softplus gate (log-decay far below -5) its
    output is NaN (measured on the H200, 2026-11-30), so that gate runs on fla."""
    return _cudnn_kda_unavailable_on(x.device, K, V, lower_bound)


@trace_constant  # under torch.compile: probed once per (device, shape, gate), while tracing
def _cudnn_kda_unavailable_on(device: torch.device, K: int, V: int, lower_bound: float | None) -> str | None:
    """:func:`cudnn_kda_unavailable` for activations on ``device``."""
    if importlib.util.find_spec("cudnn") is None:
        return "nvidia-cudnn-frontend is not importable"
    try:
        importlib.import_module(_CUDNN_KDA_OP)
    except Exception as e:  # ImportError, or a broken install raising at import
        return f"{_CUDNN_KDA_OP} does not import ({type(e).__name__}: {e})"
    if device.type != "cuda":
        return f"x is on {device}"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in (9, 10):
        return f"device capability {major}.x has no cuDNN KDA engine with a backward (SM90 or SM100)"
    if (K, V) != (CUDNN_KDA_HEAD_DIM, CUDNN_KDA_HEAD_DIM):
        return f"head dims K={K}, V={V}; the SM90 engine takes K = V = {CUDNN_KDA_HEAD_DIM}"
    if lower_bound is None or not -5.0 <= lower_bound < 0:
        return (
            f"gate_lower_bound={lower_bound}: the cuDNN engine needs a bounded gate (lower bound in [-5, 0)); "
            "with the unbounded softplus gate it returns NaN"
        )
    return None


def _cudnn_plan_name(device: torch.device) -> str | None:
    """The engine pinned on this device: ``kda_hopper_cuda`` on SM90 (so that a decline fails loudly instead of
    falling to the slow ``kda_cutile`` engine), cuDNN's own choice elsewhere. ``$KIMI_KDA_CUDNN_PLAN`` overrides
    (empty: cuDNN's choice)."""
    import os

    env = os.environ.get("KIMI_KDA_CUDNN_PLAN")
    if env is not None:
        return env or None
    return CUDNN_KDA_PLAN_SM90 if torch.cuda.get_device_capability(device)[0] == 9 else None


_CUDNN_KDA_SM90_HOST = "cudnn.linear_attention.hopper.cuda_host"  # kda_hopper_cuda's forward launcher
_PIECES_LOCK = threading.RLock()  # re-entrant: a block nested in the same thread sets its own split, then the outer's


def _cudnn_kda_host():
    """``(module, None)``: cuDNN FE's SM90 forward launcher module, which has ``pieces_per_sequence``; or
    ``(None, why)`` where it does not import or lacks that function (another cuDNN FE version, or none)."""
    try:
        host = importlib.import_module(_CUDNN_KDA_SM90_HOST)
        host.pieces_per_sequence  # noqa: B018  (only its presence is checked here)
    except Exception as e:  # ImportError, AttributeError, or a broken install raising at import
        return None, f"{type(e).__name__}: {e}"
    return host, None


def _kda_pieces_choice(pieces: str | None) -> str:
    """``kernel_choice.resolve("kda_pieces", pieces)``, checked: a forced ``"one"`` needs the launcher function.

    Raises:
        ValueError: a value outside ``kernel_choice.CHOICES["kda_pieces"]`` (argument or ``$KIMI_KDA_PIECES``).
        RuntimeError: ``"one"`` forced where the installed cuDNN FE has no such launcher function (another version).
    """
    choice = kernel_choice.resolve("kda_pieces", pieces)
    if choice == "one":
        host, missing = _cudnn_kda_host()
        if host is None:
            raise RuntimeError(
                f"kda_pieces: got 'one', but {_CUDNN_KDA_SM90_HOST}.pieces_per_sequence is not there ({missing}); "
                "this cuDNN FE version splits sequences its own way: use 'cudnn'"
            )
    return choice


class _OnePiece:
    """cuDNN's ``pieces_per_sequence`` with ``P = 1``: one CTA per (sequence, head), no walk-back. Keeps the function
    it replaced (``heuristic``), so that a ``"cudnn"`` block nested inside can put cuDNN's own split back."""

    def __init__(self, heuristic):
        self.heuristic = heuristic

    def __call__(self, total_tokens: int, n_seqs: int, n_heads: int) -> int:
        return 1


@contextlib.contextmanager
def cudnn_kda_pieces(pieces: str | None = None):
    """Run cuDNN KDA calls inside the block with the forward's sequence split ``pieces`` (``kernel_choice`` op
    ``kda_pieces``: ``"one"``, ``"cudnn"``, ``"auto"`` = ``"one"``; None: ``$KIMI_KDA_PIECES``, then auto). Yields the
    choice that applies, recorded by the caller.

    cuDNN FE 1.32's SM90 forward (``kda_hopper_cuda``, ``hopper/cuda_host.py``) launches ``P`` CTAs per (sequence,
    head) from its module function ``pieces_per_sequence`` (``P = 264 // (N * H)``, at most the 16-token chunks). A
    piece after the first begins by walking back over the tokens before it until its decay bound (per chunk, the
    slowest channel's ``sum_t g * log2(e) + 3.5 < 0``) proves the carried state negligible; one channel that hardly
    decays stalls the bound and the piece redoes its predecessors' work. ``"one"`` sets ``P = 1`` for the calls in the
    block (one CTA walks the sequence; exactly the recurrence, no walk-back) by replacing that function, and
    ``"cudnn"`` puts cuDNN's own function there (it is the one there unless this block is nested in a ``"one"``
    block); either way under one lock, held for the whole block (other threads' blocks wait: no thread launches with
    another's split), and the function found on entry is restored on exit, also on an exception. The backward engine
    has no pieces. Only the SM90 engine calls that function: elsewhere (SM100, or another engine pinned by
    ``$KIMI_KDA_CUDNN_PLAN``) the split recorded is the one requested, not one that ran. Measured: ``kernel_choice``'s
    docstring.

    Raises:
        ValueError: a value outside ``kernel_choice.CHOICES["kda_pieces"]``.
        RuntimeError: ``"one"`` forced where the installed cuDNN FE has no such launcher function (another version).
    """
    choice = _kda_pieces_choice(pieces)
    host, _ = _cudnn_kda_host()
    if host is None:  # auto or 'cudnn' on a cuDNN FE without that launcher: its own split, nothing to patch
        yield "cudnn"
        return
    split = "cudnn" if choice == "cudnn" else "one"
    with _PIECES_LOCK:
        found = host.pieces_per_sequence  # read under the lock: never another thread's patch
        heuristic = found.heuristic if isinstance(found, _OnePiece) else found
        host.pieces_per_sequence = _OnePiece(heuristic) if split == "one" else heuristic
        try:
            yield split
        finally:
            host.pieces_per_sequence = found


def _cudnn_kda_args(q, v, initial_state, cu_seqlens, plan_name):
    """What both cuDNN calls share, in the op's terms: ``(B, T, H, K, V, cu, S0, plan_name)`` with ``cu`` int32
    ``[N+1]`` on q's device (``[0, T, 2T, ...]`` for B sequences), ``S0`` None or the initial state as the op's V-first
    fp32 ``[N, H, V, K]`` (one transposing copy, only when a state is given), and the resolved plan name."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        cu = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=q.device)
    else:
        cu = torch.as_tensor(cu_seqlens).to(device=q.device, dtype=torch.int32)
    N = cu.numel() - 1
    S0 = None
    if initial_state is not None:
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(
                f"initial_state: got shape {tuple(initial_state.shape)}, expected [N, H, K, V]=[{N}, {H}, {K}, {V}]"
            )
        S0 = initial_state.float().transpose(-1, -2).contiguous()  # K-first -> the op's V-first [N, H, V, K]
    if plan_name == "default":
        plan_name = _cudnn_plan_name(q.device)
    return B, T, H, K, V, cu, S0, plan_name


def kda_recurrence_cudnn(
    q, k, v, g, beta, initial_state=None, cu_seqlens=None, plan_name: str | None = "default", pieces: str | None = None
):
    """The KDA recurrence (spec 2.2 step 7) on cuDNN Frontend's KDA op, with autograd.

    Args:
        q, k: ``[B, T, H, K]`` bf16, already L2-normalised (the SM90 backward takes no in-kernel norm).
        v: ``[B, T, H, V]`` bf16. g: ``[B, T, H, K]`` fp32 log-space decay (<= 0). beta: ``[B, T, H]`` fp32, post-sigmoid
            (the SM90 backward engine needs fp32 beta: bf16 gets "no engine proposed a plan").
        initial_state: ``[N, H, K, V]`` fp32 (our K-first layout) or None (zeros).
        cu_seqlens: ``[N+1]`` int (B == 1, packed documents, the state resets at each start) or None (B sequences).
        plan_name: cuDNN plan to pin; ``"default"``: ``kda_hopper_cuda`` on SM90 (:func:`_cudnn_plan_name`).
        pieces: the SM90 forward's sequence split (:func:`cudnn_kda_pieces`; None: ``$KIMI_KDA_PIECES``, then
            ``"one"``); recorded in ``kernel_choice.used()["kda_pieces"]``.

    Returns:
        ``o [B, T, H, V]`` bf16 and the final state ``[N, H, K, V]`` fp32 (K-first). Scale ``K^-1/2`` (the only one the
        SM90 backward takes). The op's layout is THD (``[B*T, H, *]``, a free view of our contiguous ``[B, T, H, *]``)
        with V-first states ``[N, H, V, K]``: the states are transposed here, inside autograd (one copy of
        ``N*H*K*V`` fp32 each way, 6.3 MB per sequence at H = 96, K = V = 128; none in when there is no initial state).

    Raises:
        ValueError: shapes; RuntimeError / ``cudnn.cudnnGraphNotSupportedError`` from cuDNN when no engine takes it.
    """
    op = _cudnn_kda_op()
    B, T, H, K, V, cu, S0, plan_name = _cudnn_kda_args(q, v, initial_state, cu_seqlens, plan_name)
    with cudnn_kda_pieces(pieces) as split:
        o, S, _ = op(
            q.reshape(B * T, H, K),
            k.reshape(B * T, H, K),
            v.reshape(B * T, H, V),
            g.reshape(B * T, H, K),
            beta.reshape(B * T, H),
            cu,
            K**-0.5,
            initial_state=S0,
            output_final_state=True,
            plan_name=plan_name,
        )
    kernel_choice.record("kda_pieces", split)
    return o.view(B, T, H, V), S.transpose(-1, -2).contiguous()


def kda_recurrence_cudnn_fused(
    q,
    k,
    v,
    f,
    beta_logits,
    A_log,
    dt_bias,
    lower_bound: float,
    initial_state=None,
    cu_seqlens=None,
    plan_name: str | None = "default",
    pieces: str | None = None,
):
    """Forward only: spec 2.2 steps 4-7 (q/k L2 norm, the lower-bound gate, the beta sigmoid, the recurrence) in one
    call of cuDNN Frontend's KDA op, which applies the three input maps to each staged tile inside its forward kernel
    (``use_qk_l2norm_in_kernel``, ``safe_gate`` with ``a_log`` / ``dt_bias`` / ``gate_lower_bound``,
    ``use_beta_sigmoid_in_kernel``; cuDNN FE 1.32 ``hopper/cuda_kernels/kda_fused_sm90.cu``). Same function as
    :func:`kda_recurrence_cudnn` on ``l2norm(q)``, ``l2norm(k)``, ``kda_gate(f, A_log, dt_bias, lower_bound)`` and
    ``sigmoid(beta_logits)``: the kernel computes ``x * rsqrt(sum(x^2) + 1e-6)`` in fp32 rounded to bf16 (as fla's
    ``l2norm``), ``lb * sigmoid(exp(A_log[h]) * (f + dt_bias))`` in fp32 with A_log capped at
    :data:`kimi.kda_gate.A_LOG_MAX` here (as :func:`kernels_torch.kda.kda_gate`), and ``sigmoid`` in fp32 (fast-math ``exp`` throughout).

    No autograd: the SM90 backward engine (``kda_hopper_cuda``) declines every one of these fusions, so this serves
    inference and prefill; training uses :func:`kda_recurrence_cudnn` with the maps computed outside.

    Args:
        q, k: ``[B, T, H, K]`` bf16, raw (the conv outputs, not normalised). v: ``[B, T, H, V]`` bf16.
        f: ``[B, T, H, K]`` raw gate input ``f_b(f_a(x))`` (bf16 or fp32; passed to the op as fp32, the dtype the kernel
            reads). beta_logits: ``[B, T, H]`` pre-sigmoid ``b_proj(x)`` (passed as fp32).
        A_log: ``[H]`` (canonical, sliced). dt_bias: ``[H*K]``. lower_bound: ``gate_lower_bound`` in [-5, 0).
        initial_state, cu_seqlens, plan_name, pieces: as :func:`kda_recurrence_cudnn`.

    Returns:
        ``o [B, T, H, V]`` bf16 and the final state ``[N, H, K, V]`` fp32 (K-first), as :func:`kda_recurrence_cudnn`.

    Raises:
        RuntimeError: gradients are needed (grad mode on and an input that requires grad).
        ValueError: shapes, or ``lower_bound`` outside [-5, 0); cuDNN's errors as :func:`kda_recurrence_cudnn`.
    """
    tensors = (q, k, v, f, beta_logits, A_log, dt_bias, initial_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            "kda_recurrence_cudnn_fused is forward only (the SM90 backward engine takes none of the in-kernel "
            "L2 norm / gate / beta sigmoid): run it under torch.no_grad(), or use kda_recurrence_cudnn"
        )
    if lower_bound is None or not -5.0 <= lower_bound < 0:
        raise ValueError(f"lower_bound: got {lower_bound}, expected a gate_lower_bound in [-5, 0) (the safe gate)")
    op = _cudnn_kda_op()
    B, T, H, K, V, cu, S0, plan_name = _cudnn_kda_args(q, v, initial_state, cu_seqlens, plan_name)
    if tuple(f.shape) != (B, T, H, K) or tuple(beta_logits.shape) != (B, T, H):
        raise ValueError(
            f"f, beta_logits: got shapes {tuple(f.shape)}, {tuple(beta_logits.shape)}, expected "
            f"[B, T, H, K]=[{B}, {T}, {H}, {K}] and [B, T, H]=[{B}, {T}, {H}]"
        )
    if tuple(A_log.shape) != (H,) or tuple(dt_bias.shape) != (H * K,):
        raise ValueError(
            f"A_log, dt_bias: got shapes {tuple(A_log.shape)}, {tuple(dt_bias.shape)}, expected [H]=[{H}], [H*K]=[{H * K}]"
        )
    with cudnn_kda_pieces(pieces) as split:
        o, S, _ = op(
            q.reshape(B * T, H, K),
            k.reshape(B * T, H, K),
            v.reshape(B * T, H, V),
            f.reshape(B * T, H, K).float(),  # no copy when f is fp32; else the cast the kernel would make anyway
            beta_logits.reshape(B * T, H).float(),
            cu,
            K**-0.5,
            initial_state=S0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            safe_gate=True,
            gate_lower_bound=float(lower_bound),
            a_log=A_log.float().clamp(max=A_LOG_MAX),  # the eager gate's cap (kda_gate)
            dt_bias=dt_bias.float().reshape(H, K),
            plan_name=plan_name,
        )
    kernel_choice.record("kda_pieces", split)
    return o.view(B, T, H, V), S.transpose(-1, -2).contiguous()


_FALLBACK_WARNED: set[str] = set()


def _warn_fallback(message: str) -> None:
    """One warning per distinct message: a kernel that declined and the one that runs instead."""
    if message not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add(message)
        import warnings

        warnings.warn(f"KDA: {message}", stacklevel=3)


def _short_conv_choice(layer: nn.Module, x: torch.Tensor, states, W: int) -> tuple[str, bool]:
    """``(kernel, forced)``: the kernel of the ``cudnn`` layer's q/k/v short convolutions, ``"cudnn"`` or ``"fla"``
    (``kernel_choice.resolve("short_conv", layer.short_conv_kernel)``), and whether the user forced it. ``auto``:
    ``kernel_choice.SHORT_CONV_AUTO`` where it can run (:func:`cudnn_short_conv_unavailable`; and no conv state that
    needs a gradient, which only fla's computes), else fla.

    Raises:
        ValueError: a value outside ``kernel_choice.CHOICES["short_conv"]``.
        RuntimeError: ``cudnn`` forced where it cannot run (the reason named).
    """
    choice = kernel_choice.resolve("short_conv", getattr(layer, "short_conv_kernel", None))
    if choice == "fla":
        return "fla", True
    why = cudnn_short_conv_unavailable(x, W)
    if why is None and torch.is_grad_enabled() and any(st is not None and st.requires_grad for st in states):
        why = "a conv state requires a gradient (only fla's causal_conv1d computes one)"
    if choice == "cudnn":
        if why is not None:
            raise RuntimeError(f"short_conv_kernel: got 'cudnn', but cuDNN's causal_conv1d cannot run here: {why}")
        return "cudnn", True
    return ("cudnn" if why is None and kernel_choice.SHORT_CONV_AUTO == "cudnn" else "fla"), False


def _kda_prep_choice(layer: nn.Module, x: torch.Tensor) -> str:
    """``"triton"``, ``"outside"`` or ``"in_kernel"``: where the cuDNN path computes the q/k L2 norm, the gate and the
    beta sigmoid (``kernel_choice.resolve("kda_prep", layer.kda_prep)``). ``auto``: ``outside`` (fla's functions;
    ours, ``triton``, measured no faster on the H200: kernel_choice's docstring).

    Raises:
        RuntimeError: ``in_kernel`` forced where gradients are needed (the SM90 backward takes none of the fusions);
            ``triton`` forced where it cannot run (the reason named).
    """
    prep = kernel_choice.resolve("kda_prep", getattr(layer, "kda_prep", None))
    if prep == "auto":  # in_kernel and triton measured no faster (kernel_choice's docstring); both are opt-in
        return "outside"
    if prep == "in_kernel":
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in layer.parameters())):
            raise RuntimeError(
                "kda_prep: got 'in_kernel', but gradients are needed and cuDNN's SM90 KDA backward takes none of the "
                "in-kernel L2 norm / gate / beta sigmoid; use 'triton', 'outside' or 'auto' for training (or run "
                "under torch.no_grad())"
            )
    elif prep == "triton":
        from kernels_torch.ops.kda_prep import triton_prep_unavailable

        why = triton_prep_unavailable(x) if x.is_cuda else f"x is on {x.device}"
        if why is not None:
            raise RuntimeError(f"kda_prep: got 'triton', but the Triton preparation cannot run here: {why}")
    return prep


def kda_layer_forward(layer: nn.Module, x: torch.Tensor, cu_seqlens, cache=None):
    """``KimiDeltaAttention.forward`` in chunk mode on GPU kernels (``backend='cudnn'``, GPU only); the layer calls
    it after :func:`require_cudnn_backend`.

    Same math and arguments as the eager layer (spec 2.2); the pieces:

    * short conv + SiLU, by :func:`_short_conv_choice` (``layer.short_conv_kernel``, ``$KIMI_SHORT_CONV_KERNEL``):
      ``fla`` (``fla.modules.causal_conv1d.causal_conv1d``, Triton) or ``cudnn`` (:func:`short_conv_cudnn`, cuDNN
      FE's ``causal_conv1d``; a decline at the call falls back to fla under ``auto`` with one warning, and raises when
      forced); both accumulate in fp32, output in x.dtype and reset at every ``cu_seqlens`` start; our weight
      ``[P, 1, W]`` is passed as ``[P, W]``. Recorded in ``kernel_choice.used()["short_conv"]``.
    * the recurrence, by ``kernel_choice.resolve("kda", layer.kda_kernel)``:

      - ``cudnn``: where the q/k L2 norm, the gate and the beta sigmoid run is ``kernel_choice.resolve("kda_prep",
        layer.kda_prep)`` (``$KIMI_KDA_PREP``): ``triton`` (:func:`kda_recurrence_cudnn` on the outputs of
        ``kernels_torch.ops.kda_prep``: ``l2norm_qk`` normalises q and k in one launch, ``kda_gate_lb`` computes the
        same gate, each with a one-launch backward; beta = sigmoid in fp32 in torch); ``outside``
        (:func:`kda_recurrence_cudnn`): q/k L2 norm with
        ``fla.modules.norm.l2norm`` (eps 1e-6, fp32 math, bf16 out), the gate in fp32 with
        ``fla.ops.kda.gate.fused_kda_gate`` (``lb * sigmoid(exp(A_log) * (f + dt_bias))``), beta = sigmoid in fp32,
        then the cuDNN op (the SM90 backward fuses none of these; they are computed outside, with their own backward
        kernels); ``in_kernel`` (:func:`kda_recurrence_cudnn_fused`, forward only): the op applies all three to its
        staged tiles, which saves the two L2-norm passes over q and k and the sigmoid kernels, yet measured slower
        on the H200 (3.52 against 3.13 ms at 8K tokens, 96 heads). ``auto``: ``outside`` (``triton`` measured no
        faster: 42.4 against 40.5 ms for the layer at 8K); a forced ``in_kernel``
        runs where no gradient is needed (grad mode off, or neither x nor a parameter requires grad) and raises
        otherwise. Recorded in ``kernel_choice.used()["kda_prep"]``. The SM90 forward's sequence split is
        ``kernel_choice.resolve("kda_pieces", layer.kda_pieces)`` (``$KIMI_KDA_PIECES``; auto: one piece per
        sequence, :func:`cudnn_kda_pieces`), recorded in ``kernel_choice.used()["kda_pieces"]``; a value outside the
        choices, or a forced ``one`` where cuDNN FE has no launcher function, raises (never taken for a decline).
      - ``fla``: ``fla.ops.kda.chunk_kda`` with ``use_qk_l2norm_in_kernel=True`` and ``use_gate_in_kernel=True`` (K3:
        ``safe_gate=True, lower_bound=lb``; Kimi-Linear: softplus), beta fp32.

      State ``[N, H, K, V]`` fp32 in both; ``auto`` falls back to fla (with one warning naming the reason) where cuDNN
      declines; a forced ``cudnn`` that cannot run raises.
    * output norm: ``fla.modules.norm.fused_norm_gate.rms_norm_gated`` with ``activation='sigmoid'``.
    * the six projections of x (q, k, v, f_a, b, g or g_a) run as one :func:`kernels_torch.ops.linears.
      shared_input_linears` node, whose backward sums x's gradients in the GEMMs (no elementwise adds); a
      projection that is not a plain ``nn.Linear`` (LoRA-wrapped by peft, or torchao's FP8 ``Float8Linear``, which
      the node's reading of ``.weight`` would bypass) makes them run one by one through their modules, as the eager
      layer.

    ``cu_seqlens`` (B == 1) may be int32 or int64 on any device. The kernel that ran is recorded in
    ``kernel_choice.used()["kda"]``.

    Args:
        layer: the ``kernels_torch.kda.KimiDeltaAttention`` (its config, weights and kernel attributes).
        x: ``[B, T, D]`` bf16 CUDA. cu_seqlens: ``[N+1]`` or None. cache: a ``KDACache`` (or any 4-tuple
            ``(conv_q, conv_k, conv_v, S)``; entries may be None) or None.

    Returns:
        ``(out [B, T, D] bf16, (conv_q, conv_k, conv_v, S))``: the new conv windows ``[N, P, W-1]`` bf16 and state
        ``[N, H, K, V]`` fp32, which the layer wraps in its ``KDACache``.

    Raises:
        ValueError: a cache entry of the wrong shape.
        RuntimeError: ``kda_kernel='cudnn'`` where the cuDNN op cannot run (with the reason); ``kda_prep='in_kernel'``
            where gradients are needed.
    """
    if torch.compiler.is_compiling():  # the kernels as kimi:: ops, the code between them traced (see below)
        return _kda_layer_forward_compiled(layer, x, cu_seqlens, cache)
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    c = layer.config
    B, T, _ = x.shape
    H, K = c.kda_num_heads, c.kda_head_dim
    P = H * K
    cu = cu_cpu = None
    if cu_seqlens is not None:
        cu_cpu = check_cu_seqlens(
            torch.as_tensor(cu_seqlens).cpu(), T, B
        )  # int64 on CPU: validated once, no sync later
        cu = cu_cpu.to(x.device)
    N = B if cu is None else cu.numel() - 1
    cq, ck, cv, S0 = (None,) * 4 if cache is None else cache
    W = layer.q_conv1d.weight.shape[-1]
    for name, st in (("conv_q", cq), ("conv_k", ck), ("conv_v", cv)):
        if st is not None and tuple(st.shape) != (N, P, W - 1):
            raise ValueError(f"cache.{name}: got shape {tuple(st.shape)}, expected [N, P, W-1]=[{N}, {P}, {W - 1}]")

    # the projections of x first (the GPU runs them while the host picks the kernels below): q, k, v, f_a, b and the
    # output gate's first, in one autograd node whose backward sums x's gradients inside the GEMMs
    # (kernels_torch.ops.linears); LoRA-wrapped and FP8 projections run their own forwards
    x_projs = [layer.q_proj, layer.k_proj, layer.v_proj, layer.f_a_proj, layer.b_proj]
    x_projs.append(layer.g_proj if c.use_full_rank_gate else layer.g_a_proj)
    if any(type(p) is not nn.Linear for p in x_projs):  # LoRA (peft) or FP8 (torchao's Float8Linear): own forwards
        xq, xk, xv, xf, b_logits, xg = (linear(x, p) for p in x_projs)
    else:
        xq, xk, xv, xf, b_logits, xg = shared_input_linears(x, [p.weight for p in x_projs])

    choice = kernel_choice.resolve("kda", layer.kda_kernel)
    why = cudnn_kda_unavailable(x, K, K, c.gate_lower_bound) if choice != "fla" else None
    if choice == "cudnn" and why is not None:
        raise RuntimeError(f"kda_kernel: got 'cudnn', but the cuDNN KDA op cannot run here: {why}")

    conv_kernel, conv_forced = _short_conv_choice(layer, x, (cq, ck, cv), W)

    def conv(xp: torch.Tensor, conv1d: nn.Module, state):  # -> y [B, T, P], new state [N, P, W-1]
        nonlocal conv_kernel
        if conv_kernel == "cudnn":
            try:
                out = short_conv_cudnn(xp, conv1d.weight, cu, state)
                kernel_choice.record("short_conv", "cudnn")
                return out
            except (NotImplementedError, ImportError) as e:  # cuDNN's route declined (or a part of it is missing)
                if conv_forced:
                    raise RuntimeError(
                        f"short_conv_kernel: got 'cudnn', but cuDNN's causal_conv1d declined: {e}"
                    ) from e
                _warn_fallback(f"the cuDNN short conv declined ({type(e).__name__}: {e}); running fla's causal_conv1d")
                conv_kernel = "fla"
        kernel_choice.record("short_conv", "fla")
        y, final = causal_conv1d(
            x=xp,
            weight=depthwise_conv_weight(conv1d.weight, P),
            initial_state=_fla_conv_state(state),
            output_final_state=True,
            activation="silu",
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )
        return y, final[..., 1:]

    q, cq = conv(xq, layer.q_conv1d, cq)
    k, ck = conv(xk, layer.k_conv1d, ck)
    v, cv = conv(xv, layer.v_conv1d, cv)
    q, k, v = (t.reshape(B, T, H, K) for t in (q, k, v))  # v: [B,T,H,V], V = K
    f = linear(xf, layer.f_b_proj).reshape(B, T, H, K)  # raw gate input; gated in fp32; b_logits [B,T,H]
    lb = c.gate_lower_bound
    S0f = None if S0 is None else S0.float()
    o = S = None
    if choice != "fla" and why is None:
        prep = _kda_prep_choice(layer, x)  # outside the try: a forced in_kernel under autograd raises, never falls back
        pieces = _kda_pieces_choice(getattr(layer, "kda_pieces", None))  # outside too: a bad or impossible value raises
        try:
            if prep == "in_kernel":
                o, S = kda_recurrence_cudnn_fused(
                    q, k, v, f, b_logits, layer.A_log, layer.dt_bias, lb, S0f, cu, pieces=pieces
                )
            elif prep == "triton":
                from kernels_torch.ops.kda_prep import kda_gate_lb, l2norm_qk

                g = kda_gate_lb(f, layer.A_log, layer.dt_bias, lb)  # fp32; A_log capped inside, as kda_gate
                beta = torch.sigmoid(b_logits.float())  # [B,T,H] fp32: the one sigmoid on beta, as the eager path
                qn, kn = l2norm_qk(q, k)  # one launch for both, bf16 out
                o, S = kda_recurrence_cudnn(qn, kn, v, g, beta, S0f, cu, pieces=pieces)
            else:
                from fla.modules.norm.l2norm import l2norm as fla_l2norm
                from fla.ops.kda.gate import fused_kda_gate

                A_log = layer.A_log.float().clamp(max=A_LOG_MAX)  # the eager gate's cap: finite rate, finite gradients
                g = fused_kda_gate(f, A_log, layer.dt_bias.float(), lower_bound=lb, output_dtype=torch.float32)
                beta = torch.sigmoid(b_logits.float())  # [B,T,H] fp32: the one sigmoid on beta, as the eager path
                o, S = kda_recurrence_cudnn(fla_l2norm(q), fla_l2norm(k), v, g, beta, S0f, cu, pieces=pieces)
            kernel_choice.record("kda", "cudnn")
            kernel_choice.record("kda_prep", prep)
        except Exception as e:  # a cuDNN decline (no engine / plan for this graph)
            if choice == "cudnn":
                raise
            _warn_fallback(f"the cuDNN op declined ({type(e).__name__}: {e}); running fla's chunk_kda")
    if o is None:
        from fla.ops.kda import chunk_kda

        o, S = chunk_kda(
            q,
            k,
            v,
            f,
            torch.sigmoid(b_logits.float()),  # [B,T,H] fp32: the one sigmoid on beta, as the eager path
            scale=K**-0.5,
            initial_state=S0f,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            A_log=layer.A_log.float().clamp(max=A_LOG_MAX),  # the eager gate's cap: finite rate, finite gradients
            dt_bias=layer.dt_bias.float(),
            safe_gate=lb is not None,
            lower_bound=lb,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )  # o [B,T,H,V] bf16, S [N,H,K,V] fp32
        kernel_choice.record("kda", "fla")
    gate = xg if c.use_full_rank_gate else linear(xg, layer.g_b_proj)
    y = rms_norm_gated(
        o, gate.reshape(B, T, H, K), layer.o_norm.weight, None, activation="sigmoid", eps=layer.o_norm.eps
    )
    return linear(y.reshape(B, T, P), layer.o_proj), (cq, ck, cv, S)


# ------------------------------------------------------------------------------------------------------------------
# under torch.compile: the kernels as kimi:: custom ops (kernels_torch.ops.custom)
# ------------------------------------------------------------------------------------------------------------------
# Each op runs the GPU kernel on CUDA tensors and its torch twin (kernels_torch.kda_functional) on CPU tensors, the
# twin the CPU tests check the op's registration and gradients with.


def _short_conv_gpu(x, weight, cu_seqlens, conv_state, kernel: str, forced: bool):
    """The ``cudnn`` layer's short conv + SiLU on one kernel: ``"cudnn"`` (:func:`short_conv_cudnn`; a decline at the
    call falls back to fla with one warning unless ``forced``) or ``"fla"`` (fla-core's ``causal_conv1d``); on CPU
    tensors the twin ``kernels_torch.kda.short_conv``. ``x [B, T, C]``, ``weight [C, 1, W]``, ``cu_seqlens [N+1]``
    or None, ``conv_state [N, C, W-1]`` or None -> ``(y [B, T, C], new state [N, C, W-1])`` in x's dtype. Records
    the kernel that ran (``kernel_choice.used()["short_conv"]``)."""
    if not x.is_cuda:
        return kda_functional.short_conv(x, weight, cu_seqlens, conv_state)
    if kernel == "cudnn":
        try:
            out = short_conv_cudnn(x, weight, cu_seqlens, conv_state)
            kernel_choice.record("short_conv", "cudnn")
            return out
        except (NotImplementedError, ImportError) as e:
            if forced:
                raise RuntimeError(f"short_conv_kernel: got 'cudnn', but cuDNN's causal_conv1d declined: {e}") from e
            _warn_fallback(f"the cuDNN short conv declined ({type(e).__name__}: {e}); running fla's causal_conv1d")
    from fla.modules.causal_conv1d import causal_conv1d

    C = x.shape[-1]
    cu = None if cu_seqlens is None else cu_seqlens.to(device=x.device, dtype=torch.int32)
    y, final = causal_conv1d(
        x=x,
        weight=depthwise_conv_weight(weight, C),
        initial_state=_fla_conv_state(conv_state),
        output_final_state=True,
        activation="silu",
        cu_seqlens=cu,
        cu_seqlens_cpu=None if cu is None else cu.cpu(),
    )
    kernel_choice.record("short_conv", "fla")
    return y, final[..., 1:]


def _short_conv_gpu_fake(x, weight, cu_seqlens, conv_state, kernel, forced):
    B, T, C = x.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return x.new_empty(B, T, C), x.new_empty(N, C, weight.shape[-1] - 1)


# the GPU short convolutions (cuDNN's, fla's) keep their backward inside their own autograd Functions, with no entry
# point of their own: the op's backward recomputes the forward under autograd (one more forward of the conv, the
# cheapest kernel of the layer: 0.3 of 41 ms at 8K tokens on the H200)
_short_conv_gpu_op = recompute_op(
    "kimi::kda_short_conv",
    _short_conv_gpu,
    "(Tensor x, Tensor weight, Tensor? cu_seqlens, Tensor? conv_state, str kernel, bool forced) -> (Tensor, Tensor)",
    _short_conv_gpu_fake,
)


def _kda_fla(q, k, v, g, beta, initial_state, cu_seqlens):
    """The recurrence (spec 2.2 step 7) on fla-core's ``chunk_kda`` with the inputs already prepared (q, k
    L2-normalised, g the fp32 log-decay, beta post-sigmoid fp32; scale ``K^-1/2``); on CPU tensors the twin
    ``kernels_torch.kda.kda_chunk``. Shapes as :func:`kda_recurrence_cudnn`: ``(o [B, T, H, V]`` in v's dtype,
    ``S [N, H, K, V]`` fp32)."""
    K = q.shape[-1]
    if not q.is_cuda:
        return kda_functional.kda_chunk(q, k, v, g, beta, K**-0.5, initial_state, cu_seqlens)
    from fla.ops.kda import chunk_kda

    cu = None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.int32)
    o, S = chunk_kda(
        q, k, v, g, beta, scale=K**-0.5, initial_state=initial_state, output_final_state=True, cu_seqlens=cu
    )
    kernel_choice.record("kda", "fla")
    return o, S


def _kda_recurrence_fake(q, k, v, g, beta, initial_state, cu_seqlens, *rest):
    """``(o [B, T, H, V]`` in v's dtype, ``S [N, H, K, V]`` fp32, fp64 for fp64 inputs), as the kernels and twins."""
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    S = q.new_empty(N, H, K, v.shape[-1], dtype=compute_dtype(q, k, v, g, beta))
    return torch.empty(v.shape, dtype=v.dtype, device=v.device), S


# fla's chunk_kda keeps its backward inside its autograd Function: the op's backward recomputes the forward under
# autograd (the fallback kernel: cuDNN's, below, has a backward op of its own)
_kda_fla_op = recompute_op(
    "kimi::kda_fla",
    _kda_fla,
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state, Tensor? cu_seqlens) "
    "-> (Tensor, Tensor)",
    _kda_recurrence_fake,
)


@torch.library.custom_op("kimi::kda_cudnn", mutates_args=())
def _kda_cudnn_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    pieces: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kda_recurrence_cudnn` (cuDNN FE's KDA forward, the SM90 split ``pieces``) as one op: q, k ``[B, T, H,
    K]`` bf16 L2-normalised, v ``[B, T, H, V]`` bf16, g ``[B, T, H, K]`` fp32, beta ``[B, T, H]`` fp32 post-sigmoid,
    initial_state ``[N, H, K, V]`` fp32 or None, cu_seqlens ``[N+1]`` or None -> ``(o [B, T, H, V]`` bf16,
    ``S [N, H, K, V]`` fp32). On CPU tensors the twin ``kernels_torch.kda.kda_chunk`` (o in v's dtype, S in the
    compute dtype)."""
    if not q.is_cuda:
        o, S = kda_functional.kda_chunk(q, k, v, g, beta, q.shape[-1] ** -0.5, initial_state, cu_seqlens)
    else:
        o, S = kda_recurrence_cudnn(q, k, v, g, beta, initial_state, cu_seqlens, pieces=pieces)
        kernel_choice.record("kda", "cudnn")
    inputs = (q, k, v, g, beta, initial_state)
    return own(o, inputs), own(S, inputs)


_kda_cudnn_op.register_fake(_kda_recurrence_fake)


def _kda_cudnn_backward_cuda(do, dS, q, k, v, g, beta, initial_state, cu_seqlens):
    """cuDNN FE's KDA backward (``torch.ops.cudnn.kimi_delta_attention_bwd``, the op its forward's autograd calls) on
    the forward's inputs, in the op's THD layout with V-first states; gradients back in ours."""
    bwd = (_cudnn_kda_op(), torch.ops.cudnn.kimi_delta_attention_bwd)[1]  # importing the module registers both
    B, T, H, K, V, cu, S0, plan_name = _cudnn_kda_args(q, v, initial_state, cu_seqlens, "default")
    dfs = None if dS is None else dS.float().transpose(-1, -2).contiguous()  # K-first -> the op's V-first
    dq, dk, dv, dg, dbeta, dS0, *_ = bwd(
        do.to(q.dtype).reshape(B * T, H, V).contiguous(),
        q.reshape(B * T, H, K),
        k.reshape(B * T, H, K),
        v.reshape(B * T, H, V),
        g.reshape(B * T, H, K),
        beta.reshape(B * T, H),
        cu,
        K**-0.5,
        initial_state=S0,
        d_final_state=dfs,
        plan_name=plan_name,
    )
    dS0 = dS0.transpose(-1, -2) if initial_state is not None else dS0
    return (
        dq.view(B, T, H, K),
        dk.view(B, T, H, K),
        dv.view(B, T, H, V),
        dg.view(B, T, H, K),
        dbeta.view(B, T, H),
        dS0,
    )


def _kda_cudnn_backward_twin(do, dS, q, k, v, g, beta, initial_state, cu_seqlens):
    """The CPU twin's gradients: autograd over ``kernels_torch.kda.kda_chunk``."""
    with autograd_inside_op():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
        s0 = None if initial_state is None else initial_state.detach().requires_grad_(True)
        o, S = kda_functional.kda_chunk(*leaves, q.shape[-1] ** -0.5, s0, cu_seqlens)
        wrt = leaves + ([s0] if s0 is not None else [])
        outs, grads = [o], [do]
        if dS is not None:
            outs.append(S)
            grads.append(dS)
        got = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    got = [torch.zeros_like(t) if d is None else d for t, d in zip(wrt, got)]
    if s0 is None:
        got.append(q.new_empty(0, dtype=torch.float32))
    return tuple(got)


@torch.library.custom_op("kimi::kda_cudnn_backward", mutates_args=())
def _kda_cudnn_backward_op(
    do: torch.Tensor,
    dS: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of ``kimi::kda_cudnn``: ``(dq, dk, dv, dg, dbeta, d_initial_state)`` shaped and typed as the
    inputs (``d_initial_state`` empty ``[0]`` fp32 without an initial state), from the output gradient ``do`` and
    the final state's ``dS`` (None: no gradient reaches the state). cuDNN's backward on CUDA (no recomputation), the
    twin's autograd on the CPU."""
    run = _kda_cudnn_backward_cuda if q.is_cuda else _kda_cudnn_backward_twin
    grads = run(do, dS, q, k, v, g, beta, initial_state, cu_seqlens)
    inputs = (do, dS, q, k, v, g, beta, initial_state)
    return tuple(own(t, inputs) for t in grads)


@_kda_cudnn_backward_op.register_fake
def _(do, dS, q, k, v, g, beta, initial_state, cu_seqlens):
    dS0 = q.new_empty(0, dtype=torch.float32) if initial_state is None else torch.empty_like(initial_state)
    like = lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device)  # noqa: E731  (contiguous)
    return like(q), like(k), like(v), like(g), like(beta), like(dS0)


def _kda_cudnn_setup(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, pieces = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)  # what cuDNN's own autograd saves


def _kda_cudnn_backward(ctx, do, dS):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dg, dbeta, dS0 = _kda_cudnn_backward_op(do, dS, q, k, v, g, beta, initial_state, cu_seqlens)
    return dq, dk, dv, dg, dbeta, (dS0 if initial_state is not None else None), None, None


_kda_cudnn_op.register_autograd(_kda_cudnn_backward, setup_context=_kda_cudnn_setup)

CUSTOM_OPS = (_short_conv_gpu_op, _kda_fla_op, _kda_cudnn_op, _kda_cudnn_backward_op)  # opcheck'd in tests


def _kda_layer_forward_compiled(layer: nn.Module, x: torch.Tensor, cu_seqlens, cache=None):
    """:func:`kda_layer_forward` under ``torch.compile``: the same function, with every kernel an op and the
    elementwise work between them left to the compiler.

    * the short convolutions: ``kimi::kda_short_conv`` (cuDNN's or fla's, chosen as in eager mode while tracing);
    * the q/k L2 norm, the gate and beta's sigmoid: the torch twins ``kernels_torch.kda.l2norm`` / ``kda_gate``
      (fp32, eps 1e-6, A_log capped: fla's functions compute the same), q and k rounded to bf16 as fla's ``l2norm``
      returns them; the compiler fuses them;
    * the recurrence: ``kimi::kda_cudnn`` (cuDNN's forward and backward ops) or ``kimi::kda_fla`` (fla's
      ``chunk_kda`` on the prepared inputs), by ``kernel_choice.resolve("kda", layer.kda_kernel)``; a cuDNN decline
      at the call raises here (no fallback inside a compiled graph);
    * the output norm: ``kernels_torch.kda.gated_rms_norm`` (fp32, sigmoid gate, as fla's ``rms_norm_gated``);
    * the projections: plain ``F.linear`` (the compiler schedules the gradient sums the eager path's
      ``shared_input_linears`` fuses into its GEMMs).

    Raises:
        ValueError: a cache entry of the wrong shape; ``kda_prep`` forced to ``triton`` or ``in_kernel`` (eager-only
            kernels).
        RuntimeError: ``kda_kernel='cudnn'`` where the cuDNN op cannot run (with the reason).
    """
    kda = kda_functional
    c = layer.config
    B, T, _ = x.shape
    H, K = c.kda_num_heads, c.kda_head_dim
    P = H * K
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, T, B).to(x.device)  # values: checked by the op
    N = B if cu is None else cu.shape[0] - 1
    cq, ck, cv, S0 = (None,) * 4 if cache is None else cache
    W = layer.q_conv1d.weight.shape[-1]
    for name, st in (("conv_q", cq), ("conv_k", ck), ("conv_v", cv)):
        if st is not None and tuple(st.shape) != (N, P, W - 1):
            raise ValueError(f"cache.{name}: got shape {tuple(st.shape)}, expected [N, P, W-1]=[{N}, {P}, {W - 1}]")
    prep = kernel_choice.resolve("kda_prep", getattr(layer, "kda_prep", None))
    if prep in ("triton", "in_kernel"):
        raise ValueError(
            f"kda_prep: got {prep!r} under torch.compile, whose blocks compute the q/k L2 norm, the gate and beta's "
            "sigmoid with torch ops that the compiler fuses; expected 'auto' or 'outside' (or run the layer eagerly)"
        )
    choice = kernel_choice.resolve("kda", layer.kda_kernel)
    why = _cudnn_kda_unavailable_on(x.device, K, K, c.gate_lower_bound) if choice != "fla" else None
    if choice == "cudnn" and why is not None:
        raise RuntimeError(f"kda_kernel: got 'cudnn', but the cuDNN KDA op cannot run here: {why}")
    pieces = kernel_choice.resolve("kda_pieces", getattr(layer, "kda_pieces", None))
    conv_choice = kernel_choice.resolve("short_conv", getattr(layer, "short_conv_kernel", None))
    conv_why = _short_conv_unavailable_on(x.device, x.dtype, W) if conv_choice != "fla" else None
    if conv_why is None and torch.is_grad_enabled() and any(st is not None and st.requires_grad for st in (cq, ck, cv)):
        conv_why = "a conv state requires a gradient (only fla's causal_conv1d computes one)"
    if conv_choice == "cudnn" and conv_why is not None:
        raise RuntimeError(f"short_conv_kernel: got 'cudnn', but cuDNN's causal_conv1d cannot run here: {conv_why}")
    auto_cudnn = conv_choice == "auto" and kernel_choice.SHORT_CONV_AUTO == "cudnn"
    conv_kernel = "cudnn" if conv_why is None and (conv_choice == "cudnn" or auto_cudnn) else "fla"

    x_projs = [layer.q_proj, layer.k_proj, layer.v_proj, layer.f_a_proj, layer.b_proj]
    x_projs.append(layer.g_proj if c.use_full_rank_gate else layer.g_a_proj)
    xq, xk, xv, xf, b_logits, xg = (linear(x, p) for p in x_projs)
    forced = conv_choice == "cudnn"
    q, cq = _short_conv_gpu_op(xq, layer.q_conv1d.weight, cu, cq, conv_kernel, forced)
    k, ck = _short_conv_gpu_op(xk, layer.k_conv1d.weight, cu, ck, conv_kernel, forced)
    v, cv = _short_conv_gpu_op(xv, layer.v_conv1d.weight, cu, cv, conv_kernel, forced)
    q, k, v = (t.reshape(B, T, H, K) for t in (q, k, v))
    f = linear(xf, layer.f_b_proj).reshape(B, T, H, K)
    g = kda.kda_gate(f, layer.A_log, layer.dt_bias, c.gate_lower_bound)  # fp32 (fp64 for fp64 x)
    beta = torch.sigmoid(b_logits.to(g.dtype))  # [B, T, H]: the one sigmoid on beta
    qn, kn = kda.l2norm(q).to(q.dtype), kda.l2norm(k).to(k.dtype)
    S0f = None if S0 is None else S0.to(g.dtype)
    if choice != "fla" and why is None:
        o, S = _kda_cudnn_op(qn, kn, v, g, beta, S0f, cu, pieces)
    else:
        o, S = _kda_fla_op(qn, kn, v, g, beta, S0f, cu)
    gate = xg if c.use_full_rank_gate else linear(xg, layer.g_b_proj)
    y = kda.gated_rms_norm(o, gate.reshape(B, T, H, K), layer.o_norm.weight, layer.o_norm.eps).to(x.dtype)
    return linear(y.reshape(B, T, P), layer.o_proj), (cq, ck, cv, S)
