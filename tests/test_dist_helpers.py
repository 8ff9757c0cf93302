"""``dist_helpers.run_workers`` with trainer workers (``TrainerGroups``): one group per run, no port, failures
reported; each group a fresh rendezvous."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_workers


def _two_runs(rank: int, world: int, groups, out: str) -> None:
    """Two runs as a trainer would do them: a group each (the first destroyed by the worker, as the trainer's close
    does; the second left open for ``run_workers``), with the torchrun environment set."""
    sums = []
    for run in range(2):
        groups.open()
        assert os.environ["RANK"] == str(rank) and os.environ["WORLD_SIZE"] == str(world)
        assert "MASTER_PORT" not in os.environ
        x = torch.tensor([float(rank + 1 + 10 * run)])
        dist.all_reduce(x)
        sums.append(float(x))
        if run == 0:
            dist.barrier()
            dist.destroy_process_group()
    torch.save({"sums": sums, "opened": groups.opened}, f"{out}.{rank}")


def _fails_on_rank1(rank: int, world: int, groups) -> None:
    groups.open()
    if rank == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()  # rank 0 waits here for a peer that never comes: run_workers stops it


@pytest.mark.distributed
def test_trainer_worker_opens_one_group_per_run(tmp_path):
    run_workers(_two_runs, 2, str(tmp_path / "r"))
    for rank in range(2):
        got = torch.load(tmp_path / f"r.{rank}")
        assert got == {"sums": [3.0, 23.0], "opened": 2}


@pytest.mark.distributed
def test_trainer_worker_failure_is_reported():
    with pytest.raises(AssertionError, match="rank 1 raised:[\\s\\S]*rank 1 refuses"):
        run_workers(_fails_on_rank1, 2)
