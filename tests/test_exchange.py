"""Weight exchange between the two paths through safetensors in the real key names, and orbax for JAX; the JAX
side loads without torch, bit for bit what the torch side loads."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kernels_torch.model import load_model as load_torch
from kernels_torch.model import save_model as save_torch
from kernels_torch.params import canonical_state_dict
from kimi.checkpoint import load_params
from kimi.layout import stacked_layout
from reference_jax.model import load_model as load_jax_model
from reference_jax.model import load_params_tree, save_params_tree
from reference_jax.params import path_to_name, restore_orbax, save_orbax


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
    sd = canonical_state_dict(tm)  # the routed experts' stacks split into the checkpoint's per-expert tensors
    assert sd.keys() == params.keys()
    stacked = {s.name: s.shape for s in stacked_layout(tm.config)}
    assert {k: tuple(v.shape) for k, v in tm.state_dict().items()} == stacked
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


# ------------------------------------------------------------------------------------------ no torch on the JAX side

REPO = Path(__file__).resolve().parents[1]

# Run first in the child: a meta-path finder that makes torch unimportable and records who asked for it. An attempt
# from the project's own JAX-side files (kimi/, reference_jax/) is a failure even if the caller would survive it.
_BLOCKER = """
import sys, traceback
_ASKED = []
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            _ASKED.append([f.filename for f in traceback.extract_stack()])
            raise ImportError(f"{name} is blocked in this test (the JAX reference must not need torch)")
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def test_reference_imports_loads_and_runs_without_torch(tiny_ckpt):
    """`import reference_jax.model`, load the tiny checkpoint (MXFP4 experts, bf16, A_log padding: every load path),
    run a forward, and save it back, with torch unimportable in a child process."""
    script = _BLOCKER + textwrap.dedent(
        f"""
        import numpy as np
        from reference_jax.model import load_model, load_params_tree, save_params_tree

        model, params, cfg = load_model({str(tiny_ckpt)!r}, layers=4)  # KDA, MoE (MXFP4) and a DSA layer
        logits = model.apply({{"params": params}}, np.arange(1, 9)[None] % cfg.vocab_size)
        assert logits.shape == (1, 8, cfg.vocab_size) and bool(np.isfinite(np.asarray(logits)).all())
        tree, full = load_params_tree({str(tiny_ckpt)!r})
        save_params_tree({str(tiny_ckpt.parent / "no_torch_save")!r}, tree, full)
        own = ("{REPO / "kimi"}", "{REPO / "reference_jax"}")
        bad = [s for s in _ASKED if any(f.startswith(own) for f in s)]
        assert not bad, "torch asked for by: " + repr(bad[0])
        assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
        print("no torch: ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "no torch: ok" in r.stdout, r.stdout + r.stderr
    # What the torch-free save wrote is byte for byte the original checkpoint.
    a, b = stored_bytes(tiny_ckpt), stored_bytes(tiny_ckpt.parent / "no_torch_save")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)


def _torch_side_canonical(path, cfg) -> dict[str, torch.Tensor]:
    """The canonical params computed independently on the torch side from safetensors' own torch reader: plain
    tensors as stored, A_log sliced to [H], conv weights as [C, 1, W], MXFP4 decoded here in float64."""
    raw = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        raw.update({k.removeprefix(cfg.key_prefix): v for k, v in load_file(f).items()})
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    out = {}
    for name, t in raw.items():
        if name.endswith(".weight_packed"):
            scale = raw[name.removesuffix("_packed") + "_scale"].to(torch.float64)
            codes = torch.stack((t & 0xF, t >> 4), dim=-1).reshape(t.shape[0], -1).long()
            w = table[codes] * torch.repeat_interleave(2.0 ** (scale - 127), cfg.quant_group_size, dim=1)
            out[name.removesuffix("_packed")] = w.to(getattr(torch, cfg.dtype))
        elif name.endswith(".weight_scale"):
            continue
        elif name.endswith(".self_attn.A_log"):
            out[name] = t.reshape(-1)[: cfg.kda_num_heads]
        elif name.endswith("_conv1d.weight"):
            out[name] = t.reshape(t.shape[0], 1, -1)
        else:
            out[name] = t
    return out


def _bits(a) -> tuple[str, tuple, bytes]:
    a = np.asarray(a)
    return str(a.dtype), a.shape, np.ascontiguousarray(a).view(np.uint8).tobytes()


@pytest.mark.parametrize("which", ["tiny", "tiny-linear"])
def test_jax_load_is_bit_exact_to_torch_load(which, tiny_ckpt, tiny_linear_ckpt):
    """The numpy load path (no torch) gives exactly the torch path's parameters, bf16 and dequantised MXFP4
    included: against load_params (torch tensors) and against safetensors' torch reader with a float64 decode."""
    path = tiny_ckpt if which == "tiny" else tiny_linear_ckpt
    tree, cfg = load_params_tree(path)  # stored dtypes kept
    flat = {".".join(k): v for k, v in _flatten(tree).items()}
    torch_params = load_params(path)
    independent = _torch_side_canonical(path, cfg)
    assert torch_params.keys() == independent.keys()
    assert {path_to_name(tuple(k.split("."))) for k in flat} == set(torch_params)
    dtypes = set()
    for key, arr in flat.items():
        name = path_to_name(tuple(key.split(".")))
        t = torch_params[name]
        ref = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
        assert _bits(arr) == _bits(ref), name
        ind = independent[name]
        ind = ind.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if ind.dtype == torch.bfloat16 else ind.numpy()
        assert _bits(arr) == _bits(ind), name
        dtypes.add(str(np.asarray(arr).dtype))
    assert "bfloat16" in dtypes and "float32" in dtypes
    # load_model's cast (fp32 here) equals casting the torch tensors.
    _, params32, _ = load_jax_model(path)
    flat32 = {".".join(k): v for k, v in _flatten(params32).items()}
    for key, arr in flat32.items():
        name = path_to_name(tuple(key.split(".")))
        assert _bits(arr) == _bits(torch_params[name].float().numpy()), name
        assert arr.dtype == jnp.float32
