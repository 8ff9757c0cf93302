"""Fresh random weights in the canonical layout for the module tests of both paths (never zeros).

Each family has its own scale rule and draws, in layout order, from the numpy Generator it is given, so a test that
seeds the Generator gets the same values from the JAX and the torch side. Names are relative to
``model.layers.{layer}.{prefix}``; values are float64 numpy arrays.
"""

from __future__ import annotations

import numpy as np

from kimi.layout import param_layout


def layer_shapes(cfg, layer: int, prefix: str) -> dict[str, tuple]:
    """``{name: shape}`` of layer ``layer``'s tensors under ``prefix`` (e.g. ``"self_attn."``, ``"mlp."``)."""
    pre = f"model.layers.{layer}.{prefix}"
    return {s.name[len(pre) :]: s.shape for s in param_layout(cfg, [layer]) if s.name.startswith(pre)}


def layer_dtypes(cfg, layer: int, prefix: str) -> dict[str, str]:
    """``{name: checkpoint dtype}`` for the same tensors."""
    pre = f"model.layers.{layer}.{prefix}"
    return {s.name[len(pre) :]: s.dtype for s in param_layout(cfg, [layer]) if s.name.startswith(pre)}


def mla_params(cfg, layer: int, rng: np.random.Generator, prefix: str = "self_attn.") -> dict[str, np.ndarray]:
    """MLA / DSA attention (``prefix="self_attn.indexer."`` for the indexer alone): linears N(0, 1/in), norm weights
    1 + 0.1 N(0, 1), norm biases 0.1 N(0, 1)."""
    out = {}
    for name, shape in layer_shapes(cfg, layer, prefix).items():
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("norm.bias"):
            out[name] = 0.1 * rng.standard_normal(shape)
        else:
            out[name] = rng.standard_normal(shape) / np.sqrt(shape[1])
    return out


def kda_params(cfg, layer: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """KDA attention: A_log = log U(1, 16), dt_bias N(0, 1), o_norm 1 + 0.1 N(0, 1), conv 0.5 N(0, 1), linears
    N(0, 1/in)."""
    out = {}
    for name, shape in layer_shapes(cfg, layer, "self_attn.").items():
        if name == "A_log":
            out[name] = np.log(rng.uniform(1, 16, shape))
        elif name == "dt_bias":
            out[name] = rng.standard_normal(shape)
        elif name == "o_norm.weight":
            out[name] = 1 + 0.1 * rng.standard_normal(shape)
        elif "conv1d" in name:
            out[name] = 0.5 * rng.standard_normal(shape)
        else:
            out[name] = rng.standard_normal(shape) * shape[-1] ** -0.5
    return out


def mlp_params(shapes: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Dense MLP / MoE tensors given as ``{name: shape}``: linears N(0, 1/in), 1-D weights 1 + 0.2 N(0, 1), the router
    bias 0.1 N(0, 1) (large enough to change the selection)."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith("e_score_correction_bias"):
            out[name] = 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            out[name] = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            out[name] = rng.standard_normal(shape) / np.sqrt(shape[-1])
    return out
