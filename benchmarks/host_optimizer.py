"""The host side of ``kimi train --offload cpu``, measured: the optimizer step on host tensors, and FSDP2's gradient
copy to the host when a micro-batch's gradient adds to the last one's (FSDP2's own way, and the trainer's).

Under ``--offload cpu`` FSDP2 (``CPUOffloadPolicy``) keeps each rank's parameter shards, their gradients and the
optimizer states in host memory, so two host costs enter the step that the device's rates do not give:

* ``optimizer``: one ``step_optimizer`` (the trainer's own: ``kimi_tools.train.weights``) over ``--numel`` parameters
  on the host, cut into tensors of a decoder layer's shapes: ``adamw-bf16`` (torchao's AdamW, bf16 moments,
  stochastic rounding, run eagerly on the host) and ``adamw-fp32`` (``torch.optim.AdamW``, fp32 moments). Reported
  as seconds per 10^9 parameters, using ``torch.get_num_threads()`` host threads.
* ``grad_accumulate`` (CUDA only): FSDP2's reduce-scattered gradient going to the host. The first micro-batch of a
  step copies it by a ``non_blocking`` copy into pinned memory; every later one (a gradient already there to add to)
  copies it blocking into new pageable memory and adds on the host (torch's ``foreach_reduce``). The trainer takes
  the host gradients out of ``.grad`` between micro-batches (``kernels_torch.parallel.fsdp.HostGradSums``), so every
  micro-batch copies the first way and then adds on the host into a held pinned accumulator. The three are timed per
  10^9 bytes of bf16 gradient: ``first_s_per_gb``, ``accumulate_s_per_gb`` (FSDP2's later micro-batches) and
  ``taken_s_per_gb`` (the trainer's later micro-batches: the first kind of copy, the wait, the host add).

Writes ``{"device", "torch", "threads", "date", "optimizer": {name: {"s_per_gparam", ...}}, "grad_accumulate": ...}``
to ``--out`` and prints a table.

    python benchmarks/host_optimizer.py --numel 1e9 --out results/host_optimizer.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

# a K3.1-sized layer's matrices (rows, cols): attention projections and one expert's three matrices
SHAPES = ((7168, 2048), (2048, 7168), (4096, 7168), (7168, 4096))


def _tensors(numel: float, dtype: torch.dtype) -> list[torch.Tensor]:
    out, left, i = [], int(numel), 0
    while left > 0:
        r, c = SHAPES[i % len(SHAPES)]
        n = min(left, r * c)
        out.append(torch.randn(n, dtype=dtype) * 0.02)
        left -= n
        i += 1
    return out


def optimizer_step(name: str, numel: float, steps: int) -> dict:
    """Seconds per 10^9 host parameters of one trainer optimizer step (the median of ``steps`` after a first)."""
    from kimi_tools.train.weights import _torchao_adamw, step_optimizer

    a = SimpleNamespace(optimizer=name, seed=0, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, device="cpu")
    dtype = torch.bfloat16 if name == "adamw-bf16" else torch.float32
    params = [torch.nn.Parameter(t) for t in _tensors(numel, dtype)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    groups = [{"params": params, "weight_decay": a.weight_decay}]
    if name == "adamw-bf16":
        opt = _torchao_adamw()(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=1e-8, bf16_stochastic_round=True)
    else:
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2))
    times = []
    for s in range(steps + 1):
        t0 = time.perf_counter()
        step_optimizer(opt, a, s + 1)
        if s:
            times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    return {"numel": int(numel), "tensors": len(params), "s_per_step": med, "s_per_gparam": med / (numel / 1e9)}


def grad_accumulate(gb: float, repeats: int) -> dict:
    """FSDP2's two host copies of a reduce-scattered bf16 gradient of ``gb`` GB (in tensors of a layer's shapes):
    the first micro-batch's (non-blocking, into pinned memory) and a later one's (blocking, into new pageable memory,
    then added on the host); and the trainer's later micro-batch under ``HostGradSums`` (the first kind of copy,
    then added on the host into the held pinned sums)."""
    dev = [t.cuda() for t in _tensors(gb * 1e9 / 2, torch.bfloat16)]
    nbytes = sum(t.numel() * 2 for t in dev)
    acc = [t.to("cpu") for t in dev]
    held = [t.to("cpu").pin_memory() for t in dev]  # HostGradSums' accumulator: the first micro-batch's pinned copy

    def first():
        out = [t.to("cpu", non_blocking=True) for t in dev]
        torch.cuda.synchronize()
        return out

    def later():
        for h, t in zip(acc, dev):
            h += t.to("cpu")

    def taken():
        for h, t in zip(held, first()):  # first(): the copies and the wait (FSDP2's finalize_backward)
            h.add_(t)

    res = {"gb": nbytes / 1e9}
    for name, fn in (("first", first), ("accumulate", later), ("taken", taken)):
        times = []
        for r in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if r:
                times.append(time.perf_counter() - t0)
        times.sort()
        res[f"{name}_s_per_gb"] = times[len(times) // 2] / (nbytes / 1e9)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=float, default=1e9, help="host parameters of the optimizer step")
    ap.add_argument("--optimizers", nargs="+", default=["adamw-bf16", "adamw-fp32"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--grad-gb", type=float, default=4.0, help="GB of bf16 gradient for grad_accumulate (CUDA)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%F"),
        "optimizer": {},
    }
    for name in args.optimizers:
        r = optimizer_step(name, args.numel, args.steps)
        report["optimizer"][name] = r
        print(
            f"optimizer {name:11s} {r['numel'] / 1e9:5.2f} G params: {r['s_per_gparam']:7.2f} s per G params",
            flush=True,
        )
    if torch.cuda.is_available():
        r = report["grad_accumulate"] = grad_accumulate(args.grad_gb, args.steps)
        print(
            f"grad to host {r['gb']:.1f} GB: first {r['first_s_per_gb']:.3f} s/GB, accumulate "
            f"{r['accumulate_s_per_gb']:.3f} s/GB, taken {r['taken_s_per_gb']:.3f} s/GB",
            flush=True,
        )
    if args.out:
        from kimi.checkpoint import write_atomic

        write_atomic(args.out, json.dumps(report, indent=1).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
