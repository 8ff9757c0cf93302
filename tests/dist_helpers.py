"""How the distributed tests start processes: :func:`run_workers` (spawned gloo ranks running a function of the test
module) and :func:`torchrun` (a ``torchrun`` launch of a module, e.g. ``kimi train``). No test lives here.

What makes a rank abort or hang only some of the time, and what these helpers do about it:

* **Teardown while a peer still sends.** A rank that leaves its last collective first and destroys the group closes
  its gloo connections while a slower peer is still reading or writing on them; the peer then dies in gloo's C++
  threads (``terminate called without an active exception``) or raises "Connection closed by peer". After the worker
  returns, :func:`run_workers` makes every rank pass one barrier (so every collective and point-to-point transfer of
  every rank is complete), then destroys the group. A worker never initialises or destroys the default group itself.
* **Rendezvous ports.** A port drawn free by one process and bound later by another can be taken in between (by a
  test running beside it under ``pytest -n 2``). The spawned ranks meet through a ``FileStore`` in a fresh temporary
  folder, as PyTorch's own ``MultiProcessTestCase`` does: no port at all. ``torchrun --standalone`` binds its
  rendezvous store to a port the kernel chooses and hands that same bound store to its ranks (no port drawn and
  released); :func:`torchrun` relaunches only a launch that failed binding an address before any rank started.
* **Timeouts.** Every collective of a spawned group waits up to :data:`GROUP_TIMEOUT_S` for its peers: long enough
  for a rank starved of CPU on a loaded 2-core machine, short enough that a real hang (a collective one rank never
  joins) fails with gloo's timeout error well before pytest's own timeout (``pyproject.toml``).
* **Trainer ranks.** A worker that runs the trainer as a torchrun rank would (``kimi_tools.train``: the trainer
  makes its group from the torchrun environment, or takes one already made, and destroys it when a run ends) takes a
  third parameter ``groups`` (:class:`TrainerGroups`) instead of a port: ``groups.open()`` sets the torchrun
  environment and makes the default group through a ``FileStore`` of its own, once per run (phase) of the trainer,
  so a phase never needs a port drawn before it (one drawn for a second phase minutes earlier could be taken by then,
  or be another test's store). :func:`run_workers` gives such workers the same timeouts and failure reports.
* **Exceptions.** A rank that raises writes its traceback; :func:`run_workers` then stops the other ranks (which
  may wait forever in a collective the failed rank never joins) and raises one ``AssertionError`` holding every
  failed rank's traceback, the first to fail first, and naming ranks that died without a Python exception (a signal,
  a C++ abort: their stderr is in the test's captured output). A failed rank skips the barrier and the destroy
  (either could wait on a peer stuck in another collective) and leaves with ``os._exit``.
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the longest a collective of a spawned group waits for its peers (seconds); pytest's timeout is 1200 s
GROUP_TIMEOUT_S = 600
# after the first rank fails: how long the others get to write their own tracebacks before they are stopped (s)
FAILURE_GRACE_S = 5.0


class TrainerGroups:
    """The process groups of a trainer worker (module docstring, "Trainer ranks"): :meth:`open` makes the next one.

    Attributes:
        rank, world: this rank and the world size. opened: how many groups :meth:`open` made so far."""

    def __init__(self, folder: str, rank: int, world: int, timeout_s: float):
        self.folder, self.rank, self.world, self.timeout_s, self.opened = folder, rank, world, timeout_s, 0

    def open(self) -> None:
        """Set the torchrun environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``; no ``MASTER_PORT``) and make the
        default gloo group through a fresh ``FileStore`` (every rank opens its groups in the same order, so the
        ``n``-th group of each rank meets in the same file). Raises RuntimeError: a group is still open."""
        import datetime

        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("TrainerGroups.open: the previous group is still open (the trainer closes its own)")
        os.environ.update(RANK=str(self.rank), LOCAL_RANK=str(self.rank), WORLD_SIZE=str(self.world))
        store = dist.FileStore(os.path.join(self.folder, f"group{self.opened}"), self.world)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        self.opened += 1


def _takes_groups(worker: Callable) -> bool:
    params = list(inspect.signature(worker).parameters)
    return len(params) >= 3 and params[2] == "groups"


def _rank_main(worker: Callable, rank: int, world: int, store_file: str, errors: str, timeout_s: float, args) -> None:
    """One spawned rank (the target of each process of :func:`run_workers`; module docstring)."""
    import datetime

    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        if _takes_groups(worker):  # a trainer worker: its groups, one per run of the trainer
            worker(rank, world, TrainerGroups(errors, rank, world, timeout_s), *args)
        else:
            store = dist.FileStore(store_file, world)
            timeout = datetime.timedelta(seconds=timeout_s)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
            worker(rank, world, *args)
        if dist.is_initialized():
            dist.barrier()  # every rank's transfers complete before any closes its connections
            dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001 - reported to the parent (a SystemExit or KeyboardInterrupt too)
        text = f"{time.time():.6f}\n" + traceback.format_exc()
        Path(errors, f"rank{rank}.txt").write_text(text, encoding="utf-8")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: on failure the group is still up (its C++ threads must not be destroyed under it);
    # multiprocessing's fork start ends every child this way too
    os._exit(code)


def _check_worker(worker: Callable) -> None:
    params = list(inspect.signature(worker).parameters)
    if len(params) >= 3 and params[2] == "port":
        raise TypeError(
            f"run_workers: {worker.__qualname__}{inspect.signature(worker)} takes a port: a worker is called as "
            "worker(rank, world, *args) inside a gloo group run_workers made, or worker(rank, world, groups, *args) "
            "for a trainer worker (TrainerGroups); drop the port and the worker's own init_process_group"
        )


def run_workers(worker: Callable, world: int, *args, timeout_s: float = GROUP_TIMEOUT_S) -> None:
    """Run ``worker(rank, world, *args)`` in ``world`` spawned processes, inside one gloo process group.

    Each rank: one torch thread; ``init_process_group("gloo")`` through a ``FileStore`` in a fresh temporary folder
    (no port), every collective timing out after ``timeout_s`` seconds; the worker; a barrier; the group destroyed
    (module docstring). A trainer worker ``worker(rank, world, groups, *args)`` (third parameter named ``groups``)
    makes its own groups with :class:`TrainerGroups`; a group it leaves open is barriered and destroyed after it. ``worker`` is a module-level function of the test module (the ranks import it); ``args`` are
    pickled. Subgroups (``new_group``, ``init_device_mesh``) are made by the worker and destroyed with the group.

    Raises:
        AssertionError: a rank raised or died; the message holds every failed rank's traceback (the first to fail
            first) or its exit status.
        TypeError: ``worker`` takes a ``port`` third parameter (it would initialise the group itself).
        ValueError: ``world`` < 1.
    """
    import multiprocessing

    _check_worker(worker)
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"run_workers: world: got {world!r}, expected a positive integer")
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gloo-") as tmp:
        store_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(worker, rank, world, store_file, tmp, timeout_s, args),
                name=f"{worker.__name__}-rank{rank}",
            )
            for rank in range(world)
        ]
        try:
            for p in procs:
                p.start()
            _join(procs)
        finally:
            _stop(procs)
        failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
        if not failed:
            return
        raise AssertionError(_failure_report(worker, world, failed, Path(tmp)))


def _join(procs) -> None:
    """Wait until every rank has exited, or one failed and the others had :data:`FAILURE_GRACE_S` to follow."""
    from multiprocessing.connection import wait

    pending = {p.sentinel: p for p in procs}
    deadline = None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait(list(pending), timeout)
        if not ready:  # the grace after a failure is over
            return
        for s in ready:
            p = pending.pop(s)
            p.join()
            if p.exitcode != 0 and deadline is None:
                deadline = time.monotonic() + FAILURE_GRACE_S


def _stop(procs) -> None:
    """Terminate, then kill, the ranks still running (after a failure, or when the test itself was interrupted)."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _failure_report(worker: Callable, world: int, failed: dict[int, int | None], tmp: Path) -> str:
    raised = []
    for rank in failed:
        f = tmp / f"rank{rank}.txt"
        if f.exists():
            when, _, text = f.read_text(encoding="utf-8").partition("\n")
            raised.append((float(when), rank, text))
    raised.sort()
    lines = [f"run_workers({worker.__name__}, world={world}): {len(failed)} of {world} rank(s) failed"]
    for _, rank, text in raised:
        lines.append(f"--- rank {rank} raised:\n{text.rstrip()}")
    first = raised[0][1] if raised else None
    for rank, code in failed.items():
        if any(r == rank for _, r, _ in raised):
            continue
        if code is not None and code < 0 and first is not None:
            why = f"stopped with {signal.Signals(-code).name} after rank {first} failed"
        elif code is not None and code < 0:
            why = f"died with {signal.Signals(-code).name} without a Python exception (its stderr is above)"
        else:
            why = f"exited with status {code} without a Python exception (its stderr is above)"
        lines.append(f"--- rank {rank} {why}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ torchrun

# the launch itself (the agent's rendezvous store) could not bind its address: no rank ran, the launch may be redone
_BIND_FAILURE = re.compile(r"address already in use|EADDRINUSE", re.IGNORECASE)
TORCHRUN_ATTEMPTS = 3


def torchrun(nproc: int, argv: Sequence[str], timeout_s: float = 900) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc *argv`` from the repository root with
    this tree first on ``PYTHONPATH``, one OpenMP thread and JAX on the CPU; output captured (text).

    ``--standalone``: the launcher binds its rendezvous store to a port the kernel picks and hands that bound store
    to its ranks (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` is cleared so that it does), so no port is drawn here and
    none is released before use. A launch is redone (at most :data:`TORCHRUN_ATTEMPTS` in all) only when it failed
    binding an address before any rank started (no ``ChildFailedError`` in its output): never when a rank failed.
    The ranks' own teardown (a barrier before the group is destroyed) is ``kimi_tools.train.parallel.TrainParallel.close``.

    Raises:
        subprocess.TimeoutExpired: the launch ran past ``timeout_s`` seconds.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.update(OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *argv]
    for _ in range(TORCHRUN_ATTEMPTS):
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode == 0 or not _launch_bind_failure(r.stderr):
            return r
    return r


def _launch_bind_failure(stderr: str) -> bool:
    """The launcher failed to bind its own address before starting any rank (a rank's failure names
    ``ChildFailedError``; a rank's own bind error is a test failure, not retried)."""
    return bool(_BIND_FAILURE.search(stderr)) and "ChildFailedError" not in stderr
