"""The equivalence harness: run the JAX reference and torch backends on the same token ids, compare layer by layer.

Per layer (both paths return the same intermediates, see ``reference_jax.model``): relative error
``||x - ref|| / ||ref||`` and max abs error of the attention output, the MLP output and the residual stream (the
AttnRes partial sum). DSA layers: agreement of the selected key sets **modulo ties** -- a row counts as a
disagreement only if some key in the symmetric difference of the two sets has a reference score farther than the
tie tolerance from the row's k-th selected score (so near-ties at the selection boundary, which legitimately flip
under rounding, are not failures). End: logits relative error, cosine and top-1 agreement.

The reference always runs in fp32 (it is the oracle); the torch path runs in the requested dtype, and the
tolerances are chosen by that dtype (:data:`TOLERANCES`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["Tolerances", "TOLERANCES", "RunResult", "run_reference", "run_torch", "compare_runs", "Report",
           "selection_agreement", "rel_err"]


@dataclass(frozen=True)
class Tolerances:
    """Pass/fail bounds for one torch dtype (relative errors are ``||x - ref|| / ||ref||``)."""

    attn_rel: float
    mlp_rel: float
    residual_rel: float
    logits_rel: float
    logits_cos_min: float
    top1_min: float
    tie_rel: float  # selection tie tolerance, relative to the row's max |score|
    selection_disagree_max: float  # fraction of rows allowed to disagree beyond ties


TOLERANCES = {
    "float32": Tolerances(attn_rel=1e-4, mlp_rel=1e-4, residual_rel=1e-4, logits_rel=1e-4, logits_cos_min=0.99999,
                          top1_min=0.999, tie_rel=1e-4, selection_disagree_max=0.0),
    "bfloat16": Tolerances(attn_rel=6e-2, mlp_rel=6e-2, residual_rel=6e-2, logits_rel=6e-2, logits_cos_min=0.995,
                           top1_min=0.90, tie_rel=5e-2, selection_disagree_max=0.02),
}


@dataclass
class RunResult:
    """One path's outputs on one sequence: ``logits`` [T, vocab] fp32 and one dict of fp32 numpy arrays per layer."""

    name: str
    logits: np.ndarray
    layers: list[dict[str, np.ndarray]]
    seconds: float = 0.0


def rel_err(x: np.ndarray, ref: np.ndarray) -> float:
    x64, r64 = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    den = np.linalg.norm(r64)
    num = np.linalg.norm(x64 - r64)
    return float(num / den) if den > 0 else float(num)


def _np_aux(aux: dict[str, Any], to_np: Callable[[Any], np.ndarray]) -> dict[str, np.ndarray]:
    return {k: to_np(v)[0] for k, v in aux.items()}  # drop the batch axis (B = 1)


def run_reference(checkpoint: str | Path, ids: np.ndarray, layers: int | None = None,
                  on_layer: Callable[[int], None] | None = None) -> RunResult:
    """The JAX reference in fp32 on ``ids`` [T]."""
    from reference_jax.model import load_model

    t0 = time.perf_counter()
    model, tree, _ = load_model(checkpoint, layers=layers)
    logits, auxes = model.apply({"params": tree}, np.asarray(ids)[None], return_aux=True, on_layer=on_layer)
    to_np = lambda a: np.asarray(a, dtype=np.float32) if np.asarray(a).dtype.kind == "f" else np.asarray(a)  # noqa: E731
    return RunResult("jax", to_np(logits)[0], [_np_aux(a, to_np) for a in auxes], time.perf_counter() - t0)


def run_torch(checkpoint: str | Path, ids: np.ndarray, layers: int | None = None, backend: str = "eager",
              dtype: str = "float32", on_layer: Callable[[int], None] | None = None) -> RunResult:
    """One torch backend in ``dtype`` on ``ids`` [T]."""
    import torch

    from kernels_torch.model import load_model

    t0 = time.perf_counter()
    device = "cuda" if backend == "cudnn" else "cpu"
    model = load_model(checkpoint, layers=layers, backend=backend, dtype=getattr(torch, dtype), device=device)
    with torch.no_grad():
        logits, auxes = model(torch.as_tensor(np.asarray(ids), device=device)[None], return_aux=True,
                              on_layer=on_layer)

    def to_np(t):
        t = t.detach().cpu()
        return t.float().numpy() if t.is_floating_point() else t.numpy()

    return RunResult(f"torch-{backend}", to_np(logits)[0], [_np_aux(a, to_np) for a in auxes],
                     time.perf_counter() - t0)


def selection_agreement(ref_idx: np.ndarray, ref_scores: np.ndarray, other_idx: np.ndarray,
                        tie_rel: float) -> dict[str, int]:
    """Compare top-k sets row by row. ref_idx/other_idx [T, k] (-1 = empty slot), ref_scores [T, S] (reference).

    Returns counts: ``rows``, ``identical``, ``tie_only`` (sets differ only by keys whose reference score is within
    ``tie_rel * max|score|`` of the row's k-th selected score), ``disagree`` (the rest).
    """
    out = {"rows": int(ref_idx.shape[0]), "identical": 0, "tie_only": 0, "disagree": 0}
    for t in range(ref_idx.shape[0]):
        a = set(int(i) for i in ref_idx[t] if i >= 0)
        b = set(int(i) for i in other_idx[t] if i >= 0)
        diff = a ^ b
        if not diff:
            out["identical"] += 1
            continue
        row = ref_scores[t]
        finite = row[np.isfinite(row)]
        scale = float(np.abs(finite).max()) if finite.size else 1.0
        kth = min(float(row[i]) for i in a) if a else 0.0
        ok = all(np.isfinite(row[i]) and abs(float(row[i]) - kth) <= tie_rel * max(scale, 1e-30) for i in diff)
        out["tie_only" if ok else "disagree"] += 1
    return out


@dataclass
class LayerRow:
    layer: int
    kind: str
    attn_rel: float
    attn_max_abs: float
    mlp_rel: float
    mlp_max_abs: float
    residual_rel: float
    residual_max_abs: float
    selection: dict[str, int] | None = None
    failed: list[str] = field(default_factory=list)


@dataclass
class Report:
    """The comparison of one torch run against the reference."""

    backend: str
    dtype: str
    tolerances: Tolerances
    layers: list[LayerRow]
    logits_rel: float
    logits_max_abs: float
    logits_cos: float
    top1: float
    failed: list[str]

    @property
    def passed(self) -> bool:
        return not self.failed and not any(r.failed for r in self.layers)

    @property
    def first_divergent_layer(self) -> int | None:
        return next((r.layer for r in self.layers if r.failed), None)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        d["first_divergent_layer"] = self.first_divergent_layer
        return d


def compare_runs(ref: RunResult, other: RunResult, kinds: list[str], dtype: str = "float32",
                 tol: Tolerances | None = None) -> Report:
    """Compare ``other`` against ``ref`` layer by layer; ``kinds[i]`` is 'kda' | 'mla' | 'dsa'."""
    tol = tol or TOLERANCES[dtype]
    rows = []
    for i, (r, o) in enumerate(zip(ref.layers, other.layers)):
        row = LayerRow(
            layer=i, kind=kinds[i],
            attn_rel=rel_err(o["attn_out"], r["attn_out"]),
            attn_max_abs=float(np.abs(o["attn_out"] - r["attn_out"]).max()),
            mlp_rel=rel_err(o["mlp_out"], r["mlp_out"]),
            mlp_max_abs=float(np.abs(o["mlp_out"] - r["mlp_out"]).max()),
            residual_rel=rel_err(o["residual"], r["residual"]),
            residual_max_abs=float(np.abs(o["residual"] - r["residual"]).max()),
        )
        for key, bound in (("attn_rel", tol.attn_rel), ("mlp_rel", tol.mlp_rel), ("residual_rel", tol.residual_rel)):
            v = getattr(row, key)
            if not v <= bound:  # NaN fails too
                row.failed.append(f"{key} {v:.2e} > {bound:.0e}")
        if "topk_indices" in r and "topk_indices" in o:
            sel = selection_agreement(r["topk_indices"], r["index_scores"], o["topk_indices"], tol.tie_rel)
            row.selection = sel
            frac = sel["disagree"] / max(sel["rows"], 1)
            if frac > tol.selection_disagree_max:
                row.failed.append(f"selection disagrees on {sel['disagree']}/{sel['rows']} rows beyond ties")
        rows.append(row)
    a, b = other.logits.astype(np.float64), ref.logits.astype(np.float64)
    cos = float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    lrel = rel_err(a, b)
    failed = []
    if not lrel <= tol.logits_rel:
        failed.append(f"logits_rel {lrel:.2e} > {tol.logits_rel:.0e}")
    if not cos >= tol.logits_cos_min:
        failed.append(f"logits cosine {cos:.6f} < {tol.logits_cos_min}")
    if not top1 >= tol.top1_min:
        failed.append(f"top-1 agreement {top1:.4f} < {tol.top1_min}")
    return Report(other.name, dtype, tol, rows, lrel, float(np.abs(a - b).max()), cos, top1, failed)


def format_table(reports: list[Report]) -> str:
    """A plain-text table: one block per backend, one line per layer, then the logits line and the tolerances."""
    lines = []
    for rep in reports:
        t = rep.tolerances
        lines.append(f"== {rep.backend} ({rep.dtype}) vs jax reference (fp32) ==")
        lines.append(f"{'layer':>5} {'kind':>4} | {'attn rel':>9} {'max abs':>9} | {'mlp rel':>9} {'max abs':>9} | "
                     f"{'resid rel':>9} {'max abs':>9} | {'top-k sets (same/ties/differ)':>30} | status")
        for r in rep.layers:
            sel = "" if r.selection is None else \
                f"{r.selection['identical']}/{r.selection['tie_only']}/{r.selection['disagree']} of {r.selection['rows']}"
            lines.append(f"{r.layer:>5} {r.kind:>4} | {r.attn_rel:9.2e} {r.attn_max_abs:9.2e} | {r.mlp_rel:9.2e} "
                         f"{r.mlp_max_abs:9.2e} | {r.residual_rel:9.2e} {r.residual_max_abs:9.2e} | {sel:>30} | "
                         + ("ok" if not r.failed else "FAIL: " + "; ".join(r.failed)))
        lines.append(f"logits: rel {rep.logits_rel:.2e}  max abs {rep.logits_max_abs:.2e}  cosine {rep.logits_cos:.7f}  "
                     f"top-1 agreement {rep.top1:.4f}  -> " + ("PASS" if rep.passed else "FAIL"))
        lines.append(f"tolerances ({rep.dtype}): attn/mlp/resid rel <= {t.attn_rel:.0e}/{t.mlp_rel:.0e}/"
                     f"{t.residual_rel:.0e}, logits rel <= {t.logits_rel:.0e}, cosine >= {t.logits_cos_min}, "
                     f"top-1 >= {t.top1_min}, selection ties within {t.tie_rel:.0e} x max|score|, rows differing "
                     f"beyond ties <= {t.selection_disagree_max:.0%}")
        if not rep.passed:
            first = rep.first_divergent_layer
            lines.append(f"first divergent layer: {first}" if first is not None else "layers agree; logits differ")
        lines.append("")
    return "\n".join(lines)
