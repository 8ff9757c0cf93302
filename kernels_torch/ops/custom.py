"""``torch.library`` custom ops for the blocks of a decoder layer that ``torch.compile`` cannot trace as they are:
each becomes one node (no graph break) with a fake (meta) implementation for the shapes and an autograd formula.

Why these blocks: each holds a loop whose trip count or slice bounds are *values* of a tensor, which dynamo can only
read by breaking the graph (a host sync). The ``kimi::`` ops of the project:

* ``kimi::kda_chunk`` and ``kimi::short_conv`` (``kernels_torch.kda``): the KDA recurrence and the short convolution,
  one run per ``cu_seqlens`` document;
* ``kimi::experts_loop`` (``kernels_torch.moe``): the routed experts' ``loop`` kernel, one GEMM per expert over the
  tokens ``torch.nonzero`` routes to it;
* ``kimi::permute_rows``, ``kimi::combine_rows`` and their backwards (``kernels_torch.ops.moe_grouped``): the
  grouped-expert layout's gather and weighted gather-sum (Triton kernels on CUDA);
* the ``cudnn`` backend's kernels, whose Python (library launchers, import probes, locks) dynamo cannot trace:
  ``kimi::situ_glu`` (``kernels_torch.ops.situ``), ``kimi::indexer_topk``, ``kimi::sparse_mla`` and
  ``kimi::sparse_mla_backward`` (``kernels_torch.dsa_cudnn``), ``kimi::kda_cudnn`` and ``kimi::kda_cudnn_backward``,
  ``kimi::kda_fla``, ``kimi::kda_short_conv`` (``kernels_torch.kda_cudnn``). These run the GPU kernel on CUDA
  tensors and a torch twin on CPU tensors; their kernel choices are made while tracing (:func:`trace_constant`).

Each op's implementation *is* the eager function (called unchanged, on every device: on CUDA it picks its GPU kernel
as in eager mode). The ops are registered beside the function they wrap (this module holds the machinery, as
``kernels_torch.ops`` never imports a layer module), and the functions switch to them only under
``torch.compiler.is_compiling()``: eager runs keep their own autograd graph.

:func:`recompute_op` registers an op whose gradient is computed the way the eager code computes it, by autograd over
the same forward: its backward (itself a custom op, ``<name>_backward``, since AOTAutograd traces backwards with fake
tensors) recomputes the forward with autograd on from the saved inputs and calls ``torch.autograd.grad``.
The cost is one more forward of the block in the backward (the eager KDA recurrence already recomputes each chunk in
its backward with ``torch.utils.checkpoint``; under the op the whole recurrence runs once more). Closed-form
backwards (the grouped layout's) are registered directly with ``register_autograd``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch._dynamo
from torch import Tensor

__all__ = ["recompute_op", "own", "recompute_ops", "trace_constant", "autograd_inside_op"]

_REGISTERED: dict[str, tuple] = {}  # name -> (forward op, backward op), for tests (opcheck) and docs


def own(t: Tensor, inputs: Sequence) -> Tensor:
    """``t`` contiguous and sharing no storage with any tensor of ``inputs`` (a custom op's outputs may not alias
    its inputs); a copy only where it does."""
    t = t.contiguous()
    ptr = t.untyped_storage().data_ptr()
    if any(isinstance(x, Tensor) and x.untyped_storage().data_ptr() == ptr for x in inputs):
        t = t.clone()
    return t


def trace_constant(fn: Callable) -> Callable:
    """``fn`` marked for ``torch.compile`` as a function whose result is a constant of the trace
    (``torch._dynamo.assume_constant_result``): dynamo calls it once while tracing and bakes the result into the
    graph, with no guard on it. For the probes that pick a kernel (does a package import, does the device's
    capability have an engine): Python that dynamo cannot trace (``importlib``, a device query), whose answer does not
    change while the process runs. Its arguments must be constants to dynamo (strings, numbers, ``torch.device``,
    ``torch.dtype``), never tensors. Outside compilation it is ``fn``."""
    return torch._dynamo.assume_constant_result(fn)


@contextlib.contextmanager
def autograd_inside_op():
    """Autograd back on inside an op's implementation. The dispatcher calls a custom op's kernel below the autograd
    keys (they stay in the thread's exclude set, eager or compiled), so ``torch.enable_grad`` alone records nothing
    there and ``torch.autograd.grad`` would find no graph: the autograd keys are taken out of the exclude set for
    the block (``torch._C._ForceDispatchKeyGuard``, the guard functorch uses; the other keys are left as they are)."""
    K = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (K.AutogradFunctionality, K.ADInplaceOrView, K.AutogradOther, K.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _tensor_args(schema: str) -> list[int]:
    """Positions of the ``Tensor`` and ``Tensor?`` arguments of a schema ``"(Tensor x, ...) -> ..."``."""
    args = schema.split("->")[0].strip()[1:-1]
    return [i for i, a in enumerate(args.split(",")) if a.split()[0] in ("Tensor", "Tensor?")]


def recompute_op(name: str, fn: Callable, schema: str, fake: Callable) -> Callable:
    """Register ``fn`` as the custom op ``name`` (``"kimi::x"``) with gradients by recomputation.

    Args:
        name: the op's qualified name; its backward is registered as ``name + "_backward"``.
        fn: the eager function, ``fn(*args)`` in the schema's argument order, returning a tensor or a tuple of
            tensors; differentiable in its floating tensor arguments by ordinary autograd.
        schema: arguments and returns in ``torch.library`` schema syntax, e.g. ``"(Tensor x, Tensor? s, int n) ->
            (Tensor, Tensor)"``; no argument is mutated.
        fake: ``fake(*args)`` -> outputs of the right shapes, dtypes and devices (``new_empty``), for tracing.

    Returns:
        The op (an ``OpOverload``-like callable taking the schema's arguments positionally). Forward: ``fn`` under
        ``torch.no_grad``, outputs made contiguous and unaliased (:func:`own`). Backward: ``<name>_backward(douts,
        *args, needs)`` runs ``fn`` under ``torch.enable_grad`` on detached copies of the inputs that need a
        gradient and returns ``torch.autograd.grad`` for them (zeros where the outputs do not depend on one;
        unaliased, :func:`own`: a pass-through gradient would be an incoming ``dout``).
    """
    positions = _tensor_args(schema)
    ret = schema.split("->")[1].strip()
    multi = ret.startswith("(")

    def forward(*args):
        with torch.no_grad():
            out = fn(*args)
        if multi:
            return tuple(own(o, args) for o in out)
        return own(out, args)

    op = torch.library.custom_op(name, forward, mutates_args=(), schema=schema)
    op.register_fake(fake)

    bwd_schema = "(Tensor?[] douts, " + schema.split("->")[0].strip()[1:-1] + ", bool[] needs) -> Tensor[]"

    def backward_impl(douts, *rest):
        *args, needs = rest
        args = list(args)
        leaves = []
        with autograd_inside_op():
            for j, i in enumerate(positions):
                if needs[j]:
                    args[i] = args[i].detach().requires_grad_(True)
                    leaves.append(args[i])
            out = fn(*args)
            outs = out if multi else (out,)
            pairs = [(o, d) for o, d in zip(outs, douts) if d is not None and o.requires_grad]
            got = [None] * len(leaves)
            if leaves and pairs:
                got = torch.autograd.grad([o for o, _ in pairs], leaves, [d for _, d in pairs], allow_unused=True)
        grads, it = [], iter(got)
        base = next(a for a in args if isinstance(a, Tensor))
        for j, i in enumerate(positions):
            if not needs[j]:
                grads.append(base.new_empty(0))
                continue
            gr = next(it)
            grads.append(torch.zeros_like(args[i]) if gr is None else own(gr, (*douts, *args)))  # may be a dout
        return grads

    def backward_fake(douts, *rest):
        *args, needs = rest
        base = next(a for a in args if isinstance(a, Tensor))
        return [
            torch.empty_like(args[i], memory_format=torch.contiguous_format) if needs[j] else base.new_empty(0)
            for j, i in enumerate(positions)
        ]

    bwd = torch.library.custom_op(name + "_backward", backward_impl, mutates_args=(), schema=bwd_schema)
    bwd.register_fake(backward_fake)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(inputs[i] for i in positions))
        ctx.args = list(inputs)
        for i in positions:
            ctx.args[i] = None  # the tensors come back through saved_tensors

    def backward(ctx, *douts):
        args = list(ctx.args)
        for i, t in zip(positions, ctx.saved_tensors):
            args[i] = t
        needs = [bool(ctx.needs_input_grad[i]) and args[i] is not None for i in positions]
        grads = bwd(list(douts), *args, needs)
        result = [None] * len(args)
        for j, i in enumerate(positions):
            if needs[j]:
                result[i] = grads[j]
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)
    _REGISTERED[name] = (op, bwd)
    return op


def recompute_ops() -> dict[str, tuple]:
    """``{name: (forward op, backward op)}`` of every op registered by :func:`recompute_op` so far."""
    return dict(_REGISTERED)
