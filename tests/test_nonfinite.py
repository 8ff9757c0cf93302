"""Issue 13, fault 5: non-finite weights are refused on load by name, and ``kimi compare`` / ``kimi logits`` say where
values first went non-finite.

Mutations tried (each fails a test here): ``check_finite`` defaulting to False; ``nonfinite_tensors`` skipping bf16
tensors (``t.dtype == torch.float32`` instead of ``is_floating_point``); ``first_nonfinite`` scanning ``residual``
only (reports the MoE layer's residual instead of its ``mlp_out``), or returning None.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kimi.checkpoint import CheckpointError, load_params, nonfinite_tensors, save_params
from kimi.config import load_config
from kimi.init import init_checkpoint
from kimi_tools.cli import main
from kimi_tools.compare import RunResult, first_nonfinite

LAYERS = 2  # tiny: layer 0 KDA + dense MLP, layer 1 KDA + latent MoE


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny2")
    init_checkpoint(path, load_config("tiny").truncated(LAYERS), seed=0)
    return path


def _poisoned(src, dst, edits):
    params = load_params(src)
    for name, fn in edits.items():
        params[name] = fn(params[name])
    save_params(dst, params, load_config("tiny").truncated(LAYERS))
    return dst


def test_nonfinite_tensors_names_and_counts():
    t = torch.randn(4, 5, dtype=torch.bfloat16)
    t[0, 0], t[1, 2], t[3, 4] = float("nan"), float("inf"), float("-inf")
    params = {"a.weight": torch.randn(3), "b.weight": t, "ids": torch.arange(3)}
    assert nonfinite_tensors(params) == ["non-finite: b.weight: 1 NaN, 2 inf of 20 values"]
    assert nonfinite_tensors({"a": torch.randn(3, dtype=torch.float64)}) == []


def test_load_params_refuses_nonfinite_by_name(small_ckpt, tmp_path):
    bad = _poisoned(
        small_ckpt,
        tmp_path / "bad",
        {
            "model.layers.1.self_attn.q_proj.weight": lambda w: w.index_fill(0, torch.tensor([2]), float("nan")),
            "lm_head.weight": lambda w: w.index_fill(1, torch.tensor([0]), float("inf")),
        },
    )
    with pytest.raises(CheckpointError, match="non-finite") as e:
        load_params(bad)
    names = " ".join(e.value.problems)
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert len(e.value.problems) == 2
    assert "check_finite=False" in str(e.value)  # says how to switch it off
    p = load_params(bad, check_finite=False)  # the switch for speed
    assert torch.isnan(p["model.layers.1.self_attn.q_proj.weight"]).any()


def test_first_nonfinite_order():
    ok = {k: np.ones((3, 2), np.float32) for k in ("attn_out", "mlp_out", "residual")}
    bad = dict(ok, mlp_out=np.array([[1, np.inf]] * 3, np.float32), residual=np.full((3, 2), np.nan, np.float32))
    run = RunResult("x", np.ones((3, 5), np.float32), [ok, bad, bad])
    assert first_nonfinite(run, ["kda", "mla", "dsa"]) == "layer 1 (mla) mlp_out (3 of 6 values)"
    assert first_nonfinite(RunResult("x", np.full((3, 5), np.nan, np.float32), [ok])) == "logits"
    assert first_nonfinite(RunResult("x", np.ones((3, 5), np.float32), [ok])) is None


def test_cli_logits_and_compare_name_the_first_nonfinite_layer(small_ckpt, tmp_path, capsys):
    """Finite but huge weights in layer 1's shared-expert down projection overflow its MLP output to inf: both
    commands name layer 1's mlp_out, not a later layer or the logits."""
    huge = _poisoned(
        small_ckpt,
        tmp_path / "huge",
        {"model.layers.1.block_sparse_moe.shared_experts.down_proj.weight": lambda w: torch.sign(w) * 3e38},
    )
    text = tmp_path / "t.txt"
    text.write_text("Alice was beginning to get very tired.")
    rc = main(
        ["logits", "--checkpoint", str(huge), "--backend", "eager", "--text", str(text), "--tokens", "8", "--quiet"]
        + ["--out", str(tmp_path / "l.safetensors")]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "non-finite values, first at layer 1 (kda) mlp_out" in err, err
    # --reference eager: the fp32 torch oracle (the JAX one costs ~20 s of compilation here; same reporting code)
    rc = main(
        ["compare", "--checkpoint", str(huge), "--reference", "eager", "--backends", "eager"]
        + ["--text", str(text), "--tokens", "8", "--quiet"]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert "torch-eager fp32: non-finite values, first at layer 1 (kda) mlp_out" in err, err
    assert "torch-eager: non-finite values, first at layer 1 (kda) mlp_out" in err, err
    # and non-finite *weights* stop both commands at load, by name, with the CLI's one-line error
    nan = _poisoned(small_ckpt, tmp_path / "nan", {"lm_head.weight": lambda w: w * float("nan")})
    assert main(["logits", "--checkpoint", str(nan), "--text", str(text), "--out", str(tmp_path / "m.st")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimi: error: ") and "lm_head.weight" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["one-read", "streamed"])
@pytest.mark.parametrize("where", ["prefill", "step"])
def test_static_decode_refuses_nonfinite_logits(small_ckpt, monkeypatch, where, stream):
    """Static decode samples on the device without a host read, so an id drawn from NaN logits is arbitrary: the
    Decoder flags them, and ``generate(decode="static")`` raises when it reads the tokens, before any id drawn from
    them reaches ``on_token``. NaN in the prefill's logits (the first token) or in the 3rd decode step's (one row);
    streamed (a read per token: the tokens before are emitted) or read once at the end (none emitted). ``reset``
    clears the flag: the same Decoder then generates."""
    import kernels_torch.decode as kdec
    from kernels_torch.model import load_model
    from kimi_tools.generate import generate

    model = load_model(small_ckpt, backend="eager")
    prompts, new = [[1, 2, 3], [4, 5, 6, 7]], 6
    dec = kdec.Decoder(model, 2, 4 + new, mode="static")
    calls = []
    if where == "prefill":
        prefill = kdec.Decoder.prefill

        def poisoned(self, *a, **k):
            out = prefill(self, *a, **k)
            out[0, 7] = float("nan")
            return out

        monkeypatch.setattr(kdec.Decoder, "prefill", poisoned)
    else:
        step = kdec.decode_step

        def poisoned(*a, **k):
            logits = step(*a, **k)
            calls.append(1)
            if len(calls) == 3:
                logits[1, 7] = float("nan")
            return logits

        monkeypatch.setattr(kdec, "decode_step", poisoned)
    emitted = []
    on_token = (lambda row, tok: emitted.append((row, tok))) if stream else None
    with pytest.raises(ValueError, match="logits: a decode step produced NaN or inf; expected finite values"):
        generate(model, prompts, new, decode=dec, stop_token=None, on_token=on_token)
    # streamed: tokens 0..2 of each row (the 3rd step's logits gave token 3) / none before a NaN first token
    assert len(emitted) == (2 * 3 if stream and where == "step" else 0), emitted
    monkeypatch.undo()
    res = generate(model, prompts, new, decode=dec, stop_token=None)
    assert [len(r) for r in res.tokens] == [new, new]
