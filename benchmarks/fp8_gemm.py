"""torchao's FP8 GEMMs alone at a K3.1 training step's shapes, against bf16 in the same run (kernels_torch.fp8).

* Dense projections (``torchao.float8``'s ``Float8Linear``, the module ``convert_model_to_fp8`` puts in, with its
  dynamic casts; recipes ``tensorwise`` and ``rowwise``, eager and, with ``--compile``, under ``torch.compile`` of the
  module, which fuses the casts) against bf16 ``F.linear``, at the real projection shapes of a KDA and a DSA layer,
  the shared experts, the latent MoE projections and the dense layer 0 (``kimi.config.load_config("k3.1-pro")``), at
  8,192 and 32,768 tokens. Each distinct ``[in, out]`` shape is run once and lists the projections that have it.
* The grouped routed experts (gate, up and down: three ``torch._grouped_mm`` on expert-sorted rows, each expert's
  rows padded to 16; FP8 through torchao's weight wrapper, as ``convert_model_to_fp8`` sets it up: rowwise
  ``torch._scaled_grouped_mm`` with its Triton casts), latent 3584 and expert width 3072, top-16: 112 experts at
  8,192 tokens (1,170 rows per expert: one rank of 8-way expert parallelism) and 32,768 (benchmark 5's 32K step), and
  448 experts at 4,096 tokens (146 rows
  per expert, as 896 experts at 8,192 tokens, whose 59 GB of bf16 weights would not fit beside their gradients).
  Group sizes are random around the mean (a multinomial draw), the same for both precisions.
* Forward, and forward + backward (``torch.autograd.grad`` of the input and the weights, no accumulation). FLOPs:
  ``2 M N K`` per GEMM forward, three times that with the backward.
* Ceilings measured in the same run: bf16 ``a @ b`` and FP8 ``torch._scaled_mm`` (e4m3, tensorwise and rowwise
  scales, fast accumulation) at 8192^3.
* ``layers``: the per-layer sums of the dense projections FP8 takes over (KDA: q, k, v, g, o; DSA: q_a, q_b, kv_a,
  g, o; MoE: shared experts and the latent projections) and of the grouped experts, bf16 against each FP8 variant:
  the speed-up those GEMMs allow the step, before the parts that stay bf16.

Timing: ``triton.testing.do_bench`` (``_timing.back_to_back_ms``: median, L2 flushed, calls back to back). About two
minutes on an H200 (``--compile`` adds the compilations). Writes ``--out`` (JSON) and prints a table.

    python benchmarks/fp8_gemm.py --out benchmarks/results/fp8_gemm.json [--compile]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import back_to_back_ms  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from kimi.config import load_config  # noqa: E402

RECIPES = ("tensorwise", "rowwise")
TOKENS = (8192, 32768)
GROUPED = ((112, 8192), (112, 32768), (448, 4096))  # (experts, tokens): 1,170, 4,681 and 146 rows per expert
ALIGN = 16
REP_MS, WARMUP_MS = 200.0, 50.0  # do_bench per measurement: about two minutes for the whole run


def bench_ms(fn) -> float:
    return back_to_back_ms(fn, rep_ms=REP_MS, warmup_ms=WARMUP_MS)


def dense_shapes(cfg) -> dict[tuple[int, int], list[str]]:
    """``(in, out)`` -> the projections of that shape that FP8 takes over (kernels_torch.fp8's defaults)."""
    D, P = cfg.hidden_size, cfg.kda_num_heads * cfg.kda_head_dim
    H, Kn, R, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    Dl, Ish = cfg.routed_expert_hidden_size, cfg.num_shared_experts * cfg.moe_intermediate_size
    rows = [
        ("kda.q_proj", D, P),
        ("kda.k_proj", D, P),
        ("kda.v_proj", D, P),
        ("kda.g_proj", D, P),
        ("kda.o_proj", P, D),
        ("dsa.q_a_proj", D, cfg.q_lora_rank),
        ("dsa.q_b_proj", cfg.q_lora_rank, H * (Kn + R)),
        ("dsa.kv_a_proj_with_mqa", D, cfg.kv_lora_rank + R),
        ("dsa.g_proj", D, H * V),
        ("dsa.o_proj", H * V, D),
        ("moe.shared_experts.gate_proj", D, Ish),
        ("moe.shared_experts.up_proj", D, Ish),
        ("moe.shared_experts.down_proj", Ish, D),
        ("moe.routed_expert_down_proj", D, Dl),
        ("moe.routed_expert_up_proj", Dl, D),
        ("mlp0.gate_proj", D, cfg.intermediate_size),
        ("mlp0.up_proj", D, cfg.intermediate_size),
        ("mlp0.down_proj", cfg.intermediate_size, D),
    ]
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, k, n in rows:
        shapes.setdefault((k, n), []).append(name)
    return shapes


def tflops(flop: float, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def ceilings() -> dict[str, float]:
    """TFLOP/s of an 8192^3 product: bf16 ``a @ b``, and FP8 e4m3 ``torch._scaled_mm`` with tensorwise (cuBLAS) and
    rowwise (CUTLASS) scales, fast accumulation, bf16 out."""
    n = 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b8: column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    ra, rb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    flop = 2 * n**3
    out = {"bf16": tflops(flop, bench_ms(lambda: a @ b))}
    for name, sa, sb in (("fp8_tensorwise", one, one), ("fp8_rowwise", ra, rb)):
        ms = bench_ms(
            lambda sa=sa, sb=sb: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)
        )
        out[name] = tflops(flop, ms)
    return out


def fp8_linear(weight: nn.Parameter, recipe: str, compile_: bool) -> nn.Module:
    """torchao's Float8Linear of ``recipe`` holding ``weight`` ``[out, in]`` (as ``convert_model_to_fp8`` makes it),
    compiled in place (``nn.Module.compile``: the casts fuse around ``torch._scaled_mm``) with ``compile_``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = weight
    mod = convert_to_float8_training(nn.Sequential(lin), config=Float8LinearConfig.from_recipe_name(recipe))[0]
    if compile_:
        mod.compile()
    return mod


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def bench_dense(shapes, tokens, recipes, compile_: bool) -> list[dict]:
    rows = []
    for (K, N), names in shapes.items():
        for T in tokens:
            rows += _dense_rows(K, N, T, names, recipes, compile_)
            torch.cuda.empty_cache()
    return rows


def _dense_rows(K: int, N: int, T: int, names: list[str], recipes, compile_: bool) -> list[dict]:
    """bf16 ``F.linear`` and each FP8 variant on ``x [T, K]`` with ``W [N, K]``: forward, forward + backward."""
    g = torch.Generator(device="cuda").manual_seed(K + N + T)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16, generator=g)
    w = nn.Parameter(torch.randn(N, K, device="cuda", generator=g).mul_(K**-0.5).bfloat16())
    flop = 2 * T * K * N
    ref = F.linear(x, w).detach()
    variants = [("bf16", lambda x: F.linear(x, w))]
    for recipe in recipes:
        for comp in (False, True) if compile_ else (False,):
            variants.append((f"fp8_{recipe}" + ("_compiled" if comp else ""), fp8_linear(w, recipe, comp)))
    rows = []
    for mode, fn in variants:
        row = {"names": names, "in": K, "out": N, "tokens": T, "mode": mode}
        try:
            with torch.no_grad():
                row["rel_vs_bf16"] = rel(fn(x), ref) if mode != "bf16" else 0.0
            fwd = bench_ms(lambda fn=fn: fn(x))
            both = bench_ms(lambda fn=fn: torch.autograd.grad(fn(x), (x, w), dy))
            row.update(fwd_ms=fwd, fwd_bwd_ms=both, fwd_tflops=tflops(flop, fwd), fwd_bwd_tflops=tflops(3 * flop, both))
        except Exception as e:  # noqa: BLE001 - record the failure, keep measuring
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def group_offsets(E: int, pairs: int, seed: int) -> torch.Tensor:
    """Cumulative row ends ``[E]`` int32 of ``pairs`` rows spread over ``E`` experts by a multinomial draw, each group
    padded up to a multiple of 16 (the layout ``GroupedExperts`` with ``align = 16`` makes)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.randint(0, E, (pairs,), generator=g), minlength=E)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    return torch.cumsum(padded, 0).to(torch.int32).cuda()


class _Experts(nn.Module):
    def __init__(self, E: int, I: int, Dl: int, g):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, I, Dl, device="cuda", generator=g).mul_(Dl**-0.5).bfloat16())
        self.w3 = nn.Parameter(torch.randn(E, I, Dl, device="cuda", generator=g).mul_(Dl**-0.5).bfloat16())
        self.w2 = nn.Parameter(torch.randn(E, Dl, I, device="cuda", generator=g).mul_(I**-0.5).bfloat16())


def bench_grouped(cfg, configs) -> list[dict]:
    """Gate, up and down grouped GEMMs (no activation: the GEMMs alone), bf16 ``torch._grouped_mm`` against the same
    call on torchao-wrapped weights (FP8 rowwise ``torch._scaled_grouped_mm``), for each ``(experts, tokens)``."""
    rows = []
    for E, T in configs:
        for mode in ("bf16", "fp8_rowwise"):
            rows.append(_grouped_row(cfg, E, T, mode))
            torch.cuda.empty_cache()
    return rows


def _grouped_row(cfg, E: int, T: int, mode: str) -> dict:
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    Dl, I, k = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_token
    g = torch.Generator(device="cuda").manual_seed(E)
    offs = group_offsets(E, T * k, seed=E)  # the same groups for both modes
    R = int(offs[-1])
    x = torch.randn(R, Dl, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    h = torch.randn(R, I, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    dh = torch.randn(R, I, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(R, Dl, device="cuda", dtype=torch.bfloat16, generator=g)
    mod = _Experts(E, I, Dl, g)
    if mode != "bf16":
        quantize_(mod, Float8TrainingOpConfig(), filter_fn=lambda m, fqn: fqn == "")
    flop = 3 * 2 * R * Dl * I  # gate, up, down forward

    def fwd():
        a = torch._grouped_mm(x, mod.w1.transpose(-2, -1), offs=offs)
        b = torch._grouped_mm(x, mod.w3.transpose(-2, -1), offs=offs)
        return a, b, torch._grouped_mm(h, mod.w2.transpose(-2, -1), offs=offs)

    def both():
        a, b, y = fwd()
        return torch.autograd.grad((a, b, y), (x, h, mod.w1, mod.w3, mod.w2), (dh, dh, dy))

    row = {"experts": E, "tokens": T, "rows": R, "rows_per_expert": T * k / E, "Dl": Dl, "I": I, "mode": mode}
    try:
        f_ms, b_ms = bench_ms(fwd), bench_ms(both)
        row.update(fwd_ms=f_ms, fwd_bwd_ms=b_ms, fwd_tflops=tflops(flop, f_ms), fwd_bwd_tflops=tflops(3 * flop, b_ms))
    except Exception as e:  # noqa: BLE001 - record the failure, keep measuring
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(row), flush=True)
    return row


LAYER_PARTS = {
    "kda": ("kda.q_proj", "kda.k_proj", "kda.v_proj", "kda.g_proj", "kda.o_proj"),
    "dsa": ("dsa.q_a_proj", "dsa.q_b_proj", "dsa.kv_a_proj_with_mqa", "dsa.g_proj", "dsa.o_proj"),
    "moe_dense": (
        "moe.shared_experts.gate_proj",
        "moe.shared_experts.up_proj",
        "moe.shared_experts.down_proj",
        "moe.routed_expert_down_proj",
        "moe.routed_expert_up_proj",
    ),
    "dense_mlp0": ("mlp0.gate_proj", "mlp0.up_proj", "mlp0.down_proj"),
}


def layer_sums(dense: list[dict]) -> list[dict]:
    """Per layer kind and token count, the fwd+bwd milliseconds of its FP8-able projections in each mode, and the
    speed-up over bf16."""
    out = []
    for kind, names in LAYER_PARTS.items():
        for T in sorted({r["tokens"] for r in dense}):
            by_mode: dict[str, float] = {}
            parts: dict[str, int] = {}
            for r in dense:
                if r["tokens"] == T and "fwd_bwd_ms" in r:
                    n = sum(1 for name in r["names"] if name in names)
                    if n:
                        by_mode[r["mode"]] = by_mode.get(r["mode"], 0.0) + n * r["fwd_bwd_ms"]
                        parts[r["mode"]] = parts.get(r["mode"], 0) + n
            by_mode = {m: ms for m, ms in by_mode.items() if parts[m] == len(names)}  # every part measured
            bf16 = by_mode.get("bf16")
            for mode, ms in by_mode.items():
                out.append(
                    {"layer": kind, "tokens": T, "mode": mode, "fwd_bwd_ms": ms, "speedup": bf16 / ms if bf16 else None}
                )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    ap.add_argument("--compile", action="store_true", help="also time each Float8Linear under torch.compile")
    ap.add_argument("--no-grouped", action="store_true", help="skip the grouped experts")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fp8_gemm.json")
    args = ap.parse_args()
    logging.getLogger("torchao").setLevel(logging.ERROR)
    import torchao

    if args.compile:  # one Float8Linear.forward, many shapes: keep dynamo from falling back to eager after 8
        torch._dynamo.config.cache_size_limit = 256

    cfg = load_config("k3.1-pro")
    t0 = time.perf_counter()
    ceil = ceilings()
    print(json.dumps({"ceilings_tflops": ceil}), flush=True)
    dense = bench_dense(dense_shapes(cfg), args.tokens, args.recipes, args.compile)
    grouped = [] if args.no_grouped else bench_grouped(cfg, GROUPED)
    layers = layer_sums(dense)
    for kind in ("bf16", "fp8_rowwise"):  # the grouped experts as a layer part too
        for r in grouped:
            if r["mode"] == kind and "fwd_bwd_ms" in r:
                base = next(
                    x for x in grouped if (x["experts"], x["tokens"], x["mode"]) == (r["experts"], r["tokens"], "bf16")
                )
                layers.append(
                    {
                        "layer": f"experts E={r['experts']}",
                        "tokens": r["tokens"],
                        "mode": kind,
                        "fwd_bwd_ms": r["fwd_bwd_ms"],
                        "speedup": base.get("fwd_bwd_ms", float("nan")) / r["fwd_bwd_ms"],
                    }
                )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "torchao": torchao.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "ceilings_tflops": ceil,
        "dense": dense,
        "grouped": grouped,
        "layers": layers,
        "wall_s": time.perf_counter() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(
        f"\nceilings (8192^3): bf16 {ceil['bf16']:.0f}, fp8 tensorwise {ceil['fp8_tensorwise']:.0f}, "
        f"fp8 rowwise {ceil['fp8_rowwise']:.0f} TFLOP/s"
    )
    print(f"{'shape':>13} {'tokens':>6} {'mode':>24} {'fwd ms':>8} {'TF/s':>6} {'f+b ms':>8} {'TF/s':>6}  rel  names")
    for r in dense:
        if "error" in r:
            print(f"{r['in']:>6}x{r['out']:<6} {r['tokens']:>6} {r['mode']:>24} error: {r['error'][:60]}")
            continue
        print(
            f"{r['in']:>6}x{r['out']:<6} {r['tokens']:>6} {r['mode']:>24} {r['fwd_ms']:8.3f} {r['fwd_tflops']:6.0f} "
            f"{r['fwd_bwd_ms']:8.3f} {r['fwd_bwd_tflops']:6.0f} {r['rel_vs_bf16']:.3f} {','.join(r['names'])}"
        )
    for r in grouped:
        if "error" in r:
            print(f"grouped E={r['experts']} {r['mode']}: error {r['error'][:80]}")
            continue
        print(
            f"grouped E={r['experts']:>3} rows/expert {r['rows_per_expert']:7.1f} {r['mode']:>12}: "
            f"fwd {r['fwd_ms']:7.2f} "
            f"ms {r['fwd_tflops']:5.0f} TF/s, fwd+bwd {r['fwd_bwd_ms']:7.2f} ms {r['fwd_bwd_tflops']:5.0f} TF/s"
        )
    print(f"\n{'layer part':>16} {'tokens':>6} {'mode':>24} {'f+b ms':>8} {'x bf16':>7}")
    for r in layers:
        sp = f"{r['speedup']:.2f}" if r["speedup"] else "-"
        print(f"{r['layer']:>16} {r['tokens']:>6} {r['mode']:>24} {r['fwd_bwd_ms']:8.2f} {sp:>7}")
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
