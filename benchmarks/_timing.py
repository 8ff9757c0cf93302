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


def back_to_back_ms(fn, rep_ms: float = 1000.0, warmup_ms: float = 100.0) -> float:
    """Median milliseconds of ``fn()`` issued back to back: ``triton.testing.do_bench`` (events around each call, no
    host sync between calls, the L2 cache flushed before each). The host's launch work for one call then overlaps the
    GPU work of the one before, as inside a model step; :func:`time_ms` instead starts each call from an idle GPU and
    so also counts the host time before its first kernel. Both are reported where they differ."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


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


def categorise(per: dict[str, float], categories, top: int = 30, total: float | None = None) -> dict:
    """Split the kernels of :func:`kernel_ms` over ``categories`` (``((name, (substring, ...)), ...)``, first match
    of a lower-cased kernel name wins, the unmatched are "rest"): total, ms and share per category, and the ``top``
    largest kernels ``[[name, ms], ...]``. ``total`` (default: the sum of ``per``) is for re-splitting a stored
    breakdown from its largest kernels only: what they do not cover is counted as "rest"."""
    cats = {name: 0.0 for name, _ in categories} | {"rest": 0.0}
    for k, ms in per.items():
        low = k.lower()
        cats[next((name for name, keys in categories if any(w in low for w in keys)), "rest")] += ms
    total = sum(per.values()) if total is None else total
    cats["rest"] += total - sum(cats.values())
    return {
        "total_gpu_ms": round(total, 2),
        "ms": {k: round(v, 2) for k, v in cats.items()},
        "share": {k: round(v / total, 3) for k, v in cats.items()} if total else {},
        "top_kernels_ms": [[k[:120], round(v, 3)] for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]],
    }


SYNC_HINTS = ("synchronize", "malloc", "cudafree", "memcpy", "_local_scalar_dense", "aten::item", "cumemalloc")


def idle_report(step, top: int = 10) -> dict:
    """Where the GPU waits during one ``step()``: ``torch.profiler`` with CPU and CUDA activity. Returns the span from
    the first kernel's start to the last one's end, the kernel time inside it (overlaps merged), their difference
    (``idle_ms``), the ``top`` longest gaps between kernels as ``[ms, kernel before, kernel after]``, and the calls
    that can make the host wait or stall the queue (:data:`SYNC_HINTS`: synchronisations, allocations, copies,
    ``.item()``) as ``{name: [calls, CPU ms]}``, and what the caching allocator did during the step
    (``allocator``: the change of its ``cudaMalloc`` / ``cudaFree`` counts and retries, and of reserved GiB)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    allocator = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    allocator["reserved_gib_delta"] = round(
        (after.get("reserved_bytes.all.current", 0) - before.get("reserved_bytes.all.current", 0)) / 2**30, 3
    )
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == DeviceType.CUDA
    )
    if not kernels:
        return {}
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = kernels[0]
    for start, end, name in kernels[1:]:
        if start > cur_end:  # a gap: the GPU had nothing to run
            busy += cur_end - cur_start
            gaps.append([round((start - cur_end) / 1e3, 3), cur_name[:80], name[:80]])
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
        cur_name = name
    busy += cur_end - cur_start
    span = kernels[-1][1] - kernels[0][0]
    calls = {}
    for e in prof.key_averages():
        if any(h in e.key.lower() for h in SYNC_HINTS):
            calls[e.key[:80]] = [e.count, round(e.cpu_time_total / 1e3, 3)]
    return {
        "span_ms": round(span / 1e3, 3),
        "kernel_ms": round(busy / 1e3, 3),
        "idle_ms": round((span - busy) / 1e3, 3),
        "gaps": sorted(gaps, reverse=True)[:top],
        "host_calls": calls,
        "allocator": allocator,
    }
