"""The measured rates and activation bytes the planner scales (``kimi_tools/plan/calibration.json``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from kimi.config import KimiConfig, load_config
from kimi_tools.plan.activations import activation_table, layer_activation_bytes

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class Calibration:
    """Measured rates and activation bytes of the 4-layer step, per recompute mode (``kimi_tools/plan/calibration.json``).

    Attributes:
        tflops: {mode: model TFLOP/s} for "none" and "mlp" ("full" derived: "none" x 3/4).
        act_per_token_layer: {mode: bytes per token per layer} for "none" and "mlp".
        sources: {mode: "file (date, commit), seq_len, ms, peak GiB"} of each point used.
        rows_per_expert: {mode: rows per expert in that calibration step} (``T k / E`` of the benchmark).
        density: ((rows per expert, TFLOP/s), ...) of the routed experts alone (``expert_density``).
        act_scale: {mode: measured activation bytes / :func:`layer_activation_bytes` of the calibration step's
            layers} for "none" and "mlp": what the count leaves out (workspaces, gradients in flight, the loss
            chunk, the allocator), applied to any config's count (:meth:`layer_bytes`).
    """

    tflops: dict
    act_per_token_layer: dict
    sources: dict = field(default_factory=dict)
    rows_per_expert: dict = field(default_factory=dict)
    density: tuple = ()
    act_scale: dict = field(default_factory=dict)

    def layer_bytes(self, cfg: KimiConfig, layers: range, T: int, mode: str) -> float:
        """Activation bytes of ``layers`` of ``cfg`` for ``T`` tokens under recompute ``mode`` ("none" or "mlp"):
        :func:`layer_activation_bytes` scaled by :attr:`act_scale`."""
        col = 0 if mode == "none" else 1
        table = activation_table(cfg)
        return self.act_scale[mode] * T * sum(table[i][col] for i in layers)

    def working_set(self, cfg: KimiConfig, layers: range, T: int) -> float:
        """One layer's no-recompute activation bytes (the largest of ``layers``), for ``T`` tokens: what a layer
        recomputed whole holds while its backward runs."""
        table = activation_table(cfg)
        return self.act_scale["none"] * T * max((table[i][0] for i in layers), default=0)

    def expert_rate(self, rows: float) -> float:
        """The routed experts' TFLOP/s at ``rows`` per expert (``expert_density`` points: log-linear between them,
        flat above the last, proportional to ``rows`` below the first)."""
        pts = sorted(self.density)
        if not pts:
            return 1.0
        (r0, t0), (r1, t1) = pts[0], pts[-1]
        if rows <= r0:
            return t0 * rows / r0
        if rows >= r1:
            return t1
        for (ra, ta), (rb, tb) in zip(pts, pts[1:]):
            if ra <= rows <= rb:
                return ta + (tb - ta) * math.log(rows / ra) / math.log(rb / ra)
        return t1

    def expert_slowdown(self, rows: float, mode: str) -> float:
        """How much longer the experts take at ``rows`` per expert than in the calibration step of ``mode``."""
        ref = self.rows_per_expert.get("none" if mode == "full" else mode)
        return 1.0 if ref is None or not self.density else self.expert_rate(ref) / self.expert_rate(rows)


def load_calibration(fp8: str | None = None, path: Path = CALIBRATION_FILE) -> Calibration:
    """The calibration for bf16 (``fp8=None``) or an FP8 recipe from ``path``.

    Raises:
        ValueError: no calibration point for that recipe (naming the recipes that have one)."""
    doc = json.loads(Path(path).read_text())
    key = "bf16" if fp8 is None else f"fp8-{fp8}"
    tflops, act, src, rows, scale = {}, {}, {}, {}, {}
    for p in doc["points"]:
        use = p.get("use")
        if not use or not use.startswith(key + "-"):
            continue
        mode = use[len(key) + 1 :]
        tflops[mode] = p["model_tflop"] / (p["ms"] * 1e-3)
        measured = p["peak_gib"] * 2**30 - p["param_bytes"]
        act[mode] = measured / (p["seq_len"] * CALIBRATION_LAYERS)
        ccfg = calibration_config(p["experts"], p["experts_per_token"])
        full = p.get("recompute_full_layers") or 0
        count = sum(layer_activation_bytes(ccfg, i, mode, full) for i in range(CALIBRATION_LAYERS))
        scale[mode] = measured / (p["seq_len"] * count)
        rows[mode] = p["seq_len"] * p["experts_per_token"] / p["experts"]
        src[mode] = (
            f"{p['file']} ({p['date']}, {p['commit']}): {p['seq_len']} tokens, {p['experts']} experts, "
            f"recompute {p['recompute']}, {p['ms']:.1f} ms, peak {p['peak_gib']:.2f} GiB"
        )
    if set(tflops) != {"none", "mlp"}:
        have = sorted({p["use"].rsplit("-", 1)[0] for p in doc["points"] if p.get("use")})
        raise ValueError(f"--fp8: got {fp8!r}, no calibration points for it; calibrated: {have}")
    tflops["full"] = tflops["none"] * 3 / 4
    dens = tuple((q["rows_per_expert"], q["tflops"]) for q in doc.get("expert_density", {}).get("points", []))
    return Calibration(tflops, act, src, rows, dens, scale)


CALIBRATION_LAYERS = 4  # the calibration steps' model: k3.1-pro's first 4 layers (calibration.json "about")


def calibration_config(experts: int, experts_per_token: int) -> KimiConfig:
    """The config of a calibration step: k3.1-pro truncated to :data:`CALIBRATION_LAYERS` layers, with the step's
    routed experts."""
    return (
        load_config("k3.1-pro")
        .truncated(CALIBRATION_LAYERS)
        .replace(num_experts=experts, num_experts_per_token=experts_per_token)
    )
