"""The V-shaped pipeline schedules of ``torch.distributed.pipelining`` (``DualPipeV``, ``ZBVZeroBubble``: two stages
per rank, rank ``r`` holding stages ``r`` and ``2 pp - 1 - r``) through ``kernels_torch.parallel.pipeline.Pipeline``
equal one process: the loss and every gradient of 3 AdamW steps, gloo processes in fp64, at pp2 (both schedules,
the 4 stages cut at AttnRes block boundaries) and at pp2 x ep2 (the routed experts split over ep, their all-to-alls
inside the stages of the backward-input / backward-weight split and of the overlapped forward + backward actions;
also with ``overlap="chunks"``), and under ``Pipeline(overlap_f_b=True)`` (each overlapped action's forward and
backward taking turns at the all-to-alls: ``overlap="fb"``, ``"fb+chunks"``, ``"fb"`` with whole layers recomputed;
the turns' order checked from ``Pipeline.overlap_trace``); the evaluation (forward only, one micro-batch) equals the
one-process loss; ``kimi train --ep-overlap fb`` under DualPipeV equals the same run without it. Without
processes: the V placement and the refusals of what the V schedules and the overlap cannot run; the turns of
``fb_overlap.overlap_f_b`` on a fake runtime (alternation, a party ending first, failures of either party).

The model: tiny with AttnRes blocks of 2 layers over 8 layers, so that the four stages of pp2 hold a block each and
later stages receive 2, 3 and 4 stacked sources (``tests/test_pipeline.py``'s model); 8 rows of packed documents a
step, so that each ep rank of pp2 x ep2 runs the 4 micro-batches DualPipeV needs (one per stage at least).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_workers
from helpers import check_rel
from torch.distributed.tensor import DTensor

from kimi.config import load_config

T = 16
M = 8  # rows of a step
CUS = [[0, 5, 9, 16], [0, 16], [0, 2, 3, 11, 16], [0, 7, 16]]  # a packed row, cycled over the rows
TOL = {"loss": 1e-12, "grad": 1e-9}
STEPS = 3


def _cfg():
    return load_config("tiny").replace(index_topk=8, attn_res_block_size=2).truncated(8)


def _model(seed: int = 0):
    from kernels_torch.model import KimiK3Model

    torch.manual_seed(seed)
    return KimiK3Model(_cfg()).double()


def _batch(step: int):
    """The step's rows: ids [M, T], labels [M, T] with some -100, per-row offsets (rolled with the step)."""
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, _cfg().vocab_size, (M, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[torch.rand(M, T, generator=g) < 0.2] = -100
    cus = [torch.tensor(CUS[(r + step) % len(CUS)]) for r in range(M)]
    return ids[:, :T], labels, cus


def _grad(p):
    return torch.zeros_like(p) if p.grad is None else p.grad


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The whole model in this process: each step's loss and gradients over 3 AdamW steps, and the loss of the
    first step's batch as an evaluation (no gradient) after them; saved for the spawned ranks."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grads = [], []
    for step in range(STEPS):
        ids, labels, cus = _batch(step)
        n = int((labels != -100).sum())
        loss = sum(model.loss(ids[r : r + 1], labels[r : r + 1], cus[r]) for r in range(M)) / n
        loss.backward()
        losses.append(loss.detach())
        grads.append({k: _grad(p).clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    ids, labels, cus = _batch(0)
    with torch.no_grad():
        ev = sum(model.loss(ids[r : r + 1], labels[r : r + 1], cus[r]) for r in range(M)) / int((labels != -100).sum())
    path = tmp_path_factory.mktemp("dualpipe") / "reference.pt"
    torch.save({"loss": losses, "grad": grads, "eval": ev}, path)
    return str(path)


def _run(pipe, rows: slice, ref: dict, where: str, group=None, expert_rows=None) -> list[str]:
    """3 AdamW steps of ``pipe`` on ``rows`` of each step's batch; the loss (summed over ``group``) and every
    gradient checked against the one-process run (a replicated parameter's gradient summed over ``group``, a
    routed-expert stack's checked on this rank's ``expert_rows``); then the evaluation of step 0's batch."""
    errors = []

    def check(name, got, want, tol):
        try:
            check_rel(f"{where} {name}", got, want, tol)
        except AssertionError as e:
            errors.append(str(e))

    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        ids, labels, cus = _batch(step)
        n = int((labels != -100).sum())
        loss = pipe.step(ids[rows], labels[rows], cus[rows], n_tokens=n)
        if group is not None:
            dist.all_reduce(loss, group=group)
        check(f"step {step} loss", loss, ref["loss"][step], TOL["loss"])
        for k, p in pipe.named_parameters():
            want, grad = ref["grad"][step][k], _grad(p)
            if isinstance(grad, DTensor):  # a routed-expert stack, Shard(0) over ep: this rank's experts
                grad, want = grad.to_local(), want[expert_rows]
            elif grad.shape != want.shape:  # a plain stack of this rank's experts
                want = want[expert_rows]
            elif group is not None:  # replicated: this rank's tokens' part
                dist.all_reduce(grad, group=group)
            check(f"step {step} {k}.grad", grad, want, TOL["grad"])
        opt.step()
        opt.zero_grad()
    # the evaluation after the steps, forward only (ZBVZeroBubble's eval): the first row alone (one micro-batch,
    # fewer than the stages), then the others (one micro-batch each)
    ids, labels, cus = (x[rows] for x in _batch(0))
    n = int((_batch(0)[1] != -100).sum())
    with torch.no_grad():
        ev = pipe.evaluate(ids[:1], labels[:1], cus[:1], n_tokens=n)
        ev = ev + pipe.evaluate(ids[1:], labels[1:], cus[1:], n_tokens=n, n_microbatches=len(cus) - 1)
    if group is not None:
        dist.all_reduce(ev, group=group)
    check("eval loss", ev, ref["eval"], TOL["loss"])
    return errors


def _pp_worker(rank: int, world: int, ref_path: str, schedules) -> None:
    """pp2 on 2 ranks, each schedule of ``schedules`` in turn from the same initial weights; every parameter held by
    exactly one rank."""
    from kernels_torch.parallel.pipeline import Pipeline

    ref = torch.load(ref_path)
    errors = []
    from kernels_torch.activation_memory import recompute_layers

    for schedule, n_mb, recompute in schedules:
        model = _model()
        if recompute is not None:
            recompute_layers(model, recompute)
        all_names = sorted(k for k, _ in model.named_parameters())
        pipe = Pipeline(model, pp_size=world, pp_rank=rank, n_microbatches=n_mb, schedule=schedule, stages_per_rank=2)
        del model
        assert pipe.stage_indices == [rank, 2 * world - 1 - rank], pipe.stage_indices
        errors += _run(pipe, slice(0, M), ref, f"rank {rank} {schedule} x{n_mb} recompute {recompute}")
        held = [None] * world
        dist.all_gather_object(held, [k for k, _ in pipe.named_parameters()])
        if sorted(k for part in held for k in part) != all_names:
            errors.append(f"rank {rank} {schedule}: the ranks' parameters are not the model's, each once")
    if errors:
        raise AssertionError("\n".join(errors[:20]))


@pytest.mark.distributed
def test_pp2_v_schedules_match_one_process(reference):
    """pp2 (2 ranks, 4 stages of 2 layers in a V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2): DualPipeV with
    8 micro-batches (its overlapped forward + backward actions in the steady state) and ZBVZeroBubble with 4 (the
    input / weight split of the backward): every loss and gradient of 3 steps, then the evaluation."""
    run_workers(_pp_worker, 2, reference, [("DualPipeV", 8, None), ("ZBVZeroBubble", 8, None)])


def _ep_worker(rank: int, world: int, ref_path: str, overlaps) -> None:
    """pp2 x ep2 on 4 ranks (mesh ``(pp, ep)``), DualPipeV: the routed experts split over ep (all-to-all dispatch
    and combine inside the stages), each ep rank its half of the rows (4 micro-batches, one per stage)."""
    from torch.distributed.device_mesh import init_device_mesh

    from kernels_torch.parallel.expert import shard_experts
    from kernels_torch.parallel.pipeline import Pipeline

    ref = torch.load(ref_path)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    pp, ep_mesh = mesh["pp"], mesh["ep"]
    errors = []
    for overlap in overlaps:
        model = _model()
        ep = shard_experts(model, ep_mesh.get_group(), overlap=overlap)
        pipe = Pipeline(model, pp_size=2, pp_rank=pp.get_local_rank(), n_microbatches=M // 2, group=pp.get_group(),
                        schedule="DualPipeV", stages_per_rank=2)  # fmt: skip
        del model
        rows = slice(M // 2 * ep.rank, M // 2 * (ep.rank + 1))
        where = f"rank {rank} (pp {pp.get_local_rank()}, ep {ep.rank}) overlap {overlap}"
        errors += _run(pipe, rows, ref, where, ep.group, slice(ep.local_experts.start, ep.local_experts.stop))
    if errors:
        raise AssertionError("\n".join(errors[:20]))


@pytest.mark.distributed
def test_pp2_ep2_dualpipev_matches_one_process(reference):
    """pp2 x ep2 under DualPipeV, the all-to-alls plain and cut in two chunks (``overlap="chunks"``): the ep-summed
    loss and every gradient of 3 steps, then the evaluation."""
    run_workers(_ep_worker, 4, reference, ["none", "chunks"])


@pytest.mark.distributed
def test_pp2_cp2_v_schedules_recompute_match_one_process(tmp_path):
    """pp2 x cp2 with activation recomputation under the V schedules (``tests/test_pipeline.py``'s context-parallel
    worker and rows): the backward split into input and weight parts replays a recomputed layer in each part, both
    times with the context shard of its own micro-batch. DualPipeV with whole layers recomputed, ZBVZeroBubble with
    the MLP-only mode (its first 2 layers whole): the cp-summed loss and every gradient of a step."""
    from test_pipeline import CARRY_CUS, _cp_worker, _one_process_run

    path = tmp_path / "reference.pt"
    torch.save(_one_process_run(CARRY_CUS, dense=2, steps=1), path)
    runs = [("DualPipeV", 2, None, ("layer", 0)), ("ZBVZeroBubble", 2, None, ("mlp", 2))]
    run_workers(_cp_worker, 4, str(path), runs, CARRY_CUS, 2, 1)


def _layer_state(stage) -> tuple[int, int, int, int]:
    """What a stage's FSDP2 layer units hold now, read from the parameters they register (FSDP2 registers each
    unit's sharded DTensors while it is resharded, its gathered plain tensors while it is gathered): (layers
    gathered, parameters holding a sharded gradient, gradients that are not this rank's ``Shard(0)`` block, the
    stage's layers)."""
    gathered = sharded = wrong = 0
    for layer in stage.model.layers.values():
        params = [p for p in layer.parameters() if p.requires_grad]
        gathered += any(not isinstance(p, DTensor) for p in params)
        for p in params:
            if isinstance(p, DTensor) and p.grad is not None:
                sharded += 1
                g = p.grad
                wrong += not (isinstance(g, DTensor) and g.to_local().shape == p.to_local().shape)
    return gathered, sharded, wrong, len(stage.model.layers)


def _dp_worker(rank: int, world: int, ref_path: str, runs) -> None:
    """pp2 x dp2 on 4 ranks (mesh ``(pp, dp)``), the stages FSDP2-sharded over dp (``shard_stages``): each run
    ``(schedule, fsdp)`` in turn from the same initial weights, each dp rank 4 of the 8 rows (4 micro-batches: one per
    stage of a V), the loss weighted by the global target count. Checks the dp-summed loss and every gathered gradient
    of 3 steps against one process, and what the layer units hold at the start of every micro-batch's forward
    (:func:`_layer_state`): under ``"layer"`` at most one layer gathered (torchtitan's reshard policy keeps the last
    layer's copy from its forward to its backward), and sharded gradients (this rank's ``Shard(0)`` block) accumulated
    from an earlier micro-batch's backward before the step's end; under ``"stage"`` the opposite, the whole stage
    gathered and no sharded gradient until the step's end. After the steps an evaluation (forward only) leaves every
    unit resharded."""
    from torch.distributed.device_mesh import init_device_mesh

    from kernels_torch.parallel.pipeline import Pipeline, shard_stages

    ref = torch.load(ref_path)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    errors = []
    for schedule, fsdp in runs:
        pipe = Pipeline(_model(), pp_size=2, pp_rank=pp.get_local_rank(), n_microbatches=M // 2, group=pp.get_group(),
                        schedule=schedule, stages_per_rank=1 if schedule == "1F1B" else 2)  # fmt: skip
        shard_stages(pipe, dp, fsdp=fsdp)
        seen: list[tuple[int, int, int, int]] = []
        for st in pipe.stages:
            st.register_forward_pre_hook(lambda mod, args: seen.append(_layer_state(mod)))
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
        where = f"rank {rank} (pp {pp.get_local_rank()}, dp {dp.get_local_rank()}) {schedule} fsdp={fsdp}"
        rows = slice(M // 2 * dp.get_local_rank(), M // 2 * (dp.get_local_rank() + 1))
        for step in range(STEPS):
            ids, labels, cus = _batch(step)
            loss = pipe.step(ids[rows], labels[rows], cus[rows], n_tokens=int((labels != -100).sum()))
            dist.all_reduce(loss, group=dp.get_group())
            try:
                check_rel(f"{where} step {step} loss", loss, ref["loss"][step], TOL["loss"])
            except AssertionError as e:
                errors.append(str(e))
            for k, p in pipe.named_parameters():
                got = torch.zeros_like(p).full_tensor() if p.grad is None else p.grad.full_tensor()
                try:
                    check_rel(f"{where} step {step} {k}.grad", got, ref["grad"][step][k], TOL["grad"])
                except AssertionError as e:
                    errors.append(str(e))
            opt.step()
            opt.zero_grad()
        with torch.no_grad():  # a forward alone leaves no unit gathered: the parameters stay the optimizer's
            ids, labels, cus = (x[rows] for x in _batch(0))
            pipe.evaluate(ids, labels, cus, n_tokens=1, n_microbatches=len(cus))
        if any(not isinstance(p, DTensor) for p in pipe.parameters()):
            errors.append(f"{where}: a unit left gathered after the evaluation")
        most, grads, wrong = max(x[0] for x in seen), max(x[1] for x in seen), sum(x[2] for x in seen)
        whole = any(x[0] == x[3] > 1 for x in seen)  # a stage of several layers found wholly gathered
        if fsdp == "layer" and not (most <= 1 and grads > 0 and wrong == 0):
            errors.append(f"{where}: {most} layers gathered, {grads} sharded gradients ({wrong} not the rank's "
                          "block) at a forward's start; expected at most 1, some, 0")  # fmt: skip
        if fsdp == "stage" and not (whole and grads == 0):
            errors.append(f"{where}: no stage found wholly gathered ({most} layers at most), {grads} sharded "
                          "gradients before the step's end; expected a whole stage, 0")  # fmt: skip
    if errors:
        raise AssertionError("\n".join(errors[:20]))


@pytest.mark.distributed
def test_pp2_dp2_layer_fsdp_matches_one_process_and_reshards(reference):
    """pp2 x dp2 under 1F1B, the stages' FSDP2 units per layer (``shard_stages(fsdp="layer")``, ``kimi train``'s
    default) and per stage (torch's ``PipelineStage`` no-sync): both equal one process (loss and every gradient of 3
    steps); per layer, every micro-batch's backward leaves the units resharded and their gradients reduce-scattered
    into sharded ones (at most one layer gathered at any forward's start, sharded gradients before the step's end),
    which the stage policy does not (the whole stage gathered, no sharded gradient until the step's end)."""
    run_workers(_dp_worker, 4, reference, [("1F1B", "layer"), ("1F1B", "stage")])


@pytest.mark.distributed
def test_pp2_dp2_v_schedules_fsdp_match_one_process(reference):
    """pp2 x dp2 under the V schedules: per layer (DualPipeV, ZBVZeroBubble: the split backwards run whole) and per
    stage (DualPipeV: the layers kept gathered after their forward, which a split backward needs) equal one process,
    loss and every gradient of 3 steps, with the units' state of the policy (as the 1F1B test)."""
    run_workers(_dp_worker, 4, reference, [("DualPipeV", "layer"), ("ZBVZeroBubble", "layer"), ("DualPipeV", "stage")])


# ------------------------------------------------------------------------------------------------ no processes


def test_v_placement_and_refusals():
    """The V placement (torch's ``v`` style) and what the V schedules refuse, each in one line naming the value."""
    from kernels_torch.parallel.pipeline import Pipeline, stage_ranks

    assert stage_ranks("DualPipeV", 2, 4) == (0, 1, 1, 0)
    assert stage_ranks("ZBVZeroBubble", 4, 8) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert stage_ranks("Interleaved1F1B", 2, 4) == (0, 1, 0, 1)
    with pytest.raises(ValueError, match=r"^pipeline stages: got 6 with DualPipeV on 2 ranks, expected 4 \(two"):
        stage_ranks("DualPipeV", 2, 6)
    model = _model()
    with pytest.raises(ValueError, match=r"^stages_per_rank: got 3 with ZBVZeroBubble, expected 2 \(a V of two"):
        Pipeline(model, pp_size=2, pp_rank=0, n_microbatches=4, schedule="ZBVZeroBubble", stages_per_rank=3)
    with pytest.raises(ValueError, match=r"^n_microbatches: got 3 with DualPipeV on 2 ranks, expected at least its 4"):
        Pipeline(model, pp_size=2, pp_rank=0, n_microbatches=3, schedule="DualPipeV", stages_per_rank=2)
    pipe = Pipeline(model, pp_size=2, pp_rank=0, n_microbatches=4, schedule="DualPipeV", stages_per_rank=2)
    assert pipe.stage_indices == [0, 3] and pipe.stages[0].is_first and pipe.stages[1].is_last


def test_train_refuses_v_schedule_misfits():
    """``kimi train --pp-schedule DualPipeV`` / ``ZBVZeroBubble``: a ``--pp-layout`` of other than 2 x ``--pp``
    stages, and a step of fewer micro-batches per data-parallel group than stages, refused in one line."""
    from kimi_tools.train.parallel import TrainParallel

    with pytest.raises(ValueError, match=r"^--pp-layout: got 2 stages with --pp 2 --pp-schedule DualPipeV, expected 4"):
        TrainParallel(1, "cpu", pp=2, pp_schedule="DualPipeV", pp_layout="4,4", world=2)
    with pytest.raises(ValueError, match=r"^--pp-layout: got 6 stages with --pp 2 --pp-schedule ZBVZeroBubble, expe"):
        TrainParallel(1, "cpu", pp=2, pp_schedule="ZBVZeroBubble", pp_layout="0,2,2,2,2,0", world=2)
    par = TrainParallel(1, "cpu")  # one process; the pipeline's sizes set as under torchrun (no process group)
    par.pp_size, par.pp_schedule, par.stages_per_rank = 2, "DualPipeV", 2
    assert par.stages_needed == 4
    par.check_accum(5, 40, 40)  # any count from the stages up (no rounds of pp, as Interleaved1F1B's)
    with pytest.raises(ValueError, match=r"--pp 2 --pp-schedule DualPipeV runs 4 stages\) at 4 or more each; "):
        par.check_accum(2, 40, 40)


# ------------------------------------------------------------------------------------------------ overlap_f_b


def _check_turns(trace: list[str], where: str) -> list[str]:
    """The interleaving of one overlapped action's turns (``Pipeline.overlap_trace``, events ``"<party> <what>"``,
    ``"<party> end"``): every all-to-all a party issues is waited for by that party later, and, while the other
    party has not ended, only after the other party ran (an event of it between the issue and the wait). Returns
    the errors."""
    errors, overlapped = [], 0
    ended: set[str] = set()
    for i, ev in enumerate(trace):
        party, what = ev.split(" ", 1)
        if what == "end":
            ended.add(party)
            continue
        if " issue " not in what:
            continue
        other = "B" if party == "F" else "F"
        wait = f"{party} {what.replace(' issue ', ' wait ')}"
        j = next((j for j in range(i + 1, len(trace)) if trace[j] == wait), None)
        if j is None:
            errors.append(f"{where}: {ev!r} at {i} never waited for")
        elif other not in ended:
            if not any(e.startswith(f"{other} ") for e in trace[i + 1 : j]):
                errors.append(f"{where}: {ev!r} at {i} waited for at {j} with no event of party {other} between")
            overlapped += 1
    return errors if overlapped else errors + [f"{where}: no transfer travelled while the other party ran"]


def _fb_worker(rank: int, world: int, ref_path: str, runs) -> None:
    """pp2 x ep2 on 4 ranks as :func:`_ep_worker`, DualPipeV with ``overlap_f_b`` (its OVERLAP_F_B actions' forward
    and backward taking turns at the expert all-to-alls), the MoE layers in ``overlap`` mode, the layers recomputed
    or not: the loss and every gradient of 3 steps and the evaluation against one process; the turns of the
    overlapped actions (:func:`_check_turns`), recorded at the first step."""
    from torch.distributed.device_mesh import init_device_mesh

    from kernels_torch.activation_memory import recompute_layers
    from kernels_torch.parallel.expert import shard_experts
    from kernels_torch.parallel.pipeline import Pipeline

    ref = torch.load(ref_path)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    pp, ep_mesh = mesh["pp"], mesh["ep"]
    errors = []
    for overlap, recompute in runs:
        model = _model()
        ep = shard_experts(model, ep_mesh.get_group(), overlap=overlap)
        if recompute is not None:
            recompute_layers(model, recompute)
        pipe = Pipeline(model, pp_size=2, pp_rank=pp.get_local_rank(), n_microbatches=M // 2, group=pp.get_group(),
                        schedule="DualPipeV", stages_per_rank=2, overlap_f_b=True)  # fmt: skip
        del model
        where = f"rank {rank} (pp {pp.get_local_rank()}, ep {ep.rank}) overlap {overlap} recompute {recompute}"
        actions, trace = [], []

        def traced(step_fn):  # the first step's overlapped actions, each its own trace
            def step(*a, **kw):
                if not actions:
                    pipe.overlap_trace = trace
                try:
                    return step_fn(*a, **kw)
                finally:
                    if pipe.overlap_trace is not None:
                        actions.append(list(trace))
                    pipe.overlap_trace = None

            return step

        pipe.step = traced(pipe.step)
        rows = slice(M // 2 * ep.rank, M // 2 * (ep.rank + 1))
        errors += _run(pipe, rows, ref, where, ep.group, slice(ep.local_experts.start, ep.local_experts.stop))
        # split the first step's trace into its actions (each ends with both parties' "end")
        one, n_actions = [], 0
        for ev in actions[0]:
            one.append(ev)
            if sum(e.endswith(" end") for e in one) == 2:
                errors += _check_turns(one, f"{where} action {n_actions}")
                one, n_actions = [], n_actions + 1
        if n_actions != 3:  # 2 M - 3 pp + r + 1 on rank r, one fewer on the last rank: 3 on both ranks
            errors.append(f"{where}: {n_actions} overlapped actions in a step, expected 3")
    if errors:
        raise AssertionError("\n".join(errors[:20]))


@pytest.mark.distributed
def test_pp2_ep2_dualpipev_overlap_f_b_matches_one_process(reference):
    """pp2 x ep2 under DualPipeV with ``Pipeline(overlap_f_b=True)``: each OVERLAP_F_B action's forward and backward
    take turns at the all-to-alls, one chunk a layer (``overlap="fb"``) and two chunks inside each layer
    (``"fb+chunks"``): the ep-summed loss and every gradient of 3 steps and the evaluation equal one process; in each
    overlapped action a transfer issued by one party is waited for only after the other party ran."""
    run_workers(_fb_worker, 4, reference, [("fb", None), ("fb+chunks", None)])


@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_ep2_dualpipev_overlap_f_b_recompute_matches_one_process(reference):
    """As above (``overlap="fb"``) with whole layers recomputed: the backward party replays its layers' forward
    all-to-alls inside its turns and hands the turn over at them too."""
    run_workers(_fb_worker, 4, reference, [("fb", "layer")])


# the trainer: 8 tiny layers in two AttnRes blocks of 4 cut "0,4,4,0" (rank 0 holds the embedding's stage and the
# head's, no MoE layer: its overlapped actions run the backward after the forward; rank 1 the two stages of 4 layers,
# MoE from layer 1), 2 ranks of dp x ep per stage, 8 micro-batches a step (4 per dp group, as DualPipeV needs)
TRAIN = (
    "--preset tiny --layers 8 --steps 2 --seq-len 40 --micro-batch-tokens 40 --batch-tokens 320 --eval-tokens 40 "
    "--eval-every 0 --warmup-steps 1 --lr 3e-3 --quiet --no-plot --pp 2 --pp-layout 0,4,4,0 --pp-schedule DualPipeV "
    "--ep 2"
).split()
TRAIN_TOL = {"loss": 1e-6, "grad_norm": 1e-5, "eval_loss": 1e-6}  # the same sums in the same order: seen 0


@pytest.mark.distributed
@pytest.mark.slow
def test_train_dualpipev_ep_overlap_fb_equals_plain(tmp_path):
    """``kimi train --pp 2 --ep 2 --pp-schedule DualPipeV --ep-overlap fb`` (4 gloo ranks: pp 2 x dp 2, ep 2, FSDP2
    over dp) equals the same run without the overlap: the loss and gradient norm of each step and the eval losses."""
    from test_train_parallel import _records, _short_documents, _torchrun

    data = _short_documents(tmp_path / "docs.jsonl")
    outs = {}
    for overlap in ("none", "fb"):
        outs[overlap] = tmp_path / overlap
        r = _torchrun(4, [*TRAIN, "--ep-overlap", overlap, "--data", str(data), "--out", str(outs[overlap])])
        assert r.returncode == 0, r.stderr[-3000:]
    want, got = _records(outs["none"]), _records(outs["fb"])
    assert sorted(got) == sorted(want) == [0, 1, 2], (sorted(got), sorted(want))
    compared = 0
    for step in want:
        for key, tol in TRAIN_TOL.items():
            a, b = got[step].get(key), want[step].get(key)
            assert (a is None) == (b is None), (step, key, a, b)
            if b is not None:
                assert abs(a - b) <= tol * abs(b), (step, key, a, b)
                compared += 1
    assert compared >= 5, compared  # losses and gradient norms of steps 1, 2; eval losses of steps 0, 2


def test_train_refuses_ep_overlap_fb_misfits():
    """``--ep-overlap fb`` / ``fb+chunks`` outside DualPipeV with ``--pp`` > 1, or with ``--cp`` > 1, refused in one
    line naming the flags; ``Pipeline(overlap_f_b=True)`` likewise outside DualPipeV or without ``fb`` MoE layers."""
    from kernels_torch.parallel.pipeline import Pipeline
    from kimi_tools.train.parallel import TrainParallel

    with pytest.raises(ValueError, match=r"^--ep-overlap: got 'fb' with --ep 1, expected none, or chunks, fb or fb"):
        TrainParallel(1, "cpu", pp=2, pp_schedule="DualPipeV", world=2, ep_overlap="fb")
    with pytest.raises(ValueError, match=r"^--ep-overlap: got 'fb' with --pp 2 --pp-schedule 1F1B, expected --pp > 1 "):
        TrainParallel(1, "cpu", pp=2, ep=2, world=4, ep_overlap="fb")
    with pytest.raises(ValueError, match=r"^--ep-overlap: got 'fb\+chunks' with --pp 1 --pp-schedule 1F1B, expect"):
        TrainParallel(1, "cpu", ep=2, world=2, ep_overlap="fb+chunks")
    with pytest.raises(ValueError, match=r"^--ep-overlap: got 'fb' with --cp 2, expected --cp 1 \(context"):
        TrainParallel(2, "cpu", pp=2, ep=2, pp_schedule="DualPipeV", world=4, ep_overlap="fb")
    model = _model()
    with pytest.raises(ValueError, match=r"^overlap_f_b: got True with schedule 'ZBVZeroBubble', expected DualPipeV"):
        Pipeline(model, pp_size=2, pp_rank=0, n_microbatches=4, schedule="ZBVZeroBubble", stages_per_rank=2,
                 overlap_f_b=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"^overlap_f_b: got True with MoE layers \['not expert-parallel'\], expec"):
        Pipeline(model, pp_size=2, pp_rank=0, n_microbatches=4, schedule="DualPipeV", stages_per_rank=2,
                 overlap_f_b=True)  # fmt: skip


class _FakeStage:
    """A stage of the fake runtime of :func:`test_overlap_f_b_turns_and_failures`: its forward and backward log
    their steps and hand the turn over ``turns`` times (as an MoE layer's all-to-alls do), or raise at ``fail``."""

    def __init__(self, index, log, turns, fail=None):
        self.stage_index, self.is_first, self.is_last = index, index == 0, index == 3
        self.device, self.log, self.turns, self.fail = torch.device("cpu"), log, turns, fail

    def _steps(self, what):
        from kernels_torch.parallel.fb_overlap import pass_turn

        for k in range(self.turns):
            if self.fail == (what, k):
                raise ValueError(f"{what} failed at {k}")
            self.log.append(f"{what} {k}")
            pass_turn()
        self.log.append(f"{what} done")

    def forward_one_chunk(self, mb, args, kwargs, save_forward_output=True):
        self._steps("F")
        return torch.ones(1)

    def backward_one_chunk(self, mb, loss=None, full_backward=True, last_backward=False):
        self._steps("B")

    def get_local_bwd_output(self, mb):
        return ()

    def set_local_bwd_input(self, grads, mb):
        pass

    def set_local_fwd_input(self, out, mb):
        pass


def test_overlap_f_b_turns_and_failures():
    """``fb_overlap.overlap_f_b`` on a fake runtime (no processes): the forward and the backward alternate at each
    hand-over, exactly one running at a time; a party with fewer hand-overs ends and the other runs on alone; an
    exception in either party is raised by the callback (the other party stopped, never left waiting), and a
    hand-over without the turn is refused."""
    import threading
    from collections import Counter
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, OVERLAP_F_B, _Action

    from kernels_torch.parallel import fb_overlap

    def run(f_turns, b_turns, fail=None):
        log = []
        stages = [_FakeStage(1, log, f_turns, fail), _FakeStage(2, log, b_turns, fail)]
        schedule = SimpleNamespace(
            _stages=stages, fwd_recv_ops={}, bwd_recv_ops={(2, 0): []}, backward_counter=Counter(),
            _n_microbatches=4, _assert_unsharded=lambda st: None, _maybe_get_loss=lambda st, mb: None,
            _maybe_compute_loss=lambda st, out, targets, mb: None,
        )  # fmt: skip
        action = _Action(-1, OVERLAP_F_B, None, (_Action(1, FORWARD, 1), _Action(2, FULL_BACKWARD, 0)))
        schedule.fwd_recv_ops[(1, 1)] = []
        ctx = SimpleNamespace(schedule_ref=schedule, arg_mbs=[()] * 4, kwarg_mbs=[{}] * 4, target_mbs=None)
        fb_overlap.overlap_f_b(action, ctx)
        assert fb_overlap.active_turns() is None
        return log

    assert run(3, 3) == ["F 0", "B 0", "F 1", "B 1", "F 2", "B 2", "F done", "B done"]
    assert run(1, 3) == ["F 0", "B 0", "F done", "B 1", "B 2", "B done"]  # the forward ends first
    assert run(3, 0) == ["F 0", "B done", "F 1", "F 2", "F done"]  # a backward without hand-over
    for fail in (("B", 1), ("F", 2), ("B", 0), ("F", 0)):
        with pytest.raises(ValueError, match=rf"^{fail[0]} failed at {fail[1]}$"):
            run(3, 3, fail)
        assert fb_overlap.active_turns() is None
    with pytest.raises(RuntimeError, match=r"^overlapped forward \+ backward: party B reached a hand-over without "):
        turns = fb_overlap.Turns()  # this thread is F and holds the turn; another thread hands over
        err = []

        def other():
            try:
                turns.pass_turn()
            except RuntimeError as e:
                err.append(e)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        raise err[0]
