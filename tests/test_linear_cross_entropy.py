"""``kernels_torch.loss.linear_cross_entropy`` (the LM loss without the ``[N, vocab]`` logits) and the model's
``KimiK3Model.loss``: value and gradients against the full-logits path ``F.cross_entropy((h @ w.t()).float())``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import rel

from kernels_torch.loss import default_chunk_size, linear_cross_entropy
from kernels_torch.model import KimiK3Model, cast_model
from kernels_torch.params import load_canonical
from kimi.config import load_config
from kimi.init import init_params

# relative error (Frobenius) per tensor and dtype; bf16: one bf16 rounding of dlogits / of the per-chunk dW apart
TOL = {
    torch.float64: {"loss": 1e-12, "dhidden": 1e-12, "dweight": 1e-12},
    torch.float32: {"loss": 1e-5, "dhidden": 1e-5, "dweight": 1e-5},
    torch.bfloat16: {"loss": 1e-5, "dhidden": 1e-2, "dweight": 1e-2},  # the loss is reduced in fp32 in both
}
MODEL_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}  # loss and every parameter gradient, through the model


def _inputs(N, D, V, dtype, ignored=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g, dtype=torch.float64) / D**0.5 * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[list(ignored)] = -100
    return hidden, weight, labels


def _reference(hidden, weight, labels, scale):
    """The full-logits path the model used before: logits in the weights' dtype, cross-entropy in fp32/fp64."""
    logits = hidden @ weight.t()
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    loss = F.cross_entropy(logits.to(cdt), labels, ignore_index=-100, reduction="sum")
    dh, dw = torch.autograd.grad(loss * scale, (hidden, weight))
    return loss.detach(), dh, dw


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N,chunk", [(1, 1), (1, 7), (63, 1), (63, 7), (63, 63), (63, 100), (63, None)])
def test_value_and_gradients_match_the_full_logits(dtype, N, chunk):
    D, V = 24, 101  # V prime: no multiple of anything; D != V
    hidden, weight, labels = _inputs(N, D, V, dtype, ignored=range(0, N, 5)[1:])  # row 0 kept (N = 1)
    scale = 0.37  # the backward scales the stored gradients by the incoming one
    loss, dh, dw = _reference(hidden, weight, labels, scale)
    out = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and out.ndim == 0
    gh, gw = torch.autograd.grad(out * scale, (hidden, weight))
    assert gh.dtype == dtype and gw.dtype == dtype
    tol = TOL[dtype]
    assert rel(out, loss) <= tol["loss"], (rel(out, loss), float(out), float(loss))
    assert rel(gh, dh) <= tol["dhidden"], rel(gh, dh)
    assert rel(gw, dw) <= tol["dweight"], rel(gw, dw)


def test_ignored_rows_get_zero_gradient_and_all_ignored_is_zero():
    hidden, weight, labels = _inputs(9, 16, 37, torch.float64, ignored=[2, 3, 8])
    gh, _ = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, chunk_size=4), (hidden, weight))
    assert torch.all(gh[[2, 3, 8]] == 0) and torch.all(gh[[0, 1, 4]].abs().sum(1) > 0)
    # every row ignored: the sum over no target is 0 and so are both gradients (as F.cross_entropy's "sum")
    labels[:] = -100
    out = linear_cross_entropy(hidden, weight, labels, chunk_size=4)
    gh, gw = torch.autograd.grad(out, (hidden, weight))
    assert float(out.detach()) == 0.0 and not gh.any() and not gw.any()
    assert float(F.cross_entropy(hidden.detach() @ weight.detach().t(), labels, reduction="sum")) == 0.0


def test_a_gradient_only_where_one_is_asked_for():
    hidden, weight, labels = _inputs(17, 16, 41, torch.float64)
    _, dh, dw = _reference(hidden, weight, labels, 1.0)
    w = weight.detach()  # frozen head: only dhidden
    (gh,) = torch.autograd.grad(linear_cross_entropy(hidden, w, labels, chunk_size=5), (hidden,))
    assert rel(gh, dh) <= TOL[torch.float64]["dhidden"]
    h = hidden.detach()  # frozen trunk: only dweight
    (gw,) = torch.autograd.grad(linear_cross_entropy(h, weight, labels, chunk_size=5), (weight,))
    assert rel(gw, dw) <= TOL[torch.float64]["dweight"]
    with torch.no_grad():  # no gradient work at all; same value
        out = linear_cross_entropy(hidden, weight, labels, chunk_size=5)
    assert not out.requires_grad and rel(out, _reference(hidden, weight, labels, 1.0)[0]) <= 1e-12


def test_default_chunk_size():
    assert default_chunk_size(163840) == 1536  # 1638 rows of fp32 logits in 1 GiB, down to a multiple of 128
    assert default_chunk_size(512) == 524288 and default_chunk_size(1 << 40) == 1


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(hidden=torch.randn(2, 3, 4)), r"hidden: got shape \(2, 3, 4\).*expected a 2-D floating tensor"),
        (dict(hidden=torch.ones(5, 8, dtype=torch.int64)), r"hidden: got .*int64.*floating"),
        (dict(weight=torch.randn(11, 7)), r"weight: got shape \(11, 7\), expected \[V, D\] with D = 8"),
        (dict(weight=torch.randn(11, 8, dtype=torch.float64)), r"weight: got torch.float64.*hidden's dtype"),
        (dict(labels=torch.zeros(5, dtype=torch.int32)), r"labels: got shape \(5,\) dtype torch.int32.*int64"),
        (dict(labels=torch.zeros(4, dtype=torch.int64)), r"labels: got shape \(4,\).*expected \[N\] = \[5\]"),
        (dict(labels=torch.tensor([0, 1, 11, 2, 3])), r"labels: got 11, expected ids in \[0, 11\) or ignore_index"),
        (dict(labels=torch.tensor([0, -1, 1, 2, 3])), r"labels: got -1, expected"),
        (dict(chunk_size=0), r"chunk_size: got 0, expected a positive int"),
        (dict(chunk_size=2.5), r"chunk_size: got 2.5"),
    ],
)
def test_bad_inputs_are_named(change, match):
    kw = dict(hidden=torch.randn(5, 8), weight=torch.randn(11, 8), labels=torch.tensor([0, 1, 10, -100, 3]))
    linear_cross_entropy(**kw)  # the unchanged call is fine
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(**{**kw, **change})


# ---------------------------------------------------------------------------------------------- the model


def _model(dtype, tie=False, layers=4):
    full = load_config("tiny")
    cfg = full.truncated(layers)  # KKKD: KDA, MoE and one DSA layer
    if tie:
        cfg = cfg.replace(tie_word_embeddings=True)
    model = KimiK3Model(cfg, backend="eager")
    load_canonical(model, init_params(cfg if tie else full, seed=3, layers=layers))  # routed experts into the stacks
    return cast_model(model, dtype)


def _labels(ids, cu):
    """Next-token labels of packed documents, -100 at each document's last token."""
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[:, torch.as_tensor(cu[1:]) - 1] = -100
    return labels


def _both_paths(model, ids, cu, labels, chunk):
    out = []
    for path in ("full", "chunked"):
        model.zero_grad(set_to_none=True)
        if path == "full":
            logits = model(ids, cu_seqlens=cu)
            x = logits.reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(
                x.to(torch.promote_types(x.dtype, torch.float32)), labels.reshape(-1), reduction="sum"
            )
        else:
            loss = model.loss(ids, labels, cu, chunk_size=chunk)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return out


@pytest.mark.parametrize(
    "dtype,tie,chunk",
    [(torch.float64, False, 7), (torch.float32, False, None), (torch.float64, True, 16)],
    ids=["fp64-chunk7", "fp32-default", "fp64-tied"],
)
def test_model_labels_path_equals_the_logits_path(dtype, tie, chunk):
    g = torch.Generator().manual_seed(5)
    model = _model(dtype, tie)
    cu = torch.tensor([0, 13, 14, 41, 63])  # packed documents, one of length 1 (no target)
    ids = torch.randint(0, model.config.vocab_size, (1, 63), generator=g)
    labels = _labels(ids, cu)
    (l0, g0), (l1, g1) = _both_paths(model, ids, cu, labels, chunk)
    tol = MODEL_TOL[dtype]
    assert l1.dtype == l0.dtype and rel(l1, l0) <= tol, (float(l1), float(l0))
    assert g1.keys() == g0.keys() and len(g0) > 50
    assert ("model.embed_tokens.weight" in g0) and (("lm_head.weight" in g0) != tie)
    bad = {n: e for n in g0 if not (e := rel(g1[n], g0[n])) <= tol}  # NaN fails
    assert not bad, bad


def test_model_labels_batched_rows_and_refusals():
    g = torch.Generator().manual_seed(6)
    model = _model(torch.float64, layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    labels = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    labels[1, 4:] = -100
    with torch.no_grad():
        logits = model(ids)
        want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        got = model.loss(ids, labels, chunk_size=4)
        with pytest.warns(DeprecationWarning, match="KimiK3Model.loss"):  # the old keyword: same value
            old = model(ids, labels=labels, loss_chunk_size=4)
    assert rel(got, want) <= MODEL_TOL[torch.float64] and rel(old, got) == 0.0
    for kw, match in [  # the old keyword's combinations that the loss cannot honour
        (dict(return_aux=True), "labels: given with return_aux"),
        (dict(attention_mask=torch.ones(2, 9)), "labels: given with attention_mask"),
        (dict(lengths=torch.tensor([9, 9])), "labels: given with lengths"),
    ]:
        with pytest.raises(ValueError, match=match), pytest.warns(DeprecationWarning):
            model(ids, labels=labels, **kw)
    with pytest.raises(ValueError, match=r"labels: got shape \(1, 9\) dtype torch.int64, expected \[B, T\] = \[2, 9\]"):
        model.loss(ids, labels[:1])
    with pytest.raises(ValueError, match=r"labels: got .*int32"):
        model.loss(ids, labels.int())
    ran = []  # a bad chunk_size is named, before the backbone runs
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf"loss_chunk_size: got {bad!r}, expected a positive int"):
            model.loss(ids, labels, chunk_size=bad, on_layer=ran.append)
    assert ran == []
    labels[0, 3] = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"labels: got {model.config.vocab_size}, expected ids in \[0, 512\)"):
        model.loss(ids, labels)


def test_a_wrapped_lm_head_takes_the_logits_path():
    """An ``lm_head`` that is no plain ``nn.Linear`` (a subclass here, as a wrapper would be) gives the same value."""

    class Wrapped(torch.nn.Linear):
        pass

    model = _model(torch.float64, layers=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(7))
    labels = _labels(ids, torch.tensor([0, 12]))
    with torch.no_grad():
        want = model.loss(ids, labels)
        head = Wrapped(model.config.hidden_size, model.config.vocab_size, bias=False, dtype=torch.float64)
        head.weight.copy_(model.lm_head.weight)
        model.lm_head = head
        got = model.loss(ids, labels)
    assert rel(got, want) <= MODEL_TOL[torch.float64]
