"""Memory of a rank's parameters, gradients, optimizer states and FSDP2 working set: the meta model's tensors
(:func:`kimi.layout.stacked_layout`) sharded as the trainer shards them."""

from __future__ import annotations

import functools
import math

from kimi.config import KimiConfig
from kimi.layout import TensorSpec, stacked_layout
from kimi_tools.plan.layout import FROZEN_BYTES, GATHER_BYTES, OPTIMIZERS, Layout, shard_rows, stage_ranges


def is_expert(name: str) -> bool:
    return ".experts.w" in name


@functools.lru_cache(maxsize=8)
def layout_specs(cfg: KimiConfig) -> tuple[tuple[TensorSpec, ...], dict[int, tuple[TensorSpec, ...]]]:
    """(global specs, {layer: specs}) of the torch model's parameters (:func:`kimi.layout.stacked_layout`)."""
    glob, per = [], {}
    for s in stacked_layout(cfg):
        if s.layer is None:
            glob.append(s)
        else:
            per.setdefault(s.layer, []).append(s)
    return tuple(glob), {k: tuple(v) for k, v in per.items()}


@functools.lru_cache(maxsize=16)
def lora_specs(cfg: KimiConfig, rank: int, targets: tuple[str, ...] | None = None) -> dict[int, list[TensorSpec]]:
    """The LoRA adapters ``kimi_tools.lora.apply_lora`` adds, per layer: for each ``nn.Linear`` weight ``[out, in]``
    whose module name ends with a target (default ``kimi_tools.lora.DEFAULT_TARGETS``; never the indexer),
    ``lora_A.default.weight`` ``[rank, in]`` and ``lora_B.default.weight`` ``[out, rank]`` (peft's names).

    Raises:
        ValueError: ``rank`` < 1."""
    from kimi_tools.lora import DEFAULT_TARGETS

    if rank < 1:
        raise ValueError(f"lora rank: got {rank}, expected a positive integer")
    targets = DEFAULT_TARGETS if targets is None else targets
    out: dict[int, list[TensorSpec]] = {}
    for layer, specs in layout_specs(cfg)[1].items():
        for s in specs:
            mod = s.name.removesuffix(".weight")
            if len(s.shape) != 2 or ".indexer." in s.name or not any(mod.endswith("." + t) for t in targets):
                continue
            o, i = s.shape
            out.setdefault(layer, []).append(TensorSpec(mod + ".lora_A.default.weight", (rank, i), "float32", layer))
            out.setdefault(layer, []).append(TensorSpec(mod + ".lora_B.default.weight", (o, rank), "float32", layer))
    return out


# Parameters the optimizer never updates (no gradient): the router's balancing bias, moved by its own rule.
_FIXED = ("e_score_correction_bias",)


@functools.lru_cache(maxsize=4096)
def _groups(
    cfg: KimiConfig, layer: int | None, lora_rank: int | None
) -> tuple[tuple[str, str, int, int, bool, int, int], ...]:
    """Parameters of ``layer`` (None: the global ones) as ``(kind, flag, dim-0 rows, elements per row, graded,
    dim 1, count)`` with kind "dense", "experts" (stacks, rows = E), "embed" or "lora" (``lora_rank``'s adapters), flag
    "fixed" (no gradient: :data:`_FIXED`), "fp32" (kept fp32 by the checkpoint and ``kernels_torch.model.cast_model``)
    or "", and graded whether the LM loss gives it a gradient (:func:`_gets_gradient`); equal shapes merged."""
    glob, per = layout_specs(cfg)
    counts: dict[tuple, int] = {}
    specs = list(glob) if layer is None else list(per[layer])
    for s in specs:
        kind = "experts" if is_expert(s.name) else "dense"
        if s.name == "model.embed_tokens.weight":  # the first stage's; the other globals are the last stage's
            kind = "embed"
        flag = "fixed" if s.name.endswith(_FIXED) else "fp32" if s.dtype == "float32" else ""
        key = (kind, flag, s.shape[0], math.prod(s.shape[1:]), _gets_gradient(s.name), _dim1(s.shape))
        counts[key] = counts.get(key, 0) + 1
    if lora_rank and layer is not None:
        for s in lora_specs(cfg, lora_rank).get(layer, []):
            key = ("lora", "", s.shape[0], math.prod(s.shape[1:]), True, _dim1(s.shape))
            counts[key] = counts.get(key, 0) + 1
    return tuple((*k, c) for k, c in counts.items())


@functools.lru_cache(maxsize=4096)
def rank_numel(
    cfg: KimiConfig,
    layout: Layout,
    stage: int,
    *,
    dp_cp_coord: int = 0,
    efsdp_coord: int = 0,
    lora_rank: int | None = None,
    num_stages: int | None = None,
) -> dict[str, int]:
    """Elements of the parameters one rank of pipeline stage ``stage`` holds: ``dense`` (everything but the routed
    experts, sharded over ``dp x cp`` at coordinate ``dp_cp_coord``), ``experts`` (the rank's ``E / ep`` rows of each
    stack, sharded over ``efsdp`` at ``efsdp_coord``), ``lora`` (the adapters, sharded with the dense part); and by
    role: ``trainable`` (all but the fixed ones; with ``lora_rank`` the adapters only), ``trainable_fp32`` (those
    the checkpoint keeps fp32), ``frozen`` / ``frozen_fp32`` (the LoRA base), ``fixed`` (no gradient:
    ``e_score_correction_bias``). FSDP2 shards every bf16 parameter along dim 0 (:func:`shard_rows`); the tensors
    the checkpoint keeps fp32 (and the fixed bias) are whole on every rank, as the bf16 trainer leaves them to FSDP2's
    ``ignored_params`` (``kernels_torch.parallel.fsdp.fp32_compute_params``). ``num_stages``: the stages of the
    pipeline's cut (None: ``layout.pp``; ``2 pp`` under a V schedule, where a rank holds two of them)."""
    ns = num_stages or layout.pp
    ranges = stage_ranges(cfg, ns)
    n_dc = layout.dp * layout.cp
    tot = dict.fromkeys(("dense", "experts", "lora", "fixed", "fp32", "nograd", "nograd_fp32"), 0)

    def add(kind, flag, n, graded):
        tot["dense" if kind == "embed" else kind] += n
        if flag:
            tot[flag] += n
        if not graded and flag != "fixed":
            tot["nograd_fp32" if flag == "fp32" else "nograd"] += n

    def dense_rows(flag, rows):  # the fp32 tensors (and the fixed fp32 bias) are whole on every rank
        return rows if flag in ("fp32", "fixed") else shard_rows(rows, n_dc, dp_cp_coord)

    for kind, flag, rows, inner, graded, _, count in _groups(cfg, None, None):
        if (stage == 0) if kind == "embed" else (stage == ns - 1):
            add(kind, flag, count * dense_rows(flag, rows) * inner, graded)
    for i in ranges[stage]:
        for kind, flag, rows, inner, graded, dim1, count in _groups(cfg, i, lora_rank):
            if kind == "experts":
                add(kind, flag, count * _expert_numel(rows, inner, dim1, layout.ep, layout.efsdp, efsdp_coord), graded)
            else:
                add(kind, flag, count * dense_rows(flag, rows) * inner, graded)
    base = tot["dense"] + tot["experts"] - tot["fixed"]
    fp32 = tot.pop("fp32")
    if lora_rank:  # the base is frozen: only the adapters train, all of them graded
        frozen = {"frozen": base, "frozen_fp32": fp32, "nograd": 0, "nograd_fp32": 0}
        return {**tot, "trainable": tot["lora"], "trainable_fp32": 0, **frozen}
    return {**tot, "trainable": base, "trainable_fp32": fp32, "frozen": 0, "frozen_fp32": 0}


@functools.lru_cache(maxsize=4096)
def unsharded_numel(
    cfg: KimiConfig, layer: int | None, ep: int, lora_rank: int | None, stage_of_glob: str = ""
) -> dict:
    """Elements one rank gathers of ``layer`` (its ``E / ep`` experts): dense, experts, lora; for the globals,
    ``stage_of_glob`` "first" (the embedding) or "last" (the rest)."""
    out = {"dense": 0, "experts": 0, "lora": 0}
    for kind, _, rows, inner, _, _, count in _groups(cfg, layer, lora_rank):
        if layer is None:
            if (kind == "embed") != (stage_of_glob == "first"):
                continue
            kind = "dense"
        out[kind] += count * (rows // ep if kind == "experts" else rows) * inner
    return out


def _dim1(shape: tuple[int, ...]) -> int:
    return shape[1] if len(shape) > 1 else 1


def _expert_numel(rows: int, inner: int, dim1: int, ep: int, efsdp: int, coord: int | None = None) -> int:
    """Elements of an expert stack ``[rows = E, dim1, ...]`` (``inner`` elements per expert) that FSDP2 gives
    ``efsdp`` coordinate ``coord`` of this rank's ``E / ep`` experts; ``coord`` None: the padded shard it allocates
    on every coordinate. Under expert parallelism along dim 1 when ``efsdp`` divides it (even shards,
    ``kernels_torch.parallel.fsdp._expert_placement``), else along dim 0 in ``torch.chunk`` rows (at ep 1 the
    experts are in the layer's unit, dim 0 like any parameter)."""
    local = rows // ep
    if ep > 1 and dim1 % efsdp == 0:
        return local * inner // efsdp
    return (-(-local // efsdp) if coord is None else shard_rows(local, efsdp, coord)) * inner


def _padded_shard(spec: TensorSpec, n_dc: int, ep: int, efsdp: int) -> tuple[int, int]:
    """(elements of the padded shard FSDP2 allocates for ``spec`` on each rank, the ranks it is sharded over): an
    expert stack over ``efsdp`` (:func:`_expert_numel`), any other parameter in ``torch.chunk`` rows over the
    ``n_dc = dp x cp`` ranks."""
    inner = math.prod(spec.shape[1:])
    if is_expert(spec.name):
        return _expert_numel(spec.shape[0], inner, _dim1(spec.shape), ep, efsdp), efsdp
    return -(-spec.shape[0] // n_dc) * inner, n_dc


def _gets_gradient(name: str) -> bool:
    """Whether the LM loss gives parameter ``name`` a gradient: not the DSA indexer (reached through its top-k
    selection only; the distillation stages train it) nor layer 0's attention-side AttnRes mix (one source)."""
    return ".indexer." not in name and not name.startswith("model.layers.0.self_attention_res_")


@functools.lru_cache(maxsize=4096)
def _fsdp_unit(cfg: KimiConfig, layer: int | None, n_dc: int, ep: int, efsdp: int, lora_rank: int | None, glob: str):
    """One FSDP2 unit of a rank as the trainer builds it (``kernels_torch.parallel.fsdp.apply_fsdp``, bf16 with the
    checkpoint's fp32 tensors ignored: whole on every rank, never gathered): ``(gathered, graded)`` elements, the
    all-gather output of its bf16 parameters (each padded to whole ``torch.chunk`` shards: dense ``ceil(rows / n_dc)
    x n_dc`` rows; the ``E / ep`` expert rows over ``efsdp`` along dim 1 when it divides, else padded dim 0 rows,
    ``kernels_torch.parallel.fsdp._expert_placement``) and the elements of those that get a gradient (trained,
    :func:`_gets_gradient`; with ``lora_rank`` the adapters only). ``layer`` None: the root's globals, ``glob``
    "first" (the embedding) or "last" (the rest)."""
    glob_specs, per = layout_specs(cfg)
    specs = (
        list(per[layer])
        if layer is not None
        else [s for s in glob_specs if (s.name == "model.embed_tokens.weight") == (glob == "first")]
    )
    if lora_rank and layer is not None:
        specs += lora_specs(cfg, lora_rank).get(layer, [])
    gathered = graded = 0
    for s in specs:
        lora = ".lora_" in s.name
        if s.dtype == "float32" and not lora:  # ignored by FSDP2 (a LoRA adapter is an fp32 master, gathered bf16)
            continue
        shard, ways = _padded_shard(s, n_dc, ep, efsdp)
        gathered += shard * ways
        if (lora or not lora_rank) and _gets_gradient(s.name):
            graded += s.numel // ep if is_expert(s.name) else s.numel
    return gathered, graded


def _pow2ceil(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


@functools.lru_cache(maxsize=4096)
def pinned_numel(
    cfg: KimiConfig, layout: Layout, stage: int, *, lora_rank: int | None = None, num_stages: int | None = None
) -> dict[str, int]:
    """Host elements one rank of pipeline stage ``stage`` pins under ``--offload cpu`` (FSDP2's
    ``CPUOffloadPolicy(pin_memory=True)``): ``trainable`` (the trainable shards FSDP2 manages), ``graded`` (their
    gradients, copied to pinned host memory by each reduce), ``frozen`` (a LoRA base's shards). FSDP2 pins each
    parameter's padded shard on its own (``padded_sharded_param.pin_memory()``: ``torch.chunk`` rows, dense over
    ``dp x cp``, the experts' ``E / ep`` rows over ``efsdp``, :func:`_fsdp_unit`'s padding), and torch's caching host
    allocator rounds every pinned block up to a power of two: a 5 GiB shard holds 8 GiB (measured on the H100
    machine, torch 2.11: 5, 3 and 1.2 GiB pinned took 8, 4 and 2 GiB;
    ``benchmarks/results/h100_2026-12-06_lease4/pinned_probe.txt``). So each tensor counts
    its shard's elements rounded up to a power of two (the bytes per element, 2 or 4, are one too). The tensors the
    checkpoint keeps fp32 stay on the device, whole (FSDP2 ignores them)."""
    ns = num_stages or layout.pp
    n_dc = layout.dp * layout.cp
    glob_specs, per = layout_specs(cfg)
    # the embedding on the first stage, the other global tensors on the last (as rank_numel)
    specs = [s for s in glob_specs if ((stage == 0) if s.name == "model.embed_tokens.weight" else (stage == ns - 1))]
    for i in stage_ranges(cfg, ns)[stage]:
        specs += list(per[i]) + (lora_specs(cfg, lora_rank).get(i, []) if lora_rank else [])
    out = {"trainable": 0, "graded": 0, "frozen": 0}
    for s in specs:
        lora = ".lora_" in s.name
        if s.dtype == "float32" and not lora:  # FSDP2 leaves them whole on the device
            continue
        pinned = _pow2ceil(_padded_shard(s, n_dc, layout.ep, layout.efsdp)[0])
        if lora_rank and not lora:
            out["frozen"] += pinned
            continue
        out["trainable"] += pinned
        if _gets_gradient(s.name):
            out["graded"] += pinned
    return out


@functools.lru_cache(maxsize=4096)
def stage_fsdp_bytes(
    cfg: KimiConfig, layout: Layout, stage: int, *, reduce_bytes: int = 4, lora_rank=None, num_stages: int | None = None
) -> int:
    """Bytes FSDP2 holds unsharded on a rank of pipeline stage ``stage`` under the trainer's "stage" policy
    (``kimi train --pp-fsdp stage``, ``pp`` > 1) from the first backward of a step to its end: every unit of the stage (its
    layers, their routed experts, the stage module's root) gathered in bf16 (:func:`_fsdp_unit`, with FSDP2's
    padding) and the gradients of its trained parameters, unsharded, in the reduce dtype (``reduce_bytes``: 4 for
    fp32, 2 for bf16). ``num_stages``: as :func:`rank_numel`. ``tests/test_plan.py`` measures it on the pipeline
    trainer between micro-batches."""
    ns = num_stages or layout.pp
    layers = stage_ranges(cfg, ns)[stage]
    n_dc = layout.dp * layout.cp
    units = [_fsdp_unit(cfg, i, n_dc, layout.ep, layout.efsdp, lora_rank, "") for i in layers]
    if stage == 0:
        units.append(_fsdp_unit(cfg, None, n_dc, 1, 1, None, "first"))
    if stage == ns - 1:
        units.append(_fsdp_unit(cfg, None, n_dc, 1, 1, None, "last"))
    return sum(g * GATHER_BYTES + t * reduce_bytes for g, t in units)


@functools.lru_cache(maxsize=4096)
def layer_fsdp_bytes(
    cfg: KimiConfig,
    layout: Layout,
    *,
    reshard: str = "auto",
    lora_rank=None,
    stage: int | None = None,
    num_stages: int | None = None,
) -> int:
    """Bytes FSDP2 holds gathered on a rank under the "layer" policy when a backward starts, the step's activation
    peak, by the reshard policy (``kimi train --reshard-after-forward``, ``kernels_torch.parallel.fsdp.apply_fsdp``):
    "auto" the units that keep their gathered copy from the forward to the backward (the last decoder layer and the
    root), "always" the largest unit (one at a time), "never" every unit. No gradient is unsharded then: the step
    starts with none (``zero_grad(set_to_none=True)``) and each earlier micro-batch's backward left its gradients
    reduce-scattered. ``stage`` None: the whole model (no pipeline); else pipeline stage ``stage`` of
    ``num_stages`` (None: ``layout.pp``) under ``kimi train --pp-fsdp layer``: its own layers, its root (the final
    norm, output mix and ``lm_head`` on the last stage; nothing on another, whose embedding is a unit of its own),
    the embedding on the first; the "auto" units are the stage's last layer and its root (a rank's two V stages each
    count theirs: a backward of one starts while the other's last layer may be held). On one H100 (4 real-dimension
    layers, 16 experts, 8K tokens, bf16 masters) the whole model's are the measured peaks over the one-process
    step's: 3.96, 2.19 and 12.63 GiB (``benchmarks/results/train_step_e16_torchrun_*_h100.json``)."""
    n_dc = layout.dp * layout.cp
    if stage is None:
        held, first, last = range(cfg.num_hidden_layers), True, True
    else:
        ns = num_stages or layout.pp
        held, first, last = stage_ranges(cfg, ns)[stage], stage == 0, stage == ns - 1
    layers = [_fsdp_unit(cfg, i, n_dc, layout.ep, layout.efsdp, lora_rank, "")[0] for i in held]
    root = _fsdp_unit(cfg, None, n_dc, 1, 1, None, "last")[0] if last else 0
    embed = _fsdp_unit(cfg, None, n_dc, 1, 1, None, "first")[0] if first else 0
    if reshard == "auto":
        units = layers[-1:] + [root]
    elif reshard == "always":
        units = [max([root, embed, *layers])]
    else:
        units = [root, embed, *layers]
    return sum(units) * GATHER_BYTES


def graded_numel(n: dict) -> tuple[int, int]:
    """The trainable elements of :func:`rank_numel`'s counts ``n`` that the LM loss gives a gradient, (low-precision,
    fp32): the others (the DSA indexer, layer 0's attention-side mix) keep their weights but get no gradient, no
    AdamW moments and no optimizer time (torch's optimizers make state on a tensor's first gradient)."""
    low = n["trainable"] - n["trainable_fp32"]
    return low - n.get("nograd", 0), n["trainable_fp32"] - n.get("nograd_fp32", 0)


def fp32_state_bytes(n: dict) -> dict[str, int]:
    """The part of :func:`state_bytes` in the tensors FSDP2 leaves whole (the checkpoint's fp32 ones, the fixed
    bias, a LoRA base's fp32 tensors): fp32 weights, gradients and moments, on the device under any offload."""
    graded_fp32 = graded_numel(n)[1]
    return {
        "params": (n["trainable_fp32"] + n["frozen_fp32"] + n["fixed"]) * 4,
        "grads": graded_fp32 * 4,
        "optimizer": graded_fp32 * 8,
    }


def state_bytes(n: dict, optimizer: str) -> dict[str, int]:
    """Bytes of a rank's sharded parameters, gradients and optimizer states from :func:`rank_numel`'s counts under
    ``optimizer`` (:data:`OPTIMIZERS`): the tensors the checkpoint keeps fp32 stay fp32 under either policy (fp32
    gradients, fp32 moments), the fixed ones are fp32 without gradient or state, a LoRA base is bf16 (its fp32
    tensors fp32)."""
    pb, gb, ob = OPTIMIZERS[optimizer]
    low = n["trainable"] - n["trainable_fp32"]
    frozen = (n["frozen"] - n["frozen_fp32"]) * FROZEN_BYTES + n["frozen_fp32"] * 4
    graded_low, graded_fp32 = graded_numel(n)  # the others keep their weights but no gradient and no moments
    return {
        "params": low * pb + n["trainable_fp32"] * 4 + frozen + n["fixed"] * 4,
        "grads": graded_low * gb + graded_fp32 * 4,
        "optimizer": graded_low * ob + graded_fp32 * 8,
    }
