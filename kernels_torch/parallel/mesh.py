"""One device mesh for pipeline, data, context and expert parallelism, after torchtitan's
``ParallelDims`` (``torchtitan/distributed/parallel_dims.py`` and ``PARALLEL_DIMS.md``).

Sizes: ``pp`` pipeline ranks (the outermost mesh axis: a pipeline group is the ranks that share every other
coordinate; ``kernels_torch.parallel.pipeline``), ``dp`` data-parallel replicas (FSDP2 shards over them), ``cp`` context-parallel ranks
(each holds one shard of the same sequences), ``ep`` expert-parallel ranks. ``pp x dp x cp`` is the world size;
``ep`` adds no rank: it must divide ``dp x cp``, and the routed experts take a second view of the same ranks.

The 1-D world mesh is unflattened twice (last axis fastest)::

    dense   (pp, dp, cp)        FSDP2 over the flattened (dp, cp) = "dp_cp" for everything but the routed experts;
                                CP over "cp"; the data loader deals micro-batches over "dp"
    sparse  (pp, efsdp, ep)     the routed experts: Shard(0) over "ep" (each rank ep_rank owns experts
                                [ep_rank E/ep, (ep_rank + 1) E/ep)), FSDP2 over "efsdp" = dp x cp / ep

Example, 4 ranks, dp 2 x cp 2, ep 2 (efsdp 2): cp pairs (0, 1) and (2, 3); dp pairs (0, 2) and (1, 3); the routed
experts 0-3 of every layer live on ranks 0 and 2 (FSDP2-sharded over that pair), experts 4-7 on ranks 1 and 3; a
token of rank 2 routed to expert 5 goes to rank 3 and back (``kernels_torch.parallel.expert``). With ep 4 (efsdp 1)
every rank owns a quarter of the experts whole.

Use::

    dims = ParallelDims.fill(world_size=4, cp=2, ep=2)   # dp = 4 / (pp x cp) = 2
    mesh = dims.build_mesh("cpu")                         # after init_process_group (or init_distributed)
    mesh["cp"], mesh["ep"], mesh["efsdp"], mesh["dp_cp"]  # 1-D DeviceMeshes (each rank's own row)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelDims", "ParallelMesh", "init_distributed", "DENSE_DIMS", "SPARSE_DIMS"]

DENSE_DIMS = ("pp", "dp", "cp")
SPARSE_DIMS = ("pp", "efsdp", "ep")


def init_distributed(device_type: str = "cpu", host_collectives: bool = False) -> int:
    """Initialise the default process group from the ``torchrun`` environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``) if it is not yet: NCCL on ``cuda`` (and ``torch.cuda.set_device(LOCAL_RANK)``), gloo on ``cpu``.
    ``host_collectives`` on ``cuda``: gloo beside NCCL for tensors in host memory (``cpu:gloo,cuda:nccl``; FSDP2's
    CPU offload). Returns the world size."""
    if not dist.is_initialized():
        cuda = "cpu:gloo,cuda:nccl" if host_collectives else "nccl"
        dist.init_process_group(cuda if device_type == "cuda" else "gloo")
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_world_size()


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of a parallel layout (module docstring); checked on construction.

    Attributes:
        world_size, dp, cp, ep, pp (int >= 1). Derived: ``efsdp = dp x cp / ep`` (FSDP2 ranks of each expert
        shard), ``dp_cp = dp x cp`` (FSDP2 ranks of everything else).

    Raises:
        ValueError: a size < 1; ``pp x dp x cp`` not the world size; ``ep`` not dividing ``dp x cp``. The message
            names the sizes.
    """

    world_size: int
    dp: int
    cp: int = 1
    ep: int = 1
    pp: int = 1

    def __post_init__(self):
        for name in ("world_size", "dp", "cp", "ep", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: got {v!r}, expected a positive integer")
        if self.pp * self.dp * self.cp != self.world_size:
            raise ValueError(
                f"pp x dp x cp: got pp {self.pp} x dp {self.dp} x cp {self.cp} = {self.pp * self.dp * self.cp} ranks, "
                f"expected the world size {self.world_size}"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"ep: got {self.ep}, expected a divisor of dp x cp = {self.dp} x {self.cp} = {self.dp * self.cp} "
                "(expert parallelism regroups the data x context ranks; it adds none)"
            )

    @classmethod
    def fill(cls, world_size: int, *, dp: int | None = None, cp: int = 1, ep: int = 1, pp: int = 1) -> ParallelDims:
        """The layout with ``dp`` filling the rest of the world (``world_size / (pp x cp)``) unless given.

        Raises:
            ValueError: ``pp x cp`` not dividing the world size (and the checks of the class)."""
        if dp is None:
            if cp < 1 or pp < 1 or world_size % (cp * pp):
                raise ValueError(
                    f"pp x cp: got pp {pp} x cp {cp}, expected a positive divisor of the world size {world_size}"
                )
            dp = world_size // (cp * pp)
        return cls(world_size=world_size, dp=dp, cp=cp, ep=ep, pp=pp)

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def efsdp(self) -> int:
        return self.dp * self.cp // self.ep

    def describe(self) -> str:
        """``"dp 2 x cp 2, ep 2 (efsdp 2)"``: the layout in one phrase (run headers, errors)."""
        s = (f"pp {self.pp} x " if self.pp > 1 else "") + f"dp {self.dp} x cp {self.cp}"
        return s + (f", ep {self.ep} (efsdp {self.efsdp})" if self.ep > 1 else "")

    def build_mesh(self, device_type: str = "cpu") -> ParallelMesh:
        """The meshes of this layout over the default process group (which must hold ``world_size`` ranks)."""
        return ParallelMesh(self, device_type)


class ParallelMesh:
    """The named 1-D meshes of a :class:`ParallelDims` layout (module docstring); ``mesh[name]`` for ``name`` in
    ``pp``, ``dp``, ``cp``, ``dp_cp`` (the flattened data x context ranks), ``ep``, ``efsdp``; every process group
    is created here, in the same order on every rank.

    Attributes:
        dims (:class:`ParallelDims`), device_type, dense (the ``(pp, dp, cp)`` DeviceMesh), sparse (the
        ``(pp, efsdp, ep)`` DeviceMesh, or None without expert parallelism).

    Raises:
        RuntimeError: the default process group is not initialised. ValueError: its size is not ``dims.world_size``.
    """

    def __init__(self, dims: ParallelDims, device_type: str = "cpu"):
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh: torch.distributed is not initialised (init_distributed first)")
        if dist.get_world_size() != dims.world_size:
            raise ValueError(
                f"world_size: the layout {dims.describe()} is for {dims.world_size} ranks, expected the process "
                f"group's {dist.get_world_size()}"
            )
        self.dims, self.device_type = dims, device_type
        world = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("world",))
        self.dense = world._unflatten(0, (dims.pp, dims.dp, dims.cp), DENSE_DIMS)
        self._dp_cp = self.dense["dp", "cp"]._flatten("dp_cp") if dims.dp_cp > 1 else self.dense["dp"]
        self.sparse = world._unflatten(0, (dims.pp, dims.efsdp, dims.ep), SPARSE_DIMS) if dims.ep > 1 else None

    def __getitem__(self, name: str) -> DeviceMesh:
        if name == "dp_cp":
            return self._dp_cp
        if name in DENSE_DIMS:
            return self.dense[name]
        if name in SPARSE_DIMS and self.sparse is not None:
            return self.sparse[name]
        raise KeyError(f"ParallelMesh: no dimension {name!r} in {self.dims.describe()} (ep and efsdp need ep > 1)")

    def size(self, name: str) -> int:
        """The size of dimension ``name`` (``ep`` 1 and ``efsdp`` = ``dp x cp`` without expert parallelism)."""
        if name in ("ep", "efsdp") and self.sparse is None:
            return 1 if name == "ep" else self.dims.dp_cp
        return self[name].size()
