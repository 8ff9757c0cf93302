"""``kimi plan`` (``kimi_tools/plan/``): the per-rank parameter counts equal the meta model sharded as the trainer
shards it (one process, torch's fake process group, no memory used), the FLOP split adds up to ``kimi.flops``, the
calibration file matches the benchmark results it names, the command line, and ``docs/scaling.md`` is current."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from kernels_torch.model import KimiK3Model, cast_model
from kernels_torch.parallel.mesh import ParallelDims
from kernels_torch.parallel.parallelize import parallelize
from kimi.config import load_config
from kimi.flops import estimate_flops
from kimi_tools import plan as P

ROOT = Path(__file__).resolve().parent.parent


def _stage_model(cfg, layout: P.Layout, stage: int, dtype=torch.float32) -> KimiK3Model:
    """The meta model of one pipeline stage as one rank holds it before FSDP2: the stage's layers (embedding on the
    first stage, norm, output mix and lm_head on the last); the experts whole (``parallelize`` cuts them to
    ``E / ep`` rows)."""
    with torch.device("meta"):
        model = cast_model(KimiK3Model(cfg), dtype)  # the checkpoint's fp32 tensors stay fp32
    r = P.stage_ranges(cfg, layout.pp)[stage]
    model.model.layers = nn.ModuleList([model.model.layers[i] for i in r])
    if stage != 0:
        model.model.embed_tokens = None
    if stage != layout.pp - 1:
        model.model.norm = None
        model.lm_head = None
        if cfg.has_attn_res:
            model.model.output_attn_res_norm = None
            model.model.output_attn_res_proj = None
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _sharded(cfg, layout: P.Layout, stage: int, rank: int, dtype=torch.float32, lora_rank=None) -> dict:
    """Local elements and bytes of the stage model on fake rank ``rank`` of ``dp x cp`` after the trainer's sharding
    of its bf16 model (``kernels_torch.parallel.parallelize.parallelize`` over the :class:`ParallelDims` mesh: the
    experts ``Shard(0)`` over ``ep`` and FSDP2 over ``efsdp``, ep innermost; everything else FSDP2 over ``dp x cp``;
    bf16 compute, the checkpoint's fp32 tensors ignored, whole on every rank), with masters in ``dtype`` (fp32:
    ``adamw-fp32``; bf16: none, ``adamw-bf16``)."""
    from kernels_torch.parallel.fsdp import fp32_compute_params
    from kernels_torch.parallel.parallelize import ParallelPolicy

    world = layout.dp * layout.cp
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = _stage_model(cfg, layout, stage, torch.bfloat16)
        if lora_rank:
            from kimi_tools.lora import LoraSettings, apply_lora

            apply_lora(model, LoraSettings(rank=lora_rank, alpha=2.0 * lora_rank))
        dims = ParallelDims(world_size=world, dp=layout.dp, cp=layout.cp, ep=layout.ep)
        policy = ParallelPolicy(param_dtype=torch.bfloat16, master_dtype=None if dtype == torch.bfloat16 else dtype)
        ignored = set(fp32_compute_params(model, torch.bfloat16))
        parallelize(model, dims.build_mesh("cpu"), policy, ignored_params=ignored)
        # one AdamW step on meta: the sharded gradients and the optimizer's moments as the trainer creates them,
        # on the tensors the LM loss reaches (test_gets_gradient_matches_the_lm_loss checks which on a real step)
        trained = [p for p in model.parameters() if p.requires_grad]
        first = P.stage_ranges(cfg, layout.pp)[stage][0]  # the stage's layers are renumbered from 0

        def global_name(n: str) -> str:
            if not n.startswith("model.layers."):
                return n
            i, rest = n[len("model.layers.") :].split(".", 1)
            return f"model.layers.{int(i) + first}.{rest}"

        graded = [p for n, p in model.named_parameters() if p.requires_grad and P.params._gets_gradient(global_name(n))]
        opt = torch.optim.AdamW(trained, lr=1e-3, foreach=False)
        for p in graded:
            p.grad = torch.zeros_like(p)
        opt.step()
        out = {"dense": 0, "experts": 0, "lora": 0, "bytes": 0, "trainable": 0}
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p  # parameters FSDP2 leaves whole
            key = "experts" if ".experts.w" in name else "lora" if ".lora_" in name else "dense"
            out[key] += local.numel()
            out["bytes"] += local.numel() * local.element_size()
            out["trainable"] += local.numel() if p.requires_grad else 0
        nbytes = lambda t: _local(t).numel() * _local(t).element_size()  # noqa: E731
        out["grad_bytes"] = sum(nbytes(p.grad) for p in graded)
        out["optimizer_bytes"] = sum(nbytes(t) for st in opt.state.values() for k, t in st.items() if k != "step")
        out["pinned"] = _pinned_blocks(model, {id(p) for p in graded})
        return out
    finally:
        dist.destroy_process_group()


def _pinned_blocks(model, graded_ids: set) -> dict:
    """What ``--offload cpu`` pins of a sharded model, in elements: FSDP2 pins each parameter's padded shard
    (``FSDPParam.padded_sharded_param_size``) on its own and its gradient's, and torch's host allocator rounds each
    block up to a power of two; by role (trainable, graded, frozen)."""
    from torch.distributed.fsdp import FSDPModule

    out = {"trainable": 0, "graded": 0, "frozen": 0}
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in group.fsdp_params if group else ():
            n = math.prod(fp.padded_sharded_param_size)
            block = 1 << (n - 1).bit_length()
            p = fp.sharded_param
            out["trainable" if p.requires_grad else "frozen"] += block
            out["graded"] += block if id(p) in graded_ids else 0
    return out


@pytest.mark.parametrize(
    "preset,layers,layout,stage,rank",
    [
        ("tiny", None, P.Layout(pp=1, dp=2, cp=1, ep=2), 0, 1),
        ("tiny", None, P.Layout(pp=1, dp=3, cp=1, ep=1), 0, 2),  # 3 ranks: uneven chunks, the last rank short
        ("tiny", None, P.Layout(pp=1, dp=16, cp=1, ep=2), 0, 3),  # experts split on dim 1: 4 rows over efsdp 8
        ("tiny", None, P.Layout(pp=3, dp=2, cp=2, ep=2), 1, 3),
        ("tiny", None, P.Layout(pp=3, dp=4, cp=1, ep=4), 2, 2),
        ("tiny", None, P.Layout(pp=1, dp=1, cp=2, ep=1), 0, 0),
        ("k3.1-pro", 3, P.Layout(pp=1, dp=8, cp=2, ep=4), 0, 5),
        ("k3.1-pro", 3, P.Layout(pp=1, dp=16, cp=1, ep=16), 0, 15),
        ("k3.1-pro", 24, P.Layout(pp=2, dp=4, cp=1, ep=2), 1, 3),  # stage 1 of two: layers 12-23, lm_head
    ],
)
def test_rank_numel_equals_sharded_meta_model(preset, layers, layout, stage, rank):
    cfg = load_config(preset)
    if layers:
        cfg = cfg.truncated(layers)
    got = _sharded(cfg, layout, stage, rank)
    want = P.rank_numel(cfg, layout, stage, dp_cp_coord=rank, efsdp_coord=rank // layout.ep)
    assert (got["dense"], got["experts"]) == (want["dense"], want["experts"])
    sb = P.state_bytes(want, "adamw-fp32")  # fp32 masters (the trainer's FSDP2 shards), fp32 gradients and moments
    assert (sb["params"], sb["grads"], sb["optimizer"]) == (got["bytes"], got["grad_bytes"], got["optimizer_bytes"])
    # --offload cpu: the pinned host blocks, a power of two each
    assert P.pinned_numel(cfg, layout, stage) == got["pinned"]


@pytest.mark.parametrize("preset", ["tiny", "tiny-linear"])
def test_gets_gradient_matches_the_lm_loss(preset):
    """The planner's rule for which parameters the LM loss gives a gradient (no grads, no moments for the others:
    the DSA indexer, layer 0's attention-side AttnRes mix) equals one real backward of the loss on random ids."""
    torch.manual_seed(0)
    cfg = load_config(preset)
    model = KimiK3Model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 48))
    model.loss(ids, ids).backward()
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            continue  # fixed: moved by its own balancing rule, not by a gradient
        assert (p.grad is not None) == P.params._gets_gradient(name), name


def test_worst_rank_bytes_bf16_and_evaluate():
    """The planner's per-rank parameter bytes (``evaluate``: the worst stage at coordinate 0) equal the sharded meta
    model's, for fp32 masters and for bf16 parameters."""
    cfg = load_config("tiny")
    layout = P.Layout(pp=3, dp=2, cp=1, ep=2)
    cal = P.load_calibration()
    for opt, dtype in [("adamw-fp32", torch.float32), ("adamw-bf16", torch.bfloat16)]:  # fp32 masters / bf16
        r = P.evaluate(cfg, layout, P.Policy(optimizer=opt), P.Hardware(), cal, seq_len=64, global_batch=1024)
        got = _sharded(cfg, layout, r["worst_stage"], 0, dtype)
        assert r["memory"]["params"] == got["bytes"]
        assert r["memory"]["grads"] == got["grad_bytes"]
        assert r["memory"]["optimizer"] == got["optimizer_bytes"]


def test_lora_numel_equals_sharded_meta_model():
    pytest.importorskip("peft")
    cfg = load_config("tiny")
    layout = P.Layout(pp=1, dp=4, cp=1, ep=2)
    for rank in (0, 3):
        got = _sharded(cfg, layout, 0, rank, lora_rank=4)
        want = P.rank_numel(cfg, layout, 0, dp_cp_coord=rank, efsdp_coord=rank // 2, lora_rank=4)
        assert (got["dense"], got["experts"], got["lora"]) == (want["dense"], want["experts"], want["lora"])
        assert got["trainable"] == want["trainable"] == want["lora"]
        sb = P.state_bytes(want, "adamw-fp32")  # adapters fp32 with AdamW; the base frozen (no gradient, no state)
        assert (sb["grads"], sb["optimizer"]) == (got["grad_bytes"], got["optimizer_bytes"])
        assert P.pinned_numel(cfg, layout, 0, lora_rank=4) == got["pinned"]


@pytest.mark.parametrize("preset,seq_len", [("tiny", 100), ("tiny", 8192), ("tiny-linear", 300), ("k3.1-pro", 32768)])
def test_layer_flops_add_up(preset, seq_len):
    cfg = load_config(preset)
    f = P.layer_flops(cfg, seq_len)
    assert len(f.layers) == len(f.experts) == cfg.num_hidden_layers
    want = estimate_flops(cfg, seq_len)["flops_per_token"]
    assert abs(f.total - want) <= 1e-12 * want
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert all(f.experts[i] > 0 for i in moe) and all(f.experts[i] == 0 for i in set(range(len(f.layers))) - set(moe))


def test_stage_ranges():
    cfg = load_config("k3.1-pro")
    assert P.stage_ranges(cfg, 8) == [range(12 * s, min(93, 12 * s + 12)) for s in range(8)]
    assert P.stage_ranges(cfg, 2) == [range(0, 48), range(48, 93)]
    with pytest.raises(ValueError, match="pp: got 3"):
        P.stage_ranges(cfg, 3)
    with pytest.raises(ValueError, match="ep=3"):
        P.Layout(pp=1, dp=4, cp=1, ep=3)


def test_calibration_matches_results():
    """Every calibration point is the row of the result file it names (ms, peak, FLOPs), and its parameter bytes
    are the benchmark model's."""
    from kimi.layout import stacked_layout

    doc = json.loads(P.CALIBRATION_FILE.read_text())
    used = [p for p in doc["points"] if p["use"]]
    assert {p["use"] for p in used} >= {"bf16-none", "bf16-mlp"}
    for p in doc["points"]:
        rows = json.loads((ROOT / p["file"]).read_text())["rows"]
        hit = [
            r
            for r in rows
            if r["seq_len"] == p["seq_len"] and (r["recompute"] or "none") == p["recompute"] and r["status"] == "ok"
        ]
        assert len(hit) == 1, p
        assert (hit[0]["ms"], hit[0]["peak_gib"], hit[0]["model_tflop"]) == (p["ms"], p["peak_gib"], p["model_tflop"])
        cfg = (
            load_config("k3.1-pro")
            .truncated(4)
            .replace(num_experts=p["experts"], num_experts_per_token=p["experts_per_token"])
        )
        assert p["param_bytes"] == sum(s.numel * (4 if s.dtype == "float32" else 2) for s in stacked_layout(cfg))


def test_expert_density():
    """The experts' rate is the measured one at the measured densities, grows with rows per expert in between, and
    a rank at the calibration step's density is not slowed down."""
    cal = P.load_calibration()
    for rows, tf in cal.density:
        assert cal.expert_rate(rows) == pytest.approx(tf, rel=1e-12)
    (r0, _), (r1, _) = cal.density
    mid = [cal.expert_rate(r) for r in (r0 / 2, r0, (r0 * r1) ** 0.5, r1, 4 * r1)]
    assert mid == sorted(mid) and mid[-1] == mid[-2]
    (_, t0), (_, t1) = cal.density  # log-linear: the geometric mean of the densities gets the mean of the rates
    assert cal.expert_rate((r0 * r1) ** 0.5) == pytest.approx((t0 + t1) / 2, rel=1e-12)
    assert cal.expert_slowdown(cal.rows_per_expert["none"], "none") == 1.0
    assert cal.expert_slowdown(r0, "none") == pytest.approx(
        cal.expert_rate(cal.rows_per_expert["none"]) / cal.expert_rate(r0)
    )


# the measured one-rank rows (benchmark 5 under torchrun at world 1: FSDP2, 4 real-dimension layers, 8K tokens):
# (file, reshard policy the row ran; the "never" row's JSON records the default's name)
ONE_RANK_ROWS = [
    ("train_step_e16_torchrun_h100.json", "auto"),
    ("train_step_e16_torchrun_h200.json", "auto"),
    ("train_step_e16_torchrun_always_bf16_bf16_h100.json", "always"),
    ("train_step_e16_torchrun_always_bf16_fp32_h100.json", "always"),
    ("train_step_e16_torchrun_always_fp32_fp32_h100.json", "always"),
    ("train_step_e16_torchrun_never_bf16_bf16_h100.json", "never"),
    ("train_step_e112_torchrun_h200.json", "auto"),
    ("h100_2026-12-06_lease4/train_step_e16_torchrun.json", "auto"),  # no FSDP2: one rank, bf16 masters
    ("h100_2026-12-06_lease4/train_step_e16_torchrun_fsdp.json", "auto"),  # the same with FSDP2 forced
]
TOL_PEAK = 0.05  # the planner's peak within 5% of each measured one-rank peak


def _one_rank_prediction(row: dict, reshard: str, cal) -> float:
    """The planner's peak bytes for a benchmark-5 row's one-rank layout, less the optimizer states (the benchmark
    steps no optimizer): its masters' policy, its reshard policy, one micro-batch of its tokens."""
    cfg = P.calibration_config(row["experts"], row["experts_per_token"])
    fsdp_policy = row.get("fsdp_policy") or {}
    masters = fsdp_policy.get("masters", "bf16")
    fsdp = "layer" if fsdp_policy.get("fsdp2", True) else "none"  # rows before "fsdp2" was recorded ran FSDP2
    policy = P.Policy(optimizer="adamw-bf16" if masters == "bf16" else "adamw-fp32", reshard=reshard, fsdp=fsdp)
    T = row["seq_len"]
    r = P.evaluate(cfg, P.Layout(1, 1, 1, 1), policy, P.Hardware(), cal, seq_len=T, global_batch=T)
    return r["memory"]["backward_peak"] - r["memory"]["optimizer"]


@pytest.mark.parametrize("name,reshard", ONE_RANK_ROWS)
def test_one_rank_peak_within_5_percent_of_measured(name, reshard):
    """The planner against the measured peak of each one-rank row (bf16 or fp32 masters, bf16 or fp32 reduction,
    each reshard policy): the parameters sharded as the trainer shards them, FSDP2's gathered units when the
    backward starts (:func:`kimi_tools.plan.params.layer_fsdp_bytes`), the activations (the eager count scaled
    to the GPU step, the head exact with its ``lm_head`` gradient); no sharded gradient yet at that moment."""
    row = json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"][0]
    assert row["status"] == "ok" and row["parallel"] and row["recompute"] is False
    if reshard != "never":
        assert row["fsdp_policy"]["reshard_after_forward"] == reshard
    got = _one_rank_prediction(row, reshard, P.load_calibration()) / 2**30
    assert abs(got / row["peak_gib"] - 1) <= TOL_PEAK, (name, got, row["peak_gib"])


def test_one_rank_unwrapped_holds_its_gradients_across_micro_batches():
    """On one GPU under adamw-bf16 the trainer leaves FSDP2 out (``fsdp="none"``: nothing gathered); with more
    than one micro-batch per step the whole bf16 gradients are held from the first backward on, so the backward's
    peak grows by them, and by nothing else."""
    cfg, cal, T = P.calibration_config(16, 8), P.load_calibration(), 8192
    peak = {}
    for m in (1, 4):
        r = P.evaluate(cfg, P.Layout(1, 1, 1, 1), P.Policy(optimizer="adamw-bf16"), P.Hardware(), cal, seq_len=T,
                       global_batch=m * T)  # fmt: skip
        assert r["policy"]["fsdp"] == "none" and r["memory"]["gathered"] == 0
        peak[m] = r["memory"]["backward_peak"]
    assert peak[4] - peak[1] == r["memory"]["grads"] > 0


def test_reshard_policy_moves_the_peak_as_measured():
    """The gathered units at the backward's start, against the measured differences of the one-rank rows with
    bf16 masters: "auto" holds the last layer and the root, "always" one unit, "never" every unit (exact to the
    allocator's granularity, TOL_GATHERED)."""
    TOL_GATHERED = 0.01
    rows = {
        pol: json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"][0]["peak_gib"]
        for name, pol in ONE_RANK_ROWS[:6]
        if "bf16_fp32" not in name and "fp32_fp32" not in name and "h200" not in name
    }
    cfg = P.calibration_config(16, 8)
    want = {pol: P.layer_fsdp_bytes(cfg, P.Layout(1, 1, 1, 1), reshard=pol) / 2**30 for pol in rows}
    for a, b in (("auto", "always"), ("never", "always")):
        assert abs((rows[a] - rows[b]) - (want[a] - want[b])) <= TOL_GATHERED * rows[a], (a, b, rows, want)


def test_recompute_flops_give_the_measured_step_times():
    """The recompute policies cost their recomputed forwards at the measured no-recompute rate: the planner's
    one-rank compute against benchmark 5's measured 32K steps with the MLP blocks and with whole layers
    recomputed (16 experts, one process), TOL_TIME."""
    TOL_TIME = 0.05
    cal = P.load_calibration()
    for name, mode in (("train_step_e16_pass17.json", "mlp"), ("train_step_4layers_pass8.json", "full")):
        rows = json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"]
        row = next(r for r in rows if r["seq_len"] == 32768 and r["recompute"] and r["status"] == "ok")
        assert row["recompute"] == {"full": "layer"}.get(mode, mode)
        cfg = P.calibration_config(row["experts"], row["experts_per_token"])
        r = P.evaluate(cfg, P.Layout(1, 1, 1, 1), P.Policy(recompute=mode), P.Hardware(), cal, seq_len=32768,
                       global_batch=32768)  # fmt: skip
        got = r["time"]["compute_per_microbatch"] * 1e3
        assert abs(got / row["ms"] - 1) <= TOL_TIME, (name, got, row["ms"])


def test_cli(capsys):
    from kimi_tools.cli import main

    assert (
        main(
            [
                "plan",
                "--preset",
                "tiny",
                "--gpus",
                "4",
                "--gpu-memory",
                "1",
                "--reserve",
                "0",
                "--seq-len",
                "64",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["layouts"] and all(r["layout"]["world"] == 4 for r in out["layouts"])
    assert out["layouts"][0]["fits"]
    assert main(["plan", "--preset", "tiny", "--gpus", "4", "--nodes", "3"]) == 2
    assert "--nodes: got 3" in capsys.readouterr().err
    assert main(["plan", "--preset", "tiny", "--gpus", "4", "--layout", "1,2,2,2", "--seq-len", "64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert [r["layout"] for r in rows] == [{"pp": 1, "dp": 2, "cp": 2, "ep": 2, "efsdp": 2, "world": 4}]
    for bad, msg in [("1,2,2,3", "ep=3"), ("1,2,2", "four positive integers"), ("3,1,1,1", "expected --gpus 4")]:
        assert main(["plan", "--preset", "tiny", "--gpus", "4", "--layout", bad]) == 2
        assert msg in capsys.readouterr().err
    assert main(["plan", "--preset", "tiny", "--gpus", "4", "--fp8", "tensorwise"]) == 2
    assert "--fp8: got 'tensorwise'" in capsys.readouterr().err


def test_host_memory_bounds_offloaded_states(capsys):
    """``--host-memory`` is the host each rank may fill with offloaded states: the layout whose states need 313 GB
    per rank on the host (k3.1-pro, 128 GPUs, dp 128 ep 64, the trainer's held gradient sums included) fits with
    400 GB and not with the default 250 GB; a non-positive value is refused in one line."""
    from kimi_tools.cli import main

    argv = ["--gpus", "128", "--layout", "1,128,1,64", "--top", "1"]
    row = _plan_json(capsys, *argv, "--host-memory", "400")["layouts"][0]
    assert row["fits"] and row["policy"]["offload"] == "cpu" and 250e9 < row["host_memory"] <= 400e9
    assert not _plan_json(capsys, *argv)["layouts"][0]["fits"]
    assert main(["plan", "--gpus", "8", "--host-memory", "0"]) == 2
    assert "--host-memory: got 0.0, expected a positive number" in capsys.readouterr().err


def test_states_on_the_host_cost_their_measured_host_time(capsys):
    """Under ``--offload cpu`` the optimizer steps on the host at the measured seconds per 10^9 parameters, and each
    micro-batch after a step's first pays the trainer's gradient path (``fsdp layer``: reduced every micro-batch;
    ``HostGradSums``: FSDP2's non-blocking copy, measured, then the host add into the held sums, at host memory's
    rate while the file has no ``taken_s_per_gb``; one more set of pinned host gradients); a pipeline's ``stage``
    policy reduces once per step and pays none (calibration ``host_offload``, ``benchmarks/host_optimizer.py``)."""
    import dataclasses

    from kimi_tools.plan.calibration import load_calibration
    from kimi_tools.plan.layout import OPTIMIZERS, Hardware
    from kimi_tools.plan.params import graded_numel, pinned_numel

    cal, hw = load_calibration(), Hardware()
    assert cal.host_optimizer_s_per_gparam["adamw-bf16"] > 10 * cal.host_optimizer_s_per_gparam["adamw-fp32"] > 0
    assert cal.grad_accumulate_s_per_gb > 0 and cal.host_offload_source.startswith("measured: benchmarks/")
    assert 0 < cal.grad_first_s_per_gb < cal.grad_accumulate_s_per_gb / 10 and cal.grad_taken_s_per_gb_measured is None
    taken = cal.grad_first_s_per_gb + 3 / hw.host_gbps  # read two gradients, write one, at host memory's rate
    assert cal.grad_taken_s_per_gb(hw.host_gbps) == taken and "add" in cal.host_offload_source
    measured = dataclasses.replace(cal, grad_taken_s_per_gb_measured=0.05)  # a file with the trainer's rate
    assert measured.grad_taken_s_per_gb(hw.host_gbps) == 0.05
    for argv in (["--layout", "1,128,1,64"], ["--layout", "1,256,1,64", "--gpu-memory", "80"]):
        row = _plan_json(capsys, "--gpus", argv[1].split(",")[1], *argv, "--top", "1")["layouts"][0]
        pol, t, m = row["policy"], row["time"], row["microbatches"]
        assert pol["offload"] == "cpu" and pol["fsdp"] == "layer" and m > 1, row["policy"]
        pb, gb, _ = OPTIMIZERS[pol["optimizer"]]
        tr = sum(graded_numel(row["numel"]))
        host = tr / 1e9 * cal.host_optimizer_s_per_gparam[pol["optimizer"]]
        assert math.isclose(t["optimizer"], host + tr * (pb + gb) / (hw.pcie_gbps * 1e9), rel_tol=1e-9)
        assert math.isclose(t["offload_grad_accumulate"], (m - 1) * tr * gb / 1e9 * taken)
        # the held sums: one more set of pinned host gradients than the same layout with one micro-batch per step
        lay = P.Layout(*(row["layout"][k] for k in ("pp", "dp", "cp", "ep")))
        one = P.evaluate(
            load_config("k3.1-pro"), lay, P.Policy(**pol), hw, cal, seq_len=8192, global_batch=lay.dp * 8192
        )
        assert one["microbatches"] == 1 and lay.pp == 1
        extra = pinned_numel(load_config("k3.1-pro"), lay, 0)["graded"] * gb
        assert math.isclose(row["host_memory"] - one["host_memory"], extra, rel_tol=1e-9), (row["host_memory"], extra)
        parts = t["busy"] + t["bubble"] + t["fsdp_exposed"] + t["optimizer"] + t["offload_grad_accumulate"]
        assert math.isclose(t["step"], parts, rel_tol=1e-9)
    staged = _plan_json(capsys, "--gpus", "128", "--layout", "8,8,2,16", "--top", "1")["layouts"][0]
    assert staged["policy"]["fsdp"] == "stage" and staged["policy"]["offload"] == "cpu"
    assert staged["time"]["offload_grad_accumulate"] == 0.0


def test_doc_is_current():
    """``docs/scaling.md``'s generated section is what ``kimi plan`` prints now (regenerate:
    ``python -m kimi_tools.plan --write-docs``)."""
    text = (ROOT / "docs" / "scaling.md").read_text()
    assert P.splice_docs(text) == text, "docs/scaling.md is stale: run `python -m kimi_tools.plan --write-docs`"


def _held_by_autograd(stage, x: torch.Tensor, labels: torch.Tensor, params: set) -> int:
    """Bytes one micro-batch keeps between a stage's forward and backward: the distinct non-parameter storages
    autograd saves, plus the sent state of a stage before the last (``torch.distributed.pipelining`` keeps it)."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x, labels=labels)
    held = sum(n for ptr, n in seen.items() if ptr not in params)
    if not stage.is_last:
        held += out.untyped_storage().nbytes() if out.untyped_storage().data_ptr() not in seen else 0
    return held


@pytest.mark.parametrize(
    "preset, counts, lm_head_grad",
    [("tiny", (4, 4, 1), True), ("tiny", (8, 1), False), ("tiny-linear", (2, 3, 1), True)],
    ids=["attnres-3-stages", "attnres-frozen-head", "no-attnres"],
)
def test_held_per_microbatch_equals_what_autograd_keeps(preset, counts, lm_head_grad):
    """The planner's activation bytes per in-flight micro-batch under whole-layer recomputation
    (:func:`kimi_tools.plan.held_per_microbatch`: layer inputs, the received and the sent state, the last stage's
    output mix, norm and loss) against the tensors autograd actually saves for every stage of a split bf16 model
    (TOL_HELD: the per-token fp32 scalars of the mix and the ids are not counted)."""
    from kernels_torch.activation_memory import recompute_layers
    from kernels_torch.parallel.pipeline import sources_after, split_stage, stage_layout

    TOL_HELD = 0.03
    torch.manual_seed(0)
    cfg = load_config(preset)
    model = cast_model(KimiK3Model(cfg), torch.bfloat16)
    model.lm_head.weight.requires_grad_(lm_head_grad)
    recompute_layers(model, "layer")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layout = stage_layout(cfg, len(counts), counts)
    T, D = 63, cfg.hidden_size
    labels = torch.randint(0, cfg.vocab_size, (1, T))
    for s, layers in enumerate(layout):
        stage = split_stage(model, layout, s)
        if s == 0:
            x = torch.randint(0, cfg.vocab_size, (1, T))
        else:
            x = torch.randn(sources_after(cfg, layers.start), 1, T, D, dtype=torch.bfloat16, requires_grad=True)
        got = _held_by_autograd(stage, x, labels, params)
        want = P.held_per_microbatch(cfg, layers, T, first=s == 0, last=s == len(layout) - 1, lm_head_grad=lm_head_grad)
        assert abs(got - want) <= TOL_HELD * want, (s, layers, got, want)


def test_activations_count_the_stage_io_and_head_once_in_every_mode():
    """``evaluate``'s activation bytes: the stage's received and sent states and the last stage's head
    (:func:`kimi_tools.plan.held_per_microbatch` minus the layer inputs) come on top of the per-layer bytes in every
    recomputation mode (the layer inputs counted once, by ``"full"`` only), and a frozen ``lm_head`` (LoRA) keeps no
    ``[V, D]`` gradient."""
    cfg = load_config("tiny")
    cal = P.load_calibration()
    T, D = 64, cfg.hidden_size
    for layout in (P.Layout(pp=1, dp=1, cp=1, ep=1), P.Layout(pp=3, dp=1, cp=1, ep=1)):
        heads = {}
        for rc in ("none", "attn", "mlp", "full"):
            r = P.evaluate(cfg, layout, P.Policy(recompute=rc), P.Hardware(), cal, seq_len=T, global_batch=4 * T)
            s = r["worst_stage"]
            layers = range(*r["stages"][s])
            inflight = min(layout.pp - s, r["microbatches"])
            per_mb = (r["memory"]["activations"] - cal.working_set(cfg, layers, T, rc)) / inflight
            if rc == "full":  # each layer's input (a later stage's first reads the received state)
                kept = (len(layers) - (0 if s == 0 else 1)) * T * D * 2
            else:
                kept = cal.layer_bytes(cfg, layers, T, rc)[0]
            first, last = s == 0, s == layout.pp - 1
            io = (
                P.held_per_microbatch(cfg, layers, T, first=first, last=last)
                - (len(layers) - (0 if first else 1)) * T * D * 2
            )
            heads[rc] = (s, per_mb - kept, io)
        # each mode's worst stage keeps its stage I/O and head once on top (float rounding only)
        assert all(abs(got - io) <= 1e-9 * io for _, got, io in heads.values()), (layout, heads)
    layout = P.Layout(pp=1, dp=1, cp=1, ep=1)  # one stage, one micro-batch in flight: the lm_head gradient alone
    act = {
        lora: P.evaluate(
            cfg, layout, P.Policy(recompute="full"), P.Hardware(), cal, seq_len=T, global_batch=T, lora_rank=lora
        )["memory"]["activations"]
        for lora in (None, 4)
    }
    assert act[None] - act[4] == cfg.vocab_size * D * 2


# ------------------------------------------------------------------------------ what the pipeline trainer holds


def _fsdp_held(module) -> int:
    """Bytes FSDP2 holds unsharded in ``module``'s units now: the all-gather outputs (the gathered bf16 parameters,
    padded; freed storages count 0) and the unsharded gradients (accumulated in the reduce dtype, or as computed;
    an expert stack's is a DTensor over ``ep``: its local storage)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    held, seen = 0, set()
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in fully_shard.state(m)._fsdp_param_groups:
            for fp in group.fsdp_params:
                if id(fp) in seen:
                    continue
                seen.add(id(fp))
                held += sum(t.untyped_storage().nbytes() for t in fp.all_gather_outputs)
                grad = fp.unsharded_accumulated_grad
                if grad is None and getattr(fp, "_unsharded_param", None) is not None:
                    grad = fp._unsharded_param.grad
                held += 0 if grad is None else _local(grad).untyped_storage().nbytes()  # (a DTensor's: global)
    return held


PP_M = 4  # micro-batches per pipeline and step
PP_T = 32  # tokens per micro-batch


def _pipeline_held_worker(rank: int, world: int, groups, out: str, pp_fsdp: str) -> None:
    """One rank of the pipeline trainer at pp 2 x dp 2 x ep 2 (``kimi_tools.train.parallel.TrainParallel``: its setup,
    its ``Pipeline`` step) under ``--pp-fsdp pp_fsdp``, tiny preset cut to 8 layers, bf16: the largest number of
    bytes FSDP2 holds unsharded in this rank's stage before each micro-batch's forward of a step, and the
    all-gathers and reduce-scatters that step issues."""

    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group

    torch.set_num_threads(1)
    groups.open()
    from kimi_tools.train.parallel import TrainParallel

    calls = {"all_gather": 0, "reduce_scatter": 0}
    gather, reduce = fsdp_group.foreach_all_gather, fsdp_group.foreach_reduce

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    fsdp_group.foreach_all_gather = counted("all_gather", gather)
    fsdp_group.foreach_reduce = counted("reduce_scatter", reduce)
    try:
        par = TrainParallel(1, "cpu", dp=2, pp=2, ep=2, pp_fsdp=pp_fsdp)
        cfg = load_config("tiny").truncated(8)
        torch.manual_seed(0)
        model = cast_model(KimiK3Model(cfg), torch.bfloat16)
        par.check_accum(2 * PP_M, PP_T)
        par.setup(model, lora=False)
        (stage,) = par.pipe.stages
        seen: list[int] = []
        stage.register_forward_pre_hook(lambda mod, args: seen.append(_fsdp_held(mod)))
        for step in range(1):
            g = torch.Generator().manual_seed(10 * step + par.mesh["dp"].get_local_rank())
            ids = torch.randint(0, cfg.vocab_size, (PP_M, PP_T), generator=g)
            seen.clear()
            calls.update(all_gather=0, reduce_scatter=0)
            par.pipe.step(ids, ids.roll(-1, 1), n_tokens=2 * PP_M * PP_T)
            for p in par.pipe.parameters():
                p.grad = None
        from torch.distributed.fsdp import FSDPModule, fully_shard

        units = [m for m in stage.modules() if isinstance(m, FSDPModule)]
        # the units sharded over more than one rank gather (the experts' at efsdp 1 issue no collective): m + 1
        # times a step those that reshard after their forward, once those that keep their gathered copy
        groups = [g for m in units for g in fully_shard.state(m)._fsdp_param_groups]  # (a root left no parameter)
        sharded = [g for g in groups if g.mesh_info.shard_mesh_size > 1]
        got = {
            "stage": par.pipe.stage_indices[0],
            "held": max(seen),
            "after_step": _fsdp_held(stage),
            "units": len(groups),  # the units holding parameters (each reduce-scatters once)
            "gathers_expected": sum(PP_M + 1 if g._reshard_after_forward else 1 for g in sharded),
            "gathers_most": len(sharded) * (PP_M + 1),
            # per layer: a unit resharded after its forward gathers for each forward and each backward
            "layer_gathers_least": sum(2 * PP_M for g in sharded if g._reshard_after_forward),
            "layer_gathers_most": len(sharded) * 2 * PP_M,
            **calls,
        }
        torch.save(got, f"{out}.{rank}")
        dist.barrier()
    finally:
        fsdp_group.foreach_all_gather, fsdp_group.foreach_reduce = gather, reduce
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow
def test_stage_fsdp_bytes_equal_what_the_pipeline_trainer_holds(tmp_path):
    """Under ``--pp --pp-fsdp stage`` the trainer keeps every FSDP2 unit of a stage gathered from a micro-batch's
    backward on, with the gradients unsharded in fp32 until the step's end (torch's ``PipelineStage``): the planner's
    :func:`kimi_tools.plan.stage_fsdp_bytes` equals the bytes measured before each forward on every rank of pp 2 x
    dp 2 x ep 2, exactly, and it is the whole stage, not one layer; each unit is gathered ``m + 1`` times a step
    (``evaluate``'s count; once, a unit that keeps its gathered copy after its forward) and reduce-scattered once."""
    from helpers import spawn

    spawn(_pipeline_held_worker, 4, str(tmp_path / "held"), "stage")
    cfg = load_config("tiny").truncated(8)
    layout = P.Layout(pp=2, dp=2, cp=1, ep=2)
    cal = P.load_calibration()
    kw = dict(seq_len=PP_T, global_batch=2 * PP_M * PP_T)
    row = P.evaluate(cfg, layout, P.Policy(fsdp="stage"), P.Hardware(), cal, **kw)
    assert row["policy"]["fsdp"] == "stage" and row["microbatches"] == PP_M
    for rank in range(4):
        got = torch.load(tmp_path / f"held.{rank}")
        want = P.stage_fsdp_bytes(cfg, layout, got["stage"])
        assert got["held"] == want, (rank, got, want)
        assert got["after_step"] == 0  # resharded and reduced at the step's end
        assert got["all_gather"] == got["gathers_expected"] <= got["gathers_most"], got
        assert got["reduce_scatter"] == got["units"], got
    # one layer's share (the per-layer policy's count) is far from what the stage holds
    one_layer = P.evaluate(cfg, P.Layout(pp=1, dp=2, cp=1, ep=2), P.Policy(), P.Hardware(), cal, **kw)
    assert P.stage_fsdp_bytes(cfg, layout, 0) > 2 * one_layer["memory"]["gathered"]
    # the worst stage's gathered bytes are the stage policy's, and the reduce dtype sets the gradients' bytes
    assert row["memory"]["gathered"] == P.stage_fsdp_bytes(cfg, layout, row["worst_stage"])
    with pytest.raises(ValueError, match=r"fsdp: got 'none' with pp=2 on 4 GPU\(s\) under adamw-fp32, expected one of"):
        P.evaluate(cfg, layout, P.Policy(fsdp="none"), P.Hardware(), cal, **kw)


@pytest.mark.distributed
@pytest.mark.slow
def test_layer_fsdp_bytes_bound_what_the_pipeline_trainer_holds(tmp_path):
    """Under ``--pp --pp-fsdp layer`` (the default) the pipeline trainer's units behave as without a pipeline: before
    each micro-batch's forward of a step a rank of pp 2 x dp 2 x ep 2 holds at most what the planner counts for its
    stage (:func:`kimi_tools.plan.layer_fsdp_bytes` with ``stage``: the units kept from their forward to their
    backward, the stage's last layer and its root; on the first stage, whose micro-batches' forwards run before
    their backwards under 1F1B, exactly that), never an unsharded gradient; each unit is reduce-scattered every
    micro-batch (``m`` a step, where the stage policy reduces once) and gathered at most ``2 m`` times (``evaluate``'s
    count; exactly ``2 m`` a unit resharded after its forward)."""
    from helpers import spawn

    spawn(_pipeline_held_worker, 4, str(tmp_path / "held"), "layer")
    cfg = load_config("tiny").truncated(8)
    layout = P.Layout(pp=2, dp=2, cp=1, ep=2)
    cal = P.load_calibration()
    row = P.evaluate(cfg, layout, P.Policy(), P.Hardware(), cal, seq_len=PP_T, global_batch=2 * PP_M * PP_T)
    assert row["policy"]["fsdp"] == "layer" and row["microbatches"] == PP_M
    for rank in range(4):
        got = torch.load(tmp_path / f"held.{rank}")
        want = P.layer_fsdp_bytes(cfg, layout, stage=got["stage"])
        assert got["held"] <= want and (got["stage"] == 1 or got["held"] == want), (rank, got, want)
        assert got["held"] < P.stage_fsdp_bytes(cfg, layout, got["stage"]) / 4, got
        assert got["after_step"] == 0
        assert got["layer_gathers_least"] <= got["all_gather"] <= got["layer_gathers_most"], got
        assert got["reduce_scatter"] == got["units"] * PP_M, got
    assert row["memory"]["gathered"] == P.layer_fsdp_bytes(cfg, layout, stage=row["worst_stage"])


def test_pp_fsdp_policies_count_their_collectives_and_memory():
    """Worked by hand for pp 2 x dp 4 (tiny, 8 layers in two stages of 4, fp32 AdamW, 4 micro-batches a step):
    ``--pp-fsdp layer`` gathers each unit twice a micro-batch (forward, backward) and reduce-scatters it every
    micro-batch, ``stage`` gathers it ``m + 1 = 5`` times under 1F1B (once under a V, whose runtime gathers the
    stage once and keeps it) and reduces once: all-gather bytes 8 : 5, reduce-scatter 4 : 1 (1 : 1 a unit's
    bytes, ``3 / 4`` of them leaving the rank); gathered memory one layer and the root (layer) against every unit
    and its fp32 gradient (stage), with the sharded gradients held between micro-batches (layer) or not (stage). The
    search tries both at pp > 1 and the row's command spells its ``--pp-fsdp``."""
    cfg = load_config("tiny").truncated(8)
    cal = P.load_calibration()
    L, m, T = P.Layout(2, 4, 1, 1), 4, 64
    kw = dict(seq_len=T, global_batch=L.dp * m * T)
    rows = {f: P.evaluate(cfg, L, P.Policy(fsdp=f), P.Hardware(), cal, **kw) for f in ("layer", "stage")}
    lay, st = rows["layer"], rows["stage"]
    assert lay["microbatches"] == st["microbatches"] == m and lay["worst_stage"] == st["worst_stage"]
    assert lay["comm"]["all_gather"] == pytest.approx(st["comm"]["all_gather"] * 2 * m / (m + 1), rel=1e-12)
    assert lay["comm"]["reduce_scatter"] == pytest.approx(st["comm"]["reduce_scatter"] * m, rel=1e-12)
    s = lay["worst_stage"]
    assert lay["memory"]["gathered"] == P.layer_fsdp_bytes(cfg, L, stage=s)
    assert st["memory"]["gathered"] == P.stage_fsdp_bytes(cfg, L, s)
    # by hand: one unit of each of the stage's 4 layers (the same widths) and the root's, bf16, fp32 gradients
    from kimi_tools.plan.search import stage_static

    n, sizes, full, moe = stage_static(cfg, L, None, 2)[s]
    trained, gathered = full["train_dense"] + full["train_experts"], full["dense"] + full["experts"]  # ep 1: alike
    assert st["comm"]["reduce_scatter"] == pytest.approx(trained * 4 * 3 / 4, rel=1e-12)
    assert st["comm"]["all_gather"] == pytest.approx(gathered * 2 * 3 / 4 * (m + 1), rel=1e-12)
    for r, grads in ((lay, lay["memory"]["grads"]), (st, 0)):  # the sharded gradients of earlier micro-batches
        mem = r["memory"]
        rest = mem["backward_peak"] - mem["gathered"] - mem["activations"]
        assert rest == pytest.approx(mem["params"] + mem["optimizer"] + grads, rel=1e-12)
    cfg4 = load_config("tiny-linear").truncated(4)  # 4 blocks of one layer: pp 2 runs a V of 4 stages
    v = P.evaluate(cfg4, L, P.Policy(fsdp="stage"), P.Hardware(), cal, schedule="DualPipeV", **kw)
    one = P.evaluate(cfg4, L, P.Policy(fsdp="stage"), P.Hardware(), cal, schedule="1F1B", **kw)
    full4 = [stage_static(cfg4, L, None, 4)[x][2] for x in v["worst_rank_stages"]]
    v_units = sum(f["dense"] + f["experts"] for f in full4)
    assert v["comm"]["all_gather"] == pytest.approx(v_units * 2 * 3 / 4, rel=1e-12)
    assert v["comm"]["all_gather"] < one["comm"]["all_gather"]
    out = P.plan(cfg, 8, P.Hardware(gpu_memory_gb=1, reserve_gb=0), seq_len=T, global_batch=L.dp * m * T)
    assert {r["policy"]["fsdp"] for r in out if r["layout"]["pp"] == 1} <= {"layer", "none"}
    for r in (r for r in out if r["layout"]["pp"] > 1):
        cmd = " ".join(P.train_command(r, preset="tiny", seq_len=T))
        assert f"--pp-fsdp {r['policy']['fsdp']} " in cmd and r["policy"]["fsdp"] in ("layer", "stage")


# ------------------------------------------------------------------------------ the kimi train command of a row


def _plan_json(capsys, *argv) -> dict:
    from kimi_tools.cli import main

    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.distributed
@pytest.mark.slow
def test_planned_command_runs_with_the_planned_layout(tmp_path, capsys):
    """The command ``kimi plan`` names for a pp 2 x dp 2 x ep 2 layout of the tiny preset (8 layers, two AttnRes
    blocks) runs under ``torchrun`` on 4 gloo ranks (``--device cpu --backend sdpa`` for ``cuda`` / ``cudnn``, two
    steps) and records the planned sizes, batch, schedule, stage layout, dtype and recomputation in ``run.json``."""
    import os
    import shlex
    import subprocess
    import sys

    from test_train_parallel import _short_documents

    out = _plan_json(
        capsys, "--preset", "tiny", "--layers", "8", "--gpus", "4", "--layout", "2,2,1,2", "--seq-len", "64",
        "--global-batch", "256", "--gpu-memory", "1", "--reserve", "0",
    )  # fmt: skip
    (row,) = out["layouts"]
    assert row["policy"]["optimizer"] == "adamw-fp32" and row["policy"]["offload"] == "none"  # what runs today
    argv = shlex.split(row["command"])
    assert argv[:4] == ["torchrun", "--standalone", "--nproc-per-node", "4"]
    data = _short_documents(tmp_path / "docs.jsonl")
    swap = {"DATA": str(data), "OUT": str(tmp_path / "run"), "cuda": "cpu", "cudnn": "sdpa"}
    argv = [swap.get(a, a) for a in argv[1:]]
    extra = ["--steps", "2", "--eval-every", "0", "--eval-tokens", "64", "--quiet", "--no-plot", "--no-save"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *argv, *extra], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ran = json.loads((tmp_path / "run" / "run.json").read_text())["args"]
    L = row["layout"]
    want = {
        "pp": L["pp"], "dp": L["dp"], "cp": L["cp"], "ep": L["ep"], "pp_schedule": "1F1B", "pp_layout": "4,4",
        "seq_len": 64, "micro_batch_tokens": 64, "batch_tokens": row["global_batch_tokens"], "dtype": "bfloat16",
        "recompute": row["policy"]["recompute"] != "none", "preset": "tiny", "layers": 8,
        "pp_fsdp": row["policy"]["fsdp"],
    }  # fmt: skip
    assert {k: ran[k] for k in want} == want
    assert row["global_batch_tokens"] == L["dp"] * row["microbatches"] * 64
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s][-1] == 2


def test_command_spells_each_policy(capsys):
    """Each policy of a row is a ``kimi train`` flag: bf16 AdamW states with bf16 reduction, CPU offload, MLP
    recomputation with layer 0 whole, LoRA, and a multi-node launch; the trainer's defaults add none."""
    from kimi_tools.cli import main

    cfg = load_config("k3.1-pro")
    cal = P.load_calibration()
    kw = dict(seq_len=8192, global_batch=1 << 24)
    layout = P.Layout(pp=8, dp=16, cp=1, ep=16)
    for policy, flags in [
        (P.Policy("adamw-bf16", "cpu", "full"), "--recompute --recompute-mode layer --optimizer adamw-bf16 "
         "--reduce-dtype bf16 --offload cpu"),
        (P.Policy("adamw-fp32", "none", "mlp"), "--recompute --recompute-mode mlp"),
        (P.Policy("adamw-fp32", "none", "none"), ""),
    ]:  # fmt: skip
        row = P.evaluate(cfg, layout, policy, P.Hardware(), cal, **kw)
        cmd = " ".join(P.train_command(row, preset="k3.1-pro", seq_len=8192, gpus_per_node=8))
        assert cmd.startswith(
            "torchrun --nnodes 16 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m kimi_tools.cli "
            "train --preset k3.1-pro --data DATA --out OUT --device cuda --backend cudnn --dtype bfloat16 --seq-len "
            "8192 --micro-batch-tokens 8192 --batch-tokens 16777216 --pp 8 --pp-schedule 1F1B --pp-layout "
            "12,12,12,12,12,12,12,9 --pp-fsdp layer --dp 16 --cp 1 --ep 16"
        ), cmd
        assert cmd.endswith(" --ep 16" + (" " + flags if flags else "")), cmd
    # every row of a plan carries its command; a bf16 / offloaded one spells those flags
    out = _plan_json(capsys, "--gpus", "128")
    assert all(r["command"].startswith("torchrun ") for r in out["layouts"])
    best = out["layouts"][0]
    if best["policy"]["optimizer"] == "adamw-bf16":
        assert "--optimizer adamw-bf16 --reduce-dtype bf16" in best["command"]
    if best["policy"]["offload"] == "cpu":
        assert "--offload cpu" in best["command"]
    assert main(["plan", "--preset", "tiny", "--gpus", "1", "--lora-rank", "4", "--seq-len", "64"]) == 0
    assert "--lora-rank 4" in capsys.readouterr().out


# ------------------------------------------------------------------------------ no silent arithmetic


def test_global_batch_is_honoured_or_refused(capsys):
    """A global batch that is not a whole number of sequences per data-parallel rank is rounded down and said so; one
    below a sequence is refused in one line; layouts that would need more sequences than the batch has (or fewer
    micro-batches than stages) are left out, said so; ``--layout`` asking for one is refused, naming why."""
    from kimi_tools.cli import main

    out = _plan_json(capsys, "--gpus", "3")
    assert {r["layout"]["dp"] for r in out["layouts"]} == {3}
    assert {r["global_batch_tokens"] for r in out["layouts"]} == {3 * (2**24 // (3 * 8192)) * 8192}
    assert any("--global-batch 16,777,216 is not a whole number" in n and "dp 3: 16,760,832" in n for n in out["notes"])
    out = _plan_json(capsys, "--gpus", "8")  # 2^24 divides: nothing said
    assert not any("--global-batch" in n for n in out["notes"])
    assert main(["plan", "--gpus", "8", "--global-batch", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--global-batch: got 1 tokens, expected at least one --seq-len sequence (8,192" in err[0]
    out = _plan_json(capsys, "--gpus", "8", "--global-batch", "16384")  # two sequences: dp <= 2, pp <= micro-batches
    assert out["layouts"] and all(r["global_batch_tokens"] == 16384 for r in out["layouts"])
    assert all(r["layout"]["dp"] * r["microbatches"] == 2 for r in out["layouts"])
    assert all(r["microbatches"] >= r["layout"]["pp"] for r in out["layouts"])
    assert any(n.startswith("left out, as kimi train does not run them") for n in out["notes"])
    assert main(["plan", "--gpus", "16", "--global-batch", "16384", "--layout", "8,2,1,2"]) == 2
    assert "--layout: got pp8 dp2 cp1 ep2, which kimi train does not run: 1 micro-batch(es)" in capsys.readouterr().err


def test_layout_errors_are_one_line(capsys):
    from kimi_tools.cli import main

    for bad in ("2,2,2", "2,2,2,x", "1,2,2,0", "1,,2,2"):
        assert main(["plan", "--preset", "tiny", "--gpus", "8", "--layout", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"kimi: error: --layout: got {bad!r}, expected four positive integers PP,DP,CP,EP (e.g. 8,16,1,16)"
        ]
        assert "__init__" not in err[0]


def test_pipeline_rows_only_where_the_trainer_runs_them(capsys):
    """LoRA under ``--pp`` is refused by the trainer: the planner offers pp 1 only and says why; ``--layout`` with
    pp > 1 is refused in one line."""
    from kimi_tools.cli import main

    out = _plan_json(capsys, "--gpus", "64", "--lora-rank", "16")
    assert out["layouts"] and {r["layout"]["pp"] for r in out["layouts"]} == {1}
    assert any("pp2, pp4, pp8: kimi train refuses --pp > 1 with --lora-rank 16" in n for n in out["notes"])
    assert main(["plan", "--gpus", "64", "--lora-rank", "16", "--layout", "8,8,1,8"]) == 2
    assert "kimi train refuses --pp > 1 with --lora-rank 16" in capsys.readouterr().err


def test_activations_scale_with_the_model(capsys):
    """The tiny preset's activations come from its own widths (not k3.1-pro's per-layer bytes): at 8K tokens and
    one micro-batch a layer holds under 1 MB... times T; k3.1-pro's layer holds over 50x a tiny layer's; the
    planner says the rates of a narrow preset are upper bounds."""
    tiny, k31 = load_config("tiny"), load_config("k3.1-pro")
    cal = P.load_calibration()
    per_tiny = cal.layer_bytes(tiny, range(tiny.num_hidden_layers), 8192, "none")[0] / tiny.num_hidden_layers
    per_k31 = cal.layer_bytes(k31, range(k31.num_hidden_layers), 8192, "none")[0] / k31.num_hidden_layers
    assert per_k31 > 50 * per_tiny
    out = _plan_json(capsys, "--preset", "tiny", "--gpus", "8")
    best = out["layouts"][0]
    assert best["memory"]["activations"] < 1e9  # was 119 GB: k3.1-pro's bytes per token per layer
    assert per_tiny < 100e6  # bytes per tiny layer at 8K tokens
    assert any("upper bounds, not predictions" in n for n in out["notes"])


def _measure_layer(preset: str, kind: str, T: int, policy: str) -> dict:
    """``benchmarks/activation_bytes.py``'s measurement (``saved_bytes_by_block`` on the CPU, bf16, sdpa) of the
    first layer of ``kind`` of ``preset`` under ``policy`` (``RECOMPUTE+OFFLOAD``): bytes per token."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("activation_bytes", ROOT / "benchmarks" / "activation_bytes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from kernels_torch.activation_memory import layer_kind

    cfg = load_config(preset)
    idx = next(i for i in range(cfg.num_hidden_layers) if layer_kind(cfg, i) == kind)
    torch.manual_seed(0)
    layer = mod.build_layer(cfg, idx, "sdpa", torch.bfloat16)
    return mod.measure(cfg, idx, layer, T, policy, torch.bfloat16)


TOL_BYTES = 0.03  # the eager count against autograd's saved storages, per region and per layer


@pytest.mark.parametrize("kind", ["dense", "kda", "dsa"])
def test_block_bytes_equal_what_autograd_saves_tiny(kind):
    """:func:`kimi_tools.plan.activations.block_bytes` against ``saved_bytes_by_block`` measured now on the tiny
    preset (64 tokens: one KDA chunk, the DSA top-k), per region and for the layer under each recompute mode
    (:func:`~kimi_tools.plan.activations.policy_bytes`), within TOL_BYTES."""
    from kimi_tools.plan.activations import block_bytes, policy_bytes

    cfg, T = load_config("tiny"), 64
    for rc in ("none", "attn", "mlp", "layer"):
        row = _measure_layer("tiny", kind, T, f"{rc}+none")
        i, got = row["layer"], row["device_bytes_per_token"]
        want, _ = policy_bytes(cfg, i, T, {"layer": "full"}.get(rc, rc))
        assert abs(want / T / got["layer"] - 1) <= TOL_BYTES, (kind, rc, want / T, got)
        if rc == "none":
            b = block_bytes(cfg, i, T)
            for k in ("attn", "mlp"):
                assert abs(b[k] / T / got[k] - 1) <= TOL_BYTES, (kind, k, b[k] / T, got)


def test_policy_bytes_equal_the_k31_measurement():
    """The same count at k3.1-pro's widths against ``benchmarks/results/activation_bytes.json`` (measured on the
    CPU by ``benchmarks/activation_bytes.py``: the dense, KDA and DSA layers, 256 tokens, every recompute and
    offload composition): device bytes within TOL_BYTES, and the host bytes of each offload."""
    from kimi_tools.plan.activations import policy_bytes

    doc = json.loads((ROOT / "benchmarks" / "results" / "activation_bytes.json").read_text())
    cfg, T = load_config("k3.1-pro").replace(num_experts=doc["experts"]), doc["seq_len"]
    assert cfg.num_experts_per_token == doc["experts_per_token"]
    ratio = P.load_calibration().host_ratio
    for r in doc["rows"]:
        dev, host = policy_bytes(cfg, r["layer"], T, {"layer": "full"}.get(r["recompute"]) or r["recompute"],
                                 r["offload"], ratio)  # fmt: skip
        got = r["device_bytes_per_token"]["layer"]
        assert abs(dev / T - got) <= TOL_BYTES * max(got, 2 * cfg.hidden_size), (r, dev / T)
        assert abs(host / T - r["host_bytes_per_token"]) <= TOL_BYTES * max(r["host_bytes_per_token"], 1.0), (r, host)


def test_train_command_runs_each_policy_it_names():
    """Every activation policy the search tries becomes the ``kimi train`` flags that run it: the command of a
    small plan's row parses with ``kimi train``'s own parser and carries the recompute mode, the activation
    offload and the reshard policy; a V schedule's row carries its schedule and the 2 pp stage counts that ``kimi
    train``'s pipeline layout takes."""
    import shlex

    from kimi_tools.cli import build_parser
    from kimi_tools.plan.search import POLICIES

    cfg = load_config("tiny")
    cal = P.load_calibration()
    modes = {"full": "layer"}
    seen = set()
    for rc, ao in POLICIES:
        for reshard in ("auto", "never"):
            policy = P.Policy(recompute=rc, act_offload=ao, reshard=reshard)
            row = P.evaluate(cfg, P.Layout(1, 2, 1, 2), policy, P.Hardware(), cal, seq_len=64, global_batch=256)
            argv = shlex.split(" ".join(P.train_command(row, preset="tiny", seq_len=64)))
            args = build_parser().parse_args(argv[argv.index("kimi_tools.cli") + 1 :])
            assert args.recompute == (rc != "none") and (rc == "none" or args.recompute_mode == modes.get(rc, rc))
            assert args.offload_activations == ao and args.reshard_after_forward == reshard
            seen.add((rc, ao))
    assert len(seen) == 14  # 4 recompute modes x 4 offloads, less attn / mlp offload inside a layer recomputed whole
    # a V row: its schedule and its 2 pp stage counts, which kimi train's layout takes (fake process group)
    from kernels_torch.parallel.pipeline import parse_stage_layout, stage_layout
    from kimi_tools.train.parallel import TrainParallel

    cfg = load_config("tiny-linear").truncated(4)
    for sched in ("DualPipeV", "ZBVZeroBubble"):
        row = P.evaluate(cfg, P.Layout(2, 2, 1, 2), P.Policy(recompute="full"), P.Hardware(), cal, seq_len=64,
                         global_batch=8 * 64, schedule=sched)  # fmt: skip
        argv = shlex.split(" ".join(P.train_command(row, preset="tiny-linear", layers=4, seq_len=64)))
        args = build_parser().parse_args(argv[argv.index("kimi_tools.cli") + 1 :])
        assert (args.pp, args.pp_schedule, args.pp_layout) == (2, sched, "1,1,1,1")
        assert [[r.start, r.stop] for r in stage_layout(cfg, 4, parse_stage_layout(args.pp_layout))] == row["stages"]
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        try:
            tp = TrainParallel(args.cp, "cpu", dp=args.dp, ep=args.ep, pp=args.pp, pp_schedule=args.pp_schedule,
                               pp_layout=args.pp_layout, world=4)  # fmt: skip
            assert tp.stages_per_rank == 2 and tp.stages_needed == 4
            tp.check_accum(args.batch_tokens // args.micro_batch_tokens, args.micro_batch_tokens, args.seq_len)
            assert tp.n_microbatches == row["microbatches"]
        finally:
            dist.destroy_process_group()


def test_offload_costs_its_host_copies():
    """An activation offload moves the region's bytes from the device to the host and adds the host copies' time
    at the calibration's rate: the slower of the named ``benchmarks/offload_copy.py`` result's device-to-host copy
    under compute and its host-to-device copy at the largest size."""
    cfg = load_config("k3.1-pro").truncated(12)
    cal = P.load_calibration()
    doc = json.loads(P.CALIBRATION_FILE.read_text())["host_copy"]
    big = max(json.loads((ROOT / doc["file"]).read_text())["rows"], key=lambda r: r["mb"])
    assert cal.host_copy_gbps == min(big["d2h_under_compute_gbps"], big["h2d_gbps"]) < doc["datasheet_gbps"]
    assert cal.host_copy_source.startswith(f"measured: {doc['file']}")
    kw = dict(seq_len=8192, global_batch=8192)
    plain = P.evaluate(cfg, P.Layout(1, 1, 1, 1), P.Policy(), P.Hardware(), cal, **kw)
    off = P.evaluate(cfg, P.Layout(1, 1, 1, 1), P.Policy(act_offload="mlp"), P.Hardware(), cal, **kw)
    moved = plain["memory"]["activations"] - off["memory"]["activations"]
    assert moved > 0 and off["host_activations"] > moved  # each saved view copied on its own
    t_copy = off["host_activations"] / (cal.host_copy_gbps * 1e9)
    assert off["time"]["offload_copy_per_microbatch"] >= t_copy
    assert off["time"]["step"] > plain["time"]["step"]


# ------------------------------------------------------------------------------ pipeline schedules


@pytest.mark.parametrize("schedule", ["DualPipeV", "ZBVZeroBubble"])
def test_v_bubble_formula_and_replay(schedule):
    """The V schedules' bubble: the closed form ``(pp - 1)(F + B - 2 W)`` (:func:`kimi_tools.plan.schedule.bubble`)
    by hand at pp 2, F = I = W = 1: one F, a sixth of 1F1B's 6 on its stages twice as long; the replay of torch's
    action lists the planner runs (:func:`~kimi_tools.plan.schedule.replay_bubble`) equal to it where F = I = W (pp
    2, 4, 8), the same for any micro-batch count from 2 pp, the published pp 8 case where the formula is short
    (I = 1.5 F, W = 0.5 F: 16.5 F under DualPipeV against 14 F), and longer with I = W = 2 F (recomputation in both
    parts of the backward)."""
    from kimi_tools.plan import schedule as PS

    assert PS.bubble(schedule, 2, F=1.0, B=2.0, W=1.0) == 1.0  # (2 - 1)(1 + 2 - 2)
    assert PS.bubble("1F1B", 2, F=2.0, B=4.0) == 6.0  # one 1F1B stage = two V stages
    assert PS.bubble(schedule, 2, F=1.0, B=2.0) == 1.0  # W = B / 2, the stated assumption
    tol = 1e-5  # the replay's cache key rounds the ratios to 1e-6
    for pp in (2, 4, 8):
        got = [PS.replay_bubble(schedule, pp, 1.0, 1.0, 1.0, m) for m in (2 * pp, 2 * pp + 1, 5 * pp)]
        assert all(abs(g - PS.bubble(schedule, pp, 1.0, 2.0, 1.0)) < tol for g in got), (pp, got)
        assert abs(PS.replay_bubble(schedule, pp, 2.0, 2.0, 2.0) - 2 * (pp - 1)) < tol  # linear in the times
    assert PS.bubble(schedule, 8, 1.0, 2.0, 0.5) == 14.0
    assert (
        abs(PS.replay_bubble(schedule, 8, 1.0, 1.5, 0.5) - {"DualPipeV": 16.5, "ZBVZeroBubble": 14.0}[schedule]) < tol
    )
    assert abs(PS.replay_bubble(schedule, 4, 1.0, 2.0, 2.0) - {"DualPipeV": 5.0, "ZBVZeroBubble": 6.0}[schedule]) < tol
    with pytest.raises(ValueError, match="W: got 3"):
        PS.bubble(schedule, 2, F=1.0, B=2.0, W=3.0)
    with pytest.raises(ValueError, match="micro-batches: got 3 with"):
        PS.replay_bubble(schedule, 2, 1.0, 1.0, 1.0, m=3)


def test_v_row_counts_every_rank_in_flight_and_recomputes_per_split_backward():
    """A V row's activations are its worst rank's peak over the micro-batches torch's schedule keeps in flight on
    BOTH of its stages (2 pp + 1 under DualPipeV, 2 pp under ZBVZeroBubble, on every rank, against 1F1B's pp on rank
    0 and 1 on the last), each stage's per-micro-batch bytes exact under whole-layer recomputation
    (``held_per_microbatch``); its recomputation is paid twice in a split backward (each part replays it), once in a
    full one (DualPipeV's steady state and cool-down), stage by stage as torch's action list says; its bubble is
    (pp - 1) F of one V stage."""
    from kimi_tools.plan import schedule as PS

    cfg = load_config("tiny-linear").truncated(4)  # 4 layers, blocks of one: pp 2 runs 2 or 4 stages
    cal = P.load_calibration()
    hw = P.Hardware(nvlink_gbps=1e9)  # no pipeline send time: the bubble is the compute's
    T, pp, m = 64, 2, 8
    kw = dict(seq_len=T, global_batch=m * T)
    layout = P.Layout(pp, 1, 1, 1)
    rows = {}
    for sched in ("1F1B", "DualPipeV", "ZBVZeroBubble"):
        for rc in ("none", "full"):
            rows[sched, rc] = P.evaluate(
                cfg, layout, P.Policy(recompute=rc, fsdp="stage"), hw, cal, schedule=sched, **kw
            )
            # kimi train's default --pp-fsdp layer runs each split backward whole: recomputed once, no weight part
            rows[sched, rc, "layer"] = P.evaluate(cfg, layout, P.Policy(recompute=rc), hw, cal, schedule=sched, **kw)
    for sched, total in (("DualPipeV", 2 * pp + 1), ("ZBVZeroBubble", 2 * pp)):
        r = rows[sched, "full"]
        assert r["schedule"] == sched and r["stages"] == [[0, 1], [1, 2], [2, 3], [3, 4]]
        states = PS.inflight_states(sched, pp, m)
        assert [max(sum(c) for c in st) for st in states] == [total] * pp  # every rank, not only the first
        want = 0.0
        for rank in range(pp):
            stages = PS.rank_stages(sched, pp, rank)
            held = [P.held_per_microbatch(cfg, range(s, s + 1), T, first=s == 0, last=s == 2 * pp - 1) for s in stages]
            ws = max(cal.working_set(cfg, range(s, s + 1), T, "full") for s in stages)
            want = max(want, max(c[0] * held[0] + c[1] * held[1] for c in states[rank]) + ws)
        assert r["memory"]["activations"] == pytest.approx(want, rel=1e-12)
        assert sum(r["inflight"]) == total or r["worst_rank"] == 0  # rank 0's peak may keep fewer on its head stage
        # recomputation twice in a split backward: ZBVZeroBubble splits every backward, so its extra compute over
        # its stages is twice 1F1B's over the same layers; DualPipeV runs most backwards whole (once), stage by
        # stage as torch's action list says (1 + I / m passes)
        extra = {
            x: [
                a - b for a, b in zip(*(rows[x, rc]["time"]["stage_compute_per_microbatch"] for rc in ("full", "none")))
            ]
            for x in ("1F1B", "DualPipeV", "ZBVZeroBubble")
        }
        assert sum(extra["1F1B"]) > 0 and sum(extra["ZBVZeroBubble"]) == pytest.approx(2 * sum(extra["1F1B"]), rel=1e-9)
        n_split = [
            sum(kind == "I" and st == s for ops in PS._actions(sched, pp, m) for st, kind, _ in ops) for s in range(4)
        ]
        passes = [1 + n / m for n in n_split]
        assert passes == list(PS.stage_recompute_passes(sched, pp, m))
        assert (min(passes), max(passes)) == ((2.0, 2.0) if sched == "ZBVZeroBubble" else (1.125, 1.25)), passes
        for s in range(4):
            assert extra[sched][s] == pytest.approx(passes[s] / 2 * extra["ZBVZeroBubble"][s], rel=1e-9)
        # bubble: (pp - 1) x the forward of one V stage (a third of the model FLOPs' time), W = I = B / 2
        none = rows[sched, "none"]
        comp = none["time"]["stage_compute_per_microbatch"]
        slowest = max(range(pp), key=lambda k: sum(comp[s] for s in PS.rank_stages(sched, pp, k)))
        F_v = sum(comp[s] for s in PS.rank_stages(sched, pp, slowest)) / 3 / 2
        assert none["time"]["bubble"] == pytest.approx((pp - 1) * F_v, rel=1e-5)
        full = rows[sched, "full"]
        comp = full["time"]["stage_compute_per_microbatch"]
        t = sum(comp[s] for s in PS.rank_stages(sched, pp, slowest)) / 2
        F_v = sum(none["time"]["stage_compute_per_microbatch"][s] for s in PS.rank_stages(sched, pp, slowest)) / 6
        want = PS.replay_bubble(sched, pp, F_v, (t - F_v) / 2, (t - F_v) / 2)
        assert full["time"]["bubble"] == pytest.approx(want, rel=1e-5)
        # per layer: every backward whole, so the recomputation is 1F1B's and the replay's weight part is zero
        lay = {rc: rows[sched, rc, "layer"] for rc in ("none", "full")}
        assert lay["full"]["policy"]["fsdp"] == "layer"
        extra_layer = [
            a - b for a, b in zip(*(lay[rc]["time"]["stage_compute_per_microbatch"] for rc in ("full", "none")))
        ]
        assert sum(extra_layer) == pytest.approx(sum(extra["1F1B"]), rel=1e-9)
        comp = lay["full"]["time"]["stage_compute_per_microbatch"]
        slowest = max(range(pp), key=lambda k: sum(comp[s] for s in PS.rank_stages(sched, pp, k)))
        t = sum(comp[s] for s in PS.rank_stages(sched, pp, slowest)) / 2
        F_v = (
            sum(lay["none"]["time"]["stage_compute_per_microbatch"][s] for s in PS.rank_stages(sched, pp, slowest)) / 6
        )
        want = PS.replay_bubble(sched, pp, F_v, t - F_v, 0.0)
        assert lay["full"]["time"]["bubble"] == pytest.approx(want, rel=1e-5)
    one = rows["1F1B", "none"]
    assert one["time"]["bubble"] == pytest.approx((pp - 1) * max(one["time"]["stage_compute_per_microbatch"]), rel=1e-6)
    one = rows["1F1B", "full"]
    assert one["inflight"] == [pp - one["worst_rank"]]  # 1F1B: pp - r on rank r


def test_too_few_microbatches_never_get_a_v_schedule(capsys):
    """A pp layout with fewer than 2 pp micro-batches per pipeline (but at least pp) runs 1F1B only: ``evaluate``
    refuses a V there in one line, ``plan`` never gives one; with 2 pp the V schedules are searched."""
    from kimi_tools.plan.search import schedule_refusal

    cfg = load_config("tiny-linear").truncated(4)
    cal = P.load_calibration()
    L = P.Layout(2, 1, 1, 1)
    for sched in ("DualPipeV", "ZBVZeroBubble"):
        assert "3 micro-batch(es) per pipeline, fewer than the 4 stages" in schedule_refusal(cfg, L, 64, 3 * 64, sched)
        with pytest.raises(ValueError, match=f"schedule: got {sched} with 3 micro-batch"):
            P.evaluate(cfg, L, P.Policy(), P.Hardware(), cal, seq_len=64, global_batch=3 * 64, schedule=sched)
        assert schedule_refusal(cfg, L, 64, 4 * 64, sched) is None
    args = ["--preset", "tiny-linear", "--layers", "4", "--gpus", "4", "--seq-len", "64", "--gpu-memory", "1"]
    for m in (2, 3, 4):  # micro-batches per pipeline at pp 2 x dp 2
        rows = _plan_json(capsys, *args, "--reserve", "0", "--global-batch", str(m * 2 * 64))["layouts"]
        assert any(r["layout"]["pp"] == 2 and r["microbatches"] == m for r in rows)
        assert all(r["schedule"] == "1F1B" for r in rows if r["layout"]["pp"] > 1 and r["microbatches"] < 4), rows
    for sched in ("DualPipeV", "ZBVZeroBubble"):  # searched where they run
        kw = dict(seq_len=64, global_batch=4 * 2 * 64, schedules=(sched,))
        rows = P.plan(cfg, 4, P.Hardware(gpu_memory_gb=1, reserve_gb=0), **kw)
        assert {r["schedule"] for r in rows if r["layout"]["pp"] == 2} == {sched}
        assert {r["schedule"] for r in rows if r["layout"]["pp"] == 1} == {None}
