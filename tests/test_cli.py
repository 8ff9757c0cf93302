"""The `kimi` command line, run as a user would (a subprocess), including every refusal named in the issues."""

import json
import subprocess
import sys

import pytest
from safetensors.numpy import load_file


def kimi(*args, check=True):
    r = subprocess.run(
        [sys.executable, "-m", "kimi_tools.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    if check and r.returncode != 0:
        raise AssertionError(f"kimi {' '.join(map(str, args))} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def assert_clean_error(r, needle):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and needle in err[0], r.stderr


def test_info_k31_json():
    info = json.loads(kimi("info", "--preset", "k3.1-pro", "--json").stdout)
    assert abs(info["total_params"] / 2.78e12 - 1) < 0.005 and abs(info["active_params"] / 104e9 - 1) < 0.015
    assert info["num_layers"] == 93 and len(info["kda_layers"]) == 69 and len(info["dsa_layers"]) == 24
    assert info["dsa_layers"][-2:] == [91, 92]


def test_info_from_checkpoint_and_config(tiny_ckpt):
    a = json.loads(kimi("info", "--checkpoint", tiny_ckpt, "--json").stdout)
    b = json.loads(kimi("info", "--config", tiny_ckpt / "config.json", "--json").stdout)
    assert a == b and a["num_layers"] == 9


def test_init_layers_and_set(tmp_path):
    out = tmp_path / "ck"
    kimi("init", "--preset", "tiny", "--out", out, "--layers", "4", "--seed", "3", "--set", "num_experts=4")
    cfg = json.loads((out / "config.json").read_text())["text_config"]
    assert cfg["num_hidden_layers"] == 4 and cfg["num_experts"] == 4
    assert (out / "model.safetensors.index.json").exists() or (out / "model.safetensors").exists()
    r = kimi("init", "--preset", "tiny", "--out", out, check=False)
    assert_clean_error(r, "not empty")
    r = kimi("init", "--preset", "tiny", "--out", tmp_path / "x", "--set", "bogus=1", check=False)
    assert_clean_error(r, "--set")
    # a misspelt key: the close match and the valid keys, in one line
    r = kimi("init", "--preset", "tiny", "--out", tmp_path / "x", "--set", "num_expert=4", check=False)
    assert_clean_error(r, "did you mean num_experts")
    assert "valid keys: activation_situ_beta" in r.stderr and "vocab_size)" in r.stderr, r.stderr


@pytest.mark.slow
def test_compare_defaults_pass(tmp_path):
    r = kimi("compare", "--json", tmp_path / "report.json", "--quiet")
    assert "PASS" in r.stdout and "FAIL" not in r.stdout
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["tokens"] > rep["index_topk"]  # sparse selection exercised
    assert {x["backend"] for x in rep["reports"]} == {"torch-eager", "torch-sdpa"}
    assert all(x["passed"] for x in rep["reports"])
    dsa = [row for row in rep["reports"][0]["layers"] if row["kind"] == "dsa"]
    assert dsa and all(row["selection"]["rows"] == rep["tokens"] for row in dsa)


@pytest.mark.slow
def test_compare_bf16_passes_with_layer_local_rows():
    r = kimi("compare", "--dtype", "bfloat16", "--backends", "sdpa", "--quiet")
    assert "PASS" in r.stdout and "FAIL" not in r.stdout


@pytest.mark.slow
def test_compare_against_the_eager_fp32_oracle(tmp_path):
    r = kimi(
        "compare",
        "--reference",
        "eager",
        "--backends",
        "sdpa",
        "--tokens",
        "80",
        "--json",
        tmp_path / "r.json",
        "--quiet",
    )
    assert "vs torch-eager fp32" in r.stdout and "PASS" in r.stdout
    assert json.loads((tmp_path / "r.json").read_text())["reference"] == "torch-eager fp32"


@pytest.mark.slow
def test_compare_on_init_layers_4_checkpoint(tmp_path):
    kimi("init", "--preset", "tiny", "--out", tmp_path / "ck", "--layers", "4")
    r = kimi("compare", "--checkpoint", tmp_path / "ck", "--tokens", "150", "--quiet")
    assert "PASS" in r.stdout
    assert "index_topk 64" in r.stdout.splitlines()[0]  # layer 3 is DSA: tiny's own top-k is shown


@pytest.mark.slow
def test_compare_kimi_linear_preset():
    r = kimi("compare", "--preset", "tiny-linear", "--tokens", "120", "--quiet")
    assert "PASS" in r.stdout and "FAIL" not in r.stdout
    assert "6 layers" in r.stdout


@pytest.mark.slow
def test_compare_names_first_divergent_layer(tmp_path):
    """Corrupt one weight of layer 2 in the torch path only: compare must fail and name layer 2."""
    script = """
import sys, torch
from kimi_tools.cli import main
import kernels_torch.model as km
orig = km.load_model
def corrupted(*a, **k):
    m = orig(*a, **k)
    with torch.no_grad():
        m.model.layers[2].self_attn.o_proj.weight.mul_(1.01)
    return m
km.load_model = corrupted
sys.exit(main(["compare", "--tokens", "100", "--backends", "eager", "--quiet"]))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "first divergent layer 2" in r.stderr


@pytest.mark.slow
def test_logits_and_against_roundtrip(tmp_path):
    kimi("init", "--preset", "tiny", "--out", tmp_path / "ck", "--layers", "4")
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(10, 90))))
    out = tmp_path / "l.safetensors"
    kimi(
        "logits",
        "--checkpoint",
        tmp_path / "ck",
        "--ids",
        ids,
        "--backend",
        "sdpa",
        "--out",
        out,
        "--hidden",
        "--quiet",
    )
    f = load_file(out)
    assert f["logits"].shape == (80, 512) and f["input_ids"].tolist() == list(range(10, 90))
    assert {f"hidden.{i}" for i in range(4)} <= f.keys()
    r = kimi("compare", "--checkpoint", tmp_path / "ck", "--against", out, "--quiet")
    assert "PASS" in r.stdout


def test_compare_header_and_short_text_note(tmp_path):
    """Header: no DSA layer in --layers 1, so no index_topk (it printed the 2048 default, not tiny's 64); the
    tokenizer is named as such, not as a 'fallback'. Asking for more tokens than the text has says so."""
    text = tmp_path / "short.txt"
    text.write_text("Alice was beginning to get very tired of sitting by her sister.\n")  # 64 bytes = 64 tokens
    r = kimi("compare", "--layers", "1", "--text", text, "--tokens", "100000", "--backends", "eager", "--quiet")
    header = r.stdout.splitlines()[0]
    assert "no DSA layer" in header and "2048" not in header and "index_topk" not in header, header
    assert "byte-level tokenizer" in header and "fallback" not in header, header
    assert f"text {text}" in header, header  # the header names the text it read
    assert "64 tokens" in header and "PASS" in r.stdout
    assert "--tokens 100000 is more than the 64 tokens of the input; running on 64" in r.stderr, r.stderr


def test_compare_header_names_the_bundled_default_text(tiny_ckpt):
    """Without --text the description (the header's text part) names the bundled default, not only the tokenizer."""
    from argparse import Namespace

    from kimi.config import KimiConfig
    from kimi_tools.common import DEFAULT_TEXT, token_ids

    cfg = KimiConfig.from_json(tiny_ckpt / "config.json")
    ids, desc = token_ids(Namespace(text=None, ids=None, tokens=8), tiny_ckpt, cfg)
    assert len(ids) == 8 and desc.startswith(f"the bundled text {DEFAULT_TEXT.name}, "), desc


def test_forward_names_what_it_ran(tiny_ckpt):
    r = kimi("forward", "--layers", "1", "--tokens", "4")
    assert r.stdout.startswith("kimi forward: preset tiny, random init seed 0; 1 layers; 4 random token ids"), r.stdout
    r = kimi("forward", "--checkpoint", tiny_ckpt, "--layers", "1", "--tokens", "4", "--backend", "eager")
    assert r.stdout.startswith(f"kimi forward: checkpoint {tiny_ckpt}; 1 layers;"), r.stdout
    assert "backend eager" in r.stdout.splitlines()[0] and "finite True" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["compare", "--tokens", "0"], "--tokens"),
        (["compare", "--backends", "eager,triton"], "--backends"),
        (["compare", "--text", "EMPTY"], "empty"),
        (["compare", "--text", "LATIN1"], "not UTF-8"),
        (["compare", "--checkpoint", "MISSING_TENSOR"], "model.layers.1.self_attn.q_proj.weight"),
        (["compare", "--checkpoint", "NOWHERE"], "NOWHERE"),
        (["compare", "--text", "MISSING_FILE"], "--text: no file"),
        (["compare", "--ids", "HUGE_IDS"], "token ids: got 100000000000000000000000"),
        pytest.param(
            ["compare", "--backends", "cudnn", "--tokens", "8"],
            "CUDA is not available here",
            marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only refusal"),
        ),
        pytest.param(
            ["forward", "--backend", "cudnn", "--tokens", "8"],
            "CUDA is not available",
            marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only refusal"),
        ),
    ],
)
def test_bad_input_one_line_error(args, needle, tmp_path, tiny_ckpt):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    broken = tmp_path / "broken"
    if "MISSING_TENSOR" in args:
        _copy_without(tiny_ckpt, broken, "model.layers.1.self_attn.q_proj.weight")
    (tmp_path / "huge.json").write_text("[1, 100000000000000000000000]")
    subst = {
        "EMPTY": tmp_path / "empty.txt",
        "LATIN1": tmp_path / "latin1.txt",
        "MISSING_TENSOR": broken,
        "NOWHERE": tmp_path / "NOWHERE",
        "MISSING_FILE": tmp_path / "nope.txt",
        "HUGE_IDS": tmp_path / "huge.json",
    }
    r = kimi(*[subst.get(a, a) for a in args], check=False)
    assert_clean_error(r, needle)


def _copy_without(src, dst, name):
    """Copy a checkpoint as one model.safetensors, dropping one tensor (the project's writer refuses to)."""
    from safetensors.torch import save_file

    from kimi.checkpoint import CheckpointReader

    reader = CheckpointReader(src)
    prefix = reader.config.key_prefix
    dst.mkdir()
    save_file(
        {prefix + k: reader.get(k).contiguous() for k in reader.keys() if k != name}, str(dst / "model.safetensors")
    )
    (dst / "config.json").write_text((src / "config.json").read_text())


@pytest.mark.parametrize("argv", [["train", "--steps", "0"], ["info", "--bogus"], ["generate", "--top-p", "x"]])
def test_argument_errors_have_the_one_line_form(argv, capsys):
    """argparse's own refusals read like every other failure: one ``kimi: error: ...`` line, exit 2."""
    from kimi_tools.cli import main as cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("kimi: error: ")


@pytest.mark.parametrize("command", ["compare", "logits"])
def test_output_that_is_not_a_regular_file_is_refused_before_the_run(tmp_path, command, capsys, monkeypatch):
    """``--json`` / ``--out`` naming a device (a link to /dev/null here) is refused in one line naming the flag and path,
    before any model is loaded, and the link is left in place (a rename would have replaced it)."""
    import os

    import kimi_tools.cli as cli
    from kimi_tools.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "materialise_checkpoint", no_load)
    dev = tmp_path / "dev"
    dev.symlink_to("/dev/null")
    flag = "--json" if command == "compare" else "--out"
    assert main([command, "--layers", "1", "--tokens", "8", flag, str(dev), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"kimi: error: {flag}: {dev}: exists and is a character device" in err[0], err
    assert os.readlink(dev) == "/dev/null"
