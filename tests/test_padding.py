"""Issue 13, fault 6: padded batches and ``max_position_embeddings``, both models.

Left padding changes the real tokens' logits; right padding is safe; ``attention_mask`` makes any padding safe (the
rows run as packed documents). A sequence past ``max_position_embeddings`` runs with a UserWarning (decided: warn,
not refuse; the model is NoPE and computes any length, but the checkpoint does not declare it).

Mutations tried (each fails a test here): ignoring ``attention_mask`` in either model (the left-padded row's logits
move); packing with ``cu`` built from all rows including empty ones (cu_seqlens refuses an empty document); scattering
the packed logits back in column-major order; dropping the warning; reading the document lengths before
validating ``cu_seqlens`` (torch: ``max()``'s RuntimeError; JAX: numpy's zero-size error).
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import rel

from kernels_torch.model import load_model as load_torch
from kimi.config import load_config
from kimi.init import init_checkpoint
from reference_jax.model import load_model as load_jax

LAYERS = 4  # tiny: K K K D (KDA, KDA, KDA, DSA), dense MLP then latent MoE, AttnRes
TOL_FP32 = 1e-5  # a row's logits from the padded batch vs the row alone
LEFT_PAD_MIN = 1e-2  # left padding without a mask moves the real tokens' logits by at least this (rel)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny4")
    init_checkpoint(path, load_config("tiny").truncated(LAYERS), seed=3)
    return path


def _batch(vocab):
    """Rows of 5 (left-padded by 4), 9 (full), 3 (right-padded by 6), 6 (padded 2 left, 1 right) and 0 tokens."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, vocab, n) for n in (5, 9, 3, 6, 0)]
    T = 9
    ids = np.full((5, T), 7, np.int64)  # pad id 7: any id, it is dropped
    mask = np.zeros((5, T), bool)
    for r, (row, start) in enumerate(zip(rows, (4, 0, 0, 2, 0))):
        ids[r, start : start + len(row)] = row
        mask[r, start : start + len(row)] = True
    return rows, ids, mask


def test_torch_padded_batch_equals_rows_alone(ckpt):
    model = load_torch(ckpt)
    rows, ids, mask = _batch(model.config.vocab_size)
    with torch.no_grad():
        out = model.padded(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        no_mask = model(torch.from_numpy(ids)).numpy()
        for r, row in enumerate(rows[:4]):  # row 4 has no token: all its logits are 0
            alone = model(torch.from_numpy(row)[None])[0].numpy()
            assert rel(out[r][mask[r]], alone) <= TOL_FP32, r
        assert not out[~mask].any()  # logits at pads are 0
    # without the mask: left padding moves row 0, right padding leaves row 2 as it is
    assert rel(no_mask[0][mask[0]], out[0][mask[0]]) > LEFT_PAD_MIN
    assert rel(no_mask[2][mask[2]], out[2][mask[2]]) <= TOL_FP32


def test_jax_padded_batch_equals_rows_alone_and_torch(ckpt):
    """The JAX model on the first layer only (the padding logic is the model's, above the layers; op-by-op JAX on
    all four layers costs minutes): the padded batch equals torch's, whose rows equal each row alone (above)."""
    model, tree, cfg = load_jax(ckpt, layers=1)
    rows, ids, mask = _batch(cfg.vocab_size)
    out = np.asarray(model.apply({"params": tree}, jnp.asarray(ids), mask, method="padded"))
    assert not out[~mask].any()
    with torch.no_grad():
        t = load_torch(ckpt, layers=1).padded(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    assert rel(out[mask], t[mask]) <= TOL_FP32


def test_attention_mask_refusals(ckpt):
    model = load_torch(ckpt)
    ids = torch.ones(2, 4, dtype=torch.int64)
    ok = torch.ones(2, 4, dtype=torch.bool)
    cases = [
        (ok[:, :3], "attention_mask: got shape"),
        (ok.long() * 2, r"got the value 2 \(dtype (torch\.)?int64\), expected only 0 and 1"),
        (ok.float() * 0.5, r"got the value 0\.5 \(dtype (torch\.)?float32\), expected only 0 and 1"),
        (torch.full((2, 4), float("nan")), r"got the value nan"),
        (ok.to(torch.complex64), "got dtype (torch.)?complex64, expected bool, integer or floating"),
        (torch.zeros(2, 4, dtype=torch.bool), "no real token"),
    ]
    old_keyword = [  # the deprecated forward(attention_mask=) alias: what the padded call cannot honour
        (dict(attention_mask=ok, cu_seqlens=torch.tensor([0, 4])), "given with cu_seqlens"),
        (dict(attention_mask=ok, return_aux=True), "given with return_aux"),
    ]
    for mask, msg in cases:
        with pytest.raises(ValueError, match=msg):
            model.padded(ids, mask)
    for kw, msg in old_keyword:
        with pytest.raises(ValueError, match=msg), pytest.warns(DeprecationWarning, match="padded"):
            model(ids, **kw)
    jmodel, tree, _ = load_jax(ckpt, layers=1)  # every refusal comes before the layers run
    for mask, msg in cases:
        with pytest.raises(ValueError, match=msg):
            jmodel.apply({"params": tree}, ids.numpy(), mask.numpy(), method="padded")
    for kw, msg in old_keyword:
        kw = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        with pytest.raises(ValueError, match=msg), pytest.warns(DeprecationWarning, match="padded"):
            jmodel.apply({"params": tree}, ids.numpy(), **kw)


def test_max_position_embeddings_warns(ckpt):
    """Decision: warn (UserWarning), not refuse; per row, per packed document, per masked row."""
    model = load_torch(ckpt, layers=1)
    model.config = model.config.replace(max_position_embeddings=6)
    ids = torch.ones(1, 8, dtype=torch.int64)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="sequence length 8 exceeds config.max_position_embeddings=6"):
            model(ids)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(ids, cu_seqlens=torch.tensor([0, 4, 8]))  # documents of 4: fine
            model.padded(ids, torch.arange(8)[None] >= 2)  # 6 real tokens: fine
    from reference_jax.model import _warn_past_max_positions  # the JAX model's check (running it costs ~10 s)

    with pytest.warns(UserWarning, match="sequence length 7 exceeds config.max_position_embeddings=6"):
        _warn_past_max_positions(8, np.array([0, 7, 8]), 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_past_max_positions(8, np.array([0, 4, 8]), 6)


BAD_CU = [  # (cu_seqlens for T = 8, the project's message)
    ([0], "length >= 2"),
    ([], "length >= 2"),
    ("empty int", "length >= 2"),
    ([0, 5, 3, 8], "strictly increasing"),
    ([0, 4, 4, 8], "strictly increasing"),
    ([1, 8], "start at 0 and end at T=8"),
    ([0, 4], "start at 0 and end at T=8"),
    ("float", "integer"),
    ("bool", "integer"),
]


def _cu(spec, lib):
    if spec == "empty int":
        return torch.zeros(0, dtype=torch.int64) if lib == "torch" else np.zeros(0, np.int64)
    if spec in ("float", "bool"):
        vals = [0.0, 8.0] if spec == "float" else [False, True]
        return torch.tensor(vals) if lib == "torch" else np.array(vals)
    return torch.tensor(spec, dtype=torch.int64) if lib == "torch" else np.array(spec, np.int64)


def test_degenerate_cu_seqlens_refused_before_the_length_warning(ckpt):
    """The long-sequence check reads the document lengths: it validates ``cu_seqlens`` first, so a degenerate one
    gets the project's ValueError (not ``max()``'s RuntimeError, nor numpy's zero-size reduction error), also on
    the loss path."""
    model = load_torch(ckpt, layers=1)
    ids = torch.ones(1, 8, dtype=torch.int64)
    with torch.no_grad():
        for spec, msg in BAD_CU:
            with pytest.raises(ValueError, match=f"^cu_seqlens: got .*{msg}"):
                model(ids, cu_seqlens=_cu(spec, "torch"))
        with pytest.raises(ValueError, match="^cu_seqlens: got .*length >= 2"):
            model.loss(ids, ids, cu_seqlens=torch.tensor([0]))
    jmodel, tree, _ = load_jax(ckpt, layers=1)
    for spec, msg in BAD_CU:
        with pytest.raises(ValueError, match=f"^cu_seqlens: got .*{msg}"):
            jmodel.apply({"params": tree}, ids.numpy(), cu_seqlens=_cu(spec, "jax"))


def test_float_and_int_masks_equal_the_bool_mask(ckpt):
    """A 0/1 mask in a floating or integer dtype (``torch.ones(B, T)``, a tokenizer's int64 mask) is the bool mask:
    the same logits, in both models."""
    model = load_torch(ckpt, layers=1)
    rows, ids, mask = _batch(model.config.vocab_size)
    t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
    jmodel, tree, _ = load_jax(ckpt, layers=1)
    with torch.no_grad():
        want = model.padded(t_ids, t_mask)
        for m in (t_mask.float(), t_mask.double(), t_mask.long(), t_mask.to(torch.bfloat16)):
            assert torch.equal(model.padded(t_ids, m), want), m.dtype
        assert torch.equal(model.padded(t_ids[:1], torch.ones(1, ids.shape[1])), model(t_ids[:1]))
    jwant = np.asarray(jmodel.apply({"params": tree}, jnp.asarray(ids), mask, method="padded"))
    for m in (mask.astype(np.float32), mask.astype(np.int32)):
        got = np.asarray(jmodel.apply({"params": tree}, jnp.asarray(ids), m, method="padded"))
        assert np.array_equal(got, jwant), m.dtype
