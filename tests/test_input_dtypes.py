"""Issue 13, fault 4: every layer and the model check dtypes on entry with one clear error, in both paths.

Before: an int64 ``x`` into the torch KDA layer returned zeros, MLA and MoE raised raw torch errors, uint8 token ids
reached the embedding. Mutation tried: removing the ``check_activation_dtype`` call of any one layer makes its case
here fail (int x then gives a raw torch/jax error or silent output); dropping uint8 from the refused id dtypes fails
the model case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kernels_torch.indexer as ti
import kernels_torch.kda as tk
import kernels_torch.mla as tm
import kernels_torch.model as tmodel
import kernels_torch.moe as tmoe
import reference_jax.indexer as ji
import reference_jax.kda as jk
import reference_jax.mla as jm
import reference_jax.model as jmodel
import reference_jax.moe as jmoe
from kimi.config import load_config

KDA, DSA, MOE_LAYER = 0, 3, 1  # layers of the tiny preset
FLOAT_MSG = r"has dtype .*, expected one of bfloat16, float16, float32, float64"
NAMES = {"kda": "KimiDeltaAttention", "mla": "GatedMLA", "moe": "KimiMoE", "mlp": "DenseMLP"}
IDS_MSG = r"input_ids: got dtype .*, expected integer token ids \(int32, int64\)"


def _torch_layers(cfg):
    return {
        "kda": tk.KimiDeltaAttention(cfg, KDA),
        "mla": tm.GatedMLA(cfg, DSA),
        "moe": tmoe.KimiMoE(cfg),
        "mlp": tmoe.DenseMLP(cfg, cfg.intermediate_size),
    }


def _jax_layers(cfg):
    return {
        "kda": jk.KimiDeltaAttention(cfg, KDA),
        "mla": jm.GatedMLA(cfg, DSA),
        "moe": jmoe.KimiMoE(cfg),
        "mlp": jmoe.DenseMLP(cfg, cfg.intermediate_size),
    }


@pytest.mark.parametrize("kind", ["kda", "mla", "moe", "mlp"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64], ids=str)
def test_torch_layers_refuse_non_float_x(kind, dtype):
    cfg = load_config("tiny")
    layer = _torch_layers(cfg)[kind]
    x = torch.randint(0, 3, (1, 5, cfg.hidden_size)).to(dtype)
    with pytest.raises(ValueError, match=f"{NAMES[kind]}: x {FLOAT_MSG}"):
        layer(x)


@pytest.mark.parametrize("kind", ["kda", "mla", "moe", "mlp"])
def test_jax_layers_refuse_int_x(kind):
    cfg = load_config("tiny")
    layer = _jax_layers(cfg)[kind]
    x = jnp.asarray(np.random.default_rng(0).integers(0, 3, (1, 5, cfg.hidden_size)), jnp.int32)
    with pytest.raises(ValueError, match=f"{NAMES[kind]}: x {FLOAT_MSG}"):
        layer.init(jax.random.PRNGKey(0), x)


def test_indexers_refuse_int_inputs():
    cfg = load_config("tiny")
    x = torch.randint(0, 3, (1, 5, cfg.hidden_size))
    c_q = torch.randn(1, 5, cfg.q_lora_rank)
    with pytest.raises(ValueError, match="Indexer: x " + FLOAT_MSG):
        ti.Indexer(cfg)(x, c_q)
    with pytest.raises(ValueError, match="Indexer: c_q " + FLOAT_MSG):
        ti.Indexer(cfg)(x.float(), c_q.long())
    with pytest.raises(ValueError, match="Indexer: x " + FLOAT_MSG):
        ji.Indexer(cfg).init(jax.random.PRNGKey(0), jnp.asarray(x.numpy()), jnp.asarray(c_q.numpy()))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.float32, torch.int16], ids=str)
def test_torch_model_refuses_token_id_dtypes(dtype):
    cfg = load_config("tiny").truncated(1)
    model = tmodel.KimiK3Model(cfg)
    with pytest.raises(ValueError, match=IDS_MSG):
        model(torch.ones(1, 4, dtype=dtype))
    assert model(torch.ones(1, 4, dtype=torch.int32)).shape == (1, 4, cfg.vocab_size)  # int32 and int64 accepted


@pytest.mark.parametrize("dtype", [np.uint8, np.bool_, np.float32, np.int16], ids=lambda d: np.dtype(d).name)
def test_jax_model_refuses_token_id_dtypes(dtype):
    cfg = load_config("tiny").truncated(1)
    with pytest.raises(ValueError, match=IDS_MSG):
        jmodel.KimiK3Model(cfg).init(jax.random.PRNGKey(0), np.ones((1, 4), dtype))
