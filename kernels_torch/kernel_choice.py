"""Which GPU kernel runs the two hot ops of the ``cudnn`` backend, how a user picks it, and a record of what ran.

Ops and their kernels (``docs/kernels.md``, "Measured 2026-11-30"; later H200 runs: ``benchmarks/README.md``):

* ``sparse_mla_fwd`` (DSA sparse MLA forward): ``flash_mla`` (FlashMLA's ``flash_mla_sparse_fwd``; SM90 legacy
  kernels, SM100 current ones; 96 heads padded to 128) or ``triton`` (ours, ``kernels_torch.ops.sparse_mla``).
* ``kda`` (the KDA recurrence in chunk mode): ``cudnn`` (cuDNN Frontend's ``torch.ops.cudnn.kimi_delta_attention_fwd``,
  engine ``kda_hopper_cuda`` on SM90) or ``fla`` (fla-core's ``chunk_kda``).
* ``kda_prep`` (where the cuDNN KDA path computes the q/k L2 norm, the lower-bound gate and the beta sigmoid):
  ``in_kernel`` (the op's own fusions; forward only, since the SM90 backward engine takes none of them),
  ``outside`` (fla's ``l2norm`` and ``fused_kda_gate``, torch's sigmoid, each with its backward) or ``triton``
  (ours, ``kernels_torch.ops.kda_prep``: q and k normalised in one launch, the gate in one, each with a one-launch
  backward; torch's sigmoid). ``auto`` takes ``outside``. Measured on the H200 (2026-12-01,
  ``benchmarks/results/kda_layer_pass8.json``; ``benchmarks/kda_layer.py`` times both side by side, fed fixed output
  gradients): fla's functions already run near the memory bandwidth (8K tokens, 96 heads: norms 0.77 ms, gate 0.73 ms
  fwd+bwd; ours 0.57 and 0.74), and the layer fwd+bwd with ours was no faster (42.4 against 40.5 ms at 8K, 166.9 against
  163.4 at 32K; recurrence 7.22 against 7.30 and 26.0 against 25.7), so the library's path stays the default and
  ``triton`` is opt-in. (An earlier run's 1.77 and 1.10 ms for fla's norms and gate had timed a ``.float().sum()``
  backward, not the functions.) The in-kernel fusions made the op's forward slower (3.52 ms against 3.13 ms for the
  prepared inputs; 32K: 12.1 against 9.0; benchmarks/results/kda_layer_pass7.json), so ``in_kernel`` is opt-in, for
  inference only.
* ``kda_pieces`` (how cuDNN's SM90 KDA forward, ``kda_hopper_cuda``, splits one sequence over CTAs): ``one`` (one
  piece per (sequence, head): each CTA walks its whole sequence) or ``cudnn`` (cuDNN's launcher heuristic, ``P = 264 //
  (N * H)`` pieces capped by the 16-token chunks, so 2 for one sequence of 96 heads). A piece after the first starts
  by walking back over the earlier tokens until the decay bound proves the carried state negligible; a channel that
  hardly decays stalls that bound, and then the piece redoes its predecessors' work. ``auto`` takes ``one``: on the
  random-init K3 layer's gate 95% of (16-token chunk, head) pairs stall, and the forward took 1.44 against 2.02 ms at
  8K tokens and 4.85 against 7.22 ms at 32K (H200, 2026-12-01, ``benchmarks/results/kda_layer_pass8.json``); on a gate
  uniform in (-5, 0) cuDNN's split was faster (1.23 against 1.46 ms). The backward engine has no pieces.
* ``short_conv`` (the ``cudnn`` KDA layer's q/k/v depthwise causal conv1d + SiLU, width 4): ``fla`` (fla-core's
  ``causal_conv1d``, Triton) or ``cudnn`` (cuDNN Frontend's ``cudnn.ops.causal_conv1d``, CuTe DSL: bf16 activations,
  fp32 or bf16 filter, width 4, dense or ``cu_seqlens``-packed, its own backward); ``$KIMI_SHORT_CONV_KERNEL``. ``auto``
  takes :data:`SHORT_CONV_AUTO` (``cudnn``) where that kernel can run, else fla. The layer profile at 8K tokens (H200,
  2026-12-01, ``benchmarks/results/kda_layer_pass10b.log``) gave fla's three convolutions 3.2 ms of 37.4, 2.4 ms of it
  one backward kernel at about 1 TB/s. Measured on the H200 (2026-12-01, ``benchmarks/results/short_conv_pass10b.json``,
  one ``[1, T, 12288]`` bf16 call, fp32 filter): fwd+bwd 0.84 against 1.97 ms at 8K, 2.38 against 4.63 ms at 32K packed;
  dw 1.4e-6 against 5.5e-4 of fp64. In the layer (``kda_layer_pass10b.json``) 159.3 against 165.8 ms at 32K, and no
  difference at 8K (41.2 / 40.9). cuDNN's filter gradient accumulates with atomics (bitwise reproducible only under
  ``torch.use_deterministic_algorithms``); its forward is bitwise reproducible.
* ``glu`` (the ``cudnn`` backend's fused SiTU/SiLU-GLU, ``kernels_torch.ops.situ``): ``triton`` (CUDA) or ``torch``
  (the recompute-in-backward twin; CPU, fp64); ``$KIMI_GLU_KERNEL``. The eager and sdpa backends run the plain ops
  of ``kernels_torch.moe`` and record nothing.
* ``moe`` (the routed experts of every MoE layer, ``kernels_torch.moe.GroupedExperts``): ``grouped_mm`` (the pairs
  sorted by expert on the device, ``torch._grouped_mm`` per projection, the Triton gather-sums of
  ``kernels_torch.ops.moe_grouped``; no host sync) or ``loop`` (one Python iteration per expert over its tokens: the
  readable twin of the reference, with a host sync per expert); ``$KIMI_MOE_KERNEL``. ``auto`` takes ``grouped_mm``
  on the ``cudnn`` backend where ``torch._grouped_mm`` takes the dtype and shapes, else ``loop``; the ``eager`` and
  ``sdpa`` backends run ``loop`` unless asked.

Choice, strongest first: an explicit argument (``sparse_mla_fwd(backend=...)``, a layer's ``sparse_kernel`` /
``kda_kernel`` / ``kda_prep`` / ``kda_pieces`` / ``short_conv_kernel`` attribute, which ``kernels_torch.model.load_model`` and
:func:`set_model_kernels` set from their arguments of the same names), then the environment variables
``KIMI_SPARSE_KERNEL`` / ``KIMI_KDA_KERNEL`` / ``KIMI_KDA_PREP`` / ``KIMI_KDA_PIECES`` / ``KIMI_SHORT_CONV_KERNEL``, then ``auto`` (the fast kernel
where it is importable and takes the shape, else the other one). A forced kernel that cannot run raises; ``auto``
falls back.

Every call records the kernel that actually ran (:func:`record`); :func:`used` returns the counts since the last
:func:`reset_used`, which ``kimi compare --json`` and the benchmarks write beside their numbers.
"""

from __future__ import annotations

import os
from collections import Counter

import torch

__all__ = [
    "CHOICES",
    "ENV_VARS",
    "SHORT_CONV_AUTO",
    "resolve",
    "check_environment",
    "record",
    "used",
    "reset_used",
    "set_model_kernels",
]

CHOICES = {
    "sparse_mla_fwd": ("auto", "flash_mla", "triton"),
    "kda": ("auto", "cudnn", "fla"),
    "kda_prep": ("auto", "in_kernel", "outside", "triton"),
    "kda_pieces": ("auto", "one", "cudnn"),
    "short_conv": ("auto", "fla", "cudnn"),
    "glu": ("auto", "triton", "torch"),
    "moe": ("auto", "grouped_mm", "loop"),
}
ENV_VARS = {
    "sparse_mla_fwd": "KIMI_SPARSE_KERNEL",
    "kda": "KIMI_KDA_KERNEL",
    "kda_prep": "KIMI_KDA_PREP",
    "kda_pieces": "KIMI_KDA_PIECES",
    "short_conv": "KIMI_SHORT_CONV_KERNEL",
    "glu": "KIMI_GLU_KERNEL",
    "moe": "KIMI_MOE_KERNEL",
}
SHORT_CONV_AUTO = "cudnn"  # what ``auto`` takes for ``short_conv`` where it can run (the measured faster one)
_USED: dict[str, Counter] = {}


def resolve(op: str, explicit: str | None = None) -> str:
    """The requested kernel of ``op``: ``explicit`` if given (not None), else ``$KIMI_..._KERNEL``, else ``"auto"``.

    Raises:
        ValueError: an unknown ``op``, or a value outside :data:`CHOICES` (naming where it came from).
    """
    if op not in CHOICES:
        raise ValueError(f"op: got {op!r}, expected one of {list(CHOICES)}")
    if explicit is not None:
        value, where = explicit, "kernel argument"
    else:
        value, where = os.environ.get(ENV_VARS[op], "auto") or "auto", f"${ENV_VARS[op]}"
    if value not in CHOICES[op]:
        raise ValueError(f"{where}: got {value!r} for {op}, expected one of {list(CHOICES[op])}")
    return value


def check_environment() -> None:
    """Resolve every op's environment variable now, so that a bad value fails where a ``cudnn`` model is built rather
    than at the first call of the kernel it names (which may be minutes later, or never on a CPU).

    Raises:
        ValueError: an environment variable of :data:`ENV_VARS` outside its :data:`CHOICES` (named, with the value).
    """
    for op in CHOICES:
        resolve(op)


def record(op: str, kernel: str) -> None:
    """Count one call of ``op`` that ran on ``kernel``.

    Under ``torch.compile`` it counts nothing (``kernels_torch.compile``): tracing its ``+= 1`` would guard on the
    count and recompile the block at every call."""
    if torch.compiler.is_compiling():
        return
    _USED.setdefault(op, Counter())[kernel] += 1


def used() -> dict[str, dict[str, int]]:
    """``{op: {kernel: calls}}`` since the last :func:`reset_used` (a copy)."""
    return {op: dict(c) for op, c in _USED.items()}


def reset_used() -> None:
    """Forget the recorded calls."""
    _USED.clear()


def set_model_kernels(
    model,
    sparse_kernel: str | None = None,
    kda_kernel: str | None = None,
    kda_prep: str | None = None,
    kda_pieces: str | None = None,
    short_conv_kernel: str | None = None,
    moe_kernel: str | None = None,
):
    """Set the kernel choice on every layer of ``model`` (a ``torch.nn.Module``) that has one: the DSA layers'
    ``sparse_kernel``, the KDA layers' ``kda_kernel``, ``kda_prep``, ``kda_pieces`` and ``short_conv_kernel``, and the
    MoE layers' routed experts' ``moe_kernel``. None leaves a choice as it is (the default: environment, then auto).
    Returns ``model``.

    Raises:
        ValueError: a value outside :data:`CHOICES`.
    """
    chosen = {
        "sparse_kernel": sparse_kernel,
        "kda_kernel": kda_kernel,
        "kda_prep": kda_prep,
        "kda_pieces": kda_pieces,
        "short_conv_kernel": short_conv_kernel,
        "moe_kernel": moe_kernel,
    }
    ops = {
        "sparse_kernel": "sparse_mla_fwd",
        "kda_kernel": "kda",
        "kda_prep": "kda_prep",
        "kda_pieces": "kda_pieces",
        "short_conv_kernel": "short_conv",
        "moe_kernel": "moe",
    }
    for attr, op in ops.items():
        if chosen[attr] is not None:
            resolve(op, chosen[attr])
    for m in model.modules():
        for attr, value in chosen.items():
            if value is not None and hasattr(m, attr):
                setattr(m, attr, value)
    return model
