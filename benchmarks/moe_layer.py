"""One MoE layer at K3.1's expert shapes on the H200: the routed experts (and the whole layer) fwd and fwd+bwd, the
readable per-expert loop against the grouped path, beside the bare grouped GEMMs and the bf16 matmul ceiling
measured in the same run.

Shapes: K3.1 Pro's latent MoE (hidden 7168, latent 3584, expert width 3072, top-16, SiTU, shared experts 2 x 3072),
random weights N(0, 1/in), bf16. Densities (tokens per expert = tokens x 16 / experts), each a row group:

* ``146``: 448 experts at 4,096 tokens (896 experts at 8,192 tokens has the same density; its 59 GB of expert
  weights plus their gradients do not fit one H200 beside the activations, so the benchmark halves both);
* ``1170``: 112 experts at 8,192 tokens (what one rank of 8-way expert parallelism computes at 8K);
* decode: 1 and 8 tokens at 16 and 448 experts, forward only.

Rows (``kernel``): ``loop`` (one Python iteration per expert, a host sync each: the readable twin), ``grouped_mm``
(the chosen path: device-side layout, ``torch._grouped_mm`` per projection, the fused SiTU-GLU, the Triton
gather-sums; ``align`` the group-start alignment), ``bare_grouped_mm`` (the three grouped GEMMs alone on pre-sorted
rows with the same group sizes: no permutation, activation or combine: what the layer can at most reach with this
GEMM). ``experts``: ``trained`` (weight gradients too) or ``frozen`` (input gradient only). ``scope``: ``routed``
(``KimiMoE.routed_experts`` on the latent rows, the issue's measure) or ``layer`` (the whole ``KimiMoE``: router, latent
projections, norm, shared experts).

``tflops`` counts the useful routed-expert FLOPs only (``2 x 3 x Dl x I`` per (token, expert) pair forward; backward
twice that with weight gradients, once without), over the row's time; ``of_ceiling`` divides by the bf16 8192^3
matmul rate measured at the start. ``sync_free``: the grouped path's fwd+bwd ran under
``torch.cuda.set_sync_debug_mode("error")`` without a host sync. Every row records the kernels that ran.

    python3 benchmarks/moe_layer.py --out benchmarks/results/moe_layer.json

Writes JSON (device, torch, ceiling, rows) and prints a table. About 2 minutes on an H200.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import back_to_back_ms, time_ms  # noqa: E402

from kernels_torch import kernel_choice  # noqa: E402
from kernels_torch.moe import KimiMoE  # noqa: E402
from kernels_torch.ops.moe_grouped import expert_layout  # noqa: E402
from kimi.config import load_config  # noqa: E402


def matmul_ceiling() -> float:
    """bf16 8192^3 matmul TFLOP/s on this GPU, now (random inputs)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms, _ = time_ms(lambda: a @ b, warmup=3, min_reps=10, max_reps=20)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def build(cfg, experts_trained: bool) -> KimiMoE:
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = KimiMoE(cfg, backend="cudnn")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.01)
    m = m.to(torch.bfloat16)
    m.gate.e_score_correction_bias.data = m.gate.e_score_correction_bias.data.float()
    for w in (m.experts.w1, m.experts.w2, m.experts.w3):
        w.requires_grad_(experts_trained)
    return m


def expert_flop(cfg, pairs: int, backward: str | None) -> float:
    """Useful routed-expert FLOPs: forward ``2 * 3 * Dl * I`` per pair; backward adds 2x (trained) or 1x (frozen)."""
    fwd = 2 * 3 * cfg.routed_expert_hidden_size * cfg.moe_intermediate_size * pairs
    return fwd * {None: 1, "trained": 3, "frozen": 2}[backward]


def run_case(cfg, T: int, kernel: str, scope: str, experts: str, backward: bool, align: int = 1) -> dict:
    m = build(cfg, experts == "trained")
    m.experts.moe_kernel, m.experts.align = kernel, align
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, T, cfg.hidden_size, device="cuda", generator=g, dtype=torch.bfloat16)
    with torch.no_grad():
        xf = x.reshape(T, -1)
        ids, weights = m.gate(xf)
        z = m.routed_expert_down_proj(xf)
    counts = torch.bincount(ids.reshape(-1), minlength=cfg.num_experts)
    x.requires_grad_(backward)
    z.requires_grad_(backward)
    dy = torch.randn(T, cfg.routed_expert_hidden_size if scope == "routed" else cfg.hidden_size, device="cuda")

    def step():
        if scope == "routed":
            out = m.routed_experts(z, ids, weights)
        else:
            out = m(x).reshape(T, -1)
        if backward:
            out.backward(dy.to(out.dtype))
            m.zero_grad(set_to_none=True)
            x.grad = z.grad = None
        return out

    kernel_choice.reset_used()
    torch.cuda.reset_peak_memory_stats()
    ms, reps = time_ms(step, warmup=2, min_reps=3, max_reps=20, target_s=0.6)
    row = {
        "kernel": kernel,
        "align": align,
        "scope": scope,
        "experts": experts,
        "mode": "fwd+bwd" if backward else "fwd",
        "num_experts": cfg.num_experts,
        "tokens": T,
        "tokens_per_expert": T * cfg.num_experts_per_token / cfg.num_experts,
        "max_rows_per_expert": int(counts.max()),
        "ms": ms,
        "reps": reps,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "kernels": kernel_choice.used(),
    }
    if kernel == "grouped_mm" and T > 8:
        row["ms_back_to_back"] = back_to_back_ms(step, rep_ms=600)
    if kernel == "grouped_mm":
        try:  # no host sync anywhere in the grouped path's forward and backward
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            step()
            row["sync_free"] = True
        except RuntimeError as e:
            row["sync_free"] = f"no: {e}"[:200]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    flop = expert_flop(cfg, T * cfg.num_experts_per_token, experts if backward else None)
    row["expert_tflop"] = flop / 1e12
    row["tflops"] = flop / (ms * 1e-3) / 1e12
    if scope == "layer":  # everything the layer multiplies: router, latent projections, shared experts, experts
        D, Dl, Is = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_shared_experts * cfg.moe_intermediate_size
        dense = 2 * T * (D * cfg.num_experts + 2 * D * Dl + 3 * D * Is) * (3 if backward else 1)
        row["layer_tflops"] = (flop + dense) / (ms * 1e-3) / 1e12
    return row


def bare_grouped(cfg, T: int, experts: str, backward: bool) -> dict:
    """The three grouped GEMMs alone (``torch._grouped_mm``) on rows already sorted, the router's group sizes."""
    E, Dl = cfg.num_experts, cfg.routed_expert_hidden_size
    m = build(cfg, experts == "trained")
    g = torch.Generator(device="cuda").manual_seed(1)
    x0 = torch.randn(T, cfg.hidden_size, device="cuda", generator=g, dtype=torch.bfloat16)
    with torch.no_grad():
        ids, _ = m.gate(x0)
    offs = expert_layout(ids, E).offsets
    P = T * cfg.num_experts_per_token
    x = torch.randn(P, Dl, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=backward)
    w1, w3, w2 = m.experts.w1, m.experts.w3, m.experts.w2
    dy = torch.randn(P, Dl, device="cuda", generator=g, dtype=torch.bfloat16)

    def step():
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        u = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(h * u, w2.transpose(-2, -1), offs=offs)  # (h * u: a stand-in for the activation)
        if backward:
            y.backward(dy)
            x.grad = None
            for w in (w1, w2, w3):
                w.grad = None
        return y

    torch.cuda.reset_peak_memory_stats()
    ms, reps = time_ms(step, warmup=2, min_reps=3, max_reps=20, target_s=0.6)
    flop = expert_flop(cfg, P, experts if backward else None)
    # the elementwise stand-in costs a little: it is counted as the GEMMs' time (a slight under-estimate of the rate)
    row = {
        "kernel": "bare_grouped_mm",
        "align": 1,
        "scope": "routed",
        "experts": experts,
        "mode": "fwd+bwd" if backward else "fwd",
        "num_experts": E,
        "tokens": T,
        "tokens_per_expert": P / E,
        "ms": ms,
        "reps": reps,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "expert_tflop": flop / 1e12,
        "tflops": flop / (ms * 1e-3) / 1e12,
    }
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "moe_layer.json")
    ap.add_argument("--quick", action="store_true", help="only the grouped path and the bare GEMMs (no loop rows)")
    args = ap.parse_args()
    base = load_config("k3.1-pro").truncated(2)  # layer 1 is a MoE layer; the config is only read for its shapes
    ceiling = matmul_ceiling()
    print(f"bf16 matmul ceiling {ceiling:.1f} TFLOP/s", flush=True)
    rows: list[dict] = []

    def record(row):
        row["of_ceiling"] = row["tflops"] / ceiling if row.get("tflops") else None
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%F %T")}
        args.out.write_text(json.dumps({**meta, "matmul_ceiling_tflops": ceiling, "rows": rows}, indent=1))
        gc.collect()
        torch.cuda.empty_cache()

    def safe(fn, *a, **kw):
        try:
            return fn(*a, **kw)
        except torch.OutOfMemoryError:
            return {"kernel": kw.get("kernel", a[2] if len(a) > 2 else "?"), "status": "oom", "args": repr(a[1:])}
        except Exception as e:  # noqa: BLE001 - record and go on
            return {"status": f"error: {type(e).__name__}: {e}"[:300], "args": repr(a[1:])}

    densities = [(448, 4096), (112, 8192)]
    for E, T in densities:
        cfg = base.replace(num_experts=E)
        for experts in ("frozen", "trained"):
            record(safe(bare_grouped, cfg, T, experts, True))
            for align in (1, 16):
                record(safe(run_case, cfg, T, "grouped_mm", "routed", experts, True, align))
            if not args.quick:
                record(safe(run_case, cfg, T, "loop", "routed", experts, True))
        record(safe(run_case, cfg, T, "grouped_mm", "routed", "frozen", False))
        record(safe(run_case, cfg, T, "grouped_mm", "layer", "trained", True))
        if not args.quick:
            record(safe(run_case, cfg, T, "loop", "layer", "trained", True))
    for E in (16, 448):
        cfg = base.replace(num_experts=E, num_experts_per_token=8 if E == 16 else 16)
        for T in (1, 8):
            for kernel in ("grouped_mm", "loop"):
                record(safe(run_case, cfg, T, kernel, "routed", "frozen", False))

    print(f"\nbf16 matmul ceiling {ceiling:.0f} TFLOP/s; tflops = useful routed-expert FLOPs / time")
    print(f"{'E':>4} {'tok':>5} {'tok/E':>6} {'kernel':>16} {'al':>3} {'scope':>6} {'experts':>7} {'mode':>7} "
          f"{'ms':>8} {'TFLOP/s':>8} {'ceil':>5} {'GiB':>6} sync")  # fmt: skip
    for r in rows:
        if "ms" not in r:
            print("  ", r.get("status"), r.get("args"))
            continue
        of = f"{r['of_ceiling']:.0%}" if r.get("of_ceiling") else "-"
        print(
            f"{r['num_experts']:>4} {r['tokens']:>5} {r['tokens_per_expert']:>6.0f} {r['kernel']:>16} {r['align']:>3} "
            f"{r['scope']:>6} {r['experts']:>7} {r['mode']:>7} {r['ms']:>8.2f} {r['tflops']:>8.1f} {of:>5} "
            f"{r['peak_gib']:>6.1f} {r.get('sync_free', '')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
