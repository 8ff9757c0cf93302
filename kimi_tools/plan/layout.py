"""The cluster, the mesh and the run policy of ``kimi plan``: :class:`Hardware` (one GPU and its links),
:class:`Layout` (``pp x dp x cp`` with ``ep`` borrowing ``dp x cp``), :class:`Policy` (optimizer, offload, recompute,
FSDP), the stage split and FSDP2's row shards."""

from __future__ import annotations

from dataclasses import dataclass

from kimi.config import KimiConfig

GB = 1e9

# Bytes per trained element: (parameter, gradient, optimizer state) on the GPU.
OPTIMIZERS = {"adamw-fp32": (4, 4, 8), "adamw-bf16": (2, 2, 4)}
FROZEN_BYTES = 2  # a LoRA base weight, bf16, no gradient and no state
GATHER_BYTES = 2  # FSDP2 all-gathers bf16 parameters (MixedPrecisionPolicy param_dtype)
RECOMPUTE = ("none", "attn", "mlp", "full")  # kimi train --recompute-mode attn, mlp, layer ("full")
ACT_OFFLOAD = ("none", "attn", "mlp", "all")  # kimi train --offload-activations
RESHARD = ("auto", "always", "never")  # kimi train --reshard-after-forward
FSDP_POLICIES = ("layer", "stage", "none")
# --recompute-full-layers of the "mlp" mode: layer 0 (the dense MLP) recomputed whole, as in its calibration step
MLP_FULL_LAYERS = 1


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links, effective rates (what NCCL and the kernels reach, not the datasheet's).

    Args:
        gpu_memory_gb: HBM per GPU, GB (10^9 B). reserve_gb: kept free (CUDA context, NCCL buffers, allocator
            fragmentation), GB. peak_tflops: dense bf16 peak, TFLOP/s (H200 SXM: 989.4, the MFU denominator).
        gpus_per_node: GPUs behind one NVLink switch domain. nvlink_gbps: per GPU per direction, GB/s (H200 NVLink 4:
            450 nominal, 360 effective). ib_gbps: per GPU per direction across nodes, GB/s (one 400 Gb/s
            ConnectX-7 per GPU: 50 nominal, 40 effective). hbm_gbps: HBM bandwidth, GB/s (4,800 nominal, 4,000).
            pcie_gbps: host <-> GPU, GB/s (PCIe 5 x16: 64 nominal, 50). host_gbps: a GPU's share of the host's
            memory bandwidth for a CPU optimizer step, GB/s. host_memory_gb: host memory per GPU, GB (2 TB per
            8-GPU node).
    """

    gpu_memory_gb: float = 141.0
    reserve_gb: float = 5.0
    peak_tflops: float = 989.4
    gpus_per_node: int = 8
    nvlink_gbps: float = 360.0
    ib_gbps: float = 40.0
    hbm_gbps: float = 4000.0
    pcie_gbps: float = 50.0
    host_gbps: float = 20.0
    host_memory_gb: float = 250.0


@dataclass(frozen=True)
class Layout:
    """Mesh sizes: ``pp`` pipeline stages, ``dp`` data, ``cp`` context, ``ep`` expert (dividing ``dp x cp``).

    Raises:
        ValueError: a size < 1, or ``ep`` not dividing ``dp x cp`` (naming the sizes)."""

    pp: int
    dp: int
    cp: int
    ep: int

    def __post_init__(self):
        for k in ("pp", "dp", "cp", "ep"):
            if getattr(self, k) < 1:
                raise ValueError(f"layout: got {k}={getattr(self, k)}, expected a positive size")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"layout: got ep={self.ep} with dp={self.dp} x cp={self.cp}, expected ep dividing dp x cp "
                "(expert parallelism borrows the data x context ranks)"
            )

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp

    @property
    def efsdp(self) -> int:
        """The routed experts' FSDP degree: ``dp x cp / ep``."""
        return self.dp * self.cp // self.ep

    def name(self) -> str:
        return f"pp{self.pp} dp{self.dp} cp{self.cp} ep{self.ep}"


@dataclass(frozen=True)
class Policy:
    """How a layout is run: ``optimizer`` (:data:`OPTIMIZERS`), ``offload`` (the states: "none" or "cpu"),
    ``recompute`` (:data:`RECOMPUTE`: "none", "attn", "mlp" or "full", ``kimi train --recompute-mode attn|mlp|
    layer`` on every layer), ``act_offload`` (:data:`ACT_OFFLOAD`, ``--offload-activations`` on every layer; "attn"
    and "mlp" not with "full"), ``fsdp`` ("layer", "stage" or "none", module docstring; "auto": the trainer's for the
    layout, :func:`trainer_fsdp`), ``reshard`` (:data:`RESHARD`, ``--reshard-after-forward``: which FSDP2 units
    stay gathered from their forward to their backward without a pipeline).

    Raises:
        ValueError: a field outside its choices, or "attn" / "mlp" offload with "full" recomputation."""

    optimizer: str = "adamw-fp32"
    offload: str = "none"
    recompute: str = "none"
    fsdp: str = "auto"
    act_offload: str = "none"
    reshard: str = "auto"

    def __post_init__(self):
        for name, choices in (
            ("optimizer", tuple(OPTIMIZERS)),
            ("offload", ("none", "cpu")),
            ("recompute", RECOMPUTE),
            ("fsdp", ("auto", *FSDP_POLICIES)),
            ("act_offload", ACT_OFFLOAD),
            ("reshard", RESHARD),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"policy: got {name}={getattr(self, name)!r}, expected one of {list(choices)}")
        if self.recompute == "full" and self.act_offload in ("attn", "mlp"):
            raise ValueError(
                f"policy: got act_offload={self.act_offload!r} with recompute='full', expected 'none' or 'all' (a "
                "layer recomputed whole keeps no block activation to offload)"
            )


def trainer_fsdp(world: int | None = None, optimizer: str = "adamw-fp32", offload: str = "none") -> str:
    """The FSDP policy ``kimi train`` runs by default on a ``world``-rank layout: "layer" (one unit
    per layer, resharded after its forward and its backward, gradients reduce-scattered every micro-batch and held
    sharded), with or without a pipeline (``--pp-fsdp layer``, the default: ``kernels_torch.parallel.pipeline
    .shard_stages`` hides the stage module from torch's ``PipelineStage`` no-sync, and a V schedule's split backward
    runs whole); "none" on one rank under ``adamw-bf16`` without ``offload`` (no fp32 masters to shard: FSDP2 would
    only copy, and the trainer leaves the model as it is, ``kernels_torch.parallel.parallelize.fsdp_only_copies``).
    The other policy of a pipeline, "stage" (``--pp-fsdp stage``: torch's ``PipelineStage`` sets
    ``reshard_after_backward`` and ``requires_gradient_sync`` off until the step's last backward, so every unit of
    the stage stays gathered from a micro-batch's backward on, its gradients accumulate unsharded in the reduce dtype
    and are reduce-scattered once per step; ``tests/test_plan.py`` measures it), is what :func:`pp_fsdp_policies`
    adds at ``pp`` > 1."""
    if world == 1 and optimizer == "adamw-bf16" and offload == "none":
        return "none"
    return "layer"


def pp_fsdp_policies(pp: int) -> tuple[str, ...]:
    """The FSDP policies ``kimi train`` runs at ``pp`` stages (``--pp-fsdp``): "layer" and "stage" with a pipeline,
    the trainer's own (:func:`trainer_fsdp`) without."""
    return ("layer", "stage") if pp > 1 else ("auto",)


def shard_rows(rows: int, n: int, coord: int) -> int:
    """Rows of a dim-0 size ``rows`` that FSDP2 gives coordinate ``coord`` of ``n`` ranks: ``torch.chunk`` pieces of
    ``ceil(rows / n)``, the last ones shorter or empty."""
    c = -(-rows // n)
    return max(0, min(c, rows - coord * c))


def stage_ranges(cfg: KimiConfig, pp: int) -> list[range]:
    """The layers of each of ``pp`` pipeline stages, cut at AttnRes block boundaries (``attn_res_block_size``;
    without AttnRes, blocks of one layer): ``pp`` must divide the number of blocks; each stage gets
    ``blocks / pp`` consecutive blocks (K3.1, pp = 8: [0, 12), ..., [84, 93)).

    Raises:
        ValueError: ``pp`` < 1 or not dividing the number of blocks."""
    L = cfg.num_hidden_layers
    size = cfg.attn_res_block_size or 1
    blocks = -(-L // size)
    if pp < 1 or blocks % pp:
        raise ValueError(
            f"pp: got {pp}, expected a divisor of the {blocks} AttnRes blocks of {size} layers (stages cut at block "
            "boundaries)"
        )
    per = blocks // pp
    return [range(s * per * size, min(L, (s + 1) * per * size)) for s in range(pp)]
