"""Expert parallelism (kernels_torch.parallel.expert) equals one process: outputs, routing and every gradient.

Processes are spawned by the test (``dist_helpers.run_workers``: gloo on CPU). Every rank builds the same
full ``KimiMoE`` from one seed and all ranks' token batches from one generator, and runs the single-process
reference itself on the concatenation of all ranks' tokens (the MoE is token-local, so rank r's rows of it are what
EP must give on rank r). The EP layer is a fresh ``KimiMoE`` (another seed) sharded by ``shard_experts`` and loaded
from the reference's full state dict by slicing. Uneven batches: rank 0 has [2, 5] tokens, rank 1 a single token,
ranks 2-3 [1, 9] and [1, 2]. Cases: the tiny preset with a random correction bias and routed_scaling_factor 2.5;
a bias that starves the last rank's experts (it receives no row at all, runs no expert, and still takes part in both
all-to-alls and their backward) and expert 0 (no token anywhere); the Kimi-Linear-style layer (no latent
projection, SiLU, softmax router without renormalisation) in fp32; grouped top-k (16 experts in 4 groups, top-2
groups, k = 4); and a 3-layer model (dense layer 0, two MoE layers) end to end.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_workers
from helpers import rel
from torch import nn
from torch.distributed.tensor import DTensor

from kernels_torch.parallel.expert import experts_per_rank
from kimi.config import load_config

SHAPES = [(2, 5), (1, 1), (1, 9), (1, 2)]  # [B, T] of rank 0, 1, 2, 3: uneven token counts
# named tolerances (relative error): fp64 measures the algorithm, fp32 the rounding of a different summation order
TOL = {
    torch.float64: {"out": 1e-12, "x.grad": 1e-11, "router.grad": 1e-11, "expert.grad": 1e-11, "param.grad": 1e-11},
    torch.float32: {"out": 1e-5, "x.grad": 1e-5, "router.grad": 1e-5, "expert.grad": 1e-5, "param.grad": 1e-5},
}
TOL_LOGITS, TOL_MODEL_GRAD = 1e-12, 1e-12  # the 3-layer model, fp64
_EXPERT = re.compile(r"(^|\.)experts\.(\d+)\.")
_STACK = re.compile(r"(^|\.)experts\.w[123]$")  # the stacked routed experts (E rows; a rank holds E / world)


# ------------------------------------------------------------------------------------------------ no processes


def test_experts_per_rank():
    assert experts_per_rank(896, 64) == 14
    assert experts_per_rank(8, 4) == 2
    with pytest.raises(ValueError, match=r"num_experts: got 896 for an expert-parallel group of 3 ranks"):
        experts_per_rank(896, 3)
    with pytest.raises(ValueError, match="world: got 0"):
        experts_per_rank(8, 0)


# ------------------------------------------------------------------------------------------------ spawned ranks


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of an expert-parallel DTensor (the stacks and their gradients); other tensors as they are."""
    return t.to_local() if isinstance(t, DTensor) else t


def _check(name: str, got, want, tol: float, errors: list[str]) -> None:
    if want is None and got is None:
        return
    got = torch.zeros_like(want) if got is None else got
    want = torch.zeros_like(got) if want is None else want
    err = float(got.norm()) if want.norm() == 0 else rel(got, want)
    if not err <= tol:
        errors.append(f"{name}: rel err {err:.3e} > {tol:.0e}")


def _tol_key(name: str) -> str:
    if _EXPERT.search(name) or _STACK.search(name):
        return "expert.grad"
    return "router.grad" if name.startswith("gate.") else "param.grad"


def _moe_case(cfg, dtype, world, rank, errors, tag, bias=None, moe_kernel=None):
    """One MoE layer: single-process reference on all ranks' tokens vs EP on this rank's tokens (the local experts on
    ``moe_kernel``; the reference always runs the readable loop)."""
    from kernels_torch.moe import KimiMoE
    from kernels_torch.parallel.expert import shard_experts
    from kernels_torch.params import canonical_state_dict

    torch.manual_seed(0)
    ref = KimiMoE(cfg).to(dtype)
    ref.experts.moe_kernel = "loop"
    with torch.no_grad():
        for p in ref.parameters():  # every weight random, also the norm (ones at init)
            p.add_(0.05 * torch.randn_like(p))
        ref.gate.e_score_correction_bias.copy_(bias if bias is not None else 0.1 * torch.randn(cfg.num_experts))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(*SHAPES[j], cfg.hidden_size, generator=g, dtype=dtype) for j in range(world)]
    Rs = [torch.randn(x.shape, generator=g, dtype=dtype) for x in xs]

    # reference: one process, every rank's tokens as one batch
    xr = [x.clone().requires_grad_() for x in xs]
    out_r, aux_r = ref(torch.cat([x.reshape(-1, cfg.hidden_size) for x in xr])[None], return_aux=True)
    (out_r[0] * torch.cat([R.reshape(-1, cfg.hidden_size) for R in Rs])).sum().backward()
    lo = sum(xs[j].shape[0] * xs[j].shape[1] for j in range(rank))
    hi = lo + xs[rank].shape[0] * xs[rank].shape[1]
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    lo_e, hi_e = rank * cfg.num_experts // world, (rank + 1) * cfg.num_experts // world
    ref_grads = {n: g[lo_e:hi_e] if _STACK.search(n) else g for n, g in ref_grads.items()}  # this rank's experts

    # expert parallel: a fresh layer, sharded, loaded from the full state dict by slicing
    torch.manual_seed(123)
    moe = KimiMoE(cfg).to(dtype)
    moe.experts.moe_kernel = moe_kernel
    ep = shard_experts(moe)
    full = ref.state_dict()
    ep.load_full_state_dict(full)
    El = cfg.num_experts // world
    if set(moe.state_dict()) != set(full) or moe.experts.expert_ids != range(lo_e, hi_e):
        errors.append(f"{tag}: state_dict keys {sorted(set(moe.state_dict()) ^ set(full))} or expert ids differ")
    for w in ("w1", "w3", "w2"):  # this rank's rows of each stack, exactly
        stack = moe.state_dict()[f"experts.{w}"]  # a DTensor: global [E, ...], Shard(0) over the ep mesh
        if not isinstance(stack, DTensor) or stack.shape != full[f"experts.{w}"].shape:
            errors.append(f"{tag}: experts.{w} is not a DTensor of the global stack's shape")
        elif not torch.equal(_local(stack), full[f"experts.{w}"][lo_e:hi_e]):
            errors.append(f"{tag}: experts.{w} is not rows [{lo_e}, {hi_e}) of the full stack")
    canon = canonical_state_dict(moe)  # global expert ids, as the checkpoint names them
    want_canon = {
        k for k in canonical_state_dict(ref) if not _EXPERT.search(k) or int(_EXPERT.search(k).group(2)) // El == rank
    }
    if set(canon) != want_canon:
        errors.append(f"{tag}: canonical keys {sorted(set(canon) ^ want_canon)} differ from this rank's slice")
    # the canonical (per-expert) form of the full state dict loads the same weights
    moe2 = KimiMoE(cfg).to(dtype)
    ep2 = shard_experts(moe2)
    ep2.load_full_state_dict(canonical_state_dict(ref))
    if any(
        not torch.equal(_local(a), _local(b)) for a, b in zip(moe.state_dict().values(), moe2.state_dict().values())
    ):
        errors.append(f"{tag}: loading the canonical full state dict gave other weights than the stacked one")
    for bad, what in (({k: v for k, v in full.items() if k != "gate.weight"}, "missing"), ({**full, "w9": 0}, "unexp")):
        try:
            ep.load_full_state_dict(bad)
            errors.append(f"{tag}: load_full_state_dict accepted a state dict with a key {what}...")
        except ValueError as e:
            if what not in str(e):
                errors.append(f"{tag}: load_full_state_dict: unclear error {e}")
    stray = f"experts.{cfg.num_experts}.w1.weight"  # one id too far
    try:
        ep.load_full_state_dict({**full, stray: 0})
        errors.append(f"{tag}: load_full_state_dict dropped {stray} (an expert id past num_experts) silently")
    except ValueError as e:
        if f"expert {cfg.num_experts}" not in str(e):
            errors.append(f"{tag}: load_full_state_dict: unclear error {e}")
    x = xs[rank].clone().requires_grad_()
    out, aux = moe(x, return_aux=True)
    (out * Rs[rank]).sum().backward()

    tol = TOL[dtype]
    B, T = SHAPES[rank]
    _check(f"{tag} out", out, out_r[0, lo:hi].reshape(B, T, -1), tol["out"], errors)
    _check(f"{tag} x.grad", x.grad, xr[rank].grad, tol["x.grad"], errors)
    if not torch.equal(aux["expert_ids"].reshape(-1), aux_r["expert_ids"][0, lo:hi].reshape(-1)):
        errors.append(f"{tag}: expert_ids differ from the single-process router")
    for n, p in moe.named_parameters():
        gr = torch.zeros_like(_local(p)) if p.grad is None else _local(p.grad).clone()
        if not _STACK.search(n):  # replicated: each rank holds its tokens' part
            dist.all_reduce(gr)
        _check(f"{tag} {n}.grad", gr, ref_grads[n], tol[_tol_key(n)], errors)
    if moe.gate.e_score_correction_bias.grad is not None:
        errors.append(f"{tag}: e_score_correction_bias got a gradient (it only chooses experts)")
    return aux_r["expert_ids"]


def _model_case(cfg, world, rank, errors):
    """A 3-layer model (dense layer 0, MoE layers 1-2), fp64: logits and every gradient."""
    from kernels_torch.model import KimiK3Model
    from kernels_torch.parallel.expert import shard_experts

    torch.manual_seed(2)
    ref = KimiK3Model(cfg).double()
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, cfg.vocab_size, (1, SHAPES[j][0] * SHAPES[j][1] + 2), generator=g) for j in range(world)]
    Rs = [torch.randn(*i.shape, cfg.vocab_size, generator=g, dtype=torch.float64) for i in ids]
    logits_r = [ref(i) for i in ids]
    sum((lg * R).sum() for lg, R in zip(logits_r, Rs)).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    lo_e, hi_e = rank * cfg.num_experts // world, (rank + 1) * cfg.num_experts // world
    ref_grads = {n: g[lo_e:hi_e] if _STACK.search(n) else g for n, g in ref_grads.items()}

    with torch.device("meta"):
        model = KimiK3Model(cfg).double()
    ep = shard_experts(model)
    model.to_empty(device="cpu")
    ep.load_full_state_dict(ref.state_dict())
    logits = model(ids[rank])
    (logits * Rs[rank]).sum().backward()
    _check("model logits", logits, logits_r[rank], TOL_LOGITS, errors)
    for n, p in model.named_parameters():
        gr = torch.zeros_like(_local(p)) if p.grad is None else _local(p.grad).clone()
        if not _STACK.search(n):
            dist.all_reduce(gr)
        _check(f"model {n}.grad", gr, ref_grads[n], TOL_MODEL_GRAD, errors)


def _worker(rank: int, world: int) -> None:
    from kernels_torch.moe import KimiMoE
    from kernels_torch.parallel.expert import shard_experts

    tiny = load_config("tiny")
    errors: list[str] = []
    E = tiny.num_experts
    _moe_case(tiny.replace(routed_scaling_factor=2.5), torch.float64, world, rank, errors, "tiny")

    # starve the last rank's experts and expert 0: the last rank receives nothing, expert 0 has no token anywhere
    El = E // world
    bias = torch.zeros(E)
    bias[0] = bias[E - El :] = -10.0
    ids = _moe_case(tiny, torch.float64, world, rank, errors, "starved", bias=bias)
    if bool((ids == 0).any()) or bool((ids >= E - El).any()):
        errors.append("starved: the bias did not starve the experts it should (test setup)")

    linear = tiny.replace(
        routed_expert_hidden_size=None,
        hidden_act="silu",
        activation_situ_linear_beta=None,
        moe_router_activation_func="softmax",
        moe_renormalize=False,
        quant_method=None,
    )
    _moe_case(linear, torch.float32, world, rank, errors, "kimi-linear fp32")
    # the local experts on the grouped GEMMs (torch._grouped_mm runs fp32 on a CPU), starved experts included
    _moe_case(linear, torch.float32, world, rank, errors, "grouped_mm fp32", bias=bias, moe_kernel="grouped_mm")
    grouped = tiny.replace(num_experts=16, num_experts_per_token=4, num_expert_group=4, topk_group=2)
    _moe_case(grouped, torch.float64, world, rank, errors, "grouped 4x2")

    if world == 2:  # the whole model once
        _model_case(tiny.truncated(3), world, rank, errors)

    # a clear error when the experts do not divide over the group
    try:
        shard_experts(KimiMoE(tiny.replace(num_experts=2 * world + 1)))
        errors.append("num_experts not divisible by the world size was accepted")
    except ValueError as e:
        if f"num_experts: got {2 * world + 1} for an expert-parallel group of {world} ranks" not in str(e):
            errors.append(f"unclear error for indivisible num_experts: {e}")

    # a group without this rank: refused (rank -1 took the last experts, counted from the end, silently)
    first = dist.new_group([0])  # every rank calls new_group; the others get a non-member handle
    try:
        ep = shard_experts(KimiMoE(tiny), first)
        if rank != 0:
            errors.append(f"a group without rank {rank} was accepted (local experts {list(ep.local_experts)})")
    except ValueError as e:
        if rank == 0 or f"global rank {rank}) is not a member of the expert-parallel group" not in str(e):
            errors.append(f"group [0] on rank {rank}: {e}")

    # a refusal changes nothing: one MoE layer already sharded, the model's other one is left as it was
    model = nn.Sequential(KimiMoE(tiny), KimiMoE(tiny))
    shard_experts(model[1])
    try:
        shard_experts(model)
        errors.append("a model holding an expert-parallel MoE was sharded again")
    except ValueError:
        first_ok = model[0].experts.expert_ids == range(E) and model[0].experts.num_experts == E
        if not first_ok or model[0].routed_experts.__self__ is not model[0]:
            errors.append("a refused shard_experts left the first MoE layer sharded")
    if errors:
        raise AssertionError(f"rank {rank}/{world}:\n" + "\n".join(errors))


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_process(world):
    run_workers(_worker, world)
