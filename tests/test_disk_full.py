"""A full disk while writing: one line naming the path and saying the disk is full, and no temporary file or
folder left behind (``kimi.checkpoint.DiskFullError``; the writers ``write_atomic``, ``write_stream`` and the
trainer's DCP resume states).

The full disk is simulated: ``os.fsync`` (or DCP's item writer) raises ``OSError(ENOSPC)`` for files under the
output folder, as a real write does when the file system fills up part-way.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kimi.checkpoint import DiskFullError, write_atomic
from kimi_tools.cli import main


@pytest.fixture
def full_under(monkeypatch):
    """``full_under(folder)``: from now on, fsync of a file under ``folder`` fails with ENOSPC."""
    real = os.fsync

    def arm(folder: Path) -> None:
        folder = str(Path(folder).resolve())

        def fsync(fd):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            if target.startswith(folder):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to tell which file an fsync is for")
    return arm


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp" in p.name) if folder.exists() else []


def test_write_atomic_disk_full_names_path_and_leaves_nothing(tmp_path, full_under):
    target = tmp_path / "out" / "report.json"
    write_atomic(target, b"old")
    full_under(tmp_path / "out")
    with pytest.raises(DiskFullError) as ei:
        write_atomic(target, b"new" * 1000)
    msg = str(ei.value)
    assert str(target) in msg and "the disk is full" in msg and "\n" not in msg
    assert ei.value.errno == errno.ENOSPC and isinstance(ei.value, OSError)
    assert target.read_bytes() == b"old"  # untouched
    assert _leftovers(tmp_path) == []


def _cli(argv, capsys) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


def test_cli_writers_disk_full_one_line(tmp_path, full_under, capsys):
    """kimi init / logits / compare --json / ablate: exit 2, one line naming the path, no .tmp file or folder."""
    ckpt = tmp_path / "ckpt"
    assert main(["init", "--preset", "tiny", "--layers", "1", "--out", str(ckpt)]) == 0
    text = tmp_path / "t.txt"
    text.write_text("Alice was beginning to get very tired of sitting by her sister on the bank. " * 2)
    out = tmp_path / "out"
    out.mkdir()
    full_under(out)
    runs = {
        "init": (["init", "--preset", "tiny", "--layers", "1", "--out", str(out / "init")], out / "init"),
        "logits": (["logits", "--checkpoint", str(ckpt), "--text", str(text), "--out", str(out / "l.safetensors")],
                   out / "l.safetensors"),
        "compare": (["compare", "--checkpoint", str(ckpt), "--text", str(text), "--tokens", "24", "--backends",
                     "eager", "--quiet", "--json", str(out / "c.json")], out / "c.json"),
        "ablate": (["ablate", "--checkpoint", str(ckpt), "--text", str(text), "--tokens", "24", "--seq-len", "24",
                    "--set", "index_topk=8", "--out", str(out / "ab")], out / "ab"),
    }  # fmt: skip
    for name, (argv, path) in runs.items():
        rc, err = _cli(argv, capsys)
        lines = [ln for ln in err.splitlines() if ln.startswith("kimi: error:")]
        assert rc == 2, (name, err)
        assert len(lines) == 1 and "the disk is full" in lines[0] and str(path) in lines[0], (name, err)
        assert "Traceback" not in err and "[Errno 28]" not in err, (name, err)
        assert _leftovers(out) == [], name
    assert not (out / "init").exists()  # the folder init created for the checkpoint is gone again


def test_train_save_disk_full_one_line_no_tmp_folder(tmp_path, monkeypatch, capsys):
    """kimi train: the resume state's DCP save fails with ENOSPC: one line naming the step folder, no
    ``.step-N.tmp-PID`` folder left."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from kimi_tools.common import DEFAULT_TEXT

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp_fs, "_write_item", full)
    out = tmp_path / "run"
    argv = ["train", "--data", str(DEFAULT_TEXT), "--layers", "1", "--steps", "1", "--seq-len", "16",
            "--eval-tokens", "16", "--out", str(out), "--quiet"]  # fmt: skip
    rc, err = _cli(argv, capsys)
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kimi: error:"), err
    assert "the disk is full" in lines[0] and "step 1" in lines[0] and str(out) in lines[0], err
    assert not [p.name for p in out.iterdir() if p.name.startswith(".step-")]
