"""Quick facts of the GPU stack before the long runs (run_h200.sh step ``probe``): versions, FlashMLA's sparse forward
on a small case (lse units, empty rows), cuDNN's KDA op signature and one small forward + backward through
``kernels_torch.kda_cudnn.kda_recurrence_cudnn`` against fla's ``chunk_kda`` (which engine cuDNN picks, first-call
time).

    python3 benchmarks/probe_h200.py
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels_torch.kda as tk  # noqa: E402
import kernels_torch.kda_cudnn as kc  # noqa: E402
from kernels_torch.ops import sparse_mla as sm  # noqa: E402


def section(name, fn):
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        fn()
    except Exception:  # noqa: BLE001 - a probe reports, it does not stop
        traceback.print_exc()
    print(f"== {name}: {time.perf_counter() - t0:.1f} s", flush=True)


def versions():
    print(torch.cuda.get_device_name(), torch.cuda.get_device_capability(), torch.__version__)
    for mod in ("cudnn", "flash_mla", "fla", "triton", "jax"):
        try:
            print(mod, getattr(importlib.import_module(mod), "__version__", "?"))
        except Exception as e:  # noqa: BLE001
            print(mod, "not importable:", e)


def flash_mla():
    print("flash_mla_takes:", sm.flash_mla_takes(torch.empty(1, 96, 576, device="cuda")))
    T, S, K = 300, 1000, 256
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, 96, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(S, 1, 576, device="cuda", generator=g).bfloat16()
    idx = torch.randint(-1, S, (T, 1, K), device="cuda", generator=g, dtype=torch.int32)
    idx[0] = -1
    out, mx, lse = sm.sparse_mla_fwd(q, kv, idx, 192**-0.5, backend="flash_mla")
    r_out, r_mx, r_lse = sm.sparse_mla_fwd_reference(q, kv, idx, 192**-0.5)
    fin = torch.isfinite(r_lse)
    print("out rel err", ((out.float() - r_out).norm() / r_out.norm()).item())
    print("lse max abs err (natural log)", (lse - r_lse)[fin].abs().max().item())
    print("empty row: out", out[0].abs().max().item(), "lse", lse[0, :2].tolist(), "max", mx[0, :2].tolist())


def kda():
    mod = importlib.import_module("cudnn.linear_attention.ops.kda")
    print("op schema:", torch.ops.cudnn.kimi_delta_attention_fwd.default._schema)
    print("why not:", kc.cudnn_kda_unavailable(torch.empty(1, device="cuda"), 128, 128))
    T, H, K = 1024, 96, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q = tk.l2norm(torch.randn(1, T, H, K, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    k = tk.l2norm(torch.randn(1, T, H, K, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    v = torch.randn(1, T, H, K, device="cuda", generator=g).bfloat16().requires_grad_(True)
    gg = (-5 * torch.sigmoid(torch.randn(1, T, H, K, device="cuda", generator=g))).requires_grad_(True)
    beta = torch.sigmoid(torch.randn(1, T, H, device="cuda", generator=g)).requires_grad_(True)
    S0 = torch.randn(1, H, K, K, device="cuda", generator=g).requires_grad_(True)
    t0 = time.perf_counter()
    o, S = kc.kda_recurrence_cudnn(q, k, v, gg, beta, S0)
    torch.cuda.synchronize()
    print(f"first forward {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    (o.float().sum() + S.sum()).backward()
    torch.cuda.synchronize()
    print(f"first backward {time.perf_counter() - t0:.1f} s")
    for cache in ("fprop_cache", "bprop_cache"):
        for val in getattr(mod, cache, {}).values():
            graph = val[0] if isinstance(val, tuple) else val
            name = getattr(graph, "selected_engine", None)
            print(cache, "engine:", getattr(name, "name", name))
    from fla.ops.kda import chunk_kda

    o2, S2 = chunk_kda(q, k, v, gg, beta, scale=K**-0.5, initial_state=S0, output_final_state=True)
    print("cudnn vs chunk_kda: out", ((o.float() - o2.float()).norm() / o2.float().norm()).item())
    print("cudnn vs chunk_kda: S", ((S - S2).norm() / S2.norm()).item())


if __name__ == "__main__":
    section("versions", versions)
    section("flash_mla", flash_mla)
    section("kda", kda)
