"""``kimi train`` (kimi_tools.train, kimi_tools.data): schedule, packing, exact resume, frozen parts, outputs, errors.

The runs use the tiny preset cut to 2 layers (KDA dense + KDA MoE; 4 layers where the DSA indexer matters) on the
bundled Alice chapter, 16-token rows: a few seconds each on a 2-core CPU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kimi_tools.cli import main
from kimi_tools.common import DEFAULT_TEXT
from kimi_tools.data import IGNORE_INDEX, PackedLoader, read_documents, split_tail
from kimi_tools.train import RECORD_KEYS, STAGES, LMStage, TrainArgs, lr_multiplier, train

SMALL = dict(
    data=[str(DEFAULT_TEXT)],
    layers=2,
    steps=6,
    seq_len=16,
    micro_batch_tokens=32,
    batch_tokens=32,
    eval_tokens=32,
    eval_every=3,
    warmup_steps=1,
    lr=1e-2,
    quiet=True,
)
NUMERIC = ("step", "loss", "eval_loss", "lr", "grad_norm")


def _numbers(records):
    return [{k: r[k] for k in NUMERIC} for r in records]


def _dcp_keys(step_dir: Path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata


# ---------------------------------------------------------------------------------------------- schedule


def test_lr_multiplier_warmup_then_cosine():
    kw = dict(warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    m = [lr_multiplier(s, **kw) for s in range(20)]
    assert m[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warm-up reaches the peak at step warmup - 1 ...
    assert m[4] == 1.0  # ... and the cosine starts at the peak
    assert all(a >= b for a, b in zip(m[4:], m[5:]))  # non-increasing after warm-up
    assert 0.1 < m[-1] < 0.11  # ends just above min_lr_ratio
    assert math.isclose(m[4 + 8], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 16)))  # the formula, mid-way
    assert lr_multiplier(0, warmup_steps=0, total_steps=5, min_lr_ratio=0.0) == 1.0  # no warm-up
    assert m == [lr_multiplier(s, **kw) for s in range(20)]  # pure


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(step=20, warmup_steps=4, total_steps=20, min_lr_ratio=0.1), "step"),
        (dict(step=0, warmup_steps=20, total_steps=20, min_lr_ratio=0.1), "--warmup-steps"),
        (dict(step=0, warmup_steps=1, total_steps=20, min_lr_ratio=1.5), "--min-lr-ratio"),
    ],
)
def test_lr_multiplier_rejects(kw, field):
    step = kw.pop("step")
    with pytest.raises(ValueError, match=field):
        lr_multiplier(step, **kw)


# ---------------------------------------------------------------------------------------------- data


def test_packed_rows_labels_and_cu_seqlens():
    docs = [np.arange(10, 15), np.arange(20, 23), np.arange(30, 40)]  # lengths 5, 3, 10
    b = PackedLoader(docs, seq_len=6, rows=2, shuffle=False).next_batch()
    assert b.input_ids.tolist() == [[10, 11, 12, 13, 14, 20, 21, 22, 30, 31, 32, 33]]
    # next token of the same document; -100 where a document ends; a row's last label peeks at the next row
    assert b.labels.tolist() == [[11, 12, 13, 14, -100, 21, 22, -100, 31, 32, 33, 34]]
    # document starts (10 | 20 | 30) and the row boundary (after 6 tokens: 20 | 21) are all boundaries
    assert b.cu_seqlens.tolist() == [0, 5, 6, 8, 12]
    assert b.num_targets == 10
    nxt = PackedLoader(docs, seq_len=6, rows=2, shuffle=False)
    nxt.load_state_dict({"epoch": 0, "doc": 2, "offset": 4})
    b2 = nxt.next_batch()  # wraps into the next epoch
    assert b2.input_ids.tolist() == [[34, 35, 36, 37, 38, 39, 10, 11, 12, 13, 14, 20]]
    assert b2.labels.tolist()[0][5] == IGNORE_INDEX and b2.cu_seqlens.tolist() == [0, 6, 11, 12]
    assert nxt.state_dict() == {"epoch": 1, "doc": 1, "offset": 1}


def test_loader_resumes_the_same_batches():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, size=n) for n in (1, 7, 30, 2, 63, 5)]
    a = PackedLoader(docs, seq_len=9, rows=3, seed=4)
    for _ in range(5):
        a.next_batch()
    b = PackedLoader(docs, seq_len=9, rows=3, seed=4)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # plain ints survive a JSON round trip
    for _ in range(8):  # across epochs: the shuffled order of epoch e is a function of (seed, e)
        x, y = a.next_batch(), b.next_batch()
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
        assert torch.equal(x.cu_seqlens, y.cu_seqlens)
    assert a.epoch >= 1
    other = PackedLoader(docs, seq_len=9, rows=3, seed=5)
    assert not all(np.array_equal(other.order(e), a.order(e)) for e in range(3))
    with pytest.raises(ValueError, match="data position"):
        b.load_state_dict({"epoch": 0, "doc": 6, "offset": 0})


def test_read_documents_files_folders_jsonl(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("first doc")
    (tmp_path / "d" / "b.jsonl").write_text('{"text": "second"}\n\n{"text": "third", "id": 3}\n{"text": "  "}\n')
    (tmp_path / "d" / "skip.bin").write_bytes(b"\xff")
    assert read_documents([tmp_path / "d"]) == ["first doc", "second", "third"]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with a string 'text' field"):
        read_documents([tmp_path / "bad.jsonl"])
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(ValueError, match="no text"):
        read_documents([tmp_path / "empty.txt"])
    with pytest.raises(ValueError, match="no file or folder"):
        read_documents([tmp_path / "missing.txt"])


def test_split_tail_holds_out_the_last_tokens():
    docs = [np.arange(6), np.arange(100, 104)]
    train_docs, held = split_tail(docs, 0.3)  # 10 tokens: the last 3 held out, cutting the second document
    assert [d.tolist() for d in train_docs] == [[0, 1, 2, 3, 4, 5], [100]]
    assert [d.tolist() for d in held] == [[101, 102, 103]]


# ---------------------------------------------------------------------------------------------- the model side


@pytest.fixture(scope="module")
def tiny4():
    from kernels_torch.model import model_from_params
    from kimi.config import load_config
    from kimi.init import init_params

    full = load_config("tiny")
    cfg = full.truncated(4)  # KKKD: KDA, MoE and one DSA layer

    def make(backend):
        return model_from_params(cfg, init_params(full, seed=1, layers=4), backend)

    return cfg, make


def _packed_batch(T=40):
    docs = [np.asarray(list(t.encode())) for t in ("Alice was beginning", " to get very tired of sitting by her")]
    return PackedLoader(docs, seq_len=T, rows=1, shuffle=False).next_batch()


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_indexer_gets_no_lm_gradient(tiny4, backend):
    """Hard top-k: the LM loss reaches no indexer parameter (the stage freezes them; this checks why)."""
    cfg, make = tiny4
    model = make(backend)
    loss, _ = LMStage(cfg, None).loss(model, _packed_batch())
    loss.backward()
    names = [n for n, _ in model.named_parameters() if ".indexer." in n]
    assert names, "the 4-layer tiny model has a DSA layer"
    grads = dict(model.named_parameters())
    assert all(grads[n].grad is None for n in names)
    assert grads["model.layers.3.self_attn.q_a_proj.weight"].grad.abs().sum() > 0  # the DSA layer itself trains
    stage = LMStage(cfg, None)
    assert not any(stage.trainable(n) for n in names)


def test_recompute_gives_the_same_loss_and_grads(tiny4):
    """--recompute in every mode (whole layer; MLP / MoE block only; the first N layers whole and the others' MLP)
    gives the loss and every gradient of no recomputation, bit for bit on CPU, and recomputes what it says: the
    MLP of every layer, the attention of the whole-layer ones; a bad mode or layer count is refused by name."""
    from kernels_torch.activation_memory import recompute_layers

    cfg, make = tiny4
    batch = _packed_batch()
    out = []
    L = cfg.num_hidden_layers
    for mode, full, attn_runs in ((None, 0, L), ("layer", 0, 2 * L), ("mlp", 0, L), ("mlp", 2, L + 2)):
        model = make("sdpa")
        calls = []  # feed_forward runs: once per layer, twice where the backward recomputes it
        attn = []  # attention forwards, recomputed ones included
        for i, layer in enumerate(model.model.layers):
            ff = layer.feed_forward
            layer.feed_forward = lambda h, *a, ff=ff, **k: calls.append(1) or ff(h, *a, **k)
            layer.self_attn.register_forward_hook(lambda m, args, o, i=i: attn.append(i))
        if mode:
            recompute_layers(model, mode, full)
        loss, _ = LMStage(cfg, None).loss(model, batch)
        loss.backward()
        assert len(calls) == L * (2 if mode else 1), (mode, len(calls))
        assert len(attn) == attn_runs, (mode, full, attn)
        if full:
            assert sorted({i for i in attn if attn.count(i) == 2}) == list(range(full))
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0) = out[0]
    for l1, g1 in out[1:]:
        assert torch.equal(l0, l1)
        assert g0.keys() == g1.keys() and len(g0) > 50
        for n in g0:  # the same ops recomputed in the same order: equal to the bit on CPU
            assert torch.equal(g0[n], g1[n]), n
    with pytest.raises(ValueError, match="--recompute-mode: got 'moe'"):
        recompute_layers(make("sdpa"), "moe")
    with pytest.raises(ValueError, match=rf"--recompute-full-layers: got {L + 1}, expected an int in \[0, {L}\]"):
        recompute_layers(make("sdpa"), "mlp", L + 1)
    with pytest.raises(ValueError, match="--recompute-full-layers: got 1 with --recompute-mode layer"):
        recompute_layers(make("sdpa"), "layer", 1)


# ---------------------------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run A: 6 steps. Run B: the same, stopped after step 3, then resumed to step 6."""
    root = tmp_path_factory.mktemp("train")
    a = train(TrainArgs(out=str(root / "a"), **SMALL))
    b1 = train(TrainArgs(out=str(root / "b"), stop_after=3, **SMALL))
    b2 = train(TrainArgs(out=str(root / "b"), resume=True, **SMALL))
    return root, a, b1, b2


def test_resume_continues_exactly(runs):
    root, a, b1, b2 = runs
    assert (b1.step, b2.start_step, b2.step) == (3, 3, 6)
    assert _numbers(a.records) == _numbers(b1.records + b2.records)  # losses, lr, grad norms: bitwise equal
    from safetensors.torch import load_file

    wa, wb = load_file(root / "a" / "model.safetensors"), load_file(root / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    on_disk = [json.loads(x) for x in (root / "b" / "metrics.jsonl").read_text().splitlines()]
    assert _numbers(on_disk) == _numbers(a.records)  # one record per step, none repeated by the resume
    assert a.tokens_seen == b2.tokens_seen == 6 * 32


def test_run_outputs_and_eval_loss_falls(runs):
    root, a, _, _ = runs
    out = root / "a"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "loss.png",
        "metrics.jsonl",
        "model.safetensors",
        "model.safetensors.index.json",
        "run.json",
        "step-6",
    ]
    assert (out / "step-6" / ".metadata").is_file()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(7))
    assert all(tuple(r) == RECORD_KEYS for r in records)
    assert [s for s, r in enumerate(records) if r["eval_loss"] is not None] == [0, 3, 6]
    assert records[1]["lr"] == 1e-2 and all(r["grad_norm"] > 0 for r in records[1:])
    assert records[-1]["mfu"] is None and records[-1]["peak_mem_bytes"] > 0
    assert a.eval_losses[6] < a.eval_losses[0] - 0.5  # real text is learnable: well below the step-0 value
    run = json.loads((out / "run.json").read_text())
    assert run["args"]["batch_tokens"] == 32 and run["args"]["dtype"] == "float32"
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_output_loads_in_both_paths(runs):
    """The exported model is a checkpoint in the real layout: the JAX reference's load_model and the torch twin's
    read the same tensors, which are the trained weights (from the DCP state) in the checkpoint's dtypes."""
    import torch.distributed.checkpoint as dcp

    from kernels_torch.model import load_model as load_torch
    from kimi.arrays import to_torch
    from reference_jax.model import load_model as load_jax
    from reference_jax.params import from_tree

    out = runs[0] / "a"
    jmodel, tree, cfg = load_jax(out)
    assert cfg.num_hidden_layers == 2
    jax_params = from_tree(tree)  # numpy arrays
    from kernels_torch.params import canonical_state_dict

    torch_params = canonical_state_dict(load_torch(out, backend="sdpa"))  # the checkpoint's names (experts split)
    assert jax_params.keys() == torch_params.keys()
    assert all(torch.equal(to_torch(jax_params[k]), torch_params[k]) for k in jax_params)
    name = "model.layers.1.self_attn.q_proj.weight"
    trained = {"weights": {name: torch.empty_like(torch_params[name])}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(trained, checkpoint_id=str(out / "step-6"))
    assert torch.equal(trained["weights"][name].bfloat16().float(), torch_params[name])  # stored as bf16
    from kimi.config import load_config
    from kimi.init import init_params

    initial = init_params(load_config("tiny"), seed=0, layers=2)[name].float()
    assert not torch.equal(initial, torch_params[name])  # trained, not the random init written back


def test_bf16_masters_frozen_parts_and_optimizer(tmp_path):
    """bf16 weights train through fp32 masters; the indexer, the routing bias and --freeze patterns are neither
    trained nor in the optimizer."""
    res = train(
        TrainArgs(
            out=str(tmp_path / "r"),
            **{**SMALL, "layers": 4, "steps": 1, "warmup_steps": 0, "eval_tokens": 16, "dtype": "bfloat16"},
            freeze=["model.embed_tokens.*", "*.mlp_res_*"],
            plot=False,
        )
    )
    meta = _dcp_keys(tmp_path / "r" / "step-1")
    weights = {k.removeprefix("weights."): v for k, v in meta.items() if k.startswith("weights.")}
    opt_params = {k.removeprefix("optimizer.state.").rsplit(".", 1)[0] for k in meta if k.startswith("optimizer.st")}
    assert weights and all(v.properties.dtype == torch.float32 for v in weights.values())  # fp32 masters
    assert meta["optimizer.state.lm_head.weight.exp_avg"].properties.dtype == torch.float32
    assert "model.layers.3.self_attn.q_a_proj.weight" in weights
    for frozen in ("indexer.", "embed_tokens", "e_score_correction_bias", "mlp_res_"):
        assert not any(frozen in n for n in weights), frozen
        assert not any(frozen in n for n in opt_params), frozen
    assert res.trainable_params == sum(v.size.numel() for v in weights.values())
    from kimi.checkpoint import CheckpointReader

    assert CheckpointReader(tmp_path / "r").dtype("model.layers.0.self_attn.q_proj.weight") == "bfloat16"


def short_documents(path: Path, n_words: int = 3000, seed: int = 0) -> Path:
    """A JSONL file of many short documents (1 to 12 words of the bundled text each): packed rows then hold several
    document ends, so the target count differs from one micro-batch (and one context-parallel shard) to the next."""
    rng = np.random.default_rng(seed)
    words = DEFAULT_TEXT.read_text(encoding="utf-8").split()[:n_words]
    lines, i = [], 0
    while i < len(words):
        n = int(rng.integers(1, 13))
        lines.append(json.dumps({"text": " ".join(words[i : i + n])}))
        i += n
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    """4 micro-batches of 16 tokens = one of 64 (loss and gradient norm), on short documents whose micro-batches
    hold different target counts: each is weighted by its share of the step's targets, not by 1/4."""
    data = short_documents(tmp_path / "docs.jsonl")
    kw = {**SMALL, "data": [str(data)], "steps": 1, "warmup_steps": 0, "eval_tokens": 16, "batch_tokens": 64}
    kw["plot"] = False
    one = train(TrainArgs(out=str(tmp_path / "one"), **{**kw, "micro_batch_tokens": 64}, peak_tflops=0.5))
    acc = train(TrainArgs(out=str(tmp_path / "acc"), **{**kw, "micro_batch_tokens": 16}))  # 4 micro-batches
    from kimi.tokenizer import load_tokenizer
    from kimi_tools.data import tokenize_documents

    docs, _ = split_tail(tokenize_documents(read_documents([data]), load_tokenizer(None, 512).encode), 0.05)
    loader = PackedLoader(docs, seq_len=16, rows=1, seed=0)
    counts = {loader.next_batch().num_targets for _ in range(4)}  # the first step's four micro-batches
    assert len(counts) > 1, counts  # 1/4 each would then be a different weighting
    a, b = one.records[1], acc.records[1]
    from kimi.config import load_config
    from kimi.flops import estimate_flops

    flops = estimate_flops(load_config("tiny").truncated(2), 16, backward=True)["flops_per_token"]
    assert math.isclose(a["mfu"], flops * a["tokens_per_s"] / 0.5e12) and b["mfu"] is None
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6) and math.isclose(
        a["grad_norm"], b["grad_norm"], rel_tol=1e-5
    )


def test_custom_stage_trains_its_parameters_and_logs_its_metrics(tmp_path, monkeypatch):
    class HeadOnly(LMStage):
        def trainable(self, name):
            return name == "lm_head.weight"

        def loss(self, model, batch):
            loss, _ = super().loss(model, batch)
            return loss, {"targets": float(batch.num_targets)}

    monkeypatch.setitem(STAGES, "head-only", HeadOnly)
    res = train(
        TrainArgs(
            out=str(tmp_path / "r"), **{**SMALL, "steps": 1, "warmup_steps": 0, "eval_tokens": 16}, stage="head-only"
        )
    )
    assert res.trainable_params == 512 * 96
    assert res.records[1]["targets"] > 0 and res.records[1]["eval_targets"] > 0
    weights = [k for k in _dcp_keys(tmp_path / "r" / "step-1") if k.startswith("weights.")]
    assert weights == ["weights.lm_head.weight"]


# ---------------------------------------------------------------------------------------------- bad input


def _cli(argv, capsys):
    rc = main(["train", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


def _small_argv(out):
    """The CLI form of SMALL."""
    return (
        "--layers 2 --steps 6 --seq-len 16 --micro-batch-tokens 32 --batch-tokens 32 --eval-tokens 32 --eval-every 3 "
        "--warmup-steps 1 --lr 1e-2 --quiet"
    ).split() + ["--data", str(DEFAULT_TEXT), "--out", str(out)]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda argv, tmp: argv + ["--seq-len", "1"], "--seq-len: got 1, expected at least 2"),
        (lambda argv, tmp: argv + ["--data", str(tmp / "empty.txt")], "--data: no text in"),
        (lambda argv, tmp: argv + ["--micro-batch-tokens", "24"], "expected a positive multiple of --seq-len 16"),
        (lambda argv, tmp: argv + ["--freeze", "nothing.*"], "--freeze: 'nothing.*' matches no parameter"),
        (lambda argv, tmp: argv + ["--lora-alpha", "4"], "given without --lora-rank"),
        (lambda argv, tmp: argv + ["--resume"], "holds no run"),
        # options the backend cannot honour are refused by kimi_tools.lora.check_lora_supported, before any device
        (
            lambda argv, tmp: argv + ["--backend", "cudnn", "--lora-rank", "4", "--lora-dropout", "0.1"],
            "lora dropout: got 0.1 with kv_b_proj among the targets on the cudnn backend",
        ),
        (lambda argv, tmp: argv + ["--lora-rank", "4", "--lora-targets", "lm_head"], "reads directly"),
        (lambda argv, tmp: argv + ["--no-save", "--stop-after", "3"], "--no-save: a run that saves nothing"),
        (lambda argv, tmp: argv + ["--stage", "sparse", "--lora-rank", "2"], "LoRA freezes every base weight"),
        (lambda argv, tmp: argv + ["--recompute-mode", "mlp"], "--recompute-mode: got 'mlp' without --recompute"),
        (
            lambda argv, tmp: argv + ["--recompute", "--recompute-full-layers", "1"],
            "--recompute-full-layers: got 1, expected it only with --recompute --recompute-mode mlp",
        ),
        (
            lambda argv, tmp: argv + ["--recompute", "--recompute-mode", "mlp", "--recompute-full-layers", "-1"],
            "--recompute-full-layers: got -1, expected >= 0",
        ),
        (lambda argv, tmp: argv + ["--fp8", "rowwise"], "--fp8: got --dtype float32, expected bfloat16"),
        (lambda argv, tmp: argv + ["--fp8", "rowwise", "--dtype", "bfloat16"], "--fp8: FP8 matmuls need a CUDA GPU"),
        (lambda argv, tmp: argv + ["--fp8-compile"], "--fp8-compile: compiles the FP8 projections; it needs --fp8"),
        (lambda argv, tmp: argv + ["--fp8-min-dim", "4096"], "--fp8-min-dim: got 4096 without --fp8"),
        (lambda argv, tmp: argv + ["--fp8-min-dim", "-1"], "--fp8-min-dim: got -1, expected a width >= 0"),
    ],
    ids=[
        "seq-len",
        "empty-data",
        "micro-batch",
        "freeze",
        "lora-alpha",
        "resume-nothing",
        "lora-cudnn",
        "lora-head",
        "no-save-stop",
        "stage-lora",
        "recompute-mode-alone",
        "recompute-full-layers-mode",
        "recompute-full-layers-negative",
        "fp8-fp32",
        "fp8-cpu",
        "fp8-compile-alone",
        "fp8-min-dim-alone",
        "fp8-min-dim-negative",
    ],
)
def test_bad_input_one_line_and_no_output(tmp_path, capsys, change, message):
    (tmp_path / "empty.txt").write_text("\n\n")
    out = tmp_path / "out"
    rc, err = _cli(change(_small_argv(out), tmp_path), capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("kimi: error: ") and message in err[0], err
    assert not out.exists()


def test_no_save_writes_metrics_and_plot_only(tmp_path, capsys):
    """--no-save (measurement runs whose optimizer state would not fit on disk): the run trains and logs, and
    writes neither weights nor step-N/."""
    out = tmp_path / "out"
    rc, err = _cli(_small_argv(out) + ["--steps", "2", "--eval-every", "0", "--no-save"], capsys)
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["loss.png", "metrics.jsonl", "run.json"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and all(math.isfinite(r["loss"]) for r in records[1:])


def test_checkpoint_that_does_not_match_its_config(tmp_path, capsys):
    from kimi.config import load_config
    from kimi.init import init_checkpoint

    init_checkpoint(tmp_path / "ck", load_config("tiny"), seed=0, layers=2)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["text_config"]["hidden_size"] = 128
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    argv = ["--checkpoint", str(tmp_path / "ck"), "--data", str(DEFAULT_TEXT), "--out", str(tmp_path / "out")]
    rc, err = _cli(argv + ["--seq-len", "16", "--quiet"], capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("kimi: error: "), err
    assert "model.embed_tokens.weight" in err[0] and "[512, 128]" in err[0], err  # names the tensor and the shape
    assert not (tmp_path / "out").exists()


def test_resume_refuses_another_run_and_another_model(runs, tmp_path, capsys):
    root = runs[0]
    before = sorted((root / "a").rglob("*"))
    argv = _small_argv(root / "a")
    rc, err = _cli(argv + ["--lr", "1e-3", "--resume"], capsys)  # the run used --lr 1e-2
    assert rc == 2 and len(err) == 1 and "with other settings: --lr (run: 0.01, now: 0.001); resume with" in err[0], err
    rc, err = _cli(argv + ["--layers", "3", "--resume"], capsys)  # another model: the nested text_config differs
    assert rc == 2 and len(err) == 1, err
    assert err[0] == (
        f"kimi: error: --resume: {root / 'a'} holds a run with another model config: "
        "text_config.linear_attn_config.kda_layers (run: [1, 2], now: [1, 2, 3]); "
        "text_config.num_hidden_layers (run: 2, now: 3) and other settings: --layers (run: 2, now: 3); "
        "resume with the run's own settings (the layout, --micro-batch-tokens, --compile and --recompute may "
        "change), or choose another --out"
    )
    rc, err = _cli(argv, capsys)  # a full folder without --resume
    assert rc == 2 and "exists and is not empty" in err[0], err
    assert sorted((root / "a").rglob("*")) == before


@pytest.mark.parametrize("bad_step", [1, 3])
def test_divergence_stops_with_one_line_and_leaves_a_resumable_folder(runs, tmp_path, capsys, monkeypatch, bad_step):
    """A non-finite loss at step N: one ``kimi: error:`` line naming the step and the loss; the folder keeps
    step-(N-1)/ (saved then, with the data position and RNG of before step N), the metrics up to N-1 and
    diverged.json, and no model (none is written before --steps); ``--resume`` then gives run A's numbers exactly (the folder was an unusable run.json +
    metrics.jsonl, refused by --resume and by a fresh run alike)."""

    class Diverges(LMStage):  # the loss of the bad_step-th training step is NaN, evaluation stays clean
        calls = 0

        def loss(self, model, batch):
            loss, m = super().loss(model, batch)
            if model.training:
                Diverges.calls += 1
                if Diverges.calls == bad_step:
                    loss = loss * math.nan
            return loss, m

    out = tmp_path / "run"
    monkeypatch.setitem(STAGES, "lm", Diverges)
    rc, err = _cli(_small_argv(out), capsys)
    good = bad_step - 1
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"kimi: error: step {bad_step}: the loss is nan (gradient norm nan), not finite"), err
    assert f"keeps step-{good}/" in err[0], err
    # no model: the export is written when a run reaches --steps, and a diverged run is a stopped one
    assert sorted(p.name for p in out.iterdir()) == [
        "diverged.json",
        "loss.png",
        "metrics.jsonl",
        "run.json",
        f"step-{good}",
    ]
    note = json.loads((out / "diverged.json").read_text())
    assert note["step"] == bad_step and note["last_good_step"] == good and math.isnan(note["loss"])
    on_disk = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in on_disk] == list(range(bad_step))

    monkeypatch.setitem(STAGES, "lm", LMStage)
    resumed = train(TrainArgs(out=str(out), resume=True, **SMALL))
    assert resumed.start_step == good and resumed.step == 6
    on_disk = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert _numbers(on_disk) == _numbers(runs[1].records)  # run A, step for step: the same batches, bitwise
    assert not (out / "diverged.json").exists()
    if bad_step == 1:  # --no-save: still one line and the marker, but no weights written
        Diverges.calls = 0
        monkeypatch.setitem(STAGES, "lm", Diverges)
        rc, err = _cli(_small_argv(tmp_path / "nosave") + ["--no-save", "--no-plot"], capsys)
        assert (
            rc == 2 and len(err) == 1 and "keeps no weights (--no-save) but metrics.jsonl and diverged.json" in err[0]
        )
        assert sorted(p.name for p in (tmp_path / "nosave").iterdir()) == ["diverged.json", "metrics.jsonl", "run.json"]


def test_resume_mismatch_names_nested_keys_with_both_values():
    """``_diff`` on nested checkpoint configs: the path of each differing leaf with both values, long lists by item,
    a dict against None shown short, absent keys said so (the message dumped whole dicts and lists)."""
    from kimi_tools.train.args import diff_json as _diff

    layers = list(range(1, 70))
    run = {
        "text_config": {"hidden_size": 96, "linear_attn_config": {"kda_layers": layers}, "q": {"a": 1, "b": "x" * 80}}
    }
    now = {"text_config": {"hidden_size": 128, "linear_attn_config": {"kda_layers": layers[:-1] + [93]}, "q": None}}
    now["text_config"]["rope"] = 1.5
    assert _diff(run, now) == [
        "text_config.hidden_size (run: 96, now: 128)",
        "text_config.linear_attn_config.kda_layers[68] (run: 69, now: 93)",
        "text_config.q (run: {'a': 1, 'b': '" + "x" * 40 + " ...} (2 items), now: None)",
        "text_config.rope (run: absent, now: 1.5)",
    ]
    assert _diff({"data": ["a.txt"]}, {"data": ["a.txt", "b.txt"]}) == [
        "data (run: ['a.txt'], now: ['a.txt', 'b.txt'])"
    ]
    assert _diff(run, run) == []


def test_resume_mismatch_names_the_flags_as_typed(tmp_path):
    """The settings part of the refusal names flags a user can type: ``--no-shuffle`` (given or not), not the
    ``shuffle`` field's ``--shuffle``, which ``kimi train`` does not have."""
    from kimi_tools.train.checkpoint import check_out as _check_out

    args = {**SMALL, "shuffle": True, "lora_targets": None}
    was = {"config": {}, "args": {**args, "shuffle": False}}
    (tmp_path / "run.json").write_text(json.dumps({"fingerprint": "was", "fingerprint_of": was}))
    with pytest.raises(ValueError) as e:
        _check_out(TrainArgs(out=str(tmp_path), resume=True, **SMALL), "now", {"config": {}, "args": args})
    assert "other settings: --no-shuffle (run: True, now: False); resume with" in str(e.value), e.value


def test_no_save_refusal_names_only_the_flags_given():
    from kimi_tools.train.args import resolve as _resolve

    with pytest.raises(ValueError) as e:
        _resolve(TrainArgs(out="x", save=False, stop_after=3, **SMALL))
    assert "got it with --stop-after 3, expected none of --save-every, --stop-after, --resume" in str(e.value)
    with pytest.raises(ValueError, match="got it with --save-every 2, --resume, expected"):
        _resolve(TrainArgs(out="x", save=False, save_every=2, resume=True, **SMALL))


# ---------------------------------------------------------------------------------------------- LoRA


def test_lora_run_resumes_exactly_and_writes_the_adapter(tmp_path):
    """LoRA (dropout on, so the RNG state matters): 4 steps equal 2 + resume 2; the output holds peft's two files
    (no full model), the DCP state only the adapters, and the adapter loads back onto the base."""
    from safetensors.torch import load_file

    from kimi.config import load_config
    from kimi.init import init_checkpoint
    from kimi_tools import lora

    base = tmp_path / "base"
    init_checkpoint(base, load_config("tiny"), seed=0, layers=2)
    kw = {**SMALL, "layers": None, "steps": 4, "eval_every": 2, "lr": 1e-2, "checkpoint": str(base)}
    kw.update(lora_rank=4, lora_dropout=0.1, plot=False)
    a = train(TrainArgs(out=str(tmp_path / "a"), **kw))
    b1 = train(TrainArgs(out=str(tmp_path / "b"), stop_after=2, **kw))
    with pytest.raises(ValueError, match="drop --stop-after"):  # README's "the same command with --resume"
        train(TrainArgs(out=str(tmp_path / "b"), resume=True, stop_after=2, **kw))
    b2 = train(TrainArgs(out=str(tmp_path / "b"), resume=True, **kw))
    assert _numbers(a.records) == _numbers(b1.records + b2.records)
    assert a.eval_losses[4] != a.eval_losses[0]  # the adapters change the function (the benchmark: loss falls)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors", "metrics.jsonl", "run.json", "step-4"]
    assert lora.adapter_base_fingerprint(tmp_path / "a") == lora.base_fingerprint(base)  # kimi lora merge checks it
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "a").iterdir() if p.is_file()}
    assert len(set(modes.values())) == 1, modes  # the adapter file as every other (it was 0600)
    wa = load_file(tmp_path / "a" / "adapter_model.safetensors")
    wb = load_file(tmp_path / "b" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(k.startswith("base_model.model.model.layers.") and ".lora_" in k for k in wa)
    assert any(".lora_B." in k and wa[k].abs().sum() > 0 for k in wa)  # B moved off its zero init
    weights = [k for k in _dcp_keys(tmp_path / "a" / "step-4") if k.startswith("weights.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert a.trainable_params == sum(v.numel() for v in wa.values())
    from kernels_torch.model import load_model

    model = load_model(base, backend="sdpa")
    lora.load_adapter(model, tmp_path / "a")
    sd = lora.adapter_state_dict(model)
    assert all(torch.equal(sd[k], wa[k]) for k in wa)


def test_lora_adapters_that_get_no_gradient_stop_the_run(tmp_path, monkeypatch):
    """A path that bypasses the adapters (here a stage that never runs the layers) is caught at the first step."""

    class Bypass(LMStage):  # calls one adapted projection and skips every other
        def loss(self, model, batch):
            h = model.model.embed_tokens(batch.input_ids)
            return model.model.layers[0].self_attn.q_proj(h).float().pow(2).mean(), {}

    monkeypatch.setitem(STAGES, "bypass", Bypass)
    kw = {**SMALL, "steps": 1, "warmup_steps": 0, "eval_tokens": 16, "plot": False}
    with pytest.raises(ValueError, match=r"LoRA: the adapters of model\.layers\.0\.self_attn\..* got no gradient"):
        train(TrainArgs(out=str(tmp_path / "r"), **kw, stage="bypass", lora_rank=2))


def test_default_warmup_fits_short_runs_and_finished_runs_are_not_resumed(tmp_path):
    """The default warm-up is min(10, steps // 10), so a 2-step run needs no --warmup-steps; --resume of a run that
    already reached --steps is refused with one line instead of training nothing (it printed 'loss nan')."""
    from kimi_tools.train.args import resolve as _resolve

    assert _resolve(TrainArgs(data=["x"], out="o", steps=2)).warmup_steps == 0
    assert _resolve(TrainArgs(data=["x"], out="o", steps=100)).warmup_steps == 10
    assert _resolve(TrainArgs(data=["x"], out="o", steps=1000)).warmup_steps == 10
    text = tmp_path / "t.txt"
    text.write_text("Alice was beginning to get very tired of sitting by her sister on the bank. " * 20)
    args = ["train", "--preset", "tiny", "--layers", "1", "--data", str(text), "--out", str(tmp_path / "run"),
            "--steps", "2", "--seq-len", "16", "--eval-tokens", "32", "--quiet"]  # fmt: skip
    assert main(args) == 0
    assert main([*args, "--resume"]) == 2


# ---------------------------------------------------------------------------------------------- the step's parts


def _dcp_tensors(step_dir: Path, names) -> dict[str, torch.Tensor]:
    """The fp32 masters ``weights.<name>`` of a ``step-N/`` resume state."""
    import torch.distributed.checkpoint as dcp

    from kimi_tools.train.checkpoint import Checkpointer

    meta = _dcp_keys(step_dir)
    state = {"weights": {n: torch.empty(meta[f"weights.{n}"].size, dtype=torch.float32) for n in names}}
    Checkpointer(step_dir.parent).damage(int(step_dir.name.removeprefix("step-")))  # (complete: checked below)
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, checkpoint_id=str(step_dir))
    return state["weights"]


def test_bf16_export_is_the_fp32_masters_rounded(tmp_path):
    """bf16 training (the cudnn default): after 2 steps every trained bf16 weight of the export differs from the
    initial weight and equals its fp32 master (in step-2/) rounded to bf16, so the updates reached the model."""
    from kernels_torch.model import load_model
    from kimi.config import load_config
    from kimi.init import init_params

    kw = {**SMALL, "steps": 2, "warmup_steps": 0, "eval_tokens": 16, "eval_every": 0, "dtype": "bfloat16"}
    train(TrainArgs(out=str(tmp_path / "r"), plot=False, **kw))
    export = load_model(tmp_path / "r", dtype=torch.bfloat16).state_dict()  # the stored values (bf16 or fp32)
    initial = init_params(load_config("tiny"), seed=0, layers=2)
    from kimi.checkpoint import CheckpointReader

    stored = CheckpointReader(tmp_path / "r")  # bf16 on disk (routed experts are re-quantised to MXFP4: not these)
    names = [k for k in _trainable_names(tmp_path / "r") if k in stored and stored.dtype(k) == "bfloat16"]
    assert len(names) > 20, names
    masters = _dcp_tensors(tmp_path / "r" / "step-2", names)
    moved = [n for n in names if not torch.equal(masters[n], initial[n].float())]  # (some get no gradient)
    assert len(moved) > 20, moved
    for n in names:
        assert torch.equal(export[n], masters[n].to(torch.bfloat16)), f"{n}: the export is not the master rounded"
    for n in moved:
        assert not torch.equal(export[n], initial[n].to(torch.bfloat16)), f"{n}: the export holds the initial weight"


def _trainable_names(run: Path) -> set[str]:
    step = max(p for p in run.glob("step-*"))
    return {k.removeprefix("weights.") for k in _dcp_keys(step) if k.startswith("weights.")}


def test_every_step_applies_the_schedule(tmp_path):
    """With warm-up 3 of 6 steps, step k applies lr x lr_multiplier(k - 1) (recorded, read from the optimizer at
    its step), and AdamW's first update, |dW| = lr for gradients well above eps, has that size too: a schedule wired
    one step ahead (step 1 at lr_multiplier(1)) fails both."""
    from kimi.config import load_config
    from kimi.init import init_params

    kw = {**SMALL, "steps": 6, "warmup_steps": 3, "eval_every": 0, "eval_tokens": 16, "grad_clip": 0.0}
    res = train(TrainArgs(out=str(tmp_path / "r"), save_every=1, keep=10, plot=False, **kw))
    want = [SMALL["lr"] * lr_multiplier(k - 1, warmup_steps=3, total_steps=6, min_lr_ratio=0.1) for k in range(1, 7)]
    got = [r["lr"] for r in res.records[1:]]
    assert got == pytest.approx(want, rel=1e-12), (got, want)
    assert got[0] < got[1] < got[2] == SMALL["lr"] > got[4] > got[5]  # the warm-up, the peak, the decay
    name = "model.layers.1.self_attn.q_proj.weight"
    w0 = init_params(load_config("tiny"), seed=0, layers=2)[name].float()
    w1 = _dcp_tensors(tmp_path / "r" / "step-1", [name])[name]
    step = (w1 - w0).abs().flatten()
    moved = step[step > 0]
    assert moved.numel() > 0.9 * step.numel()
    assert float(moved.median()) == pytest.approx(want[0], rel=1e-3)  # the lr step 1 applied


def test_evaluation_runs_in_eval_mode(tmp_path):
    """Two evaluations at the same weights agree with LoRA dropout 0.5 (the adapters non-zero), and the model is
    back in train mode afterwards; in train mode the same evaluation is not reproducible (dropout draws)."""
    from kimi.config import load_config
    from kimi.init import init_checkpoint
    from kimi_tools import lora
    from kimi_tools.train import Trainer

    init_checkpoint(tmp_path / "base", load_config("tiny"), seed=0, layers=2)
    kw = {**SMALL, "layers": None, "checkpoint": str(tmp_path / "base"), "eval_tokens": 64}
    t = Trainer(TrainArgs(out=str(tmp_path / "r"), lora_rank=4, lora_dropout=0.5, **kw))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in lora.lora_modules(t.model).values():
            w = layer.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.5)
    t.model.train()
    first, second = t.evaluate(), t.evaluate()
    assert first == second and t.model.training
    with torch.no_grad():  # what evaluation in train mode would give: dropout makes two passes differ
        b = t.evals[0]
        a1, a2 = (float(t.stage.loss(t.model, b)[0]) for _ in range(2))
    assert a1 != a2
    assert not (tmp_path / "r").exists()  # building a Trainer writes nothing


def test_weight_decay_spares_vectors(tmp_path):
    """One step with --weight-decay 0.5 against one without, from the same init and data: the vectors (norm weights,
    A_log, dt_bias, conv-free 1-D tensors) come out identical, the matrices decayed."""
    kw = {**SMALL, "steps": 1, "warmup_steps": 0, "eval_tokens": 16, "plot": False}
    for wd in (0.0, 0.5):
        train(TrainArgs(out=str(tmp_path / f"wd{wd}"), weight_decay=wd, **kw))
    from kimi.config import load_config
    from kimi.init import init_params

    names = sorted(_trainable_names(tmp_path / "wd0.0"))
    a = _dcp_tensors(tmp_path / "wd0.0" / "step-1", names)
    b = _dcp_tensors(tmp_path / "wd0.5" / "step-1", names)
    from kernels_torch.model import model_from_params

    cfg = load_config("tiny")
    initial = model_from_params(cfg.truncated(2), init_params(cfg, seed=0, layers=2)).state_dict()  # torch names
    moved = [n for n in names if not torch.equal(a[n], initial[n].float())]  # (layer 0's AttnRes mix gets no grad)
    vectors = [n for n in moved if a[n].ndim == 1]
    for must in ("A_log", "dt_bias", "input_layernorm.weight", "model.norm.weight"):
        assert any(must in n for n in vectors), must
    assert len(moved) - len(vectors) > 20
    for n in moved:
        if a[n].ndim == 1:
            assert torch.equal(a[n], b[n]), f"{n}: a vector was decayed"
        else:
            assert not torch.equal(a[n], b[n]), f"{n}: a matrix was not decayed"


def test_parser_is_the_dataclass(tmp_path):
    """``kimi train``'s flags are TrainArgs' fields: the CLI form of SMALL parses to TrainArgs(**SMALL), every field
    has its flag, and a run-control field is outside the fingerprint while a numbers field is in it."""
    import dataclasses

    from kimi_tools.cli import build_parser
    from kimi_tools.train.args import args_from_namespace, fingerprint, run_control_fields
    from kimi_tools.train.weights import load_run_config

    ns = build_parser().parse_args(["train", *_small_argv(tmp_path / "o"), "--no-shuffle", "--save-every", "5min"])
    got = args_from_namespace(ns)
    assert got == TrainArgs(out=str(tmp_path / "o"), shuffle=False, save_every="5min", **SMALL)
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for f in dataclasses.fields(TrainArgs):
        flag = ("--no-" if f.default is True else "--") + f.name.replace("_", "-")
        assert flag in help_text, flag
    assert {"out", "resume", "restart", "save_every", "quiet", "cp"} <= set(run_control_fields())
    assert "lr" not in run_control_fields()
    a = TrainArgs(out="o", **SMALL)
    cfg = load_run_config(dataclasses.replace(a, preset="tiny"))
    base = fingerprint(a, cfg)[0]
    assert fingerprint(dataclasses.replace(a, out="elsewhere", save_every=3), cfg)[0] == base
    assert fingerprint(dataclasses.replace(a, lr=1e-3), cfg)[0] != base


@pytest.mark.parametrize(
    "value, want", [(None, (0, 10.0)), (0, (0, 0.0)), (5, (5, 0.0)), ("7", (7, 0.0)), ("2.5min", (0, 2.5))]
)
def test_save_every_steps_or_minutes(value, want):
    from kimi_tools.train.args import parse_save_every

    assert parse_save_every(value) == want


@pytest.mark.parametrize("value", [-1, "5s", "1.5", "min", True])
def test_save_every_rejects(value):
    from kimi_tools.train.args import parse_save_every

    with pytest.raises(ValueError, match="--save-every: got"):
        parse_save_every(value)


def test_periodic_saves_by_minutes(tmp_path):
    """``--save-every Nmin`` saves when N minutes have passed since the last save (here every step), keeping the
    latest --keep; the model is written at the last step only."""
    kw = {**SMALL, "steps": 3, "eval_every": 0, "eval_tokens": 16, "plot": False}
    train(TrainArgs(out=str(tmp_path / "r"), save_every="0.0001min", keep=5, **kw))
    assert sorted(p.name for p in (tmp_path / "r").glob("step-*")) == ["step-1", "step-2", "step-3"]


def test_stop_after_summary_and_no_model_before_the_end(tmp_path, capsys):
    """--stop-after before the first --eval-every step: the summary names the one evaluation and the next one (it
    read 'eval loss X (step 0) -> X (step 0)'); the folder holds the resume state and no model until --steps."""
    out = tmp_path / "r"
    argv = [a for a in _small_argv(out) if a != "--quiet"] + ["--eval-every", "4", "--no-plot", "--stop-after", "2"]
    assert main(["train", *argv]) == 0
    text = capsys.readouterr().out
    assert "(step 0) ->" not in text, text
    assert "(step 0; the next evaluation is at step 4)" in text and "step 2/6 (--stop-after)" in text, text
    assert "the model is written at step 6" in text
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "run.json", "step-2"]
    assert main(["train", *argv[:-3], "--resume"]) == 0  # without --stop-after 2
    assert "model.safetensors" in {p.name for p in out.iterdir()}
    assert "eval loss" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- crash safety


def test_a_run_without_a_saved_step_restarts_with_one_flag(tmp_path, capsys):
    """A folder with run.json but no step-N (a crash before the first save): --resume and a plain rerun are refused,
    both naming --restart; --restart deletes the run's own files and starts again. --restart refuses a folder that
    is not a run, or that holds a file no run writes (nothing deleted)."""
    out = tmp_path / "r"
    argv = _small_argv(out) + ["--steps", "2", "--no-plot"]
    assert main(["train", *argv, "--no-save"]) == 0  # run.json and metrics, no step-N: as a crash leaves it
    (out / ".step-3.tmp-99").mkdir()  # a save cut short
    rc, err = _cli(argv + ["--resume"], capsys)
    assert rc == 2 and "no complete step-N resume state" in err[0] and "--restart" in err[0], err
    rc, err = _cli(argv, capsys)
    assert rc == 2 and "--restart" in err[0] and "--resume" in err[0], err
    rc, err = _cli(argv + ["--resume", "--restart"], capsys)
    assert rc == 2 and "got both" in err[0], err
    (out / "notes.txt").write_text("mine")
    rc, err = _cli(argv + ["--restart"], capsys)
    assert rc == 2 and "'notes.txt'" in err[0] and "nothing was deleted" in err[0], err
    assert (out / ".step-3.tmp-99").exists()
    (out / "notes.txt").unlink()
    rc, err = _cli(argv + ["--restart"], capsys)
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "metrics.jsonl", "model.safetensors", "model.safetensors.index.json", "run.json", "step-2",
    ]  # fmt: skip
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.txt").write_text("x")
    rc, err = _cli(_small_argv(other) + ["--restart"], capsys)
    assert rc == 2 and "no kimi train run; refusing to delete it" in err[0], err
    assert (other / "data.txt").exists()


def test_a_damaged_step_is_named_and_the_previous_one_offered(tmp_path, capsys):
    """A truncated ``step-N/*.distcp`` (a save cut short by a full disk): --resume names the file, says the step is
    damaged and offers the previous complete step; removing it resumes from there, and the run ends as one that was
    never interrupted. A step whose .metadata is garbage is named too."""
    out = tmp_path / "r"
    base = _small_argv(out) + ["--steps", "4", "--eval-every", "0", "--no-plot", "--save-every", "1", "--keep", "3"]
    assert main(["train", *base, "--stop-after", "3"]) == 0
    shard = next((out / "step-3").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    rc, err = _cli(base + ["--resume"], capsys)
    assert rc == 2 and len(err) == 1, err
    assert f"{out / 'step-3'} is damaged: {shard.name} holds 100 bytes where its .metadata needs" in err[0], err
    assert "the previous complete step is step-2" in err[0] and "--resume" in err[0], err
    (out / "step-2" / ".metadata").write_bytes(b"not a pickle")
    rc, err = _cli(base + ["--resume"], capsys)
    assert rc == 2 and "the previous complete step is step-1" in err[0], err
    import shutil

    for s in (2, 3):
        shutil.rmtree(out / f"step-{s}")
    assert main(["train", *base, "--resume"]) == 0
    whole = tmp_path / "whole"
    assert main(["train", *_small_argv(whole), "--steps", "4", "--eval-every", "0", "--no-plot"]) == 0
    got = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert _numbers(got) == _numbers(want)


@pytest.mark.parametrize(
    "dropped, named",
    [
        (("optimizer",), "optimizer (the AdamW state: "),
        (("lr_scheduler", "dataloader"), "dataloader (the data position: 3 keys, e.g. dataloader.doc) and lr_sched"),
    ],
)
def test_a_step_missing_a_part_is_named_and_the_previous_one_offered(tmp_path, capsys, monkeypatch, dropped, named):
    """A resume state written without its AdamW state, its schedule or its data position (DCP loads what it finds):
    --resume refuses it in one line naming the step's .metadata and the missing part, and offers the previous
    complete step; when every step lacks it, none is offered. The full run then resumes from the complete step."""
    from kimi_tools.train.checkpoint import Checkpointer

    out = tmp_path / "r"
    base = _small_argv(out) + ["--steps", "4", "--eval-every", "0", "--no-plot", "--save-every", "1", "--keep", "3"]
    save = Checkpointer.save
    cut_from = {"step": 3}

    def save_without(self, step, states):
        if step >= cut_from["step"]:
            states = {k: v for k, v in states.items() if k not in dropped}
        return save(self, step, states)

    monkeypatch.setattr(Checkpointer, "save", save_without)
    assert main(["train", *base, "--stop-after", "3"]) == 0
    monkeypatch.setattr(Checkpointer, "save", save)
    rc, err = _cli(base + ["--resume"], capsys)
    assert rc == 2 and len(err) == 1, err
    assert f"{out / 'step-3'} is damaged: .metadata lacks {named}" in err[0], err
    assert "the previous complete step is step-2" in err[0], err
    cut_from["step"] = 0  # every step lacks it: nothing to offer
    monkeypatch.setattr(Checkpointer, "save", save_without)
    other = tmp_path / "o"
    argv = [*base[: base.index("--out")], "--out", str(other), *base[base.index("--out") + 2 :]]
    assert main(["train", *argv, "--stop-after", "2"]) == 0
    monkeypatch.setattr(Checkpointer, "save", save)
    rc, err = _cli(argv + ["--resume"], capsys)
    assert rc == 2 and "is damaged: .metadata lacks" in err[0] and "there is no earlier complete step" in err[0], err
    import shutil

    shutil.rmtree(out / "step-3")
    assert main(["train", *base, "--resume"]) == 0
    whole = tmp_path / "whole"
    assert main(["train", *_small_argv(whole), "--steps", "4", "--eval-every", "0", "--no-plot"]) == 0
    got = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert _numbers(got) == _numbers(want)


def test_stop_request_first_signal_asks_second_interrupts():
    """In-process: the first SIGINT inside StopRequest only sets the flag (and calls on_first once), SIGTERM too;
    a second SIGINT raises KeyboardInterrupt; the handlers are restored on exit."""
    import os
    import signal

    from kimi_tools.train.interrupt import StopRequest

    before = signal.getsignal(signal.SIGINT)
    seen = []
    with StopRequest(on_first=seen.append) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signum == signal.SIGTERM and seen == ["SIGTERM"]
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM: still the first request
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before and seen == ["SIGTERM"]


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_real_signal_saves_and_exits_with_one_line(tmp_path, sig, code):
    """``kimi train`` in a child process, sent a real signal after its first steps: the step in flight finishes,
    its resume state is saved, the child prints one line (how to resume) and exits 128 + signum, no traceback; the
    folder has no model; --resume then continues from that step to the end, the records contiguous."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "r"
    argv = _small_argv(out) + ["--steps", "500", "--eval-every", "0", "--no-plot", "--layers", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    root = Path(__file__).resolve().parents[1]
    child = subprocess.Popen(
        [sys.executable, "-m", "kimi_tools.cli", "train", *argv],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and child.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:  # steps 0, 1, 2 logged
            break
        time.sleep(0.05)
    assert child.poll() is None, child.communicate()
    os.kill(child.pid, getattr(signal, sig))
    stdout, stderr = child.communicate(timeout=240)
    assert child.returncode == code, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    last = steps[-1]
    assert steps == list(range(last + 1)) and 2 <= last < 500
    assert lines[0] == (
        f"kimi train: stopped by {sig} after step {last} of 500; its resume state is {out}/step-{last} (no model "
        "is written until step 500); to continue, run the same command with --resume"
    )
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "run.json", f"step-{last}"]
    res = train(TrainArgs(out=str(out), resume=True, stop_after=last + 1, **{**SMALL, "steps": 500, "layers": 1,
                          "eval_every": 0, "plot": False}))  # fmt: skip
    assert res.start_step == last and res.step == last + 1
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(last + 2))


def test_micro_batches_must_deal_evenly_to_data_parallel_groups():
    """Under torchrun every rank runs the same number of forwards (FSDP2's collectives): a step of 3 micro-batches
    for 2 dp groups is refused naming --batch-tokens and the multiple it needs."""
    from kimi_tools.train.parallel import TrainParallel

    par = TrainParallel(1, "cpu")
    par.check_accum(3, 16)  # one process: anything goes
    par.dp_size, par.cp_size = 2, 2  # as under torchrun --nproc-per-node 4 --cp 2
    par.check_accum(4, 16)
    with pytest.raises(
        ValueError,
        match=r"^--batch-tokens: 48 tokens per step = 3 micro-batches of --micro-batch-tokens 16, which cannot be dealt "
        r"to the 2 data-parallel groups \(--dp 2 of world 4 = --dp 2 x --cp 2\) evenly; expected --batch-tokens 64 "
        r"or no --batch-tokens \(the default: 32\)$",
    ):
        par.check_accum(3, 16, 16)


def test_fp8_run_converts_records_and_exports_the_checkpoint_layout(tmp_path, monkeypatch):
    """``--fp8 RECIPE`` converts the model before the optimizer is built (torchao's emulation here: FP8 rounding on
    the CPU; the device check stubbed), records it in run.json's ``conversions`` and every metrics record, trains
    (finite losses that differ from the bf16 run's: the FP8 casts ran) and exports the checkpoint's names."""
    import functools

    import kernels_torch.fp8 as fp8
    from kimi.checkpoint import CheckpointReader
    from kimi_tools.train.args import FP8_RECIPES

    assert FP8_RECIPES == fp8.FP8_RECIPES
    monkeypatch.setattr(fp8, "check_fp8_supported", lambda device, grouped=False: (9, 0))
    monkeypatch.setattr(fp8, "convert_model_to_fp8", functools.partial(fp8.convert_model_to_fp8, emulate=True))
    kw = {**SMALL, "steps": 2, "warmup_steps": 0, "eval_every": 0, "dtype": "bfloat16", "plot": False}
    plain = train(TrainArgs(out=str(tmp_path / "bf16"), **kw))
    res = train(TrainArgs(out=str(tmp_path / "fp8"), fp8="rowwise", **kw))
    run = json.loads((tmp_path / "fp8" / "run.json").read_text())
    assert run["args"]["fp8"] == "rowwise"
    assert len(run["conversions"]) == 1 and run["conversions"][0].startswith("fp8 rowwise: "), run["conversions"]
    assert "routed experts stay bf16" in run["conversions"][0] and "emulation" in run["conversions"][0]
    n_proj = int(run["conversions"][0].split(": ")[1].split()[0])
    assert n_proj >= 10, run["conversions"]
    recs = [json.loads(line) for line in (tmp_path / "fp8" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("fp8") for r in recs if r["step"] > 0] == ["rowwise", "rowwise"]
    losses = [r["loss"] for r in res.records if r["step"] > 0]
    assert all(math.isfinite(x) for x in losses) and losses != [r["loss"] for r in plain.records if r["step"] > 0]
    assert set(CheckpointReader(tmp_path / "fp8").keys()) == set(CheckpointReader(tmp_path / "bf16").keys())


def test_a_field_added_off_by_default_keeps_earlier_fingerprints():
    """A run written before ``--fp8`` existed (its run.json has no ``fp8``) still resumes: at its default the field is
    left out of the hash; set, it changes the fingerprint."""
    import dataclasses
    import hashlib

    from kimi.config import load_config
    from kimi_tools.train.args import fingerprint, resolve

    cfg = load_config("tiny")
    a = resolve(TrainArgs(out="o", **SMALL))
    fp, body = fingerprint(a, cfg)
    assert not {"fp8", "fp8_compile", "fp8_min_dim"} & set(body["args"])
    older = {**body, "args": {k: v for k, v in body["args"].items() if k not in ("fp8", "fp8_compile")}}
    assert fp == hashlib.sha256(json.dumps(older, sort_keys=True).encode()).hexdigest()
    assert fingerprint(dataclasses.replace(a, fp8="rowwise"), cfg)[0] != fp
    with_fp8 = fingerprint(dataclasses.replace(a, fp8="rowwise"), cfg)[0]
    assert fingerprint(dataclasses.replace(a, fp8="rowwise", fp8_compile=True), cfg)[0] != with_fp8
    assert fingerprint(dataclasses.replace(a, fp8="rowwise", fp8_min_dim=64), cfg)[0] != with_fp8


def test_a_step_overwritten_inside_is_named_and_a_killed_save_is_cleaned(tmp_path, capsys):
    """4 KB overwritten at the start of a ``step-N/*.distcp`` (the size unchanged, so the size check passes): --resume
    names the step and offers the previous one in one line, no traceback. A ``.step-N.tmp-PID/`` left by a killed
    save (its process gone) is removed when the run resumes."""
    import subprocess

    out = tmp_path / "r"
    base = _small_argv(out) + ["--steps", "3", "--eval-every", "0", "--no-plot", "--save-every", "1", "--keep", "3"]
    assert main(["train", *base, "--stop-after", "2"]) == 0
    shard = next((out / "step-2").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    assert len(data) > 4096
    data[:4096] = np.random.default_rng().integers(0, 256, 4096, dtype=np.uint8).tobytes()
    shard.write_bytes(bytes(data))
    rc, err = _cli(base + ["--resume"], capsys)
    assert rc == 2 and len(err) == 1, err
    assert f"{out / 'step-2'} is damaged: reading it failed" in err[0], err
    assert "the previous complete step is step-1" in err[0] and "Traceback" not in err[0], err
    import shutil

    shutil.rmtree(out / "step-2")
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid whose process is gone
    killed = out / f".step-2.tmp-{dead.pid}"
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"x" * 10)
    assert main(["train", *base, "--resume"]) == 0
    assert not killed.exists()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".", "step-"))) == ["step-1", "step-2", "step-3"]


def test_rows_longer_than_the_data_are_refused_before_anything_is_written(tmp_path, capsys):
    """--seq-len (or a micro-batch, or a step) beyond the training tokens is refused in one line naming the flag and
    the token counts, and nothing is written, so the fixed command runs; an eval set shorter than --seq-len is
    evaluated once, in one shorter row (its tokens are not repeated to fill a row)."""
    from kimi_tools.train.trainer import Trainer

    out = tmp_path / "r"
    argv = ["--layers", "1", "--steps", "1", "--quiet", "--no-plot", "--data", str(DEFAULT_TEXT), "--out", str(out)]
    probe = Trainer(TrainArgs(data=[str(DEFAULT_TEXT)], layers=1, steps=1, seq_len=16, out=str(out)))
    n_train = probe.num_tokens
    for extra, flag in (
        (["--seq-len", "100000"], "--seq-len: got 100,000"),
        (["--seq-len", "16", "--micro-batch-tokens", str(16 * (n_train // 16 + 1))], "--micro-batch-tokens: got"),
        (["--seq-len", "16", "--batch-tokens", str(16 * (n_train // 16 + 1))], "--batch-tokens: got"),
    ):
        rc, err = _cli(argv + extra, capsys)
        assert rc == 2 and len(err) == 1 and flag in err[0], err
        assert f"holds {n_train:,} training tokens" in err[0] and f"at most {n_train:,}" in err[0], err
        assert not out.exists()
    rc, err = _cli(argv + ["--seq-len", "16", "--eval-tokens", "16"], capsys)  # the same command, sizes that fit
    assert rc == 0, err
    short = Trainer(TrainArgs(data=[str(DEFAULT_TEXT)], layers=1, steps=1, seq_len=1024, out=str(tmp_path / "s")))
    from kimi_tools.data import split_tail, tokenize_documents

    held = split_tail(tokenize_documents(read_documents([DEFAULT_TEXT]), short.tokenizer.encode), 0.05)[1]
    n_eval = sum(len(d) for d in held)
    assert n_eval < 1024 <= short.num_tokens
    assert [b.num_tokens for b in short.evals] == [n_eval]  # one row, each held-out token once
    assert torch.equal(short.evals[0].input_ids[0], torch.from_numpy(np.concatenate(held)))


def test_a_folder_that_is_no_run_gets_one_answer_with_or_without_resume(tmp_path, capsys):
    """A non-empty --out without run.json: the plain command does not send the user to --resume, and --resume gives
    the same answer (another --out), so the two messages agree."""
    out = tmp_path / "notes"
    out.mkdir()
    (out / "mine.txt").write_text("x")
    argv = _small_argv(out) + ["--steps", "2"]
    answers = []
    for extra in ([], ["--resume"]):
        rc, err = _cli(argv + extra, capsys)
        assert rc == 2 and len(err) == 1, err
        assert "holds files but no run.json, so it is no kimi train run" in err[0], err
        assert "choose another --out" in err[0] and "pass --resume" not in err[0], err
        answers.append(err[0].split(": ", 3)[3])  # after "kimi: error: <flag>: "
    assert answers[0] == answers[1]
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]


def test_fp8_on_a_cpu_in_fp32_reports_both_problems_at_once():
    """``--fp8`` in fp32 on a CPU: one error asks for --dtype bfloat16 and says FP8 needs a CUDA GPU."""
    from kimi_tools.train.args import resolve

    with pytest.raises(ValueError) as ei:
        resolve(TrainArgs(data=[str(DEFAULT_TEXT)], out="x", fp8="rowwise", device="cpu"))
    msg = str(ei.value)
    assert msg.startswith("--fp8: ") and "\n" not in msg
    assert "got --dtype float32, expected bfloat16" in msg and "need a CUDA GPU" in msg, msg


# ---------------------------------------------------------------------------------------------- bf16 masters, saves


def test_bf16_resume_continues_exactly(tmp_path):
    """bf16 weights with fp32 masters: 3 steps equal 1 + resume 2, bitwise (losses, grad norms, the export). A
    resume whose masters are not copied back into the model (the model keeps its initial weights), or a step that
    leaves the bf16 gradient on the model (the next step's gradient then adds to it), breaks the equality."""
    kw = {**SMALL, "steps": 3, "warmup_steps": 0, "eval_every": 0, "eval_tokens": 16, "dtype": "bfloat16"}
    kw["plot"] = False
    a = train(TrainArgs(out=str(tmp_path / "a"), **kw))
    b1 = train(TrainArgs(out=str(tmp_path / "b"), stop_after=1, **kw))
    b2 = train(TrainArgs(out=str(tmp_path / "b"), resume=True, **kw))
    assert _numbers(a.records) == _numbers(b1.records + b2.records)
    from safetensors.torch import load_file

    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_master_weights_move_gradients_and_load_into_the_model():
    """MasterWeights over a bf16 module: grads_to_masters gives the masters the fp32 gradient and clears the
    model's (so the next backward does not add to it); load_state_dict (after DCP filled the masters in place)
    rounds them into the model."""
    from kimi_tools.train.weights import MasterWeights

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).bfloat16()
    mw = MasterWeights(model)
    assert mw.module is not model and all(m.dtype == torch.float32 for m in mw.masters)
    x = torch.randn(3, 8).bfloat16()
    model(x).float().square().sum().backward()
    want = {n: p.grad.float() for n, p in model.named_parameters()}
    mw.grads_to_masters()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(m.grad, want[n]) for n, m in zip(mw.names, mw.masters))
    state = mw.state_dict()
    new = {n: torch.randn(t.shape) for n, t in state.items()}
    for n, t in state.items():  # what DCP does: fills the state's tensors in place
        t.copy_(new[n])
    mw.load_state_dict(state)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), new[n].bfloat16()), n


def test_save_every_n_steps_and_the_last(tmp_path):
    """``--save-every 2 --steps 5``: resume states at steps 2 and 4 and at the last step 5 (--keep 10)."""
    kw = {**SMALL, "steps": 5, "eval_every": 0, "eval_tokens": 16, "plot": False, "layers": 1}
    train(TrainArgs(out=str(tmp_path / "r"), save_every=2, keep=10, **kw))
    assert sorted(p.name for p in (tmp_path / "r").glob("step-*")) == ["step-2", "step-4", "step-5"]


def _changed(f, value):
    """Another valid-looking value for the TrainArgs field ``f`` than ``value`` (for the fingerprint test)."""
    import typing

    from kimi_tools.train.args import _hint

    tp, _, is_list = _hint(typing.get_type_hints(TrainArgs)[f.name])
    choices = f.metadata.get("choices")
    if callable(choices):
        choices = choices()
    if is_list:
        return [*(value or []), "x"]
    if choices is not None:
        return next(c for c in choices if c != value)
    if tp is bool:
        return not value
    if tp in (int, float):
        return (value or 0) * 2 + 1
    return "x" if value is None else value + "x"


def _numbers_fields():
    import dataclasses

    from kimi_tools.train.args import run_control_fields

    return [f for f in dataclasses.fields(TrainArgs) if f.name not in run_control_fields()]


@pytest.mark.parametrize("f", _numbers_fields(), ids=lambda f: f.name)
def test_every_numbers_field_changes_the_fingerprint(f):
    """Each field that is not run control (``numbers=True``) changes the fingerprint when changed, so a resume with
    another value is refused; run-control fields do not."""
    import dataclasses

    from kimi.config import load_config
    from kimi_tools.train.args import fingerprint

    cfg = load_config("tiny").truncated(2)
    a = TrainArgs(out="o", **SMALL)
    value = _changed(f, getattr(a, f.name))
    assert value != getattr(a, f.name)
    assert fingerprint(dataclasses.replace(a, **{f.name: value}), cfg)[0] != fingerprint(a, cfg)[0], f.name


def test_fingerprint_fields_are_all_the_numbers_fields():
    """The parametrized list above is every field but run control: at least the ones a run's numbers obviously
    depend on (a field dropped from the hash must show up as a failing case there)."""
    names = {f.name for f in _numbers_fields()}
    assert {"seed", "grad_clip", "lr", "steps", "seq_len", "data", "beta2", "lora_rank", "fp8"} <= names


def test_eval_loss_is_the_token_weighted_mean(tmp_path):
    """The eval loss over batches of unequal target counts (short documents: rows hold several document ends) is
    the mean over all targets, i.e. the one-batch loss of all eval rows together, not the mean of batch means."""
    from kimi_tools.data import Batch
    from kimi_tools.train import Trainer

    data = short_documents(tmp_path / "docs.jsonl")
    kw = {**SMALL, "data": [str(data)], "eval_tokens": 96, "eval_fraction": 0.2}
    t = Trainer(TrainArgs(out=str(tmp_path / "r"), **kw))
    counts = [b.num_targets for b in t.evals]
    assert len(t.evals) == 3 and len(set(counts)) > 1, counts
    got, _ = t.evaluate()
    rows = list(t.evals)
    ids = torch.cat([b.input_ids for b in rows], dim=1)
    labels = torch.cat([b.labels for b in rows], dim=1)
    cus, off = [torch.zeros(1, dtype=torch.int64)], 0
    for b in rows:
        cus.append(b.cu_seqlens[1:] + off)
        off += b.num_tokens
    whole = Batch(ids, labels, torch.cat(cus))
    t.model.eval()
    with torch.no_grad():
        want = float(t.stage.loss(t.model, whole)[0])
        means = [float(t.stage.loss(t.model, b)[0]) for b in rows]
    unweighted = sum(means) / len(means)
    assert abs(unweighted - want) > 1e-4 * abs(want)  # the test tells the two weightings apart
    assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.gpu
def test_cuda_rng_is_restored_on_resume(tmp_path):
    """On CUDA, a step-N/ resume state holds the CUDA RNG and loading it restores it (dropout and any sampling on
    the GPU continue as in an uninterrupted run)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kimi_tools.train import Trainer

    kw = {**SMALL, "steps": 2, "eval_every": 0, "eval_tokens": 16, "plot": False, "layers": 1, "device": "cuda"}
    t = Trainer(TrainArgs(out=str(tmp_path / "r"), **kw))
    t._open()
    torch.cuda.manual_seed(1234)
    torch.rand(1000, device="cuda")
    want = torch.cuda.get_rng_state()
    t.save()  # step-0
    t2 = Trainer(TrainArgs(out=str(tmp_path / "r"), resume=True, **kw))  # seeds every RNG from --seed
    assert not torch.equal(torch.cuda.get_rng_state(), want)
    t2.checkpointer.load(0, t2.states())
    assert torch.equal(torch.cuda.get_rng_state(), want)
