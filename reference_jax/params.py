"""Canonical flat parameters (checkpoint names -> arrays) <-> the linen parameter tree, and orbax save/restore.

The mapping (docs/design.md): split the name at '.', and fold a numeric segment into the one before it, as linen
names list members: ``model.layers.3.block_sparse_moe.experts.5.w1.weight`` <->
``tree["model"]["layers_3"]["block_sparse_moe"]["experts_5"]["w1"]["weight"]``. It is a bijection because no
checkpoint segment name ends in ``_<digits>``.

No torch here: flat params are numpy arrays (bf16 as ``ml_dtypes.bfloat16``, as :func:`kimi.checkpoint.load_arrays`
returns them) or jax arrays; torch tensors are also accepted (tests build parameters on the torch side), converted
exactly by :func:`kimi.arrays.to_numpy`, which never imports torch itself.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from kimi.arrays import numpy_dtype, to_numpy

__all__ = ["name_to_path", "path_to_name", "to_tree", "from_tree", "save_orbax", "restore_orbax"]


def name_to_path(name: str) -> tuple[str, ...]:
    """Checkpoint name -> linen tree path: ``"model.layers.3.mlp.gate_proj.weight"`` ->
    ``("model", "layers_3", "mlp", "gate_proj", "weight")`` (a numeric segment folds into the one before it)."""
    out: list[str] = []
    for seg in name.split("."):
        if seg.isdigit() and out:
            out[-1] = f"{out[-1]}_{seg}"
        else:
            out.append(seg)
    return tuple(out)


def path_to_name(path: tuple[str, ...]) -> str:
    """Linen tree path -> checkpoint name, the inverse of :func:`name_to_path`."""
    segs = []
    for p in path:
        m = re.fullmatch(r"(.+)_(\d+)", p)
        segs.extend([m.group(1), m.group(2)] if m else [p])
    return ".".join(segs)


def to_tree(params: Mapping[str, Any], dtype: Any = None, prefix: str = "") -> dict:
    """Flat canonical params (numpy/jax arrays or torch tensors) -> nested linen tree of jax arrays, cast to ``dtype``
    (None keeps each tensor's dtype; bf16 keeps its bits).

    ``prefix`` strips a leading name part (e.g. ``"model.layers.3.self_attn."`` to get one module's tree).
    """
    tree: dict = {}
    for name, t in params.items():
        if not name.startswith(prefix):
            continue
        arr = jnp.asarray(to_numpy(t))
        if dtype is not None and jnp.issubdtype(arr.dtype, jnp.floating):
            arr = arr.astype(dtype)
        node = tree
        path = name_to_path(name[len(prefix) :])
        for seg in path[:-1]:
            node = node.setdefault(seg, {})
        node[path[-1]] = arr
    return tree


def from_tree(tree: Mapping[str, Any], dtypes: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Nested linen tree -> flat canonical params as numpy arrays (what :func:`kimi.checkpoint.save_params` takes);
    ``dtypes`` (``{name: dtype name or numpy dtype}``) casts named entries (fp32 -> bf16 rounds to nearest even)."""
    flat = {path_to_name(tuple(k.key for k in kp)): v for kp, v in jax.tree_util.tree_flatten_with_path(dict(tree))[0]}
    out = {}
    for name, v in flat.items():
        a = np.array(v)  # a copy: jax buffers are read-only
        if dtypes is not None and name in dtypes:
            a = a.astype(numpy_dtype(dtypes[name]), copy=False)
        out[name] = a
    return out


def save_orbax(path: str | Path, tree: Mapping[str, Any]) -> None:
    """Save a linen parameter tree with orbax-checkpoint (``StandardCheckpointer``) to a new directory ``path``."""
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(Path(path).absolute(), dict(tree))
    ckptr.wait_until_finished()


def restore_orbax(path: str | Path, like: Mapping[str, Any] | None = None) -> dict:
    """Restore a tree written by :func:`save_orbax` (``like`` gives the target structure/dtypes, optional)."""
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    if like is None:
        return ckptr.restore(Path(path).absolute())
    return ckptr.restore(Path(path).absolute(), dict(like))
