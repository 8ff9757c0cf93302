"""Cached generation on one GPU against the memory roofline: prefill tokens/s, and per decode step the bytes it must
read, the GB/s it reaches and the fraction of the bandwidth a device-to-device copy reaches in the same run.

Model: the first ``--layers`` layers of K3.1 Pro (default 4: ``KKKD``, three KDA layers and one DSA layer; real dims,
random weights N(0, 1/in), norms 1), bf16, then the final norm and lm_head, with the routed experts shrunk so the MoE
fits one GPU (``--experts`` / ``--topk`` pairs, default 16 top-8 and 112 top-16). Backend ``cudnn``.

* prefill: one sequence of ``--context`` tokens through ``KimiK3Model.step`` in chunks of ``--chunk-size``; tokens/s
  = context / wall time (CUDA-synchronised, after a warm-up prefill of 2 chunks).
* decode: the prefilled cache replicated into B rows (``ModelCache.rows``), then ``--steps`` steps back to back, timed
  by CUDA events around all of them (host launch time included: what generation pays), in each ``--modes`` of
  ``loop`` (today's cached path: one ``KimiK3Model.step`` a token), ``static`` (``kernels_torch.decode``'s
  static-shape step, uncaptured), ``graph`` (that step in one CUDA graph) and ``compile``
  (``torch.compile(mode="reduce-overhead")``); greedy sampling on the device inside the step (``loop``: argmax).
* bytes a step must read (:func:`step_bytes`, from the parameters and the context): the weights every token uses
  (all but the embedding table and the routed experts), the routed experts the batch picks (``E (1 - (1 - k/E)^B)``
  distinct experts expected for B tokens of k uniform picks each, per MoE layer), and the cache reads (DSA: the
  indexer keys of the whole context and the top-k latent rows; dense MLA: every latent row; KDA: the state).
  GB/s = bytes / step time; ``roofline`` = GB/s over the copy probe's (``copy_(src)`` of 2 GiB: read + write bytes /
  time, the best of 10).
* parts alone: every layer's attention and MLP and the head, each captured in its own CUDA graph and timed alone at
  the same batch and context; where their sum bounds the step below the target (>= 50% of the roofline at batch 1,
  >= 40% at batch 8), the script prints that arithmetic, part by part.

    python3 benchmarks/generate_decode.py --out benchmarks/results/generate_decode.json

About 3 minutes on an H200 with the defaults. Writes a JSON record (config, device, torch version, probe, rows) and
prints a table. ``--bytes-only`` prints the byte model for the configs without a GPU (meta tensors).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels_torch.cache as tc  # noqa: E402
from kernels_torch.decode import Decoder, StaticStep  # noqa: E402
from kernels_torch.model import KimiK3Model, cast_model  # noqa: E402
from kimi.checkpoint import write_atomic  # noqa: E402
from kimi.config import load_config  # noqa: E402

TARGETS = {1: 0.50, 8: 0.40}  # fraction of the roofline a step should reach at that batch (other batches: 0.40)
MODES = ("loop", "static", "graph", "compile")


# ---------------------------------------------------------------------------------------------- the byte model


def _is_routed(name: str) -> bool:
    return ".experts." in name  # experts.{e}.w1.weight (per expert) or experts.w1 (stacked); not shared_experts


def expected_experts(E: int, k: int, B: int) -> float:
    """Distinct experts that B tokens of k distinct uniform picks each touch, in expectation: ``E (1 - (1 - k/E)^B)``."""
    return E * (1.0 - (1.0 - k / E) ** B)


def step_bytes(model: KimiK3Model, B: int, context: int) -> dict:
    """The bytes one decode step of B rows at ``context`` cached tokens must read (module docstring): ``dense``,
    ``routed``, ``cache``, ``total`` (bytes) and ``experts`` (expected distinct per MoE layer)."""
    c = model.config
    dense = routed = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight"):
            dense += B * p.shape[1] * p.element_size()  # B rows of the table
        elif _is_routed(name):
            routed += size
        else:
            dense += size
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    E, k = c.num_experts, c.num_experts_per_token
    n_exp = expected_experts(E, k, B)
    routed_read = routed / E * n_exp if moe_layers else 0.0
    act = 2  # bf16 cache rows
    cache = 0
    for i in range(c.num_hidden_layers):
        kind = c.layer_type(i)
        if kind == "kda":
            cache += B * c.kda_num_heads * c.kda_head_dim * c.kda_head_dim * 4  # the fp32 state
        elif kind == "dsa":
            row = (c.kv_lora_rank + c.qk_rope_head_dim) * act
            cache += B * (context * c.index_head_dim * act + min(c.index_topk, context) * row)
        else:
            cache += B * context * (c.kv_lora_rank + c.qk_rope_head_dim) * act
    return {
        "dense": dense,
        "routed": routed_read,
        "cache": cache,
        "total": dense + routed_read + cache,
        "experts": n_exp,
    }


def config_for(layers: int, experts: int, topk: int, hidden: int | None):
    cfg = load_config("k3.1-pro").truncated(layers).replace(num_experts=experts, num_experts_per_token=topk)
    return cfg.replace(hidden_size=hidden) if hidden else cfg


# ---------------------------------------------------------------------------------------------- GPU pieces


def build(cfg) -> KimiK3Model:
    """Random-weight model on the GPU in bf16 (A_log, dt_bias, conv, o_norm, router bias in fp32 as stored)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = KimiK3Model(cfg, backend="cudnn")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("res_norm.weight"):
                p.fill_(1.0)
            elif p.ndim >= 2 and "conv1d" not in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return cast_model(model, torch.bfloat16).eval()


def copy_probe_gbs(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes over the time), the best of ``reps``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (best * 1e-3) / 1e9


def events_ms(fn, n: int) -> float:
    """Milliseconds per call of ``fn()`` issued ``n`` times back to back between two CUDA events."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def graph_ms(fn, n: int = 20) -> float:
    """``fn()`` captured in its own CUDA graph (after a warm-up call), replayed ``n`` times: ms per replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ms = events_ms(g.replay, n)
    del g
    return ms


@torch.no_grad()
def parts_alone(model, dec: Decoder, context: int) -> list[dict]:
    """Every layer's attention and MLP and the head, each alone in a CUDA graph, at the decoder's batch: name, ms,
    bytes (its parameters, its routed experts, its cache reads)."""
    c, B = model.config, dec.batch
    D = c.hidden_size
    h = torch.randn(B, 1, D, device="cuda", dtype=torch.bfloat16)
    step = StaticStep(dec.cache.layers, dec.cache.pos, dec.cache.latent, dec.kda_kernel)
    saved = dec.cache._state()
    out = []
    n_exp = expected_experts(c.num_experts, c.num_experts_per_token, B)
    for i, layer in enumerate(model.model.layers):
        attn_bytes = sum(p.numel() * p.element_size() for p in layer.self_attn.parameters())
        kind = c.layer_type(i)
        if kind == "kda":
            attn_bytes += B * c.kda_num_heads * c.kda_head_dim**2 * 4
        else:
            row = (c.kv_lora_rank + c.qk_rope_head_dim) * 2
            attn_bytes += B * (
                context * c.index_head_dim * 2 + min(c.index_topk, context) * row if kind == "dsa" else context * row
            )
        ms = graph_ms(lambda layer=layer: layer.attention(h, None, "expanded", step))
        out.append({"part": f"L{i} {kind} attention", "ms": ms, "bytes": attn_bytes})
        mlp_bytes = 0.0
        for name, p in (layer.block_sparse_moe if c.is_moe_layer(i) else layer.mlp).named_parameters():
            size = p.numel() * p.element_size()
            mlp_bytes += size / c.num_experts * n_exp if _is_routed("." + name) else size
        ms = graph_ms(lambda layer=layer: layer.feed_forward(h, False))
        out.append({"part": f"L{i} {'moe' if c.is_moe_layer(i) else 'mlp'}", "ms": ms, "bytes": mlp_bytes})
    w = model.output_weight()
    ms = graph_ms(lambda: model.logits(model.model.norm(h)))
    out.append({"part": "norm + lm_head", "ms": ms, "bytes": w.numel() * w.element_size()})
    dec.cache._restore(saved)
    return out


@torch.no_grad()
def run(cfg, args, probe: float) -> list[dict]:
    model = build(cfg)
    ctx, chunk = args.context, args.chunk_size
    ids = torch.randint(0, cfg.vocab_size, (1, ctx), device="cuda")
    tc.prefill(model, ids[:, : 2 * chunk], tc.init_cache(cfg, 1, 2 * chunk, torch.bfloat16, "cuda"), chunk)  # warm-up
    spare = args.steps * len(args.modes) + 16
    cache = tc.init_cache(cfg, 1, ctx + spare, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _, cache, _ = tc.prefill(model, ids, cache, chunk)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    label = f"E{cfg.num_experts}k{cfg.num_experts_per_token}"
    rows = [{"experts": label, "mode": "prefill", "batch": 1, "context": ctx, "ms": prefill_s * 1e3}]
    rows[-1]["tok_s"] = ctx / prefill_s
    for B in args.batches:
        base = cache.rows([0] * B)
        need = step_bytes(model, B, ctx)
        dec = None
        for mode in args.modes:
            tok = torch.randint(0, cfg.vocab_size, (B,), device="cuda")
            if mode == "loop":
                c = base.copy()

                def one(c=c, state={"tok": tok}, model=model):  # noqa: B006 - the step's own token, fed back
                    logits, _ = model.step(state["tok"][:, None], c)
                    state["tok"] = logits[:, 0].argmax(-1)

            else:
                dec = Decoder(model, B, ctx + spare, mode=mode).load(base)

                def one(dec=dec, state={"tok": tok}):  # noqa: B006
                    state["tok"], _ = dec.step(state["tok"])

            try:
                for _ in range(2):  # warm-up (the graph is captured here; compile compiles)
                    one()
                ms = events_ms(one, args.steps)
            except Exception as e:  # noqa: BLE001 - a mode that cannot run is reported, the others still run
                rows.append({"experts": label, "mode": mode, "batch": B, "context": ctx, "error": repr(e)[:300]})
                print(f"{label} B={B} {mode}: {e!r}", file=sys.stderr)
                continue
            gbs = need["total"] / (ms * 1e-3) / 1e9
            rows.append(
                {
                    "experts": label,
                    "mode": mode,
                    "batch": B,
                    "context": ctx,
                    "ms": ms,
                    "tok_s": B / (ms * 1e-3),
                    "bytes": need,
                    "gb_s": gbs,
                    "roofline": gbs / probe,
                    "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                }
            )
        if dec is not None and not args.no_parts:
            parts = parts_alone(model, dec, ctx)
            rows.append({"experts": label, "mode": "parts", "batch": B, "context": ctx, "parts": parts})
            bound_report(label, B, need, parts, probe)
        del base, dec
        torch.cuda.empty_cache()
    del model, cache
    torch.cuda.empty_cache()
    return rows


def bound_report(label: str, B: int, need: dict, parts: list[dict], probe: float) -> None:
    """Print the arithmetic where the parts, measured alone, bound the step below the target."""
    target = TARGETS.get(B, 0.40)
    total_ms = sum(p["ms"] for p in parts)
    want_ms = need["total"] / (target * probe * 1e9) * 1e3
    best = need["total"] / (total_ms * 1e-3) / 1e9 / probe
    print(
        f"{label} B={B}: parts alone {total_ms:.3f} ms for {need['total'] / 1e9:.2f} GB -> at most {best:.1%} of the "
        f"roofline; the {target:.0%} target needs <= {want_ms:.3f} ms"
    )
    if total_ms <= want_ms:
        return
    print(f"  bound below the target: the parts alone take {total_ms - want_ms:.3f} ms more than the target allows")
    for p in sorted(parts, key=lambda p: -(p["ms"] - p["bytes"] / (probe * 1e9) * 1e3)):
        floor = p["bytes"] / (probe * 1e9) * 1e3
        print(
            f"  {p['part']:>20}: {p['ms']:.3f} ms for {p['bytes'] / 1e6:9.1f} MB = {p['bytes'] / p['ms'] / 1e6:7.1f}"
            f" GB/s ({floor / p['ms']:.0%} of the probe; {p['ms'] - floor:+.3f} ms over its copy-speed time)"
        )


def print_table(rows: list[dict], probe: float) -> None:
    print(f"copy probe: {probe:.0f} GB/s")
    head = f"{'experts':>8} {'mode':>8} {'B':>3} {'context':>8} {'ms':>9} {'tok/s':>9} {'GB/step':>8} {'GB/s':>7} {'roof':>6}"
    print(head)
    for r in rows:
        if r["mode"] == "parts":
            continue
        base = f"{r['experts']:>8} {r['mode']:>8} {r['batch']:>3} {r['context']:>8}"
        if "error" in r:
            print(f"{base} error: {r['error'][:80]}")
        elif r["mode"] == "prefill":
            print(f"{base} {r['ms']:>9.1f} {r['tok_s']:>9.0f}")
        else:
            gb = r["bytes"]["total"] / 1e9
            print(f"{base} {r['ms']:>9.3f} {r['tok_s']:>9.1f} {gb:>8.2f} {r['gb_s']:>7.0f} {r['roofline']:>6.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, nargs="+", default=[16, 112], help="routed experts (K3.1: 896)")
    ap.add_argument("--topk", type=int, nargs="+", default=[8, 16], help="active routed experts (K3.1: 16)")
    ap.add_argument("--hidden-size", type=int, default=None, help="override D (default: K3.1's 7168)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--chunk-size", type=int, default=8192)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per mode and batch size")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["loop", "static", "graph"])
    ap.add_argument("--no-parts", action="store_true", help="skip the parts-alone timings")
    ap.add_argument("--bytes-only", action="store_true", help="print the byte model only (no GPU)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/generate_decode.json"))
    args = ap.parse_args()
    if len(args.experts) != len(args.topk):
        ap.error(f"--experts {args.experts} and --topk {args.topk}: expected as many of each (pairs)")
    configs = [config_for(args.layers, e, k, args.hidden_size) for e, k in zip(args.experts, args.topk)]
    if args.bytes_only:
        for cfg in configs:
            with torch.device("meta"):
                model = cast_model(KimiK3Model(cfg), torch.bfloat16)
            for B in args.batches:
                b = step_bytes(model, B, args.context)
                print(
                    f"E{cfg.num_experts}k{cfg.num_experts_per_token} B={B}: dense {b['dense'] / 1e9:.2f} GB, routed "
                    f"{b['routed'] / 1e9:.2f} GB ({b['experts']:.1f} experts a layer), cache {b['cache'] / 1e9:.3f} "
                    f"GB, total {b['total'] / 1e9:.2f} GB"
                )
        return 0
    if not torch.cuda.is_available():
        print("generate_decode: needs CUDA (or --bytes-only)", file=sys.stderr)
        return 2
    probe = copy_probe_gbs()
    rows = []
    for cfg in configs:
        rows += run(cfg, args, probe)
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "layers": args.layers,
        "layer_types": [configs[0].layer_type(i) for i in range(args.layers)],
        "hidden_size": configs[0].hidden_size,
        "copy_probe_gb_s": probe,
        "targets": TARGETS,
        "rows": rows,
    }
    write_atomic(args.out, json.dumps(record, indent=1, default=float).encode())
    print_table(rows, probe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
