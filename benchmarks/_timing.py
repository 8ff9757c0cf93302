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
