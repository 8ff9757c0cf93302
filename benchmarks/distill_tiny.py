"""Measured effect of the indexer distillation (DeepSeek-V3.2's two stages) on a small model trained here, on CPU.

    python benchmarks/distill_tiny.py [--data ../shared/data/tinyshakespeare.txt] [--out runs/distill_tiny]

1. **Dense base**: the ``tiny`` preset (9 layers, 3 DSA layers, ``index_topk`` 64) run dense (every visible key
   selected) and trained with the LM loss for ``--base-steps`` on the text (``kimi train --stage lm``; the indexers
   stay at their random init).
2. **Fresh indexer**: recall of the untouched indexers (share of the dense head-summed attention mass on their
   64 selected keys, averaged over held-out queries and DSA layers; also over the queries with > 64 visible keys).
3. **Warm-up** (``--stage indexer-warmup``, ``--warmup-steps``): recall again.
4. **Sparse stage** (``--stage sparse``, ``--sparse-steps``, top-64 of 256 tokens) from the warmed-up model, against
   (a) the dense model trained with the LM loss for the same steps from the same base and (b) the sparse stage from
   the fresh indexer (no warm-up): held-out LM loss at equal steps.

Writes ``benchmarks/results/distill_tiny.json`` and ``.md`` (a table). One CPU thread (the shared 2-core machines
thrash with more); about 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels_torch.model import load_model  # noqa: E402
from kimi.checkpoint import write_atomic  # noqa: E402
from kimi.config import load_config  # noqa: E402
from kimi.init import init_checkpoint  # noqa: E402
from kimi_tools.distill import DENSE_TOPK, capture_dsa_inputs, dense_selection, dsa_layers, layer_terms  # noqa: E402
from kimi_tools.train import TrainArgs, train  # noqa: E402


def set_topk(ckpt: Path, topk: int) -> None:
    """Rewrite ``dsa_config.index_topk`` of a checkpoint's config.json (the weights do not depend on it)."""
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    cfg["text_config"]["dsa_config"]["index_topk"] = topk
    write_atomic(path, json.dumps(cfg, indent=1).encode())


def recall_on(ckpt: Path, ids: torch.Tensor, topk: int) -> dict:
    """Dense-view recall on held-out rows: over all queries, and over the queries with more than ``topk`` keys."""
    model = load_model(ckpt, backend="eager")
    all_q, far_q = [], []
    for r in range(ids.shape[0]):
        with torch.no_grad(), capture_dsa_inputs(model) as seen, dense_selection(model):
            model(ids[r : r + 1])
        rq = [layer_terms(a, seen[i]["x"], None, "warmup")["recall"][0] for i, a in dsa_layers(model).items()]
        all_q.append(float(torch.stack(rq).mean()))
        far_q.append(float(torch.stack(rq)[:, topk:].mean()))
    return {"recall_all_queries": sum(all_q) / len(all_q), "recall_beyond_topk": sum(far_q) / len(far_q)}


def run(args_: argparse.Namespace, **kw) -> dict:
    t0 = time.perf_counter()
    res = train(TrainArgs(**kw, quiet=True))
    evals = [r for r in res.records if r.get("eval_loss") is not None]
    return {"wall_s": round(time.perf_counter() - t0, 1), "evals": evals, "out": str(res.out)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shared = [d / "shared" / "data" / "tinyshakespeare.txt" for d in (ROOT.parent, ROOT.parents[1])]
    p.add_argument("--data", default=str(next((f for f in shared if f.is_file()), shared[0])))
    p.add_argument("--out", default=str(ROOT / "runs" / "distill_tiny"))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--base-steps", type=int, default=150)
    p.add_argument("--warmup-steps", type=int, default=60)
    p.add_argument("--sparse-steps", type=int, default=60)
    p.add_argument("--eval-rows", type=int, default=4)
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "distill_tiny"))
    a = p.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = load_config("tiny")
    topk = cfg.index_topk
    common = dict(data=[a.data], seq_len=a.seq_len, backend="eager", eval_tokens=4 * a.seq_len, seed=0)

    # 1. dense base
    init_checkpoint(out / "init", cfg.replace(index_topk=DENSE_TOPK), seed=0)
    base = run(
        a,
        out=str(out / "base"),
        checkpoint=str(out / "init"),
        steps=a.base_steps,
        lr=3e-3,
        eval_every=a.base_steps,
        warmup_steps=min(10, a.base_steps - 1),
        **common,
    )
    # the tail of the text, held out (as kimi train's eval split), in rows of seq_len tokens
    text = Path(a.data).read_text(encoding="utf-8")
    ids_all = torch.tensor(list(text[-(a.eval_rows * a.seq_len + 1000) :].encode("utf-8"))[: a.eval_rows * a.seq_len])
    ids = ids_all.view(a.eval_rows, a.seq_len)

    # 2. fresh indexer
    for name in ("base",):
        set_topk(out / name, topk)
    fresh = recall_on(out / "base", ids, topk)

    # 3. warm-up
    wu = run(
        a,
        out=str(out / "warmup"),
        checkpoint=str(out / "base"),
        steps=a.warmup_steps,
        lr=1e-2,
        stage="indexer-warmup",
        eval_every=a.warmup_steps,
        warmup_steps=min(5, a.warmup_steps - 1),
        **common,
    )
    warm = recall_on(out / "warmup", ids, topk)

    # 4. sparse stage vs dense LM at equal steps, and sparse without warm-up
    steps = dict(
        steps=a.sparse_steps,
        lr=1e-3,
        eval_every=max(1, a.sparse_steps // 4),
        warmup_steps=min(5, a.sparse_steps - 1),
        **common,
    )
    sparse = run(a, out=str(out / "sparse"), checkpoint=str(out / "warmup"), stage="sparse", **steps)
    sparse_cold = run(a, out=str(out / "sparse_cold"), checkpoint=str(out / "base"), stage="sparse", **steps)
    shutil.copytree(out / "base", out / "base_dense", ignore=shutil.ignore_patterns("step-*", "metrics.jsonl"))
    set_topk(out / "base_dense", DENSE_TOPK)
    dense = run(a, out=str(out / "dense"), checkpoint=str(out / "base_dense"), stage="lm", **steps)

    def curve(r, key):
        return [(e["step"], round(e.get(key) if e.get(key) is not None else e["eval_loss"], 4)) for e in r["evals"]]

    result = {
        "command": "python benchmarks/distill_tiny.py " + " ".join(sys.argv[1:]),
        "config": {
            "preset": "tiny",
            "index_topk": topk,
            "seq_len": a.seq_len,
            "data": Path(a.data).name,
            "base_steps": a.base_steps,
            "warmup_steps": a.warmup_steps,
            "sparse_steps": a.sparse_steps,
            "threads": 1,
        },
        "dense_base_eval_loss": base["evals"][-1]["eval_loss"],
        "recall_fresh_indexer": fresh,
        "recall_after_warmup": warm,
        "warmup_eval_kl": curve(wu, "eval_kl"),
        "eval_lm_loss": {
            "sparse_after_warmup": curve(sparse, "eval_lm_loss"),
            "sparse_fresh_indexer": curve(sparse_cold, "eval_lm_loss"),
            "dense": curve(dense, "eval_loss"),
        },
        "wall_s": {
            k: v["wall_s"]
            for k, v in {
                "base": base,
                "warmup": wu,
                "sparse": sparse,
                "sparse_cold": sparse_cold,
                "dense": dense,
            }.items()
        },
    }
    res = Path(a.results)
    res.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(res.with_suffix(".json"), json.dumps(result, indent=1).encode())
    L = result["eval_lm_loss"]
    lines = [
        f"# Indexer distillation on `tiny` ({a.data and Path(a.data).name}, {a.seq_len}-token rows, top-{topk})",
        "",
        f"Command: `{result['command']}`",
        "",
        "| indexer | recall (all queries) | recall (queries with > k keys) |",
        "|---|---|---|",
        f"| fresh (random init) | {fresh['recall_all_queries']:.3f} | {fresh['recall_beyond_topk']:.3f} |",
        f"| after {a.warmup_steps} warm-up steps | {warm['recall_all_queries']:.3f} | {warm['recall_beyond_topk']:.3f} |",
        "",
        f"Held-out LM loss after {a.sparse_steps} more steps from the dense base "
        f"(base: {result['dense_base_eval_loss']:.4f}):",
        "",
        "| model | " + " | ".join(f"step {s}" for s, _ in L["dense"]) + " |",
        "|---|" + "---|" * len(L["dense"]),
    ]
    for name, c in L.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for _, v in c) + " |")
    write_atomic(res.with_suffix(".md"), ("\n".join(lines) + "\n").encode())
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
