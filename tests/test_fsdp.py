"""FSDP2 + context parallelism on a 2-D mesh (dp=1, cp=2) equals one process: loss, every gradient and the weights
after one AdamW step; its DCP checkpoint loads in one process (world size 1) and gives the same logits; its HF
safetensors export equals ``save_model`` of the single-process model. Two gloo processes spawned by the test, fp64.
Six layers of the tiny preset, whose AttnRes blocks of 4 layers put a block boundary inside: the block written at
layer 4 is read by layer 5 and the output mix.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import run_workers
from helpers import rel

from kimi.config import load_config

T = 45
CU = [0, 3, 12, 40, 45]
TOL = {"loss": 1e-12, "grad": 1e-9, "param": 1e-9, "logits": 1e-9}


def _setup():
    from kernels_torch.model import KimiK3Model

    cfg = load_config("tiny").replace(index_topk=8).truncated(6)
    torch.manual_seed(0)
    model = KimiK3Model(cfg).double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, T + 1), generator=g)
    return model, ids[:, :T], ids[:, 1:]


def _loss(logits, labels, n_tokens):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum") / n_tokens


def _worker(rank: int, world: int, out: str) -> None:
    from kernels_torch.model import save_model
    from kernels_torch.parallel.fsdp import (
        export_safetensors,
        global_token_count,
        init_mesh,
        save_checkpoint,
    )
    from kernels_torch.parallel.parallelize import parallelize

    model, ids, labels = _setup()
    ref = copy.deepcopy(model)
    errors = []

    # one process: loss, gradients, one AdamW step
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    loss_r = _loss(ref(ids, torch.tensor(CU)), labels, T)
    loss_r.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    opt_r.step()

    # FSDP2 over the flattened (dp, cp) mesh + context parallelism over cp
    mesh = init_mesh(dp=1, cp=world)
    cp = parallelize(model, mesh).ctx
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    ids_l, cu_l = cp.shard(ids, torch.tensor(CU))
    n_tok = global_token_count(ids_l.numel(), mesh)
    loss = _loss(model(ids_l, cu_l), cp.shard_like(labels), n_tok)
    loss.backward()
    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum)
    if not rel(loss_sum, loss_r.detach()) <= TOL["loss"]:  # NaN fails
        errors.append(f"loss {float(loss_sum)} vs {float(loss_r)}")
    for n, p in model.named_parameters():
        got = torch.zeros_like(p).full_tensor() if p.grad is None else p.grad.full_tensor()
        want = ref_grads.get(n, torch.zeros_like(got))
        err = rel(got, want) if want.norm() > 0 else float(got.norm())
        if not err <= TOL["grad"]:
            errors.append(f"{n}.grad: rel err {err:.3e}")
    opt.step()
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        err = rel(p.detach().full_tensor(), ref_params[n].detach())
        if not err <= TOL["param"]:
            errors.append(f"{n} after one AdamW step: rel err {err:.3e}")

    # DCP checkpoint, logits after the step (gathered), the HF export of both
    save_checkpoint(f"{out}/dcp", model, opt)
    with torch.no_grad():
        cp.shard(ids, torch.tensor(CU))
        local = model(ids_l, cu_l)
    parts = [None] * world
    dist.all_gather_object(parts, local)
    export_safetensors(model, f"{out}/hf_fsdp")
    if rank == 0:
        torch.save(torch.cat(parts, dim=1), f"{out}/logits.pt")
        save_model(ref, f"{out}/hf_ref")
    if errors:
        raise AssertionError(f"rank {rank}/{world}:\n" + "\n".join(errors))


@pytest.mark.distributed
def test_fsdp_cp_step_dcp_and_export(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from kimi.checkpoint import CheckpointReader

    run_workers(_worker, 2, str(tmp_path))

    # the DCP folder written by 2 ranks loads in this process (world size 1) and gives the same logits
    model, ids, _ = _setup()
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    model.load_state_dict(state["model"])
    with torch.no_grad():
        logits = model(ids, torch.tensor(CU))
    want = torch.load(tmp_path / "logits.pt")
    assert rel(logits, want) <= TOL["logits"]

    # the HF safetensors export of the sharded model equals save_model of the single-process one
    files = sorted(p.name for p in (tmp_path / "hf_ref").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp_path / "hf_fsdp").glob("*.safetensors"))
    for name in files:
        a, b = load_file(tmp_path / "hf_fsdp" / name), load_file(tmp_path / "hf_ref" / name)
        assert a.keys() == b.keys()
        for k in a:
            assert rel(a[k].double(), b[k].double()) <= 1e-6 or torch.equal(a[k], b[k]), k
    assert CheckpointReader(tmp_path / "hf_fsdp").config.num_hidden_layers == 6


# ------------------------------------------------------------------------------------------------ DCP resharding


def _reshard_cfg():
    # 2 routed experts: on 3 ranks FSDP2 gives the stacked banks' rows as 1, 1, 0: the last rank holds no expert
    return load_config("tiny").replace(num_experts=2, num_experts_per_token=1).truncated(3)


def _reshard_worker(rank: int, world: int, out: str, mode: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from kernels_torch.model import KimiK3Model
    from kernels_torch.parallel.fsdp import (
        full_state_dict,
        init_mesh,
        load_checkpoint,
        save_checkpoint,
    )
    from kernels_torch.parallel.parallelize import parallelize

    torch.manual_seed(0 if mode == "save" else 5)  # the loading run starts from other weights
    model = KimiK3Model(_reshard_cfg()).double()
    parallelize(model, init_mesh(dp=world, cp=1))
    # lr 0: AdamW's moments move, the weights do not (the weight checks below compare with the initial ones)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    if mode == "save":
        g = torch.Generator().manual_seed(10 + rank)  # each rank its own batch
        ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=g)
        for _ in range(2):
            model(ids).double().square().mean().backward()
            opt.step()
            opt.zero_grad()
        save_checkpoint(f"{out}/dcp", model, opt)
    else:
        load_checkpoint(f"{out}/dcp", model, opt)
        sd = full_state_dict(model)
        if rank == 0:
            torch.save(sd, f"{out}/loaded_{world}.pt")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    osd = get_optimizer_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save(osd, f"{out}/optim_{mode}_{world}.pt")


@pytest.mark.distributed
def test_dcp_reshards_stacked_experts(tmp_path):
    """A DCP checkpoint written by 2 FSDP2 ranks loads on 3 (and 1) bitwise, stacked expert banks included, with a rank
    that holds no expert row (no hang); AdamW's moments and step count (two steps of the 2-rank run) load on the 3
    ranks bitwise, so a checkpoint that does not write, or a load that does not restore, the optimizer fails."""
    from kernels_torch.model import KimiK3Model
    from kernels_torch.parallel.fsdp import load_checkpoint

    run_workers(_reshard_worker, 2, str(tmp_path), "save")
    run_workers(_reshard_worker, 3, str(tmp_path), "load")
    torch.manual_seed(0)
    want = KimiK3Model(_reshard_cfg()).double().state_dict()
    got = torch.load(tmp_path / "loaded_3.pt")
    assert set(got) == set(want) and "model.layers.1.block_sparse_moe.experts.w1" in got
    for k in want:
        assert torch.equal(got[k], want[k]), k
    saved, loaded = torch.load(tmp_path / "optim_save_2.pt"), torch.load(tmp_path / "optim_load_3.pt")
    assert set(saved["state"]) == set(loaded["state"]) and len(saved["state"]) > 20
    moved = 0
    for name, s in saved["state"].items():
        assert set(s) == {"step", "exp_avg", "exp_avg_sq"}, name
        for key in s:
            assert torch.equal(loaded["state"][name][key], s[key]), f"{name}.{key}"
        assert float(s["step"]) == 2.0, name
        moved += bool(s["exp_avg"].abs().sum() > 0)
    assert moved > 20, moved  # real moments (not the zeros a fresh AdamW state holds)
    torch.manual_seed(7)
    one = KimiK3Model(_reshard_cfg()).double()  # world size 1, no process group
    load_checkpoint(tmp_path / "dcp", one)
    for k, v in one.state_dict().items():
        assert torch.equal(v, want[k]), k
