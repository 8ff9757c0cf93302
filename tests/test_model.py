"""The whole reference model (JAX) and its torch twin on the tiny presets, from checkpoints on disk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import rel

from kernels_torch.model import load_model as load_torch
from kimi.checkpoint import CheckpointReader
from kimi.layout import layer_of
from reference_jax.model import load_model as load_jax

TOL_FP32 = {"logits": 1e-5}  # torch fp32 vs JAX fp32, whole tiny model
TOL_BF16 = {
    "logits": 0.3
}  # torch bf16 vs JAX fp32 end to end: routing/top-k flips at near-ties (see kimi_tools.compare)


def ids_for(T, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, size=(1, T))


@pytest.mark.parametrize("T", [1, 63, 200])
def test_reference_runs_from_disk_and_is_healthy(tiny_ckpt, T):
    model, params, cfg = load_jax(tiny_ckpt)
    logits, aux = model.apply({"params": params}, ids_for(T, cfg.vocab_size, T), return_aux=True)
    assert logits.shape == (1, T, cfg.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.isfinite(logits).all())
    # Healthy init: the residual stream neither explodes nor vanishes over depth.
    rms = [float(jnp.sqrt(jnp.mean(a["residual"] ** 2))) for a in aux]
    assert all(1e-3 < r < 1e3 for r in rms), rms
    dsa = [i for i in range(cfg.num_hidden_layers) if cfg.layer_type(i) == "dsa"]
    for i in dsa:
        assert aux[i]["topk_indices"].shape == (1, T, min(cfg.index_topk, T))


@pytest.mark.slow
def test_absorbed_equals_expanded_whole_model_fp64(tiny_ckpt):
    with jax.enable_x64(True):
        model, params, cfg = load_jax(tiny_ckpt, dtype=jnp.float64)
        ids = ids_for(100, cfg.vocab_size, 5)
        a = model.apply({"params": params}, ids, mla_form="expanded")
        b = model.apply({"params": params}, ids, mla_form="absorbed")
        assert a.dtype == jnp.float64
        assert rel(b, a) <= 1e-10


@pytest.mark.slow
def test_packed_documents_equal_separate_runs(tiny_ckpt):
    model, params, cfg = load_jax(tiny_ckpt)
    lens = [5, 90, 1, 104]
    ids = ids_for(sum(lens), cfg.vocab_size, 7)
    cu = np.concatenate([[0], np.cumsum(lens)])
    packed = model.apply({"params": params}, ids, cu_seqlens=cu)
    for s, e in zip(cu[:-1], cu[1:]):
        alone = model.apply({"params": params}, ids[:, s:e])
        assert rel(packed[:, s:e], alone) <= 1e-5, (s, e)


@pytest.mark.slow
def test_layers_n_reads_only_first_layers(tiny_ckpt, monkeypatch):
    seen = []
    orig = CheckpointReader.get_array  # the JAX side reads numpy arrays (no torch)

    def spy(self, name):
        seen.append(name)
        return orig(self, name)

    monkeypatch.setattr(CheckpointReader, "get_array", spy)
    model, params, cfg = load_jax(tiny_ckpt, layers=4)
    assert cfg.num_hidden_layers == 4
    layers = {layer_of(n) for n in seen} - {None}
    assert layers == {0, 1, 2, 3}
    logits = model.apply({"params": params}, ids_for(70, cfg.vocab_size, 1))
    assert bool(jnp.isfinite(logits).all())


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("T", [1, 63, 200])
def test_torch_matches_reference_fp32(tiny_ckpt, backend, T):
    jm, params, cfg = load_jax(tiny_ckpt)
    ids = ids_for(T, cfg.vocab_size, 11 + T)
    ref = np.asarray(jm.apply({"params": params}, ids))
    tm = load_torch(tiny_ckpt, backend=backend)
    with torch.no_grad():
        out = tm(torch.as_tensor(ids)).numpy()
    assert rel(out, ref) <= TOL_FP32["logits"]


@pytest.mark.slow
def test_torch_bf16_close_to_reference(tiny_ckpt):
    jm, params, cfg = load_jax(tiny_ckpt)
    ids = ids_for(96, cfg.vocab_size, 3)
    ref = np.asarray(jm.apply({"params": params}, ids))
    tm = load_torch(tiny_ckpt, backend="sdpa", dtype=torch.bfloat16)
    assert tm.model.layers[0].self_attn.A_log.dtype == torch.float32  # fp32 params stay fp32 (spec 6)
    with torch.no_grad():
        out = tm(torch.as_tensor(ids)).float().numpy()
    assert np.isfinite(out).all() and rel(out, ref) <= TOL_BF16["logits"]


def test_torch_packed_documents(tiny_ckpt):
    tm = load_torch(tiny_ckpt, backend="sdpa")
    lens = [70, 1, 60]
    ids = torch.as_tensor(ids_for(sum(lens), tm.config.vocab_size, 9))
    cu = torch.tensor([0, 70, 71, 131])
    with torch.no_grad():
        packed = tm(ids, cu_seqlens=cu)
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert rel(packed[:, s:e], tm(ids[:, s:e])) <= 1e-5


def test_kimi_linear_checkpoint_both_paths(tiny_linear_ckpt):
    jm, params, cfg = load_jax(tiny_linear_ckpt)
    assert cfg.is_kimi_linear and not cfg.has_attn_res and cfg.q_lora_rank is None
    ids = ids_for(80, cfg.vocab_size, 2)
    ref = np.asarray(jm.apply({"params": params}, ids))
    tm = load_torch(tiny_linear_ckpt, backend="eager")
    with torch.no_grad():
        out = tm(torch.as_tensor(ids)).numpy()
    assert np.isfinite(ref).all() and rel(out, ref) <= TOL_FP32["logits"]


def test_bad_token_ids_refused(tiny_ckpt):
    jm, params, cfg = load_jax(tiny_ckpt, layers=1)
    with pytest.raises(ValueError, match="input_ids"):
        jm.apply({"params": params}, np.array([[0, cfg.vocab_size]]))
    tm = load_torch(tiny_ckpt, layers=1)
    with pytest.raises(ValueError, match="input_ids"):
        tm(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="input_ids"):
        tm(torch.zeros((1, 0), dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids: got dtype"):
        tm(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="input_ids: got dtype"):
        jm.apply({"params": params}, np.array([[1.5, 2.0]]))
    with pytest.raises(ValueError, match="backend"):
        load_torch(tiny_ckpt, layers=1, backend="triton")
