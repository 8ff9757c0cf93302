"""DSA indexer + top-k on one GPU: ``kernels_torch.dsa_cudnn.indexer_topk_cudnn`` (cuDNN FE indexer + top-k in query-row
chunks) against (a) a torch fp32 einsum + ``torch.topk`` over row chunks of 1024 that reads the keys up to each
chunk's last row, (a') the same reading every key of the sequence for every chunk (the straightforward baseline of
``docs/kernels.md``; run up to ``--all-keys-max`` tokens) and (b) cuDNN's indexer over whole rows + cuDNN top-k
(a quadratic [S, S] fp32 buffer plus 2 words/element of top-k scratch; skipped where it does not fit).

H_I = 32, D_I = 128, k = 2048, one causal sequence of S tokens, bf16 q_I/k_I, fp32 weights. Time: median of
CUDA-event-timed calls after warm-up. Peak extra memory: ``torch.cuda.max_memory_allocated()`` during the call minus
the memory allocated before it (inputs excluded). Selected sets of (b) and (a) are compared with ours row by row.

    python benchmarks/indexer_topk.py --out indexer_topk.json
    python benchmarks/indexer_topk.py --profile 8192 --out indexer_topk_profile.json   # where ours and (b) spend time

``--profile S`` runs instead one warm call and one ``torch.profiler`` call of ours and of (b) at S, and writes the
GPU kernels (name, calls, microseconds) of each next to the call's CUDA-event time; the difference is the time the
GPU waited on the host.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import time_ms  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from kernels_torch import dsa_cudnn as dc  # noqa: E402

HI, KI, K = 32, 128, 2048
GIB = 1 << 30


def peak_extra_gib(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GIB, res


def torch_chunks(q, k, w, rows=1024, all_keys=False):
    """(a): fp32 einsum over row chunks (keys up to the chunk's last row), causal -inf, torch.topk.
    (a') with ``all_keys``: every chunk scores all S keys (then masks), as the spec's baseline."""
    S = q.shape[0]
    out = torch.full((S, K), -1, dtype=torch.int64, device=q.device)
    kf = k.float()
    for r0 in range(0, S, rows):
        r1 = min(S, r0 + rows)
        n = S if all_keys else r1  # keys scored for this chunk
        logits = torch.einsum("cjd,sd->cjs", q[r0:r1].float(), kf[:n])  # [C, HI, n]
        s = torch.einsum("cj,cjs->cs", w[r0:r1] * (HI * KI) ** -0.5, torch.relu(logits))
        t = torch.arange(r0, r1, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(n, device=q.device)[None] > t, float("-inf"))
        vals, idx = s.topk(min(K, r1), dim=-1)
        out[r0:r1, : idx.shape[1]] = torch.where(torch.isfinite(vals), idx, -1)
    return out


def cudnn_whole_rows(q, k, w):
    """(b): one indexer call over all rows ([1, S, S] fp32 scores), one top-k call."""
    dsa = dc._dsa()
    S = q.shape[0]
    scores = dsa.indexer_forward_wrapper(q[None], k[None, :, None], w[None], ratio=1, sm_scale=(HI * KI) ** -0.5)[
        "scores"
    ][0]
    seq_lens = torch.arange(1, S + 1, dtype=torch.int32, device=q.device)
    return dsa.indexer_top_k_wrapper(scores, seq_lens, K, return_val=False, tie_break=2)["indices"]


def same_set_rows(a, b):
    a = torch.sort(a.long(), -1).values
    b = torch.sort(b.long(), -1).values
    return int((a == b).all(-1).sum())


def profile_calls(S: int, out: Path) -> None:
    """Kernel-level breakdown of ours and (b) at S (``torch.profiler``, CUDA activity), one profiled call each."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(S, HI, KI, device="cuda", generator=g).bfloat16()
    k = torch.randn(S, KI, device="cuda", generator=g).bfloat16()
    w = torch.randn(S, HI, device="cuda", generator=g)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "S": S, "calls": {}}
    for name, fn in [("ours", lambda: dc.indexer_topk_cudnn(q, k, w, K)), ("(b)", lambda: cudnn_whole_rows(q, k, w))]:
        ms, _ = time_ms(fn, warmup=2, min_reps=5, max_reps=20)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [
            {
                "kernel": e.key,
                "calls": e.count,
                "us": getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0),
            }
            for e in prof.key_averages()
        ]
        kernels = sorted((r for r in kernels if r["us"] > 0), key=lambda r: -r["us"])
        result["calls"][name] = {"event_ms": ms, "kernel_us_sum": sum(r["us"] for r in kernels), "kernels": kernels}
        print(f"\n{name}: {ms * 1e3:.0f} us per call (CUDA events), kernels {sum(r['us'] for r in kernels):.0f} us")
        for r in kernels:
            print(f"  {r['us']:9.1f} us  x{r['calls']:<3d} {r['kernel'][:110]}")
    out.write_text(json.dumps(result, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="indexer_topk.json")
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument("--all-keys-max", type=int, default=32768, help="largest S for (a'), which reads every key")
    ap.add_argument("--profile", type=int, metavar="S", help="only the kernel breakdown of ours and (b) at S")
    args = ap.parse_args()
    if args.profile:
        return profile_calls(args.profile, Path(args.out))
    dev = torch.cuda.get_device_name()
    rows = []
    for S in (int(s) for s in args.sizes.split(",")):
        g = torch.Generator(device="cuda").manual_seed(S)
        q = torch.randn(S, HI, KI, device="cuda", generator=g).bfloat16()
        k = torch.randn(S, KI, device="cuda", generator=g).bfloat16()
        w = torch.randn(S, HI, device="cuda", generator=g)
        ours_fn = lambda: dc.indexer_topk_cudnn(q, k, w, K)  # noqa: E731
        mem, (ours, _) = peak_extra_gib(ours_fn)  # also the warm-up (compilation)
        ms, reps = time_ms(ours_fn, warmup=0)
        row = {
            "S": S,
            "impl": "ours: cuDNN indexer + top-k, row chunks",
            "ms": ms,
            "reps": reps,
            "peak_extra_gib": mem,
            "chunk_rows": dc._default_chunk_rows(S, S, dc.CHUNK_BYTES),
        }
        rows.append(row)
        print(row, flush=True)
        free = torch.cuda.mem_get_info()[0]
        if 12 * S * S < 0.8 * free:
            mem_b, idx_b = peak_extra_gib(lambda: cudnn_whole_rows(q, k, w))
            ms_b, reps_b = time_ms(lambda: cudnn_whole_rows(q, k, w), warmup=0)
            rows.append(
                {
                    "S": S,
                    "impl": "(b) cuDNN indexer + top-k, whole rows",
                    "ms": ms_b,
                    "reps": reps_b,
                    "peak_extra_gib": mem_b,
                    "same_set_rows_vs_ours": same_set_rows(idx_b, ours),
                }
            )
            del idx_b
        else:
            rows.append(
                {
                    "S": S,
                    "impl": "(b) cuDNN indexer + top-k, whole rows",
                    "ms": None,
                    "skipped": f"needs {12 * S * S / GIB:.0f} GiB, {free / GIB:.0f} GiB free",
                }
            )
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
        mem_a, idx_a = peak_extra_gib(lambda: torch_chunks(q, k, w))
        ms_a, reps_a = time_ms(lambda: torch_chunks(q, k, w), target_s=1.5, warmup=0, max_reps=5)
        rows.append(
            {
                "S": S,
                "impl": "(a) torch fp32 einsum + topk, row chunks of 1024",
                "ms": ms_a,
                "reps": reps_a,
                "peak_extra_gib": mem_a,
                "same_set_rows_vs_ours": same_set_rows(idx_a, ours),
            }
        )
        print(rows[-1], flush=True)
        del idx_a
        if S <= args.all_keys_max:
            torch.cuda.empty_cache()
            mem_f, idx_f = peak_extra_gib(lambda: torch_chunks(q, k, w, all_keys=True))
            ms_f, reps_f = time_ms(lambda: torch_chunks(q, k, w, all_keys=True), target_s=1.5, warmup=0, max_reps=5)
            rows.append(
                {
                    "S": S,
                    "impl": "(a') torch fp32 einsum + topk, row chunks of 1024, every key",
                    "ms": ms_f,
                    "reps": reps_f,
                    "peak_extra_gib": mem_f,
                    "same_set_rows_vs_ours": same_set_rows(idx_f, ours),
                }
            )
            print(rows[-1], flush=True)
            del idx_f
        del ours, q, k, w
        torch.cuda.empty_cache()
    for S in sorted({r["S"] for r in rows}):
        ours = next(r for r in rows if r["S"] == S and r["impl"].startswith("ours"))
        for r in rows:
            if r["S"] == S and r is not ours and r.get("ms"):
                ours["ratio_vs_" + r["impl"][:3]] = ours["ms"] / r["ms"]  # < 1: ours faster
    Path(args.out).write_text(
        json.dumps({"device": dev, "torch": torch.__version__, "H_I": HI, "D_I": KI, "k": K, "rows": rows}, indent=1)
    )
    print(f"\n{dev}; H_I={HI}, D_I={KI}, k={K}")
    print("| S | impl | ms | peak extra GiB | same sets as ours |\n|---|---|---|---|---|")
    for r in rows:
        ms = f"{r['ms']:.2f}" if r.get("ms") else "skipped: " + r.get("skipped", "")
        mem = f"{r['peak_extra_gib']:.2f}" if "peak_extra_gib" in r else ""
        print(f"| {r['S']} | {r['impl']} | {ms} | {mem} | {r.get('same_set_rows_vs_ours', '')} |")
    for r in rows:
        if r["impl"].startswith("ours"):
            ratio_full = r.get("ratio_vs_(a'")  # ours / (a'), when (a') ran
            full = f", (a')/ours = {1 / ratio_full:.1f}x" if ratio_full else ""
            print(
                f"S={r['S']}: ours/(b) = {r.get('ratio_vs_(b)', float('nan')):.3f}, "
                f"(a)/ours = {1 / r['ratio_vs_(a)']:.1f}x{full}"
            )


if __name__ == "__main__":
    main()
