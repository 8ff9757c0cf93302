"""Shared by the process-spawning tests (`test_context_parallel.py`, `test_expert_parallel.py`, `test_fsdp.py`):
the relative error they compare by and a free TCP port for each group's rendezvous."""

from __future__ import annotations

import socket

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` (the reference ``b`` floored at 1e-300)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for ``init_process_group``'s ``tcp://`` rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
