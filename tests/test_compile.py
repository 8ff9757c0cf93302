"""Decoder blocks under ``torch.compile`` (``kernels_torch.compile``): no graph break inside a block, one compilation
per block shape, compiled == eager in outputs and gradients, the ``kimi::`` custom ops pass ``torch.library.opcheck``
and give the eager functions' gradients, and ``kimi train --compile`` reproduces an uncompiled run's losses.

All on the CPU with the ``aot_eager`` backend (AOTAutograd, the joint forward/backward graph, no code generation):
it traces exactly what inductor gets, in seconds. Compiled and eager agree bitwise there; the tolerances below allow
for the reordering a code-generating backend may do. The ``cudnn`` backend's blocks are traced here through the
CPU twins of its ``kimi::`` ops (the kernels themselves run in ``tests/gpu/test_gpu_compile.py``); the ops' own
checks are in ``tests/test_custom_ops.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.utils.checkpoint
from helpers import check_rel
from torch._dynamo.testing import CompileCounterWithBackend

from kernels_torch import kda, kda_functional, kernel_choice, moe
from kernels_torch.compile import check_compile_supported, compile_blocks
from kernels_torch.model import KimiK3Model
from kernels_torch.ops import moe_grouped as mg
from kimi.config import load_config

TOL = {"out": 1e-6, "grad": 1e-6, "loss": 1e-6}  # compiled vs eager, fp32 (aot_eager: bitwise equal in practice)
TOL_TWIN = 1e-5  # a compiled cudnn-backend layer (CPU twins) vs the eager backend's, fp32: other summation orders
TOL_OP = {"grad": 1e-12}  # a kimi:: op's gradient vs the eager function's, fp64 (the same autograd, recomputed)


def _breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _layer_run(call, layer, blocks, p, cu, w):
    """Output and gradients (input ``p``, each parameter of ``layer``) of ``sum(out * w)``, ``out`` from ``call``
    (``layer`` itself or its compiled wrapper)."""
    for t in (p, *blocks, *layer.parameters()):
        t.grad = None
    _, out, _ = call(blocks, p, cu)
    (out * w).sum().backward()
    return out.detach(), p.grad.clone(), {n: q.grad.clone() for n, q in layer.named_parameters() if q.grad is not None}


@pytest.mark.parametrize(
    "idx, backend, moe_kernel, dtype",
    [(3, "eager", None, torch.float32), (1, "sdpa", "grouped_mm", torch.bfloat16)],
    ids=["dsa-moe-eager-fp32", "kda-moe-grouped-bf16"],
)
def test_layer_compiles_whole_once_and_matches_eager(idx, backend, moe_kernel, dtype):
    """One decoder layer (DSA + MoE after an AttnRes block, or KDA + the grouped MoE) compiled with fullgraph=True:
    0 graph breaks, 1 compilation for two micro-batches of one shape (other document boundaries), output and
    gradients equal to eager."""
    cfg = load_config("tiny")
    torch.manual_seed(idx)
    model = KimiK3Model(cfg, backend=backend).to(dtype)
    layer = model.model.layers[idx]
    if moe_kernel:
        layer.block_sparse_moe.experts.moe_kernel = moe_kernel
    T, D = 40, cfg.hidden_size
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    tol = TOL if dtype == torch.float32 else dict.fromkeys(TOL, 1e-2)
    for cu in ([0, 13, 40], [0, 29, 40]):  # same shape, other documents: no recompilation
        p = torch.randn(1, T, D, dtype=dtype, requires_grad=True)
        blocks = [torch.randn(1, T, D, dtype=dtype, requires_grad=True)] if layer.config.has_attn_res and idx else []
        w = torch.randn(1, T, D, dtype=dtype)
        want = _layer_run(layer, layer, blocks, p, torch.tensor(cu), w)
        got = _layer_run(compiled, layer, blocks, p, torch.tensor(cu), w)
        check_rel("out", got[0], want[0], tol["out"])
        check_rel("d p", got[1], want[1], tol["grad"])
        assert set(want[2]) <= set(got[2])
        for name in want[2]:
            check_rel(f"d {name}", got[2][name], want[2][name], tol["grad"])
        for name in set(got[2]) - set(want[2]):  # AOTAutograd gives zeros where eager leaves None (the indexer's
            assert not got[2][name].any(), name  # parameters: hard top-k passes no gradient)
    assert _breaks() == 0, dict(torch._dynamo.utils.counters["graph_break"])
    assert counter.frame_count == 1


def _twins(cfg) -> tuple[KimiK3Model, KimiK3Model]:
    """Two sdpa models of ``cfg`` with the same fresh random weights: the eager one and the one to compile."""
    torch.manual_seed(0)
    eager = KimiK3Model(cfg, backend="sdpa")
    model = KimiK3Model(cfg, backend="sdpa")
    model.load_state_dict(eager.state_dict())
    return eager, model


def _steps_match(eager, model, cfg, T: int = 48):
    """Loss and backward of both models on two micro-batches of fresh random tokens with other document counts:
    the loss and every gradient equal (TOL). Returns the last micro-batch's ``(ids, labels)``."""
    for cu in ([0, 13, T], [0, 5, 30, T]):
        ids = torch.randint(0, cfg.vocab_size, (1, T))
        labels = torch.randint(0, cfg.vocab_size, (1, T))
        losses = []
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
            loss = m.loss(ids, labels, torch.tensor(cu))
            loss.backward()
            losses.append(loss.detach())
        check_rel("loss", losses[1], losses[0], TOL["loss"])
        for (name, a), b in zip(eager.named_parameters(), model.parameters()):
            if a.grad is not None:
                check_rel(f"d {name}", b.grad, a.grad, TOL["grad"])
    return ids, labels


def test_compile_blocks_model_loss_and_grads():
    """``compile_blocks`` on a two-layer model (KDA + dense MLP, KDA + MoE): the loss and every gradient equal eager;
    one graph per block shape, none more for a micro-batch with another document count (``cu_seqlens``' length is
    dynamic), 0 graph breaks; a bad ``cu_seqlens`` is still refused (checked before the compiled blocks)."""
    cfg = load_config("tiny").truncated(2)
    eager, model = _twins(cfg)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(model, backend=counter)
    kernel_choice.reset_used()
    ids, labels = _steps_match(eager, model, cfg)
    assert _breaks() == 0
    assert counter.frame_count == 2  # the two blocks differ (dense MLP / MoE, AttnRes depth); no recompilation
    assert kernel_choice.used()["moe"] == {"loop": 2}  # the eager calls: a compiled block records nothing
    with pytest.raises(ValueError, match="cu_seqlens"):
        model.loss(ids, labels, torch.tensor([0, 30, 20, 48]))


@pytest.mark.parametrize(
    "mode, full_layers", [("layer", 0), ("mlp", 1), ("attn", 0)], ids=["layer", "mlp-first-whole", "attn"]
)
def test_compiled_blocks_under_recomputation_match_eager(mode, full_layers):
    """``compile_blocks`` after ``kernels_torch.activation_memory.recompute_layers`` (the trainer's order): whole layers compiled
    inside their checkpoint, MLP-only and attention-only recomputation traced inside the compiled layer. The loss and every gradient
    equal eager recomputation's, with 0 graph breaks, over two micro-batches of other document counts."""
    from kernels_torch.activation_memory import recompute_layers

    cfg = load_config("tiny").truncated(4)
    eager, model = _twins(cfg)
    for m in (eager, model):
        recompute_layers(m, mode, full_layers)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(model, backend=counter)
    for i, layer in enumerate(model.model.layers):  # the recomputation stays around the compiled function
        block = {"layer": "forward", "mlp": "feed_forward", "attn": "attention"}[mode]
        wrapped = layer.__dict__.get("forward" if i < full_layers else block)
        assert wrapped is not None and wrapped.func is torch.utils.checkpoint.checkpoint, i
    _steps_match(eager, model, cfg)
    assert _breaks() == 0, dict(torch._dynamo.utils.counters["graph_break"])
    assert counter.frame_count >= 2  # the blocks ran compiled


def test_compile_refusals(monkeypatch):
    """The cudnn backend compiles; its eager-only KDA preparations and unknown compile backends are refused."""
    monkeypatch.delenv("KIMI_KDA_PREP", raising=False)
    check_compile_supported("cudnn")
    for prep in ("triton", "in_kernel"):
        monkeypatch.setenv("KIMI_KDA_PREP", prep)
        with pytest.raises(ValueError, match=f"KIMI_KDA_PREP={prep}"):
            check_compile_supported("cudnn")
    monkeypatch.setenv("KIMI_KDA_PREP", "outside")
    check_compile_supported("cudnn")
    with pytest.raises(ValueError, match="compile-backend"):
        check_compile_supported("sdpa", "tvm")


@pytest.mark.parametrize("idx", [1, 3], ids=["kda-moe", "dsa-moe"])
def test_cudnn_block_compiles_whole_through_the_op_twins(monkeypatch, idx):
    """A ``cudnn``-backend decoder layer (KDA + MoE, DSA + MoE) compiled with fullgraph=True on the CPU: every kernel
    of the layer is a ``kimi::`` op (here running its CPU twin: the backend's device and dtype gate is lifted for
    the test), the code between them traced. 0 graph breaks, 1 compilation for two micro-batches of one shape, the
    output and gradients equal to the ``eager`` backend's layer with the same weights (fp32: the twins compute the
    same functions; the DSA layer's sparse gather and the MoE's fused SiTU-GLU backward reorder sums)."""
    from kernels_torch import dsa_cudnn, kda_cudnn

    monkeypatch.setattr(kda_cudnn, "require_cudnn_backend", lambda x: None)
    monkeypatch.setattr(dsa_cudnn, "require_cudnn", lambda x, what="x": None)
    cfg = load_config("tiny")
    torch.manual_seed(idx)
    model = KimiK3Model(cfg, backend="cudnn")
    ref = KimiK3Model(cfg, backend="eager")
    ref.load_state_dict(model.state_dict())
    layer, ref_layer = model.model.layers[idx], ref.model.layers[idx]
    T, D = 40, cfg.hidden_size
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    for cu in ([0, 13, 40], [0, 29, 40]):
        p = torch.randn(1, T, D, requires_grad=True)
        blocks = [torch.randn(1, T, D)]
        w = torch.randn(1, T, D)
        want = _layer_run(ref_layer, ref_layer, blocks, p, torch.tensor(cu), w)
        got = _layer_run(compiled, layer, blocks, p, torch.tensor(cu), w)
        check_rel("out", got[0], want[0], TOL_TWIN)
        check_rel("d p", got[1], want[1], TOL_TWIN)
        for name in got[2]:  # the cudnn layer's indexer is frozen: its parameters have no gradient
            check_rel(f"d {name}", got[2][name], want[2][name], TOL_TWIN)
        assert set(got[2]) == {n for n in want[2] if not n.startswith("self_attn.indexer.")}
    assert _breaks() == 0, dict(torch._dynamo.utils.counters["graph_break"])
    assert counter.frame_count == 1


def _f64(*shape, requires_grad=True):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=requires_grad)


def _op_cases():
    """(name, op, args, eager function of the same args) for every kimi:: op, fp64 except the grouped layout's."""
    torch.manual_seed(0)
    B, T, H, K, V = 1, 37, 2, 8, 4  # K != V; T not a multiple of the chunk
    cu = torch.tensor([0, 10, 37])
    q, k = (torch.nn.functional.normalize(_f64(B, T, H, K), dim=-1).detach().requires_grad_() for _ in range(2))
    g = (-torch.rand(B, T, H, K, dtype=torch.float64) * 2).requires_grad_()
    beta = torch.rand(B, T, H, dtype=torch.float64).requires_grad_()
    kda_args = (q, k, _f64(B, T, H, V), g, beta, K**-0.5, _f64(2, H, K, V), cu, 16)
    x, cw, cs = _f64(1, T, 6), _f64(6, 1, 4), _f64(2, 6, 3)
    N, Dl, I, E, kk = 11, 8, 6, 4, 2
    ids = torch.stack([torch.randperm(E)[:kk] for _ in range(N)])
    wts = torch.rand(N, kk, dtype=torch.float64, requires_grad=True)
    loop_args = (_f64(N, Dl), ids, wts, _f64(E, I, Dl), _f64(E, I, Dl), _f64(E, Dl, I), "situ", 4.0, 25.0, False)
    lay = mg.expert_layout(ids, E, 4)
    z, y = torch.randn(N, Dl, requires_grad=True), torch.randn(lay.rows, Dl, requires_grad=True)
    w32 = torch.rand(N, kk, requires_grad=True)

    def kda_eager(q, k, v, g, beta, scale, s0, cu, C):
        return kda.kda_chunk(q, k, v, g, beta, scale, s0, cu, C)

    return [
        ("kda_chunk", kda_functional._kda_chunk_op, kda_args, kda_eager),
        ("short_conv", kda_functional._short_conv_op, (x, cw, cu, cs), kda.short_conv),
        ("short_conv_no_state", kda_functional._short_conv_op, (x, cw, cu, None), kda.short_conv),
        ("experts_loop", moe._experts_loop_op, loop_args, moe._experts_loop_flat),
        ("permute_rows", mg._permute_rows_op, (z, lay.row_of_pair, lay.order, lay.rows, kk, "auto"), None),
        ("combine_rows", mg._combine_rows_op, (y, w32, lay.row_of_pair, kk, "auto"), None),
        ("gather_sum", mg._gather_sum_op, (y.detach(), lay.row_of_pair, kk, torch.float32, "auto"), None),
        (
            "combine_rows_backward",
            mg._combine_rows_backward_op,
            (torch.randn(N, Dl), y.detach(), w32.detach(), lay.row_of_pair, kk, "auto"),
            None,
        ),
    ]


CASES = _op_cases()


@pytest.mark.parametrize("name, op, args, eager", CASES, ids=[c[0] for c in CASES])
def test_custom_op_opcheck_and_gradients(name, op, args, eager):
    """``torch.library.opcheck`` (schema, autograd registration, fake tensors, AOT dispatch with dynamic shapes) on
    each kimi:: op; for the ops with gradients by recomputation, the op's gradients equal the eager function's
    (opcheck alone would pass an op whose backward returned zeros)."""
    torch.library.opcheck(op, args)
    if eager is None:
        return
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    outs = [op(*args), eager(*args)]
    grads = []
    for out in outs:
        out = out if isinstance(out, tuple) else (out,)
        torch.manual_seed(1)
        seeds = [torch.randn_like(o) for o in out]
        grads.append(torch.autograd.grad(out, inputs, seeds))
    for i, (a, b) in enumerate(zip(*grads)):
        check_rel(f"{name} d input {i}", a, b, TOL_OP["grad"])


def test_recompute_op_outputs_never_alias_inputs():
    """A custom op's outputs may not share storage with its inputs (``torch.library``'s contract; an alias would let
    the compiler reuse or overwrite a buffer the caller still reads): ``own`` copies an output that does (the input
    itself, or a view of it) and keeps one that does not; an op whose eager function returns its input passes
    ``opcheck``."""
    from kernels_torch.ops.custom import own, recompute_op

    x, other = torch.randn(4, 3), torch.randn(4, 3)
    for t in (x, x[1:], x.t()):  # the input, a view of it, a non-contiguous view
        got = own(t, (x,))
        assert got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() and got.is_contiguous()
        assert torch.equal(got, t)
    assert own(other, (x,)) is other
    op = recompute_op("kimi_test::passthrough", lambda x: x, "(Tensor x) -> Tensor", lambda x: torch.empty_like(x))
    torch.library.opcheck(op, (torch.randn(5, 2, dtype=torch.float64, requires_grad=True),))


def test_train_compile_matches_uncompiled(tmp_path, monkeypatch):
    """``kimi train --compile`` (aot_eager) for 2 steps on the tiny preset (2 layers): the losses and eval losses of
    an uncompiled run; ``run.json`` records the flags."""
    import json

    from kimi_tools.common import DEFAULT_TEXT
    from kimi_tools.train import TrainArgs, train

    kw = dict(
        data=[str(DEFAULT_TEXT)], layers=2, steps=2, seq_len=16, micro_batch_tokens=32, batch_tokens=32,
        eval_tokens=32, eval_every=0, warmup_steps=1, lr=1e-2, quiet=True, plot=False, save=False,
    )  # fmt: skip
    torch._dynamo.reset()
    plain = train(TrainArgs(out=str(tmp_path / "plain"), **kw))
    comp = train(TrainArgs(out=str(tmp_path / "comp"), compile=True, compile_backend="aot_eager", **kw))
    for a, b in zip(plain.records, comp.records):
        for key in ("loss", "eval_loss"):
            if a[key] is not None:
                check_rel(f"step {a['step']} {key}", b[key], a[key], TOL["loss"])
    run = json.loads((tmp_path / "comp" / "run.json").read_text())
    assert run["args"]["compile"] is True and run["args"]["compile_backend"] == "aot_eager"
    with pytest.raises(ValueError, match="--compile-backend"):
        train(TrainArgs(out=str(tmp_path / "x"), compile_backend="aot_eager", **kw))
    monkeypatch.setenv("KIMI_KDA_PREP", "in_kernel")  # forward only: refused before any model is built
    with pytest.raises(ValueError, match="--compile: got KIMI_KDA_PREP=in_kernel with --backend cudnn"):
        train(TrainArgs(out=str(tmp_path / "y"), compile=True, backend="cudnn", device="cuda", dtype="bfloat16", **kw))
