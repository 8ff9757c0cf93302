"""The measured rates and activation bytes the planner scales (``kimi_tools/plan/calibration.json``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from kimi.config import KimiConfig, load_config
from kimi_tools.plan.activations import block_bytes, held_per_microbatch, layer_inputs_bytes, policy_bytes

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class Calibration:
    """Measured rates and activation bytes of the 4-layer step (``kimi_tools/plan/calibration.json``).

    Attributes:
        tflops: {mode: model TFLOP/s} measured per calibration point ("none": no recomputation, the rate every
            policy's work runs at; "mlp": the 32K point with the MoE recomputed, a cross-check of the recompute
            FLOPs: :func:`~kimi_tools.plan.search.evaluate` counts the recomputed forwards as work at the "none"
            rate).
        act_scale: the GPU step's activation bytes over the eager twin's count of the same layers
            (:func:`~kimi_tools.plan.activations.block_bytes`): measured peak - parameters - the head's exact
            bytes (:func:`~kimi_tools.plan.activations.held_per_microbatch`, the ``lm_head`` gradient included),
            over the count, at the "none" and "act" points (geometric mean: 8 and 16 experts per token). The
            peak of a one-process step comes as its backward starts, before any layer's gradient exists, so no
            gradient is subtracted. The fused kernels keep no fp32 GLU copies and no attention probabilities: the
            scale is below 1.
        sources: {mode: "file (date, commit), seq_len, ms, peak GiB"} of each point used.
        rows_per_expert: {mode: rows per expert in that calibration step} (``T k / E`` of the benchmark).
        density: ((rows per expert, TFLOP/s), ...) of the routed experts alone (``expert_density``).
        host_ratio: host bytes per device byte of each offloaded region (``policy_bytes``), measured on the CPU
            (``activation_offload`` in the file).
        host_copy_gbps: the host copy rate of activation offload, GB/s per direction: a measured
            ``benchmarks/offload_copy.py`` result when ``host_copy.file`` names one, else the datasheet's.
        host_copy_source: where :attr:`host_copy_gbps` comes from ("datasheet, not measured: ..." or the file).
        host_optimizer_s_per_gparam: {optimizer: seconds per 10^9 parameters} of the trainer's optimizer step on
            host tensors (``--offload cpu``), from a ``benchmarks/host_optimizer.py`` result named by
            ``host_offload.file``; empty without one.
        grad_accumulate_s_per_gb: seconds per GB of gradient of FSDP2's copy to the host when a micro-batch's
            gradient adds to the last one's (blocking, into pageable memory, then a host add); 0 without a file.
            The trainer avoids it (:meth:`grad_taken_s_per_gb`).
        grad_first_s_per_gb: seconds per GB of FSDP2's copy when the parameter has no gradient yet (non-blocking,
            into pinned memory); 0 without a file. grad_taken_s_per_gb_measured: the file's ``taken_s_per_gb``
            (that copy, then the host add into the trainer's held sums), or None.
        host_offload_source: where the rates above come from.
    """

    tflops: dict
    act_scale: float
    sources: dict = field(default_factory=dict)
    rows_per_expert: dict = field(default_factory=dict)
    density: tuple = ()
    host_ratio: dict = field(default_factory=dict)
    host_copy_gbps: float = 64.0
    host_copy_source: str = ""
    host_optimizer_s_per_gparam: dict = field(default_factory=dict)
    grad_accumulate_s_per_gb: float = 0.0
    host_offload_source: str = ""
    grad_first_s_per_gb: float = 0.0
    grad_taken_s_per_gb_measured: float | None = None
    _memo: dict = field(
        default_factory=dict, init=False, repr=False, compare=False
    )  # layer_bytes / working_set results

    def grad_taken_s_per_gb(self, host_gbps: float) -> float:
        """Seconds per GB of gradient of each micro-batch of a step after the first under ``--offload cpu``: the
        trainer takes the host gradients out of ``.grad`` between micro-batches
        (``kernels_torch.parallel.fsdp.HostGradSums``), so FSDP2 copies each one non-blocking into pinned memory
        (:attr:`grad_first_s_per_gb`) and the trainer adds it on the host into the held sums. The measured
        ``taken_s_per_gb`` when the file has it, else the copy plus the add at host memory's rate ``host_gbps`` (GB/s:
        read two gradients, write one, ``3 / host_gbps``; not measured); 0 without a file."""
        if self.grad_taken_s_per_gb_measured is not None:
            return self.grad_taken_s_per_gb_measured
        return self.grad_first_s_per_gb + 3 / host_gbps if self.grad_first_s_per_gb else 0.0

    def layer_bytes(self, cfg: KimiConfig, layers: range, T: int, recompute: str, offload: str = "none"):
        """``(device, host)`` activation bytes of ``layers`` of ``cfg`` for ``T`` tokens under a recompute and an
        offload mode: :func:`~kimi_tools.plan.activations.policy_bytes` summed, the device part scaled by
        :attr:`act_scale` (the host part too: the same tensors; the inputs a recomputed region keeps are exact)."""
        key = ("layer_bytes", cfg, tuple(layers), T, recompute, offload)
        if key not in self._memo:
            dev = host = 0.0
            for i in layers:
                d, h = policy_bytes(cfg, i, T, recompute, offload, self.host_ratio, self.act_scale)
                dev, host = dev + d, host + h
            self._memo[key] = dev, host
        return self._memo[key]

    def working_set(self, cfg: KimiConfig, layers: range, T: int, recompute: str) -> float:
        """What a recomputed region holds again while its backward runs: the largest of ``layers``' recomputed
        regions (the whole layer for "full", its attention or MLP block for "attn" / "mlp") at its no-recompute
        bytes, scaled; 0 for "none"."""
        if recompute == "none":
            return 0.0
        key = ("working_set", cfg, tuple(layers), T, recompute)
        if key not in self._memo:
            parts = {"full": ("attn", "mlp", "glue"), "attn": ("attn",), "mlp": ("mlp",)}[recompute]
            most = max((sum(block_bytes(cfg, i, T)[k] for k in parts) for i in layers), default=0)
            self._memo[key] = self.act_scale * most
        return self._memo[key]

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

    def expert_slowdown(self, rows: float, mode: str = "none") -> float:
        """How much longer the experts take at ``rows`` per expert than in the "none" calibration step (the rate
        every policy's work runs at)."""
        ref = self.rows_per_expert.get("none")
        return 1.0 if ref is None or not self.density else self.expert_rate(ref) / self.expert_rate(rows)


def calibration_head_bytes(cfg: KimiConfig, T: int) -> int:
    """The exact bytes of a one-stage step's head beside its layers (the output mix, final norm, loss and the
    ``lm_head`` gradient: :func:`~kimi_tools.plan.activations.held_per_microbatch` less the layer inputs)."""
    layers = range(cfg.num_hidden_layers)
    return held_per_microbatch(cfg, layers, T, first=True, last=True) - layer_inputs_bytes(
        layers, T, cfg.hidden_size, True
    )


def _host_copy(doc: dict, root: Path) -> tuple[float, str]:
    """The host copy rate (GB/s) and its source from the file's ``host_copy``: the slower of the device-to-host
    copy under compute and the host-to-device copy at the largest size of a named ``benchmarks/offload_copy.py``
    result, else the datasheet rate."""
    hc = doc.get("host_copy", {})
    if hc.get("file"):
        rows = json.loads((root / hc["file"]).read_text())["rows"]
        big = max(rows, key=lambda r: r["mb"])
        rate = min(big["d2h_under_compute_gbps"], big["h2d_gbps"])
        return rate, f"measured: {hc['file']} ({big['mb']} MB copies)"
    return hc.get("datasheet_gbps", 64.0), "datasheet, not measured: " + hc.get("datasheet", "")


def _host_offload(doc: dict, root: Path) -> tuple[dict, float, str, dict]:
    """``(seconds per 10^9 parameters per optimizer, seconds per GB of FSDP2's accumulating gradient copy, source,
    {"grad_first_s_per_gb", "grad_taken_s_per_gb_measured"}: the trainer's gradient copy rates)`` from the file's
    ``host_offload`` (a ``benchmarks/host_optimizer.py`` result), else ``({}, 0.0, "not measured", {})``. A result
    without ``grad_accumulate`` (a run without CUDA) counts no gradient copies, as without a file.

    Raises:
        ValueError (one line naming ``host_offload.file``): the file missing or not JSON, or a key the result always
            has (``device``, ``threads``, each optimizer's ``s_per_gparam``, ``grad_accumulate``'s
            ``first_s_per_gb`` and ``accumulate_s_per_gb``) missing."""
    name = doc.get("host_offload", {}).get("file")
    if not name:
        return {}, 0.0, "not measured", {}
    what = f"calibration host_offload.file: got {name!r}"
    try:
        res = json.loads((root / name).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}, expected a readable benchmarks/host_optimizer.py result (JSON): {e}") from None
    need = [k for k in ("device", "threads") if k not in res]
    need += [f"optimizer.{k}.s_per_gparam" for k, v in res.get("optimizer", {}).items() if "s_per_gparam" not in v]
    if "grad_accumulate" in res:
        need += [
            f"grad_accumulate.{k}" for k in ("first_s_per_gb", "accumulate_s_per_gb") if k not in res["grad_accumulate"]
        ]
    if need:
        raise ValueError(f"{what}, a result without {', '.join(need)}; expected a benchmarks/host_optimizer.py result")
    rates = {k: v["s_per_gparam"] for k, v in res.get("optimizer", {}).items()}
    if "grad_accumulate" not in res:
        src = f"measured: {name} ({res['device']}, {res['threads']} host threads); no gradient copies measured: not counted"
        return rates, 0.0, src, {}
    g = res["grad_accumulate"]
    taken = {
        "grad_first_s_per_gb": g.get("first_s_per_gb", 0.0),
        "grad_taken_s_per_gb_measured": g.get("taken_s_per_gb"),
    }
    src = f"measured: {name} ({res['device']}, {res['threads']} host threads)"
    if taken["grad_taken_s_per_gb_measured"] is None:
        src += "; the host add into the trainer's held gradient sums not measured: host memory's rate"
    return rates, g.get("accumulate_s_per_gb", 0.0), src, taken


def load_calibration(fp8: str | None = None, path: Path = CALIBRATION_FILE) -> Calibration:
    """The calibration for bf16 (``fp8=None``) or an FP8 recipe from ``path``.

    Raises:
        ValueError: no calibration point for that recipe (naming the recipes that have one); a damaged
            ``host_offload.file`` result (:func:`_host_offload`)."""
    doc = json.loads(Path(path).read_text())
    key = "bf16" if fp8 is None else f"fp8-{fp8}"
    tflops, src, rows = {}, {}, {}
    scales = []
    for p in doc["points"]:
        use = p.get("use")
        if not use or not use.startswith(key + "-"):
            continue
        mode = use[len(key) + 1 :]
        if mode in ("none", "act"):
            ccfg = calibration_config(p["experts"], p["experts_per_token"])
            T = p["seq_len"]
            count = sum(policy_bytes(ccfg, i, T)[0] for i in range(CALIBRATION_LAYERS))
            scales.append((p["peak_gib"] * 2**30 - p["param_bytes"] - calibration_head_bytes(ccfg, T)) / count)
        if mode == "act":
            continue
        tflops[mode] = p["model_tflop"] / (p["ms"] * 1e-3)
        rows[mode] = p["seq_len"] * p["experts_per_token"] / p["experts"]
        src[mode] = (
            f"{p['file']} ({p['date']}, {p['commit']}): {p['seq_len']} tokens, {p['experts']} experts, "
            f"recompute {p['recompute']}, {p['ms']:.1f} ms, peak {p['peak_gib']:.2f} GiB"
        )
    if "none" not in tflops:
        have = sorted({p["use"].rsplit("-", 1)[0] for p in doc["points"] if p.get("use")})
        raise ValueError(f"--fp8: got {fp8!r}, no calibration points for it; calibrated: {have}")
    dens = tuple((q["rows_per_expert"], q["tflops"]) for q in doc.get("expert_density", {}).get("points", []))
    ratio = dict(doc.get("activation_offload", {}).get("host_ratio", {}))
    root = Path(path).resolve().parents[2]
    rate, rate_src = _host_copy(doc, root)
    host_opt, host_acc, host_src, taken = _host_offload(doc, root)
    tflops["full"] = tflops["none"] * 3 / 4  # one more forward per three units of work, at the "none" rate
    scale = math.exp(sum(math.log(x) for x in scales) / len(scales))
    return Calibration(tflops, scale, src, rows, dens, ratio, rate, rate_src, host_opt, host_acc, host_src, **taken)


CALIBRATION_LAYERS = 4  # the calibration steps' model: k3.1-pro's first 4 layers (calibration.json "about")


def calibration_config(experts: int, experts_per_token: int) -> KimiConfig:
    """The config of a calibration step: k3.1-pro truncated to :data:`CALIBRATION_LAYERS` layers, with the step's
    routed experts."""
    return (
        load_config("k3.1-pro")
        .truncated(CALIBRATION_LAYERS)
        .replace(num_experts=experts, num_experts_per_token=experts_per_token)
    )
