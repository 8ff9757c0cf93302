"""benchmarks/fp8_bound.py: the FP8 step's bound from the GEMMs alone, with the recomputed forwards counted."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def fp8_bound():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("fp8_bound", BENCH / "fp8_bound.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH))


def _gemm(fp8_bound, scale: dict[str, float]) -> dict:
    """Every projection of each part at fwd = s, fwd + bwd = 3 s (s per mode and tokens); grouped experts 10x."""
    dense, grouped = [], []
    for names in fp8_bound.LAYER_PARTS.values():
        for name in names:
            for T in (8192, 32768):
                for mode in scale:
                    s = scale[mode] * T / 8192
                    dense.append({"names": [name], "tokens": T, "mode": mode, "fwd_ms": s, "fwd_bwd_ms": 3 * s})
    for T in (8192, 32768):
        for mode in ("bf16", "fp8_rowwise"):
            s = 10 * scale[mode] * T / 8192
            grouped.append({"experts": 112, "tokens": T, "mode": mode, "fwd_ms": s, "fwd_bwd_ms": 3 * s})
    return {"dense": dense, "grouped": grouped}


def _step(T, ms, recompute=False, full=None, recipe=None, compiled=False):
    return {
        "seq_len": T,
        "backend": "cudnn",
        "recompute": recompute,
        "recompute_full_layers": full,
        "layers": ["kda", "kda", "kda", "dsa"],
        "experts": 112,
        "fp8": {"recipe": recipe, "compiled": compiled} if recipe else None,
        "ms": ms,
        "status": "ok" if ms else "oom",
    }


def test_bound_counts_every_gemm_and_each_recomputed_forward(fp8_bound):
    gemm = _gemm(fp8_bound, {"bf16": 1.0, "fp8_rowwise": 0.5})
    bf16 = {"rows": [_step(8192, 500.0), _step(32768, 2400.0, "mlp", 1)]}
    fp8 = {"rows": [_step(8192, 420.0, recipe="rowwise"), _step(32768, 2100.0, "mlp", 1, "rowwise")]}
    r8k, r32k = fp8_bound.bound_rows(gemm, bf16, fp8)
    # 8K: 4 attention layers x 5 projections x 3 + layer 0's MLP 3 x 3 + 3 MoE layers x 5 x 3 + 3 x 30 (experts)
    assert r8k["gemm_bf16_ms"] == pytest.approx(60 + 9 + 45 + 90)
    assert r8k["gemm_fp8_ms"] == pytest.approx(0.5 * 204)
    assert r8k["rest_ms"] == pytest.approx(500 - 204)
    assert r8k["bound_ms"] == pytest.approx(296 + 102)
    assert r8k["bound_speedup"] == pytest.approx(500 / 398)
    assert r8k["measured_over_bound"] == pytest.approx(420 / 398)
    # 32K (4x the time) with the MLPs and the first layer's attention recomputed: + 5 + 3 + 15 + 30 forwards
    assert r32k["gemm_bf16_ms"] == pytest.approx(4 * (204 + 53))
    assert r32k["bound_ms"] == pytest.approx(2400 - 4 * 257 + 2 * 257)


def test_a_compiled_step_is_bounded_by_the_compiled_gemms(fp8_bound):
    """A step run with ``--fp8-compile`` takes fp8_gemm.py's ``_compiled`` dense rows (the grouped experts have
    one FP8 mode); an eager one the eager rows."""
    gemm = _gemm(fp8_bound, {"bf16": 1.0, "fp8_rowwise": 0.75, "fp8_rowwise_compiled": 0.5})
    bf16 = {"rows": [_step(8192, 500.0)]}
    (eager,) = fp8_bound.bound_rows(gemm, bf16, {"rows": [_step(8192, 420.0, recipe="rowwise")]})
    (comp,) = fp8_bound.bound_rows(gemm, bf16, {"rows": [_step(8192, 420.0, recipe="rowwise", compiled=True)]})
    assert not eager["compiled"] and comp["compiled"]
    # dense 114 ms of the 204 (experts 90): 0.75 x 114 + 0.75 x 90 eager, 0.5 x 114 + 0.75 x 90 compiled
    assert eager["gemm_fp8_ms"] == pytest.approx(0.75 * 204)
    assert comp["gemm_fp8_ms"] == pytest.approx(0.5 * 114 + 0.75 * 90)


def test_projections_kept_bf16_count_their_bf16_time(fp8_bound):
    """A step whose ``fp8.min_dim`` kept the narrow projections bf16 (``kernels_torch.fp8``'s rule) is bounded with
    their bf16 rows: here the DSA ``kv_a_proj_with_mqa`` (576 wide) under ``min_dim`` 1024."""
    gemm = _gemm(fp8_bound, {"bf16": 1.0, "fp8_rowwise": 0.5})
    for r in gemm["dense"]:
        r["in"], r["out"] = 7168, 576 if r["names"] == ["dsa.kv_a_proj_with_mqa"] else 7168
    bf16 = {"rows": [_step(8192, 500.0)]}
    (every,) = fp8_bound.bound_rows(gemm, bf16, {"rows": [_step(8192, 420.0, recipe="rowwise")]})
    narrow = _step(8192, 420.0, recipe="rowwise")
    narrow["fp8"]["min_dim"] = 1024
    (kept,) = fp8_bound.bound_rows(gemm, bf16, {"rows": [narrow]})
    assert kept["gemm_fp8_ms"] == pytest.approx(every["gemm_fp8_ms"] + 0.5 * 3)  # one projection: 3 ms, not 1.5


def test_rows_without_a_pair_and_missing_gemms(fp8_bound, tmp_path):
    gemm = _gemm(fp8_bound, {"bf16": 1.0, "fp8_rowwise": 0.5})
    bf16 = {"rows": [_step(32768, None, "mlp", 1)]}
    fp8 = {"rows": [_step(32768, 2100.0, "mlp", 1, "rowwise"), _step(8192, 400.0, recipe="rowwise")]}
    oom, no_row = fp8_bound.bound_rows(gemm, bf16, fp8)
    assert oom["status"] == "no pair: fp8 ok, bf16 oom" and no_row["status"] == "no pair: fp8 ok, bf16 no row"
    gemm["grouped"] = [g for g in gemm["grouped"] if g["tokens"] != 32768]
    bf16 = {"rows": [_step(32768, 2400.0, "mlp", 1)]}
    paths = {}
    for name, obj in (("gemm", gemm), ("bf16", bf16), ("fp8", fp8)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(obj))
    argv = sys.argv
    sys.argv = ["fp8_bound.py"] + [f"--{k}={v}" for k, v in paths.items()] + [f"--out={tmp_path / 'out.json'}"]
    try:
        assert fp8_bound.main() == 1  # grouped experts at 32K not measured: refused, nothing written
    finally:
        sys.argv = argv
    assert not (tmp_path / "out.json").exists()
