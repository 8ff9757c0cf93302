"""The equivalence harness: run the JAX reference and torch backends on the same token ids, compare layer by layer.

Per layer (both paths return the same intermediates, see ``reference_jax.model``): relative error
``||x - ref|| / ||ref||`` and max abs error of the attention output, the MLP output and the residual stream (the
AttnRes partial sum). DSA layers: agreement of the selected key sets **modulo ties** -- a row counts as a
disagreement only if some key in the symmetric difference of the two sets has a reference score farther than the
tie tolerance from the row's k-th selected score (so near-ties at the selection boundary, which legitimately flip
under rounding, are not failures). End: logits relative error, cosine and top-1 agreement.

The reference always runs in fp32 (it is the oracle); the torch path runs in the requested dtype, and the
tolerances are chosen by that dtype (:data:`TOLERANCES`). An FP8 run (``run_torch(..., convert=...)`` with
``kernels_torch.fp8.convert_model_to_fp8``; ``kimi compare --fp8 RECIPE``) runs bf16 activations around FP8 GEMMs and
is judged by :data:`TOLERANCES_FP8`; :func:`format_fp8_side_by_side` sets its rows beside the bf16 run's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = [
    "Tolerances",
    "TOLERANCES",
    "TOLERANCES_FP8",
    "RunResult",
    "run_reference",
    "run_torch",
    "compare_runs",
    "Report",
    "selection_agreement",
    "rel_err",
    "format_fp8_side_by_side",
]


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


# Per-layer rows are layer-local and carry the tight checks. The end-to-end logits of a bf16 run accumulate
# discrete flips (expert routing and top-k keys at near-ties, then everything downstream of them), so in bf16 they
# get looser bounds (measured on the random-init tiny preset, 256 tokens, sdpa: rel 0.193, cosine 0.981, top-1 0.894).
# fp32/fp64: the end-to-end logits bound is this many times looser once a near-tie flip occurred and every layer
# passed (bf16's bounds already allow for flips, which happen there in most runs).
TIE_FLIP_LOGITS_FACTOR = 10.0

TOLERANCES = {
    "float32": Tolerances(
        attn_rel=1e-4,
        mlp_rel=1e-4,
        residual_rel=1e-4,
        logits_rel=1e-4,
        logits_cos_min=0.99999,
        top1_min=0.999,
        tie_rel=1e-4,
        selection_disagree_max=0.0,
    ),
    "bfloat16": Tolerances(
        attn_rel=4e-2,
        mlp_rel=4e-2,
        residual_rel=4e-2,
        logits_rel=0.3,
        logits_cos_min=0.95,
        top1_min=0.85,
        tie_rel=5e-2,
        selection_disagree_max=0.01,
    ),
}

# FP8 (``kimi compare --fp8 RECIPE``, ``kernels_torch.fp8``): bf16 activations, and the projections' and experts'
# GEMMs round their inputs to e4m3 (3 mantissa bits: unit roundoff 2^-4, against bf16's 2^-8), so one such GEMM's
# output is off by about 3.7% (rel; torchao's emulation on the CPU, either recipe) where bf16's is 0.3%. A layer
# chains two to five of them (KDA: q/k/v through the recurrence, the output gate, o_proj). Measured with torchao's
# emulation on the CPU (tiny preset, random init, 256 tokens, eager, layer-local rows, both recipes), FP8 against the
# fp32 oracle was 9-12x bf16's error in every row: attention 0.054-0.114, MLP / MoE 0.077-0.115, residual
# 0.039-0.115; logits rel 0.44, cosine 0.903, top-1 0.53-0.54 (bf16: 0.19, 0.982, 0.887). The bounds below leave about
# 2x on the rows and less on the logits of that random-init model, which amplifies rounding through its routing and
# top-k flips (the layer rows are the sharp check). The DSA selection reads the indexer's input c_q from the FP8
# q_a_proj: near-ties twice as wide as bf16's left no row differing beyond them (at bf16's width, 1-3 of 256 did),
# and one MoE row of 256 changed its experts beyond ties. First bounds, from the format and the emulation: the H200
# run of the 4-layer real-dimension checkpoint at 4K and 8K (kimi compare --fp8) confirms or tightens them.
TOLERANCES_FP8 = Tolerances(
    attn_rel=0.25,
    mlp_rel=0.25,
    residual_rel=0.25,
    logits_rel=0.6,
    logits_cos_min=0.85,
    top1_min=0.4,
    tie_rel=0.1,
    selection_disagree_max=0.02,
)


@dataclass
class RunResult:
    """One path's outputs on one sequence: ``logits`` [T, vocab] fp32 and one dict of fp32 numpy arrays per layer."""

    name: str
    logits: np.ndarray
    layers: list[dict[str, np.ndarray]]
    seconds: float = 0.0
    kernels: dict[str, dict[str, int]] = field(default_factory=dict)  # torch cudnn: {op: {kernel: calls}} that ran
    fp8: dict[str, Any] | None = None  # the model's FP8 conversion (kernels_torch.fp8.FP8Conversion.to_dict), if any


def first_nonfinite(run: RunResult, kinds: list[str] | None = None) -> str | None:
    """Where ``run`` first holds NaN or inf, in forward order: ``"layer 3 (dsa) attn_out"`` (per layer ``attn_out``,
    then ``mlp_out``, then ``residual``), else ``"logits"``; ``None`` when everything is finite. For a layer-local
    run (:func:`run_torch` with ``ref``) this is the first layer whose own computation went non-finite."""
    for i, layer in enumerate(run.layers):
        for key in ("attn_out", "mlp_out", "residual"):
            if key in layer and not np.isfinite(layer[key]).all():
                kind = f" ({kinds[i]})" if kinds is not None and i < len(kinds) else ""
                bad = int((~np.isfinite(layer[key])).sum())
                return f"layer {i}{kind} {key} ({bad} of {layer[key].size} values)"
    if not np.isfinite(run.logits).all():
        return "logits"
    return None


def rel_err(x: np.ndarray, ref: np.ndarray) -> float:
    """``||x - ref|| / ||ref||`` (Frobenius, in float64); the absolute ``||x - ref||`` when ``ref`` is all zeros."""
    x64, r64 = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    den = np.linalg.norm(r64)
    num = np.linalg.norm(x64 - r64)
    return float(num / den) if den > 0 else float(num)


def _np_aux(aux: dict[str, Any], to_np: Callable[[Any], np.ndarray]) -> dict[str, Any]:
    """Per-layer intermediates as numpy with the batch axis (B = 1) dropped; ``input_blocks`` stays a tuple.
    Entries that are None are left out: the torch ``cudnn`` backend never forms the [T, T] ``index_scores``; the
    tie analysis of compare_runs reads the reference's scores only."""
    out: dict[str, Any] = {}
    for k, v in aux.items():
        if v is not None:
            out[k] = tuple(to_np(b)[0] for b in v) if isinstance(v, (tuple, list)) else to_np(v)[0]
    return out


def run_reference(
    checkpoint: str | Path, ids: np.ndarray, layers: int | None = None, on_layer: Callable[[int], None] | None = None
) -> RunResult:
    """The JAX reference in fp32 on ``ids`` [T], with full-precision matmuls (no TF32 on GPUs)."""
    import jax

    from reference_jax.model import load_model

    t0 = time.perf_counter()
    model, tree, _ = load_model(checkpoint, layers=layers)
    with jax.default_matmul_precision("highest"):
        logits, auxes = model.apply({"params": tree}, np.asarray(ids)[None], return_aux=True, on_layer=on_layer)
    to_np = lambda a: np.asarray(a, dtype=np.float32) if np.asarray(a).dtype.kind == "f" else np.asarray(a)  # noqa: E731
    return RunResult(
        "jax reference (fp32)", to_np(logits)[0], [_np_aux(a, to_np) for a in auxes], time.perf_counter() - t0
    )


def run_torch(
    checkpoint: str | Path,
    ids: np.ndarray,
    layers: int | None = None,
    backend: str = "eager",
    dtype: str = "float32",
    on_layer: Callable[[int], None] | None = None,
    device: str | None = None,
    ref: RunResult | None = None,
    convert: Callable[[Any], Any] | None = None,
) -> RunResult:
    """One torch backend in ``dtype`` on ``ids`` [T]; ``device`` defaults to CUDA when available (always for
    ``cudnn``), else the CPU. ``convert`` (e.g. ``kernels_torch.fp8.convert_model_to_fp8`` with its recipe) is
    applied to the loaded model before anything runs; a model it leaves with an FP8 record (``model.fp8``) is named
    ``torch-{backend} fp8-{recipe}`` and carries the record in ``RunResult.fp8``.

    The logits always come from an end-to-end run. With ``ref`` (the reference's run, which carries each layer's
    inputs), the per-layer intermediates are **layer-local**: layer i of this backend is fed the reference's inputs
    of layer i (cast to ``dtype``), so each row measures that layer's own error, not the error accumulated upstream.
    That keeps bf16 comparisons meaningful (upstream rounding otherwise flips MoE routing and top-k selections in
    later layers) and makes "the first layer that diverges" exact. Without ``ref``: the end-to-end intermediates.
    """
    import torch

    from kernels_torch import kernel_choice
    from kernels_torch.model import load_model

    t0 = time.perf_counter()
    kernel_choice.reset_used()
    if device is None:
        device = "cuda" if backend == "cudnn" or torch.cuda.is_available() else "cpu"
    model = load_model(checkpoint, layers=layers, backend=backend, dtype=getattr(torch, dtype), device=device)
    if convert is not None:
        convert(model)
    fp8 = getattr(model, "fp8", None)
    with torch.no_grad():
        logits, auxes = model(torch.as_tensor(np.asarray(ids), device=device)[None], return_aux=True, on_layer=on_layer)

    def to_np(t):
        t = t.detach().cpu()
        return t.float().numpy() if t.is_floating_point() else t.numpy()

    layer_rows = [_np_aux(a, to_np) for a in auxes]
    if ref is not None:
        layer_rows = _layer_local(model, ref, to_np, device)
    result = RunResult(
        f"torch-{backend}" + ("" if fp8 is None else f" fp8-{fp8.recipe}"),
        to_np(logits)[0],
        layer_rows,
        time.perf_counter() - t0,
        kernels=kernel_choice.used(),
        fp8=None if fp8 is None else fp8.to_dict(),
    )
    del model, logits, auxes
    if device == "cuda":
        torch.cuda.empty_cache()  # the next backend's model gets the memory back
    return result


def _layer_local(model, ref: RunResult, to_np, device) -> list[dict[str, Any]]:
    """Run each torch layer on the reference's inputs of that layer (see :func:`run_torch`)."""
    import torch

    dtype = model.model.layers[0].input_layernorm.weight.dtype
    put = lambda a: torch.from_numpy(np.array(a, np.float32))[None].to(device=device, dtype=dtype)  # noqa: E731
    rows = []
    with torch.no_grad():
        for layer, r in zip(model.model.layers, ref.layers):
            _, _, aux = layer([put(b) for b in r["input_blocks"]], put(r["input_p"]))
            rows.append(_np_aux(aux, to_np))
    return rows


def selection_agreement(
    ref_idx: np.ndarray, ref_scores: np.ndarray, other_idx: np.ndarray, tie_rel: float, causal: bool = False
) -> tuple[dict[str, int], np.ndarray]:
    """Compare top-k sets row by row (DSA keys or MoE experts).

    ref_idx / other_idx ``[T, k]`` (-1 = empty slot), ref_scores ``[T, S]``: the reference's selection scores.
    A row whose sets differ counts as ``tie_only`` when every key in the symmetric difference has a reference score
    within ``tie_rel * max|score|`` of the row's k-th selected score (a near-tie at the selection boundary, which
    rounding may legitimately flip), else as ``disagree``.

    With ``causal`` (DSA keys of one document: row t may see keys 0..t), a key beyond the row is always a
    disagreement, whatever its score: a causality bug must never pass as a near-tie.

    Returns ``(counts, same)``: counts ``rows``, ``identical``, ``tie_only``, ``disagree``; ``same`` ``[T]`` bool,
    True where the two sets are identical.
    """
    T = ref_idx.shape[0]
    out = {"rows": int(T), "identical": 0, "tie_only": 0, "disagree": 0}
    same = np.zeros(T, bool)
    for t in range(T):
        a = {int(i) for i in ref_idx[t] if i >= 0}
        b = {int(i) for i in other_idx[t] if i >= 0}
        diff = a ^ b
        if not diff:
            out["identical"] += 1
            same[t] = True
            continue
        row = ref_scores[t]
        finite = row[np.isfinite(row)]
        scale = float(np.abs(finite).max()) if finite.size else 1.0
        kth = min(float(row[i]) for i in a) if a else 0.0
        ok = all(
            np.isfinite(row[i]) and abs(float(row[i]) - kth) <= tie_rel * max(scale, 1e-30) and not (causal and i > t)
            for i in diff
        )
        out["tie_only" if ok else "disagree"] += 1
    return out, same


@dataclass
class LayerRow:
    """One layer's comparison. Errors are measured on the tokens whose discrete choices agree (the same top-k keys
    in DSA layers, the same experts in MoE layers); ``excluded`` counts the tokens left out because a choice
    differed (at near-ties, or beyond: those fail through ``selection`` / ``routing``)."""

    layer: int
    kind: str
    attn_rel: float
    attn_max_abs: float
    mlp_rel: float
    mlp_max_abs: float
    residual_rel: float
    residual_max_abs: float
    selection: dict[str, int] | None = None
    routing: dict[str, int] | None = None
    excluded: int = 0
    failed: list[str] = field(default_factory=list)


@dataclass
class Report:
    """The comparison of one torch run against the reference."""

    backend: str
    dtype: str
    tolerances: Tolerances
    layers: list[LayerRow]
    reference: str
    logits_rel: float
    logits_max_abs: float
    logits_cos: float
    top1: float
    failed: list[str]
    kernels: dict[str, dict[str, int]] = field(default_factory=dict)  # the GPU kernels that ran (cudnn backend)
    # Rows whose keys or experts flipped at near-ties in some layer (layer-local), and the logits bound that applied:
    # tolerances.logits_rel, times TIE_FLIP_LOGITS_FACTOR when such flips occurred and every layer passed.
    tie_flipped_rows: int = 0
    logits_rel_bound: float | None = None
    fp8: dict[str, Any] | None = None  # the torch run's FP8 conversion record (RunResult.fp8), if any

    @property
    def passed(self) -> bool:
        """True when the logits and every layer row are within their tolerances."""
        return not self.failed and not any(r.failed for r in self.layers)

    @property
    def first_divergent_layer(self) -> int | None:
        """The 0-based index of the first layer row past tolerance, or None."""
        return next((r.layer for r in self.layers if r.failed), None)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the report, with ``passed`` and ``first_divergent_layer`` added."""
        d = asdict(self)
        d["passed"] = self.passed
        d["first_divergent_layer"] = self.first_divergent_layer
        return d


def _errors(o: np.ndarray, r: np.ndarray, keep: np.ndarray) -> tuple[float, float]:
    """(relative error, max abs error) over the token rows ``keep`` (all rows when none is kept)."""
    if keep.any():
        o, r = o[keep], r[keep]
    return rel_err(o, r), float(np.abs(o.astype(np.float64) - r).max())


def compare_runs(
    ref: RunResult, other: RunResult, kinds: list[str], dtype: str = "float32", tol: Tolerances | None = None
) -> Report:
    """Compare ``other`` against ``ref`` layer by layer; ``kinds[i]`` is 'kda' | 'mla' | 'dsa'."""
    tol = tol or TOLERANCES[dtype]
    rows = []
    flipped = np.zeros(ref.logits.shape[0], bool)  # rows whose keys or experts differ in some layer
    for i, (r, o) in enumerate(zip(ref.layers, other.layers)):
        T = r["attn_out"].shape[0]
        sel = routing = None
        attn_keep = np.ones(T, bool)
        mlp_keep = np.ones(T, bool)
        if "topk_indices" in r and "topk_indices" in o:
            sel, attn_keep = selection_agreement(
                r["topk_indices"], r["index_scores"], o["topk_indices"], tol.tie_rel, causal=True
            )
        if "expert_ids" in r and "expert_ids" in o:
            routing, mlp_keep = selection_agreement(r["expert_ids"], r["expert_scores"], o["expert_ids"], tol.tie_rel)
        keep = attn_keep & mlp_keep  # the residual carries both
        if keep.shape == flipped.shape:
            flipped |= ~keep
        row = LayerRow(
            i,
            kinds[i],
            *_errors(o["attn_out"], r["attn_out"], attn_keep),
            *_errors(o["mlp_out"], r["mlp_out"], keep),
            *_errors(o["residual"], r["residual"], keep),
            selection=sel,
            routing=routing,
            excluded=int(T - keep.sum()),
        )
        for key, bound in (("attn_rel", tol.attn_rel), ("mlp_rel", tol.mlp_rel), ("residual_rel", tol.residual_rel)):
            v = getattr(row, key)
            if not v <= bound:  # NaN fails too
                row.failed.append(f"{key} {v:.2e} > {bound:.0e}")
        for name, counts in (("top-k selection", sel), ("expert routing", routing)):
            if counts is not None and counts["disagree"] / max(counts["rows"], 1) > tol.selection_disagree_max:
                row.failed.append(f"{name} differs on {counts['disagree']}/{counts['rows']} rows beyond ties")
        rows.append(row)
    a, b = other.logits.astype(np.float64), ref.logits.astype(np.float64)
    cos = float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    lrel = rel_err(a, b)
    failed = []
    bound = tol.logits_rel
    if dtype in ("float32", "float64") and flipped.any() and not any(r.failed for r in rows):
        # Every layer passed, and some row's keys or experts flipped at a near-tie. In the two end-to-end runs that
        # flip changes the row, and through the KDA state and the later layers' keys every row after it, by far
        # more than rounding (fp32, 3,379 tokens of the tiny preset: logits rel 1.9e-4 after two flipped rows in 45k
        # layer-rows); the layer rows above, fed the same inputs, are the sharp check there.
        bound = tol.logits_rel * TIE_FLIP_LOGITS_FACTOR
    if not lrel <= bound:
        failed.append(f"logits_rel {lrel:.2e} > {bound:.0e}")
    if not cos >= tol.logits_cos_min:
        failed.append(f"logits cosine {cos:.6f} < {tol.logits_cos_min}")
    if not top1 >= tol.top1_min:
        failed.append(f"top-1 agreement {top1:.4f} < {tol.top1_min}")
    return Report(
        other.name,
        dtype,
        tol,
        rows,
        ref.name,
        lrel,
        float(np.abs(a - b).max()),
        cos,
        top1,
        failed,
        other.kernels,
        int(flipped.sum()),
        bound,
        other.fp8,
    )


def format_table(reports: list[Report]) -> str:
    """A plain-text table: one block per backend, one line per layer, then the logits line and the tolerances."""

    def choice(c):
        return "" if c is None else f"{c['identical']}/{c['tie_only']}/{c['disagree']}"

    lines = []
    for rep in reports:
        t = rep.tolerances
        lines.append(f"== {rep.backend} ({rep.dtype}) vs {rep.reference} ==")
        lines.append(
            f"{'layer':>5} {'kind':>4} | {'attn rel':>9} {'max abs':>9} | {'mlp rel':>9} {'max abs':>9} | "
            f"{'resid rel':>9} {'max abs':>9} | {'top-k keys':>12} {'experts':>12} | status"
        )
        for r in rep.layers:
            lines.append(
                f"{r.layer:>5} {r.kind:>4} | {r.attn_rel:9.2e} {r.attn_max_abs:9.2e} | {r.mlp_rel:9.2e} "
                f"{r.mlp_max_abs:9.2e} | {r.residual_rel:9.2e} {r.residual_max_abs:9.2e} | "
                f"{choice(r.selection):>12} {choice(r.routing):>12} | "
                + ("ok" if not r.failed else "FAIL: " + "; ".join(r.failed))
            )
        lines.append(
            f"logits: rel {rep.logits_rel:.2e}  max abs {rep.logits_max_abs:.2e}  cosine {rep.logits_cos:.7f}  "
            f"top-1 agreement {rep.top1:.4f}  -> " + ("PASS" if rep.passed else "FAIL")
        )
        if rep.logits_rel_bound is not None and rep.logits_rel_bound != t.logits_rel:
            lines.append(
                f"logits rel bound {rep.logits_rel_bound:.0e} ({TIE_FLIP_LOGITS_FACTOR:g} x {t.logits_rel:.0e}): "
                f"{rep.tie_flipped_rows} rows' keys or experts flipped at near-ties, which moves every later row in "
                "a full run; the layer rows, fed the same inputs, all passed"
            )
        if rep.fp8:
            f = rep.fp8
            kept = ", ".join(f"{reason} {n}" for reason, n in f["skipped"].items()) or "none"
            lines.append(
                f"fp8: {f['linears']} projections ({f['recipe']}) and {f['grouped_experts']} grouped experts "
                f"({f['grouped_recipe'] or '-'}) in FP8, torchao {f['torchao']}"
                + (" (emulated)" if f["emulate"] else "")
                + f"; candidates left as they are: {kept}"
            )
        if rep.kernels:
            lines.append(
                "kernels: "
                + "; ".join(f"{op} {', '.join(f'{k} x{n}' for k, n in c.items())}" for op, c in rep.kernels.items())
            )
        lines.append(
            "rows: each torch layer is fed the reference's inputs of that layer (layer-local errors); "
            "top-k keys / experts = rows same/differing only at near-ties/differing; errors exclude the "
            "rows whose keys or experts differ"
        )
        lines.append(
            f"tolerances ({'fp8 ' + rep.fp8['recipe'] if rep.fp8 else rep.dtype}): attn/mlp/resid rel <= {t.attn_rel:.0e}/{t.mlp_rel:.0e}/"
            f"{t.residual_rel:.0e}, logits rel <= {t.logits_rel:.0e}, cosine >= {t.logits_cos_min}, "
            f"top-1 >= {t.top1_min}, near-tie = within {t.tie_rel:.0e} x max|score| of the k-th, rows "
            f"differing beyond ties <= {t.selection_disagree_max:.0%}"
        )
        if not rep.passed:
            first = rep.first_divergent_layer
            lines.append(f"first divergent layer: {first}" if first is not None else "layers agree; logits differ")
        lines.append("")
    return "\n".join(lines)


def format_fp8_side_by_side(bf16: Report, fp8: Report) -> str:
    """Per layer, the bf16 run's and the FP8 run's layer-local relative errors (attention, MLP, residual) side by side
    with their ratio, then both runs' logits rel, cosine and top-1; both reports against the same reference."""
    lines = [
        f"== {bf16.backend} vs {fp8.backend} (both against {bf16.reference}) ==",
        f"{'layer':>5} {'kind':>4} | {'attn bf16':>9} {'fp8':>9} {'x':>5} | {'mlp bf16':>9} {'fp8':>9} {'x':>5} | "
        f"{'resid bf16':>10} {'fp8':>9} {'x':>5}",
    ]

    def ratio(a: float, b: float) -> str:
        return f"{b / a:5.1f}" if a > 0 else "    -"

    for a, b in zip(bf16.layers, fp8.layers):
        lines.append(
            f"{a.layer:>5} {a.kind:>4} | {a.attn_rel:9.2e} {b.attn_rel:9.2e} {ratio(a.attn_rel, b.attn_rel)} | "
            f"{a.mlp_rel:9.2e} {b.mlp_rel:9.2e} {ratio(a.mlp_rel, b.mlp_rel)} | "
            f"{a.residual_rel:10.2e} {b.residual_rel:9.2e} {ratio(a.residual_rel, b.residual_rel)}"
        )
    for rep in (bf16, fp8):
        lines.append(
            f"logits {rep.backend}: rel {rep.logits_rel:.2e}  cosine {rep.logits_cos:.6f}  top-1 {rep.top1:.4f}  -> "
            + ("PASS" if rep.passed else "FAIL")
        )
    return "\n".join(lines) + "\n"
