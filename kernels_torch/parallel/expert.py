"""Expert parallelism (EP) of the torch MoE over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).

The ``E`` routed experts of every :class:`kernels_torch.moe.KimiMoE` are split over the ``world`` ranks of the EP
group in contiguous blocks: rank ``r`` owns experts ``[r E/world, (r + 1) E/world)`` (``E`` must be divisible by
``world``). Everything else of the layer (the router ``gate``, the latent ``routed_expert_down_proj`` /
``routed_expert_norm`` / ``routed_expert_up_proj``, the shared experts) stays on every rank and runs on the rank's
own tokens, as in data parallelism; only the routed-expert step (``KimiMoE.routed_experts``, spec 5.3 steps 4-6) is
replaced, on the instance, by (``docs/scaling.md`` section 2):

1. *route*: the layer's own router, unchanged (same top-k, ``e_score_correction_bias`` for the choice only, grouped
   top-k, renormalisation, ``routed_scaling_factor``): ``ids, weights`` ``[N, k]`` for the rank's ``N`` tokens.
2. *dispatch*: the ``N k`` (token, expert) pairs are sorted by expert (stable: token order within an expert), so
   they are grouped by owner rank; one small ``all_to_all_single`` of the per-expert counts ``[E]`` int64 tells
   every rank how many rows it receives from each source for each of its experts; then ``all_to_all_single`` of the
   latent rows ``z`` ``[N k, Dl]`` (the latent MoE dispatches in ``Dl``, not ``D``) with those split sizes.
3. *experts*: the owner runs each received row through its local expert with the layer's own
   :meth:`kernels_torch.moe.GroupedExperts.rows_forward` (the grouped GEMMs, or the readable loop, as the layer's
   ``moe_kernel`` picks: the same path as one process); outputs in the activation dtype (the rounding ``KimiMoE``
   applies).
4. *combine*: the reverse ``all_to_all_single`` returns every output row to its token's rank, in the order it was
   sent; there the rows are weighted by the fp32 router weights and summed per token in fp32 (``index_add_`` in
   expert order, as ``KimiMoE.routed_experts``; on CUDA ``index_add_`` with repeated indices does not fix the order
   of the additions, so the sums there match the single-process MoE to fp32 rounding, not bitwise).

Backward: ``torch.distributed._functional_collectives.all_to_all_single_autograd`` (what
``torch.distributed.nn.functional.all_to_all_single`` now points to): the gradient of an all-to-all is the reverse
all-to-all (split sizes swapped), so the gradient of the combine goes back to the expert owners and the gradient of
the dispatch back to the tokens' ranks (reaching ``routed_expert_down_proj``, the router through the weights, and x).

Gradients: each rank holds the **whole** gradient of its own experts (every token of the group that chose them); the
replicated parameters (router, latent projections, norm, shared experts) get each rank's part and must be summed (or
averaged, as the loss is normalised) over the group, as data-parallel replicas.

Use::

    ep = shard_experts(model, group)        # keeps only this rank's experts; call the model as before
    ep.load_full_state_dict(full_sd)        # a full (single-process) state dict, sliced to this rank's experts
    loss.backward()                         # then sum the replicated parameters' gradients over the group

The all-to-alls' split sizes are host integers, so the dispatch reads the per-expert counts on the host once per
layer call (the one host sync of an expert-parallel MoE; the single-process grouped path has none).

**Overlap** (``shard_experts(..., overlap="chunks")``, ``kimi train --ep-overlap chunks``; default ``"none"``, all
of the above in sequence): the rank's ``N`` tokens are cut in two chunks (tokens ``[0, ceil(N/2))`` and the rest),
each with its own dispatch and combine (one counts exchange for both, one host read), issued as asynchronous
``dist.all_to_all_single(..., async_op=True)`` (on NCCL they run on the process group's own stream while the
compute stream goes on; on gloo on its worker threads) in this order::

    issue dispatch 0, issue dispatch 1
    wait dispatch 0 -> experts of chunk 0        (dispatch 1 travels)
    issue combine 0; wait dispatch 1 -> experts of chunk 1   (combine 0 travels)
    issue combine 1 -> the shared experts        (combine 1 travels)
    wait combine 0, 1 -> each chunk's weighted sums

The backward runs the reverse all-to-alls interleaved the same way: each transfer is two autograd nodes (issue and
wait; ``_Transfer``), the reverse combines of both chunks are issued first (and the shared experts' backward runs
while they travel), chunk 1's expert backward runs while chunk 0's reverse combine travels, chunk 0's while chunk
1's reverse dispatch travels. What stays exposed is the first dispatch and the last combine of a layer (and their
reverses). Numbers: a token's pairs all lie in its chunk and are summed in expert order, so each token's combine
sum is the one of the path without overlap; what differs is that the experts run each chunk's rows as their own
GEMMs (half the rows per expert) and each weight gradient is the sum of two per-chunk GEMMs instead of one, so fp32
results differ by rounding (fp64: to 1e-12; ``tests/test_ep_overlap.py``). ``ExpertParallel.trace`` records the
order of the transfers' events. With FSDP2 over ``efsdp`` the experts' unit runs twice per layer (one
``rows_forward`` per chunk): with ``efsdp`` > 1 and resharding after the forward, its all-gather runs twice.

**Across micro-batches** (``overlap="fb"``, ``kimi train --ep-overlap fb``; ``"fb+chunks"`` with the two chunks
above): the layer's dispatch and combine are :class:`_Transfer` s of the whole ``N`` tokens, and after each issue
(forward, and the reverse issues of the backward) the turn is handed to the other micro-batch of a DualPipeV
``OVERLAP_F_B`` action (``kernels_torch.parallel.fb_overlap``, registered by
``kernels_torch.parallel.pipeline.Pipeline(overlap_f_b=True)``): the transfer travels while the other micro-batch
computes, and is waited for when the turn comes back. Outside such an action (the schedule's other actions, the
evaluation, no pipeline) the hand-over is a no-op and ``"fb"`` runs as ``"none"`` (the same numbers: the same rows
in the same order, ``dist.all_to_all_single(async_op=True)`` waited at once). ``"fb+chunks"`` hands the turn over
at each of the two chunks' transfers. With ``trace`` set, the events also go to the action's
``Pipeline.overlap_trace`` as ``"F forward issue dispatch"``, ``"B backward wait combine"`` (``F`` the forward
party, ``B`` the backward one).

Not implemented: capacity limits / token dropping (this is dropless, variable counts), a reader that fetches only
the local experts from a checkpoint directory (``load_full_state_dict`` takes full tensors; ``kernels_torch.params.load_canonical`` streams canonical pairs and
skips other ranks' experts).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from kernels_torch.common import compute_dtype
from kernels_torch.moe import KimiMoE
from kernels_torch.parallel.fb_overlap import active_turns, pass_turn
from kernels_torch.params import load_canonical
from kimi.layout import EXPERT_PROJECTIONS

__all__ = ["OVERLAPS", "FB_OVERLAPS", "experts_per_rank", "all_to_all", "ExpertParallel", "shard_experts"]

# ExpertParallel.overlap: no overlap; the two-chunk overlap inside each layer; across micro-batches (one chunk, the
# turn handed to the other micro-batch at each transfer inside DualPipeV's overlapped actions); both (module docstring)
OVERLAPS = ("none", "chunks", "fb", "fb+chunks")
FB_OVERLAPS = ("fb", "fb+chunks")  # the modes that hand the turn over (kernels_torch.parallel.fb_overlap)

_EXPERT_KEY = re.compile(r"(^|\.)experts\.(\d+)\.")  # a canonical per-expert name
_STACK_KEY = re.compile(r"(^|\.)experts\.w[123]$")  # a stacked name (kimi.layout.stacked_layout)


def experts_per_rank(num_experts: int, world: int) -> int:
    """``num_experts / world``, the number of experts each EP rank owns.

    Raises:
        ValueError: ``world < 1`` or ``num_experts`` not divisible by ``world``.
    """
    if world < 1:
        raise ValueError(f"world: got {world}, expected a positive EP group size")
    if num_experts % world:
        raise ValueError(
            f"num_experts: got {num_experts} for an expert-parallel group of {world} ranks, expected a multiple of "
            f"{world} (each rank owns num_experts / world experts)"
        )
    return num_experts // world


def _check_overlap(mode) -> None:
    if mode not in OVERLAPS:
        raise ValueError(f"overlap: got {mode!r}, expected one of {list(OVERLAPS)}")


def all_to_all(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0: rows ``input_split_sizes[j]`` of ``x`` go to rank ``j``;
    the result holds ``output_split_sizes[j]`` rows from rank ``j``, in rank order. Backward: the reverse all-to-all
    (``torch.distributed._functional_collectives.all_to_all_single_autograd``).

    ``x`` ``[sum(input_split_sizes), ...]`` -> ``[sum(output_split_sizes), ...]``, same dtype. Every rank of the group
    must call it (and run its backward) in the same order."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), list(output_split_sizes), list(input_split_sizes), group)
    return funcol.wait_tensor(out)


class _Plan:
    """One chunk's dispatch: its pairs in expert order (``tok``, ``slot``: chunk-local token and top-k slot of each
    sent row), the split sizes (host ints: rows to / from each rank) and the local expert of each received row."""

    def __init__(self, tok, slot, send_splits, recv_splits, row_expert):
        self.tok, self.slot, self.send_splits, self.recv_splits, self.row_expert = (
            tok, slot, send_splits, recv_splits, row_expert,
        )  # fmt: skip


def _plans(ep: ExpertParallel, chunks: list[torch.Tensor], num_experts: int) -> list[_Plan]:
    """The dispatch plans of ``chunks`` (each ``ids`` ``[n, k]`` of one chunk of the rank's tokens), with one small
    ``all_to_all_single`` of the per-expert counts of every chunk (``[world, chunks, El]`` int64) and one host read."""
    world, El = ep.world, ep.experts_per_rank
    orders, counts = [], []
    for ids in chunks:
        flat = ids.reshape(-1)  # [n k]
        orders.append(torch.sort(flat, stable=True).indices)  # [n k]: pair (tok, slot) = divmod(order, k)
        counts.append(torch.bincount(flat, minlength=num_experts))  # [E] pairs to each expert (on z's device: NCCL)
    send = torch.stack([c.view(world, El) for c in counts], 1).contiguous()  # [world (destination), chunks, El]
    recv = torch.empty_like(send)  # [world (source), chunks, El]: rows from source j for my local expert e
    dist.all_to_all_single(recv, send, group=ep.group)
    send, recv = send.cpu(), recv.cpu()  # the split sizes are host integers
    local = torch.arange(El).repeat(world)  # [world El]: local expert of each (source, expert) block
    plans = []
    for c, (ids, order) in enumerate(zip(chunks, orders)):
        k = ids.shape[1]
        row_expert = torch.repeat_interleave(local, recv[:, c].reshape(-1)).to(ids.device)  # [R]
        send_splits, recv_splits = send[:, c].sum(1).tolist(), recv[:, c].sum(1).tolist()
        plans.append(_Plan(order // k, order % k, send_splits, recv_splits, row_expert))
    return plans


def _weighted_sum(back: torch.Tensor, plan: _Plan, weights: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """The combine's sum on the token's rank: ``back`` ``[n k, Dl]`` (the expert outputs of the chunk's pairs, in
    the plan's order), ``weights`` ``[n, k]`` fp32 -> ``[n, Dl]`` in ``cd``, each token's outputs weighted by their
    router weights and added in expert order (``index_add_`` over the expert-sorted pairs)."""
    r = torch.zeros(weights.shape[0], back.shape[-1], dtype=cd, device=back.device)
    return r.index_add_(0, plan.tok, back.to(cd) * weights[plan.tok, plan.slot, None].to(cd))


def _routed_experts_ep(moe: KimiMoE, ep: ExpertParallel, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """``KimiMoE.routed_experts`` under expert parallelism (module docstring, steps 2-4): ``z`` ``[N, Dl]``, ``ids``
    / ``weights`` ``[N, k]`` of this rank's tokens -> ``[N, Dl]`` fp32 (fp64 for fp64 z)."""
    (plan,) = _plans(ep, [ids], moe.config.num_experts)  # 2. dispatch: pairs in expert order, counts first
    recv = all_to_all(z[plan.tok], plan.recv_splits, plan.send_splits, ep.group)  # [R, Dl]: source-major
    y = moe.experts.rows_forward(recv, plan.row_expert)  # 3. [R, Dl] in z's dtype, in the received order
    back = all_to_all(y, plan.send_splits, plan.recv_splits, ep.group)  # 4. combine: [N k, Dl] in the plan's order
    return _weighted_sum(back, plan, weights, compute_dtype(z))


def _routed_experts_fb(moe: KimiMoE, ep: ExpertParallel, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """``KimiMoE.routed_experts`` under expert parallelism with the overlap across micro-batches (``overlap="fb"``):
    :func:`_routed_experts_ep`'s steps with its two all-to-alls as :class:`_Transfer` s, each handing the turn to the
    other micro-batch of an overlapped forward + backward between its issue and its wait (forward and backward).
    ``z`` ``[N, Dl]``, ``ids`` / ``weights`` ``[N, k]`` -> ``[N, Dl]`` fp32 (fp64 for fp64 z)."""
    (plan,) = _plans(ep, [ids], moe.config.num_experts)
    recv = _Transfer(ep, plan.recv_splits, plan.send_splits, "dispatch").start(z[plan.tok]).finish()  # [R, Dl]
    y = moe.experts.rows_forward(recv, plan.row_expert)  # [R, Dl] in z's dtype
    back = _Transfer(ep, plan.send_splits, plan.recv_splits, "combine").start(y).finish()  # [N k, Dl]
    return _weighted_sum(back, plan, weights, compute_dtype(z))


class _Transfer:
    """One all-to-all of the overlapped paths (two chunks, or across micro-batches), in flight between :meth:`start` and :meth:`finish`, forward and
    backward: ``x`` ``[sum(in_splits), ...]`` -> ``[sum(out_splits), ...]`` over ``group`` (``dist.all_to_all_single``,
    ``async_op=True``: on NCCL its own stream, on gloo its worker threads).

    Autograd sees two nodes: :class:`_Start` (made at :meth:`start`: sends ``x``, returns an empty token) and
    :class:`_Finish` (made at :meth:`finish`: waits, returns the received rows). The backward runs them in reverse:
    ``_Finish``'s backward *issues* the reverse all-to-all of the rows' gradient (split sizes swapped) and returns,
    ``_Start``'s backward *waits* for it and returns ``x``'s gradient. Autograd runs ready nodes latest-made first,
    so what was computed between ``start`` and ``finish`` in the forward (the other chunk's experts) has its backward
    run while the reverse transfer travels."""

    def __init__(self, ep: ExpertParallel, out_splits: list[int], in_splits: list[int], name: str):
        self.group, self.trace, self.name = ep.group, ep.trace, name
        self.fb = ep.overlap in FB_OVERLAPS  # hand the turn over after each issue (inside an overlapped action)
        self.out_splits, self.in_splits = out_splits, in_splits
        self.work = self.out = self.sent = self.token = None

    def log(self, what: str) -> None:
        if self.trace is not None:
            self.trace.append(f"{what} {self.name}")
        turns = active_turns() if self.fb else None
        if turns is not None:
            turns.log(f"{what} {self.name}")

    def issued(self) -> None:
        """After an issue: with an ``fb`` mode, inside an overlapped forward + backward, the other micro-batch
        computes while this transfer travels (``kernels_torch.parallel.fb_overlap.pass_turn``)."""
        if self.fb:
            pass_turn()

    def start(self, x: torch.Tensor) -> _Transfer:
        self.token = _Start.apply(x, self)
        return self

    def finish(self) -> torch.Tensor:
        return _Finish.apply(self.token, self)


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, t: _Transfer) -> torch.Tensor:
        x = x.contiguous()
        t.out = x.new_empty((sum(t.out_splits), *x.shape[1:]))
        t.sent = x  # held until the transfer is waited for
        t.work = dist.all_to_all_single(t.out, x, t.out_splits, t.in_splits, group=t.group, async_op=True)
        t.log("forward issue")
        ctx.t = t
        t.issued()
        return x.new_empty(0)  # the token: links this node to _Finish's

    @staticmethod
    def backward(ctx, _token_grad):
        t = ctx.t
        if t.work is None:
            raise RuntimeError(f"expert all-to-all {t.name}: the backward waits for a transfer never issued")
        t.work.wait()
        t.log("backward wait")
        grad, t.work, t.out, t.sent = t.out, None, None, None
        return grad, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token: torch.Tensor, t: _Transfer) -> torch.Tensor:
        t.work.wait()
        t.log("forward wait")
        out, t.work, t.out, t.sent = t.out, None, None, None
        ctx.t = t
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        t = ctx.t
        grad = grad.contiguous()
        t.out = grad.new_empty((sum(t.in_splits), *grad.shape[1:]))
        t.sent = grad
        t.work = dist.all_to_all_single(t.out, grad, t.in_splits, t.out_splits, group=t.group, async_op=True)
        t.log("backward issue")
        t.issued()
        return grad.new_zeros(0), None


def _routed_and_shared_chunks(
    moe: KimiMoE, ep: ExpertParallel, x: torch.Tensor, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``KimiMoE.routed_and_shared`` under expert parallelism with the two-chunk overlap (module docstring): the
    rank's ``N`` tokens in two chunks (``[0, ceil(N/2))`` and the rest); chunk 1's dispatch travels while chunk 0's
    experts run, chunk 0's combine while chunk 1's experts run, chunk 1's combine while the shared experts run.
    ``x`` ``[B, T, D]``, ``z`` ``[N, Dl]``, ``ids`` / ``weights`` ``[N, k]`` -> (``[N, Dl]`` fp32 (fp64 for fp64 z),
    the shared experts' ``[B, T, D]`` or None)."""
    N = ids.shape[0]
    cuts = [(0, (N + 1) // 2), ((N + 1) // 2, N)]
    plans = _plans(ep, [ids[a:b] for a, b in cuts], moe.config.num_experts)
    sent = [
        _Transfer(ep, p.recv_splits, p.send_splits, f"dispatch {c}").start(z[a:b][p.tok])
        for c, ((a, b), p) in enumerate(zip(cuts, plans))
    ]
    back = []
    for c, p in enumerate(plans):  # chunk c's experts while the next transfer travels
        y = moe.experts.rows_forward(sent[c].finish(), p.row_expert)  # [R_c, Dl] in z's dtype
        back.append(_Transfer(ep, p.send_splits, p.recv_splits, f"combine {c}").start(y))
    shared = moe.shared_experts(x) if moe.config.num_shared_experts else None  # while the last combine travels
    cd = compute_dtype(z)
    r = [_weighted_sum(t.finish(), p, weights[a:b], cd) for t, p, (a, b) in zip(back, plans, cuts)]
    return torch.cat(r), shared


class ExpertParallel:
    """Expert parallelism of every :class:`kernels_torch.moe.KimiMoE` inside ``model`` (a
    :class:`kernels_torch.model.KimiK3Model`, or a bare ``KimiMoE``) over a process group.

    Attaching keeps only this rank's experts: each layer's stacked ``experts.w1`` / ``w3`` / ``w2`` becomes a
    ``DTensor`` of global shape ``[E, ...]``, ``Shard(0)`` over the 1-D ``ep`` mesh, whose local tensor is this rank's
    ``[E / world, ...]`` rows (``experts.expert_ids`` the range of their global ids, so
    ``kernels_torch.params.canonical_state_dict`` names them ``...experts.8.w1.weight`` as the checkpoint does); the
    other ranks' experts are freed. Being DTensors, the stacks carry their placement: DCP
    (``torch.distributed.checkpoint``) writes every rank's experts under their global offsets and reshards them on
    load, and FSDP2 shards them further over the ranks that hold the same experts
    (``kernels_torch.parallel.parallelize.parallelize``: the ``efsdp`` mesh). ``moe.routed_experts`` is replaced on the
    instance by the all-to-all version (module docstring), which computes on the local tensors
    (``GroupedExperts.local_weights``). Build the model on the ``meta`` device, attach, then ``to_empty`` and
    :meth:`load_full_state_dict`, to never hold all experts at once.

    Args:
        model: the module holding the MoE layers. group: the EP process group (default: the world group; its
            1-D mesh is made with ``DeviceMesh.from_group``). mesh: the 1-D ``ep`` DeviceMesh instead of a group.
        overlap: ``"none"`` (one dispatch, the experts, one combine), ``"chunks"`` (the two-chunk overlap of the
            module docstring), ``"fb"`` (one chunk, the turn handed to the other micro-batch of a DualPipeV
            overlapped action at each transfer) or ``"fb+chunks"`` (both); every rank of the group must use the same.

    Attributes:
        model, group, mesh, rank, world; experts_per_rank (``E / world``); local_experts (``range`` of this rank's
        global ids); overlap (settable: switches every layer); trace: None, or a list to which the overlapped
        path appends its all-to-alls' events in the order they happen (``"forward issue dispatch 0"``, ...,
        ``"backward wait combine 1"``).

    Raises:
        RuntimeError: ``torch.distributed`` not initialised; ``model`` holds no ``KimiMoE``.
        ValueError: ``num_experts`` not divisible by the group size (:func:`experts_per_rank`) or not the same in
            every MoE layer; an MoE already expert-parallel (nothing is changed then); this process not a member of
            ``group``; both ``group`` and ``mesh``, or a mesh that is not 1-D; ``overlap`` not in
            :data:`OVERLAPS`.
    """

    def __init__(self, model: nn.Module, group=None, *, mesh: DeviceMesh | None = None, overlap: str = "none"):
        _check_overlap(overlap)
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallel: torch.distributed is not initialised (init_process_group first)")
        if mesh is not None and group is not None:
            raise ValueError("ExpertParallel: got both group and mesh, expected one (the mesh's group is used)")
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(f"mesh: got a {mesh.ndim}-D mesh, expected the 1-D ep mesh (ParallelMesh['ep'])")
        self.model = model
        self.group = mesh.get_group() if mesh is not None else group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.rank < 0:  # new_group's non-member handle: rank -1 would index the last experts from the end
            raise ValueError(
                f"group: this process (global rank {dist.get_rank()}) is not a member of the expert-parallel group, "
                "expected a group that holds it (call shard_experts only on the group's ranks)"
            )
        if mesh is None:
            device_type = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
            mesh = DeviceMesh.from_group(self.group, device_type, mesh_dim_names=("ep",))
        self.mesh = mesh
        self._layers = [m for m in model.modules() if isinstance(m, KimiMoE)]
        if not self._layers:
            raise RuntimeError(f"ExpertParallel: {type(model).__name__} holds no KimiMoE layer, expected at least one")
        self.num_experts = self._layers[0].config.num_experts
        self.experts_per_rank = experts_per_rank(self.num_experts, self.world)
        self.local_experts = range(self.rank * self.experts_per_rank, (self.rank + 1) * self.experts_per_rank)
        for m in self._layers:  # every layer checked before any is changed: a refusal leaves the model as it was
            if m.experts.expert_ids != range(m.experts.num_experts):
                raise ValueError("ExpertParallel: an MoE layer is already expert-parallel (its experts are sharded)")
            if m.experts.num_experts != self.num_experts:
                raise ValueError(
                    f"num_experts: an MoE layer holds {m.experts.num_experts} experts, expected "
                    f"{self.num_experts} (the first layer's config) in every layer"
                )
        lo, hi = self.local_experts.start, self.local_experts.stop
        for m in self._layers:
            for w in EXPERT_PROJECTIONS:
                old = getattr(m.experts, w)
                local = old.detach()[lo:hi].clone()  # [E / world, ...]; free on meta
                dt = DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False)  # global [E, ...]
                setattr(m.experts, w, nn.Parameter(dt, requires_grad=old.requires_grad))
            m.experts.expert_ids = self.local_experts
            m.experts.ep_mesh = self.mesh
        self.trace: list[str] | None = None
        self.overlap = overlap

    @property
    def overlap(self) -> str:
        """One of :data:`OVERLAPS`: how every MoE layer runs its all-to-alls (module docstring)."""
        return self._overlap

    @overlap.setter
    def overlap(self, mode: str) -> None:
        _check_overlap(mode)
        self._overlap = mode
        routed = _routed_experts_fb if mode == "fb" else _routed_experts_ep
        for m in self._layers:
            m.routed_experts = functools.partial(routed, m, self)
            chunks = mode in ("chunks", "fb+chunks")
            m.routed_and_shared = functools.partial(_routed_and_shared_chunks, m, self) if chunks else None
            m.expert_overlap = mode  # read by Pipeline(overlap_f_b=True)

    def owner(self, expert: int) -> int:
        """The EP rank that owns global expert id ``expert``."""
        return expert // self.experts_per_rank

    def shard_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of a full (single-process) state dict that this rank keeps: stacked expert tensors
        (``...experts.w1``, ``[E, ...]``) sliced to this rank's rows; per-expert canonical keys
        (``...experts.<id>.w1.weight``) kept only for :attr:`local_experts`; everything else as it is.

        Raises:
            ValueError: a canonical expert id outside ``[0, num_experts)``, or a stack whose first axis is not
                ``num_experts``."""
        out = {}
        lo, hi = self.local_experts.start, self.local_experts.stop
        for name, t in state_dict.items():
            m = _EXPERT_KEY.search(name)
            if m is not None and not 0 <= int(m.group(2)) < self.num_experts:
                raise ValueError(
                    f"state_dict: {name!r} names expert {m.group(2)}, expected an id in [0, {self.num_experts}) "
                    "(num_experts): a checkpoint of another model?"
                )
            if _STACK_KEY.search(name):
                if t.shape[0] != self.num_experts:
                    raise ValueError(
                        f"state_dict: {name!r} stacks {t.shape[0]} experts, expected {self.num_experts} (num_experts)"
                    )
                out[name] = t[lo:hi]
            elif m is None or int(m.group(2)) in self.local_experts:
                out[name] = t
        return out

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]):
        """Load a full (single-process, all experts) state dict into the sharded, materialised model (after
        ``to_empty`` from ``meta``): the single-process model's own ``state_dict()`` (stacked experts) or its
        canonical form (per-expert keys), sliced by :meth:`shard_state_dict`, then copied in by
        ``kernels_torch.params.load_canonical`` (strict).

        Raises:
            ValueError: a key missing from ``state_dict``, a key that is neither the model's nor another rank's expert,
                or a misshaped tensor (all listed).
        """
        return load_canonical(self.model, self.shard_state_dict(state_dict), strict=True)


def shard_experts(
    model: nn.Module, group=None, *, mesh: DeviceMesh | None = None, overlap: str = "none"
) -> ExpertParallel:
    """Make every MoE layer of ``model`` expert-parallel over ``mesh`` (a 1-D ``ep`` mesh, e.g.
    ``kernels_torch.parallel.mesh.ParallelMesh['ep']``) or ``group`` (default the world group), its all-to-alls
    overlapped with compute as ``overlap`` says (one of :data:`OVERLAPS`): see :class:`ExpertParallel` (which
    this returns; its errors)."""
    return ExpertParallel(model, group, mesh=mesh, overlap=overlap)
