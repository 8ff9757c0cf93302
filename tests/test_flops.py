"""kimi.flops.estimate_flops against a count by hand of the tiny presets (every term written out)."""

import pytest

from kimi.config import load_config
from kimi.flops import estimate_flops

REL = 1e-12  # both sides are exact float sums of integers


def _keys(T, window=None):
    """Mean causal keys per query, summed by brute force over positions t = 1..T."""
    return sum(t if window is None else min(t, window) for t in range(1, T + 1)) / T


def _tiny_by_hand(T):
    # tiny: D 96, vocab 512 (lm_head untied), 6 KDA layers (H 4, K = V 16, gate rank 16, full-rank output gate,
    # conv width 4), 3 DSA layers (H 4, q rank 48, kv rank 32, nope 16, rope 8, v 16, indexer 4 x 16, top-k 64),
    # layer 0 dense MLP (192), 8 latent-MoE layers (8 experts, 2 per token, I 32, latent 64, 2 shared of 32).
    kda = 3 * 64 * 96 + 16 * 96 + 64 * 16 + 4 * 96 + 64 * 96 + 96 * 64
    dsa = 48 * 96 + 4 * 24 * 48 + 40 * 96 + 4 * 32 * 32 + 4 * 16 * 96 + 96 * 64
    indexer_params = 3 * (4 * 16 * 48 + 16 * 96 + 4 * 96)  # wq_b, wk, weights_proj
    dense_mlp = 3 * 192 * 96
    moe = 8 * 96 + 64 * 96 + 96 * 64 + 3 * 64 * 96 + 8 * (3 * 32 * 64) * 2 / 8
    attn_res = 2 * 96
    params = 6 * kda + 3 * dsa + dense_mlp + 8 * moe + 9 * attn_res + 96 + 512 * 96  # + output mix, lm_head
    matmul = 2 * params + 6 * 2 * (3 * 64 * 4)  # + the depthwise convs
    kda_rec = 6 * (6 * 4 * 16 * 16)
    attention = 3 * 2 * 4 * (32 + 8 + 32) * _keys(T, 64)
    indexer = 2 * indexer_params + 3 * 2 * 4 * (16 + 1) * _keys(T)
    return params, matmul, kda_rec, attention, indexer


@pytest.mark.parametrize("T", [1, 63, 2049])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_tiny_matches_hand_count(T, backward):
    params, matmul, kda_rec, attention, indexer = _tiny_by_hand(T)
    f = estimate_flops(load_config("tiny"), T, backward=backward)
    m = 3 if backward else 1
    assert f["active_matmul_params"] == pytest.approx(params, rel=REL)
    for key, want in (
        ("matmul", m * matmul),
        ("kda", m * kda_rec),
        ("attention", m * attention),
        ("indexer", indexer),
    ):  # the frozen indexer has no backward
        assert f[key] == pytest.approx(want, rel=REL), key
    assert f["flops_per_token"] == pytest.approx(m * (matmul + kda_rec + attention) + indexer, rel=REL)


def test_dense_mla_layers_count_the_expanded_form():
    cfg = load_config("tiny-linear")
    assert cfg.mla_layers and not cfg.dsa_layers
    T = 63
    f = estimate_flops(cfg, T, backward=False)
    d_qk, d_v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    want = len(cfg.mla_layers) * 2 * cfg.num_attention_heads * (d_qk + d_v) * _keys(T)
    assert f["attention"] == pytest.approx(want, rel=REL)
    assert f["indexer"] == 0


def test_real_size_is_dominated_by_the_active_weights():
    f = estimate_flops(load_config("k3.1-pro"), 8192, backward=True)
    # ~104 B active parameters -> about 6 x 104e9 FLOPs per trained token, plus attention
    assert 6 * 95e9 < f["matmul"] < 6 * 110e9
    assert 0 < f["attention"] < f["matmul"]


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_seq_len_is_refused(bad):
    with pytest.raises(ValueError, match="seq_len"):
        estimate_flops(load_config("tiny"), bad)
