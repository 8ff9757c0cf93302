"""Weight exchange between the two paths through safetensors in the real key names, and orbax for JAX."""

import numpy as np
import torch
from safetensors import safe_open

from kernels_torch.model import load_model as load_torch
from kernels_torch.model import save_model as save_torch
from kimi.checkpoint import load_params
from reference_jax.model import load_params_tree, save_params_tree
from reference_jax.params import restore_orbax, save_orbax


def stored_bytes(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                t = sf.get_tensor(k)
                out[k] = (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def test_torch_save_jax_load_save_is_byte_identical(tiny_ckpt, tmp_path):
    tm = load_torch(tiny_ckpt, dtype=torch.bfloat16)  # bf16 checkpoint, fp32 tensors stay fp32: exact
    save_torch(tm, tmp_path / "from_torch")
    tree, cfg = load_params_tree(tmp_path / "from_torch")  # stored dtypes kept
    save_params_tree(tmp_path / "from_jax", tree, cfg)
    a, b, c = stored_bytes(tiny_ckpt), stored_bytes(tmp_path / "from_torch"), stored_bytes(tmp_path / "from_jax")
    assert a.keys() == b.keys() == c.keys()
    assert all(k.startswith("language_model.") for k in a)
    for k in a:
        assert a[k] == b[k] == c[k], k


def test_orbax_roundtrip(tiny_ckpt, tmp_path):
    tree, cfg = load_params_tree(tiny_ckpt)
    save_orbax(tmp_path / "orbax", tree)
    back = restore_orbax(tmp_path / "orbax", like=tree)
    flat_a = {k: np.asarray(v) for k, v in _flatten(tree).items()}
    flat_b = {k: np.asarray(v) for k, v in _flatten(back).items()}
    assert flat_a.keys() == flat_b.keys()
    for k in flat_a:
        assert flat_a[k].dtype == flat_b[k].dtype and np.array_equal(
            flat_a[k].view(np.uint8), flat_b[k].view(np.uint8)
        ), k


def test_canonical_params_equal_in_both_paths(tiny_ckpt):
    params = load_params(tiny_ckpt)
    tm = load_torch(tiny_ckpt, dtype=torch.bfloat16)
    sd = tm.state_dict()
    assert sd.keys() == params.keys()
    for k, v in params.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k


def _flatten(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out
