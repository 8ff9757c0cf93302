"""The JAX reference on ``jax.sharding``, applied from outside: the model modules never import this file.

Two tables, MaxText-style (``maxtext/utils/sharding.py``, ``configs/custom_mesh_and_rule``):

* :data:`LOGICAL_AXES`: canonical parameter name (regex, full match) -> one logical axis name per dimension
  (``"heads"`` for a ``[H * head_dim, ...]`` row block, ``"mlp"``, ``"vocab"``, ``"embed"``; None = replicated).
* :data:`RULES`: logical axis -> mesh axis. Default mesh ``("seq", "model")``: activations are split along the
  sequence on ``"seq"``, heads / MLP width / vocabulary along ``"model"``.

:func:`shard_params` places a parameter tree with :class:`jax.sharding.NamedSharding` (a dimension that the mesh axis
does not divide stays replicated, and is listed); :func:`sharded_logits` jits the model's forward with
``in_shardings`` (parameters as placed, token ids ``P(None, "seq")``) and ``out_shardings`` (logits
``P(None, "seq", "model")``). Everything in between is left to XLA's sharding propagation (no ``shard_map``: no
layer of the reference needs one; the KDA scan over a sequence-sharded row is gathered by the compiler). Values equal
the single-device forward up to the reduction order of the collectives XLA inserts.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["LOGICAL_AXES", "RULES", "make_mesh", "param_specs", "shard_params", "sharded_logits", "logits_fn"]

LOGICAL_AXES: list[tuple[str, tuple[str | None, ...]]] = [
    (r"(model\.embed_tokens|lm_head)\.weight", ("vocab", "embed")),  # [vocab, D]
    # KDA (spec 2.1): P = H * K rows are head blocks
    (r".*self_attn\.[qkv]_proj\.weight", ("heads", "embed")),  # [P, D] (MLA without q-LoRA: [H*(Kn+R), D])
    (r".*self_attn\.[qkv]_conv1d\.weight", ("heads", None, None)),  # [P, 1, W]
    (r".*self_attn\.(f_b_proj|g_b_proj)\.weight", ("heads", None)),  # [P, R]
    (r".*self_attn\.(dt_bias|A_log)", ("heads",)),  # [P], [H]
    (r".*self_attn\.g_proj\.weight", ("heads", "embed")),  # KDA [P, D]; MLA output gate [H*V, D]
    (r".*self_attn\.o_proj\.weight", ("embed", "heads")),  # [D, P] / [D, H*V]
    # MLA / DSA (spec 3.1, 4.1): per-head rows; the latent (kv_a, q_a) stays replicated, shared by all heads
    (r".*self_attn\.(q_b_proj|kv_b_proj)\.weight", ("heads", None)),  # [H*(Kn+R), q_lora], [H*(Kn+V), L]
    (r".*self_attn\.indexer\.wq_b\.weight", ("heads", None)),  # [HI*KI, q_lora]
    (r".*self_attn\.indexer\.weights_proj\.weight", ("heads", "embed")),  # [HI, D]
    # MLPs (spec 5): dense and shared experts [I, D] / [D, I]; routed experts w1, w3 [I, Dl], w2 [Dl, I]
    (r".*(mlp|shared_experts)\.(gate_proj|up_proj)\.weight", ("mlp", "embed")),
    (r".*(mlp|shared_experts)\.down_proj\.weight", ("embed", "mlp")),
    (r".*experts\.\d+\.(w1|w3)\.weight", ("mlp", None)),
    (r".*experts\.\d+\.w2\.weight", (None, "mlp")),
]

RULES: dict[str, str | None] = {"heads": "model", "mlp": "model", "vocab": "model", "embed": None, "seq": "seq"}


def make_mesh(seq: int, model: int, devices=None) -> Mesh:
    """A ``(seq, model)`` mesh over the first ``seq * model`` devices.

    Raises:
        ValueError: fewer devices than ``seq * model``.
    """
    devices = jax.devices() if devices is None else devices
    if seq * model > len(devices):
        raise ValueError(f"mesh: got seq={seq} x model={model}, expected at most {len(devices)} devices")
    return Mesh(np.asarray(devices[: seq * model]).reshape(seq, model), ("seq", "model"))


def _name(path) -> str:
    """Canonical dotted name of a tree path (``layers_3`` -> ``layers.3``, as ``reference_jax.params.path_to_name``,
    which this torch-free module does not import)."""
    segs = []
    for k in path:
        key = str(getattr(k, "key", k))
        m = re.fullmatch(r"(.+)_(\d+)", key)
        segs.extend([m.group(1), m.group(2)] if m else [key])
    return ".".join(segs)


def param_specs(tree: Any, mesh: Mesh, rules: dict[str, str | None] = RULES) -> tuple[Any, list[str]]:
    """``PartitionSpec`` of every parameter from :data:`LOGICAL_AXES` and ``rules``, and the list of
    ``name[dim]`` that stayed replicated because the mesh axis does not divide them."""
    replicated: list[str] = []

    def spec(path, leaf) -> P:
        name = _name(path)
        axes = next((ax for pat, ax in LOGICAL_AXES if re.fullmatch(pat, name)), ())
        if len(axes) != leaf.ndim:
            axes = (None,) * leaf.ndim
        out = []
        for d, logical in enumerate(axes):
            mesh_axis = rules.get(logical) if logical else None
            if mesh_axis is not None and leaf.shape[d] % mesh.shape[mesh_axis]:
                replicated.append(f"{name}[{d}]")
                mesh_axis = None
            out.append(mesh_axis)
        return P(*out)

    return jax.tree_util.tree_map_with_path(spec, tree), replicated


def shard_params(tree: Any, mesh: Mesh, rules: dict[str, str | None] = RULES) -> tuple[Any, Any]:
    """Place ``tree`` on ``mesh``: returns ``(sharded tree, tree of NamedSharding)``."""
    specs, _ = param_specs(tree, mesh, rules)
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    return jax.device_put(tree, shardings), shardings


def sharded_logits(model, tree: Any, input_ids, mesh: Mesh, cu_seqlens=None, mla_form: str = "expanded"):
    """The reference's logits under ``mesh``: ``jax.jit`` of the forward with the parameters sharded by
    :func:`shard_params`, ``input_ids`` ``[B, T]`` on ``P(None, "seq")`` and the logits ``[B, T, vocab]`` on
    ``P(None, "seq", "model")``.

    ``input_ids`` are checked on the host first, then the jitted :func:`logits_fn` runs.

    Raises:
        ValueError: token ids outside ``[0, vocab)``, a bad shape, or ``T`` not divisible by the ``seq`` axis.
    """
    ids = np.asarray(input_ids)
    c = model.config
    if ids.ndim != 2 or ids.size == 0 or ids.min() < 0 or ids.max() >= c.vocab_size:
        raise ValueError(
            f"input_ids: got shape {ids.shape}, ids in [{ids.min()}, {ids.max()}], expected [B, T] in [0, {c.vocab_size})"
        )
    if ids.shape[1] % mesh.shape["seq"]:
        raise ValueError(f"input_ids: got T={ids.shape[1]}, expected a multiple of the seq axis {mesh.shape['seq']}")
    params, p_shard = shard_params(tree, mesh)
    fn = jax.jit(
        logits_fn(model, cu_seqlens, mla_form),
        in_shardings=(p_shard, NamedSharding(mesh, P(None, "seq"))),
        out_shardings=NamedSharding(mesh, P(None, "seq", "model")),
    )
    return fn(params, jnp.asarray(ids))


def logits_fn(model, cu_seqlens=None, mla_form: str = "expanded"):
    """``f(params, input_ids) -> logits``: ``KimiK3Model.__call__`` after its host-side id check (which needs
    concrete ids), i.e. the bound model's backbone and head; jittable with traced ids. ``cu_seqlens`` is captured as
    a concrete constant (the KDA and mask code read it on the host)."""
    c = model.config
    cu = None if cu_seqlens is None else np.asarray(cu_seqlens)

    def forward(module, ids):
        h, _ = module.model(ids, cu, mla_form)
        if c.tie_word_embeddings:
            return h @ module.model.embed_tokens.variables["params"]["weight"].T
        return module.lm_head(h)

    return lambda params, ids: model.apply({"params": params}, ids, method=forward)
