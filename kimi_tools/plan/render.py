"""What ``kimi plan`` prints: the markdown table of rows and each row's ``kimi train`` command."""

from __future__ import annotations

from kimi_tools.plan.layout import GB
from kimi_tools.plan.search import divisors


def _gb(x: float) -> str:
    return f"{x / GB:,.1f}"


def _row(r: dict) -> str:
    L, p, mem, c, t = r["layout"], r["policy"], r["memory"], r["comm"], r["time"]
    opt = p["optimizer"] + ("+cpu" if p["offload"] == "cpu" else "")
    rc = p["recompute"] + (f", offload {p['act_offload']}" if p.get("act_offload", "none") != "none" else "")
    return (
        f"| {L['pp']} | {r.get('schedule') or '-'} | {L['dp']} | {L['cp']} | {L['ep']} | {L['efsdp']} | {opt} | {rc} "
        f"| {p['fsdp']} "
        f"| {r['microbatches']} | {_gb(mem['params'])} | {_gb(mem['grads'])} | {_gb(mem['optimizer'])} "
        f"| {_gb(mem['gathered'])} | {_gb(mem['activations'])} | **{_gb(mem['total'])}** "
        f"| {_gb(c['all_gather'])} | {_gb(c['reduce_scatter'])} | {_gb(c['all_to_all'])} | {_gb(c['pipeline'])} "
        f"| {t['step']:.2f} | {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.0f} | **{r['mfu']:.1%}** |"
    )


HEADER = (
    "| pp | schedule | dp | cp | ep | efsdp | optimizer | recompute, act. offload | fsdp | micro-batches | params GB | grads GB | optimizer GB "
    "| gathered GB | activations GB | total GB | all-gather GB | reduce-scatter GB | all-to-all GB | pipeline GB "
    "| step s | tokens/s/GPU | TFLOP/s/GPU | MFU |\n"
    "|---:|---|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def render_markdown(rows: list[dict], top: int = 5) -> str:
    """A markdown table of the first ``top`` fitting rows (or, when none fits, of the ``top`` smallest), memory per
    rank (worst stage) and communication per step per rank in GB, then each shown row's ``kimi train`` command
    (its ``command``, when :func:`run_plan` added one)."""
    fit = [r for r in rows if r["fits"]]
    shown = (fit or rows)[:top]
    lines = [HEADER] + [_row(r) for r in shown]
    if not fit:
        lines.insert(0, f"Nothing fits; the {len(shown)} layouts with the least memory per rank:\n")
    cmds = [(r, r["command"]) for r in shown if r.get("command")]
    if cmds:
        lines += ["", COMMANDS_NOTE, ""]
        lines += [f"* {_layout_name(r)}: `{c}`" for r, c in cmds]
    return "\n".join(lines)


COMMANDS_NOTE = (
    "The `kimi train` command of each row (the same on every node; DATA and OUT to fill in, HOST the first node's "
    "address; `--preset` trains a random init, `--checkpoint DIR` instead fine-tunes a checkpoint):"
)


def _layout_name(r: dict) -> str:
    L = r["layout"]
    return f"pp{L['pp']} dp{L['dp']} cp{L['cp']} ep{L['ep']}"


def train_command(
    row: dict,
    *,
    preset: str,
    seq_len: int,
    layers: int | None = None,
    lora_rank: int | None = None,
    fp8: str | None = None,
    gpus_per_node: int = 8,
) -> list[str]:
    """The ``torchrun ... -m kimi_tools.cli train ...`` command (argv) that runs ``row`` (an :func:`evaluate`
    result): ``torchrun --standalone`` on one node, else ``--nnodes N`` with a c10d rendezvous at ``HOST:29500``
    (``N`` the fewest nodes of at most ``gpus_per_node`` ranks that divide the world); the layout (``--pp``, with
    the row's ``--pp-schedule``, its ``--pp-layout``: the layers of each of its stages, ``pp`` for 1F1B, ``2 pp``
    for DualPipeV and ZBVZeroBubble, as ``kimi train`` checks them, and its ``--pp-fsdp``, ``layer`` or ``stage``,
    spelled out though ``layer`` is the default); ``--dp``, ``--cp``, ``--ep``); one ``--seq-len``
    sequence per micro-batch (``--micro-batch-tokens``) and the planned tokens per step (``--batch-tokens`` =
    ``dp x micro-batches x seq_len``); bf16 on the cudnn backend; the recomputation (``--recompute
    --recompute-mode attn|mlp|layer``), the activation offload (``--offload-activations``), a reshard policy other
    than the trainer's default (``--reshard-after-forward``); LoRA,
    FP8; the optimizer and offload policies where they differ from the trainer's defaults (``--optimizer
    adamw-bf16`` with ``--reduce-dtype bf16``, ``--offload cpu``); ``--ep-overlap chunks``, ``fb`` or ``fb+chunks`` where
    the row counted it (``--overlap-a2a``). ``DATA`` and ``OUT`` are placeholders."""
    L, p = row["layout"], row["policy"]
    world = L["world"]
    per_node = max(d for d in divisors(world) if d <= max(1, gpus_per_node))
    if per_node == world:
        cmd = ["torchrun", "--standalone", "--nproc-per-node", str(world)]
    else:
        cmd = ["torchrun", "--nnodes", str(world // per_node), "--nproc-per-node", str(per_node)]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "HOST:29500"]
    cmd += ["-m", "kimi_tools.cli", "train", "--preset", preset] + (["--layers", str(layers)] if layers else [])
    cmd += ["--data", "DATA", "--out", "OUT", "--device", "cuda", "--backend", "cudnn", "--dtype", "bfloat16"]
    tokens = row["global_batch_tokens"]
    cmd += ["--seq-len", str(seq_len), "--micro-batch-tokens", str(seq_len), "--batch-tokens", str(tokens)]
    if L["pp"] > 1:
        counts = ",".join(str(b - a) for a, b in row["stages"])
        cmd += ["--pp", str(L["pp"]), "--pp-schedule", row.get("schedule") or "1F1B", "--pp-layout", counts]
        cmd += ["--pp-fsdp", p["fsdp"]]
    cmd += ["--dp", str(L["dp"]), "--cp", str(L["cp"]), "--ep", str(L["ep"])]
    if p["recompute"] != "none":
        cmd += ["--recompute", "--recompute-mode", {"full": "layer"}.get(p["recompute"], p["recompute"])]
    if p.get("act_offload", "none") != "none":
        cmd += ["--offload-activations", p["act_offload"]]
    if p.get("reshard", "auto") != "auto":
        cmd += ["--reshard-after-forward", p["reshard"]]
    if lora_rank:
        cmd += ["--lora-rank", str(lora_rank)]
    if fp8:
        cmd += ["--fp8", fp8]
    if p["optimizer"] != "adamw-fp32":
        cmd += ["--optimizer", p["optimizer"], "--reduce-dtype", "bf16"]
    if p["offload"] != "none":
        cmd += ["--offload", p["offload"]]
    if row.get("ep_overlap", "none") != "none":
        cmd += ["--ep-overlap", row["ep_overlap"]]
    return cmd
