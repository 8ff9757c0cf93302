"""Activation bytes per token per decoder layer, by layer kind and by recompute / offload policy (CPU, no GPU).

One decoder layer of each kind of a preset (default ``k3.1-pro``: ``dense`` layer 0, the first ``kda`` and the first
``dsa`` MoE layer, ``kernels_torch.model.DecoderLayer`` at the preset's real dimensions) runs one forward of ``--seq-len``
tokens in bf16 with autograd on, under each policy of ``--policies`` (``RECOMPUTE+OFFLOAD`` words: recompute ``none``,
``attn``, ``mlp`` or ``layer`` (``kernels_torch.activation_memory.recompute_layers``), offload ``none``, ``all``, ``attn`` or ``mlp``
(``kernels_torch.activation_memory.offload_activations``)). For each it counts, through
``kernels_torch.activation_memory.saved_bytes_by_block`` (``saved_tensors_hooks``, each storage once, parameters not
counted), the bytes autograd keeps on the device until the backward, for the layer and its attention and MLP / MoE
blocks, and the bytes the offload holds in host memory; both divided by the token count. The backward is not run.

What the numbers are: the ``--backend`` path's saved tensors (default ``sdpa``: the eager twin's, which keeps fp32
intermediates in places where the GPU's fused ``cudnn`` kernels keep fewer), with the layer's AttnRes inputs as at its
index in the whole model (``sources_after``). The routed experts are cut to ``--experts`` (default 2 x top-k, so the
CPU holds the layer); the saved bytes depend on top-k and the expert widths, not on the expert count, except the
router's ``[T, E]`` scores (fp32: ``4 E`` bytes per token, given as ``router_bytes_per_token_at_full_e`` to add). The
weights are random (``normal(0, 0.02)``): the routing changes which experts get tokens, not how many rows they hold.
The DSA layer's attention bytes grow with ``T`` up to its top-k (2,048 tokens), so give the planner's length.

    python benchmarks/activation_bytes.py --seq-len 256 --out results/activation_bytes.json

Writes ``{"preset", "seq_len", "dtype", "backend", "experts", "rows": [{"kind", "layer", "recompute", "offload",
"device_bytes_per_token": {"layer", "attn", "mlp"}, "host_bytes_per_token"}], "router_bytes_per_token_at_full_e"}``
and prints a table (KB = 10^3 bytes per token per layer).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_torch.activation_memory import (  # noqa: E402
    layer_kind,
    offload_activations,
    recompute_layers,
    saved_bytes_by_block,  # noqa: E402
)
from kernels_torch.model import DecoderLayer  # noqa: E402
from kernels_torch.parallel.pipeline import sources_after  # noqa: E402
from kimi.config import load_config  # noqa: E402

POLICIES = ("none+none", "attn+none", "mlp+none", "layer+none", "none+attn", "none+mlp", "none+all", "attn+mlp",
            "mlp+attn", "layer+all")  # fmt: skip


class _Holder(nn.Module):
    """Stands for a model with ``model.layers``: a ``ModuleDict`` keyed by the layer's index in the whole model."""

    def __init__(self, idx: int, layer: nn.Module):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(idx): layer})


def build_layer(cfg, idx: int, backend: str, dtype: torch.dtype) -> DecoderLayer:
    """Decoder layer ``idx`` of ``cfg`` on the CPU, ``dtype`` (fp32 where the checkpoint keeps fp32), random weights
    (the layer holds no buffer)."""
    from kernels_torch.model import cast_model

    with torch.device("meta"):
        layer = DecoderLayer(cfg, idx, backend)
    layer = layer.to_empty(device="cpu")
    g = torch.Generator().manual_seed(idx)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02, generator=g)
    holder = _Holder(idx, layer)
    holder.config = cfg
    cast_model(holder, dtype)
    return layer


def measure(cfg, idx: int, layer: DecoderLayer, T: int, policy: str, dtype: torch.dtype) -> dict:
    """One forward of ``layer`` under ``policy``; the policy's wrappers are removed after."""
    rc, off = policy.split("+")
    holder = _Holder(idx, layer)
    if rc != "none":
        recompute_layers(holder, rc)
    stats = offload_activations(holder, off)
    D = cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    n_src = sources_after(cfg, idx) - 1 if cfg.has_attn_res else 0  # stored blocks before this layer
    blocks = [torch.randn(1, T, D, generator=g).to(dtype).requires_grad_() for _ in range(n_src)]
    p = torch.randn(1, T, D, generator=g).to(dtype).requires_grad_()
    cu = torch.tensor([0, T], dtype=torch.int32)
    out = []
    per = saved_bytes_by_block(holder, lambda: out.append(holder.model.layers[str(idx)](blocks, p, cu)))
    host = sum(s["bytes"] for s in stats.values())
    for name in ("forward", "attention", "feed_forward"):  # the wrappers are instance attributes
        layer.__dict__.pop(name, None)
    return {
        "kind": layer_kind(cfg, idx),
        "layer": idx,
        "recompute": rc,
        "offload": off,
        "device_bytes_per_token": {k: v / T for k, v in per[idx].items()},
        "host_bytes_per_token": host / T,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3.1-pro")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--experts", type=int, help="routed experts kept (default 2 x the preset's top-k)")
    ap.add_argument("--backend", default="sdpa", choices=["eager", "sdpa"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kinds", nargs="+", default=["dense", "kda", "dsa"], help="layer kinds (the first layer of each)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), help="RECOMPUTE+OFFLOAD words")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "activation_bytes.json")
    args = ap.parse_args()
    full = load_config(args.preset)
    E = args.experts or 2 * full.num_experts_per_token
    if not full.num_experts_per_token <= E <= full.num_experts:
        ap.error(f"--experts: got {E}, expected [{full.num_experts_per_token}, {full.num_experts}]")
    for pol in args.policies:
        rc, _, off = pol.partition("+")
        if rc not in ("none", "attn", "mlp", "layer") or off not in ("none", "all", "attn", "mlp"):
            ap.error(f"--policies: got {pol!r}, expected RECOMPUTE+OFFLOAD (none|attn|mlp|layer + none|all|attn|mlp)")
    cfg = full.replace(num_experts=E)
    dtype = getattr(torch, args.dtype)
    first = {}
    for i in range(cfg.num_hidden_layers):
        first.setdefault(layer_kind(cfg, i), i)
    missing = [k for k in args.kinds if k not in first]
    if missing:
        ap.error(f"--kinds: got {missing}, expected kinds of {args.preset}: {sorted(first)}")
    rows = []
    for kind in args.kinds:
        layer = build_layer(cfg, first[kind], args.backend, dtype)
        for pol in args.policies:
            t0 = time.perf_counter()
            row = measure(cfg, first[kind], layer, args.seq_len, pol, dtype)
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
        del layer
    out = {
        "preset": args.preset,
        "seq_len": args.seq_len,
        "dtype": args.dtype,
        "backend": args.backend,
        "experts": E,
        "experts_per_token": cfg.num_experts_per_token,
        "router_bytes_per_token_at_full_e": 4 * (full.num_experts - E),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"\n{args.preset}, T = {args.seq_len}, {args.dtype}, {args.backend}, {E} experts; KB per token per layer")
    print(f"{'kind':>6} {'recompute':>9} {'offload':>7} {'device':>8} {'attn':>8} {'mlp':>8} {'host':>8}")
    for r in rows:
        d = r["device_bytes_per_token"]
        print(
            f"{r['kind']:>6} {r['recompute']:>9} {r['offload']:>7} {d['layer'] / 1e3:>8.1f} {d['attn'] / 1e3:>8.1f} "
            f"{d['mlp'] / 1e3:>8.1f} {r['host_bytes_per_token'] / 1e3:>8.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
