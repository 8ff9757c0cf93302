"""CUDA-event timing shared by the benchmark scripts (METHOD.md: warm up, then the median of event-timed calls)."""

from __future__ import annotations

import statistics
import time

import torch


def time_ms(fn, target_s: float = 1.0, warmup: int = 1, min_reps: int = 1, max_reps: int = 20) -> tuple[float, int]:
    """Median milliseconds of ``fn()`` over a number of repeats sized to take about ``target_s`` seconds
    (clamped to ``[min_reps, max_reps]``), after ``warmup`` untimed calls. Returns ``(median_ms, reps)``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()  # one host-timed call to size the repeats
    torch.cuda.synchronize()
    est = time.perf_counter() - t0
    reps = max(min_reps, min(max_reps, int(target_s / max(est, 1e-6))))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), reps


def kernel_ms(step) -> dict[str, float]:
    """GPU milliseconds per kernel name of one ``step()`` (``torch.profiler``, CUDA activity, self device time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            per[e.key] = per.get(e.key, 0.0) + t / 1e3
    return per


def categorise(per: dict[str, float], categories, top: int = 30) -> dict:
    """Split the kernels of :func:`kernel_ms` over ``categories`` (``((name, (substring, ...)), ...)``, first match
    of a lower-cased kernel name wins, the unmatched are "rest"): total, ms and share per category, and the ``top``
    largest kernels ``[[name, ms], ...]``."""
    cats = {name: 0.0 for name, _ in categories} | {"rest": 0.0}
    for k, ms in per.items():
        low = k.lower()
        cats[next((name for name, keys in categories if any(w in low for w in keys)), "rest")] += ms
    total = sum(per.values())
    return {
        "total_gpu_ms": round(total, 2),
        "ms": {k: round(v, 2) for k, v in cats.items()},
        "share": {k: round(v / total, 3) for k, v in cats.items()} if total else {},
        "top_kernels_ms": [[k[:120], round(v, 3)] for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]],
    }
