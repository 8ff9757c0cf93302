"""Sparse MLA forward (DSA prefill) on one GPU: FlashMLA and our Triton kernel vs the torch gather + einsum baseline.

Measures, in one process: the bf16 matmul ceiling (8192^3, random data), a sweep of Triton launch variants at
S = 8192 (``--no-sweep``: the default variant only), the best variant at S in {8192, 32768, 65536}, FlashMLA
(``sparse_mla_fwd(backend="flash_mla")``: SM90 legacy kernels, 96 heads padded to 128, padding included in the time;
the TFLOP/s count the 96 useful heads) at the same S when the ``flash_mla`` module imports, and the torch baseline at
S = 8192 and 32768, the same FlashMLA call on a query built with ``padded_q`` (the layout the DSA layer writes
without autograd: read in place, no head-padding copies in or out), and FlashMLA's bare call at S <= 32768 (no wrapper, h_q = 128; ``bare_rows``: the most a 96-head
wrapper of it can reach). Every row names the kernel (``kernel``: flash_mla / triton / torch / matmul).
H = 96, K = 2048 random valid causal-ish indices (row t draws from [0, max(t+1, K))), d_qk = 576, d_v = 512.
FLOPs = 2 * S * H * K * (576 + 512) (docs/kernels.md). Times are medians over CUDA-event-timed calls after warm-up, each
call started from an idle GPU (``ms``); the padded-q and bare FlashMLA rows also give ``ms_back_to_back`` /
``tflops_back_to_back``: calls issued back to back (``_timing.back_to_back_ms``), the host's launch work hidden as in
a model step.

    python benchmarks/sparse_mla_fwd.py --out sparse_mla_fwd.json
    ncu --clock-control none -k regex:_sparse_mla_fwd_kernel --launch-skip 1 --launch-count 1 --set full \\
        python benchmarks/sparse_mla_fwd.py --profile-call 8192     # hardware counters of one call (run_h200.sh)

``--profile-call S`` makes two calls of the default kernel at S and nothing else, for a profiler to capture the second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import back_to_back_ms, time_ms  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from kernels_torch.ops import sparse_mla as sm  # noqa: E402

SM_SCALE = 192**-0.5
H, K = 96, 2048
VARIANTS = {  # name -> kwargs of sm._sparse_mla_fwd_triton
    "hk-h64-k64-s2": dict(layout="hk", block_h=64, block_k=64, num_warps=8, num_stages=2),
    "hk-h64-k32-s3": dict(layout="hk", block_h=64, block_k=32, num_warps=8, num_stages=3),
    "kh-h64-k128-s1": dict(layout="kh", block_h=64, block_k=128, num_warps=8, num_stages=1),
    "kh-h64+32-k128-s1": dict(
        layout="kh", block_k=128, num_warps=8, num_stages=1, head_splits=[(0, 64, 64), (64, 32, 32)]
    ),
    "kh-h32-k128-s1": dict(layout="kh", block_h=32, block_k=128, num_warps=8, num_stages=1),
}


def matmul_ceiling():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms, _ = time_ms(lambda: a @ b, warmup=3, min_reps=3, max_reps=20)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12, ms


def make_inputs(S, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(S, H, sm.D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(S, 1, sm.D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    hi = torch.clamp(torch.arange(1, S + 1, device="cuda"), min=K).float()[:, None]  # causal-ish, always K valid ids
    idx = (torch.rand(S, K, device="cuda", generator=g) * hi).long().clamp_max(S - 1).to(torch.int32)
    return q, kv, idx[:, None, :]


def torch_baseline(q, kv, idx, rows=1024):
    """Gather + einsum in bf16 with an fp32 softmax, in chunks of query rows."""
    kv2, idx2 = kv[:, 0], idx[:, 0].long()
    out = torch.empty(q.shape[0], H, sm.D_V, device="cuda", dtype=torch.bfloat16)
    for t0 in range(0, q.shape[0], rows):
        g = kv2[idx2[t0 : t0 + rows]]  # [C, K, 576]
        s = torch.einsum("thd,tkd->thk", q[t0 : t0 + rows], g).float() * SM_SCALE
        p = torch.softmax(s, dim=-1).to(torch.bfloat16)
        out[t0 : t0 + rows] = torch.einsum("thk,tkv->thv", p, g[..., : sm.D_V])
    return out


def flops(S):
    return 2 * S * H * K * (sm.D_QK + sm.D_V)


def bare_rows(S, q, kv, idx, row):
    """FlashMLA's own call, no wrapper: h_q = 128 (the 96 heads plus 32 zero heads, built once outside the timing),
    (a) every row with K valid ids (this benchmark's inputs), (b) the causal inputs of docs/kernels.md's measurement
    (row t keeps min(t + 1, K) ids, the rest -1). The rows give three rates: ``tflops`` counts the 96 useful heads and K
    ids per row (the convention of every row here), ``tflops_128_heads`` the heads the kernel computes, and
    ``tflops_valid_ids`` only the ids that are valid. With (a), 0.75 x ``tflops_128_heads`` is the most any 96-head
    wrapper of this kernel can reach."""
    kwargs = {"use_legacy": True} if sm._flash_mla_arch(q.device) == "legacy" else {}
    q128 = torch.zeros(S, 128, sm.D_QK, device=q.device, dtype=q.dtype)
    q128[:, :H] = q
    t = torch.arange(S, device=q.device)[:, None]
    causal = torch.where(torch.arange(K, device=q.device)[None, :] <= t, idx[:, 0] % (t + 1), -1).to(torch.int32)
    for name, ids, valid in (
        ("all K valid", idx, S * K),
        ("causal, kernels.md inputs", causal[:, None, :].contiguous(), int((causal >= 0).sum())),
    ):
        ms, _ = time_ms(
            lambda ids=ids: sm._flash_mla_sparse_fwd(q128, kv, ids, SM_SCALE, sm.D_V, **kwargs),
            target_s=1.0,
            warmup=2,
            min_reps=3,
            max_reps=50,
        )
        at128 = flops(S) * 128 / H / (ms * 1e-3) / 1e12
        b2b = back_to_back_ms(lambda ids=ids: sm._flash_mla_sparse_fwd(q128, kv, ids, SM_SCALE, sm.D_V, **kwargs))
        row(
            S,
            ms,
            f"flash_mla bare call (h_q 128, {name})",
            tflops_128_heads=round(at128, 1),
            tflops_valid_ids=round(at128 * valid / (S * K), 1),
            bare=True,
            b2b_ms=b2b,
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON file for the result rows (required unless --profile-call)")
    ap.add_argument("--seq-lens", default="8192,32768,65536")
    ap.add_argument("--baseline-seq-lens", default="8192,32768")
    ap.add_argument("--profile-call", type=int, metavar="S", help="only two calls of the default kernel at S")
    ap.add_argument("--no-sweep", action="store_true", help="skip the Triton variant sweep (default variant only)")
    args = ap.parse_args()
    if args.profile_call:
        q, kv, idx = make_inputs(args.profile_call)
        for _ in range(2):  # the first compiles; a profiler skips it
            sm._sparse_mla_fwd_triton(q, kv[:, 0], idx[:, 0], SM_SCALE)
        torch.cuda.synchronize()
        return
    if not args.out:
        ap.error("--out is required")
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}, triton {sm.triton.__version__}", flush=True)
    ceiling, mm_ms = matmul_ceiling()
    print(f"bf16 matmul 8192^3: {mm_ms:.3f} ms, {ceiling:.1f} TFLOP/s (ceiling)", flush=True)
    rows = [
        dict(
            seq_len=8192,
            heads=None,
            topk=None,
            ms=round(mm_ms, 4),
            tflops=round(ceiling, 1),
            ratio_to_matmul_ceiling=1.0,
            impl="torch.matmul bf16 8192^3 (ceiling)",
            kernel="matmul",
            device=dev,
        )
    ]

    def row(S, ms, impl, b2b_ms=None, **extra):
        tf = flops(S) / (ms * 1e-3) / 1e12
        if b2b_ms is not None:  # the same calls issued back to back (_timing.back_to_back_ms)
            extra |= dict(ms_back_to_back=round(b2b_ms, 4), tflops_back_to_back=round(flops(S) / b2b_ms / 1e9, 1))
        r = dict(
            seq_len=S,
            heads=H,
            topk=K,
            ms=round(ms, 4),
            tflops=round(tf, 1),
            ratio_to_matmul_ceiling=round(tf / ceiling, 3),
            impl=impl,
            kernel=impl.split()[0],
            device=dev,
            **extra,
        )
        rows.append(r)
        print(
            f"  S={S:6d} {impl:38s} {ms:9.3f} ms {tf:7.1f} TFLOP/s ({tf / ceiling:.2f} of ceiling) {extra}", flush=True
        )
        return r

    # variant sweep at S = 8192, each checked against the torch baseline on its first rows
    S0 = 8192
    q, kv, idx = make_inputs(S0)
    ref = torch_baseline(q[:1024], kv, idx[:1024]).float()
    best = None
    variants = {"hk-h64-k64-s2": VARIANTS["hk-h64-k64-s2"]} if args.no_sweep else VARIANTS
    for name, cfg in variants.items():
        try:
            t0 = time.perf_counter()
            out, mx, lse, kernels = sm._sparse_mla_fwd_triton(
                q, kv[:, 0], idx[:, 0], SM_SCALE, return_kernels=True, **cfg
            )
            torch.cuda.synchronize()
            comp_s = time.perf_counter() - t0
            rel = ((out[:1024].float() - ref).norm() / ref.norm()).item()
            stats = dict(
                n_regs=[getattr(k, "n_regs", None) for k in kernels],
                n_spills=[getattr(k, "n_spills", None) for k in kernels],
                shared=[k.metadata.shared for k in kernels],
                rel_err_vs_torch=float(f"{rel:.2e}"),
                compile_s=round(comp_s, 1),
            )
            ms, _ = time_ms(
                lambda: sm._sparse_mla_fwd_triton(q, kv[:, 0], idx[:, 0], SM_SCALE, **cfg),
                warmup=2,
                min_reps=3,
                max_reps=50,
            )
            row(S0, ms, f"triton {name}", sweep=True, **stats)
            if rel < 2e-2 and (best is None or ms < best[1]):
                best = (name, ms)
        except Exception as e:  # a variant that does not compile or fit is reported, not fatal
            print(f"  variant {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"best variant: {best}", flush=True)
    for S in [int(s) for s in args.baseline_seq_lens.split(",") if s]:
        if S != S0:
            del q, kv, idx
            q, kv, idx = make_inputs(S, seed=1)
        ms, _ = time_ms(lambda: torch_baseline(q, kv, idx), target_s=0.5, warmup=1, min_reps=3, max_reps=3)
        row(S, ms, "torch gather+einsum (bf16, chunks of 1024)")
    cfg = VARIANTS[best[0]]
    for S in [int(s) for s in args.seq_lens.split(",") if s]:
        del q, kv, idx
        torch.cuda.empty_cache()
        q, kv, idx = make_inputs(S, seed=2)
        ms, _ = time_ms(
            lambda: sm._sparse_mla_fwd_triton(q, kv[:, 0], idx[:, 0], SM_SCALE, **cfg),
            target_s=1.5,
            warmup=2,
            min_reps=3,
            max_reps=50,
        )
        row(S, ms, f"triton {best[0]}")
        why = sm.flash_mla_takes(q)
        if why is not None:
            print(f"  S={S}: FlashMLA not run: {why}", flush=True)
            continue
        out_f, mx_f, lse_f = sm.sparse_mla_fwd(q[:1024], kv, idx[:1024], SM_SCALE, backend="flash_mla")
        out_t, mx_t, lse_t = sm._sparse_mla_fwd_triton(q[:1024], kv[:, 0], idx[:1024, 0], SM_SCALE)
        ref = torch_baseline(q[:1024], kv, idx[:1024]).float()
        stats = dict(
            rel_err_vs_torch=float(f"{((out_f.float() - ref).norm() / ref.norm()).item():.2e}"),
            rel_err_vs_triton=float(f"{((out_f.float() - out_t.float()).norm() / out_t.float().norm()).item():.2e}"),
            lse_max_abs_diff_vs_triton=float(f"{(lse_f - lse_t).abs().max().item():.2e}"),
        )
        ms, _ = time_ms(
            lambda: sm.sparse_mla_fwd(q, kv, idx, SM_SCALE, backend="flash_mla"),
            target_s=1.5,
            warmup=2,
            min_reps=3,
            max_reps=50,
        )
        row(S, ms, "flash_mla sparse_fwd (legacy SM90, H 96->128)", **stats)
        # the layout the DSA layer builds without autograd (padded_q): FlashMLA reads q in place, returns views
        qp = sm.padded_q(S, H, device="cuda")
        qp.copy_(q)
        same = all(
            torch.equal(a, b)
            for a, b in zip(sm.sparse_mla_fwd(qp[:1024], kv, idx[:1024], SM_SCALE), (out_f, mx_f, lse_f))
        )
        ms, _ = time_ms(
            lambda qp=qp: sm.sparse_mla_fwd(qp, kv, idx, SM_SCALE, backend="flash_mla"),
            target_s=1.5,
            warmup=2,
            min_reps=3,
            max_reps=50,
        )
        b2b = back_to_back_ms(lambda qp=qp: sm.sparse_mla_fwd(qp, kv, idx, SM_SCALE, backend="flash_mla"))
        row(
            S,
            ms,
            "flash_mla sparse_fwd, q built with padded_q (no copies)",
            bitwise_equal_to_wrapper=same,
            b2b_ms=b2b,
        )
        del qp
        if S <= 32768:
            bare_rows(S, q, kv, idx, row)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print("\n| seq_len | impl | ms | TFLOP/s | of matmul ceiling | TFLOP/s back to back |\n|---|---|---|---|---|---|")
    for r in rows:
        if not r.get("sweep"):
            b2b = r.get("tflops_back_to_back", "")
            print(
                f"| {r['seq_len']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.1f} | "
                f"{r['ratio_to_matmul_ceiling']:.2f} | {b2b} |"
            )


if __name__ == "__main__":
    main()
