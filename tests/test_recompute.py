"""Selective recomputation and activation offload (``kernels_torch.activation_memory.recompute_layers``,
``kernels_torch.activation_memory``): every policy gives the loss and every gradient of no recomputation, bit for bit in
fp64 on the CPU over two optimizer steps; each recomputes or offloads the block it names, in the layer kinds it
names; what does not compose is refused in one line; ``kimi train`` records the policy.

The model is the tiny preset cut to 4 layers: dense (KDA attention, dense MLP), two KDA + MoE, one DSA + MoE.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kernels_torch.activation_memory import layer_kind, offload_activations, recompute_layers, saved_bytes_by_block
from kimi_tools.data import PackedLoader
from kimi_tools.train import LMStage, TrainArgs, train
from kimi_tools.train.args import resolve

LR = 1e-2  # the SGD step between the two compared steps (moves every weight well past fp64 rounding)
# offloaded block: what autograd still keeps on the device there is its small tensors (< MIN_OFFLOAD_BYTES each:
# per-head scalars, ids) and nothing else; this share of the block's bytes without offload is the bound
TOL_LEFT = 0.05


@pytest.fixture(scope="module")
def tiny4():
    from kernels_torch.model import model_from_params
    from kimi.config import load_config
    from kimi.init import init_params

    full = load_config("tiny")
    cfg = full.truncated(4)
    params = init_params(full, seed=2, layers=4)
    docs = [np.asarray(list(t.encode())) for t in ("Alice was beginning", " to get very tired of sitting by her")]
    batch = PackedLoader(docs, seq_len=40, rows=1, shuffle=False).next_batch()

    def make():
        return model_from_params(cfg, params, "sdpa", torch.float64)

    return cfg, make, batch


def _steps(cfg, model, batch, n=2):
    """Loss and every gradient of ``n`` steps, an SGD update between them."""
    out = []
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        loss, _ = LMStage(cfg, None).loss(model, batch)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        out.append((loss.detach(), grads))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return out


@pytest.fixture(scope="module")
def reference(tiny4):
    cfg, make, batch = tiny4
    return _steps(cfg, make(), batch)


POLICIES = {  # id: (recompute mode, full layers, recompute kinds, offload mode, offload kinds)
    "attn": ("attn", 0, None, "none", None),
    "attn-first-whole": ("attn", 1, None, "none", None),
    "mlp-kda": ("mlp", 0, ("kda",), "none", None),
    "layer-dsa-dense": ("layer", 0, ("dense", "dsa"), "none", None),
    "offload-all": (None, 0, None, "all", None),
    "offload-attn": (None, 0, None, "attn", None),
    "offload-mlp-dsa": (None, 0, None, "mlp", ("dsa",)),
    "layer+offload-all": ("layer", 0, None, "all", None),
    "mlp+offload-attn": ("mlp", 0, None, "attn", None),
    "attn+offload-mlp": ("attn", 0, None, "mlp", None),
    "attn+offload-attn": ("attn", 0, None, "attn", None),
    "layer-kda+offload-attn-dense-dsa": ("layer", 0, ("kda",), "attn", ("dense", "dsa")),
}


def _apply(model, policy):
    mode, full, rk, off, ok = policy
    if mode:
        recompute_layers(model, mode, full, rk)
    return offload_activations(model, off, ok)


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_policy_equals_no_recomputation_fp64(tiny4, reference, policy):
    """Two steps under the policy: each step's loss and every gradient equal no recomputation's, bit for bit (the
    same ops, recomputed in order; the same values copied out and back); every chosen layer offloaded something,
    no other layer anything."""
    cfg, make, batch = tiny4
    model = make()
    stats = _apply(model, policy)
    got = _steps(cfg, model, batch)
    for (l0, g0), (l1, g1) in zip(reference, got):
        assert torch.equal(l0, l1)
        assert g0.keys() == g1.keys() and len(g0) > 50
        for n in g0:
            assert torch.equal(g0[n], g1[n]), n
    _, _, _, off, ok = policy
    chosen = {i for i in range(cfg.num_hidden_layers) if off != "none" and (ok is None or layer_kind(cfg, i) in ok)}
    assert set(stats) == chosen
    assert all(s["tensors"] > 0 and s["bytes"] > 0 for s in stats.values()), stats


def test_recompute_modes_recompute_the_named_block_in_the_named_kinds(tiny4):
    """``attn`` runs each attention twice and each MLP once; kinds limit it to those layers; the first N layers
    recomputed whole run both twice."""
    cfg, make, batch = tiny4
    L = cfg.num_hidden_layers
    for mode, full, kinds, attn_twice, mlp_twice in (
        ("attn", 0, None, set(range(L)), set()),
        ("attn", 0, ("dsa",), {3}, set()),
        ("attn", 1, ("dsa",), {0, 3}, {0}),
        ("mlp", 0, ("kda", "dense"), set(), {0, 1, 2}),
    ):
        model = make()
        attn, mlp = [], []
        for i, layer in enumerate(model.model.layers):
            # pre-hooks: the recomputation stops early, once the backward's last saved tensor is made again
            layer.self_attn.register_forward_pre_hook(lambda m, a, i=i: attn.append(i))
            inner = getattr(layer, "mlp", None) or layer.block_sparse_moe
            inner.register_forward_pre_hook(lambda m, a, i=i: mlp.append(i))
        recompute_layers(model, mode, full, kinds)
        LMStage(cfg, None).loss(model, batch)[0].backward()
        assert {i for i in attn if attn.count(i) == 2} == attn_twice, (mode, kinds, attn)
        assert {i for i in mlp if mlp.count(i) == 2} == mlp_twice, (mode, kinds, mlp)
        assert sorted(set(attn)) == sorted(set(mlp)) == list(range(L))


def test_offload_takes_the_named_block_off_the_device(tiny4):
    """``saved_bytes_by_block`` (what autograd keeps on the device, per layer and block) with the attention
    offloaded in the DSA layer: that block keeps only small tensors, every other attention block keeps what it keeps
    without offload, to the byte, every MLP block too (a storage it shares with an offloaded attention now counts
    there); with the MLP recomputed, that block keeps its input alone."""
    cfg, make, batch = tiny4
    T, D = batch.input_ids.shape[1], cfg.hidden_size

    def measure(model):
        return saved_bytes_by_block(model, lambda: LMStage(cfg, None).loss(model, batch))

    base = measure(make())
    model = make()
    offload_activations(model, "attn", ("dsa",))
    recompute_layers(model, "mlp", 0, ("kda",))  # after the offload: its blocks are others, so the order is free
    got = measure(model)
    for i in range(cfg.num_hidden_layers):
        if i == 3:
            assert got[i]["attn"] <= TOL_LEFT * base[i]["attn"], (got[i], base[i])
        else:
            assert got[i]["attn"] == base[i]["attn"], i
        if i in (1, 2):  # recomputed: the checkpoint keeps its input, [1, T, D] fp64
            assert got[i]["mlp"] == T * D * 8, (got[i], base[i])
        else:  # a storage both blocks save counts where first seen: in the MLP once the attention's is offloaded
            assert base[i]["mlp"] <= got[i]["mlp"] <= base[i]["mlp"] + TOL_LEFT * base[i]["attn"], (i, got[i], base[i])
        assert base[i]["layer"] >= base[i]["attn"] + base[i]["mlp"] > 0


def test_what_does_not_compose_is_refused_in_one_line(tiny4):
    _, make, _ = tiny4
    model = make()
    recompute_layers(model, "mlp", 1)
    with pytest.raises(ValueError, match="--offload-activations: got attn on layer 0, which is recomputed whole"):
        offload_activations(model, "attn")
    offload_activations(make(), "mlp", ("dsa",))  # accepted
    with pytest.raises(ValueError, match="--recompute-mode: got 'moe'"):
        recompute_layers(make(), "moe")
    with pytest.raises(ValueError, match="--offload-activations: got 'host'"):
        offload_activations(make(), "host")
    base = dict(data=["x"], out="x", recompute=True)
    cases = [
        (dict(offload_activations="attn"), "--offload-activations: got attn with --recompute-mode layer on the same"),
        (dict(recompute=False, recompute_layers="kda"), "--recompute-layers: got 'kda' without --recompute"),
        (dict(recompute_layers="kda,moe"), "--recompute-layers: got 'kda,moe', expected kinds from"),
        (dict(offload_layers="dsa"), "--offload-layers: got 'dsa' with --offload-activations none"),
        (dict(offload_activations="mlp", recompute_mode="mlp", compile=True), "--offload-activations: got mlp with --compile"),
        (dict(recompute_full_layers=1), "--recompute-full-layers: got 1, expected it only with --recompute --recompute-mode mlp or attn"),
    ]  # fmt: skip
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            resolve(TrainArgs(**{**base, **kw}))
    a = resolve(TrainArgs(**base, recompute_layers="dsa, kda", offload_activations="all", offload_layers="dense"))
    assert (a.recompute_layers, a.offload_layers) == ("kda,dsa", "dense")  # the kinds' own order
    a = resolve(TrainArgs(**base, recompute_layers="kda", offload_activations="attn", offload_layers="dsa"))
    assert a.offload_activations == "attn"  # recomputed whole and offloaded: other layers, accepted


def test_kimi_train_runs_and_records_the_policy(tmp_path, capsys):
    """``kimi train`` with attention recomputation on the KDA layers and the MLP blocks offloaded: the losses of the
    plain run (fp32, the same ops), the policy in run.json and in the header."""
    from kimi_tools.common import DEFAULT_TEXT

    kw = dict(data=[str(DEFAULT_TEXT)], layers=4, steps=2, seq_len=32, eval_tokens=32, eval_every=0, warmup_steps=1,
              save=False, plot=False)  # fmt: skip
    plain = train(TrainArgs(out=str(tmp_path / "a"), quiet=True, **kw))
    policy = dict(recompute=True, recompute_mode="attn", recompute_layers="kda", offload_activations="mlp")
    run = train(TrainArgs(out=str(tmp_path / "b"), **policy, **kw))
    assert [r["loss"] for r in run.records] == [r["loss"] for r in plain.records]
    args = json.loads((tmp_path / "b" / "run.json").read_text())["args"]
    assert {k: args[k] for k in (*policy, "offload_layers")} == {**policy, "offload_layers": None}
    header = capsys.readouterr().out.splitlines()[0]
    assert "recompute (attn, kda layers), activations offloaded to the host (mlp)" in header, header


def test_train_args_spell_the_modes_of_activation_memory():
    """``kimi_tools.train.args`` spells the recompute / offload modes and layer kinds without importing torch; they
    are ``kernels_torch.activation_memory``'s."""
    from kernels_torch import activation_memory as am
    from kimi_tools.train import args

    assert args.RECOMPUTE_MODES == am.RECOMPUTE_MODES
    assert args.OFFLOAD_MODES == am.OFFLOAD_MODES
    assert args.LAYER_KINDS == am.LAYER_KINDS
