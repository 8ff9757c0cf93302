"""``torch.compile`` of the decoder blocks, one block at a time (torchtitan's per-block compile).

:func:`compile_blocks` compiles each ``DecoderLayer`` of a :class:`kernels_torch.model.KimiK3Model` in place
(``nn.Module.compile``, ``fullgraph=True``): the embedding, the AttnRes output mix, the final norm and the loss
stay eager, and so do the model's input checks, which read ``input_ids`` and ``cu_seqlens`` on the host once
before the first block (``kernels_torch.common.check_cu_seqlens``).

No graph break inside a block: every kernel whose Python dynamo cannot trace runs as a ``kimi::`` custom op under
compilation, one node with a fake (meta) implementation for the shapes and an autograd formula
(``torch.library.custom_op``, ``register_fake``, ``register_autograd``); the code between the ops is traced and
left to the compiler. The ops, each registered beside the function it wraps:

* every backend: the KDA recurrence and short convolution of the torch path (``kimi::kda_chunk``,
  ``kimi::short_conv``, ``kernels_torch.kda``: loops over ``cu_seqlens`` documents), the routed experts' ``loop``
  kernel (``kimi::experts_loop``, ``kernels_torch.moe``), the grouped layout's Triton gather-sums
  (``kimi::permute_rows``, ``kimi::combine_rows``, ``kernels_torch.ops.moe_grouped``);
* the ``cudnn`` backend: the fused SiTU-GLU (``kimi::situ_glu``, ``kernels_torch.ops.situ``); the cuDNN indexer and
  top-k (``kimi::indexer_topk``) and the sparse MLA forward, FlashMLA's or our Triton kernel, with cuDNN's sparse
  backward as its own op (``kimi::sparse_mla``, ``kimi::sparse_mla_backward``, ``kernels_torch.dsa_cudnn``);
  cuDNN FE's KDA forward with its backward op (``kimi::kda_cudnn``, ``kimi::kda_cudnn_backward``), fla's
  ``chunk_kda`` and the short convolution on cuDNN's or fla's kernel (``kimi::kda_fla``, ``kimi::kda_short_conv``,
  ``kernels_torch.kda_cudnn``). The q/k L2 norm, the KDA gate, beta's sigmoid and the gated output norm, fla kernels
  in eager mode, are their torch twins in a compiled block (the compiler fuses them;
  ``kernels_torch.kda_cudnn._kda_layer_forward_compiled``).

Closed-form backwards where the kernel has one of its own (SiTU-GLU, the sparse MLA, cuDNN's KDA, the
gather-sums); the others (fla's ``chunk_kda`` and short convolution, cuDNN's short convolution, whose backwards
live inside their libraries' autograd Functions, and the torch path's loops) recompute their forward under
autograd in the backward (``kernels_torch.ops.custom.recompute_op``). Each op runs its GPU kernel on CUDA tensors
and a torch twin on CPU tensors, which the CPU tests check the registrations with (``torch.library.opcheck``).
``tests/test_compile.py`` counts graph breaks (0) and compilations per block shape, on the ``cudnn`` backend too
(its blocks traced on the CPU through the twins); ``tests/gpu/test_gpu_compile.py`` runs them with inductor on CUDA.

Compilations. A block's forward reads its kind (``is_kda``, ``is_moe``, ``writes_block``), never its index, so
blocks of one kind, input shape and AttnRes depth (``len(blocks)``) share one graph: the tiny preset's 9 blocks
compile 7 graphs per (grad mode, shape), K3's 93 far fewer than 93. ``cu_seqlens``' length (the document count of
a micro-batch) is marked dynamic before the blocks run, so a new document count never recompiles; a new row length
``T`` recompiles once with ``dynamic=None`` (dynamo's automatic dynamic shapes), then ``T`` is symbolic.
The kernel choices of the ``cudnn`` backend (``kernels_torch.kernel_choice``: the layers' attributes, the
environment, whether a package imports, the device's capability) are made while tracing and are constants of the
graph (``kernels_torch.ops.custom.trace_constant``); a cuDNN kernel that declines at the call raises in a compiled
block (eager mode falls back to fla there).

``kernels_torch.kernel_choice.used()`` counts the calls the ops make when they run (their kernels) and the eager
calls: the Python traced into a block records nothing (tracing the counter's ``+= 1`` would guard on its value and
recompile at every call).

Not covered here: decode caches (``step=``), the ``cudnn`` KDA layer's ``kda_prep`` ``triton`` and ``in_kernel``
kernels (eager only: refused), and the parallel wrappers (FSDP2, CP, EP, PP), which were not tried compiled. Not
measured yet: the compiled ``cudnn`` blocks' speed and their agreement with eager on a GPU
(``benchmarks/run_h200.sh`` step ``train_step_compiled``, ``tests/gpu/test_gpu_compile.py``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["COMPILE_BACKENDS", "compile_blocks", "check_compile_supported"]

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # torch.compile backends the blocks were compiled with here
RECOMPILE_LIMIT = 64  # dynamo graphs per code object: every block shares DecoderLayer.forward


def check_compile_supported(model_backend: str, compile_backend: str = "inductor") -> None:
    """Refuse what :func:`compile_blocks` cannot do, before any block is traced.

    Args:
        model_backend: the model's backend (``eager``, ``sdpa`` or ``cudnn``; all three compile).
        compile_backend: a name of :data:`COMPILE_BACKENDS`.

    Raises:
        ValueError: a ``compile_backend`` outside :data:`COMPILE_BACKENDS`; on the ``cudnn`` backend,
            ``$KIMI_KDA_PREP`` set to ``triton`` or ``in_kernel`` (eager-only kernels: a compiled block computes the
            q/k L2 norm, gate and beta sigmoid with torch ops that the compiler fuses) or to a value outside
            ``kernel_choice.CHOICES["kda_prep"]``.
    """
    if compile_backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile-backend: got {compile_backend!r}, expected one of {list(COMPILE_BACKENDS)}")
    if model_backend == "cudnn":
        from kernels_torch import kernel_choice

        prep = kernel_choice.resolve("kda_prep", None)
        if prep in ("triton", "in_kernel"):
            raise ValueError(
                f"compile: got KIMI_KDA_PREP={prep} with --backend cudnn; a compiled KDA block computes the q/k L2 "
                "norm, gate and beta sigmoid with torch ops the compiler fuses: expected KIMI_KDA_PREP unset, auto "
                "or outside"
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
        ValueError: as :func:`check_compile_supported`, or a model without ``model.layers``. A layer's own refusals
            (a forced ``kda_prep`` of ``triton`` / ``in_kernel``, a forced kernel that cannot run) come at the
            first call, when the block is traced.
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
