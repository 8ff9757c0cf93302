"""``kimi_tools.plan.calibration.load_calibration``'s ``host_offload`` section: a damaged
``benchmarks/host_optimizer.py`` result named by it is refused in one line naming the field, and a result without
the gradient copies (a run without CUDA) counts none, saying so."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kimi_tools.plan.calibration import CALIBRATION_FILE, load_calibration

RESULT = "benchmarks/results/test/host_optimizer.json"


def _calibration(tmp_path: Path, result: dict | str | None) -> Path:
    """A copy of the bundled calibration under ``tmp_path`` (at the repository's depth), its ``host_offload.file``
    naming ``result`` written there (a dict as JSON, a str as is, None: no file)."""
    doc = json.loads(Path(CALIBRATION_FILE).read_text())
    doc.pop("host_copy", None)  # the datasheet rate: no other file needed
    doc["host_offload"]["file"] = RESULT
    path = tmp_path / "kimi_tools" / "plan" / "calibration.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    if result is not None:
        (tmp_path / RESULT).parent.mkdir(parents=True)
        (tmp_path / RESULT).write_text(result if isinstance(result, str) else json.dumps(result))
    return path


def _result() -> dict:
    root = Path(CALIBRATION_FILE).resolve().parents[2]
    return json.loads((root / json.loads(Path(CALIBRATION_FILE).read_text())["host_offload"]["file"]).read_text())


def test_a_whole_result_loads(tmp_path):
    cal = load_calibration(path=_calibration(tmp_path, _result()))
    assert cal.host_optimizer_s_per_gparam == {k: v["s_per_gparam"] for k, v in _result()["optimizer"].items()}
    assert cal.grad_accumulate_s_per_gb == _result()["grad_accumulate"]["accumulate_s_per_gb"] > 0


@pytest.mark.parametrize(
    "drop, said",
    [
        (("device",), "device"),
        (("optimizer", "adamw-bf16", "s_per_gparam"), "optimizer.adamw-bf16.s_per_gparam"),
        (("grad_accumulate", "first_s_per_gb"), "grad_accumulate.first_s_per_gb"),
    ],
)
def test_a_result_missing_a_key_is_refused_in_one_line(tmp_path, drop, said):
    res = copy.deepcopy(_result())
    d = res
    for k in drop[:-1]:
        d = d[k]
    del d[drop[-1]]
    with pytest.raises(ValueError, match=rf"^calibration host_offload.file: got '{RESULT}', a result without {said};"):
        load_calibration(path=_calibration(tmp_path, res))


@pytest.mark.parametrize("result", [None, "{not json"])
def test_a_missing_or_damaged_file_is_refused_in_one_line(tmp_path, result):
    with pytest.raises(ValueError, match=rf"^calibration host_offload.file: got '{RESULT}', expected a readable"):
        load_calibration(path=_calibration(tmp_path, result))


def test_a_result_without_gradient_copies_counts_none_and_says_so(tmp_path):
    res = copy.deepcopy(_result())
    del res["grad_accumulate"]
    cal = load_calibration(path=_calibration(tmp_path, res))
    assert cal.grad_accumulate_s_per_gb == 0.0 and cal.grad_taken_s_per_gb(20.0) == 0.0
    assert "no gradient copies measured: not counted" in cal.host_offload_source
    assert "host memory's rate" not in cal.host_offload_source
