"""Benchmark 5: a training step (forward + backward) of the first four real-dimension K3.1 layers, `cudnn` vs `sdpa`.

The model is `k3.1-pro` truncated to 4 layers (KDA, KDA, KDA, DSA: the real first four), with the routed experts
shrunk so the MoE fits (``--experts``, default 16 of which 8 are active per token; every other dimension is real),
random weights drawn directly on the GPU (the numbers do not depend on the values), bf16 parameters with the
fp32 ones kept fp32 as in the checkpoint. Loss (``--loss``, recorded in every row): ``chunked`` (default) is the
model's own ``loss(ids, labels)``, the summed NLL of random targets by ``kernels_torch.loss.linear_cross_entropy``
(``--loss-chunk-size`` rows at a time, default 1 GiB of fp32 logits per chunk: the [T, 163840] logits never exist),
divided by T; ``full`` is the old path, ``F.cross_entropy`` of the whole bf16 logits (PyTorch's log-softmax
accumulates in fp32). One step = forward + backward of that loss; timed with CUDA events after two warm-up steps,
median of ``--repeats``.

Rows in ``--recompute-seq-lens`` wrap every decoder layer in ``torch.utils.checkpoint`` (non-reentrant; with
``--recompute-mode mlp`` only each layer's MLP / MoE block, with ``attn`` only its attention block, and the row's
``recompute`` is the mode): its
activations are recomputed in the backward (``--recompute-full-layers N``: the first N layers whole, the others' MLP;
several values are tried in order, and the row's ``recompute_full_layers`` is the first that fits), which is what
lets 32K tokens fit (the eager MLP/MoE keep fp32 SiTU
intermediates: about 1.3 MB per token in the dense layer 0 alone); rows in ``--seq-lens`` run without it (32K
there is the row that asks whether the chunked loss lets a whole 32K step fit). Each row is written to ``--out`` as
it finishes.
``--offload-activations all|attn|mlp`` keeps, in every row, what each layer (or block) saves for the backward in
pinned host memory (``kernels_torch.activation_memory.offload_activations``, kimi train's flag; the row's
``offload_activations``); ``benchmarks/offload_copy.py`` measures the copy rate alone.
The script sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the variable is already set.

    python benchmarks/train_step_4layers.py --seq-lens 2048 8192 32768 --recompute-seq-lens 8192 32768 \
        --loss chunked --repeats 3 --out results/train_step_4layers.json

Model FLOPs utilisation: ``kimi.flops.estimate_flops(cfg, T)`` (model FLOPs of the forward + backward, counted from the
config, no recomputation) over the step time and the bf16 matmul ceiling measured at the start of the same run
(8192^3). Every row records the GPU kernels that ran (``kernels``: sparse forward and KDA recurrence).

``--fp8 RECIPE`` (``tensorwise`` or ``rowwise``) converts each model with ``kernels_torch.fp8.convert_model_to_fp8``
right after it is built (torchao: the projections, shared experts and grouped experts in FP8; the row's ``fp8`` holds
the conversion record); MFU stays counted against the bf16 ceiling (comparable with the bf16 rows), and
``mfu_fp8_ceiling`` beside it is counted against the FP8 ``torch._scaled_mm`` ceiling of that recipe measured at the
start of the same run (``benchmarks/fp8_gemm.py``'s ``ceilings``, 8192^3). ``--fp8-compile`` compiles each FP8
projection on its own (``compile_linears``; the row's ``fp8.compiled``), the rest of the step staying eager; the
projections narrower than ``--fp8-min-dim`` stay bf16 (default as ``kimi train``'s: ``kernels_torch.fp8.min_dim_for``;
the row's ``fp8.min_dim`` and ``fp8.skipped``).

``--compile`` runs every row twice, eagerly and then with each decoder block compiled by inductor
(``kernels_torch.compile.compile_blocks``, ``fullgraph=True``, after the recompute and offload wrappers, as ``kimi
train --compile``; the row's ``compile``: null or ``"inductor"``); the compilation happens in the two warm-up steps
(``wall_s`` includes it), and the table ends with the compiled/eager speed-up of each backend.

``--parallel`` (under ``torchrun``, e.g. ``torchrun --nproc-per-node 1 benchmarks/train_step_4layers.py --parallel
...``) puts each model through ``kimi train``'s parallel path (``kimi_tools.train.parallel.TrainParallel.setup``, after the
FP8 conversion and before the recompute wrappers, as the trainer orders them): FSDP2 over the ranks (``--ep N``:
the routed experts split over groups of N ranks), bf16 compute through FSDP2's ``MixedPrecisionPolicy`` with fp32
sharded parameters (the trainer's masters: one rank holds 4 B per parameter where the plain row holds bf16's 2 B),
the checkpoint's fp32 tensors whole; every rank runs its own ``T`` tokens, rank 0 writes (the row's ``parallel``).
On one rank with ``--masters bf16`` FSDP2 would only copy, and the trainer leaves the model as it is
(``kernels_torch.parallel.parallelize.fsdp_only_copies``; ``--shard-one-rank`` applies FSDP2 anyway, to measure it).

Writes ``{"device", "torch", "date", "matmul_ceiling_tflops", "fp8_matmul_ceiling_tflops", "rows": [...]}``, rows
with ``seq_len``, ``backend``, ``fp8``, ``compile``, ``recompute``, ``loss``, ``loss_chunk_size`` (null for ``full``), ``ms``,
``recompute_full_layers``, ``offload_activations``, ``tokens_per_s``, ``peak_gib``, ``model_tflop``, ``mfu``, ``mfu_fp8_ceiling``, ``kernels``, ``status``, and prints a
table with the cudnn/sdpa speed-up. A backend that runs out of memory is reported as ``status: "oom"``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

# Before torch allocates: the sdpa backend at 32K fragments the default caching allocator (35 GiB reserved but
# unallocated when it ran out of memory on the H200); expandable segments let the same step fit.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import time_ms  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from kernels_torch import kernel_choice  # noqa: E402
from kernels_torch.activation_memory import offload_activations, recompute_layers  # noqa: E402
from kernels_torch.loss import default_chunk_size  # noqa: E402
from kernels_torch.model import KimiK3Model, cast_model  # noqa: E402
from kimi.config import load_config  # noqa: E402
from kimi.layout import param_layout  # noqa: E402
from kimi_tools.train.args import OFFLOAD_MODES, RECOMPUTE_MODES  # noqa: E402


def build(cfg, backend: str) -> KimiK3Model:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = KimiK3Model(cfg, backend=backend)
    model = model.to_empty(device="cuda")
    fp32 = {s.name for s in param_layout(cfg) if s.dtype == "float32"}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(0.0, math.log(16.0))
            elif name.endswith("norm.weight") or name.endswith("k_norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("dt_bias", "e_score_correction_bias", "k_norm.bias")):
                p.normal_(0.0, 0.01)
            elif p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
            else:
                p.normal_(0.0, 0.02)
    model = cast_model(model, torch.bfloat16)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n in fp32)
    return model


def step_time(model: KimiK3Model, T: int, repeats: int, loss_kind: str = "chunked", chunk_size=None) -> float:
    V = model.config.vocab_size
    ids = torch.randint(0, V, (1, T), device="cuda")
    target = torch.randint(0, V, (T,), device="cuda")

    def step():
        if loss_kind == "chunked":  # the summed NLL inside the forward, logits never materialised
            loss = model.loss(ids, target[None], chunk_size=chunk_size) / T
        else:  # the whole [T, vocab] bf16 logits, then their cross-entropy
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits[0], target)
        loss.backward()
        model.zero_grad(set_to_none=True)

    # two warm-ups (compilation, autotuning, allocator), then exactly `repeats` timed steps
    return time_ms(step, warmup=2, min_reps=repeats, max_reps=repeats)[0]


def _loss_step(model: KimiK3Model, T: int, loss_kind: str, chunk_size) -> None:
    """One forward + backward of random ids (the gradients are left in place)."""
    V = model.config.vocab_size
    ids = torch.randint(0, V, (1, T), device="cuda")
    target = torch.randint(0, V, (T,), device="cuda")
    if loss_kind == "chunked":
        (model.loss(ids, target[None], chunk_size=chunk_size) / T).backward()
    else:
        torch.nn.functional.cross_entropy(model(ids)[0], target).backward()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(model: KimiK3Model) -> dict[str, int]:
    """Bytes of the parameters this rank holds between steps, by dtype (local shards under FSDP2)."""
    out: dict[str, int] = {}
    for p in model.parameters():
        t = _local(p)
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def memory_by_kind(model: KimiK3Model, T: int, loss_kind: str, chunk_size, held: dict, sharded: bool) -> dict:
    """The row's memory by kind, GiB: ``parameters`` (the compute-dtype tensors held between steps: bf16 and the
    checkpoint's fp32 ones), ``masters`` (FSDP2's fp32 shards of the bf16-compute parameters; none in one process,
    where this step keeps no masters), ``gradients`` (held after the backward), ``optimizer`` (0: this benchmark
    steps no optimizer), ``peak`` (of one more step), and ``activations_and_buffers`` = peak - parameters - masters -
    gradients (saved activations, FSDP2's gathered copies and reduce buffers, the allocator's transients)."""
    gib = 2**30
    fp32_names = {s.name for s in param_layout(model.config) if s.dtype == "float32"}
    fp32_held = sum(
        _local(p).numel() * 4 for n, p in model.named_parameters() if p.dtype == torch.float32 and n in fp32_names
    )
    total = sum(held.values())
    masters = held.get("float32", 0) - fp32_held if sharded else 0
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _loss_step(model, T, loss_kind, chunk_size)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    grads = sum(
        _local(p.grad).numel() * _local(p.grad).element_size() for p in model.parameters() if p.grad is not None
    )
    model.zero_grad(set_to_none=True)
    params = total - masters
    return {
        "parameters": params / gib,
        "masters": masters / gib,
        "gradients": grads / gib,
        "optimizer": 0.0,
        "activations_and_buffers": (peak - total - grads) / gib,
        "peak": peak / gib,
    }


def allocator_counts(before: dict, after: dict) -> dict:
    """The caching allocator's events over the timed steps (warm-ups included): ``retries`` (a failed cudaMalloc
    freed the cache and synchronised; ``num_alloc_retries``), ``cuda_malloc`` / ``cuda_free`` (device calls), ``ooms``."""
    keys = {"retries": "num_alloc_retries", "cuda_malloc": "num_device_alloc", "cuda_free": "num_device_free",
            "ooms": "num_ooms"}  # fmt: skip
    return {k: after.get(v, 0) - before.get(v, 0) for k, v in keys.items()}


def planner_prediction(
    cfg,
    T: int,
    recompute,
    compare: bool,
    optimizer: str = "adamw-fp32",
    reshard: str = "auto",
    fsdp: str = "auto",
    act_offload: str = "none",
) -> dict | None:
    """``kimi plan``'s prediction for this row's one-rank layout (pp1 dp1 cp1 ep1, one micro-batch of ``T``): its
    memory by kind (bytes -> GiB) and step time; ``compare_gib``: its total less the optimizer states, which this
    benchmark does not allocate. ``optimizer``: the planner's policy the row runs (``--masters bf16``: ``adamw-bf16``,
    bf16 weights and gradients); ``reshard``: the row's ``--reshard-after-forward`` (the planner's ``Policy.reshard``,
    which moves the gathered units at the peak); ``fsdp``: the planner's FSDP policy ("auto": the trainer's for the
    layout; "layer" for a ``--shard-one-rank`` row, FSDP2 forced); ``act_offload``: the row's
    ``--offload-activations`` (the planner's ``Policy.act_offload``: ``activations`` is then what stays on the GPU,
    ``host_activations_gib`` what goes to the host, ``offload_copy_s`` the copies' time per step). ``compare``: a
    ``--parallel`` row (the one-process row holds no masters whatever the optimizer); an error is recorded in place of
    the prediction."""
    try:
        from kimi_tools import plan as P

        mode = {False: "none", "mlp": "mlp", "attn": "attn", "layer": "full"}[recompute]
        hw = P.Hardware(gpu_memory_gb=torch.cuda.get_device_properties(0).total_memory / 1e9)
        policy = P.Policy(optimizer=optimizer, recompute=mode, reshard=reshard, fsdp=fsdp, act_offload=act_offload)
        r = P.evaluate(cfg, P.Layout(1, 1, 1, 1), policy, hw, P.load_calibration(), seq_len=T, global_batch=T)
    except Exception as e:  # noqa: BLE001 - the prediction is a record, not the measurement
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    mem = {k: v / 2**30 for k, v in r["memory"].items() if isinstance(v, (int, float))}
    out = {"memory_gib": mem, "step_s": r["time"].get("step"), "policy": r["policy"]}
    out |= {
        "host_activations_gib": r["host_activations"] / 2**30,
        "offload_copy_s": r["time"]["offload_copy_per_microbatch"],
    }
    if compare:
        out["compare_gib"] = mem.get("total", 0.0) - mem.get("optimizer", 0.0)
    return out


def planned_masters(cfg, T: int) -> str:
    """The masters of the optimizer ``kimi plan`` picks for this row's one-GPU layout (pp1 dp1 cp1 ep1, one
    micro-batch of ``T`` tokens, the card's memory): ``"fp32"`` when fp32 AdamW fits, else ``"bf16"`` (its
    adamw-bf16, the order of ``kimi plan --optimizer auto``)."""
    from kimi_tools import plan as P

    hw = P.Hardware(gpu_memory_gb=torch.cuda.get_device_properties(0).total_memory / 1e9)
    r = P.evaluate(cfg, P.Layout(1, 1, 1, 1), P.Policy(optimizer="adamw-fp32"), hw, P.load_calibration(), seq_len=T,
                   global_batch=T)  # fmt: skip
    return "fp32" if r["fits"] else "bf16"


def profile_step(model: KimiK3Model, T: int, loss_kind: str, chunk_size, out: Path, tag: str) -> Path:
    """One step under ``torch.profiler`` (CPU and CUDA); writes its op tables (by CUDA time, then by CPU self time)
    beside ``out`` and returns the path."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _loss_step(model, T, loss_kind, chunk_size)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    path = out.with_name(f"{out.stem}.profile.{tag}.txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "by CUDA time\n" + ka.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60)
        + "\nby CPU self time\n" + ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
    )  # fmt: skip
    return path


def matmul_ceiling() -> float:
    """bf16 8192^3 matmul TFLOP/s on this GPU, now."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms, _ = time_ms(lambda: a @ b, warmup=3, min_reps=10, max_reps=20)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def model_tflop(cfg, T: int):
    """Model FLOPs of one forward + backward step of T tokens in TFLOP (``kimi.flops.estimate_flops``), and its parts."""
    from kimi.flops import estimate_flops

    d = estimate_flops(cfg, T, backward=True)
    return d["flops_per_token"] * T / 1e12, d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--seq-lens", type=int, nargs="*", default=[2048, 8192, 32768], help="lengths run without recomputation"
    )
    ap.add_argument(
        "--recompute-seq-lens",
        type=int,
        nargs="*",
        default=[8192, 32768],
        help="lengths run with activation recomputation per decoder layer (--recompute-mode)",
    )
    ap.add_argument(
        "--recompute-mode",
        choices=list(RECOMPUTE_MODES),
        default="layer",
        help="what the recompute rows recompute: the whole layer, only its MLP / MoE block, or only its attention",
    )
    ap.add_argument(
        "--offload-activations",
        choices=list(OFFLOAD_MODES),
        default="none",
        help="every row: the saved activations of each layer (all), its attention or its MLP / MoE block kept in "
        "pinned host memory (kimi train's --offload-activations), around the recompute wrappers",
    )
    ap.add_argument(
        "--recompute-full-layers",
        type=int,
        nargs="+",
        default=[0],
        help="with --recompute-mode mlp or attn: the first N layers recomputed whole (kimi train's --recompute-full-layers); "
        "several values are tried in order per recompute row until one fits (the others' rows are kept)",
    )
    ap.add_argument("--backends", nargs="+", default=["cudnn", "sdpa"])
    ap.add_argument("--loss", choices=["chunked", "full"], default="chunked", help="chunked: no [T, vocab] logits")
    ap.add_argument("--loss-chunk-size", type=int, help="rows per loss chunk (default: 1 GiB of fp32 logits)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--experts-per-token", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fp8", choices=["tensorwise", "rowwise"], help="FP8 matmuls (kernels_torch.fp8) in every row")
    ap.add_argument(
        "--fp8-compile",
        action="store_true",
        help="with --fp8: compile each FP8 projection (convert_model_to_fp8's compile_linears; kimi train --fp8-compile)",
    )
    ap.add_argument(
        "--fp8-min-dim",
        type=int,
        help="with --fp8: projections narrower than N stay bf16 (default as kimi train: the measured width when "
        "compiled, else 0)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="run each row eagerly and then with every decoder block compiled (compile_blocks, inductor; kimi train "
        "--compile); the row's compile",
    )
    ap.add_argument(
        "--parallel",
        action="store_true",
        help="under torchrun: each model through kimi train's parallel path (FSDP2, bf16 compute, --masters)",
    )
    ap.add_argument("--ep", type=int, default=1, help="with --parallel: expert-parallel ranks (kimi train --ep)")
    ap.add_argument(
        "--reduce-dtype",
        default=None,
        choices=["fp32", "bf16"],
        help="with --parallel: kimi train --reduce-dtype (default: bf16 with bf16 masters, else fp32)",
    )
    ap.add_argument(
        "--reshard-after-forward",
        default="auto",
        choices=["auto", "always", "never"],
        help="with --parallel: kimi train --reshard-after-forward",
    )
    ap.add_argument(
        "--masters",
        default="fp32",
        choices=["fp32", "bf16", "planned"],
        help="with --parallel: the dtype of FSDP2's sharded trainable parameters (fp32: AdamW's fp32 masters, kimi "
        "train's default; bf16: the bf16 weights and gradients an optimizer with stochastic rounding steps, "
        "kimi plan's adamw-bf16; planned: the optimizer kimi plan picks for this one-GPU layout, fp32 AdamW if it "
        "fits the card at the first row's length, else adamw-bf16)",
    )
    ap.add_argument(
        "--shard-one-rank",
        action="store_true",
        help="with --parallel: FSDP2 even where one rank would only copy (ParallelPolicy.shard_one_rank: bf16 masters, "
        "no offload, one rank), to measure its cost; by default the trainer leaves such a model as it is",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after each row's timed steps, one more step under torch.profiler: its op table (CUDA and CPU time) is "
        "written beside --out as <out>.profile.<seq_len>_<backend>.txt",
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train_step_4layers.json")
    args = ap.parse_args()
    cfg = (
        load_config("k3.1-pro")
        .truncated(4)
        .replace(num_experts=args.experts, num_experts_per_token=args.experts_per_token)
    )
    if not args.seq_lens and not args.recompute_seq_lens:
        ap.error("--seq-lens, --recompute-seq-lens: both empty, expected at least one length")
    par = None
    if args.parallel:
        from kimi_tools.train.parallel import TrainParallel, under_torchrun

        if not under_torchrun():
            ap.error("--parallel: expected a launch under torchrun (torchrun --nproc-per-node N ...)")
        if args.masters == "planned":
            args.masters = planned_masters(cfg, (args.seq_lens or args.recompute_seq_lens)[0])
            print(f"--masters planned: {args.masters} (kimi plan's optimizer for pp1 dp1 cp1 ep1)", flush=True)
        if args.reduce_dtype is None:  # the gradients' own dtype: bf16 with bf16 masters
            args.reduce_dtype = "bf16" if args.masters == "bf16" else "fp32"
        par = TrainParallel(
            1, "cuda", ep=args.ep, reduce_dtype=args.reduce_dtype, reshard_after_forward=args.reshard_after_forward,
            bf16_masters=args.masters == "bf16", shard_one_rank=args.shard_one_rank,
        )  # fmt: skip
    elif (
        args.ep != 1
        or args.reduce_dtype
        or args.reshard_after_forward != "auto"
        or args.masters != "fp32"
        or args.shard_one_rank
    ):
        ap.error(
            "--ep, --reduce-dtype, --reshard-after-forward, --masters, --shard-one-rank: given without --parallel, "
            "expected --parallel"
        )
    writer = par is None or par.is_writer
    chunk = args.loss_chunk_size or default_chunk_size(cfg.vocab_size)
    plan = [(T, False) for T in args.seq_lens] + [(T, True) for T in args.recompute_seq_lens]
    ceiling = matmul_ceiling()
    print(f"bf16 matmul ceiling {ceiling:.1f} TFLOP/s", flush=True)
    fp8_ceiling = None
    if args.fp8:
        from fp8_gemm import ceilings  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

        fp8_ceiling = ceilings()[f"fp8_{args.fp8}"]
        print(f"fp8 {args.fp8} matmul ceiling {fp8_ceiling:.1f} TFLOP/s", flush=True)
    rows = []
    compiles = [None, "inductor"] if args.compile else [None]
    runs = [
        (T, rc, b, f, comp)
        for T, rc in plan
        for b in args.backends
        for comp in compiles
        for f in (args.recompute_full_layers if rc else [0])
    ]
    fitted: set[tuple] = set()  # recompute rows: the first full-layer count that fits ends the row
    for T, recompute, backend, full, comp in runs:
        if (T, recompute, backend, comp) in fitted:
            continue
        gc.collect()  # the previous row's model (recompute wrappers make reference cycles) and OOM tracebacks
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row = {
            "seq_len": T,
            "backend": backend,
            "recompute": recompute and args.recompute_mode,
            "recompute_full_layers": full if recompute else None,
            "offload_activations": args.offload_activations,
            "loss": args.loss,
            "loss_chunk_size": chunk if args.loss == "chunked" else None,
            "layers": [cfg.layer_type(i) for i in range(4)],
            "experts": args.experts,
            "experts_per_token": args.experts_per_token,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "fp8": args.fp8,
            "compile": comp,
            "parallel": None if par is None else f"torchrun, {par.dims.describe()}",  # its FSDP2 named after setup
            "fsdp_policy": None
            if par is None
            else {
                "reduce_dtype": args.reduce_dtype,
                "reshard_after_forward": args.reshard_after_forward,
                "masters": args.masters,
            },
        }
        t0 = time.perf_counter()
        model = None
        try:
            model = build(cfg, backend)
            if args.fp8:  # before the recompute wrappers, as kimi train would
                from kernels_torch.fp8 import convert_model_to_fp8, min_dim_for

                min_dim = min_dim_for(args.fp8, args.fp8_compile) if args.fp8_min_dim is None else args.fp8_min_dim
                rec = convert_model_to_fp8(model, args.fp8, compile_linears=args.fp8_compile, min_dim=min_dim)
                row["fp8"] = rec.to_dict()
            if par is not None:  # kimi train's order: convert, shard, then the recompute wrappers
                par.setup(model, lora=False)
                fsdp = "FSDP2 bf16" if par.sharded else "no FSDP2 (one rank: it would only copy), bf16"
                row["parallel"] = f"torchrun, {par.dims.describe()}, {fsdp} / {args.masters} masters"
                row["fsdp_policy"]["fsdp2"] = par.sharded
            if recompute:
                recompute_layers(model, args.recompute_mode, full)  # kimi train's --recompute-mode
            offload_activations(model, args.offload_activations)  # around the recompute wrappers, as kimi train
            if comp:  # last, as kimi train --compile: the blocks compiled inside their wrappers
                from torch import _dynamo

                from kernels_torch.compile import compile_blocks

                _dynamo.reset()  # the previous row's graphs
                compile_blocks(model, backend=comp)
            kernel_choice.reset_used()
            held = held_bytes(model)  # before the step: parameters (and FSDP2's fp32 masters)
            stats0 = torch.cuda.memory_stats()
            ms = step_time(model, T, args.repeats, args.loss, chunk)
            row["allocator"] = allocator_counts(stats0, torch.cuda.memory_stats())
            row.update(ms=ms, tokens_per_s=T / ms * 1e3, status="ok", kernels=kernel_choice.used())
            row["memory_gib"] = memory_by_kind(model, T, args.loss, chunk, held, par is not None and par.sharded)
            optimizer = "adamw-bf16" if args.masters == "bf16" else "adamw-fp32"
            row["planner"] = planner_prediction(
                cfg,
                T,
                recompute and args.recompute_mode,
                par is not None,
                optimizer,
                args.reshard_after_forward,
                "layer" if args.shard_one_rank else "auto",
                args.offload_activations,
            )
            if args.profile:
                tag = f"{T}_{backend}" + ("_compiled" if comp else "")
                row["profile"] = str(profile_step(model, T, args.loss, chunk, args.out, tag))
            fitted.add((T, recompute, backend, comp))
            tf, detail = model_tflop(cfg, T)
            row.update(model_tflop=tf, flops_detail=detail)
            row["mfu"] = tf / (ms * 1e-3) / ceiling if tf else None
            row["mfu_fp8_ceiling"] = tf / (ms * 1e-3) / fp8_ceiling if tf and fp8_ceiling else None
        except torch.OutOfMemoryError:
            row.update(ms=None, tokens_per_s=None, status="oom")
        except Exception as e:  # noqa: BLE001 - record the failure, keep benchmarking
            row.update(ms=None, tokens_per_s=None, status=f"error: {type(e).__name__}: {e}"[:300])
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["wall_s"] = time.perf_counter() - t0
        model = None  # noqa: F841
        rows.append(row)
        if not writer:
            continue
        print(json.dumps(row), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"),
                    "matmul_ceiling_tflops": ceiling,
                    "fp8_matmul_ceiling_tflops": fp8_ceiling,
                    "rows": rows,
                },
                indent=1,
            )
        )
    if par is not None:
        par.close()
    if not writer:
        return 0
    print(
        f"\nloss: {args.loss}\n{'seq_len':>8} {'recompute':>9} {'backend':>7} {'ms/step':>10} {'tokens/s':>10} "
        f"{'peak GiB':>9} {'MFU':>6} {'MFU/fp8':>7} {'retries':>7} status"
    )
    for r in rows:
        rc = str(r["recompute"]) + (f"+{r['recompute_full_layers']}" if r.get("recompute_full_layers") else "")
        rc += f"/off:{r['offload_activations']}" if r.get("offload_activations", "none") != "none" else ""
        rc += "/compiled" if r.get("compile") else ""
        ms = f"{r['ms']:.1f}" if r["ms"] else "-"
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        mfu8 = f"{r['mfu_fp8_ceiling']:.1%}" if r.get("mfu_fp8_ceiling") else "-"
        print(
            f"{r['seq_len']:>8} {rc:>9} {r['backend']:>7} {ms:>10} {tps:>10} {r['peak_gib']:>9.1f} "
            f"{mfu:>6} {mfu8:>7} {r.get('allocator', {}).get('retries', '-'):>7} {r['status'][:60]}"
        )
    for T, recompute in plan:
        for comp in compiles:
            by = {
                r["backend"]: r
                for r in rows
                if (r["seq_len"], bool(r["recompute"]), r["compile"]) == (T, recompute, comp) and r["ms"]
            }
            if "cudnn" in by and "sdpa" in by:
                print(
                    f"T={T} recompute={recompute} compile={comp}: cudnn is "
                    f"{by['sdpa']['ms'] / by['cudnn']['ms']:.2f}x the sdpa tokens/s"
                )
        for backend in args.backends if args.compile else []:
            pair = [
                r
                for c in compiles
                for r in rows
                if (r["seq_len"], bool(r["recompute"]), r["backend"], r["compile"]) == (T, recompute, backend, c)
                and r["ms"]
            ]
            if len(pair) == 2:
                print(
                    f"T={T} recompute={recompute} {backend}: compiled is {pair[0]['ms'] / pair[1]['ms']:.2f}x the "
                    "eager tokens/s"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
