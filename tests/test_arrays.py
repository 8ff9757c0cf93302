"""kimi.arrays: exact numpy <-> torch conversion (bf16 bit for bit), dtype names, and no torch import of its own."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from kimi.arrays import dtype_name, is_array, is_torch_tensor, numpy_dtype, to_numpy, to_torch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8])
def test_round_trip_keeps_bits(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 5, generator=g) * 100).to(dtype)
    a = to_numpy(t)
    assert dtype_name(a) == dtype_name(t) == str(dtype).removeprefix("torch.")
    back = to_torch(a)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    assert to_torch(a, torch.float64).dtype == torch.float64


def test_read_only_and_strided_arrays_and_jax():
    a = np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4)[:, ::2]
    a.flags.writeable = False  # safetensors or jax buffers can be read-only: copied, not refused
    t = to_torch(a)
    assert t.dtype == torch.bfloat16 and t.tolist() == [[0, 2], [4, 6], [8, 10]]
    j = jnp.arange(4, dtype=jnp.bfloat16)
    assert to_numpy(j).dtype == ml_dtypes.bfloat16 and to_torch(to_numpy(j)).tolist() == [0, 1, 2, 3]


def test_dtype_names_and_kinds():
    assert numpy_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)
    assert numpy_dtype(torch.bfloat16) == np.dtype(ml_dtypes.bfloat16)
    assert numpy_dtype(np.float32) == np.float32 and numpy_dtype("uint8") == np.uint8
    with pytest.raises(ValueError, match="dtype: got 'bfloat17'"):
        numpy_dtype("bfloat17")
    assert is_torch_tensor(torch.ones(1)) and not is_torch_tensor(np.ones(1))
    assert is_array(np.ones(1)) and is_array(torch.ones(1)) and not is_array([1.0])
