"""What the tests share: the relative error every numerics test compares by, a check that names the tensor and its
tolerance, and the gloo process spawner of the distributed tests. No test lives here; importing it needs no GPU.

``from helpers import rel, check_rel, spawn``: ``tests/conftest.py`` puts ``tests/`` on pytest's path (its
default ``prepend`` import mode), so the tests in ``tests/gpu`` import it the same way.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable

import numpy as np
import torch


def _f64(x) -> torch.Tensor:
    """``x`` (a torch tensor on any device, a numpy or JAX array, a number) as a detached fp64 torch tensor."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    return torch.from_numpy(np.array(x, dtype=np.float64, copy=True))


def rel(a, b) -> float:
    """``||a - b|| / ||b||`` (Frobenius, in fp64) of torch tensors (detached, any device), numpy or JAX arrays.

    ``inf`` where ``a`` holds a NaN or an infinity (so ``rel(a, b) <= tol`` fails on it); ``0.0`` where ``a`` and
    ``b`` are both exactly zero; ``inf`` where only ``b`` is.

    Raises:
        ValueError: ``a`` and ``b`` of different shapes (broadcasting would hide a wrong layout).
    """
    a, b = _f64(a), _f64(b)
    if a.shape != b.shape:
        raise ValueError(f"rel: got shapes {tuple(a.shape)} and {tuple(b.shape)}, expected equal shapes")
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    num, den = float((a - b).norm()), float(b.norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def check_rel(name: str, got, want, tol: float) -> float:
    """Assert ``rel(got, want) <= tol``; the failure names the tensor, the error and the tolerance. Returns the error."""
    err = rel(got, want)
    assert err <= tol, f"{name}: rel error {err:.3e} > tolerance {tol:.1e}"
    return err


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for ``init_process_group``'s ``tcp://`` rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable, world: int, *args) -> None:
    """Run ``worker(rank, world, port, *args)`` in ``world`` processes (``torch.multiprocessing.spawn``, joined; a
    rank's exception fails the test with its traceback), ``port`` a free one for the group's ``tcp://`` rendezvous."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world, free_port(), *args), nprocs=world, join=True)
