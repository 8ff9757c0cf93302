"""Pipeline parallelism (``kernels_torch.parallel.pipeline``) equals one process: the loss and every gradient of 3
AdamW steps at pp2 (1F1B on an uneven 2 + 6 layout, GPipe), pp4 (1F1B) and 2 ranks x 2 stages (Interleaved1F1B),
micro-batches of packed documents (a different ``cu_seqlens`` per micro-batch, targets masked), gloo processes in
fp64; pp2 x dp2 (stages sharded by FSDP2), pp2 x ep2 (experts split over ep) and pp2 x cp2 (rows cut into
context shards, a different one current per micro-batch; also with activation recomputation, whose replayed
forwards must see their own micro-batch's shard) the same, and the DCP state of pp2 x dp2 resumed at pp4 and in
one process (weights and AdamW moments). Without processes: the stages chained by
hand equal ``KimiK3Model.loss``, and the layout, ``cu_seqlens`` and batch checks refuse bad input.

The model: tiny with AttnRes blocks of 2 layers over 8 layers (block writes at 0, 2, 4, 6), so that four stages cut
at block boundaries and later stages receive 2, 3 and 4 stacked sources.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_workers
from helpers import check_rel
from torch.distributed.tensor import DTensor

from kimi.config import load_config

T = 24
M = 4  # micro-batches = rows of a step
CUS = [[0, 5, 13, 24], [0, 24], [0, 2, 3, 17, 24], [0, 11, 24]]  # a packed row per micro-batch
# Rows whose context shards (2 of 12 tokens) hold documents of the same lengths in every micro-batch, [6, 6] each,
# but the second shard's first document either continues the one begun at 6 ([0, 6, 18, 24]: carried KDA state,
# conv window and keys) or starts at 12 ([0, 6, 12, 18, 24]): a forward replayed with another micro-batch's shard
# runs the same shapes (no checkpoint error) on other documents. With the first block's MLPs dense (no routing
# whose token counts would change the shapes), a wrong replay gives wrong gradients silently.
CARRY_CUS = [[0, 6, 18, 24], [0, 6, 12, 18, 24], [0, 6, 12, 18, 24], [0, 6, 18, 24]]
TOL = {"loss": 1e-12, "grad": 1e-9, "state": 1e-9}
STEPS = 3


def _cfg(dense: int = 1):
    """``dense``: the first layers with a dense MLP (``first_k_dense_replace``)."""
    return load_config("tiny").replace(index_topk=8, attn_res_block_size=2, first_k_dense_replace=dense).truncated(8)


def _model(seed: int = 0, dense: int = 1):
    from kernels_torch.model import KimiK3Model

    torch.manual_seed(seed)
    return KimiK3Model(_cfg(dense)).double()


def _batch(step: int, cus_set=CUS):
    """The step's rows: ids [M, T], labels [M, T] with some -100, per-row offsets from ``cus_set`` (rolled with
    the step)."""
    g = torch.Generator().manual_seed(100 + step)
    V = _cfg().vocab_size
    ids = torch.randint(0, V, (M, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[torch.rand(M, T, generator=g) < 0.2] = -100
    cus = [torch.tensor(cus_set[(r + step) % M]) for r in range(M)]
    return ids[:, :T], labels, cus


def _grad(p):
    """``p.grad``, or zeros where no gradient reached ``p`` (the indexer's weights get none from the LM loss)."""
    return torch.zeros_like(p) if p.grad is None else p.grad


def _ref_loss(model, ids, labels, cus):
    n = int((labels != -100).sum())
    return sum(model.loss(ids[r : r + 1], labels[r : r + 1], cus[r]) for r in range(M)) / n


def _one_process_run(cus_set=CUS, dense: int = 1, steps: int = STEPS) -> dict:
    """The reference: ``steps`` AdamW steps of the whole model in this process, each step's loss and gradients."""
    model = _model(dense=dense)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grads = [], []
    for step in range(steps):
        loss = _ref_loss(model, *_batch(step, cus_set))
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: _grad(p).clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"loss": losses, "grad": grads, "final": _trained_state(model.named_parameters(), opt)}


def _trained_state(named_params, opt) -> dict[str, tuple[torch.Tensor, ...]]:
    """``{name: (weight, exp_avg, exp_avg_sq, step)}`` as full tensors; ``(weight,)`` alone for a parameter the
    optimizer holds no state of (one no gradient ever reached: the indexer's weights)."""

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    out = {}
    for n, p in named_params:
        st = opt.state.get(p, {})
        moments = (full(st["exp_avg"]), full(st["exp_avg_sq"]), torch.as_tensor(st["step"]).clone()) if st else ()
        out[n] = (full(p), *moments)
    return out


def _load_dcp(path: str, module, opt) -> None:
    """Model and AdamW state from a DCP folder by name, as ``kimi train`` resumes: a parameter no gradient ever
    reached has no AdamW state in the folder (partial load)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, opt)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(module, state["model"])
    set_optimizer_state_dict(module, opt, state["optimizer"])


def _check_trained_state(where: str, got: dict, want: dict) -> list[str]:
    """Weights and AdamW moments of ``got`` against ``want``; where ``want`` has no moments, ``got``'s must be
    absent or zero (a loaded optimizer's initialised, untouched state: DCP's zero-lr step)."""
    errors = []
    for n, tensors in got.items():
        ref = want[n]
        if len(ref) == 1:
            if any(float(t.abs().sum()) != 0 for t in tensors[1:3]):
                errors.append(f"{where} {n}: AdamW state holds non-zero moments, expected none")
        for what, a, b in zip(("weight", "exp_avg", "exp_avg_sq", "step"), tensors, ref):  # weight only if no state
            try:
                check_rel(f"{where} {n} {what}", a, b, TOL["state"])
            except AssertionError as e:
                errors.append(str(e))
    return errors


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """:func:`_one_process_run` once for every layout, saved for the spawned ranks."""
    path = tmp_path_factory.mktemp("pipeline") / "reference.pt"
    torch.save(_one_process_run(), path)
    return str(path)


@pytest.fixture(scope="module")
def carry_reference(tmp_path_factory) -> str:
    """:func:`_one_process_run` on the rows of ``CARRY_CUS``, the first 2 layers dense, one step."""
    path = tmp_path_factory.mktemp("pipeline") / "carry_reference.pt"
    torch.save(_one_process_run(CARRY_CUS, dense=2, steps=1), path)
    return str(path)


def _worker(rank: int, world: int, ref_path: str, layouts, dcp_path: str | None = None) -> None:
    """Each layout ``(schedule, stages_per_rank, layer_counts)`` in turn, from the same initial weights, on this
    group of ``world`` ranks (one spawn for several layouts: process start-up is most of a small test's time)."""
    from kernels_torch.parallel.pipeline import Pipeline

    ref = torch.load(ref_path)
    errors = []
    for schedule, stages_per_rank, counts in layouts:
        model = _model()
        all_names = sorted(n for n, _ in model.named_parameters())
        pipe = Pipeline(
            model, pp_size=world, pp_rank=rank, n_microbatches=M, schedule=schedule,
            stages_per_rank=stages_per_rank, layer_counts=counts,
        )  # fmt: skip
        del model
        names = [n for n, _ in pipe.named_parameters()]
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
        where = f"rank {rank}/{world} {schedule} x{stages_per_rank} {counts or 'default'}"
        for step in range(STEPS):
            loss = pipe.step(*_batch(step))
            try:
                check_rel(f"{where} step {step} loss", loss, ref["loss"][step], TOL["loss"])
            except AssertionError as e:
                errors.append(str(e))
            for n, p in pipe.named_parameters():
                try:
                    check_rel(f"{where} step {step} {n}.grad", _grad(p), ref["grad"][step][n], TOL["grad"])
                except AssertionError as e:
                    errors.append(str(e))
            opt.step()
            opt.zero_grad()
        # every parameter of the model is held by exactly one rank
        held = [None] * world
        dist.all_gather_object(held, names)
        every = sorted(n for part in held for n in part)
        if every != all_names:
            errors.append(f"{where}: {len(every)} parameter names held, expected the model's {len(all_names)} once")
    if dcp_path is not None:  # the state saved at pp2 x dp2 loads here into other weights, by name
        schedule, stages_per_rank, counts = layouts[-1]
        pipe = Pipeline(_model(seed=5), pp_size=world, pp_rank=rank, n_microbatches=M, schedule=schedule,
                        stages_per_rank=stages_per_rank, layer_counts=counts)  # fmt: skip
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
        _load_dcp(dcp_path, pipe.rank_module(), opt)
        got = _trained_state(pipe.named_parameters(), opt)
        errors += _check_trained_state(f"rank {rank}/{world} DCP of pp2 x dp2", got, ref["final"])
    if errors:
        raise AssertionError("\n".join(errors[:20]))


@pytest.mark.distributed
def test_pp2_matches_one_process(reference):
    """pp2: 1F1B on an uneven layout (2 + 6 layers), Interleaved1F1B with 2 stages per rank (4 stages of 2
    layers, looped: rank 0 holds stages 0 and 2), GPipe on the default layout (4 + 4)."""
    layouts = [("1F1B", 1, (2, 6)), ("Interleaved1F1B", 2, None), ("GPipe", 1, None)]
    run_workers(_worker, 2, reference, layouts)


@pytest.mark.distributed
def test_pp4_matches_one_process(reference, pp2_dp2_dcp):
    """pp4, 1F1B: one AttnRes block of 2 layers per stage; the last stage receives 4 stacked sources. Then the DCP
    state saved at pp2 x dp2 loads into a pp4 pipeline of other weights equal to the one-process run's."""
    run_workers(_worker, 4, reference, [("1F1B", 1, None)], pp2_dp2_dcp)


def _dp_worker(rank: int, world: int, ref_path: str, dcp_path: str) -> None:
    """pp2 x dp2 on 4 ranks (mesh ``(pp, dp)``): each dp rank runs half the rows (2 micro-batches) through its
    pipeline, the stages FSDP2-sharded over dp; the loss is weighted by the global target count."""
    from torch.distributed.device_mesh import init_device_mesh

    from kernels_torch.parallel.pipeline import Pipeline, shard_stages

    ref = torch.load(ref_path)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    pipe = Pipeline(_model(), pp_size=2, pp_rank=pp.get_local_rank(), n_microbatches=M // 2, group=pp.get_group())
    shard_stages(pipe, dp)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    errors, where = [], f"rank {rank} (pp {pp.get_local_rank()}, dp {dp.get_local_rank()})"
    rows = slice(2 * dp.get_local_rank(), 2 * dp.get_local_rank() + 2)
    for step in range(STEPS):
        ids, labels, cus = _batch(step)
        n = int((labels != -100).sum())
        loss = pipe.step(ids[rows], labels[rows], cus[rows], n_tokens=n)
        dist.all_reduce(loss, group=dp.get_group())
        try:
            check_rel(f"{where} step {step} loss", loss, ref["loss"][step], TOL["loss"])
        except AssertionError as e:
            errors.append(str(e))
        for n, p in pipe.named_parameters():
            got = torch.zeros_like(p).full_tensor() if p.grad is None else p.grad.full_tensor()
            try:
                check_rel(f"{where} step {step} {n}.grad", got, ref["grad"][step][n], TOL["grad"])
            except AssertionError as e:
                errors.append(str(e))
        opt.step()
        opt.zero_grad()
    errors += _check_trained_state(where, _trained_state(pipe.named_parameters(), opt), ref["final"])
    from kernels_torch.parallel.fsdp import save_checkpoint

    save_checkpoint(dcp_path, pipe.rank_module(), opt)
    if errors:
        raise AssertionError("\n".join(errors[:20]))


@pytest.fixture(scope="module")
def pp2_dp2_dcp(reference, tmp_path_factory) -> str:
    """The pp2 x dp2 run (its parity checks run in the ranks) and the DCP state it saves after its 3 steps."""
    path = str(tmp_path_factory.mktemp("pipeline_dcp") / "step-3")
    run_workers(_dp_worker, 4, reference, path)
    return path


@pytest.mark.distributed
def test_pp2_dp2_matches_one_process(reference, pp2_dp2_dcp):
    """pp2 x dp2 (1F1B, stages sharded by FSDP2 over dp): the dp-summed loss and every gathered gradient of 3
    steps, the weights and AdamW moments after them; the DCP state it saved loads in one process (a
    ``KimiK3Model`` of other weights) equal to the one-process run's."""
    model = _model(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _load_dcp(pp2_dp2_dcp, model, opt)
    errors = _check_trained_state(
        "one process", _trained_state(model.named_parameters(), opt), torch.load(reference)["final"]
    )
    assert not errors, "\n".join(errors[:20])


def _ep_worker(rank: int, world: int, ref_path: str) -> None:
    """pp2 x ep2 on 4 ranks (mesh ``(pp, ep)``): the routed experts of the model split over ep
    (``kernels_torch.parallel.expert.shard_experts``, all-to-all dispatch inside the stages), each ep rank runs half
    the rows; the replicated parameters' gradients are summed over ep, the experts' are whole on their owner."""
    from torch.distributed.device_mesh import init_device_mesh

    from kernels_torch.parallel.expert import shard_experts
    from kernels_torch.parallel.pipeline import Pipeline

    ref = torch.load(ref_path)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    pp, ep_mesh = mesh["pp"], mesh["ep"]
    model = _model()
    ep = shard_experts(model, ep_mesh.get_group())
    pipe = Pipeline(model, pp_size=2, pp_rank=pp.get_local_rank(), n_microbatches=M // 2, group=pp.get_group())
    del model
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    lo, hi = ep.local_experts.start, ep.local_experts.stop
    errors, where = [], f"rank {rank} (pp {pp.get_local_rank()}, ep {ep.rank})"
    rows = slice(2 * ep.rank, 2 * ep.rank + 2)
    for step in range(STEPS):
        ids, labels, cus = _batch(step)
        loss = pipe.step(ids[rows], labels[rows], cus[rows], n_tokens=int((labels != -100).sum()))
        dist.all_reduce(loss, group=ep.group)
        try:
            check_rel(f"{where} step {step} loss", loss, ref["loss"][step], TOL["loss"])
        except AssertionError as e:
            errors.append(str(e))
        for n, p in pipe.named_parameters():
            want = ref["grad"][step][n]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
            if isinstance(grad, DTensor):  # a routed-expert stack, Shard(0) over ep: this rank's rows, whole
                grad, want = grad.to_local(), want[lo:hi]
            elif p.shape != want.shape:  # a plain stack of this rank's rows
                want = want[lo:hi]
            else:  # replicated: this rank's tokens' part
                dist.all_reduce(grad, group=ep.group)
            try:
                check_rel(f"{where} step {step} {n}.grad", grad, want, TOL["grad"])
            except AssertionError as e:
                errors.append(str(e))
        opt.step()
        opt.zero_grad()
    if errors:
        raise AssertionError("\n".join(errors[:20]))


@pytest.mark.distributed
def test_pp2_ep2_matches_one_process(reference):
    """pp2 x ep2 (1F1B, experts split over ep, all-to-alls inside the stages): the ep-summed loss and every
    gradient of 3 steps."""
    run_workers(_ep_worker, 4, reference)


def _cp_worker(rank: int, world: int, ref_path: str, runs, cus_set=CUS, dense: int = 1, steps: int = STEPS) -> None:
    """pp2 x cp2 on 4 ranks (mesh ``(pp, cp)``): every row cut into 2 context shards (documents cross the cut),
    each stage setting the shard of the micro-batch it runs; the parameters' gradients summed over cp. Each run
    ``(schedule, stages_per_rank, layer_counts, recompute)`` in turn from the same initial weights; ``recompute``
    None, or ``(mode, full_layers)`` of ``kernels_torch.activation_memory.recompute_layers``; ``steps`` AdamW steps each."""
    from torch.distributed.device_mesh import init_device_mesh

    from kernels_torch.activation_memory import recompute_layers
    from kernels_torch.parallel.context import ContextParallel, shard_bounds
    from kernels_torch.parallel.pipeline import Pipeline

    ref = torch.load(ref_path)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    pp, cp_mesh = mesh["pp"], mesh["cp"]
    errors = []
    for schedule, stages_per_rank, counts, recompute in runs:
        model = _model(dense=dense)
        cp = ContextParallel(model, cp_mesh.get_group())
        if recompute is not None:
            recompute_layers(model, *recompute)
        pipe = Pipeline(
            model, pp_size=2, pp_rank=pp.get_local_rank(), n_microbatches=M, group=pp.get_group(),
            schedule=schedule, stages_per_rank=stages_per_rank, layer_counts=counts, context=cp,
        )  # fmt: skip
        del model
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
        start, stop = shard_bounds(T, 2)[cp.rank]
        where = f"rank {rank} (pp {pp.get_local_rank()}, cp {cp.rank}) {schedule} recompute {recompute}"
        for step in range(steps):
            ids, labels, cus = _batch(step, cus_set)
            n = int((labels != -100).sum())
            loss = pipe.step(ids[:, start:stop], labels[:, start:stop], cus, n_tokens=n)
            dist.all_reduce(loss, group=cp_mesh.get_group())
            try:
                check_rel(f"{where} step {step} loss", loss, ref["loss"][step], TOL["loss"])
            except AssertionError as e:
                errors.append(str(e))
            for n, p in pipe.named_parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=cp_mesh.get_group())
                try:
                    check_rel(f"{where} step {step} {n}.grad", p.grad, ref["grad"][step][n], TOL["grad"])
                except AssertionError as e:
                    errors.append(str(e))
            opt.step()
            opt.zero_grad()
    if errors:
        raise AssertionError("\n".join(errors[:20]))


@pytest.mark.distributed
def test_pp2_cp2_matches_one_process(reference):
    """pp2 x cp2 (1F1B: several micro-batches of different documents in flight on a rank, each with its own
    context shard): the cp-summed loss and every gradient of 3 steps."""
    run_workers(_cp_worker, 4, reference, [("1F1B", 1, None, None)])


@pytest.mark.distributed
def test_pp2_cp2_recompute_matches_one_process(carry_reference):
    """pp2 x cp2 with activation recomputation: a non-last stage runs a micro-batch's backward (and so its
    recomputed forward) after later micro-batches' forwards made their shards current; the micro-batches' shards
    run the same shapes with and without a carried document (``CARRY_CUS``). Whole layers under 1F1B (2 + 6: the
    first stage's layers dense) and Interleaved1F1B, and the MLP-only mode with its first 2 layers whole under
    GPipe: the cp-summed loss and every gradient of a step (both transitions between the two kinds of rows) equal
    one process."""
    runs = [
        ("1F1B", 1, (2, 6), ("layer", 0)),
        ("Interleaved1F1B", 2, None, ("layer", 0)),
        ("GPipe", 1, None, ("mlp", 2)),
    ]
    run_workers(_cp_worker, 4, carry_reference, runs, CARRY_CUS, 2, 1)


# ------------------------------------------------------------------------------------------------ no processes


@pytest.mark.parametrize(
    "counts", [None, (2, 2, 4), (6, 2), (0, 8), (0, 4, 4, 0)], ids=["default-4", "2+2+4", "6+2", "E+8", "E+4+4+L"]
)
def test_stages_chained_equal_model_loss(counts):
    """The stage modules run one after the other (the state tensor handed on by hand) give the model's loss and
    gradients, with packed documents."""
    from kernels_torch.parallel.pipeline import split_stage, stage_layout

    model = _model()
    ids, labels, cus = _batch(0)
    want = model.loss(ids[:1], labels[:1], cus[0])
    want.backward()
    ref = {n: _grad(p).clone() for n, p in model.named_parameters()}
    model.zero_grad()
    n_stages = 4 if counts is None else len(counts)
    layout = stage_layout(model.config, n_stages, counts)
    x = ids[:1]
    from kernels_torch.parallel.pipeline import pack_cu_seqlens

    cu = pack_cu_seqlens([cus[0]], T)
    for s in range(n_stages):
        x = split_stage(model, layout, s)(x, cu_seqlens=cu, labels=labels[:1])
    check_rel("loss", x, want, TOL["loss"])
    x.backward()
    for n, p in model.named_parameters():
        check_rel(f"{n}.grad", _grad(p), ref[n], TOL["grad"])


def test_stage_layout_default_and_checks():
    from kernels_torch.parallel.pipeline import parse_stage_layout, sources_after, stage_layout

    c = _cfg()
    assert stage_layout(c, 2) == (range(0, 4), range(4, 8))
    assert stage_layout(c, 4) == tuple(range(i, i + 2) for i in (0, 2, 4, 6))
    assert stage_layout(c, 3, (2, 2, 4)) == (range(0, 2), range(2, 4), range(4, 8))
    assert [sources_after(c, s) for s in (2, 4, 6, 8)] == [2, 3, 4, 5]
    k3 = load_config("k3.1-pro")
    pp8 = stage_layout(k3, 8)
    assert [r.start % 12 for r in pp8] == [0] * 8 and pp8[-1].stop == 93 and len(pp8) == 8
    assert sources_after(k3, 93) == 9  # the final mix's 9 sources (docs/spec.md 5.4)
    assert parse_stage_layout("12, 24,24,33") == (12, 24, 24, 33)
    with pytest.raises(ValueError, match="stage 1 starts at layer 3, inside an AttnRes block"):
        stage_layout(c, 2, (3, 5))
    with pytest.raises(ValueError, match="summing to 7, expected 8 layers"):
        stage_layout(c, 2, (4, 3))
    with pytest.raises(ValueError, match="got 5, but the model has only 4 AttnRes blocks"):
        stage_layout(c, 5)
    with pytest.raises(ValueError, match="expected 3 \\(one per stage\\)"):
        stage_layout(c, 3, (4, 4))
    assert stage_layout(c, 3, (0, 8, 0)) == (range(0, 0), range(0, 8), range(8, 8))
    assert stage_layout(k3, 9, (12,) * 7 + (9, 0))[-1] == range(93, 93)  # lm_head alone after a partial block
    with pytest.raises(ValueError, match="expected 0 layers only on the first stage"):
        stage_layout(c, 3, (4, 0, 4))
    with pytest.raises(ValueError, match="expected layer counts per stage"):
        parse_stage_layout("4,x")


def test_cu_seqlens_packing():
    from kernels_torch.parallel.pipeline import pack_cu_seqlens, unpack_cu_seqlens

    packed = pack_cu_seqlens([[0, 5, 24], None, [0, 1, 2, 3, 24]], T)
    assert packed.tolist() == [[0, 5, 24, 24, 24], [0, 24, 24, 24, 24], [0, 1, 2, 3, 24]]
    assert unpack_cu_seqlens(packed[0], T).tolist() == [0, 5, 24]
    assert unpack_cu_seqlens(packed[1], T).tolist() == [0, 24]
    assert unpack_cu_seqlens(packed[2], T).tolist() == [0, 1, 2, 3, 24]
    with pytest.raises(ValueError, match=r"cu_seqlens\[1\]: .*strictly increasing"):
        pack_cu_seqlens([[0, 24], [0, 5, 5, 24]], T)


def test_pipeline_refuses_bad_sizes():
    from kernels_torch.parallel.pipeline import Pipeline

    model = _model()
    with pytest.raises(ValueError, match="pipeline schedule: got 'ZB'"):
        Pipeline(model, pp_size=2, pp_rank=0, n_microbatches=2, schedule="ZB")
    with pytest.raises(ValueError, match="stages_per_rank: got 1 with Interleaved1F1B, expected >= 2"):
        Pipeline(model, pp_size=2, pp_rank=0, n_microbatches=2, schedule="Interleaved1F1B")
    with pytest.raises(ValueError, match="pp_rank: got 2"):
        Pipeline(model, pp_size=2, pp_rank=2, n_microbatches=2)
    tied = load_config("tiny").replace(tie_word_embeddings=True)
    from kernels_torch.model import KimiK3Model

    with pytest.raises(ValueError, match="tie_word_embeddings"):
        Pipeline(KimiK3Model(tied), pp_size=2, pp_rank=0, n_microbatches=2)


def test_stages_chained_rows_without_cu_seqlens():
    """Micro-batches of several independent rows (no ``cu_seqlens``) go through the stages as through the model."""
    from kernels_torch.parallel.pipeline import split_stage, stage_layout

    model = _model()
    ids, labels, _ = _batch(1)
    want = model.loss(ids[:2], labels[:2])
    layout = stage_layout(model.config, 2)
    x = ids[:2]
    for s in range(2):
        x = split_stage(model, layout, s)(x, labels=labels[:2])
    check_rel("loss", x, want, TOL["loss"])


def test_pipeline_step_refuses_bad_batches():
    """Checked before any communication (no process group needed)."""
    from kernels_torch.parallel.pipeline import Pipeline

    pipe = Pipeline(_model(), pp_size=2, pp_rank=0, n_microbatches=M)
    ids, labels, cus = _batch(0)
    with pytest.raises(ValueError, match="got 3 rows, expected a multiple of n_microbatches=4"):
        pipe.step(ids[:3], labels[:3])
    with pytest.raises(ValueError, match="labels: got"):
        pipe.step(ids, labels[:, :-1])
    with pytest.raises(ValueError, match="cu_seqlens: got 3 rows, expected 4"):
        pipe.step(ids, labels, cus[:3])
    with pytest.raises(ValueError, match="cu_seqlens: given with 8 rows in 4 micro-batches"):
        pipe.step(torch.cat([ids, ids]), torch.cat([labels, labels]), cus + cus)
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\]: .*end at T=24"):
        pipe.step(ids, labels, [torch.tensor([0, 5, 20])] + cus[1:])
    with pytest.raises(ValueError, match="n_tokens: got 0"):
        pipe.step(ids, labels, cus, n_tokens=0)
