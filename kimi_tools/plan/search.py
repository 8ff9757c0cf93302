"""The search: :func:`evaluate` (one layout under one policy: memory, communication, time, MFU) and :func:`plan`
(every layout ``kimi train`` runs, each with its fastest fitting policy; the refusals the trainer makes)."""

from __future__ import annotations

import dataclasses
import functools

from kimi.config import KimiConfig
from kimi_tools.plan.activations import held_per_microbatch, layer_inputs_bytes
from kimi_tools.plan.calibration import Calibration, load_calibration
from kimi_tools.plan.layout import (
    ACT_OFFLOAD,
    FROZEN_BYTES,
    GATHER_BYTES,
    GB,
    OPTIMIZERS,
    RECOMPUTE,
    Hardware,
    Layout,
    Policy,
    pp_fsdp_policies,
    stage_ranges,
    trainer_fsdp,
)
from kimi_tools.plan.params import (
    fp32_state_bytes,
    graded_numel,
    layer_fsdp_bytes,
    pinned_numel,
    rank_numel,
    stage_fsdp_bytes,
    state_bytes,
    unsharded_numel,
)
from kimi_tools.plan.schedule import (
    PLANNED_SCHEDULES,
    V_SCHEDULES,
    W_SHARE,
    bubble,
    inflight_states,
    min_microbatches,
    num_stages,
    overlap_pairs,
    pair_time,
    rank_stages,
    replay_bubble,
    stage_recompute_passes,
)
from kimi_tools.plan.timing import a2a_time, layer_flops, ring_bandwidth


@functools.lru_cache(maxsize=256)
def stage_static(cfg: KimiConfig, L: Layout, lora_rank: int | None, num_stages: int | None = None) -> tuple:
    """Per stage of the cut into ``num_stages`` (None: ``L.pp``), what does not depend on the policy:
    (:func:`rank_numel`, (gathered, trainable) elements of each layer as one FSDP unit, the stage's unsharded
    elements {dense, experts, lora, train_dense, train_experts}, MoE layers). Cached: read it, never change it."""
    ns = num_stages or L.pp
    out = []
    for s, layers in enumerate(stage_ranges(cfg, ns)):
        n = rank_numel(cfg, L, s, lora_rank=lora_rank, num_stages=ns)
        per_layer = [unsharded_numel(cfg, i, L.ep, lora_rank) for i in layers]
        sizes = [
            (u["dense"] + u["experts"] + u["lora"], u["lora"] if lora_rank else u["dense"] + u["experts"])
            for u in per_layer
        ]
        full = {k: sum(u[k] for u in per_layer) for k in ("dense", "experts", "lora")}
        if s == 0:
            full["dense"] += unsharded_numel(cfg, None, 1, None, "first")["dense"]
        if s == ns - 1:
            full["dense"] += unsharded_numel(cfg, None, 1, None, "last")["dense"]
        if lora_rank:  # the frozen base is gathered, only the adapters' gradients are reduced
            full["train_dense"], full["train_experts"] = full["lora"], 0
            full["dense"] += full["lora"]
        else:
            full["train_dense"], full["train_experts"] = full["dense"], full["experts"]
        moe = sum(1 for i in layers if cfg.is_moe_layer(i))
        out.append((n, sizes, full, moe))
    return tuple(out)


# kimi train --ep-overlap (kernels_torch.parallel.expert.OVERLAPS)
EP_OVERLAPS = ("none", "chunks", "fb", "fb+chunks")


def evaluate(
    cfg: KimiConfig,
    layout: Layout,
    policy: Policy,
    hw: Hardware,
    cal: Calibration,
    *,
    seq_len: int,
    global_batch: int,
    lora_rank: int | None = None,
    overlap_a2a: bool | str = False,
    schedule: str = "1F1B",
) -> dict:
    """One layout under one policy and pipeline schedule: per-rank bytes (worst rank), communication per step,
    predicted time and MFU.

    Args:
        seq_len: tokens per sequence (one micro-batch row, cut over ``cp``). global_batch: tokens per optimizer
            step; micro-batches per pipeline ``m = max(1, global_batch // (dp x seq_len))``.
        overlap_a2a: the all-to-all overlap ``kimi train --ep-overlap`` runs (:data:`EP_OVERLAPS`; True:
            ``"chunks"``, False: ``"none"``): ``chunks`` (ep > 1), ``fb`` or ``fb+chunks`` (DualPipeV, ep > 1,
            cp 1: one micro-batch's all-to-all behind another's compute in each ``OVERLAP_F_B`` pair,
            :func:`~kimi_tools.plan.schedule.pair_time`; elsewhere ``fb`` counts nothing and ``fb+chunks`` as
            ``chunks``); the row's ``ep_overlap`` says what was counted.
        schedule: ``kimi train --pp-schedule`` for ``pp`` > 1, one of
            :data:`~kimi_tools.plan.schedule.PLANNED_SCHEDULES` (ignored at ``pp`` = 1):
            1F1B (``pp`` stages) or a V (``2 pp`` stages, two per rank; its bubble, its in-flight micro-batches on
            every rank and its recomputation replayed twice: :mod:`kimi_tools.plan.schedule`).

    Returns:
        A JSON-able dict: ``layout``, ``policy``, ``schedule`` (None at ``pp`` = 1), ``stages`` (each stage's
        ``[start, stop)`` layers), ``microbatches``, ``worst_rank`` and its ``worst_rank_stages`` (``worst_stage``
        the first of them), ``inflight`` (its micro-batches in flight per stage at the activation peak), ``memory``
        (bytes: params, grads, optimizer, gathered, activations, total; host bytes when offloaded), ``comm`` (bytes
        per step per rank: all_gather, reduce_scatter, all_to_all, pipeline), ``time`` (s: compute, all_to_all,
        fsdp_exposed, pipeline, bubble, optimizer, step; per micro-batch the slowest rank's), ``tokens_per_s_per_gpu``,
        ``tflops_per_gpu``, ``mfu``, ``fits``.

    Raises:
        ValueError: a policy's FSDP other than the trainer's; a schedule outside ``PLANNED_SCHEDULES``, a V
            schedule with fewer than ``2 pp`` micro-batches or ``2 pp`` not dividing the AttnRes blocks; an
            ``overlap_a2a`` outside :data:`EP_OVERLAPS`.
    """
    L = layout
    mode = ("chunks" if overlap_a2a else "none") if isinstance(overlap_a2a, bool) else overlap_a2a
    if mode not in EP_OVERLAPS:
        raise ValueError(f"overlap_a2a: got {overlap_a2a!r}, expected a bool or one of {list(EP_OVERLAPS)}")
    fsdp = trainer_fsdp(L.world, policy.optimizer, policy.offload)
    # on one rank "layer" is what the trainer runs with FSDP2 forced (ParallelPolicy.shard_one_rank, the benchmark's);
    # with a pipeline "stage" too (kimi train --pp-fsdp stage)
    runs = {"auto", fsdp} | ({"layer"} if fsdp == "none" else set()) | set(pp_fsdp_policies(L.pp))
    if policy.fsdp not in runs:
        raise ValueError(
            f"fsdp: got {policy.fsdp!r} with pp={L.pp} on {L.world} GPU(s) under {policy.optimizer}, expected "
            f"one of {sorted(runs - {'auto'})}, the policies the trainer runs there (trainer_fsdp, pp_fsdp_policies)"
        )
    fsdp = fsdp if policy.fsdp == "auto" else policy.fsdp
    policy = dataclasses.replace(policy, fsdp=fsdp)
    m = max(1, global_batch // (L.dp * seq_len))
    sched = schedule if L.pp > 1 else None
    if sched is None:  # one micro-batch at a time without a pipeline
        ns, inflight, rank_of = 1, (((1,),),), [(0,)]
    else:
        ns = num_stages(sched, L.pp)
        if m < min_microbatches(sched, L.pp):
            raise ValueError(
                f"schedule: got {sched} with {m} micro-batch(es) per pipeline, expected at least "
                f"{min_microbatches(sched, L.pp)} (one per stage)"
            )
        inflight = inflight_states(sched, L.pp, m)
        rank_of = [rank_stages(sched, L.pp, r) for r in range(L.pp)]
    # "layer" under a V schedule: each split backward runs whole at its input part (pipeline.shard_stages), so a
    # recomputed layer replays once and the weight part is no work of its own
    whole = fsdp == "layer" and sched in V_SCHEDULES
    stage_passes = (1.0,) * ns if whole or not sched else stage_recompute_passes(sched, L.pp, m)
    T = seq_len // L.cp
    pb, gb, ob = OPTIMIZERS[policy.optimizer]
    rb = 4 if policy.optimizer == "adamw-fp32" else 2  # reduce-scatter dtype
    fl = layer_flops(cfg, seq_len, frozen_weights=bool(lora_rank))
    fwd_share = 1 / 2 if lora_rank else 1 / 3  # the forward's part of a layer's training FLOPs (weights: 1 of 3)
    rows = T * cfg.num_experts_per_token * L.ep / cfg.num_experts if cfg.num_experts else 0.0
    # overlap_a2a: the trainer's --ep-overlap chunks (kernels_torch.parallel.expert): each MoE layer's tokens in two
    # chunks, so the experts run half the rows per expert (the calibrated rate there); the first dispatch and the
    # last combine of a layer (and their reverses) stay exposed, half the all-to-all; the other half travels while
    # the routed experts compute and shows only where it outlasts them
    chunks = bool(mode in ("chunks", "fb+chunks") and L.ep > 1 and rows)
    # fb: the trainer's --ep-overlap fb under DualPipeV (kernels_torch.parallel.fb_overlap), counted per OVERLAP_F_B
    # pair below; the trainer refuses it elsewhere (and with cp > 1), where it counts nothing here
    fb = bool(mode.startswith("fb") and sched == "DualPipeV" and L.ep > 1 and L.cp == 1 and rows)
    slow = cal.expert_slowdown(rows / 2 if chunks else rows, policy.recompute) if rows else 1.0
    ranges = stage_ranges(cfg, ns)
    n_dc = L.dp * L.cp
    D, k = cfg.hidden_size, cfg.num_experts_per_token
    Dl = cfg.routed_expert_hidden_size or D
    block = cfg.attn_res_block_size or 1
    stages = []
    static = stage_static(cfg, L, lora_rank, ns)
    rate = cal.tflops["none"] * 1e12  # every policy's work runs at the measured rate; recomputation adds work
    copy_rate = cal.host_copy_gbps * GB
    v_turn = L.pp if sched in V_SCHEDULES else None  # the V's stage that its predecessor hands over in memory
    for s, layers in enumerate(ranges):
        n, sizes, full, moe = static[s]
        passes = stage_passes[s] if sched in V_SCHEDULES else 1.0
        # dispatch + combine, fwd, bwd (+ the recomputed, once per recompute pass)
        a2a_units = 4 + 2 * passes if policy.recompute in ("mlp", "full") else 4
        if fsdp == "none":  # one rank, the parameters in their compute dtype: nothing gathered
            gathered = 0
        elif fsdp == "layer":
            where = {} if sched is None else {"stage": s, "num_stages": ns}
            gathered = layer_fsdp_bytes(cfg, L, reshard=policy.reshard, lora_rank=lora_rank, **where)
        else:
            gathered = stage_fsdp_bytes(cfg, L, s, reduce_bytes=rb, lora_rank=lora_rank, num_stages=ns)
        first, last = s == 0, s == ns - 1
        held = held_per_microbatch(cfg, layers, T, first=first, last=last, lm_head_grad=not lora_rank)
        inputs = layer_inputs_bytes(layers, T, D, first)
        if policy.recompute == "full":  # the layer inputs (exact, in `held`) on the device or the host
            host_mb = inputs if policy.act_offload == "all" else 0.0
            dev_mb = held - host_mb
        else:  # the per-layer bytes replace the layer inputs; the stage's I/O and head come on top
            dev, host_mb = cal.layer_bytes(cfg, layers, T, policy.recompute, policy.act_offload)
            dev_mb = dev + held - inputs
        # communication per step (bytes per rank)
        # "layer" (with or without a pipeline): a forward and a backward gather per micro-batch (a layer
        # recomputed in the backward runs under the backward's), a reduce-scatter per micro-batch; "stage": each
        # forward after a backward finds the units still gathered and reshards them (reshard_after_forward), so
        # 1F1B gathers once per micro-batch's backward plus once for the first forward, m + 1, and reduces once
        # (measured in tests/test_plan.py); a unit that keeps its gathered copy after the forward (FSDP2's reshard
        # policy: torchtitan's leaves the last layer and the root) gathers once: m + 1 is the most. A V schedule's
        # runtime gathers its stages once a step and shard_stages keeps their layers gathered after the forward: 1
        gathers = 2 * m if fsdp == "layer" else (1 if sched in V_SCHEDULES else m + 1)
        reduces = m if fsdp == "layer" else 1
        f_dc, f_ef = (n_dc - 1) / n_dc, (L.efsdp - 1) / L.efsdp
        ag_d = full["dense"] * GATHER_BYTES * f_dc * gathers
        ag_e = full["experts"] * GATHER_BYTES * f_ef * gathers
        rs_d = full["train_dense"] * rb * f_dc * reduces
        rs_e = full["train_experts"] * rb * f_ef * reduces
        a2a = m * moe * a2a_units * T * k * Dl * 2 * (L.ep - 1) / L.ep
        b_in = layers.start // block  # AttnRes blocks stored when entering this stage
        b_out = layers.stop // block if layers.stop < cfg.num_hidden_layers else None
        pp_bytes = 0.0
        if s > 0 and s != v_turn:
            pp_bytes += m * 2 * (b_in + 1) * T * D * 2  # receive forward, send the gradient back
        if b_out is not None and s + 1 != v_turn:
            pp_bytes += m * 2 * (b_out + 1) * T * D * 2
        comm = {"all_gather": ag_d + ag_e, "reduce_scatter": rs_d + rs_e, "all_to_all": a2a, "pipeline": pp_bytes}
        # time
        f_stage = T * (sum(fl.layers[i] for i in layers) + (fl.head if last else 0.0))
        f_exp = T * sum(fl.experts[i] for i in layers)
        rec = [fl.recomputed(i, policy.recompute) for i in layers]
        f_rec, f_rec_exp = passes * T * sum(r[0] for r in rec), passes * T * sum(r[1] for r in rec)
        # per micro-batch: the measured rate, the experts slowed down at a lower density than the calibration's
        t_model = (f_stage + f_exp * (slow - 1.0)) / rate
        t_comp = t_model + (f_rec + f_rec_exp * (slow - 1.0)) / rate
        # activation offload: the forward's copies on a side stream behind the forward, the backward's on the
        # compute stream (read when needed, not prefetched: kernels_torch.activation_memory.save_on_host)
        t_copy = host_mb / copy_rate
        t_off_fwd = max(0.0, t_copy - (f_stage / 3) / rate) if host_mb else 0.0
        t_off = t_copy + t_off_fwd if host_mb else 0.0
        t_a2a = a2a_time(a2a / m, L.ep, hw) if a2a else 0.0
        t_exp = (f_exp + f_rec_exp) * slow / rate  # the routed experts' part of t_comp
        t_shown = t_a2a / 2 + max(0.0, t_a2a / 2 - t_exp) if chunks else t_a2a
        bw_dc = ring_bandwidth(n_dc, 1, hw)
        bw_ef = ring_bandwidth(L.efsdp, L.ep, hw)
        t_fsdp = (ag_d + rs_d) / bw_dc + (ag_e + rs_e) / bw_ef
        t_pp = pp_bytes / m / ring_bandwidth(2, n_dc, hw)
        # the forward's part of the micro-batch: its compute, its dispatch and combine, its send, its copies' excess
        t_fwd = t_model * fwd_share + t_shown * 2 / a2a_units + t_pp / 2 + t_off_fwd
        # an OVERLAP_F_B party's parts: the forward's compute and transfers, the full backward's (one recompute pass)
        rec_units = 2 if policy.recompute in ("mlp", "full") else 0
        x_f = x_b = None
        if fb:  # a stage without MoE layers hands nothing over but its compute still hides the other's transfers
            t_x = t_shown / (moe * a2a_units) if moe else 0.0  # one transfer, as much of it as shows outside a pair
            c_f = t_model * fwd_share
            c_b = t_model * (1 - fwd_share) + (t_comp - t_model) / passes
            x_f = (c_f, 2 * moe, t_x)
            x_b = (c_b, (2 + rec_units) * moe, t_x)
        stages.append(
            dict(n=n, gathered=gathered, dev_mb=dev_mb, host_mb=host_mb, comm=comm, t_comp=t_comp, t_a2a=t_a2a)
            | dict(t_shown=t_shown, t_fsdp=t_fsdp, t_pp=t_pp, t_off=t_off, t_fwd=t_fwd, f=f_stage, f_rec=f_rec)
            | dict(x_f=x_f, x_b=x_b)
            | {"ws": cal.working_set(cfg, layers, T, policy.recompute)}
        )
    ranks = []
    usable = (hw.gpu_memory_gb - hw.reserve_gb) * GB
    for r, held_stages in enumerate(rank_of):
        st = [stages[s] for s in held_stages]
        n = {key: sum(x["n"][key] for x in st) for key in st[0]["n"]}
        on_gpu = policy.offload == "none"
        sb = state_bytes(n, policy.optimizer)
        gathered = sum(x["gathered"] for x in st)
        counts = inflight[r]
        peak = max(counts, key=lambda c: sum(c[j] * st[j]["dev_mb"] for j in range(len(st))))
        act = sum(peak[j] * st[j]["dev_mb"] for j in range(len(st))) + max(x["ws"] for x in st)
        pairs = overlap_pairs(L.pp, m)[r] if fb else ()
        if pairs:  # the other party's transfer in flight at a hand-over: its send and receive buffers (bf16)
            act += 2 * T * k * Dl * 2
        host_act = max(sum(c[j] * st[j]["host_mb"] for j in range(len(st))) for c in counts)
        # the activation peak comes when the backward starts: the sharded gradients exist only after a first
        # micro-batch's reduce (none under "stage", whose gradients stay unsharded in `gathered` until the end);
        # unwrapped ("none") the whole gradients accumulate from the first micro-batch's backward on
        grads_held = sb["grads"] if on_gpu and fsdp in ("layer", "none") and m > 1 else 0
        # under --offload cpu the shards FSDP2 manages, their gradients and moments live on the host (the shards and
        # gradients pinned, each block a power of two: pinned_numel); the fp32 tensors it leaves whole stay here
        dev = sb if on_gpu else fp32_state_bytes(n)
        mem = {
            "params": dev["params"],
            "grads": dev["grads"],
            "optimizer": dev["optimizer"],
            "gathered": gathered,
            "activations": act,
        }
        mem["backward_peak"] = mem["params"] + mem["optimizer"] + gathered + act + grads_held
        mem["step_peak"] = mem["params"] + mem["grads"] + mem["optimizer"]
        mem["total"] = max(mem["backward_peak"], mem["step_peak"])
        host = host_act
        if not on_gpu:
            pn = [pinned_numel(cfg, L, s, lora_rank=lora_rank, num_stages=ns) for s in held_stages]
            pinned = {key: sum(x[key] for x in pn) for key in pn[0]}
            host += pinned["trainable"] * pb + pinned["frozen"] * FROZEN_BYTES + pinned["graded"] * gb
            if fsdp == "layer" and m > 1:  # the trainer's held gradient sums beside a micro-batch's (HostGradSums)
                host += pinned["graded"] * gb
            host += sb["optimizer"] - dev["optimizer"]  # the moments (pageable: exact)
        comm = {key: sum(x["comm"][key] for x in st) for key in st[0]["comm"]}
        t = {key: sum(x[key] for x in st) for key in ("t_comp", "t_a2a", "t_shown", "t_pp", "t_off", "t_fwd", "t_fsdp")}
        f, f_rec = sum(x["f"] for x in st), sum(x["f_rec"] for x in st)
        # each OVERLAP_F_B pair takes pair_time where the forward then the backward took their sum
        hidden = 0.0
        for sf, sb, count in pairs:
            (c_f, n_f, x_f), (c_b, n_b, x_b) = stages[sf]["x_f"], stages[sb]["x_b"]
            t_x = max(x_f, x_b)  # one size of transfer on the rank's links (the stages' alike)
            apart = c_f + n_f * x_f + c_b + n_b * x_b
            hidden += count * max(0.0, apart - pair_time(c_f, n_f, c_b, n_b, t_x))
        t_micro = t["t_comp"] + t["t_shown"] + t["t_pp"] + t["t_off"]
        ranks.append(
            dict(rank=r, stages=held_stages, mem=mem, host=host, host_act=host_act, comm=comm, n=n, peak=peak)
            | t
            | {"t_micro": t_micro - hidden / m, "t_apart": t_micro, "share": f / (f + f_rec)}
        )
    worst = max(ranks, key=lambda x: x["mem"]["total"])
    slowest = max(ranks, key=lambda x: x["t_micro"])
    t_micro = slowest["t_micro"]
    busy = m * t_micro
    if sched is None:
        bub = 0.0
    elif sched in V_SCHEDULES:  # one of the 2 pp stages: the slowest rank's two stages' mean, I = W = B / 2
        F = slowest["t_fwd"] / 2
        B = slowest["t_apart"] / 2 - F  # its warm-up and cool-down run no pair
        w = 0.0 if whole else W_SHARE  # "layer": the split's weight part runs inside its input part
        bub = replay_bubble(sched, L.pp, F, B * (1 - w), B * w)
    else:
        bub = bubble(sched, L.pp, slowest["t_fwd"], t_micro - slowest["t_fwd"])
    pipeline = busy + bub
    fsdp_exposed = max(max(0.0, x["t_fsdp"] - m * x["t_comp"]) for x in ranks)
    # the optimizer steps only the tensors that get a gradient (params.state_bytes)
    tr = max(sum(graded_numel(x["n"])) for x in ranks)
    t_acc = 0.0
    if policy.offload == "none":
        t_opt = tr * (pb + gb + 2 * ob + pb) / (hw.hbm_gbps * GB)  # read p, g, m, v; write p, m, v
    else:
        # the host step at its measured rate (else host memory's bandwidth), and the shards' gradients down and
        # parameters up the host link
        rate = cal.host_optimizer_s_per_gparam.get(policy.optimizer)
        t_host = tr / 1e9 * rate if rate is not None else tr * (pb + gb + 2 * ob + pb) / (hw.host_gbps * GB)
        t_opt = t_host + tr * (pb + gb) / (hw.pcie_gbps * GB)
        if fsdp == "layer":  # reduced every micro-batch: each after the first added on the host to the held sums
            t_acc = (m - 1) * tr * gb / GB * cal.grad_taken_s_per_gb(hw.host_gbps)
    step = pipeline + fsdp_exposed + t_opt + t_acc
    tokens = L.dp * m * seq_len
    tps = tokens / step / L.world
    f_tok = fl.total  # = kimi.flops.estimate_flops(cfg, seq_len)["flops_per_token"] (2/3 of the matmuls for LoRA)
    fits = worst["mem"]["total"] <= usable and worst["host"] <= hw.host_memory_gb * GB
    return {
        "layout": dataclasses.asdict(L) | {"efsdp": L.efsdp, "world": L.world},
        "policy": dataclasses.asdict(policy),
        "schedule": sched,
        "stages": [[r.start, r.stop] for r in ranges],
        "microbatches": m,
        "tokens_per_microbatch_per_rank": T,
        "rows_per_expert": rows,
        "ep_overlap": ("fb+chunks" if chunks else "fb") if fb else ("chunks" if chunks else "none"),
        "expert_slowdown": slow,
        "global_batch_tokens": tokens,
        "worst_rank": worst["rank"],
        "worst_rank_stages": list(worst["stages"]),
        "worst_stage": worst["stages"][0],
        "inflight": list(worst["peak"]),
        "memory": worst["mem"],
        "host_memory": worst["host"],
        "host_activations": worst["host_act"],
        "numel": worst["n"],
        "comm": worst["comm"],
        "time": {
            "compute_per_microbatch": max(x["t_comp"] for x in ranks),
            "stage_compute_per_microbatch": [x["t_comp"] for x in stages],
            "all_to_all_per_microbatch": max(x["t_a2a"] for x in ranks),
            "all_to_all_exposed_per_microbatch": max(x["t_shown"] for x in ranks),
            # the slowest rank's all-to-all hidden per step in DualPipeV's OVERLAP_F_B pairs (--ep-overlap fb)
            "all_to_all_hidden_in_pairs": m * (slowest["t_apart"] - slowest["t_micro"]),
            "pipeline_send_per_microbatch": max(x["t_pp"] for x in ranks),
            "offload_copy_per_microbatch": max(x["t_off"] for x in ranks),
            # the model FLOPs' share of the slowest rank's work (recomputation adds the rest)
            "compute_model_flops_share": max(ranks, key=lambda x: x["t_comp"])["share"],
            "busy": busy,
            "bubble": bub,
            "fsdp_exposed": fsdp_exposed,
            "optimizer": t_opt,
            # --offload cpu: the gradient copies to the host and host adds after a step's first micro-batch, per step
            # (the trainer's HostGradSums; calibration's host_offload)
            "offload_grad_accumulate": t_acc,
            "step": step,
        },
        "tokens_per_s_per_gpu": tps,
        "tflops_per_gpu": f_tok * tps / 1e12,
        "mfu": f_tok * tps / (hw.peak_tflops * 1e12),
        "fits": fits,
    }


# the activation policies the search tries: each recompute mode with each activation offload the trainer composes
POLICIES = tuple((rc, ao) for rc in RECOMPUTE for ao in ACT_OFFLOAD if not (rc == "full" and ao in ("attn", "mlp")))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_refusal(L: Layout, seq_len: int, global_batch: int) -> str | None:
    """Why ``kimi train`` cannot run layout ``L`` with steps of ``global_batch`` tokens in ``seq_len`` sequences
    (``kimi_tools.train.parallel.TrainParallel.check_accum`` and its pipeline check), or None."""
    m = global_batch // (L.dp * seq_len)
    if m < 1:
        return (
            f"--global-batch {global_batch:,} is less than one --seq-len {seq_len:,} sequence for each of the "
            f"{L.dp} data-parallel ranks"
        )
    if m < L.pp:
        return f"{m} micro-batch(es) per pipeline, fewer than its {L.pp} stages (1F1B needs one in flight per stage)"
    return None


def schedule_refusal(cfg: KimiConfig, L: Layout, seq_len: int, global_batch: int, schedule: str) -> str | None:
    """Why the pipeline of layout ``L`` cannot run ``schedule`` (:data:`~kimi_tools.plan.schedule.PLANNED_SCHEDULES`)
    with steps of ``global_batch`` tokens in ``seq_len`` sequences, or None (always None at ``pp`` = 1, where no
    schedule runs): fewer micro-batches per pipeline than the schedule's stages
    (:func:`~kimi_tools.plan.schedule.min_microbatches`: ``2 pp`` for a V), or its ``2 pp`` stages not a divisor of
    the AttnRes blocks (the cut at block boundaries, :func:`stage_ranges`)."""
    if L.pp == 1:
        return None
    ns = num_stages(schedule, L.pp)
    m = global_batch // (L.dp * seq_len)
    if m < ns:
        return f"{m} micro-batch(es) per pipeline, fewer than the {ns} stages of {schedule} on {L.pp} ranks"
    blocks = -(-cfg.num_hidden_layers // (cfg.attn_res_block_size or 1))
    if blocks % ns:
        return f"{schedule}'s {ns} stages on {L.pp} ranks do not divide the {blocks} AttnRes blocks"
    return None


def _pipeline_refusal(lora_rank: int | None, fp8: str | None) -> str | None:
    """The trainer's refusal of ``--pp`` > 1 for this run (``kimi_tools.train.parallel.refuse_pipeline``), or None."""
    import types

    from kimi_tools.train.parallel import refuse_pipeline

    try:
        refuse_pipeline(2, types.SimpleNamespace(lora_rank=lora_rank, stage="lm", fp8=fp8), bool(lora_rank))
    except ValueError as e:
        return "kimi train " + str(e).replace("--pp 2 with", "refuses --pp > 1 with", 1)
    return None


def _overlaps(overlap_a2a: bool, L: Layout, schedule: str) -> tuple[str, ...]:
    """The ``kimi train --ep-overlap`` modes :func:`plan` tries for layout ``L`` under ``schedule``: ``none``
    without ``overlap_a2a``; else ``chunks``, and under DualPipeV (``L.pp`` > 1, ep > 1, cp 1) also ``fb`` and
    ``fb+chunks``."""
    if not overlap_a2a:
        return ("none",)
    if L.pp > 1 and schedule == "DualPipeV" and L.ep > 1 and L.cp == 1:
        return ("chunks", "fb", "fb+chunks")
    return ("chunks",)


def plan(
    cfg: KimiConfig,
    gpus: int,
    hw: Hardware,
    *,
    seq_len: int = 8192,
    global_batch: int = 1 << 24,
    lora_rank: int | None = None,
    fp8: str | None = None,
    optimizers: tuple[str, ...] = ("adamw-fp32",),
    offloads: tuple[str, ...] = ("none",),
    overlap_a2a: bool = False,
    cps: tuple[int, ...] = (1, 2, 4, 8),
    only: Layout | None = None,
    dropped: list[tuple[str, str]] | None = None,
    schedules: tuple[str, ...] = PLANNED_SCHEDULES,
) -> list[dict]:
    """Every layout of ``gpus`` GPUs (``pp`` dividing the AttnRes blocks, ``cp`` in ``cps`` dividing ``seq_len``,
    ``ep`` dividing ``dp x cp`` and the expert count) that ``kimi train`` runs, each with the fastest policy
    (recompute mode and, at ``pp`` > 1, the pipeline schedule among ``schedules`` that runs there
    (:func:`schedule_refusal`) and ``--pp-fsdp`` layer or stage (:func:`pp_fsdp_policies`), then the first of
    ``optimizers`` x ``offloads`` in order; without a pipeline the FSDP policy the trainer's for the layout,
    :func:`trainer_fsdp`) that fits, the row's ``schedule`` saying which; layouts where none fits come with their smallest-memory policy and
    ``fits`` false. Sorted: fitting first, then by predicted MFU (descending).

    A step is ``m = global_batch // (dp x seq_len)`` micro-batches of one sequence per pipeline (rounded down: the
    row's ``global_batch_tokens`` says what runs). Left out, with the reason appended to ``dropped``: layouts whose
    ``dp`` ranks cannot each get a sequence (``m`` < 1), pipelines with fewer micro-batches than stages (the
    trainer's 1F1B refuses them; a V schedule needs ``2 pp``, else 1F1B alone is tried), and ``pp`` > 1 where the trainer refuses the pipeline (LoRA, FP8:
    ``kimi_tools.train.parallel.refuse_pipeline``); each as ``(layout, reason)`` in ``dropped``.

    Raises:
        ValueError: ``gpus`` < 1, ``seq_len`` < 1, ``global_batch`` below one sequence; ``only`` not a layout of
            ``gpus`` the trainer runs (naming the flag and why)."""
    if gpus < 1:
        raise ValueError(f"--gpus: got {gpus}, expected a positive integer")
    if seq_len < 1:
        raise ValueError(f"--seq-len: got {seq_len}, expected a positive integer")
    if global_batch < seq_len:
        raise ValueError(
            f"--global-batch: got {global_batch:,} tokens, expected at least one --seq-len sequence ({seq_len:,} "
            "tokens) per step: each data-parallel rank trains whole sequences"
        )
    cal = load_calibration(fp8)
    blocks = -(-cfg.num_hidden_layers // (cfg.attn_res_block_size or 1))
    refusal = _pipeline_refusal(lora_rank, fp8)
    if only is not None:
        if only.world != gpus:
            raise ValueError(f"--layout: got {only.name()} = {only.world} GPUs, expected --gpus {gpus}")
        stage_ranges(cfg, only.pp)  # pp must divide the AttnRes blocks
        if cfg.num_experts and cfg.num_experts % only.ep:
            raise ValueError(f"--layout: got ep={only.ep}, expected a divisor of the {cfg.num_experts} experts")
        if seq_len % only.cp:
            raise ValueError(f"--layout: got cp={only.cp}, expected a divisor of --seq-len {seq_len}")
        why = _batch_refusal(only, seq_len, global_batch) or (refusal if only.pp > 1 else None)
        if why:
            raise ValueError(f"--layout: got {only.name()}, which kimi train does not run: {why}")
        cps = (only.cp,)
    out = []
    for pp in divisors(blocks):
        if gpus % pp:
            continue
        if pp > 1 and refusal:
            if dropped is not None:
                dropped.append((f"pp{pp}", refusal))
            continue
        n_dc = gpus // pp
        for cp in cps:
            if n_dc % cp or seq_len % cp:
                continue
            for ep in divisors(n_dc):
                if cfg.num_experts and cfg.num_experts % ep:
                    continue
                if not cfg.num_experts and ep > 1:
                    continue
                L = Layout(pp, n_dc // cp, cp, ep)
                if only is not None and L != only:
                    continue
                why = _batch_refusal(L, seq_len, global_batch)
                if why:
                    if dropped is not None:
                        dropped.append((L.name(), why))
                    continue
                runs = [x for x in schedules if not schedule_refusal(cfg, L, seq_len, global_batch, x)][
                    : 1 if pp == 1 else None
                ]
                if not runs:
                    if dropped is not None:
                        why = "; ".join(schedule_refusal(cfg, L, seq_len, global_batch, x) for x in schedules)
                        dropped.append((L.name(), why))
                    continue
                best = None
                fsdps = pp_fsdp_policies(pp)
                for opt in optimizers:
                    for off in offloads:
                        combos = [(x, o, f) for x in runs for o in _overlaps(overlap_a2a, L, x) for f in fsdps]
                        for sched, mode, fsdp in combos:
                            for rc, ao in POLICIES:
                                r = evaluate(
                                    cfg,
                                    L,
                                    Policy(opt, off, rc, fsdp=fsdp, act_offload=ao),
                                    hw,
                                    cal,
                                    seq_len=seq_len,
                                    global_batch=global_batch,
                                    lora_rank=lora_rank,
                                    overlap_a2a=mode,
                                    schedule=sched,
                                )
                                if best is None:
                                    best = r
                                elif r["fits"] and (not best["fits"] or r["mfu"] > best["mfu"]):
                                    best = r
                                elif (
                                    not r["fits"]
                                    and not best["fits"]
                                    and r["memory"]["total"] < best["memory"]["total"]
                                ):
                                    best = r
                        if best["fits"]:
                            break
                    if best["fits"]:
                        break
                out.append(best)
    out.sort(key=lambda r: (not r["fits"], -r["mfu"] if r["fits"] else r["memory"]["total"]))
    return out
