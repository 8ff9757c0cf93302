"""Canonical flat parameters (checkpoint names -> torch tensors) <-> the linen parameter tree, and orbax save/restore.

The mapping (docs/design.md): split the name at '.', and fold a numeric segment into the one before it, as linen
names list members: ``model.layers.3.block_sparse_moe.experts.5.w1.weight`` <->
``tree["model"]["layers_3"]["block_sparse_moe"]["experts_5"]["w1"]["weight"]``. It is a bijection because no
checkpoint segment name ends in ``_<digits>``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

__all__ = [
    "name_to_path",
    "path_to_name",
    "to_tree",
    "from_tree",
    "torch_to_numpy",
    "numpy_to_torch",
    "save_orbax",
    "restore_orbax",
]

_TORCH_TO_NP = {
    torch.bfloat16: ml_dtypes.bfloat16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.uint8: np.uint8,
    torch.int32: np.int32,
    torch.int64: np.int64,
}
_NP_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_NP.items()}


def name_to_path(name: str) -> tuple[str, ...]:
    out: list[str] = []
    for seg in name.split("."):
        if seg.isdigit() and out:
            out[-1] = f"{out[-1]}_{seg}"
        else:
            out.append(seg)
    return tuple(out)


def path_to_name(path: tuple[str, ...]) -> str:
    segs = []
    for p in path:
        m = re.fullmatch(r"(.+)_(\d+)", p)
        segs.extend([m.group(1), m.group(2)] if m else [p])
    return ".".join(segs)


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """Exact conversion (bf16 keeps its bits through ``ml_dtypes.bfloat16``)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def numpy_to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_tree(params: Mapping[str, Any], dtype: Any = None, prefix: str = "") -> dict:
    """Flat canonical params (torch tensors or numpy/jax arrays) -> nested linen tree of jax arrays, cast to ``dtype``
    (None keeps each tensor's dtype).

    ``prefix`` strips a leading name part (e.g. ``"model.layers.3.self_attn."`` to get one module's tree).
    """
    tree: dict = {}
    for name, t in params.items():
        if not name.startswith(prefix):
            continue
        arr = jnp.asarray(torch_to_numpy(t) if isinstance(t, torch.Tensor) else t)
        if dtype is not None and jnp.issubdtype(arr.dtype, jnp.floating):
            arr = arr.astype(dtype)
        node = tree
        path = name_to_path(name[len(prefix) :])
        for seg in path[:-1]:
            node = node.setdefault(seg, {})
        node[path[-1]] = arr
    return tree


def from_tree(tree: Mapping[str, Any], dtypes: Mapping[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """Nested linen tree -> flat canonical params (torch CPU tensors); ``dtypes`` casts named entries back."""
    flat = {path_to_name(tuple(k.key for k in kp)): v for kp, v in jax.tree_util.tree_flatten_with_path(dict(tree))[0]}
    out = {}
    for name, v in flat.items():
        t = numpy_to_torch(np.asarray(v))
        if dtypes is not None and name in dtypes:
            t = t.to(dtypes[name])
        out[name] = t
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
