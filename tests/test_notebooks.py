"""Every notebook's code cells run top to bottom (notebooks must not rot as the API changes)."""

import json
from pathlib import Path

import pytest


def notebooks(folder: Path) -> list[Path]:
    """The project's notebooks, without the ``*.nbconvert.ipynb`` copies ``jupyter nbconvert --execute`` leaves."""
    return sorted(p for p in folder.glob("*.ipynb") if not p.name.endswith(".nbconvert.ipynb"))


NOTEBOOKS = notebooks(Path(__file__).parent.parent / "notebooks")


def test_nbconvert_outputs_are_not_collected(tmp_path):
    (tmp_path / "explore.ipynb").write_text("{}")
    (tmp_path / "explore.nbconvert.ipynb").write_text("{}")
    assert [p.name for p in notebooks(tmp_path)] == ["explore.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = json.loads(path.read_text())
    code = "\n\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    exec(compile(code, str(path), "exec"), {"__name__": "__notebook__"})
