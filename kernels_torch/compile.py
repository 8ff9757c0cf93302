"""``torch.compile`` of the decoder blocks, one block at a time (torchtitan's per-block compile).

:func:`compile_blocks` compiles each ``DecoderLayer`` of a :class:`kernels_torch.model.KimiK3Model` in place
(``nn.Module.compile``, ``fullgraph=True``): the embedding, the AttnRes output mix, the final norm and the loss
stay eager, and so do the model's input checks, which read ``input_ids`` and ``cu_seqlens`` on the host once
before the first block (``kernels_torch.common.check_cu_seqlens``).

No graph break inside a block: the blocks whose loops read tensor values (the KDA recurrence and short convolution
over ``cu_seqlens`` documents, the routed experts' ``loop`` kernel, the grouped layout's Triton gathers) run as
``kimi::`` custom ops under compilation (``kernels_torch.ops.custom``), single nodes with fake shapes and autograd
formulas. ``tests/test_compile.py`` counts graph breaks (0) and compilations per block shape.

Compilations. A block's forward reads its kind (``is_kda``, ``is_moe``, ``writes_block``), never its index, so
blocks of one kind, input shape and AttnRes depth (``len(blocks)``) share one graph: the tiny preset's 9 blocks
compile 7 graphs per (grad mode, shape), K3's 93 far fewer than 93. ``cu_seqlens``' length (the document count of
a micro-batch) is marked dynamic before the blocks run, so a new document count never recompiles; a new row length
``T`` recompiles once with ``dynamic=None`` (dynamo's automatic dynamic shapes), then ``T`` is symbolic.

``kernels_torch.kernel_choice.used()`` counts the eager calls only: a compiled block records nothing (tracing
the counter's ``+= 1`` would guard on its value and recompile at every call).

Not covered here: the ``cudnn`` backend (its cuDNN KDA, FlashMLA and fla kernels are not ``kimi::`` ops yet:
refused), decode caches (``step=``), and the parallel wrappers (FSDP2, CP, EP, PP), which were not tried compiled.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["COMPILE_BACKENDS", "compile_blocks", "check_compile_supported"]

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # torch.compile backends the blocks were compiled with here
RECOMPILE_LIMIT = 64  # dynamo graphs per code object: every block shares DecoderLayer.forward


def check_compile_supported(model_backend: str, compile_backend: str = "inductor") -> None:
    """Refuse what :func:`compile_blocks` cannot do.

    Raises:
        ValueError: a ``compile_backend`` outside :data:`COMPILE_BACKENDS`, or the ``cudnn`` model backend (its
            fused GPU kernels are not registered as custom ops yet, so its blocks would break the graph).
    """
    if compile_backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile-backend: got {compile_backend!r}, expected one of {list(COMPILE_BACKENDS)}")
    if model_backend == "cudnn":
        raise ValueError(
            "compile: got --backend cudnn, whose kernels (cuDNN KDA, FlashMLA, fla) are not kimi:: custom ops yet and were "
            "never run compiled; expected --backend eager or sdpa"
        )


def _mark_cu_seqlens_dynamic(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of the backbone: the document count varies per micro-batch, so ``cu_seqlens``' length is
    dynamic from the first call (no recompilation per document count)."""
    cu = args[1] if len(args) > 1 else kwargs.get("cu_seqlens")
    if isinstance(cu, torch.Tensor):
        torch._dynamo.maybe_mark_dynamic(cu, 0)


def _checkpointed_forward(layer: nn.Module) -> functools.partial | None:
    """The ``functools.partial(torch.utils.checkpoint.checkpoint, forward, ...)`` that whole-layer recomputation
    (``kernels_torch.activation_memory.recompute_layers``, mode ``layer``) puts in place of ``layer.forward``, or None. (Its MLP-only
    and attention-only modes wrap ``feed_forward`` / ``attention`` inside the forward, which dynamo traces as a
    checkpointed region.)"""
    import torch.utils.checkpoint

    f = layer.__dict__.get("forward")
    ok = isinstance(f, functools.partial) and f.func is torch.utils.checkpoint.checkpoint and f.args
    return f if ok else None


def compile_blocks(
    model: nn.Module,
    *,
    backend: str | object = "inductor",
    dynamic: bool | None = None,
    fullgraph: bool = True,
    mode: str | None = None,
) -> nn.Module:
    """Compile every decoder layer of ``model`` (a ``KimiK3Model``) in place with ``torch.compile``; returns
    ``model``. The parameters, ``state_dict`` keys and values are unchanged; compiled and eager blocks agree to
    rounding (``tests/test_compile.py``).

    Args:
        backend: a ``torch.compile`` backend: ``"inductor"`` (the default: generated Triton on CUDA, C++ on the CPU,
            which needs a C++ compiler), ``"aot_eager"`` (AOTAutograd without code generation, for tests), or a
            backend object (a compile counter in tests).
        dynamic: ``torch.compile``'s ``dynamic`` (None: static first, a shape that changes becomes symbolic).
        fullgraph: True (the default) makes a graph break an error rather than a silent split.
        mode: ``torch.compile``'s ``mode`` (e.g. ``"max-autotune-no-cudagraphs"``).

    Raises:
        ValueError: as :func:`check_compile_supported`, or a model without ``model.layers``.
    """
    check_compile_supported(getattr(model, "backend", "eager"), backend if isinstance(backend, str) else "inductor")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"compile: got a {type(model).__name__}, expected a KimiK3Model (model.model.layers)")
    cfg = torch._dynamo.config
    # every block runs DecoderLayer.forward: its graphs (kinds x AttnRes depths x shapes x grad modes) share one
    # code object's cache, which must hold them all (fullgraph=True turns a full cache into an error, not eager)
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT, 4 * len(layers))
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * cfg.recompile_limit)
    kw = dict(backend=backend, dynamic=dynamic, fullgraph=fullgraph, mode=mode)
    for layer in layers:
        recomputed = _checkpointed_forward(layer)
        if recomputed is None:
            layer.compile(**kw)
        else:  # compile inside the checkpoint: dynamo does not trace a checkpoint call that replaced ``forward``
            layer.forward = functools.partial(
                recomputed.func, torch.compile(recomputed.args[0], **kw), *recomputed.args[1:], **recomputed.keywords
            )
    if not getattr(model, "_compiled_blocks", False):
        model.model.register_forward_pre_hook(_mark_cu_seqlens_dynamic, with_kwargs=True)
    model._compiled_blocks = True
    return model
