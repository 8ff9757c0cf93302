"""Shared fixtures: small checkpoints written by the project itself, in the real layout."""

import pytest

from kimi.config import load_config


def pytest_configure(config):
    """Run the JAX reference on the CPU in this test process.

    Why: the reference is the fp32/fp64 oracle and its tests are CPU-sized; on a GPU machine JAX would otherwise
    claim the accelerator (and preallocate most of its memory) next to the torch GPU tests. How: ``jax.config``,
    which is this process's JAX setting only. No environment variable is set, so nothing leaks into a user's own
    runs or into child processes (tests that start ``kimi`` in a subprocess pass ``JAX_PLATFORMS`` through
    ``env=``). A ``JAX_PLATFORMS`` the user set explicitly is respected. This runs before collection, so before any
    test module imports jax and picks a backend.
    """
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):  # one of pytest-xdist's `-n N` worker processes
        _one_thread_per_worker()
    if "JAX_PLATFORMS" not in os.environ:
        import jax

        jax.config.update("jax_platforms", "cpu")


def _one_thread_per_worker() -> None:
    """Under ``pytest -n N`` the N workers share the cores: each runs torch (and the processes its tests start: the
    ``kimi`` command line, torchrun ranks, notebook kernels) on one thread. With the default of one thread per core
    in every worker, OpenMP's spinning threads oversubscribe the machine: a notebook that takes 11 s alone took 120 s
    beside another worker on a 2-core machine. The variables are set in the worker's environment only (tests that
    compare numbers run both sides in the same setting), never in a user's shell."""
    import os

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The tiny preset, random-initialised (seed 0), written once per session."""
    from kimi.init import init_checkpoint

    path = tmp_path_factory.mktemp("tiny")
    init_checkpoint(path, load_config("tiny"), seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_linear_ckpt(tmp_path_factory):
    """A Kimi-Linear-shaped tiny checkpoint (keys without prefix, A_log [1,1,H,1], low-rank gates)."""
    from kimi.init import init_checkpoint

    path = tmp_path_factory.mktemp("tiny_linear")
    init_checkpoint(path, load_config("tiny-linear"), seed=1)
    return path


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly without CUDA (CI is CPU-only)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `"gpu" in item.keywords`: that also matches a path part
            item.add_marker(skip)
