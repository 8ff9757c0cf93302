"""``kimi plan``'s command line: :func:`add_parser`, :func:`run_plan` (the rows and notes of the arguments) and
:func:`cmd_plan`."""

from __future__ import annotations

import argparse
import json

from kimi.config import PRESETS, load_config
from kimi_tools.plan.layout import GB, OPTIMIZERS, Hardware, Layout
from kimi_tools.plan.render import render_markdown, train_command
from kimi_tools.plan.search import plan


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``kimi plan`` on the ``kimi`` subcommand parser."""
    from kimi_tools.common import positive_int

    p = subparsers.add_parser("plan", help="parallel layouts that fit a cluster: memory, communication, step time, MFU")
    p.add_argument("--preset", choices=sorted(PRESETS), default="k3.1-pro")
    p.add_argument("--layers", type=positive_int, help="keep the first N layers (as kimi train --layers)")
    p.add_argument("--gpus", type=positive_int, required=True, help="world size")
    p.add_argument("--gpu-memory", type=float, default=141.0, metavar="GB", help="HBM per GPU in GB (default 141)")
    p.add_argument("--reserve", type=float, default=5.0, metavar="GB", help="HBM kept free per GPU (default 5 GB)")
    p.add_argument(
        "--host-memory",
        type=float,
        default=250.0,
        metavar="GB",
        help="host memory per GPU in GB, for offloaded states (default 250: 2 TB per 8-GPU node)",
    )
    p.add_argument("--nodes", type=positive_int, help="nodes (GPUs per node = gpus / nodes; default 8 per node)")
    p.add_argument("--seq-len", type=positive_int, default=8192, help="tokens per sequence (default 8192)")
    p.add_argument(
        "--global-batch",
        type=positive_int,
        default=1 << 24,
        help="tokens per step (default 2^24; rounded down to whole sequences per data-parallel rank, as announced)",
    )
    p.add_argument("--lora-rank", type=positive_int, help="LoRA of the attention projections, frozen base in bf16")
    p.add_argument("--fp8", metavar="RECIPE", help="calibrate on the FP8 step of this recipe (rowwise)")
    p.add_argument(
        "--optimizer",
        choices=["auto", *OPTIMIZERS],
        default="auto",
        help="optimizer states; auto: fp32 AdamW, else bf16 states, else CPU offload, the first that fits",
    )
    p.add_argument(
        "--layout", metavar="PP,DP,CP,EP", help="evaluate this one layout only (pp x dp x cp = --gpus, ep | dp x cp)"
    )
    p.add_argument(
        "--overlap-a2a",
        action="store_true",
        help="the all-to-all overlapped as kimi train --ep-overlap runs it: chunks, and under DualPipeV also fb and "
        "fb+chunks (the faster counted)",
    )
    p.add_argument("--top", type=positive_int, default=8, help="rows shown (default 8)")
    p.add_argument("--json", action="store_true", help="print every layout as one JSON list")
    for name, default, help_ in [
        ("--nvlink-gbps", 360.0, "NVLink GB/s per GPU per direction, effective"),
        ("--ib-gbps", 40.0, "inter-node GB/s per GPU per direction, effective"),
        ("--peak-tflops", 989.4, "dense bf16 peak TFLOP/s (the MFU denominator)"),
    ]:
        p.add_argument(name, type=float, default=default, help=help_ + f" (default {default})")
    p.set_defaults(func=cmd_plan)
    return p


def _modes(optimizer: str) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    if optimizer == "auto":
        return [(("adamw-fp32",), ("none",)), (("adamw-bf16",), ("none",)), (("adamw-fp32", "adamw-bf16"), ("cpu",))]
    return [((optimizer,), ("none",)), ((optimizer,), ("cpu",))]


def run_plan(args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """The rows and the notes (which optimizer policies did not fit) of ``kimi plan``'s arguments."""
    from kimi_tools.common import CliError

    if args.gpu_memory <= 0:
        raise CliError(f"--gpu-memory: got {args.gpu_memory}, expected a positive number of GB")
    if not 0 <= args.reserve < args.gpu_memory:
        raise CliError(f"--reserve: got {args.reserve}, expected a number of GB in [0, --gpu-memory)")
    for flag in ("nvlink_gbps", "ib_gbps", "peak_tflops", "host_memory"):
        if getattr(args, flag) <= 0:
            raise CliError(f"--{flag.replace('_', '-')}: got {getattr(args, flag)}, expected a positive number")
    gpn = 8
    if args.nodes:
        if args.gpus % args.nodes:
            raise CliError(f"--nodes: got {args.nodes} for --gpus {args.gpus}, expected a divisor of the GPU count")
        gpn = args.gpus // args.nodes
    hw = Hardware(
        gpu_memory_gb=args.gpu_memory,
        reserve_gb=args.reserve,
        gpus_per_node=gpn,
        nvlink_gbps=args.nvlink_gbps,
        ib_gbps=args.ib_gbps,
        peak_tflops=args.peak_tflops,
        host_memory_gb=args.host_memory,
    )
    cfg = load_config(args.preset)
    layers = getattr(args, "layers", None)
    if layers:
        if layers > cfg.num_hidden_layers:
            raise CliError(f"--layers: got {layers}, expected at most the {cfg.num_hidden_layers} of {args.preset}")
        cfg = cfg.truncated(layers)
    only = None
    if args.layout:
        parts = args.layout.split(",")
        if len(parts) != 4 or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
            raise CliError(
                f"--layout: got {args.layout!r}, expected four positive integers PP,DP,CP,EP (e.g. 8,16,1,16)"
            )
        try:
            only = Layout(*(int(x) for x in parts))
        except ValueError as e:
            raise CliError(str(e).replace("layout:", "--layout:", 1)) from None
    notes = []
    ref = load_config("k3.1-pro").hidden_size
    if cfg.hidden_size != ref:
        notes.append(
            f"compute rates are k3.1-pro's measured ones (hidden {ref}); --preset {args.preset} (hidden "
            f"{cfg.hidden_size}) runs its far narrower matmuls far below them, so its step times, tokens/s and MFU "
            "are upper bounds, not predictions (its memory is counted from its own dimensions)"
        )
    rows: list[dict] = []
    dropped: list[tuple[str, str]] = []
    for opts, offs in _modes(args.optimizer):
        dropped.clear()
        rows = plan(
            cfg,
            args.gpus,
            hw,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            lora_rank=args.lora_rank,
            fp8=args.fp8,
            optimizers=opts,
            offloads=offs,
            overlap_a2a=args.overlap_a2a,
            only=only,
            dropped=dropped,
        )
        if not rows:
            raise CliError(f"--gpus {args.gpus}: no layout that kimi train runs ({_left_out(dropped)})")
        if rows and rows[0]["fits"]:
            break
        least = min((r["memory"]["total"] for r in rows), default=float("nan"))
        host = min((r["host_memory"] for r in rows), default=0.0)
        notes.append(
            f"{'/'.join(opts)} with offload {'/'.join(offs)}: nothing fits {args.gpus} GPUs of {args.gpu_memory:g} GB "
            f"(least memory per rank {least / GB:,.0f} GB"
            + (f"; host memory per GPU {host / GB:,.0f} GB, {hw.host_memory_gb:g} GB available)" if host else ")")
        )
    short = sorted(
        {(r["layout"]["dp"], r["global_batch_tokens"]) for r in rows if r["global_batch_tokens"] != args.global_batch}
    )
    if short:
        runs = ", ".join(f"dp {dp}: {t:,}" for dp, t in short)
        notes.append(
            f"--global-batch {args.global_batch:,} is not a whole number of --seq-len {args.seq_len:,} sequences per "
            f"data-parallel rank for every layout: rounded down to whole micro-batches, those run fewer tokens per "
            f"step ({runs}); their rates are for those steps"
        )
    if dropped:
        notes.append(f"left out, as kimi train does not run them: {_left_out(dropped)}")
    for r in rows:
        argv = train_command(
            r,
            preset=args.preset,
            seq_len=args.seq_len,
            layers=layers,
            lora_rank=args.lora_rank,
            fp8=args.fp8,
            gpus_per_node=gpn,
        )
        r["command"] = " ".join(argv)
    return rows, notes


def _left_out(dropped: list[tuple[str, str]]) -> str:
    """``plan``'s ``dropped`` grouped by reason: "pp2, pp4: reason; ..." (at most 4 layouts named per reason)."""
    by: dict[str, list[str]] = {}
    for name, why in dropped:
        by.setdefault(why, []).append(name)
    return "; ".join(
        ", ".join(n[:4]) + (f" and {len(n) - 4} more" if len(n) > 4 else "") + f": {why}" for why, n in by.items()
    )


def cmd_plan(args: argparse.Namespace) -> int:
    """``kimi plan``: print the layouts (a markdown table, or ``--json``). Returns 0."""
    rows, notes = run_plan(args)
    if args.json:
        print(json.dumps({"notes": notes, "layouts": rows}))
        return 0
    for n in notes:
        print(n)
    print(render_markdown(rows, args.top))
    return 0
