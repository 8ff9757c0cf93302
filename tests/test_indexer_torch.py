"""``kernels_torch.indexer`` (scores, top-k with the canonical tie rule) against its JAX twin
``reference_jax.indexer``, row chunking, gradients and memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import rel

import kernels_torch.indexer as ti
import reference_jax.indexer as ji

TOL_FP32 = 1e-5  # torch vs JAX, fp32
TOL_FP64 = 1e-10  # torch vs JAX, fp64


def tie_heavy_inputs(T: int, seed: int, frac_positive: float = 0.1):
    """Indexer q/k/w where ~90% of keys have q.k < 0 for every head: their score is exactly 0 (ReLU ties)."""
    rng = np.random.default_rng(seed)
    HI, KI = 3, 8
    q = np.abs(rng.standard_normal((1, T, HI, KI)))
    sign = np.where(rng.random(T) < frac_positive, 1.0, -1.0)
    k = sign[None, :, None] * np.abs(rng.standard_normal((1, T, KI)))
    w = np.abs(rng.standard_normal((1, T, HI))) + 0.1
    return q, k, w


# ------------------------------------------------------------------------------------------------ indexer functions


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_indexer_scores_and_topk_match_jax(dtype):
    rng = np.random.default_rng(0)
    B, T, HI, KI, k = 2, 200, 3, 8, 64
    q, kk, w = rng.standard_normal((B, T, HI, KI)), rng.standard_normal((B, T, KI)), rng.standard_normal((B, T, HI))
    tdt, jdt, tol = (
        (torch.float64, jnp.float64, TOL_FP64) if dtype == "fp64" else (torch.float32, jnp.float32, TOL_FP32)
    )
    s_t = ti.indexer_scores(*(torch.from_numpy(a).to(tdt) for a in (q, kk, w)))
    with jax.enable_x64(dtype == "fp64"):
        s_j = np.asarray(ji.indexer_scores(*(jnp.asarray(a, jdt) for a in (q, kk, w))))
        # select from the *same* scores in both frameworks: the top-k rule itself must agree index for index
        mask = np.tril(np.ones((T, T), bool))
        i_j = np.asarray(ji.topk_indices(jnp.asarray(s_j), jnp.asarray(mask), k))
    assert s_t.dtype == tdt and rel(s_t, s_j) <= tol
    i_t = ti.topk_indices(torch.from_numpy(np.array(s_j)), torch.from_numpy(mask), k)
    assert i_t.dtype == torch.int32 and np.array_equal(i_t.numpy(), i_j)
    assert np.array_equal(ti.sparse_mask(i_t, T).numpy(), np.asarray(ji.sparse_mask(jnp.asarray(i_j), T)))


TOL_CHUNKED_FP64 = 1e-12  # row-chunked indexer scores (and their recomputing backward) vs plain autograd, fp64


@pytest.mark.parametrize("values", ["normal", "integers"])
@pytest.mark.parametrize(
    "T,S,chunk_bytes",
    [(1, 1, 1), (63, 63, 1), (63, 40, 3 * 8 * 40 * 2 * 5), (23, 23, 1 << 29)],
    ids=["T1-row-chunks", "T63-row-chunks", "T63-S40-5-row-chunks", "T23-one-chunk"],
)
def test_indexer_scores_row_chunks_and_gradients(T, S, chunk_bytes, values):
    """``indexer_scores`` in query-row chunks, whose backward recomputes each chunk's logits: scores and the gradients
    of q_I, k_I and weights equal plain autograd through the one-shot formula (fp64, B = 2, S != T). ``integers``
    draws q_I and k_I from {-1, 0, 1}, so many logits are exactly 0, where ReLU's gradient must be 0."""
    g = torch.Generator().manual_seed(T + S)
    B, HI, KI = 2, 3, 8
    if values == "normal":
        draw = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    else:
        draw = lambda *shape: torch.randint(-1, 2, shape, generator=g).double()  # noqa: E731
    q, k = draw(B, T, HI, KI).requires_grad_(), draw(B, S, KI).requires_grad_()
    w = torch.randn(B, T, HI, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(B, T, S, generator=g, dtype=torch.float64)
    logits = torch.einsum("btjk,bsk->btjs", q, k) * KI**-0.5
    if values == "integers" and T > 1:
        assert (logits == 0).float().mean() > 0.1
    ref = torch.einsum("btj,btjs->bts", w * HI**-0.5, torch.relu(logits))
    out = ti.indexer_scores(q, k, w, chunk_bytes=chunk_bytes)
    assert rel(out, ref) <= TOL_CHUNKED_FP64
    for name, got, want in zip(
        ("dq_I", "dk_I", "dweights"),
        torch.autograd.grad((out * dy).sum(), (q, k, w)),
        torch.autograd.grad((ref * dy).sum(), (q, k, w)),
    ):
        assert rel(got, want) <= TOL_CHUNKED_FP64, name


def test_indexer_scores_memory_is_one_chunk():
    """No tensor made in the forward or the backward of ``indexer_scores`` is larger than one chunk's logits or the
    ``[B, T, S]`` result (the point of the chunking: the ``[B, T, HI, S]`` logits would be 137 GB at 32K)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    LargestOutput.largest = max(LargestOutput.largest, t.numel() * t.element_size())
            return out

    B, T, HI, KI = 1, 256, 8, 16
    q = torch.randn(B, T, HI, KI, requires_grad=True)
    k = torch.randn(B, T, KI, requires_grad=True)
    w = torch.randn(B, T, HI, requires_grad=True)
    chunk_bytes = 16 * HI * T * 4  # 16 query rows of fp32 logits
    with LargestOutput():
        ti.indexer_scores(q, k, w, chunk_bytes=chunk_bytes).sum().backward()
    result_bytes = B * T * T * 4
    assert LargestOutput.largest <= max(chunk_bytes, result_bytes) < B * T * HI * T * 4


@pytest.mark.parametrize("T", [65, 200, 2049], ids=lambda t: f"T{t}")
def test_tie_heavy_selection_identical(T):
    """Many exact zeros (ReLU): both frameworks pick the same keys in the same (canonical) order."""
    k = 64 if T < 2049 else 2048
    q, kk, w = tie_heavy_inputs(T, seed=T)
    s_t = ti.indexer_scores(*(torch.from_numpy(a).float() for a in (q, kk, w)))
    s_j = ji.indexer_scores(*(jnp.asarray(a, jnp.float32) for a in (q, kk, w)))
    assert (s_t == 0).float().mean() > 0.5
    mask = np.tril(np.ones((T, T), bool))
    i_t = ti.topk_indices(s_t, torch.from_numpy(mask), k).numpy()
    i_j = np.asarray(ji.topk_indices(s_j, jnp.asarray(mask), k))
    assert np.array_equal(i_t, i_j)
    # canonical tie rule on the last row: zero-score keys come last, larger index first
    s = s_t[0, -1].numpy()
    zeros_part = i_t[0, -1][int((s > 0).sum()) :]
    assert np.all(s[zeros_part[zeros_part >= 0]] == 0) and np.all(np.diff(zeros_part[zeros_part >= 0]) < 0)


def test_topk_hand_example_and_errors():
    scores = torch.tensor([[[0.0, 0.0, 1.0, 0.0, 0.5]]])
    assert ti.topk_indices(scores, torch.ones(1, 5, dtype=torch.bool), 4).tolist() == [[[2, 4, 3, 1]]]
    mask = torch.tensor([[True, True, True, False, True]])
    assert ti.topk_indices(scores, mask, 5).tolist() == [[[2, 4, 1, 0, -1]]]
    with pytest.raises(ValueError, match="topk"):
        ti.topk_indices(scores, mask, 0)
    with pytest.raises(ValueError, match="mask"):
        ti.topk_indices(scores, torch.ones(2, 5, dtype=torch.bool), 2)


def test_masked_before_topk_T2049():
    T, k = 2049, 2048
    rng = np.random.default_rng(8)
    scores = torch.from_numpy(np.arange(T, dtype=np.float32)[None, None] + rng.random((1, T, T), np.float32))
    idx = ti.topk_indices(scores, torch.ones(T, T, dtype=torch.bool).tril(), k)[0]
    assert bool((idx <= torch.arange(T)[:, None]).all())
    assert torch.equal((idx >= 0).sum(1), torch.clamp(torch.arange(T) + 1, max=k))


def test_signed_zero_scores_tie_the_same_way_in_both_frameworks():
    """Negative head weights times all-zero ReLUs give -0.0 in one framework and +0.0 in the other unless the
    scores are canonicalised; the canonical rule (ties -> larger key index) must not see the sign bit."""
    rng = np.random.default_rng(5)
    B, T, HI, KI = 1, 12, 2, 4
    q = rng.standard_normal((B, T, HI, KI)).astype(np.float32)
    k = rng.standard_normal((B, T, KI)).astype(np.float32)
    k[:, ::2] = -np.abs(k[:, ::2]) * 0 - 1.0  # every other key: negative everywhere ...
    q = np.abs(q) + 0.1  # ... against positive queries: every ReLU is exactly 0 for those keys
    w = -np.abs(rng.standard_normal((B, T, HI))).astype(np.float32) - 0.1  # negative weights: 0 * w = -0.0
    js = np.asarray(ji.indexer_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w)))
    ts = ti.indexer_scores(torch.tensor(q), torch.tensor(k), torch.tensor(w)).numpy()
    assert not np.signbit(js[js == 0]).any() and not np.signbit(ts[ts == 0]).any()
    mask = np.tril(np.ones((T, T), bool))
    jt = np.asarray(ji.topk_indices(jnp.asarray(js), jnp.asarray(mask), 4))
    tt = ti.topk_indices(torch.tensor(ts), torch.tensor(mask), 4).numpy()
    assert np.array_equal(jt, tt)
