"""The JAX reference under a ``jax.sharding.Mesh`` (reference_jax/sharding.py) equals one device.

Run in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (this test run's own JAX keeps its
single CPU device): a ``(seq=2, model=4)`` mesh, the tiny preset cut to 4 layers (KDA x 3, DSA; dense and MoE; AttnRes), fp64,
packed documents; logits sharded ``P(None, "seq", "model")`` against the unsharded forward.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOL = {"logits": 1e-10}

SCRIPT = r"""
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
from kimi.config import load_config
from kimi.init import init_params
from reference_jax.model import KimiK3Model
from reference_jax.params import to_tree
from reference_jax.sharding import logits_fn, make_mesh, param_specs, sharded_logits, shard_params

assert len(jax.devices()) == 8, jax.devices()
cfg = load_config("tiny").replace(index_topk=8).truncated(4)
tree = to_tree(init_params(load_config("tiny"), seed=0, layers=4), jnp.float64)
model = KimiK3Model(cfg)
ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 32))
cu = [0, 3, 20, 32]
want = jax.jit(logits_fn(model, cu))(tree, jnp.asarray(ids))  # one device, no sharding (jit: one compile)
mesh = make_mesh(seq=2, model=4)
got = sharded_logits(model, tree, ids, mesh, cu_seqlens=cu)
assert got.sharding.spec == jax.sharding.PartitionSpec(None, "seq", "model"), got.sharding
err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
placed, _ = shard_params(tree, mesh)
leaves = jax.tree_util.tree_leaves(placed)
total = sum(x.nbytes for x in leaves)
per_dev = sum(x.addressable_shards[0].data.nbytes for x in leaves)
_, replicated = param_specs(tree, mesh)
print(f"RESULT err={err:.3e} per_device_fraction={per_dev / total:.3f} replicated_dims={len(replicated)}")
"""


@pytest.mark.distributed
@pytest.mark.slow  # ~28 s of CPU: two whole-model compilations, one of them for 8 devices
def test_reference_sharded_equals_one_device():
    env = {
        **os.environ,
        "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip(),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT"))
    fields = dict(kv.split("=") for kv in line.split()[1:])
    assert float(fields["err"]) <= TOL["logits"], line
    assert float(fields["per_device_fraction"]) <= 0.5, line  # most bytes split 4 ways over "model"


def test_model_modules_never_import_sharding():
    for f in (ROOT / "reference_jax").glob("*.py"):
        if f.name != "sharding.py":
            assert "sharding" not in f.read_text(encoding="utf-8"), f"{f.name} mentions sharding"
