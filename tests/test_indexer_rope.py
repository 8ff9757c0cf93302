"""Issue 13, fault 7: the indexer's optional RoPE (``indexer_rope`` "half" / "interleaved", DeepSeek-V3.2 style: the
leading ``qk_rope_head_dim`` channels of q_I and k_I rotated by position within the document), in both twins.

Checked against a rotation written out by hand (one pair at a time, numpy fp64), JAX vs torch at fp32 and fp64 on the
Indexer and a DSA layer, and packed documents equal separate runs (positions restart). The cudnn path rotates in
``Indexer.projections`` before the cuDNN call (tests/gpu/test_gpu_hardening.py).

Mutations tried (each fails a test here): swapping the two styles' pairings; the sign of ``sin`` flipped; positions
not restarting per document; theta 1e4 -> 1e5 in one twin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import rel
from layer_weights import mla_params

import kernels_torch.indexer as ti
import kernels_torch.mla as tm
import reference_jax.indexer as ji
import reference_jax.mla as jm
from kimi.config import load_config
from reference_jax.params import to_tree

DSA = 3  # a DSA layer of the tiny preset
TOL_HAND_FP64 = 1e-12  # apply_rope vs the hand-written rotation
TOL_FP32 = 1e-5  # torch vs JAX, fp32
TOL_FP64 = 1e-10  # torch vs JAX, fp64
TOL_PACKED_FP64 = 1e-12  # packed vs separate documents
STYLES = ["half", "interleaved"]


def rope_by_hand(x: np.ndarray, pos: np.ndarray, R: int, style: str, theta: float = 10000.0) -> np.ndarray:
    """x [B, T, (H,) K]: pair by pair, as RoFormer eq. 15 and DeepSeek-V3.2's apply_rotary_emb write it."""
    out = x.copy()
    for t in range(x.shape[1]):
        for i in range(R // 2):
            ang = pos[t] * theta ** (-2.0 * i / R)
            a, b = (2 * i, 2 * i + 1) if style == "interleaved" else (i, i + R // 2)
            xa, xb = x[:, t, ..., a], x[:, t, ..., b]
            out[:, t, ..., a] = xa * np.cos(ang) - xb * np.sin(ang)
            out[:, t, ..., b] = xa * np.sin(ang) + xb * np.cos(ang)
    return out


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("shape", [(2, 7, 3, 12), (1, 9, 12)], ids=["q_I", "k_I"])
def test_apply_rope_matches_hand_rotation(style, shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape)
    pos = rope_pos = np.array([0, 1, 2, 3, 0, 1, 2, 3, 4][: shape[1]])  # two documents
    R = 8  # rotate 8 of 12 channels: the last 4 pass unchanged
    want = rope_by_hand(x, pos, R, style)
    with jax.enable_x64(True):
        got_j = np.asarray(ji.apply_rope(jnp.asarray(x), rope_pos, R, style))
    got_t = ti.apply_rope(torch.from_numpy(x), rope_pos, R, style).numpy()
    assert rel(got_j, want) <= TOL_HAND_FP64 and rel(got_t, want) <= TOL_HAND_FP64
    assert np.array_equal(got_t[..., R:], x[..., R:])
    # position 0 is the identity; a rotation keeps each pair's norm
    assert np.array_equal(got_t[:, 0], x[:, 0])
    np.testing.assert_allclose(np.linalg.norm(got_t, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)


def test_styles_differ_and_positions_restart():
    x = np.random.default_rng(1).standard_normal((1, 6, 8))
    h = ti.apply_rope(torch.from_numpy(x), np.arange(6), 8, "half")
    i = ti.apply_rope(torch.from_numpy(x), np.arange(6), 8, "interleaved")
    assert rel(h, i) > 1e-2
    assert ti.rope_positions(6, torch.tensor([0, 2, 6])).tolist() == [0, 1, 0, 1, 2, 3]
    assert ji.rope_positions(6, np.array([0, 2, 6])).tolist() == [0, 1, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="indexer_rope"):
        ti.apply_rope(torch.from_numpy(x), np.arange(6), 8, "neox")
    with pytest.raises(ValueError, match="rope_dim"):
        ji.apply_rope(jnp.asarray(x), np.arange(6), 10, "half")


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_indexer_torch_matches_jax(style, dtype):
    cfg = load_config("tiny").replace(indexer_rope=style)
    rng = np.random.default_rng(2)
    p = mla_params(cfg, DSA, rng, prefix="self_attn.indexer.")
    B, T = 2, 63
    x, c_q = rng.standard_normal((B, T, cfg.hidden_size)), rng.standard_normal((B, T, cfg.q_lora_rank))
    tdt, jdt, tol = (
        (torch.float64, jnp.float64, TOL_FP64) if dtype == "fp64" else (torch.float32, jnp.float32, TOL_FP32)
    )
    m = ti.Indexer(cfg).to(tdt)
    m.load_state_dict({k: torch.from_numpy(v) for k, v in p.items()})
    with torch.no_grad():
        idx_t, s_t = m(torch.from_numpy(x).to(tdt), torch.from_numpy(c_q).to(tdt))
    with jax.enable_x64(dtype == "fp64"):
        idx_j, s_j = jax.jit(ji.Indexer(cfg).apply)(
            {"params": to_tree(p, jdt)}, jnp.asarray(x, jdt), jnp.asarray(c_q, jdt)
        )
        s_j, idx_j = np.asarray(s_j), np.asarray(idx_j)
    assert rel(s_t, s_j) <= tol
    # the rotation is really on: the same weights without RoPE give other scores
    cfg0 = cfg.replace(indexer_rope="none")
    m0 = ti.Indexer(cfg0).to(tdt)
    m0.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert rel(m0(torch.from_numpy(x).to(tdt), torch.from_numpy(c_q).to(tdt))[1], s_t) > 1e-2
    if dtype == "fp64":  # selections agree index for index when the scores agree to 1e-10
        assert np.array_equal(idx_t.numpy(), idx_j)


@pytest.mark.parametrize("style", STYLES)
def test_indexer_packed_equals_separate_fp64(style):
    """Positions restart at every packed document: packed scores equal each document run alone."""
    cfg = load_config("tiny").replace(indexer_rope=style)
    rng = np.random.default_rng(3)
    p = mla_params(cfg, DSA, rng, prefix="self_attn.indexer.")
    cu = [0, 5, 17, 30]
    x, c_q = rng.standard_normal((1, 30, cfg.hidden_size)), rng.standard_normal((1, 30, cfg.q_lora_rank))
    m = ti.Indexer(cfg).double()
    m.load_state_dict({k: torch.from_numpy(v) for k, v in p.items()})
    with torch.no_grad():
        _, s = m(torch.from_numpy(x), torch.from_numpy(c_q), cu_seqlens=torch.tensor(cu))
        for a, b in zip(cu[:-1], cu[1:]):
            _, s_doc = m(torch.from_numpy(x[:, a:b]), torch.from_numpy(c_q[:, a:b]))
            assert rel(s[:, a:b, a:b], s_doc) <= TOL_PACKED_FP64


@pytest.mark.parametrize("style", STYLES)
def test_dsa_layer_with_rope_torch_matches_jax(style):
    """A DSA layer at T = 100 > index_topk = 64 (the selection matters) with RoPE in the indexer, fp64."""
    cfg = load_config("tiny").replace(indexer_rope=style)
    rng = np.random.default_rng(4)
    p = mla_params(cfg, DSA, rng)
    x = rng.standard_normal((1, 100, cfg.hidden_size))
    m = tm.GatedMLA(cfg, DSA).double()
    m.load_state_dict({k: torch.from_numpy(v) for k, v in p.items()})
    with torch.no_grad():
        out_t, aux_t = m(torch.from_numpy(x), return_aux=True)
    with jax.enable_x64(True):
        layer = jm.GatedMLA(cfg, DSA)
        out_j, aux_j = jax.jit(lambda t, xx: layer.apply(t, xx, return_aux=True))(
            {"params": to_tree(p, jnp.float64)}, jnp.asarray(x)
        )
        out_j, idx_j = np.asarray(out_j), np.asarray(aux_j["topk_indices"])
    assert np.array_equal(aux_t["topk_indices"].numpy(), idx_j)
    assert rel(out_t, out_j) <= TOL_FP64
