"""LoRA (kimi_tools.lora): peft's format and peft itself, no path that skips an adapter, merged == unmerged,
refusals, and ``kimi lora merge`` read by the JAX reference.

All adapters here have a non-zero B (peft's ``init_lora_weights=False`` style) and the inputs are fresh random ids.
The model is the tiny preset cut to 2 layers, a KDA layer (dense MLP) and a DSA layer (latent MoE), so every
projection kind is present at a third of the 4-layer cost.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from helpers import rel

from kernels_torch.loss import lm_loss
from kernels_torch.model import KimiK3Model, load_model
from kimi.config import load_config
from kimi_tools.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    DEFAULT_TARGETS,
    LoraSettings,
    adapters_without_gradient,
    apply_lora,
    check_lora_supported,
    load_adapter,
    lora_modules,
    merge_lora,
    save_adapter,
)

# fp64 models: merged and unmerged differ only by the order of the rounding of W + s B A vs x W^T + s x A^T B^T.
MERGE_OUT_REL = 1e-10  # logits, merged vs unmerged
MERGE_GRAD_REL = 1e-8  # dL/dW (unmerged base weight) vs dL/dW' (merged weight); dL/dA, dL/dB vs their closed forms
PEFT_OUT_REL = 0.0  # peft's PeftModel on our adapter runs the same layers: bitwise equal
MERGED_CKPT_REL = 2e-2  # JAX on the merged bf16 checkpoint vs the unmerged fp32 torch model (bf16 rounding of W')
MERGED_CKPT_SAME_REL = 1e-4  # JAX vs torch, both on the merged checkpoint (fp32)

T = 37  # awkward length; two packed documents
CU = torch.tensor([0, 13, T])


def _two_layers():
    return load_config("tiny").replace(num_hidden_layers=2, kda_layers=(0,), mla_layers=(1,), dsa_layers=(1,))


@pytest.fixture(scope="module")
def cfg():
    return _two_layers()


def _model(cfg, backend="eager", seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return KimiK3Model(cfg, backend=backend).to(dtype)


def _randomise_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_modules(model).values():
            for w in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float64).to(w.dtype) * 0.2)


def _ids(cfg, seed=2, n=T):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (1, n), generator=g)


def test_defaults_wrap_mla_and_kda_projections_only(cfg):
    model = _model(cfg)
    names = apply_lora(model, LoraSettings(rank=4, alpha=8.0))
    leaves = {n.rsplit(".", 1)[1] for n in names}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}
    assert "model.layers.1.self_attn.kv_b_proj" in names
    assert not any(".indexer." in n for n in names)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(names)
    layer = lora_modules(model)["model.layers.1.self_attn.kv_b_proj"]
    assert layer.lora_A["default"].weight.shape == (4, cfg.kv_lora_rank)  # [r, in]
    assert layer.lora_B["default"].weight.shape == (layer.base_layer.out_features, 4)  # [out, r]
    assert torch.all(layer.lora_B["default"].weight == 0)  # B starts at zero: the wrapped model is the base model
    assert layer.scaling["default"] == 2.0
    rs = _model(cfg)
    apply_lora(rs, LoraSettings(rank=4, alpha=8.0, use_rslora=True))
    assert lora_modules(rs)["model.layers.1.self_attn.kv_b_proj"].scaling["default"] == pytest.approx(8.0 / 2.0)


@pytest.mark.parametrize(
    "backend,form", [("eager", "expanded"), ("eager", "absorbed"), ("sdpa", "expanded"), ("sdpa", "absorbed")]
)
def test_merged_equals_unmerged_and_no_adapter_is_skipped(cfg, backend, form):
    """Outputs and gradients: the LoRA model (W frozen + s B A) vs the merged model (W' = W + s B A), fp64.

    Every adapter must receive a non-zero gradient (an adapter that some path skips would get none: the vLLM bug)
    and change the output; dL/dW of the unmerged base weight equals dL/dW' of the merged one; dL/dB = s G Aᵀ and
    dL/dA = s Bᵀ G with G = dL/dW' (the chain rule through W' = W + s B A)."""
    model = _model(cfg, backend)
    ids = _ids(cfg)
    with torch.no_grad():
        base = model(ids, cu_seqlens=CU, mla_form=form)
    names = apply_lora(model, LoraSettings(rank=3, alpha=5.0, targets=DEFAULT_TARGETS + ("g_proj",)))
    _randomise_adapters(model)
    for p in model.parameters():
        p.requires_grad_(True)  # the base weights too, to compare dL/dW with the merged model's
    out = model(ids, cu_seqlens=CU, mla_form=form)
    lm_loss(out, ids, CU).backward()
    assert rel(out.detach(), base) > 1e-2  # the adapters change the output

    layers = lora_modules(model)
    assert adapters_without_gradient(model) == []
    for name, layer in layers.items():
        for w in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
            assert w.grad is not None and w.grad.abs().max() > 0, f"{name}: the adapter gets no gradient (skipped)"

    merged = copy.deepcopy(model)
    for p in merged.parameters():
        p.grad = None
    assert sorted(merge_lora(merged)) == sorted(names)
    assert not lora_modules(merged)
    assert set(merged.state_dict()) == set(_model(cfg).state_dict())  # canonical names again
    for p in merged.parameters():
        p.requires_grad_(True)
    out_m = merged(ids, cu_seqlens=CU, mla_form=form)
    lm_loss(out_m, ids, CU).backward()
    assert rel(out.detach(), out_m.detach()) <= MERGE_OUT_REL

    grads_m = {n: p.grad for n, p in merged.named_parameters()}
    for n, p in model.named_parameters():
        if ".lora_" in n:
            continue
        key = n.replace(".base_layer.", ".")
        assert (p.grad is None) == (grads_m[key] is None), key
        if p.grad is not None:
            assert rel(p.grad, grads_m[key]) <= MERGE_GRAD_REL, key
    for name, layer in layers.items():
        G = grads_m[name + ".weight"]  # [out, in]
        A, B, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
        assert rel(B.grad, s * G @ A.detach().T) <= MERGE_GRAD_REL, name
        assert rel(A.grad, s * B.detach().T @ G) <= MERGE_GRAD_REL, name


def test_peft_loads_our_adapter_and_we_load_peft_s(cfg, tmp_path):
    """Our file is peft's format: exactly two files, peft's key names and shapes; ``PeftModel.from_pretrained`` on
    the eager module tree gives our outputs. Conversely an adapter made by peft's ``get_peft_model`` (random B,
    ``init_lora_weights=False``) and saved by peft loads through :func:`load_adapter` with peft's outputs."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    settings = LoraSettings(rank=4, alpha=16.0, use_rslora=True)
    ours = _model(cfg, dtype=torch.float32)
    names = apply_lora(ours, settings)
    _randomise_adapters(ours)
    ids = _ids(cfg, seed=5)
    with torch.no_grad():
        expect = ours(ids, cu_seqlens=CU)
    save_adapter(ours, settings, tmp_path / "a", base_checkpoint="some/base")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    sd = load_file(str(tmp_path / "a" / ADAPTER_WEIGHTS))
    assert set(sd) == {f"base_model.model.{n}.lora_{x}.weight" for n in names for x in "AB"}
    kvb = "base_model.model.model.layers.1.self_attn.kv_b_proj"
    assert sd[kvb + ".lora_A.weight"].shape == (4, cfg.kv_lora_rank)
    assert sd[kvb + ".lora_B.weight"].shape == (cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), 4)
    conf = json.loads((tmp_path / "a" / ADAPTER_CONFIG).read_text())
    assert (conf["peft_type"], conf["r"], conf["lora_alpha"], conf["use_rslora"]) == ("LORA", 4, 16.0, True)
    assert conf["base_model_name_or_path"] == "some/base"

    peft_model = PeftModel.from_pretrained(_model(cfg, dtype=torch.float32), str(tmp_path / "a"))
    with torch.no_grad():
        assert rel(peft_model(ids, cu_seqlens=CU), expect) <= PEFT_OUT_REL

    theirs = get_peft_model(
        _model(cfg, dtype=torch.float32),
        LoraConfig(r=2, lora_alpha=3.0, target_modules=["kv_b_proj", "o_proj"], init_lora_weights=False),
    )
    theirs.save_pretrained(str(tmp_path / "b"))
    with torch.no_grad():
        expect_b = theirs(ids, cu_seqlens=CU)
    mine = _model(cfg, dtype=torch.float32)
    load_adapter(mine, tmp_path / "b")
    with torch.no_grad():
        assert rel(mine(ids, cu_seqlens=CU), expect_b) <= PEFT_OUT_REL


def test_refusals(cfg, tmp_path):
    ok = LoraSettings(rank=2, alpha=2.0)
    for backend in ("eager", "sdpa", "cudnn"):
        check_lora_supported(ok, backend)
    with pytest.raises(ValueError, match="dropout.*kv_b_proj.*absorbed"):
        check_lora_supported(LoraSettings(rank=2, alpha=2.0, dropout=0.1), "cudnn")
    check_lora_supported(LoraSettings(2, 2.0, dropout=0.1, targets=("o_proj", "q_b_proj")), "cudnn")  # no kv_b_proj
    with pytest.raises(ValueError, match="DoRA"):
        check_lora_supported(LoraSettings(rank=2, alpha=2.0, use_dora=True), "eager")
    for bad, match in (
        (LoraSettings(0, 2.0), "rank"),
        (LoraSettings(2, 0.0), "alpha"),
        (LoraSettings(2, 2.0, dropout=1.0), "dropout"),
        (LoraSettings(2, 2.0, targets=()), "targets"),
        (LoraSettings(2, 2.0, targets=("o_proj[",)), "regular expression"),
    ):
        with pytest.raises(ValueError, match=match):
            check_lora_supported(bad, "eager")
    for targets, match in (
        (("wq_b",), "indexer"),
        ((r".*\.indexer\..*",), "indexer"),
        ((r".*_proj",), "indexer|reads directly"),
        (("lm_head",), "reads directly"),
        (("self_attention_res_proj",), "reads directly"),
        (("w1",), "routed experts"),
        ((r".*experts\.w2",), "routed experts"),
        (("gate",), "nn.Linear"),
        (("q_prj",), "matches no module"),
    ):
        with pytest.raises(ValueError, match=match):
            apply_lora(_model(cfg), LoraSettings(2, 2.0, targets=targets))
    # dropout on kv_b_proj used in absorbed form by eager/sdpa: a clear error at forward time in training mode
    model = _model(cfg)
    apply_lora(model, LoraSettings(2, 2.0, dropout=0.1, targets=("kv_b_proj",)))
    with pytest.raises(RuntimeError, match="dropout.*absorbed"):
        model(_ids(cfg), mla_form="absorbed")
    model.eval()
    model(_ids(cfg), mla_form="absorbed")  # no dropout in eval mode: fine
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoraSettings(2, 2.0))
    # a DoRA adapter file is refused on load
    save_adapter(model, LoraSettings(2, 2.0), tmp_path / "d")
    conf = json.loads((tmp_path / "d" / ADAPTER_CONFIG).read_text())
    (tmp_path / "d" / ADAPTER_CONFIG).write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        load_adapter(_model(cfg), tmp_path / "d")
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_adapter(_model(cfg), tmp_path / "missing")


def test_lora_merge_cli_gives_a_checkpoint_the_reference_loads(cfg, tmp_path, capsys):
    """``kimi lora merge`` -> a plain checkpoint; the JAX reference on it gives the unmerged torch model's logits."""
    import jax

    from kimi.init import init_checkpoint
    from kimi_tools.cli import main
    from reference_jax.model import load_model as load_jax

    init_checkpoint(tmp_path / "base", _two_layers(), seed=3)
    settings = LoraSettings(rank=4, alpha=4.0, targets=DEFAULT_TARGETS + ("g_proj",))
    model = load_model(tmp_path / "base", dtype=torch.float32)
    apply_lora(model, settings)
    _randomise_adapters(model, seed=7)
    save_adapter(model, settings, tmp_path / "adapter", base_checkpoint=tmp_path / "base")
    ids = _ids(model.config, seed=9, n=29)
    with torch.no_grad():
        unmerged = model(ids).double()

    args = ["lora", "merge", "--checkpoint", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter")]
    assert main(args + ["--out", str(tmp_path / "merged")]) == 0
    assert main(args + ["--out", str(tmp_path / "merged")]) == 2  # not empty: refused, nothing touched
    bad = ["lora", "merge", "--checkpoint", str(tmp_path / "base"), "--adapter", str(tmp_path / "nowhere")]
    assert main(bad + ["--out", str(tmp_path / "m2")]) == 2 and not (tmp_path / "m2").exists()
    assert "kimi: error: adapter: no adapter_config.json" in capsys.readouterr().err
    jm, tree, _ = load_jax(tmp_path / "merged")
    with jax.default_matmul_precision("highest"):
        ref = torch.from_numpy(np.asarray(jm.apply({"params": tree}, ids.numpy()), np.float64))
    with torch.no_grad():
        merged_torch = load_model(tmp_path / "merged", dtype=torch.float32)(ids).double()
    assert rel(ref, merged_torch) <= MERGED_CKPT_SAME_REL
    assert rel(ref, unmerged) <= MERGED_CKPT_REL
    base_logits = load_model(tmp_path / "base", dtype=torch.float32)(ids).detach().double()
    assert rel(base_logits, unmerged) > 10 * MERGED_CKPT_REL  # the adapter's effect is far above the bf16 rounding


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_lora_on_the_generation_cache_path(cfg, form):
    """Cached prefill + decode with adapters (the absorbed decode reads kv_b_proj through effective_weight) gives
    the cache-free LoRA logits; the adapters change them."""
    from kernels_torch import cache as tcache

    model = _model(cfg)
    ids = _ids(cfg, seed=12, n=24)
    with torch.no_grad():
        base = model(ids, mla_form=form)
    apply_lora(model, LoraSettings(rank=2, alpha=4.0))
    _randomise_adapters(model, seed=13)
    with torch.no_grad():
        free = model(ids, mla_form=form)
        logits, cache, _ = tcache.prefill(model, ids[:, :17], tcache.init_cache(model.config, 1, 24, torch.float64))
        steps = [logits]
        for t in range(17, 24):
            step, cache = model.step(ids[:, t : t + 1], cache, mla_form=form)
            steps.append(step)
    assert rel(torch.cat(steps, dim=1), free) <= MERGE_OUT_REL * 100
    assert rel(free, base) > 1e-2


def test_merge_refuses_to_write_over_its_inputs(tmp_path, capsys):
    """--out equal to --checkpoint (or --adapter) is refused even with --force: the base would be overwritten."""
    from kimi_tools.cli import main

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    for d in (base, adapter):
        d.mkdir()
        (d / "keep.txt").write_text("x")
    for out in (base, adapter, tmp_path / "base" / ".." / "base"):
        args = ["lora", "merge", "--checkpoint", str(base), "--adapter", str(adapter), "--out", str(out), "--force"]
        assert main(args) == 2
        assert "write the merged checkpoint to another folder" in capsys.readouterr().err
    assert (base / "keep.txt").read_text() == "x"


def test_adapter_of_another_rank_or_model_names_the_tensor_and_shapes(cfg, tmp_path, capsys):
    """An adapter_config.json whose r is not the tensors' rank, or an adapter of a model with other sizes, is refused
    with one line naming the tensor, its shape and the model's (torch's error said only 'Error(s) in loading')."""
    import shutil

    from kimi.init import init_checkpoint
    from kimi_tools.cli import main

    settings = LoraSettings(rank=2, alpha=2.0)
    init_checkpoint(tmp_path / "base", cfg, seed=0)
    model = load_model(tmp_path / "base", dtype=torch.float32)
    apply_lora(model, settings)
    save_adapter(model, settings, tmp_path / "r2")
    shutil.copytree(tmp_path / "r2", tmp_path / "r4")
    conf = json.loads((tmp_path / "r4" / ADAPTER_CONFIG).read_text())
    (tmp_path / "r4" / ADAPTER_CONFIG).write_text(json.dumps({**conf, "r": 4}))  # the tensors stay rank 2
    rank_msg = (
        r"tensor 'base_model\.model\.model\.layers\.0\.\S+\.lora_A\.weight' has shape \[2, 96\], expected \[4, 96\] "
        r"\(lora_A \[r, in\]; adapter_config\.json says r=4 but the tensors have rank 2\)"
    )
    fresh = _model(cfg, dtype=torch.float32)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=rank_msg):
        load_adapter(fresh, tmp_path / "r4")
    after = fresh.state_dict()  # the refusal left the model as it was: no adapters, the same tensors
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    load_adapter(fresh, tmp_path / "r2")  # so a retry with the right adapter works
    args = ["lora", "merge", "--checkpoint", str(tmp_path / "base"), "--adapter", str(tmp_path / "r4")]
    assert main([*args, "--out", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kimi: error: adapter: ") and "has shape [2, 96]" in err[0], err
    assert not (tmp_path / "merged").exists()

    other = _model(cfg.replace(kv_lora_rank=16), dtype=torch.float32)  # another model: a narrower MLA latent
    apply_lora(other, settings)
    save_adapter(other, settings, tmp_path / "other")
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa\.lora_B\.weight' has shape \[24, 2\], expected \[40, 2\] "
                       r"\(lora_B \[out, r\]; an adapter trained for a model with other layer sizes\)"):  # fmt: skip
        load_adapter(_model(cfg, dtype=torch.float32), tmp_path / "other")


def test_merge_scale_follows_rslora(cfg):
    """rsLoRA scales the update by alpha / sqrt(r), not alpha / r: the merge (which reads ``LoraSettings.scale``)
    gives the unmerged model's logits for both rules (r = 4, so the two scales differ by 2x)."""
    ids = _ids(cfg, seed=5)
    for rslora in (False, True):
        model = _model(cfg)
        apply_lora(model, LoraSettings(rank=4, alpha=3.0, use_rslora=rslora))
        _randomise_adapters(model, seed=6)
        s = next(iter(lora_modules(model).values())).scaling["default"]
        assert s == pytest.approx(3.0 / (2.0 if rslora else 4.0))  # peft's forward scale
        assert LoraSettings(rank=4, alpha=3.0, use_rslora=rslora).scale == pytest.approx(s)
        with torch.no_grad():
            unmerged = model(ids, cu_seqlens=CU)
            merge_lora(model)
            merged = model(ids, cu_seqlens=CU)
        assert rel(merged, unmerged) <= MERGE_OUT_REL, rslora


def test_merge_on_a_bf16_model_adds_in_fp32_and_rounds_once(cfg):
    """A bf16 base: each merged weight is bf16(fp32(W) + fp32(s B A)) exactly, the contract ``kimi lora merge`` meets
    by loading in fp32; adding in bf16 (round W + round(s B A)) differs in some elements, which this checks too."""
    model = _model(cfg, dtype=torch.bfloat16)
    settings = LoraSettings(rank=4, alpha=8.0)
    apply_lora(model, settings)
    _randomise_adapters(model, seed=8)
    want, bf16_add = {}, 0
    for name, layer in lora_modules(model).items():
        W = layer.get_base_layer().weight
        A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        assert W.dtype == A.dtype == B.dtype == torch.bfloat16
        want[name] = (W.float() + (B.float() @ A.float()) * settings.scale).to(torch.bfloat16)
        bf16_add += int((W + (B @ A) * settings.scale != want[name]).sum())
    assert bf16_add > 0  # the two roundings differ somewhere on these sizes: the check below can fail
    merge_lora(model)
    for name, w in want.items():
        got = model.get_submodule(name).weight
        assert got.dtype == torch.bfloat16 and torch.equal(got, w), name


def test_merge_refuses_another_base_unless_forced(cfg, tmp_path, capsys):
    """The adapter records its base's fingerprint (safetensors metadata, beside peft's "format"); ``kimi lora merge``
    onto another base of the same shapes (another init seed) is refused with one line naming --force-base, and
    merges with it. The adapter files are written 0644 like every other file (safetensors' own writer makes 0600)."""
    import os
    import stat

    from kimi.init import init_checkpoint
    from kimi_tools.cli import main
    from kimi_tools.lora import adapter_base_fingerprint, base_fingerprint

    init_checkpoint(tmp_path / "base", cfg, seed=0)
    init_checkpoint(tmp_path / "other", cfg, seed=7)
    fp = base_fingerprint(tmp_path / "base")
    assert fp.startswith("sha256:") and fp == base_fingerprint(tmp_path / "base")
    assert base_fingerprint(tmp_path / "other") != fp  # same config and shapes, other values
    settings = LoraSettings(rank=2, alpha=4.0)
    model = load_model(tmp_path / "base", dtype=torch.float32)
    apply_lora(model, settings)
    _randomise_adapters(model, seed=3)
    old = os.umask(0o022)
    try:
        save_adapter(model, settings, tmp_path / "adapter", base_checkpoint=tmp_path / "base", base_fingerprint=fp)
    finally:
        os.umask(old)
    for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        assert stat.S_IMODE((tmp_path / "adapter" / f).stat().st_mode) == 0o644, f
    assert adapter_base_fingerprint(tmp_path / "adapter") == fp
    args = ["lora", "merge", "--adapter", str(tmp_path / "adapter")]
    assert main([*args, "--checkpoint", str(tmp_path / "other"), "--out", str(tmp_path / "m1")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not the base" in err[0] and "--force-base" in err[0], err
    assert not (tmp_path / "m1").exists()
    assert main([*args, "--checkpoint", str(tmp_path / "other"), "--out", str(tmp_path / "m1"), "--force-base"]) == 0
    assert "differs from the adapter's (--force-base)" in capsys.readouterr().out
    assert main([*args, "--checkpoint", str(tmp_path / "base"), "--out", str(tmp_path / "m2")]) == 0


def test_an_adapter_folder_as_checkpoint_says_to_merge_in_every_command(tmp_path, capsys):
    """A LoRA adapter folder passed as ``--checkpoint`` (to compare, train, ablate, logits, forward, info, and
    as the base of lora merge): one line saying it is an adapter and giving the merge command with the recorded base
    (``kimi_tools.common.refuse_adapter_folder``), not "config.json: no file"."""
    from kimi_tools.cli import main
    from kimi_tools.common import DEFAULT_TEXT

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/ckpts/base"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    a = str(adapter)
    argvs = {
        "compare": ["compare", "--checkpoint", a, "--tokens", "8", "--backends", "eager", "--quiet"],
        "train": ["train", "--checkpoint", a, "--data", str(DEFAULT_TEXT), "--out", str(tmp_path / "run")],
        "ablate": ["ablate", "--checkpoint", a, "--set", "index_topk=8", "--out", str(tmp_path / "ab")],
        "logits": ["logits", "--checkpoint", a, "--text", str(DEFAULT_TEXT), "--out", str(tmp_path / "l.st")],
        "forward": ["forward", "--checkpoint", a],
        "info": ["info", "--checkpoint", a],
        "lora": ["lora", "merge", "--checkpoint", a, "--adapter", a, "--out", str(tmp_path / "m")],
    }
    for name, argv in argvs.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--checkpoint: {a} is a LoRA adapter folder" in err[0], (name, err)
        assert f"kimi lora merge --checkpoint /ckpts/base --adapter {a} --out MERGED" in err[0], (name, err)
        assert "no file" not in err[0], (name, err)
    assert not (tmp_path / "run").exists() and not (tmp_path / "ab").exists()


@pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("torchao") is None, reason="torchao is not installed: nothing to hush"
)
def test_lora_and_merge_runs_print_no_torchao_noise(tmp_path):
    """peft imports transformers, which imports torchao when installed: on a CPU that printed "Failed to load
    ..._C_mxfp8...so" and pytree deprecation lines in every LoRA and merge run. A fresh process trains a LoRA
    adapter and merges it: its stderr holds none of them."""
    import os
    import subprocess
    import sys

    from kimi_tools.common import DEFAULT_TEXT

    script = f"""
from kimi.config import load_config
from kimi.init import init_checkpoint
from kimi_tools.cli import main
init_checkpoint({str(tmp_path / "base")!r}, load_config("tiny").truncated(1), seed=0)
assert main(["train", "--checkpoint", {str(tmp_path / "base")!r}, "--data", {str(DEFAULT_TEXT)!r}, "--lora-rank", "2",
             "--steps", "1", "--seq-len", "16", "--eval-tokens", "16", "--quiet", "--no-plot",
             "--out", {str(tmp_path / "ad")!r}]) == 0
assert main(["lora", "merge", "--checkpoint", {str(tmp_path / "base")!r}, "--adapter", {str(tmp_path / "ad")!r},
             "--out", {str(tmp_path / "merged")!r}]) == 0
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Failed to load" not in res.stderr and "_pytree" not in res.stderr, res.stderr[-3000:]
    assert "is an Enum subclass" not in res.stderr, res.stderr[-3000:]


def test_base_fingerprint_sees_the_config_and_every_stored_byte(cfg, tmp_path):
    """The base fingerprint changes when config.json's ``routed_scaling_factor`` is edited, and when one byte of the
    largest tensor changes: at the start of its last row (first dimension), or in its middle."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from kimi.checkpoint import CheckpointReader
    from kimi.init import init_checkpoint
    from kimi_tools.lora import base_fingerprint

    init_checkpoint(tmp_path / "base", cfg, seed=0)
    fp = base_fingerprint(tmp_path / "base")

    edited = tmp_path / "config_edit"
    shutil.copytree(tmp_path / "base", edited)
    conf = json.loads((edited / "config.json").read_text())
    section = conf.get("text_config", conf)
    assert "routed_scaling_factor" in section
    section["routed_scaling_factor"] = float(section["routed_scaling_factor"]) * 1.5 + 0.5
    (edited / "config.json").write_text(json.dumps(conf))
    assert base_fingerprint(edited) != fp

    reader = CheckpointReader(tmp_path / "base")
    name = max(reader.keys(), key=lambda n: reader.get_array(n).size)
    file, prefix = reader.file_of(name), reader.config.key_prefix
    with safe_open(str(reader.path / file), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    t = tensors[prefix + name]
    assert t.ndim >= 2 and t[-1].numel() > 64, (name, tuple(t.shape))
    raw = t.reshape(-1).view(torch.uint8)
    for where, byte in [("last row", raw.numel() - t[-1].numel() * t.element_size()), ("middle", raw.numel() // 2)]:
        other = tmp_path / where.replace(" ", "_")
        shutil.copytree(tmp_path / "base", other)
        changed = raw.clone()
        changed[byte] ^= 1
        save_file({**tensors, prefix + name: changed.view(t.dtype).reshape(t.shape)}, other / file, metadata=meta)
        assert base_fingerprint(other) != fp, (where, name)
