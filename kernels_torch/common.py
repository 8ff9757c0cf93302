"""Small helpers shared by the torch modules: twins of ``reference_jax.common`` (same names and semantics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "compute_dtype",
    "rms_norm",
    "check_cu_seqlens",
    "segment_ids",
    "causal_document_mask",
    "RMSNorm",
    "ACTIVATION_DTYPES",
    "TOKEN_ID_DTYPES",
    "check_activation_dtype",
    "check_token_ids",
    "check_range_async",
    "effective_weight",
    "linear",
    "depthwise_conv_weight",
]


def compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """The dtype the math of a group of inputs runs in: fp64 if any input is fp64, else fp32 (bf16/fp16 upcast).

    The one dtype-promotion rule of the torch path (the twin of ``reference_jax.common.compute_dtype``).
    """
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Kimi/DeepSeek RMSNorm: normalise in fp32, cast back to ``x.dtype``, then scale by ``weight`` (spec 3.4)."""
    xf = x.to(compute_dtype(x))
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight.to(x.dtype)


class RMSNorm(torch.nn.Module):
    """RMSNorm with a ``weight`` parameter (checkpoint name), see :func:`rms_norm`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def check_cu_seqlens(cu_seqlens: torch.Tensor, T: int, B: int = 1) -> torch.Tensor:
    """Validate packed-document boundaries ([N+1] ints, 0 .. T, strictly increasing, batch 1); return int64.

    Under ``torch.compile`` only the shape, dtype and batch are checked: the value checks read the tensor on the
    host (a graph break). The compiled decoder layers (``kernels_torch.compile``) run inside ``KimiK3Model.forward``
    / ``loss``, which check the values in full before the first layer, and the ``kimi::`` ops that loop over the
    documents (``kernels_torch.ops.custom``) check them again when they run.

    Raises:
        ValueError: naming ``cu_seqlens``, the value and the expectation.
    """
    cu = torch.as_tensor(cu_seqlens)
    if cu.ndim != 1 or cu.numel() < 2 or cu.is_floating_point() or cu.dtype == torch.bool:
        raise ValueError(
            f"cu_seqlens: got {cu.tolist()!r} ({cu.dtype}), expected a 1-D integer tensor [0, ..., T] of length >= 2"
        )
    if B != 1:
        raise ValueError(f"cu_seqlens: given with batch size {B}, expected batch size 1 (documents packed in one row)")
    if torch.compiler.is_compiling():  # values checked before the compiled layers (docstring)
        return cu.to(torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != T:
        raise ValueError(f"cu_seqlens: got {cu.tolist()}, expected to start at 0 and end at T={T}")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens: got {cu.tolist()}, expected strictly increasing offsets (no empty document)")
    return cu.to(torch.int64)


def segment_ids(cu_seqlens: torch.Tensor | None, T: int, device=None) -> torch.Tensor:
    """Document index of every token, ``[T]`` int64; all zeros when ``cu_seqlens`` is None."""
    if cu_seqlens is None:
        return torch.zeros(T, dtype=torch.int64, device=device)
    cu = check_cu_seqlens(cu_seqlens, T).to(device)
    return torch.searchsorted(cu[1:], torch.arange(T, device=cu.device), right=True)


def causal_document_mask(
    T: int, cu_seqlens: torch.Tensor | None = None, S: int | None = None, device=None
) -> torch.Tensor:
    """``[T, S]`` bool: query t may see key s iff ``s <= t`` and both lie in the same document."""
    S = T if S is None else S
    t = torch.arange(T, device=device)[:, None]
    s = torch.arange(S, device=device)[None, :]
    seg = segment_ids(cu_seqlens, T, device=device)
    return (s <= t) & (seg[:, None] == seg[None, :S])


ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # what every layer accepts as x
TOKEN_ID_DTYPES = (torch.int32, torch.int64)  # what the model accepts as input_ids


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_activation_dtype(x: torch.Tensor, where: str, name: str = "x") -> None:
    """Refuse a non-float activation on entry to a layer (an int ``x`` would give silent garbage or a raw torch error).

    Raises:
        ValueError: ``{where}: {name} has dtype ..., expected one of bfloat16, float16, float32, float64``.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in ACTIVATION_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{where}: {name} has dtype {got}, expected one of {_names(ACTIVATION_DTYPES)}")


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Token ids ``[B, T]`` int32/int64 in ``[0, vocab_size)``. The range is checked on the host for CPU ids and by a
    device-side assertion for accelerator ids (:func:`check_range_async`: no host sync in the step).

    Raises:
        ValueError: a wrong shape, a dtype other than int32/int64 (uint8, bool, float ... are refused), or (CPU ids)
            ids out of range; the message names ``input_ids``, the value and what was expected.
    """
    if input_ids.ndim != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids: got shape {tuple(input_ids.shape)}, expected [B, T] with B, T >= 1")
    if input_ids.dtype not in TOKEN_ID_DTYPES:
        raise ValueError(
            f"input_ids: got dtype {input_ids.dtype}, expected integer token ids ({_names(TOKEN_ID_DTYPES)})"
        )
    if input_ids.device.type == "cpu":
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"input_ids: got ids in [{lo}, {hi}], expected ids in [0, {vocab_size})")
        return
    check_range_async((input_ids >= 0) & (input_ids < vocab_size), f"input_ids: expected ids in [0, {vocab_size})")


def check_range_async(ok: torch.Tensor, message: str) -> None:
    """The device-side form of a value check on an accelerator tensor: ``torch._assert_async(ok.all(), message)``,
    no host sync (a training or decode step stays free of them); a failing check stops the program at the next
    synchronisation with a device-side assertion carrying ``message``. On the CPU checks raise ``ValueError`` at once
    (reading a CPU tensor costs no sync), which is what the callers do there."""
    torch._assert_async(ok.all(), message)


def effective_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The ``[out, in]`` weight a linear layer applies, for code that uses the weight in another form than ``x Wᵀ``
    (MLA's absorbed ``kv_b_proj``, spec 3.3): ``layer.weight`` for a plain ``nn.Linear``; for a LoRA-wrapped layer
    (a peft ``LoraLayer``: ``base_layer``, ``lora_A``/``lora_B``, see ``kimi_tools.lora``) ``W + scale * B A`` summed
    over its active, unmerged adapters (peft's ``get_delta_weight``; scale = alpha/r, alpha/sqrt(r) with rsLoRA).
    Differentiable in W, A and B. A wrapped layer's ``.weight`` is the base weight alone: reading it directly would
    silently drop the adapter (vLLM shipped that bug), so every such use goes through here.

    Raises:
        RuntimeError: an active adapter with dropout > 0 in training mode (LoRA dropout acts on the layer's input,
            which the absorbed form never forms), or a DoRA adapter (its magnitude vector needs the input too).
    """
    base = getattr(layer, "base_layer", None)
    if base is None:
        return layer.weight
    if getattr(layer, "disable_adapters", False) and getattr(layer, "merged", False):
        layer.unmerge()  # as peft's own forward does for a disabled, merged layer
    w = base.weight
    if getattr(layer, "disable_adapters", False):
        return w
    merged = set(getattr(layer, "merged_adapters", ()))
    for name in layer.active_adapters:
        if name in merged or name not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(name, False):
            raise RuntimeError(f"adapter {name!r}: DoRA on a weight used in absorbed form is not supported")
        drop = layer.lora_dropout[name]
        if layer.training and isinstance(drop, torch.nn.Dropout) and drop.p > 0:
            raise RuntimeError(
                f"adapter {name!r}: lora_dropout {drop.p} on a weight used in absorbed form (kv_b_proj): dropout acts "
                "on the layer input, which the absorbed form never forms; use lora dropout 0 for this layer"
            )
        w = w + layer.get_delta_weight(name).to(w.dtype)
    return w


def linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """``x Wᵀ`` in the activation dtype, the weight cast to ``x.dtype`` (the twin of ``reference_jax.common.linear``,
    taking the module instead of its weight). x ``[..., in]`` -> ``[..., out]``; ``layer`` an ``nn.Linear`` without
    bias. A layer that is not a plain ``nn.Linear`` runs its own forward: a LoRA-wrapped one (peft ``LoraLayer``,
    whose ``.weight`` is the base weight alone, so its adapters apply) and torchao's ``Float8Linear``
    (``kernels_torch.fp8``: its forward runs the FP8 GEMMs; ``F.linear`` on its ``.weight`` would silently run bf16)."""
    if type(layer) is not torch.nn.Linear:
        return layer(x)
    return F.linear(x, layer.weight.to(x.dtype))


def depthwise_conv_weight(weight: torch.Tensor, C: int) -> torch.Tensor:
    """A depthwise conv weight as ``[C, W]``: accepts the checkpoint's ``[C, 1, W]`` or a squeezed ``[C, W]`` (some
    exporters drop the singleton axis; both name the same filter).

    Raises:
        ValueError: any other shape, or a channel count other than ``C``.
    """
    if weight.ndim == 3 and weight.shape[0] == C and weight.shape[1] == 1:
        return weight[:, 0, :]
    if weight.ndim == 2 and weight.shape[0] == C:
        return weight
    raise ValueError(f"weight: got shape {tuple(weight.shape)}, expected [C, 1, W] or [C, W] with C={C}")
