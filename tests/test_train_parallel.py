"""``kimi train`` under ``torchrun`` (gloo processes) equals one process: FSDP2 with data parallelism (dp = 2),
context parallelism (cp = 2) and both (dp = 2 x cp = 2), the same losses, gradient norms and eval loss; a DCP
``step-N/`` folder of 2 ranks resumes in one process (another world size) and continues as the one-process run
does; the distillation stages run under FSDP2 (their indexers whole on every rank) and refuse --cp > 1.

The data are many short JSONL documents, so the micro-batches of a step, and the context-parallel shards of a row,
hold different target counts: a loss weighted 1/accum, or a CP loss taken as the mean of per-shard means, fails."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_helpers import torchrun
from safetensors.torch import load_file

from kimi_tools.cli import main
from kimi_tools.common import DEFAULT_TEXT

# fp32 sums in another order (sharded reductions): the gradient norm is the most sensitive, seen 1.0e-4 at step 3
# of dp 2 x cp 2 (after two updates); the fp32 masters after 3 steps: 1e-5 seen; the export stores them in bf16,
# where fp32 differences of 1e-6 can flip a rounding
TOL = {"loss": 1e-5, "grad_norm": 3e-4, "eval_loss": 1e-5, "kl": 1e-5, "masters": 1e-4}
# the bf16 exports of the two runs: values whose rounding flipped, at most this share of each tensor (or 2 values).
# The masters agree to TOL["masters"]; a value flips where the two fp32 masters straddle a bf16 rounding boundary
# (seen: 1.1% of layer 0's down_proj with the fp32 tensors summed outside FSDP2); exactness is checked above, each
# export equal to its own run's masters rounded once.
EXPORT_FLIPS = 0.03
# Four layers: no AttnRes block boundary inside (blocks of 4). At six layers cp 2 (fp32) and bf16 ep 2 leave the
# one-process run by rounding alone: their step-1 gradients agree (fp32: 1.3e-5, bf16: 3e-3), but AdamW's first step
# (m / sqrt(v) = g / |g|) gives an element whose gradient cancels to 1e-5 of its parts a full-lr update or none, as
# rounding decides (cp 2: step-2 loss 3.1e-5 off at --lr 3e-3, 7e-7 at 3e-4), and bf16 one process with its step-1
# gradients rounded differently (x (1 + 2e-3 N(0, 1))) is 5-11% off at step 3. The layouts across a block boundary:
# exactly, fp64, in test_fsdp.py (cp 2) and test_mesh.py (bf16 dp 2 x ep 2), and dp 2 here.
COMMON = (
    "--preset tiny --layers 4 --steps 3 --seq-len 40 --micro-batch-tokens 40 --batch-tokens 80 --eval-tokens 40 "
    "--eval-every 0 --warmup-steps 1 --lr 3e-3 --quiet --no-plot"
).split()
STAGE = (
    "--preset tiny --layers 4 --steps 2 --seq-len 80 --micro-batch-tokens 80 --batch-tokens 160 --eval-tokens 80 "
    "--eval-every 0 --warmup-steps 1 --lr 3e-3 --quiet --no-plot"
).split()


def _short_documents(path: Path, n_words: int = 1500, seed: int = 0) -> Path:
    """Many short documents (1 to 12 words each) of the bundled text, one JSONL line each."""
    rng = np.random.default_rng(seed)
    words = DEFAULT_TEXT.read_text(encoding="utf-8").split()[:n_words]
    lines, i = [], 0
    while i < len(words):
        n = int(rng.integers(1, 13))
        lines.append(json.dumps({"text": " ".join(words[i : i + n])}))
        i += n
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return _short_documents(tmp_path_factory.mktemp("data") / "docs.jsonl")


@pytest.fixture(scope="module")
def one(tmp_path_factory, data) -> Path:
    """The LM run in one process: the reference of every layout."""
    out = tmp_path_factory.mktemp("one") / "run"
    assert main(["train", *COMMON, "--data", str(data), "--out", str(out)]) == 0
    return out


def _records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _close(a, b, tol) -> bool:
    return abs(a - b) <= tol * abs(b)


def _torchrun(nproc: int, argv: list[str]) -> subprocess.CompletedProcess:
    """``kimi train *argv`` on ``nproc`` torchrun ranks (``dist_helpers.torchrun``)."""
    return torchrun(nproc, ["-m", "kimi_tools.cli", "train", *argv])


def _assert_same(got: dict, want: dict, steps, keys=("loss", "grad_norm")) -> None:
    for step in steps:
        for key in keys:
            assert _close(got[step][key], want[step][key], TOL[key]), (step, key, got[step][key], want[step][key])


def _target_counts(data: Path, seq_len: int, n: int) -> list[list[int]]:
    """The target counts of the first ``n`` rows of the run's loader, split in two halves (the CP shards)."""
    from kimi.tokenizer import load_tokenizer
    from kimi_tools.data import IGNORE_INDEX, PackedLoader, read_documents, split_tail, tokenize_documents

    docs, _ = split_tail(tokenize_documents(read_documents([data]), load_tokenizer(None, 512).encode), 0.05)
    loader = PackedLoader(docs, seq_len, rows=1, seed=0)
    out = []
    for _ in range(n):
        lab = loader.next_batch().labels[0]
        out.append([int((lab[: seq_len // 2] != IGNORE_INDEX).sum()), int((lab[seq_len // 2 :] != IGNORE_INDEX).sum())])
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_cp2_equals_one_process_and_resumes_on_one(tmp_path, data, one):
    counts = _target_counts(data, 40, 2)
    assert len({c for row in counts for c in row}) > 1, counts  # shards and micro-batches of unequal target counts
    two = tmp_path / "two"
    r = _torchrun(2, [*COMMON, "--data", str(data), "--cp", "2", "--stop-after", "2", "--out", str(two)])
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = _records(one), _records(two)
    _assert_same(got, want, (1, 2))
    assert _close(got[0]["eval_loss"], want[0]["eval_loss"], TOL["eval_loss"])
    assert not (two / "model.safetensors").exists()  # stopped early: its resume state, no model
    # the DCP folder of 2 ranks resumes in one process and reaches the one-process run's step 3
    assert main(["train", *COMMON, "--data", str(data), "--resume", "--out", str(two)]) == 0
    got = _records(two)
    _assert_same(got, want, (3,))
    assert _close(got[3]["eval_loss"], want[3]["eval_loss"], TOL["eval_loss"])
    ma, mb = _masters(two / "step-3"), _masters(one / "step-3")  # the fp32 weights after step 3
    assert ma.keys() == mb.keys() and len(mb) > 50
    for k in mb:
        err = float((ma[k].double() - mb[k].double()).norm() / mb[k].double().norm().clamp_min(1e-30))
        assert err <= TOL["masters"], (k, err)
    a, b = load_file(two / "model.safetensors"), load_file(one / "model.safetensors")
    assert a.keys() == b.keys()
    exact = 0
    for k in b:
        name = k.split(".", 1)[1] if k.startswith("language_model.") else k
        if name in ma and a[k].is_floating_point() and a[k].shape == ma[name].shape:  # the masters, rounded once
            assert torch.equal(a[k], ma[name].to(a[k].dtype)), k
            exact += 1
        if b[k].dtype == torch.float32:  # fp32 in the export too: the masters' bound
            err = float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30))
            assert err <= TOL["masters"], (k, err)
        else:  # bf16, MXFP4 blocks and scales: a rounding flipped here and there
            flips = int((a[k] != b[k]).sum())
            assert flips <= flip_bound(b[k].numel(), EXPORT_FLIPS), (k, flips, b[k].numel())
    assert exact > 20, exact


def flip_bound(n: int, share: float) -> float:
    """The most roundings of an ``n``-value bf16 tensor that may flip between two runs whose masters differ: each
    value flips with probability at most ``share`` (its master moved across a bf16 rounding boundary), so the count
    is about Poisson with mean ``share x n``; allowed: the mean plus three standard deviations, and one more (a small
    tensor's few flips are a count of rare events, not a share)."""
    mean = share * n
    return mean + 3 * mean**0.5 + 1


def assert_exports_close(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], flips_share: float = EXPORT_FLIPS
) -> None:
    """Two runs' exported tensors (``a`` parallel, ``b`` one process): fp32 ones within the masters' bound, the
    others (bf16, MXFP4 blocks and scales) with at most ``flips_share`` of their values' roundings flipped."""
    assert a.keys() == b.keys()
    for k in b:
        if b[k].dtype == torch.float32:
            err = float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30))
            assert err <= TOL["masters"], (k, err)
        else:
            flips = int((a[k] != b[k]).sum())
            assert flips <= flip_bound(b[k].numel(), flips_share), (k, flips, b[k].numel())


def _masters(step_dir: Path) -> dict[str, torch.Tensor]:
    """The fp32 masters ``weights.<name>`` of a ``step-N/`` resume state, read in this process."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    names = [k.removeprefix("weights.") for k in meta if k.startswith("weights.")]
    state = {"weights": {n: torch.empty(meta[f"weights.{n}"].size, dtype=torch.float32) for n in names}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(state, checkpoint_id=str(step_dir))
    return state["weights"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("nproc, cp", [(2, 1), (4, 2)], ids=["dp2", "dp2xcp2"])
def test_torchrun_data_parallel_equals_one_process(tmp_path, data, one, nproc, cp):
    """dp = 2 (each rank one of the step's two micro-batches, FSDP2 over both) and dp = 2 x cp = 2 (each dp group one
    micro-batch, cut into two shards): the one-process losses, gradient norms and eval loss, three steps."""
    out = tmp_path / "run"
    r = _torchrun(nproc, [*COMMON, "--data", str(data), "--cp", str(cp), "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = _records(one), _records(out)
    _assert_same(got, want, (1, 2, 3))
    for step in (0, 3):
        assert _close(got[step]["eval_loss"], want[step]["eval_loss"], TOL["eval_loss"]), step


@pytest.mark.distributed
def test_torchrun_dp2_across_an_attn_res_block_equals_one_process(tmp_path, data):
    """dp = 2 on six layers of the tiny preset, whose AttnRes blocks of 4 put a block boundary inside (the runs above
    use four layers): the one-process losses and gradient norms, three steps. FSDP2 once gathered the layers of a
    block a second time in the backward there (``kernels_torch.model._passed_on``) and held them gathered past the
    step, and this run's eval loss after step 3 drifted (5.84942 against 5.84436)."""
    args = [*COMMON, "--layers", "6", "--data", str(data)]
    assert main(["train", *args, "--out", str(tmp_path / "one")]) == 0
    r = _torchrun(2, [*args, "--out", str(tmp_path / "dp2")])
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = _records(tmp_path / "dp2"), _records(tmp_path / "one")
    _assert_same(got, want, (1, 2, 3))
    for step in (0, 3):  # the update of the last step shows in the eval after it
        assert _close(got[step]["eval_loss"], want[step]["eval_loss"], TOL["eval_loss"]), step


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["indexer-warmup", "sparse"])
def test_torchrun_distillation_stages_equal_one_process(tmp_path, data, stage):
    """The distillation stages under torchrun with FSDP2 (2 ranks, --cp 1; they crashed with 'mixed torch.Tensor
    and DTensor'; the sparse stage with --ep 2) give the one-process loss, KL and gradient norm; --cp 2 is refused
    with one line saying why."""
    argv = [*STAGE, "--data", str(data), "--stage", stage]
    assert main(["train", *argv, "--out", str(tmp_path / "one")]) == 0
    layout = ["--ep", "2"] if stage == "sparse" else []  # the sparse stage with the routed experts split too
    r = _torchrun(2, [*argv, *layout, "--out", str(tmp_path / "two")])
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = _records(tmp_path / "one"), _records(tmp_path / "two")
    _assert_same(got, want, (1, 2), ("loss", "grad_norm", "kl"))
    assert _close(got[2]["eval_loss"], want[2]["eval_loss"], TOL["eval_loss"])
    if stage == "indexer-warmup":  # one refusal is enough: both stages share the check
        r = _torchrun(2, [*argv, "--cp", "2", "--out", str(tmp_path / "cp")])
        assert r.returncode != 0, r.stderr[-3000:]  # torchrun's own status: a rank exited with 2
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("kimi: error:")]
        assert errors and "with --cp 2: the distillation's teacher" in errors[0], r.stderr[-3000:]
        assert not (tmp_path / "cp").exists()


BF16_TOL = {"loss": 1e-2, "grad_norm": 3e-2, "eval_loss": 1e-2}  # bf16 compute, sums in another order (2^-8 = 3.9e-3)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ep2", "lora_ep2", "bf16_ep2"])
def test_torchrun_expert_parallel_equals_one_process(tmp_path, data, one, variant):
    """--ep 2 on 2 ranks (dp 2, efsdp 1): the routed experts split over the ranks, everything else FSDP2; in fp32,
    with LoRA (frozen base, adapters FSDP2-sharded and gathered for the export), and in bf16 through FSDP2's mixed
    precision (fp32 masters, the checkpoint's fp32 tensors kept fp32): the one-process run's losses, gradient norms,
    eval loss and export."""
    extra = {"ep2": [], "lora_ep2": ["--lora-rank", "4"], "bf16_ep2": ["--dtype", "bfloat16"]}[variant]
    ref = one
    if extra:
        ref = tmp_path / "one"
        assert main(["train", *COMMON, *extra, "--data", str(data), "--out", str(ref)]) == 0
    out = tmp_path / "two"
    r = _torchrun(2, [*COMMON, *extra, "--data", str(data), "--ep", "2", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = _records(ref), _records(out)
    if variant == "bf16_ep2":
        for step in (1, 2, 3):
            for key in ("loss", "grad_norm"):
                assert _close(got[step][key], want[step][key], BF16_TOL[key]), (step, key)
        assert _close(got[3]["eval_loss"], want[3]["eval_loss"], BF16_TOL["eval_loss"])
        from kimi.checkpoint import CheckpointReader

        stored = CheckpointReader(out)  # the checkpoint's dtypes: fp32 where the layout keeps fp32
        assert stored.dtype("model.layers.0.self_attn.A_log") == "float32"
        assert stored.dtype("model.layers.0.self_attn.q_proj.weight") == "bfloat16"
        return
    _assert_same(got, want, (1, 2, 3))
    assert _close(got[3]["eval_loss"], want[3]["eval_loss"], TOL["eval_loss"])
    files = ["adapter_model.safetensors"] if variant == "lora_ep2" else ["model.safetensors"]
    for name in files:
        a, b = load_file(out / name), load_file(ref / name)
        assert a.keys() == b.keys()
        assert_exports_close(a, b)


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_recompute_and_offload_equal_one_process(tmp_path, data, one):
    """Attention recomputation with the MLP / MoE blocks offloaded to the host (saved-tensor hooks inside FSDP2's
    units, the routed experts split by --ep 2; the gathered parameters are never copied) and the dense and DSA layers
    recomputed whole with their inputs offloaded: the one-process run's losses, gradient norms and eval loss."""
    for name, policy in (
        ("attn_mlp", ["--recompute-mode", "attn", "--offload-activations", "mlp"]),
        ("layer_all", ["--recompute-layers", "dense,dsa", "--offload-activations", "all", "--offload-layers", "dsa"]),
    ):
        out = tmp_path / name
        argv = [*COMMON, "--data", str(data), "--ep", "2", "--recompute", *policy, "--no-save", "--out", str(out)]
        r = _torchrun(2, argv)
        assert r.returncode == 0, r.stderr[-3000:]
        want, got = _records(one), _records(out)
        _assert_same(got, want, (1, 2, 3))
        assert _close(got[3]["eval_loss"], want[3]["eval_loss"], TOL["eval_loss"])


def test_layout_flags_refused_in_one_line():
    """Sizes that cannot make a layout are refused before any process group, naming the flags and values."""
    from kimi_tools.train.parallel import TrainParallel

    with pytest.raises(ValueError, match=r"^--ep: got 3, expected a divisor of --dp x --cp = 2 x 2 = 4"):
        TrainParallel(2, "cpu", ep=3, world=4)
    with pytest.raises(ValueError, match=r"^--dp/--cp: got --dp 3 x --cp 2 = 6 ranks, expected the world size 4"):
        TrainParallel(2, "cpu", dp=3, world=4)
    with pytest.raises(ValueError, match=r"^--cp: got 3, expected a positive divisor of the world size 4"):
        TrainParallel(3, "cpu", world=4)
    with pytest.raises(ValueError, match=r"^--ep: got 0, expected a positive integer"):
        TrainParallel(1, "cpu", ep=0, world=4)
    if "RANK" not in os.environ:  # one process (not under torchrun)
        with pytest.raises(ValueError, match=r"^--ep 2: given in one process, expected a launch under torchrun"):
            TrainParallel(1, "cpu", ep=2)
        with pytest.raises(ValueError, match=r"^--cp 2 --dp 2: given in one process"):
            TrainParallel(2, "cpu", dp=2)
