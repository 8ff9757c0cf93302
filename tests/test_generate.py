"""``kimi_tools.generate``: greedy tokens equal on jax, eager and sdpa and equal to the cache-free greedy oracle
(nanochat's engine-vs-``GPT.generate`` test), seeded sampling, batches of different lengths, the command line."""

import json
import math

import numpy as np
import pytest
import torch

from kernels_torch.model import load_model as load_torch
from kimi_tools.cli import main
from kimi_tools.common import DEFAULT_TEXT
from kimi_tools.generate import generate, sample
from reference_jax.model import load_model as load_jax

PROMPT = list(DEFAULT_TEXT.read_bytes()[:24])  # byte-level ids of the bundled text


def greedy_oracle(model, prompt, n):
    """Cache-free greedy decoding: the whole sequence through the model for every new token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.slow
def test_greedy_tokens_equal_on_jax_eager_sdpa(tiny_ckpt):
    """The whole tiny preset (9 layers, three DSA layers), 8 greedy tokens: one sequence of ids on all backends."""
    eager = load_torch(tiny_ckpt, backend="eager")
    want = greedy_oracle(eager, PROMPT, 8)
    got = {"eager": generate(eager, PROMPT, 8, stop_token=None).tokens[0]}
    got["sdpa"] = generate(load_torch(tiny_ckpt, backend="sdpa"), PROMPT, 8, stop_token=None).tokens[0]
    jmodel, params, _ = load_jax(tiny_ckpt)
    got["jax"] = generate(jmodel, PROMPT, 8, params=params, stop_token=None).tokens[0]
    assert all(v == want for v in got.values()), (want, got)


def test_batch_of_different_lengths_and_chunked_prefill(tiny_ckpt):
    model = load_torch(tiny_ckpt, layers=4)
    prompts = [PROMPT[:5], PROMPT, PROMPT[:13]]
    res = generate(model, prompts, 5, stop_token=None)  # the oracle does not stop at eos
    assert res.tokens == [greedy_oracle(model, p, 5) for p in prompts]
    assert generate(model, PROMPT, 5, chunk_size=7, stop_token=None).tokens == [res.tokens[1]]
    assert res.stats["prefill_tokens"] == 42 and res.stats["decode_tokens"] == 15 and res.stats["decode_tok_s"] > 0


def test_sampling_is_seeded_and_streams(tiny_ckpt):
    model = load_torch(tiny_ckpt, layers=4)
    seen = []
    a = generate(model, PROMPT, 6, temperature=1.0, top_p=0.9, seed=3, on_token=lambda b, t: seen.append(t))
    b = generate(model, PROMPT, 6, temperature=1.0, top_p=0.9, seed=3)
    c = generate(model, PROMPT, 6, temperature=1.0, top_p=0.9, seed=4)
    assert a.tokens == b.tokens and seen == a.tokens[0]
    assert a.tokens != c.tokens  # 6 draws from a near-uniform random-init distribution: equal by chance ~never
    stop = a.tokens[0][2]
    assert generate(model, PROMPT, 6, temperature=1.0, top_p=0.9, seed=3, stop_token=stop).tokens[0][-1] == stop


def test_sample():
    rng = np.random.default_rng(0)
    logits = np.array([[0.0, 3.0, 1.0, 3.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, 0.0, 1.0, rng).tolist() == [1, 0]  # greedy: ties to the lowest id
    assert sample(logits, 1.0, 1e-6, rng).tolist() == [1, 0]  # top_p -> 0 keeps only the most likely token
    draws = np.stack([sample(logits, 1.0, 1.0, rng) for _ in range(2000)])
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert np.allclose(np.bincount(draws[:, 0], minlength=4) / 2000, p, atol=0.04)
    nucleus = np.stack([sample(logits, 1.0, 0.8, rng) for _ in range(200)])
    assert set(nucleus[:, 0].tolist()) == {1, 3}  # 0.84 of the mass is in ids 1 and 3
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, -1.0, 1.0, rng)
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, 1.0, 0.0, rng)


@pytest.mark.parametrize(
    "temperature, top_p, match",
    [
        (math.inf, 1.0, "temperature: got inf, expected a finite number"),  # was a silent uniform draw
        (math.nan, 1.0, "temperature: got nan"),
        (-0.5, 1.0, "temperature: got -0.5"),
        (1e-320, 1.0, "temperature: got 1e-320, so small that logits / temperature overflows"),  # was NaN probs
        (1.0, math.nan, "top_p: got nan"),
        (1.0, 1.5, "top_p: got 1.5"),
        (1.0, -0.1, "top_p: got -0.1"),
    ],
)
def test_sample_refuses_nonfinite_settings(temperature, top_p, match):
    logits = np.array([[0.0, 3.0, 1.0, 3.0]])
    with pytest.raises(ValueError, match=match):
        sample(logits, temperature, top_p, np.random.default_rng(0))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize(
    "row", [[0.0, np.nan, 5.0], [np.nan] * 3, [0.0, np.inf, 1.0], [-np.inf] * 3], ids=["nan", "all-nan", "inf", "-inf"]
)
def test_sample_names_bad_logits_not_the_temperature(temperature, row):
    """Bad logits are refused whatever the temperature: greedy returned argmax of a NaN row (the first NaN's id) as
    if it were a token."""
    logits = np.array([[0.0, 3.0, 1.0], row])
    with pytest.raises(ValueError, match="logits: a row holds NaN, \\+inf or only -inf"):
        sample(logits, temperature, 1.0, np.random.default_rng(0))


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--temperature", "inf", "--temperature: got inf, expected a finite number >= 0"),
        ("--temperature", "nan", "--temperature: got nan, expected a finite number >= 0"),
        ("--temperature", "-1", "--temperature: got -1.0, expected a finite number >= 0"),
        ("--top-p", "nan", "--top-p: got nan, expected a number in (0, 1]"),
        ("--top-p", "0", "--top-p: got 0.0, expected a number in (0, 1]"),
        ("--top-p", "1.01", "--top-p: got 1.01, expected a number in (0, 1]"),
    ],
)
def test_cli_generate_refuses_bad_sampling_flags(capsys, flag, value, message):
    """One ``kimi: error:`` line and exit 2, before any model is built (``--temperature inf`` used to run)."""
    with pytest.raises(SystemExit) as e:
        main(["generate", "--preset", "tiny", "--layers", "1", "--prompt", "a", "--max-new-tokens", "1", flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("kimi: error: ") and message in err[0], err


def test_generate_refuses_bad_input(tiny_ckpt):
    model = load_torch(tiny_ckpt, layers=1)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, [[1, 2], []], 3)
    with pytest.raises(ValueError, match="token id 600"):
        generate(model, [1, 600], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [1, 2], 0)
    with pytest.raises(ValueError, match="chunk_size"):
        generate(model, [[1, 2], [3]], 2, chunk_size=1)
    # past max_position_embeddings: the cache-free forward's policy (warn, compute), also on the cached path
    model.config = model.config.replace(max_position_embeddings=4)
    with pytest.warns(UserWarning, match="max_position_embeddings=4"):
        generate(model, [1, 2, 3], 2, stop_token=None)


def test_cli_generate_streams_text_and_stats(capsys, tmp_path):
    assert main(["generate", "--preset", "tiny", "--layers", "4", "--prompt", "Alice", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Alice") and out.endswith("\n")
    assert "prefill: 5 tokens" in err and "decode: 4 tokens" in err and "tok/s" in err
    f = tmp_path / "p.txt"
    f.write_bytes(b"\xff\xfe")
    assert main(["generate", "--prompt-file", str(f), "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"kimi: error: --prompt-file: {f} is not UTF-8 text (byte 0: invalid start byte)"
    ]
    assert main(["generate", "--prompt-file", str(tmp_path / "none"), "--max-new-tokens", "2"]) == 2
    assert "no file at" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")  # the error names the flag that was given
    assert main(["generate", "--prompt-file", str(tmp_path / "empty.txt"), "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"kimi: error: --prompt-file: got an empty file {tmp_path / 'empty.txt'}, expected some text"
    ]
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "a", "--max-new-tokens", "2", "--temperature", "-1"])
    assert e.value.code == 2 and "--temperature: got -1.0" in capsys.readouterr().err


def test_cli_generate_on_an_adapter_folder_says_to_merge(capsys, tmp_path):
    """A LoRA adapter folder is not a checkpoint: one line naming ``kimi lora merge`` with the recorded base."""
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/ckpts/base"}))
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt", "a", "--max-new-tokens", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a LoRA adapter folder" in err[0], err
    assert f"kimi lora merge --checkpoint /ckpts/base --adapter {tmp_path} --out MERGED" in err[0], err


def test_cli_generate_decode_switch(capsys):
    """``--decode static`` streams the same greedy text as the default (``loop`` on eager); ``--decode`` other than
    loop with ``--backend jax`` is one error line, before any model is built."""
    args = ["generate", "--preset", "tiny", "--layers", "4", "--prompt", "Alice", "--max-new-tokens", "4"]
    assert main(args) == 0
    want, err = capsys.readouterr()
    assert "decode loop" in err
    assert main([*args, "--decode", "static"]) == 0
    got, err = capsys.readouterr()
    assert got == want and "decode static" in err
    assert main([*args, "--backend", "jax", "--decode", "graph"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "kimi: error: --decode: got 'graph' with --backend jax, expected loop (or auto)"
    ]


def test_cli_generate_cuda_decode_off_cuda_refused_before_loading(capsys, monkeypatch):
    """``--decode graph|compile`` where the model would run on the CPU: one line naming --decode and the
    alternatives, before the model is built or the prompt printed; the library call names ``decode``."""
    import kimi_tools.generate as gen

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before --decode was checked")

    monkeypatch.setattr(gen, "materialise_checkpoint", no_loading)
    for mode in ("graph", "compile"):
        argv = ["generate", "--preset", "tiny", "--layers", "1", "--prompt", "Alice", "--max-new-tokens", "2"]
        assert main([*argv, "--decode", mode]) == 2
        out, err = capsys.readouterr()
        assert out == "", out
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kimi: error: --decode: got {mode!r}"), lines
        assert "--decode static" in lines[0] and "--device cuda" in lines[0] and " mode:" not in lines[0], lines


def test_generate_cuda_decode_on_a_cpu_model_names_decode(tiny_ckpt):
    model = load_torch(tiny_ckpt, layers=1)
    with pytest.raises(ValueError, match=r"^decode: got 'graph', which captures CUDA graphs.*'static'"):
        generate(model, [1, 2], 2, decode="graph")
