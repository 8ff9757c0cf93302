"""The command line's side effects on disk and on the terminal: a random init of a preset that does not fit is refused
before anything is written, a long one shows its progress, a signal removes the temporary folder and ends in one
line, an output path that cannot be one is refused naming its flag, and under torchrun one rank speaks."""

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest

import kimi.init
import kimi_tools.common as common
from kimi.config import load_config
from kimi_tools.cli import _with_flag, main

ROOT = Path(__file__).resolve().parent.parent
DiskUsage = namedtuple("DiskUsage", "total used free")


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    err = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("kimi: error: "), captured.err
    assert "Traceback" not in captured.err and "[Errno" not in captured.err, captured.err
    return err[0]


# ---------------------------------------------------------------------------------------------- size before writing


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """10 GB free everywhere, the temporary folder in ``tmp_path/tmp``, and any random init a test failure."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(common.tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(common.shutil, "disk_usage", lambda p: DiskUsage(10**12, 10**12 - 10 * 10**9, 10 * 10**9))

    def no_write(*a, **k):
        raise AssertionError("a random init was written")

    monkeypatch.setattr(kimi.init, "init_checkpoint", no_write)
    return tmp


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--preset", "k3.1-pro", "--prompt", "Alice", "--max-new-tokens", "1"],
        ["compare", "--preset", "k3.1-pro", "--quiet"],
        ["forward", "--preset", "k3.1-pro"],
        ["init", "--preset", "k3.1-pro", "--out", "OUT"],
    ],
    ids=["generate", "compare", "forward", "init"],
)
def test_preset_larger_than_the_free_space_is_refused_before_writing(argv, small_disk, tmp_path, capsys):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    full = kimi.init.checkpoint_nbytes(load_config("k3.1-pro"))
    assert 1.5e12 < full < 1.6e12  # 2.78T parameters, the routed experts in MXFP4
    assert "--preset k3.1-pro" in line and common.human_bytes(full) in line and "10.0 GB free" in line, line
    glob, per_layer = kimi.init.layer_nbytes(load_config("k3.1-pro"))
    assert glob + per_layer[0] <= 10e9 < glob + per_layer[0] + per_layer[1]  # so the largest N that fits is 1
    assert "at most --layers 1 fits" in line, line
    assert list(small_disk.iterdir()) == [] and not (tmp_path / "out").exists()


def test_checkpoint_nbytes_bounds_the_files_written(tmp_path):
    """The estimate is the tensor data written (the sizes ``on_bytes`` reports) plus at most 160 header bytes per
    tensor, and at least the safetensors files' size."""
    cfg = load_config("tiny")
    seen = []
    kimi.init.init_checkpoint(tmp_path, cfg, layers=3, on_bytes=seen.append)
    files = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    est = kimi.init.checkpoint_nbytes(cfg, 3)
    assert sum(seen) < files <= est
    n_tensors = len(seen)
    assert est == sum(seen) + 160 * n_tensors


def test_long_random_init_shows_progress(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "PROGRESS_BYTES", 0)  # the bar's threshold, 1 GiB, lowered for the tiny preset
    assert main(["init", "--preset", "tiny", "--layers", "2", "--out", str(tmp_path / "ck")]) == 0
    captured = capsys.readouterr()
    assert "random init" in captured.err and "B/s" in captured.err, captured.err
    assert "random init" not in captured.out


# ---------------------------------------------------------------------------------------------- signals

_SLOW_INIT = textwrap.dedent(
    """
    import sys, threading, time
    import kimi.init
    draw = kimi.init._init_stored
    said = threading.Lock()  # the tensors are drawn on several threads: one whole line each
    def slow(*a, **k):  # each tensor takes a while: the signal comes while the checkpoint is being written
        with said:
            print("drawing", flush=True)
        time.sleep(0.2)
        return draw(*a, **k)
    kimi.init._init_stored = slow
    from kimi_tools.cli import main
    sys.exit(main(["forward", "--preset", "tiny", "--layers", "2"]))
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_while_materialising_removes_the_temporary_folder(tmp_path, sig):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen(
        [sys.executable, "-c", _SLOW_INIT],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a shell's background job starts with SIGINT ignored, and Python keeps it so: give the child the default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert p.stdout.readline().strip() == "drawing"  # the temporary folder exists and is being written
        assert [f.name[:5] for f in tmp.iterdir()] == ["kimi-"]
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    name = signal.Signals(sig).name
    assert p.returncode == 128 + sig, (p.returncode, err)
    assert [ln for ln in err.splitlines() if ln.strip()] == [f"kimi forward: interrupted by {name}"], err
    assert list(tmp.iterdir()) == []


def test_stop_on_signals_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(common.Interrupted) as e, common.stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises before this ends
    assert e.value.exit_code == 143 and e.value.signal_name == "SIGTERM"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


# ---------------------------------------------------------------------------------------------- output paths


@pytest.fixture
def a_file(tmp_path) -> Path:
    f = tmp_path / "file"
    f.write_text("not a folder")
    return f


@pytest.mark.parametrize("under", [False, True], ids=["is-a-file", "under-a-file"])
@pytest.mark.parametrize("command", ["init", "ablate", "lora-merge"])
def test_out_folder_that_cannot_be_one_is_refused_naming_the_flag(command, under, a_file, tmp_path, capsys):
    out = a_file / "sub" if under else a_file
    (tmp_path / "base").mkdir()
    argv = {
        "init": ["init", "--preset", "tiny", "--layers", "1", "--out", str(out)],
        "ablate": ["ablate", "--set", "index_topk=16", "--tokens", "32", "--quiet", "--out", str(out)],
        "lora-merge": ["lora", "merge", "--checkpoint", str(tmp_path / "base"), "--adapter", str(tmp_path / "base")]
        + ["--out", str(out)],
    }[command]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"kimi: error: --out: {out}"), line
    want = f"{a_file} is a file, not a folder" if under else "exists and is not a folder"
    assert want in line and "expected a new folder" in line, line
    if command != "ablate":
        assert "--force" in line, line
    assert a_file.read_text() == "not a folder"


@pytest.mark.parametrize("command", ["compare", "logits"])
def test_out_file_under_a_file_is_refused_before_the_run(command, a_file, monkeypatch, capsys):
    import kimi_tools.cli as cli

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "materialise_checkpoint", no_load)
    flag = "--json" if command == "compare" else "--out"
    out = a_file / "x.out"
    assert main([command, "--layers", "1", "--tokens", "8", "--text", str(a_file), flag, str(out), "--quiet"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"kimi: error: {flag}: {out}: {a_file} is a file, not a folder"), line


@pytest.mark.parametrize("command", ["info", "forward", "generate", "ablate"])
@pytest.mark.parametrize("missing", [False, True], ids=["a-file", "missing"])
def test_checkpoint_that_is_not_a_folder_is_refused_naming_the_flag(command, missing, a_file, tmp_path, capsys):
    ckpt = tmp_path / "nowhere" if missing else a_file
    extra = {
        "info": [],
        "forward": [],
        "generate": ["--prompt", "a", "--max-new-tokens", "1"],
        "ablate": ["--set", "index_topk=16", "--out", str(tmp_path / "ab")],
    }[command]
    assert main([command, "--checkpoint", str(ckpt), *extra]) == 2
    line = _one_error_line(capsys)
    what = "does not exist" if missing else "is a file"
    assert line == f"kimi: error: --checkpoint: {ckpt} {what}; expected a checkpoint folder (config.json + safetensors)"


def test_bare_os_error_names_its_flag(tmp_path):
    """The last resort for an OSError no check caught: the option whose path failed, or that the path lies under."""
    args = argparse.Namespace(cmd="x", out=str(tmp_path / "o"), text="README.md", seed=0)
    e = NotADirectoryError(20, "Not a directory", str(tmp_path / "o" / "model.safetensors"))
    assert _with_flag(e, args) == f"--out: {args.out}: Not a directory ({e.filename})"
    e = FileExistsError(17, "File exists", str(tmp_path / "o"))
    assert _with_flag(e, args) == f"--out: {args.out}: File exists"
    e = PermissionError(13, "Permission denied", "/elsewhere")
    assert _with_flag(e, args) == str(e)  # no option's path: the message as it is


# ---------------------------------------------------------------------------------------------- one rank speaks


@pytest.mark.parametrize("rank", ["0", "1"])
def test_only_rank_zero_prints_the_error(rank, tmp_path, monkeypatch, capsys):
    """Under torchrun (``RANK`` set) an error every rank meets is printed by rank 0 alone; the others exit with the
    same status silently. Both a command's error and an argument error."""
    monkeypatch.setenv("RANK", rank)
    assert main(["info", "--checkpoint", str(tmp_path / "nowhere")]) == 2
    with pytest.raises(SystemExit) as e:
        main(["info", "--no-such-flag"])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == (2 if rank == "0" else 0), err


@pytest.mark.distributed
def test_torchrun_error_after_process_group_init_is_printed_once(tmp_path):
    """2 gloo ranks, ``--ep 2`` on a one-layer tiny model (no MoE layer to shard): refused by every rank after the
    process group is made; one ``kimi: error:`` line in all of torchrun's output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    cmd += ["kimi_tools.cli", "train", "--preset", "tiny", "--layers", "1", "--ep", "2", "--steps", "1"]
    cmd += ["--seq-len", "32", "--batch-tokens", "64", "--data", str(ROOT / "kimi/data/alice_ch1.txt")]
    cmd += ["--out", str(tmp_path / "run")]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "kimi: error:" in ln]
    assert len(lines) == 1 and lines[0].startswith("kimi: error: --"), r.stdout + r.stderr
