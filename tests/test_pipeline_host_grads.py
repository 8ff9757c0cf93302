"""Pipeline stages under FSDP2's ``CPUOffloadPolicy`` and the per-layer policy (``shard_stages(fsdp="layer")``, a
reduce-scatter every micro-batch): with ``Pipeline.host_sums`` (``kimi train --pp N --offload cpu``) the host
gradients are taken out of ``.grad`` after each backward action, so that FSDP2 never adds a micro-batch's gradient
into an existing host ``.grad`` (its blocking copy and host add), and the step's gradients are FSDP2's own
accumulation bit for bit. pp2 x dp2 on 4 gloo ranks, the model of ``tests/test_pipeline_dualpipe.py`` in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_workers
from test_pipeline_dualpipe import M, _batch, _model

SCHEDULES = ("1F1B", "DualPipeV")


def _worker(rank: int, world: int) -> None:
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_mod
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    from kernels_torch.parallel.fsdp import HostGradSums, offloaded_params
    from kernels_torch.parallel.pipeline import Pipeline, shard_stages

    into_grad = [0]  # offloaded parameters whose reduce-scattered gradient FSDP2 added into an existing .grad
    reduce = group_mod.foreach_reduce

    def counted(fsdp_params, *args, **kwargs):
        into_grad[0] += sum(1 for fp in fsdp_params if fp.offload_to_cpu and fp.sharded_param.grad is not None)
        return reduce(fsdp_params, *args, **kwargs)

    group_mod.foreach_reduce = counted
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    rows = slice(M // 2 * dp.get_local_rank(), M // 2 * (dp.get_local_rank() + 1))
    ids, labels, cus = _batch(0)
    n = int((labels != -100).sum())
    errors = []
    for schedule in SCHEDULES:
        grads, counts = {}, {}
        for held in (False, True):
            pipe = Pipeline(_model(), pp_size=2, pp_rank=pp.get_local_rank(), n_microbatches=M // 2,
                            group=pp.get_group(), schedule=schedule,
                            stages_per_rank=1 if schedule == "1F1B" else 2)  # fmt: skip
            shard_stages(pipe, dp, fsdp="layer", offload_policy=CPUOffloadPolicy(pin_memory=False))
            params = [p for st in pipe.stages for p in offloaded_params(st)]
            assert params, "no offloaded parameter"
            if held:
                pipe.host_sums = HostGradSums(params)
            into_grad[0] = 0
            pipe.step(ids[rows], labels[rows], cus[rows], n_tokens=n)
            counts[held] = into_grad[0]
            grads[held] = {k: None if p.grad is None else p.grad.to_local().clone() for k, p in pipe.named_parameters()}
            if held and pipe.host_sums.held:
                errors.append(f"rank {rank} {schedule}: host sums still held after the step")
        where = f"rank {rank} {schedule}"
        if counts[False] == 0:  # the test's sensitivity: FSDP2 alone adds into .grad from the second micro-batch
            errors.append(f"{where}: FSDP2 alone added into no existing .grad")
        if counts[True] != 0:
            errors.append(f"{where}: {counts[True]} gradients added into an existing host .grad with host_sums")
        for k, want in grads[False].items():
            got = grads[True][k]
            if (got is None) != (want is None) or (want is not None and not torch.equal(got, want)):
                errors.append(f"{where}: {k}.grad differs from FSDP2's own accumulation (tolerance 0)")
    dist.barrier()
    if errors:
        raise AssertionError("\n".join(errors[:20]))


@pytest.mark.distributed
def test_pipeline_host_sums_take_every_backward_and_equal_fsdp2_accumulation():
    """pp2 x dp2, 4 micro-batches per dp rank, under 1F1B and DualPipeV (its split backwards run whole): with
    ``Pipeline.host_sums`` no micro-batch's gradient is added into an existing host ``.grad`` by FSDP2 (without it,
    some are: the test can tell), nothing is held after the step, and every gradient equals FSDP2's own
    accumulation bit for bit."""
    run_workers(_worker, 4)
