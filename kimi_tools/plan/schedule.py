"""The pipeline schedules ``kimi plan`` searches (:data:`PLANNED_SCHEDULES`, ``kimi train --pp-schedule``): the
stages each rank holds, the micro-batches a step needs, the micro-batches in flight at the activation peak and the
bubble.

``1F1B`` runs ``pp`` stages, one per rank; the V schedules (``DualPipeV``, ``ZBVZeroBubble``:
``kernels_torch.parallel.pipeline.V_SCHEDULES``) run ``2 pp`` stages, rank ``r`` holding stages ``r`` and
``2 pp - 1 - r`` (``kernels_torch.parallel.pipeline.stage_ranks``), and split each stage's backward ``B`` into an
input part ``I`` and a weight part ``W`` (``B = I + W``) run later in the bubbles.

The bubble per rank (:func:`bubble`), from a replay of torch's own action lists for each rank with communication
free and every stage alike (``F``, ``I``, ``W`` the times of one stage of the schedule):

* 1F1B: ``(pp - 1)(F + B)``, ``F + B`` the time of one of its ``pp`` stages;
* DualPipeV and ZBVZeroBubble: ``(pp - 1)(F + B - 2 W)``, ``F``, ``B``, ``W`` of one of the ``2 pp`` stages. Exact
  at pp 2 and 4; at pp 8 exact when ``F = I = W``, and where ``I > F`` the replay gives more (pp 8, ``I = 1.5 F``,
  ``W = 0.5 F``: ``16.5 F`` where the formula gives ``14 F``): an optimistic bound there.

The planner runs that replay itself for its V rows (:func:`replay_bubble`: exact for torch's order, where the formula
is not: with ``I = W = 2 F``, a layer recomputed in both parts of the backward, pp 4 gives ``5 F`` under DualPipeV
and ``6 F`` under ZBVZeroBubble against the formula's ``3 F``). The split of ``B`` into ``I`` and ``W`` is not
measured: the planner assumes ``W = I = B / 2`` (:data:`W_SHARE`; with ``B = 2 F`` the bubble is then ``(pp - 1) F``,
a sixth of 1F1B's); an input backward longer than the weight backward (the attention's and the KDA recurrence's
backward and the all-to-all's reverses are all in ``I``) makes it longer. ``F`` is the stage's forward: a third of
its model FLOPs' time, its forward dispatch and combine, half its pipeline sends, its offload copies beyond the
forward.

The activation peak: 1F1B keeps ``min(pp - r, m)`` micro-batches in flight on rank ``r`` (``m`` per step);
the V schedules keep them on every rank: at the peak ``2 pp + 1`` stage-micro-batches under DualPipeV, ``2 pp``
under ZBVZeroBubble (about ``pp + 1/2`` and ``pp`` micro-batches of a one-stage-per-rank stage), split between the
rank's two stages as :func:`inflight_states` replays them. A micro-batch is in flight on a stage from its forward to
its weight backward (or its full backward): the input backward frees only the activation gradients, the weight
backward still reads the saved inputs of the weight matmuls.

Each V schedule needs ``m >= 2 pp`` micro-batches per step and data-parallel group (:func:`min_microbatches`:
torch's ``ScheduleDualPipeV`` refuses fewer, ``ScheduleZBVZeroBubble`` runs the missing ones as bubbles and
``kimi train`` refuses them). With recomputation, a layer recomputed in the backward is replayed by the input and
again by the weight backward (``torch.utils.checkpoint`` under torch's split backward): its recompute forward, and
its all-to-all with it, is paid twice in a split backward and once in a full one (:func:`stage_recompute_passes`).

Not every backward of a V is split: DualPipeV runs most of its backwards whole (``B``: its steady state and its
cool-down), only the warm-up's zero-bubble parts as ``I`` and ``W``; ZBVZeroBubble splits them all. The recompute
passes are therefore counted per stage from torch's action lists (:func:`stage_recompute_passes`: 1 per full
backward, 2 per split one).

**The all-to-all of one micro-batch behind another's compute** (``kimi train --ep-overlap fb``, DualPipeV only:
``kernels_torch.parallel.fb_overlap``): each ``OVERLAP_F_B`` action of torch's list (:func:`overlap_pairs`) runs one
stage's forward and the other stage's full backward as two parties taking turns at each expert all-to-all, so each
transfer travels while the other party computes. :func:`pair_time` replays one such pair (the compute between two
hand-overs taken equal within a party, one transfer on the network at a time); the actions outside the pairs
(DualPipeV's warm-up and cool-down) keep their all-to-alls exposed.
"""

from __future__ import annotations

import functools

PLANNED_SCHEDULES = ("1F1B", "DualPipeV", "ZBVZeroBubble")
V_SCHEDULES = ("DualPipeV", "ZBVZeroBubble")  # kernels_torch.parallel.pipeline.V_SCHEDULES
W_SHARE = 0.5  # W / B of a V stage: not measured, I = W = B / 2 assumed (module docstring)


def _check(schedule: str, pp: int) -> None:
    if schedule not in PLANNED_SCHEDULES:
        raise ValueError(f"schedule: got {schedule!r}, expected one of {list(PLANNED_SCHEDULES)}")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 2:
        raise ValueError(f"pp: got {pp!r} with schedule {schedule!r}, expected an int >= 2 (a pipeline)")


def num_stages(schedule: str, pp: int) -> int:
    """Pipeline stages of ``schedule`` on ``pp`` ranks: ``pp`` (1F1B) or ``2 pp`` (a V).

    Raises:
        ValueError: a schedule outside :data:`PLANNED_SCHEDULES` or ``pp`` < 2."""
    _check(schedule, pp)
    return 2 * pp if schedule in V_SCHEDULES else pp


def rank_stages(schedule: str, pp: int, rank: int) -> tuple[int, ...]:
    """The stages rank ``rank`` holds: ``(rank,)`` (1F1B) or ``(rank, 2 pp - 1 - rank)`` (a V;
    ``kernels_torch.parallel.pipeline.stage_ranks``)."""
    _check(schedule, pp)
    return (rank, 2 * pp - 1 - rank) if schedule in V_SCHEDULES else (rank,)


def min_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches per step and data-parallel group ``kimi train`` runs ``schedule`` with: one per
    stage (``kimi_tools.train.parallel.TrainParallel.stages_needed``): ``pp`` or ``2 pp``."""
    return num_stages(schedule, pp)


@functools.lru_cache(maxsize=256)
def stage_recompute_passes(schedule: str | None, pp: int, m: int) -> tuple[float, ...]:
    """Per stage, the mean number of times a recomputed region's forward runs again in a micro-batch's backward over
    a step of ``m`` micro-batches: 1 for a full backward (``B``), 2 for one split into ``I`` and ``W`` (each replays
    it), counted in torch's action lists (:func:`_actions`); ``(1.0,) * pp`` for 1F1B (and ``(1.0,)`` without a
    pipeline, ``schedule`` None). DualPipeV, pp 4, m 16: between 1.125 and 1.25 per stage; ZBVZeroBubble: 2.

    Raises:
        ValueError: as :func:`inflight_states`."""
    if schedule is None:
        return (1.0,)
    inflight_states(schedule, pp, m)  # checks the schedule, pp and m
    if schedule not in V_SCHEDULES:
        return (1.0,) * pp
    split = [0] * (2 * pp)
    for ops in _actions(schedule, pp, m):
        for s, kind, _ in ops:
            split[s] += kind == "I"
    return tuple(1.0 + n / m for n in split)


@functools.lru_cache(maxsize=256)
def overlap_pairs(pp: int, m: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per rank of ``ScheduleDualPipeV`` on ``pp`` ranks with ``m`` micro-batches, its ``OVERLAP_F_B`` actions
    counted by stages: ``((forward stage, backward stage, count), ...)``: the forward of one micro-batch and the full
    backward of another that ``kimi train --ep-overlap fb`` runs as two parties taking turns
    (``kernels_torch.parallel.fb_overlap``). ``2 m - 3 pp + r + 1`` pairs on rank ``r`` (one fewer on the last).

    Raises:
        ValueError: as :func:`inflight_states` (``m`` below ``2 pp``)."""
    inflight_states("DualPipeV", pp, m)
    from torch.distributed.pipelining import schedules as S

    out = []
    for r in range(pp):
        counts: dict[tuple[int, int], int] = {}
        for a in _rank_actions("DualPipeV", pp, m, r):
            if a is not None and a.computation_type.value == "OVERLAP_F_B":
                f, b = a.sub_actions
                if (f.computation_type, b.computation_type) != (S.FORWARD, S.FULL_BACKWARD):
                    raise AssertionError(f"DualPipeV rank {r}: OVERLAP_F_B of {f} and {b}, expected F and B")
                key = (f.stage_index, b.stage_index)
                counts[key] = counts.get(key, 0) + 1
        out.append(tuple((f, b, n) for (f, b), n in sorted(counts.items())))
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def pair_time(c_f: float, n_f: int, c_b: float, n_b: int, t_x: float) -> float:
    """The time of one ``OVERLAP_F_B`` action run as two parties taking turns (``kernels_torch.parallel.fb_overlap``):
    the forward party computes ``c_f`` in ``n_f + 1`` equal parts, issuing one transfer of ``t_x`` after each part
    but the last (its ``n_f`` dispatches and combines); the backward party likewise (``c_b``, ``n_b``: its reverse
    transfers and those of its recomputed layers). The forward party starts; at each issue the turn passes to the
    other party, which first waits for its own transfer in flight (if any), then computes its next part; a party
    that has ended leaves the other to run alone, waiting for each of its transfers at once. Transfers share the
    network one at a time (a transfer starts when the previous one ends). Returns the action's time (the unit of the
    inputs): between ``c_f + c_b`` (every transfer hidden) and ``c_f + c_b + (n_f + n_b) t_x`` (none hidden, the
    time of the forward then the backward).

    Raises:
        ValueError: a negative time or count."""
    if min(c_f, c_b, t_x) < 0 or min(n_f, n_b) < 0:
        raise ValueError(f"pair_time: got c_f={c_f}, n_f={n_f}, c_b={c_b}, n_b={n_b}, t_x={t_x}, expected >= 0")
    part = {"F": c_f / (n_f + 1), "B": c_b / (n_b + 1)}
    issues, done_parts = {"F": n_f, "B": n_b}, {"F": 0, "B": 0}
    pending: dict[str, float | None] = {"F": None, "B": None}
    clock = net = 0.0
    ended: set[str] = set()
    turn = "F"
    while len(ended) < 2:
        other = "B" if turn == "F" else "F"
        if pending[turn] is not None:  # its transfer must have arrived before it computes on
            clock = max(clock, pending[turn])
            pending[turn] = None
        clock += part[turn]
        done_parts[turn] += 1
        if done_parts[turn] <= issues[turn]:  # it issues a transfer and hands the turn over
            net = max(clock, net) + t_x
            pending[turn] = net
            turn = turn if other in ended else other
        else:
            ended.add(turn)
            turn = other
    return clock


def bubble(schedule: str, pp: int, F: float, B: float, W: float | None = None) -> float:
    """The bubble per rank (seconds, or the unit of ``F``) of ``schedule`` on ``pp`` ranks, every stage alike:
    ``(pp - 1)(F + B)`` for 1F1B (``F``, ``B`` the forward and backward of one of its ``pp`` stages),
    ``(pp - 1)(F + B - 2 W)`` for a V (``F``, ``B`` and the weight backward ``W`` of one of its ``2 pp`` stages;
    ``W`` None: ``W_SHARE x B``). Module docstring: exact at pp 2 and 4, at pp 8 when ``F = I = W``.

    Raises:
        ValueError: a schedule outside :data:`PLANNED_SCHEDULES`, ``pp`` < 2, or ``W`` outside ``[0, B]``."""
    _check(schedule, pp)
    if schedule not in V_SCHEDULES:
        return (pp - 1) * (F + B)
    W = W_SHARE * B if W is None else W
    if not 0 <= W <= B:
        raise ValueError(f"W: got {W}, expected the weight part of the backward, in [0, B = {B}]")
    return (pp - 1) * (F + B - 2 * W)


@functools.lru_cache(maxsize=256)
def inflight_states(schedule: str, pp: int, m: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, the distinct counts of micro-batches in flight on each of its stages (:func:`rank_stages` order)
    after each forward of a step of ``m`` micro-batches: the states where the activation peak can come. 1F1B:
    ``((min(pp - r, m),),)`` for rank ``r``. A V schedule: replayed from torch's own action list for the rank
    (``ScheduleDualPipeV`` / ``ScheduleZBVZeroBubble._calculate_single_rank_operations``): a forward adds one on its
    stage, a full backward or a weight backward takes one off (``OVERLAP_F_B``: its forward, then its backward).

    Raises:
        ValueError: as :func:`num_stages`; ``m`` below :func:`min_microbatches`."""
    _check(schedule, pp)
    if m < min_microbatches(schedule, pp):
        raise ValueError(
            f"micro-batches: got {m} with {schedule} on {pp} ranks, expected at least {min_microbatches(schedule, pp)}"
        )
    if schedule not in V_SCHEDULES:
        return tuple(((min(pp - r, m),),) for r in range(pp))
    out = []
    for r, ops in enumerate(_actions(schedule, pp, m)):
        slot = {s: j for j, s in enumerate(rank_stages(schedule, pp, r))}
        n, states = [0, 0], set()
        for s, kind, _ in ops:
            if kind == "F":
                n[slot[s]] += 1
                states.add(tuple(n))
            elif kind in ("B", "W"):
                n[slot[s]] -= 1
        if n != [0, 0]:
            raise AssertionError(f"{schedule} replay: rank {r} ends with {n} micro-batches in flight")
        # keep the states no other state dominates on both stages
        out.append(
            tuple(sorted(s for s in states if not any(t != s and t[0] >= s[0] and t[1] >= s[1] for t in states)))
        )
    return tuple(out)


def _rank_actions(schedule: str, pp: int, m: int, r: int) -> list:
    """torch's action list of rank ``r`` (``_Action`` or None), ``ScheduleDualPipeV`` /
    ``ScheduleZBVZeroBubble._calculate_single_rank_operations``, built without stages or a process group."""
    from torch.distributed.pipelining import schedules as S

    cls = {"DualPipeV": S.ScheduleDualPipeV, "ZBVZeroBubble": S.ScheduleZBVZeroBubble}[schedule]
    sched = object.__new__(cls)  # the action list only: no stage, no process group
    sched.pp_group_size, sched._n_microbatches = pp, m
    sched.num_stages = sched._num_stages = 2 * pp
    sched.n_local_stages = 2
    return sched._calculate_single_rank_operations(r)


@functools.lru_cache(maxsize=64)
def _actions(schedule: str, pp: int, m: int) -> tuple[tuple[tuple[int, str, int], ...], ...]:
    """Per rank, torch's compute actions of a V schedule as ``(stage, kind, micro-batch)``, kind "F", "I", "W" or
    "B" (full backward), in order; ``OVERLAP_F_B`` as its forward then its backward (:func:`_rank_actions`)."""
    out = []
    for r in range(pp):
        flat = []
        for a in _rank_actions(schedule, pp, m, r):
            if a is None:
                continue
            for b in a.sub_actions if a.computation_type.value == "OVERLAP_F_B" else (a,):
                flat.append((b.stage_index, b.computation_type.value, b.microbatch_index))
        out.append(tuple(flat))
    return tuple(out)


def replay_bubble(schedule: str, pp: int, F: float, I: float, W: float, m: int | None = None) -> float:
    """The bubble of a V schedule on ``pp`` ranks (the same unit as ``F``): the longest step of any rank less its
    work ``m x 2 (F + I + W)``, from torch's action lists (:func:`_actions`) run with communication free and every
    stage alike: a forward waits for the previous stage's forward of its micro-batch, an input (or full) backward for
    the next stage's input backward (the last stage for its own forward), a weight backward for its input backward,
    each rank runs its actions in order. ``m``: micro-batches (None: ``2 pp``, the fewest; more do not change the
    bubble, ``tests/test_plan.py``). Equal to :func:`bubble` where ``F = I = W``; with ``I = W > F`` (a recomputed
    layer in both parts) longer: pp 4, ``I = W = 2 F``: 5 F (DualPipeV), 6 F (ZBVZeroBubble) against the formula's
    3 F.

    Raises:
        ValueError: not a V schedule; a negative time; ``m`` below ``2 pp``."""
    if schedule not in V_SCHEDULES:
        raise ValueError(f"schedule: got {schedule!r}, expected one of {list(V_SCHEDULES)} (a V schedule)")
    if min(F, I, W) < 0:
        raise ValueError(f"F, I, W: got {F}, {I}, {W}, expected times >= 0")
    if F == 0 and I == 0 and W == 0:
        return 0.0
    m = 2 * pp if m is None else m
    inflight_states(schedule, pp, m)  # checks pp and m
    scale = max(F, I, W)
    return scale * _replay(schedule, pp, m, round(F / scale, 6), round(I / scale, 6), round(W / scale, 6))


@functools.lru_cache(maxsize=4096)
def _replay(schedule: str, pp: int, m: int, F: float, I: float, W: float) -> float:
    lists, ns = _actions(schedule, pp, m), 2 * pp
    cost = {"F": F, "I": I, "W": W, "B": I + W}
    done: dict = {}
    clock, pos = [0.0] * pp, [0] * pp
    while any(pos[r] < len(lists[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(lists[r]):
                s, kind, i = lists[r][pos[r]]
                if kind == "F":
                    need = [(s - 1, "F", i)] if s > 0 else []
                elif kind in ("I", "B"):
                    need = [(s + 1, "I", i)] if s < ns - 1 else [(s, "F", i)]
                else:
                    need = [(s, "I", i)]
                if any(n not in done for n in need):
                    break
                clock[r] = max([clock[r]] + [done[n] for n in need]) + cost[kind]
                done[(s, "I" if kind == "B" else kind, i)] = clock[r]
                pos[r] += 1
                moved = True
        if not moved:
            raise AssertionError(f"{schedule} replay on {pp} ranks: no action can run")
    return max(clock) - m * 2 * (F + I + W)
