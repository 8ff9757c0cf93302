"""The speed-up FP8 GEMMs allow benchmark 5's step, from measurements of one run: a bound, and how close FP8 came.

Inputs (one H200 run): ``fp8_gemm.py``'s JSON (the GEMMs alone at the step's shapes, bf16 and FP8) and
``train_step_4layers.py``'s JSON of the same step in bf16 and with ``--fp8``. For each FP8 row and the bf16 row of the
same length and recomputation:

* ``gemm_bf16_ms``: the bf16 time of the GEMMs FP8 takes over in the step, summed from ``fp8_gemm.py``'s rows: the
  4-layer model KKKD (three KDA layers, then one DSA layer; layer 0 with the dense MLP, layers 1-3 with the MoE) has
  the projections of three KDA layers and one DSA layer, layer 0's dense MLP, three MoE layers' shared experts and
  latent projections, and three layers of grouped routed experts. Each counts forward + backward, plus one more
  forward where the step recomputes it (``recompute`` ``mlp``: every MLP / MoE block; ``recompute_full_layers`` N:
  the attention projections of the first N layers too; ``layer``: everything).
* ``rest_ms = bf16 step - gemm_bf16_ms``: the work that stays bf16 (KDA recurrence, sparse attention, indexer,
  norms, permutation, loss, the excluded projections).
* ``bound_ms = rest_ms + gemm_fp8_ms`` (the same sum over the FP8 rows: ``fp8_gemm.py``'s compiled rows, from a
  ``--compile`` run, where the step ran with ``--fp8-compile``; the bf16 rows of the projections the step kept bf16,
  narrower than its ``fp8.min_dim``), ``bound_speedup = bf16 step / bound_ms``
  against the target of 1.3, and ``measured_over_bound = FP8 step / bound_ms`` (within 1.1: the step reached its
  bound to 10%).

    python benchmarks/fp8_bound.py --gemm DIR/fp8_gemm.json --bf16 DIR/train_step_e112.json \
        --fp8 DIR/train_step_e112_fp8.json --out DIR/fp8_bound.json

Writes ``--out`` (JSON: the inputs' paths and one row per FP8 row) and prints a table. Exits 1 when a GEMM the
bound needs is missing from ``--gemm`` (a row with an ``error``, or a token count or expert count not measured).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_gemm import LAYER_PARTS  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

TARGET = 1.3
ATTENTION = {"kda": "kda", "dsa": "dsa"}  # layer kind -> LAYER_PARTS entry of its attention projections


def _part_ms(gemm: dict, part: str, tokens: int, mode: str, experts: int, min_dim: int = 0) -> tuple[float, float]:
    """(forward, forward + backward) milliseconds of one layer part at ``tokens`` in ``mode``; in an FP8 mode a
    projection narrower than ``min_dim`` (``min(in, out)``: the step kept it bf16, ``kernels_torch.fp8``'s rule)
    counts its bf16 row.

    Raises:
        KeyError: a projection or the grouped experts of that part not measured without error.
    """
    if part == "experts":
        grouped_mode = "bf16" if mode == "bf16" else "fp8_rowwise"  # the grouped experts run rowwise in every recipe
        for r in gemm["grouped"]:
            if (r["experts"], r["tokens"], r["mode"]) == (experts, tokens, grouped_mode) and "fwd_bwd_ms" in r:
                return r["fwd_ms"], r["fwd_bwd_ms"]
        raise KeyError(f"grouped experts E={experts} at {tokens} tokens, {grouped_mode}")
    fwd = both = 0.0
    for name in LAYER_PARTS[part]:
        row = _dense_row(gemm, name, tokens, mode)
        if mode != "bf16" and min(row.get("in", min_dim), row.get("out", min_dim)) < min_dim:
            row = _dense_row(gemm, name, tokens, "bf16")  # kept bf16 by the step's min_dim
        fwd, both = fwd + row["fwd_ms"], both + row["fwd_bwd_ms"]
    return fwd, both


def _dense_row(gemm: dict, name: str, tokens: int, mode: str) -> dict:
    """``fp8_gemm.py``'s dense row of projection ``name`` at ``tokens`` in ``mode`` (KeyError when not measured)."""
    for r in gemm["dense"]:
        if name in r["names"] and r["tokens"] == tokens and r["mode"] == mode and "fwd_bwd_ms" in r:
            return r
    raise KeyError(f"{name} at {tokens} tokens, {mode}")


def step_gemm_ms(gemm: dict, row: dict, mode: str) -> tuple[float, list[str]]:
    """Milliseconds of the FP8-able GEMMs of benchmark 5's step ``row`` in ``mode`` (``bf16`` or ``fp8_<recipe>``),
    with the recomputed forwards, and the parts counted (``"3 x kda"``, ``"+fwd dense_mlp0"``, ...). The projections
    narrower than the row's ``fp8.min_dim`` count their bf16 time."""
    T, E = row["seq_len"], row["experts"]
    min_dim = int((row.get("fp8") or {}).get("min_dim") or 0)
    kinds = row["layers"]  # e.g. ["kda", "kda", "kda", "dsa"]
    recompute, full = row.get("recompute") or None, row.get("recompute_full_layers") or 0
    ms, parts = 0.0, []

    def add(part: str, n: int, recomputed: bool) -> None:
        nonlocal ms
        fwd, both = _part_ms(gemm, part, T, mode, E, min_dim)
        ms += n * (both + (fwd if recomputed else 0.0))
        parts.append(f"{n} x {part}" + (" (+fwd)" if recomputed else ""))

    for i, kind in enumerate(kinds):
        add(ATTENTION[kind], 1, recompute == "layer" or i < full)
    ffn_recomputed = recompute in ("layer", "mlp")
    add("dense_mlp0", 1, ffn_recomputed)  # layer 0: first_k_dense_replace = 1
    add("moe_dense", len(kinds) - 1, ffn_recomputed)
    add("experts", len(kinds) - 1, ffn_recomputed)
    return ms, parts


def bound_rows(gemm: dict, bf16: dict, fp8: dict) -> list[dict]:
    out = []
    for r8 in fp8["rows"]:
        key = (r8["seq_len"], r8.get("recompute"), r8.get("recompute_full_layers"), r8["backend"])
        r16 = next(
            (
                r
                for r in bf16["rows"]
                if (r["seq_len"], r.get("recompute"), r.get("recompute_full_layers"), r["backend"]) == key
            ),
            None,
        )
        row = {
            "seq_len": key[0],
            "recompute": key[1],
            "recompute_full_layers": key[2],
            "backend": key[3],
            "experts": r8["experts"],
            "recipe": (r8.get("fp8") or {}).get("recipe"),
        }
        if not (r8.get("ms") and r16 and r16.get("ms")):
            row["status"] = f"no pair: fp8 {r8.get('status')}, bf16 {r16.get('status') if r16 else 'no row'}"
            out.append(row)
            continue
        compiled = bool((r8.get("fp8") or {}).get("compiled"))  # --fp8-compile: fp8_gemm.py's compiled rows
        mode = f"fp8_{row['recipe']}" + ("_compiled" if compiled else "")
        row["compiled"] = compiled
        g16, parts = step_gemm_ms(gemm, r16, "bf16")
        g8, _ = step_gemm_ms(gemm, r8, mode)
        rest = r16["ms"] - g16
        bound = rest + g8
        row.update(
            status="ok",
            bf16_step_ms=r16["ms"],
            fp8_step_ms=r8["ms"],
            gemm_bf16_ms=g16,
            gemm_fp8_ms=g8,
            gemm_parts=parts,
            rest_ms=rest,
            bound_ms=bound,
            bound_speedup=r16["ms"] / bound,
            measured_speedup=r16["ms"] / r8["ms"],
            measured_over_bound=r8["ms"] / bound,
            target_speedup=TARGET,
        )
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemm", type=Path, required=True, help="fp8_gemm.py's JSON")
    ap.add_argument("--bf16", type=Path, required=True, help="train_step_4layers.py's JSON, bf16")
    ap.add_argument("--fp8", type=Path, required=True, help="train_step_4layers.py's JSON, --fp8")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    gemm, bf16, fp8 = (json.loads(p.read_text()) for p in (args.gemm, args.bf16, args.fp8))
    try:
        rows = bound_rows(gemm, bf16, fp8)
    except KeyError as e:
        print(f"--gemm {args.gemm}: no measurement of {e.args[0]}, which the bound needs", file=sys.stderr)
        return 1
    inputs = {"gemm": str(args.gemm), "bf16": str(args.bf16), "fp8": str(args.fp8)}
    args.out.write_text(json.dumps({"inputs": inputs, "rows": rows}, indent=1))
    print(
        f"{'T':>6} {'recompute':>9} {'E':>4} {'bf16 ms':>8} {'GEMM bf16':>9} {'rest':>7} {'GEMM fp8':>8} "
        f"{'bound':>7} {'bound x':>7} {'fp8 ms':>8} {'fp8 x':>6} {'fp8/bound':>9}"
    )
    for r in rows:
        rc = f"{r['recompute']}" + (f"+{r['recompute_full_layers']}" if r["recompute_full_layers"] else "")
        if r["status"] != "ok":
            print(f"{r['seq_len']:>6} {rc:>9} {r['experts']:>4} {r['status']}")
            continue
        print(
            f"{r['seq_len']:>6} {rc:>9} {r['experts']:>4} {r['bf16_step_ms']:8.1f} {r['gemm_bf16_ms']:9.1f} "
            f"{r['rest_ms']:7.1f} {r['gemm_fp8_ms']:8.1f} {r['bound_ms']:7.1f} {r['bound_speedup']:7.2f} "
            f"{r['fp8_step_ms']:8.1f} {r['measured_speedup']:6.2f} {r['measured_over_bound']:9.3f}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
