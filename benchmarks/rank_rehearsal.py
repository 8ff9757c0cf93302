"""One rank of a planned cluster at real dimensions: materialise what the worst pipeline rank of a ``kimi plan`` layout
holds and run its stage's forward and backward, against the planner's memory and time (``docs/scaling.md`` section 7).

For each run (``--runs full lora``): full fine-tuning on the smallest cluster of ``--clusters`` where ``kimi plan``
finds a layout that fits, LoRA (rank ``--lora-rank``) on ``--lora-gpus``. Among the fitting layouts the best one
whose ranks hold at least ``num_experts_per_token`` experts (``E / ep >= k``, needed for the local routing below).
The rank holds:

* its stage's layers at the model's real dimensions, in bf16 (the fp32 ones as stored; layers of one kind share
  one set of weights, as FSDP2 holds only a couple of layers unsharded at a time), with the MoE layers cut to
  the rank's ``E / ep`` experts: the router then chooses among the local experts only, so every local expert receives
  ``T k ep / E`` rows on average, the count the all-to-all would deliver (the all-to-all itself is replaced by this
  local routing; the per-expert counts follow the random router, balanced in expectation);
* its FSDP2 shards as flat buffers of the planner's sizes (parameters, gradients and optimizer states; those byte
  counts are the meta model's, ``tests/test_plan.py``);
* the activations of the micro-batches in flight on that stage under 1F1B (``min(pp - s, m)`` forwards before the
  first backward), with the planner's recomputation mode applied as the trainer applies it
  (``kernels_torch.parallel.parallelize.parallelize``, its activation memory step; the FSDP2 shards stand as
  flat buffers of the planner's sizes).

The stage is the trainer's pipeline stage module (``kernels_torch.parallel.pipeline.split_stage``): the first stage
takes token ids, a later one a random received state ``[M, 1, T, D]`` (the AttnRes blocks so far and the partial
sum); a stage before the last returns the state it sends, kept until its backward as the schedule keeps it, and
gets a random gradient of it; the last stage ends with the output mix, the final norm, ``lm_head`` and the summed
NLL. The prediction compared is

    sharded states (planner) + the materialised weights and their gradients (counted) + activations (planner)

and the compute time of one micro-batch against the planner's for that stage. Writes one JSON (``--out``): the
layout, the prediction and the measurement (peak memory on CUDA; ``null`` on CPU), their ratio, the predicted
cluster tokens/s per GPU and MFU.

    python benchmarks/rank_rehearsal.py --seq-len 8192 --out benchmarks/results/rank_rehearsal.json
    python benchmarks/rank_rehearsal.py --preset tiny --device cpu --clusters 4 --lora-gpus 4 --gpu-memory 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

if str(Path(__file__).resolve().parent.parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels_torch.model import KimiK3Model, cast_model  # noqa: E402
from kimi.config import load_config  # noqa: E402
from kimi_tools import plan as P  # noqa: E402


def choose(preset: str, gpus: int, seq_len: int, lora_rank: int | None, gpu_memory: float) -> dict | None:
    """The best fitting layout of ``kimi plan`` on ``gpus`` GPUs whose ranks hold >= top-k experts, or None."""
    args = P._args(gpus, lora_rank, seq_len=seq_len, preset=preset, gpu_memory=gpu_memory, reserve=0.05 * gpu_memory)
    rows, _ = P.run_plan(args)
    cfg = load_config(preset)
    for r in rows:
        if r["fits"] and cfg.num_experts // r["layout"]["ep"] >= cfg.num_experts_per_token:
            return r
    return None


def _materialise(model: nn.Module, device: str) -> None:
    """``to_empty`` that keeps shared parameters shared (``Module.to_empty`` gives each module its own copy)."""
    made: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                m._parameters[k] = made[id(p)]
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = torch.empty_like(b, device=device)


def build_stage(cfg, row: dict, device: str, lora_rank: int | None) -> nn.Module:
    """The worst stage of ``row``'s pipeline as the trainer runs it (``kernels_torch.parallel.pipeline.
    PipelineStageModule``: the embedding on the first stage; the output AttnRes mix, final norm, ``lm_head`` and
    loss on the last; a stage before the last returns the state it sends), with ``E / ep`` experts per MoE layer,
    random weights in bf16 (fp32 where the checkpoint keeps fp32) on ``device``."""
    from kernels_torch.parallel.pipeline import split_stage

    ep = row["layout"]["ep"]
    local = cfg.replace(num_experts=cfg.num_experts // ep)
    with torch.device("meta"):  # the whole model on meta (no memory); only the stage is materialised
        model = cast_model(KimiK3Model(local, backend="cudnn" if device == "cuda" else "eager"), torch.bfloat16)
    layout = [range(a, b) for a, b in row["stages"]]
    lo, hi = row["stages"][row["worst_stage"]]
    # Layers of one kind (attention kind, dense or MoE MLP) share one set of weights, so the rank holds a few
    # layers' unsharded weights, as FSDP2 does (two at a time), while every layer keeps its own activations.
    reps: dict[tuple[str, bool], nn.Module] = {}
    for i in range(lo, hi):
        layer = model.model.layers[i]
        rep = reps.setdefault((local.layer_type(i), local.is_moe_layer(i)), layer)
        if rep is not layer:
            for name, p in rep.named_parameters():
                owner, _, leaf = name.rpartition(".")
                setattr(layer.get_submodule(owner) if owner else layer, leaf, p)
    if lora_rank:
        from kimi_tools.lora import LoraSettings, apply_lora

        apply_lora(model, LoraSettings(rank=lora_rank, alpha=2.0 * lora_rank))
    stage = split_stage(model, layout, row["worst_stage"])
    _materialise(stage, device)
    with torch.no_grad():  # as benchmarks/train_step_4layers.py (the values do not matter, only their ranges)
        for name, p in stage.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(0.0, 2.0)
            elif name.endswith("lora_B.weight"):
                p.normal_(0.0, 1e-3)
            elif p.ndim >= 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
            elif name.endswith(("dt_bias", "e_score_correction_bias", "k_norm.bias")):
                p.normal_(0.0, 0.01)
            else:
                p.fill_(1.0)
    return stage


def rehearse(preset: str, row: dict, device: str, lora_rank: int | None, seed: int = 0) -> dict:
    """Materialise the rank of ``row`` (a ``kimi plan`` layout) on ``device``, run its in-flight micro-batches'
    forwards and backwards, and return the prediction beside the measurement (bytes, seconds)."""
    from kernels_torch.parallel.parallelize import ParallelPolicy, parallelize
    from kernels_torch.parallel.pipeline import sources_after

    torch.manual_seed(seed)
    cfg = load_config(preset)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    mem = row["memory"]
    # the FSDP2 shards of the rank: parameters, gradients and optimizer states, as flat buffers of the planner's bytes
    states = [torch.empty(int(mem[k]), dtype=torch.uint8, device=device) for k in ("params", "grads", "optimizer")]
    stage = build_stage(cfg, row, device, lora_rank)
    rc = row["policy"]["recompute"]
    if rc != "none":  # the trainer's activation memory step (kernels_torch.parallel.parallelize, one process)
        mode, full = ("layer", 0) if rc == "full" else ("mlp", 1)
        parallelize(stage, None, ParallelPolicy(recompute=mode, recompute_full_layers=full))
    weights = sum(p.numel() * p.element_size() for p in stage.parameters())
    grads = sum(p.numel() * p.element_size() for p in stage.parameters() if p.requires_grad)
    T, D = row["tokens_per_microbatch_per_rank"], cfg.hidden_size
    s = row["worst_stage"]
    inflight = min(row["layout"]["pp"] - s, row["microbatches"])

    def forward():
        """One micro-batch through the stage: ids on the first stage, else a received state ``[M, 1, T, D]``;
        the summed NLL on the last stage, else the state it sends (kept until its backward, as the schedule
        keeps it)."""
        if stage.is_first:
            x = torch.randint(0, cfg.vocab_size, (1, T), device=device)
        else:
            x = torch.randn(sources_after(cfg, stage.start), 1, T, D, dtype=torch.bfloat16, device=device)
            x.requires_grad_(True)
        labels = torch.randint(0, cfg.vocab_size, (1, T), device=device) if stage.is_last else None
        return stage(x, labels=labels)

    def backward(out):
        """The loss's gradient on the last stage, else a received gradient of the sent state."""
        if stage.is_last:
            (out / T).backward()
        else:
            out.backward(torch.randn_like(out))

    def sync():
        if cuda:
            torch.cuda.synchronize()

    outs = [forward() for _ in range(inflight)]  # 1F1B warm-up: the in-flight forwards
    for out in outs:
        backward(out)
    del outs
    sync()
    t0 = time.perf_counter()  # one more micro-batch, timed alone (the steady state's forward + backward)
    backward(forward())
    sync()
    ms = (time.perf_counter() - t0) * 1e3
    peak = torch.cuda.max_memory_allocated() if cuda else None
    predicted = mem["params"] + mem["grads"] + mem["optimizer"] + weights + grads + mem["activations"]
    del states
    return {
        "layout": row["layout"],
        "policy": row["policy"],
        "stage": s,
        "stage_layers": row["stages"][s],
        "tokens_per_microbatch": T,
        "microbatches_in_flight": inflight,
        "experts_per_rank": cfg.num_experts // row["layout"]["ep"],
        "rows_per_expert": row["rows_per_expert"],
        "predicted": {
            "sharded_states": mem["params"] + mem["grads"] + mem["optimizer"],
            "stage_weights_and_grads": weights + grads,
            "activations": mem["activations"],
            "total": predicted,
            "planner_total": mem["total"],
            "compute_ms_per_microbatch": row["time"]["stage_compute_per_microbatch"][s] * 1e3,
        },
        "measured": {"peak_bytes": peak, "ms_per_microbatch": ms},
        "peak_over_predicted": peak / predicted if peak else None,
        "cluster": {
            "gpus": row["layout"]["world"],
            "tokens_per_s_per_gpu": row["tokens_per_s_per_gpu"],
            "tflops_per_gpu": row["tflops_per_gpu"],
            "mfu": row["mfu"],
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3.1-pro")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--runs", nargs="+", choices=["full", "lora"], default=["full", "lora"])
    ap.add_argument("--clusters", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--lora-gpus", type=int, default=64)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--gpu-memory", type=float, default=141.0, help="GB per GPU")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--plan-only", action="store_true", help="print the chosen layouts, materialise nothing")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "date": time.strftime("%F")}
    report["runs"] = {}
    for run in args.runs:
        lora = args.lora_rank if run == "lora" else None
        row = None
        for gpus in [args.lora_gpus] if lora else args.clusters:
            row = choose(args.preset, gpus, args.seq_len, lora, args.gpu_memory)
            if row is not None:
                break
        if row is None:
            report["runs"][run] = {"status": "no layout fits"}
            print(f"{run}: no layout fits", flush=True)
            continue
        L = row["layout"]
        print(f"{run}: {L['world']} GPUs, pp{L['pp']} dp{L['dp']} cp{L['cp']} ep{L['ep']}, {row['policy']}", flush=True)
        if args.plan_only:
            report["runs"][run] = {"status": "planned", "row": row}
            continue
        try:
            res = rehearse(args.preset, row, args.device, lora)
            res["status"] = "ok"
        except torch.OutOfMemoryError:
            res = {"status": "oom", "peak_bytes": torch.cuda.max_memory_allocated()}
        report["runs"][run] = res
        print(json.dumps(res), flush=True)
    if args.out:
        from kimi.checkpoint import write_atomic

        write_atomic(args.out, json.dumps(report, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
