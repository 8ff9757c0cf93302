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

Not implemented: capacity limits / token dropping (this is dropless, variable counts), overlap of the all-to-alls
with compute, a reader that fetches only the local experts from a checkpoint directory (``load_full_state_dict``
takes full tensors; ``kernels_torch.params.load_canonical`` streams canonical pairs and skips other ranks' experts).
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
from kernels_torch.params import load_canonical
from kimi.layout import EXPERT_PROJECTIONS

__all__ = ["experts_per_rank", "all_to_all", "ExpertParallel", "shard_experts"]

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


def all_to_all(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0: rows ``input_split_sizes[j]`` of ``x`` go to rank ``j``;
    the result holds ``output_split_sizes[j]`` rows from rank ``j``, in rank order. Backward: the reverse all-to-all
    (``torch.distributed._functional_collectives.all_to_all_single_autograd``).

    ``x`` ``[sum(input_split_sizes), ...]`` -> ``[sum(output_split_sizes), ...]``, same dtype. Every rank of the group
    must call it (and run its backward) in the same order."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), list(output_split_sizes), list(input_split_sizes), group)
    return funcol.wait_tensor(out)


def _routed_experts_ep(moe: KimiMoE, ep: ExpertParallel, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """``KimiMoE.routed_experts`` under expert parallelism (module docstring, steps 2-4): ``z`` ``[N, Dl]``, ``ids``
    / ``weights`` ``[N, k]`` of this rank's tokens -> ``[N, Dl]`` fp32 (fp64 for fp64 z)."""
    E, world, El = moe.config.num_experts, ep.world, ep.experts_per_rank
    N, k = ids.shape
    cd = compute_dtype(z)

    # 2. dispatch: pairs in expert order (= grouped by owner rank), per-expert counts first
    flat = ids.reshape(-1)  # [N k]
    order = torch.sort(flat, stable=True).indices  # [N k]: pair (tok, slot) = divmod(order, k)
    tok, slot = order // k, order % k
    counts = torch.bincount(flat, minlength=E)  # [E] pairs this rank sends to each expert (on z's device: NCCL)
    recv_counts = torch.empty_like(counts)  # [E] = [world, El]: rows from source j for my local expert e
    dist.all_to_all_single(recv_counts, counts, group=ep.group)
    counts, recv_counts = counts.cpu(), recv_counts.cpu()  # the split sizes are host integers
    send_splits = counts.view(world, El).sum(1).tolist()
    recv_splits = recv_counts.view(world, El).sum(1).tolist()
    recv = all_to_all(z[tok], recv_splits, send_splits, ep.group)  # [R, Dl]: source-major, expert within source

    # 3. the local experts, each row through its own (grouped GEMMs or the loop, as the layer's moe_kernel picks)
    local = torch.arange(El).repeat(world)  # [world El]: local expert of each (source, expert) block
    row_expert = torch.repeat_interleave(local, recv_counts).to(z.device)  # [R]
    y = moe.experts.rows_forward(recv, row_expert)  # [R, Dl] in z's dtype, in the received order

    # 4. combine: the reverse all-to-all, then the weighted fp32 sum per token in expert order
    back = all_to_all(y, send_splits, recv_splits, ep.group)  # [N k, Dl] in `order`
    r = torch.zeros(N, z.shape[-1], dtype=cd, device=z.device)
    return r.index_add_(0, tok, back.to(cd) * weights[tok, slot, None].to(cd))


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

    Attributes:
        model, group, mesh, rank, world; experts_per_rank (``E / world``); local_experts (``range`` of this rank's
        global ids).

    Raises:
        RuntimeError: ``torch.distributed`` not initialised; ``model`` holds no ``KimiMoE``.
        ValueError: ``num_experts`` not divisible by the group size (:func:`experts_per_rank`) or not the same in
            every MoE layer; an MoE already expert-parallel (nothing is changed then); this process not a member of
            ``group``; both ``group`` and ``mesh``, or a mesh that is not 1-D.
    """

    def __init__(self, model: nn.Module, group=None, *, mesh: DeviceMesh | None = None):
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
            m.routed_experts = functools.partial(_routed_experts_ep, m, self)

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


def shard_experts(model: nn.Module, group=None, *, mesh: DeviceMesh | None = None) -> ExpertParallel:
    """Make every MoE layer of ``model`` expert-parallel over ``mesh`` (a 1-D ``ep`` mesh, e.g.
    ``kernels_torch.parallel.mesh.ParallelMesh['ep']``) or ``group`` (default the world group): see
    :class:`ExpertParallel` (which this returns; its errors)."""
    return ExpertParallel(model, group, mesh=mesh)
