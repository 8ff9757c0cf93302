"""Shared fixtures: small checkpoints written by the project itself, in the real layout."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no accelerator probing on CPU machines (set before jax imports)

import pytest  # noqa: E402

from kimi.config import load_config  # noqa: E402


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
