"""One mesh for data, context and expert parallelism (kernels_torch.parallel.mesh, parallelize) equals one
process: loss and every gradient (the expert stacks' global gradients included) for 3 AdamW steps, fp64, at
dp 4 x ep 2 (efsdp 2), dp 2 x cp 2 x ep 2, dp 4 x ep 4 (efsdp 1) and dp 2 x cp 2; the DCP state written at
dp 4 x ep 2 resumes at ep 4, without expert parallelism and in one process with the same weights and AdamW moments.

Two silent failures of expert parallelism before the experts were DTensors are pinned here: DCP of an expert-parallel
model stored one rank's experts under the global key (loaded back, rank 0 held experts 4-7), and ``parallelize``
applied to an expert-parallel model sharded each rank's own experts as if they were the global stack (both ranks of
ep 2 ended up with global experts [0, 1, 6, 7]).

Every rank builds the same model from one seed and runs the one-process reference itself (each data-parallel group's
micro-batch in turn, losses averaged), then the parallel layouts one after the other in the same process group.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_workers
from helpers import rel

from kernels_torch.parallel.mesh import ParallelDims
from kimi.config import load_config

T = 40  # tokens of a micro-batch (one packed row), documents cut at CU
CU = [0, 7, 20, 33, 40]
STEPS = 3
LR = 1e-2
# fp64: the algorithm, not the rounding (sums in another order give ~1e-15; a wrong expert or factor gives > 1e-2)
TOL = {"loss": 1e-11, "grad": 1e-9, "param": 1e-9, "moment": 1e-9}
BF16_TOL = 2e-2  # bf16 compute (2^-8 = 3.9e-3 a rounding), gradients summed in fp32 across ranks vs bf16 in one process
LAYOUTS = {  # name: (dp, cp, ep)
    "dp4_ep2": (4, 1, 2),
    "dp2_cp2_ep2": (2, 2, 2),
    "dp4_ep4": (4, 1, 4),
    "dp2_cp2": (2, 2, 1),
}
_STACK = re.compile(r"experts\.w[123]$")


# ------------------------------------------------------------------------------------------------ no processes


def test_parallel_dims_fill_and_refusals():
    d = ParallelDims.fill(8, cp=2, ep=4)
    assert (d.dp, d.cp, d.ep, d.efsdp, d.dp_cp) == (4, 2, 4, 2, 8)
    assert d.describe() == "dp 4 x cp 2, ep 4 (efsdp 2)"
    assert ParallelDims.fill(4, ep=4).efsdp == 1
    with pytest.raises(ValueError, match=r"ep: got 3, expected a divisor of dp x cp = 2 x 2 = 4"):
        ParallelDims.fill(4, cp=2, ep=3)
    with pytest.raises(ValueError, match=r"ep: got 8, expected a divisor of dp x cp"):
        ParallelDims.fill(4, ep=8)
    with pytest.raises(ValueError, match=r"pp x dp x cp: got pp 1 x dp 3 x cp 2 = 6 ranks, expected the world size 4"):
        ParallelDims(4, dp=3, cp=2)
    with pytest.raises(ValueError, match=r"pp x cp: got pp 1 x cp 3, expected a positive divisor of the world size 4"):
        ParallelDims.fill(4, cp=3)
    d = ParallelDims.fill(8, pp=2, cp=2)  # the pipeline dimension: world = pp x dp x cp
    assert (d.pp, d.dp, d.cp, d.dp_cp) == (2, 2, 2, 4) and d.describe() == "pp 2 x dp 2 x cp 2"
    with pytest.raises(ValueError, match=r"pp x dp x cp: got pp 2 x dp 4 x cp 1 = 8 ranks, expected the world size 4"):
        ParallelDims(4, dp=4, pp=2)
    with pytest.raises(ValueError, match=r"ep: got 0, expected a positive integer"):
        ParallelDims(4, dp=4, ep=0)


# ------------------------------------------------------------------------------------------------ spawned ranks


def _config(layers: int = 4):
    # 8 experts, layer 0 dense, layers 1-3 MoE (KDA layers 0-2, DSA layer 3); AttnRes blocks of 4 layers, so at
    # layers=6 the block written at layer 4 is read by layer 5 (KDA, MoE) and the output mix: a block boundary inside
    return load_config("tiny").replace(index_topk=8).truncated(layers)


def _batches(cfg, dp: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``dp`` micro-batches (input ids, labels) ``[1, T]`` of a step, the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(dp):
        ids = torch.randint(0, cfg.vocab_size, (1, T + 1), generator=g)
        out.append((ids[:, :T], ids[:, 1:]))
    return out


def _reference(cfg, dp: int):
    """One process: per step, the mean over the dp micro-batches of each one's mean NLL; its loss, gradients (by
    name) and the model and AdamW after the steps."""
    from kernels_torch.model import KimiK3Model

    torch.manual_seed(0)
    model = _freeze(KimiK3Model(cfg).double())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, grads = [], []
    cu = torch.tensor(CU)
    for step in range(STEPS):
        total = 0.0
        for ids, labels in _batches(cfg, dp, step):
            loss = model.loss(ids, labels, cu) / T / dp
            loss.backward()
            total += float(loss)
        losses.append(total)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, losses, grads


def _freeze(model):
    """The LM stage's trainable set (kimi_tools.train.stages.LMStage): the DSA indexer has no LM-loss gradient (hard
    top-k); under CP its gathered keys give it a zero one, which AdamW's weight decay would act on."""
    for n, p in model.named_parameters():
        if ".indexer." in n:
            p.requires_grad_(False)
    return model


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _parallel_run(cfg, layout: str, errors: list[str], ref, save: str | None = None):
    """The layout's 3 steps against the reference: loss, every gradient, the weights after the steps."""
    from kernels_torch.model import KimiK3Model
    from kernels_torch.parallel.fsdp import global_token_count, init_mesh, save_checkpoint
    from kernels_torch.parallel.parallelize import parallelize

    dp, cp, ep = LAYOUTS[layout]
    _, ref_opt, ref_losses, ref_grads = ref
    mesh = init_mesh(dp=dp, cp=cp, ep=ep)
    torch.manual_seed(0)
    with torch.device("meta"):  # built on meta, sharded, then materialised: the trainer's order
        model = KimiK3Model(cfg).double()
    torch.manual_seed(0)
    full = KimiK3Model(cfg).double().state_dict()
    ctx = parallelize(_freeze(model), mesh).ctx
    model.to_empty(device="cpu")
    _load_full(model, full)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    my_dp = mesh["dp"].get_local_rank()
    cu = torch.tensor(CU)
    for step in range(STEPS):
        ids, labels = _batches(cfg, dp, step)[my_dp]
        if ctx is not None:
            ids, cu_l = ctx.shard(ids, cu)
            labels = ctx.shard_like(labels)
        else:
            cu_l = cu
        n_tok = global_token_count(ids.numel(), mesh)
        with warnings.catch_warnings():  # a wrapped layer that returns a view: its in-place use skips the all-gather
            warnings.filterwarnings("error", message=".*returned a view tensor.*")
            loss = model.loss(ids, labels, cu_l) / n_tok
            loss.backward()
        got = loss.detach().clone()
        dist.all_reduce(got)
        got = float(got) / dp
        if not abs(got - ref_losses[step]) <= TOL["loss"] * abs(ref_losses[step]):
            errors.append(f"{layout} step {step + 1}: loss {got} vs {ref_losses[step]}")
        for n, p in model.named_parameters():
            g = torch.zeros_like(_full(p)) if p.grad is None else _full(p.grad)
            want = ref_grads[step].get(n, torch.zeros_like(g))
            err = rel(g, want) if want.norm() > 0 else float(g.norm())
            if not err <= TOL["grad"]:
                errors.append(f"{layout} step {step + 1}: {n}.grad rel err {err:.2e}")
        opt.step()
        opt.zero_grad(set_to_none=True)
    _compare_state(model, opt, ref, layout, errors)
    if save:
        save_checkpoint(save, model, opt)


def _load_full(model, full: dict) -> None:
    """Copy full tensors into a sharded model (each rank keeps its part of each)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))


def _compare_state(model, opt, ref, tag: str, errors: list[str]) -> None:
    """Weights and AdamW moments of ``model`` / ``opt`` against the reference's, by parameter name."""
    ref_model, ref_opt = ref[0], ref[1]
    ref_params = dict(ref_model.named_parameters())
    for n, p in model.named_parameters():
        err = rel(_full(p.detach()), ref_params[n].detach())
        if not err <= TOL["param"]:
            errors.append(f"{tag}: {n} rel err {err:.2e}")
        want = ref_opt.state.get(ref_params[n], {})
        have = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in want and (key not in have or not rel(_full(have[key]), want[key]) <= TOL["moment"]):
                errors.append(f"{tag}: {n} AdamW {key} differs")


def _resume(cfg, layout: str, path: str, ref, errors: list[str]) -> None:
    """Load the DCP state into a fresh model of another layout: the reference's weights and moments."""
    from kernels_torch.model import KimiK3Model
    from kernels_torch.parallel.fsdp import init_mesh, load_checkpoint
    from kernels_torch.parallel.parallelize import parallelize

    dp, cp, ep = LAYOUTS[layout]
    torch.manual_seed(7)  # other weights than the saved ones
    model = _freeze(KimiK3Model(cfg).double())
    parallelize(model, init_mesh(dp=dp, cp=cp, ep=ep))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    load_checkpoint(path, model, opt)
    _compare_state(model, opt, ref, f"resumed at {layout}", errors)


def _worker(rank: int, world: int, out: str) -> None:
    cfg = _config()
    errors: list[str] = []
    refs = {dp: _reference(cfg, dp) for dp in sorted({v[0] for v in LAYOUTS.values()})}
    for layout, (dp, _, _) in LAYOUTS.items():
        _parallel_run(cfg, layout, errors, refs[dp], save=f"{out}/dcp" if layout == "dp4_ep2" else None)
    for layout in ("dp4_ep4", "dp2_cp2"):  # the ep 2 state at ep 4 and without expert parallelism
        _resume(cfg, layout, f"{out}/dcp", refs[4], errors)
    if rank == 0:
        ref_model, ref_opt = refs[4][0], refs[4][1]
        names = {id(p): n for n, p in ref_model.named_parameters()}
        moments = {names[id(p)]: {k: s[k] for k in ("exp_avg", "exp_avg_sq")} for p, s in ref_opt.state.items()}
        torch.save({"model": ref_model.state_dict(), "moments": moments}, f"{out}/ref.pt")
    if errors:
        raise AssertionError(f"rank {rank}/{world}:\n" + "\n".join(errors[:40]))


@pytest.mark.distributed
def test_layouts_equal_one_process_and_dcp_reshards(tmp_path):
    from kernels_torch.model import KimiK3Model
    from kernels_torch.parallel.fsdp import load_checkpoint

    run_workers(_worker, 4, str(tmp_path))
    # the DCP state of dp 4 x ep 2 in one process (no process group): the same weights and AdamW moments
    ref = torch.load(tmp_path / "ref.pt")
    torch.manual_seed(7)
    model = _freeze(KimiK3Model(_config()).double())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        load_checkpoint(tmp_path / "dcp", model, opt)
    for n, v in model.state_dict().items():
        assert rel(v, ref["model"][n]) <= TOL["param"] or torch.equal(v, ref["model"][n]), n
    for n, p in model.named_parameters():
        for k, want in ref["moments"].get(n, {}).items():
            assert rel(opt.state[p][k], want) <= TOL["moment"], (n, k)


# ------------------------------------------------------------------------------------------------ silent failures


def _silent_worker(rank: int, world: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from kernels_torch.model import KimiK3Model
    from kernels_torch.parallel.expert import shard_experts
    from kernels_torch.parallel.fsdp import init_mesh
    from kernels_torch.parallel.parallelize import parallelize

    cfg = _config()
    errors = []
    torch.manual_seed(0)
    full = KimiK3Model(cfg).double().state_dict()
    # 1. DCP of an expert-parallel model (no FSDP): every rank's experts are written
    model = KimiK3Model(cfg).double()
    ep = shard_experts(model)
    ep.load_full_state_dict(full)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{out}/ep_dcp")

    # 2. parallelize over a mesh without ep, applied to a model already expert-parallel over the world group:
    # refused (it sharded each rank's own experts as if they were the global stack)
    model = KimiK3Model(cfg).double()
    shard_experts(model).load_full_state_dict(full)
    try:
        parallelize(model, init_mesh(dp=world))
        w1 = model.model.layers[1].block_sparse_moe.experts.w1.full_tensor()
        name = "model.layers.1.block_sparse_moe.experts.w1"
        if not torch.equal(w1, full[name]):
            errors.append("parallelize of an expert-parallel model ran and holds other experts than the model's")
    except ValueError as e:
        if "expert-parallel already" not in str(e):
            errors.append(f"unclear refusal: {e}")

    # 3. the mesh's own expert parallelism: each rank holds its global experts, FSDP2-sharded over efsdp
    model = KimiK3Model(cfg).double()
    model.load_state_dict(full)
    parallelize(model, init_mesh(dp=world, ep=world))
    bank = model.model.layers[1].block_sparse_moe.experts
    E = cfg.num_experts
    lo, hi = rank * E // world, (rank + 1) * E // world
    if bank.expert_ids != range(lo, hi):
        errors.append(f"rank {rank} holds experts {bank.expert_ids}, expected range({lo}, {hi})")
    for w in ("w1", "w3", "w2"):
        if not torch.equal(getattr(bank, w).full_tensor(), full[f"model.layers.1.block_sparse_moe.experts.{w}"]):
            errors.append(f"experts.{w}: the global stack differs from the model's")
    _bf16_case(_config(layers=6), world, rank, errors)
    if errors:
        raise AssertionError(f"rank {rank}/{world}:\n" + "\n".join(errors))


def _bf16_case(cfg, world: int, rank: int, errors: list[str]) -> None:
    """bf16 through FSDP2's MixedPrecisionPolicy at dp 2 x ep 2: the trainable bf16 parameters become fp32 shards,
    the checkpoint's fp32 tensors stay fp32 (in the forward too), the loss and gradients within a bf16 bound of one
    process in bf16 (each rank's micro-batch; the gradients summed). ``cfg`` of six layers crosses an AttnRes block
    boundary: with each layer handing on the block tensors it received (FSDP2 then gathers a layer a second time in
    the backward; ``kernels_torch.model._passed_on``) gradients of layers 0-1 here were 2.0e-2 and 3.8e-2 off (seen
    now: at most 2.9e-3, a bf16 rounding)."""
    from kernels_torch.model import model_from_params
    from kernels_torch.parallel.fsdp import fp32_compute_params, init_mesh
    from kernels_torch.parallel.parallelize import ParallelPolicy, parallelize
    from kimi.init import init_params

    params = init_params(load_config("tiny"), seed=0, layers=cfg.num_hidden_layers)
    ref = _freeze(model_from_params(cfg, params, "sdpa", torch.bfloat16, "cpu"))
    model = _freeze(model_from_params(cfg, params, "sdpa", torch.bfloat16, "cpu"))
    cu = torch.tensor(CU)
    batches = _batches(cfg, world, 0)
    total = sum(ref.loss(ids, labels, cu).float() / T / world for ids, labels in batches)
    total.backward()
    ignored = set(fp32_compute_params(model, torch.bfloat16))
    mesh = init_mesh(dp=world, ep=world)
    policy = ParallelPolicy(param_dtype=torch.bfloat16, gradient_divide_factor=1.0)
    parallelize(model, mesh, policy, ignored_params=ignored)
    attn = model.model.layers[0].self_attn
    seen = {}
    hook = attn.register_forward_pre_hook(lambda m, a: seen.update(A_log=m.A_log.dtype, q=m.q_proj.weight.dtype))
    ids, labels = batches[rank]
    loss = model.loss(ids, labels, cu).float() / T / world
    loss.backward()
    hook.remove()
    if seen != {"A_log": torch.float32, "q": torch.bfloat16}:
        errors.append(f"bf16: the forward saw {seen}, expected A_log float32 and q_proj bfloat16")
    for p in model.parameters():  # in model order (a set's order differs between processes)
        if p in ignored and p.grad is not None:
            dist.all_reduce(p.grad)  # whole on every rank: the caller sums their gradients
    got = loss.detach().clone()
    dist.all_reduce(got)
    if not rel(got, total.detach()) <= BF16_TOL:
        errors.append(f"bf16: loss {float(got)} vs {float(total)}")
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        want = ref_params[n]
        if p.dtype != (want.dtype if p in ignored or not p.requires_grad else torch.float32):
            errors.append(f"bf16: {n} held in {p.dtype} (one process {want.dtype}, trainable {p.requires_grad})")
        if want.grad is not None and not rel(_full(p.grad), want.grad) <= BF16_TOL:
            errors.append(f"bf16: {n}.grad rel err {rel(_full(p.grad), want.grad):.2e}")


@pytest.mark.distributed
def test_expert_parallel_dcp_and_parallelize_are_not_silent(tmp_path):
    """DCP of an ep 2 model loads in one process with all 8 experts; ``parallelize`` of an ep model over a mesh
    without that ep is refused; the mesh's own ep holds the global experts (both failed silently before)."""
    import torch.distributed.checkpoint as dcp

    from kernels_torch.model import KimiK3Model

    run_workers(_silent_worker, 2, str(tmp_path))
    torch.manual_seed(0)
    want = KimiK3Model(_config()).double().state_dict()
    torch.manual_seed(5)
    model = KimiK3Model(_config()).double()
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(state, checkpoint_id=str(tmp_path / "ep_dcp"))
    for k, v in state["model"].items():
        assert torch.equal(v, want[k]), k
