"""Framework-neutral arrays for the shared base: numpy (with ``ml_dtypes.bfloat16``) inside, torch at the edge.

``kimi/`` reads, writes, quantises and initialises checkpoints in numpy, so that ``reference_jax`` can load them
without importing torch. The torch side gets torch tensors through :func:`to_torch`; torch is imported lazily, only
when a torch tensor is asked for or handed in (a torch tensor can only exist once torch is imported, so
:func:`is_torch_tensor` never imports it).

Conversions are exact: bf16 keeps its bits (``torch.bfloat16`` <-> ``ml_dtypes.bfloat16`` through an int16 view),
and dtype names are the ones :class:`kimi.layout.TensorSpec` uses (``"bfloat16"``, ``"float32"``, ``"uint8"``, ...),
which are both torch's and numpy's (ml_dtypes') names.
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["numpy_dtype", "dtype_name", "is_torch_tensor", "is_array", "to_numpy", "to_torch"]


def numpy_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype from a name (``"bfloat16"``, ``"float32"``, ...), a numpy dtype or a ``torch.dtype``.

    Raises:
        ValueError: an unknown dtype name.
    """
    if type(dtype).__module__ == "torch":  # torch.dtype: its name without the "torch." prefix
        dtype = str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and hasattr(ml_dtypes, dtype):  # bfloat16, float8_e4m3fn, ...
        return np.dtype(getattr(ml_dtypes, dtype))
    try:
        return np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype: got {dtype!r}, expected a numpy/torch dtype or a name like 'bfloat16'") from None


def dtype_name(x: Any) -> str:
    """The dtype name of a numpy array or torch tensor (``"bfloat16"``, ``"float32"``, ``"uint8"``, ...)."""
    if is_torch_tensor(x):
        return str(x.dtype).removeprefix("torch.")
    return np.dtype(x.dtype).name


def is_torch_tensor(x: Any) -> bool:
    """True for a ``torch.Tensor``; never imports torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_array(x: Any) -> bool:
    """True for a numpy array or a torch tensor (the two kinds the checkpoint functions accept)."""
    return isinstance(x, np.ndarray) or is_torch_tensor(x)


def to_numpy(x: Any) -> np.ndarray:
    """A numpy array with the same values and dtype (bf16 bit for bit). Torch tensors are detached and moved to the
    CPU (the result shares memory with a CPU tensor); numpy and jax arrays go through ``np.asarray``."""
    if is_torch_tensor(x):
        import torch

        t = x.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(x)


def to_torch(a: np.ndarray, dtype: Any = None) -> Any:
    """A CPU ``torch.Tensor`` with the values and dtype of ``a`` (bf16 bit for bit), or cast to ``dtype`` (a
    ``torch.dtype``). Shares memory with ``a`` when ``a`` is writable and C-contiguous; torch tensors pass through."""
    import torch

    if is_torch_tensor(a):
        return a if dtype is None else a.to(dtype)
    a = np.asarray(a)
    if not (a.flags.writeable and a.flags.c_contiguous):
        a = np.array(a, order="C")  # torch.from_numpy needs a writable buffer
    if a.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if dtype is None else t.to(dtype)
