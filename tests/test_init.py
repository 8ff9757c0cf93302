"""Random initialisation: determinism per seed and per tensor name, layer-prefix consistency, healthy values,
MXFP4-exact experts, and random checkpoints that reload bit for bit."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch

from kimi.checkpoint import CheckpointReader, load_params
from kimi.config import load_config
from kimi.init import init_checkpoint, init_params
from kimi.layout import layer_of, param_layout
from kimi.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


@pytest.fixture(scope="module")
def cfg():
    return load_config("tiny")


@pytest.fixture(scope="module")
def full(cfg):
    return init_params(cfg, seed=0)


def test_layout_and_finite(cfg, full):
    specs = param_layout(cfg)
    assert list(full) == [s.name for s in specs]
    for s in specs:
        t = full[s.name]
        assert tuple(t.shape) == s.shape and str(t.dtype) == f"torch.{s.dtype}", s.name
        assert bool(torch.isfinite(t).all()), s.name
        assert t.float().std() > 0 or t.numel() == 1, f"{s.name} is constant"


def test_deterministic_and_seed_dependent(cfg, full):
    again = init_params(cfg, seed=0)
    assert all(_same(full[k], again[k]) for k in full)
    other = init_params(cfg, seed=1)
    assert all(not torch.equal(full[k], other[k]) for k in full)


@pytest.mark.parametrize("layers", [3, [5], [0, 8]], ids=["first-3", "only-5", "0-and-8"])
def test_layer_subsets_match_full_model(cfg, full, layers):
    part = init_params(cfg, seed=0, layers=layers)
    want = set(range(layers)) if isinstance(layers, int) else set(layers)
    assert {layer_of(k) for k in part} == want | {None}
    assert all(_same(t, full[k]) for k, t in part.items())


def test_healthy_scales(cfg, full):
    D, L = cfg.hidden_size, cfg.num_hidden_layers
    q = full["model.layers.0.self_attn.q_proj.weight"].float()
    assert abs(q.std().item() * math.sqrt(D) - 1) < 0.1
    o = full["model.layers.0.self_attn.o_proj.weight"].float()
    fan_in = o.shape[1]
    assert abs(o.std().item() * math.sqrt(fan_in * 2 * L) - 1) < 0.15
    for k, t in full.items():
        if k.endswith("norm.weight"):
            assert abs(t.float().mean().item() - 1) < 0.05 and not torch.all(t == 1), k
        if k.endswith(".A_log"):
            assert t.shape == (cfg.kda_num_heads,) and bool(((t >= 0) & (t <= math.log(16))).all()), k
        if k.endswith("_res_proj.weight"):
            assert t.shape == (1, D) and 0 < t.float().abs().max().item() < 1.0, k
        if k.endswith("e_score_correction_bias"):
            assert t.dtype == torch.float32 and t.abs().max().item() < 0.1, k
    # AttnRes depth logits ~ res_proj . RMSNorm(x): std around 1 for unit-RMS inputs (not uniform, not saturated)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, D, generator=g)
    s = x @ full["model.layers.4.self_attention_res_proj.weight"].float().T
    assert 0.5 < s.std().item() < 2.0


def test_experts_exactly_mxfp4(cfg, full):
    experts = [k for k in full if ".experts." in k]
    assert experts
    for k in experts:
        w = full[k]
        assert w.dtype == torch.bfloat16
        assert _same(dequantize_mxfp4(*quantize_mxfp4(w), dtype=w.dtype), w), k


def test_init_checkpoint_full_reloads_exactly(tmp_path, cfg, full):
    out = init_checkpoint(tmp_path, cfg, seed=0, max_shard_bytes=200_000)
    assert out == cfg
    assert sum(f.endswith(".safetensors") for f in os.listdir(tmp_path)) > 1
    got = load_params(tmp_path)
    assert list(got) == list(full) and all(_same(got[k], full[k]) for k in full)


def test_init_checkpoint_truncated(tmp_path, cfg, full):
    out = init_checkpoint(tmp_path, cfg, seed=0, layers=4)
    r = CheckpointReader(tmp_path)
    assert out.num_hidden_layers == 4 and r.config == cfg.truncated(4)
    got = load_params(r)
    assert {layer_of(k) for k in got} == {None, 0, 1, 2, 3}
    assert all(_same(t, full[k]) for k, t in got.items())


def test_init_checkpoint_refuses_an_existing_checkpoint_unless_forced(tmp_path, cfg):
    """From Python as from ``kimi init``: a folder that already holds a checkpoint is refused (named, nothing
    written), so trained weights are not replaced by random ones; ``force=True`` replaces it; a folder without
    checkpoint files (absent, empty, or holding other files) is written."""
    small = cfg.truncated(2)
    out = tmp_path / "ck"
    init_checkpoint(out, small, seed=0)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    with pytest.raises(FileExistsError, match=rf"^{re.escape(str(out))}: already holds a checkpoint \(config.json, "):
        init_checkpoint(out, small, seed=1)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert init_checkpoint(out, small, seed=1, force=True) == small
    after = {f.name: f.read_bytes() for f in out.iterdir()}
    assert after.keys() == before.keys() and after != before  # seed 1's weights
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    init_checkpoint(other, small, seed=0)
    assert (other / "notes.txt").read_text() == "mine"
    assert {f.name: f.read_bytes() for f in other.iterdir() if f.name != "notes.txt"} == before


def test_kimi_init_force_replaces_a_checkpoint(tmp_path, capsys):
    """``kimi init`` onto a checkpoint: refused in one line without ``--force``, replaced with it."""
    from kimi_tools.cli import main

    argv = ["init", "--preset", "tiny", "--layers", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert main([*argv, "--seed", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--force" in err[0], err
    assert main([*argv, "--seed", "1", "--force"]) == 0
