"""One DSA layer (``cudnn`` backend: cuDNN indexer + top-k, FlashMLA or Triton sparse forward, cuDNN sparse backward) against one
dense MLA layer, forward + backward, K3.1 real dims (hidden 7168, H 96, q_lora 1536, kv_lora 512, rope 64, nope 128,
v 128, indexer 32 x 128, k 2048), bf16, one causal sequence of S tokens.

Dense baselines: the ``sdpa`` backend as it is (a dense [T, S] bool mask, so SDPA cannot use its causal flash
kernels), and the dense path of the ``cudnn`` backend on a K3 (no indexer) layer (SDPA ``is_causal=True``, expanded
form). Time: median of CUDA-event-timed fwd+bwd calls (``out.backward(dy)``, parameter and input gradients) after a
warm-up; OOM is recorded, not fatal. The speed-up and the crossing are printed last. Each DSA row records the sparse
forward kernel that ran (``kernels``); with ``--breakdown`` one more fwd+bwd call of the DSA layer runs under
``torch.profiler`` and its GPU time is split per call (indexer, top-k, sparse forward, sparse backward, matmuls = the
projections, the rest), with the 30 largest kernels by name.

    python benchmarks/dsa_vs_dense_layer.py --out dsa_vs_dense_layer.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import categorise, time_ms  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from kernels_torch import kernel_choice  # noqa: E402
from kernels_torch.mla import GatedMLA  # noqa: E402
from kimi.config import load_config  # noqa: E402

LAYER = 3  # a DSA layer of K3.1 (an MLA layer of K3)


def make_layer(cfg, backend):
    torch.manual_seed(0)
    layer = GatedMLA(cfg, LAYER, backend=backend)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.fill_(1.0) if name.endswith("weight") else p.zero_()
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return layer.to("cuda", torch.bfloat16)


def fwd_bwd(layer, x, dy):
    def step():
        for p in layer.parameters():
            p.grad = None
        xx = x.detach().requires_grad_()
        layer(xx).backward(dy)

    return step


CATEGORIES = (  # first match wins, on the lower-cased kernel name (names as seen on the H200, 2026-11-30)
    ("top-k", ("indexer_top_k", "top_k", "topk", "radixsort")),  # cuDNN top-k; radixSort = sort_topk_slots
    ("indexer", ("indexer",)),
    ("sparse forward", ("sparse_attn_fwd", "sparse_fwd", "_sparse_mla_fwd_kernel")),  # FlashMLA legacy / Triton
    ("sparse backward", ("sparse_attention_backward", "dsa_bwd")),
    ("matmuls (projections)", ("gemm", "nvjet", "cutlass", "xmma", "wgmma")),
    ("copies and fills", ("copy", "fill", "memcpy", "memset")),
)


def breakdown(step) -> dict:
    """GPU time of one ``step()`` per category of kernel (CATEGORIES), in ms, plus the 30 largest kernels."""
    from _timing import kernel_ms

    return categorise(kernel_ms(step), CATEGORIES)


def print_breakdowns(rows) -> None:
    print("| S | total GPU ms | " + " | ".join(n for n, _ in CATEGORIES) + " | rest |")
    print("|---" * (len(CATEGORIES) + 3) + "|")
    for r in rows:
        if "breakdown" in r:
            b = r["breakdown"]
            cells = " | ".join(f"{v:.1f} ({b['share'].get(k, 0):.0%})" for k, v in b["ms"].items())
            print(f"| {r['S']} | {b['total_gpu_ms']:.1f} | {cells} |")


def recategorise(path: str) -> None:
    """Re-split the breakdowns stored in a result file with the current CATEGORIES (from its 30 largest kernels)."""
    d = json.loads(Path(path).read_text())
    for r in d["rows"]:
        if "breakdown" in r:
            b = r["breakdown"]
            r["breakdown"] = categorise(dict(b["top_kernels_ms"]), CATEGORIES, total=b["total_gpu_ms"])
    Path(path).write_text(json.dumps(d, indent=1))
    print_breakdowns(d["rows"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="dsa_vs_dense_layer.json")
    ap.add_argument("--sizes", default="4096,8192,32768,65536")
    ap.add_argument("--sdpa-max", type=int, default=32768, help="largest S for the masked sdpa backend (slow)")
    ap.add_argument("--breakdown", action="store_true", help="profile one more DSA fwd+bwd per S, split per call")
    ap.add_argument("--recategorise", metavar="FILE", help="only re-split the breakdowns stored in FILE (no GPU)")
    args = ap.parse_args()
    if args.recategorise:
        recategorise(args.recategorise)
        return
    k31, k3 = load_config("k3.1-pro"), load_config("k3")
    impls = {
        "dsa (cudnn)": (k31, "cudnn"),
        "dense (sdpa backend, mask)": (k3, "sdpa"),
        "dense (cudnn backend: SDPA is_causal)": (k3, "cudnn"),
    }
    rows = []
    for name, (cfg, backend) in impls.items():
        layer = make_layer(cfg, backend)
        for S in (int(s) for s in args.sizes.split(",")):
            g = torch.Generator(device="cuda").manual_seed(S)
            x = torch.randn(1, S, cfg.hidden_size, device="cuda", generator=g).bfloat16()
            dy = torch.randn(1, S, cfg.hidden_size, device="cuda", generator=g).bfloat16()
            row = {"S": S, "impl": name}
            if backend == "sdpa" and S > args.sdpa_max:
                row["ms"], row["error"] = None, f"not run (S > --sdpa-max {args.sdpa_max})"
                rows.append(row)
                continue
            try:
                torch.cuda.reset_peak_memory_stats()
                kernel_choice.reset_used()
                row["ms"], row["reps"] = time_ms(fwd_bwd(layer, x, dy), min_reps=2, max_reps=5)
                row["peak_gib"] = torch.cuda.max_memory_allocated() / (1 << 30)
                row["kernels"] = kernel_choice.used()
                if args.breakdown and name.startswith("dsa"):
                    row["breakdown"] = breakdown(fwd_bwd(layer, x, dy))
            except torch.OutOfMemoryError as e:
                row["ms"], row["error"] = None, f"OOM: {str(e)[:120]}"
            except Exception as e:  # a kernel that refuses the shape: recorded, the other rows still run
                row["ms"], row["error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(row, flush=True)
            del x, dy
            torch.cuda.empty_cache()
        del layer
        torch.cuda.empty_cache()
    sizes = sorted({r["S"] for r in rows})
    summary = []
    for S in sizes:
        by = {r["impl"]: r.get("ms") for r in rows if r["S"] == S}
        dsa = by["dsa (cudnn)"]
        dense = [v for k, v in by.items() if k != "dsa (cudnn)" and v]
        best = min(dense) if dense else None
        summary.append(
            {
                "S": S,
                "dsa_ms": dsa,
                "best_dense_ms": best,
                "speedup_vs_best_dense": (best / dsa) if dsa and best else None,
                "speedup_vs_sdpa_backend": (by["dense (sdpa backend, mask)"] / dsa)
                if dsa and by["dense (sdpa backend, mask)"]
                else None,
            }
        )
    faster = [s["S"] for s in summary if s["speedup_vs_best_dense"] and s["speedup_vs_best_dense"] > 1]
    slower = [s["S"] for s in summary if s["speedup_vs_best_dense"] and s["speedup_vs_best_dense"] <= 1]
    crossing = (
        f"DSA faster from S={min(faster)} (slower at {slower})"
        if faster and slower and max(slower) < min(faster)
        else f"DSA faster at every measured S ({faster})"
        if faster and not slower
        else f"DSA never faster in {sizes}"
        if not faster
        else f"mixed: faster {faster}, slower {slower}"
    )
    dev = torch.cuda.get_device_name()
    Path(args.out).write_text(
        json.dumps(
            {"device": dev, "torch": torch.__version__, "rows": rows, "summary": summary, "crossing": crossing},
            indent=1,
        )
    )
    print(f"\n{dev}; fwd+bwd of one attention layer, K3.1 dims, bf16")
    print("| S | impl | ms | peak GiB |\n|---|---|---|---|")
    for r in rows:
        ms = f"{r['ms']:.1f}" if r.get("ms") else r.get("error", "")[:60]
        print(f"| {r['S']} | {r['impl']} | {ms} | {r.get('peak_gib', float('nan')):.1f} |")
    print("| S | DSA ms | best dense ms | speed-up vs best dense | vs sdpa backend |\n|---|---|---|---|---|")
    f = lambda v, p=".1f": format(v, p) if v else "-"  # noqa: E731
    for s in summary:
        print(
            f"| {s['S']} | {f(s['dsa_ms'])} | {f(s['best_dense_ms'])} | {f(s['speedup_vs_best_dense'], '.2f')} | "
            f"{f(s['speedup_vs_sdpa_backend'], '.2f')} |"
        )
    print(crossing)
    print_breakdowns(rows)


if __name__ == "__main__":
    main()
