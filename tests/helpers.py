"""What the tests share: the relative error every numerics test compares by, a check that names the tensor and its
tolerance (the distributed tests' process helpers are in ``dist_helpers``). No test lives here; importing it needs no
GPU.

``from helpers import rel, check_rel``: ``tests/conftest.py`` puts ``tests/`` on pytest's path (its
default ``prepend`` import mode), so the tests in ``tests/gpu`` import it the same way.
"""

from __future__ import annotations

import math
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


def spawn(worker: Callable, world: int, *args) -> None:
    """``worker(rank, world, *args)`` in ``world`` gloo ranks through ``dist_helpers.run_workers`` (the group made,
    barriered and destroyed around it). A worker that runs the trainer as a torchrun rank would takes a third
    parameter ``groups`` (``dist_helpers.TrainerGroups``: it opens one group per run of the trainer, no port)."""
    from dist_helpers import run_workers

    run_workers(worker, world, *args)


class RouterTape:
    """Forward hooks on every ``kernels_torch.moe.MoEGate`` of ``model``: records its routing, or replays a recording.

    While ``on`` is true (``with tape:`` sets it for the block), each gate call:

    * **records** (``replay=None``): appends ``(ids [N, k] int64, weights [N, k], gap [N] fp32)`` to ``calls``, where
      ``gap`` is the k-th minus the (k+1)-th selection score of each row (``selection_scores``, groups ignored): how
      near a tie the pick was;
    * **replays** (``replay=calls`` of another tape): returns the next recorded ``(ids, weights)`` (rows
      ``rows`` of them) instead of its own pick, so that two paths run the same experts with the same weights
      (routing replay), and appends to ``splits`` the gate's own ``gap`` [N] where its own expert set differs
      from the recorded one (``inf`` where they agree).

    ``done()`` is true once a replay used every recorded call. Hooks fire on eager calls only, not in a CUDA
    graph's replay. ``remove()`` takes the hooks off.
    """

    def __init__(self, model: torch.nn.Module, replay: list | None = None, rows: slice = slice(None)):
        from kernels_torch.moe import MoEGate, selection_scores

        self._selection_scores = selection_scores
        self.on, self.calls, self.splits = False, [], []
        self.replay, self.rows, self._next = replay, rows, 0
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, MoEGate)]
        if not self.handles:
            raise ValueError("RouterTape: the model has no MoEGate")

    def _hook(self, gate, args, out):
        if not self.on:
            return None
        ids, weights = out
        k = ids.shape[-1]
        x = args[0].reshape(-1, args[0].shape[-1])
        s = self._selection_scores(x, gate.weight, gate.e_score_correction_bias, gate.config).float()
        top = s.topk(min(k + 1, s.shape[-1]), dim=-1).values
        gap = top[:, k - 1] - top[:, -1]
        if self.replay is None:
            self.calls.append((ids.reshape(-1, k).clone(), weights.reshape(-1, k).clone(), gap))
            return None
        if self._next >= len(self.replay):
            raise IndexError(f"RouterTape: gate call {self._next + 1}, but the recording holds {len(self.replay)}")
        want_ids, want_w, _ = self.replay[self._next]
        self._next += 1
        want_ids, want_w = want_ids[self.rows], want_w[self.rows]
        if want_ids.shape != ids.reshape(-1, k).shape:
            raise ValueError(f"RouterTape: recorded ids {tuple(want_ids.shape)}, the gate picked {tuple(ids.shape)}")
        differ = (want_ids.sort(-1).values != ids.reshape(-1, k).sort(-1).values).any(-1)
        self.splits.append(torch.where(differ, gap, torch.full_like(gap, math.inf)))
        return want_ids.reshape(ids.shape), want_w.reshape(weights.shape).to(weights.dtype)

    def __enter__(self) -> RouterTape:
        self.on = True
        return self

    def __exit__(self, *exc) -> None:
        self.on = False

    def done(self) -> bool:
        return self.replay is not None and self._next == len(self.replay)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
