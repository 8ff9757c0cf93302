"""Cached generation on one GPU: prefill tokens/s and decode tokens/s at batch 1 and 8 with a 32K-token context.

Model: the first ``--layers`` layers of K3.1 Pro (default 4: ``KKKD``, three KDA layers and one DSA layer; real
dims, random weights N(0, 1/in), norms 1), bf16, then the final norm and lm_head, with the routed experts shrunk so
the MoE fits one GPU as in benchmark 5 (``--experts``, default 16 of which 8 are active per token); ``--hidden-size``
shrinks D (attention and KDA head dims stay real) when memory is short. Backend ``cudnn`` by default
(``kernels_torch.decode_cudnn``: fla's ``fused_recurrent_kda`` for KDA decode, the indexer over the cached keys and
the Triton sparse MLA over the selected latent rows); ``--backends cudnn,sdpa`` adds the dense baseline.

* prefill: one sequence of ``--context`` tokens through ``kernels_torch.cache.prefill`` in chunks of
  ``--chunk-size``; tokens/s = context / wall time (CUDA-synchronised, after one warm-up prefill of 2 chunks).
* decode: the prefilled cache replicated into B rows (``ModelCache.rows``, nanochat's batch-1 prefill copied into
  N decode rows), then one call per token; tokens/s = B / median step time (CUDA events, ``_timing.time_ms``);
  every timed step extends the context by one token.

    python3 benchmarks/generate_decode.py --context 32768 --batches 1 8 --out benchmarks/results/generate_decode.json

Writes a JSON record (config, device, torch version, rows) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import time_ms  # noqa: E402

import kernels_torch.cache as tc  # noqa: E402
from kernels_torch.model import KimiK3Model  # noqa: E402
from kimi.config import load_config  # noqa: E402


def build(cfg, backend: str) -> KimiK3Model:
    """Random-weight model on the GPU in bf16 (A_log, dt_bias, conv, o_norm, router bias in fp32 as stored)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = KimiK3Model(cfg, backend=backend)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("res_norm.weight"):
                p.fill_(1.0)
            elif p.ndim >= 2 and "conv1d" not in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    from kernels_torch.model import cast_model

    return cast_model(model, torch.bfloat16).eval()


@torch.no_grad()
def run(backend: str, cfg, context: int, chunk: int, batches: list[int], steps: int) -> list[dict]:
    model = build(cfg, backend)
    ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda")
    warm = tc.init_cache(cfg, 1, 2 * chunk, torch.bfloat16, "cuda")
    tc.prefill(model, ids[:, : 2 * chunk], warm, chunk)  # warm-up: kernels compiled / autotuned
    cache = tc.init_cache(cfg, 1, context + steps + 8, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _, cache, _ = tc.prefill(model, ids, cache, chunk)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    rows = [
        {
            "backend": backend,
            "phase": "prefill",
            "batch": 1,
            "context": context,
            "chunk": chunk,
            "ms": prefill_s * 1e3,
            "tok_s": context / prefill_s,
        }
    ]
    for B in batches:
        c = cache.rows([0] * B)
        tok = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda")

        def step():
            nonlocal c
            _, c = model(tok, cache=c)

        ms, reps = time_ms(step, target_s=2.0, warmup=2, min_reps=5, max_reps=steps)
        rows.append(
            {
                "backend": backend,
                "phase": "decode",
                "batch": B,
                "context": context,
                "reps": reps,
                "ms": ms,
                "tok_s": B / (ms / 1e3),
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16, help="routed experts (K3.1: 896)")
    ap.add_argument("--experts-per-token", type=int, default=8, help="active routed experts per token (K3.1: 16)")
    ap.add_argument("--hidden-size", type=int, default=None, help="override D (default: K3.1's 7168)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--chunk-size", type=int, default=8192)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=32, help="at most this many timed decode steps per batch size")
    ap.add_argument("--backends", default="cudnn")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/generate_decode.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("generate_decode: needs CUDA", file=sys.stderr)
        return 2
    cfg = (
        load_config("k3.1-pro")
        .truncated(args.layers)
        .replace(num_experts=args.experts, num_experts_per_token=args.experts_per_token)
    )
    if args.hidden_size:
        cfg = cfg.replace(hidden_size=args.hidden_size)
    rows = []
    for backend in args.backends.split(","):
        rows += run(backend, cfg, args.context, args.chunk_size, args.batches, args.steps)
        torch.cuda.empty_cache()
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "layers": cfg.num_hidden_layers,
        "layer_types": [cfg.layer_type(i) for i in range(cfg.num_hidden_layers)],
        "hidden_size": cfg.hidden_size,
        "experts": [cfg.num_experts, cfg.num_experts_per_token],
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    with open(tmp, "w") as f:  # atomic: temp file, fsync, rename
        f.write(json.dumps(record, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, args.out)
    print(f"{'backend':>8} {'phase':>8} {'B':>3} {'context':>8} {'ms':>10} {'tok/s':>10}")
    for r in rows:
        print(
            f"{r['backend']:>8} {r['phase']:>8} {r['batch']:>3} {r['context']:>8} {r['ms']:>10.2f} {r['tok_s']:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
