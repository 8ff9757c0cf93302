"""The equivalence harness's own logic: selection agreement modulo ties, layer-local rows, pass/fail."""

import numpy as np

from kimi_tools.compare import TOLERANCES, RunResult, compare_runs, format_table, rel_err, selection_agreement

rng = np.random.default_rng(0)


def test_selection_agreement_counts_ties_separately():
    base = rng.uniform(1.0, 2.0, size=10)
    scores = np.stack([base, base, base, base]).astype(np.float32)
    order = np.argsort(-base)
    scores[1, order[4]] = scores[1, order[3]]  # row 1: the k-th and (k+1)-th keys tie exactly
    ref = np.stack([order[:4]] * 4)
    other = ref.copy()
    other[1, 3] = order[4]  # row 1: the tied twin instead of the k-th key -> a tie flip
    other[2, 3] = order[9]  # row 2: the worst key instead of the k-th -> a real disagreement
    counts, same = selection_agreement(ref, scores, other, tie_rel=1e-6)
    assert counts == {"rows": 4, "identical": 2, "tie_only": 1, "disagree": 1}
    assert same.tolist() == [True, False, False, True]


def test_a_future_key_is_never_a_tie():
    scores = np.array([[3.0, 2.0, 2.0, 2.0]] * 4)  # raw scores: the future keys tie with the k-th visible one
    ref = np.array([[0, -1], [0, 1], [0, 1], [0, 1]])
    other = ref.copy()
    other[1] = [0, 2]  # row 1 selects key 2 > 1: a causality bug, not a tie
    counts, _ = selection_agreement(ref, scores, other, tie_rel=0.1, causal=True)
    assert counts["disagree"] == 1
    counts, _ = selection_agreement(ref, scores, other, tie_rel=0.1, causal=False)
    assert counts["tie_only"] == 1


def test_padding_slots_are_ignored():
    scores = np.array([[1.0, 2.0, -np.inf, -np.inf]])
    a = np.array([[1, 0, -1, -1]])
    b = np.array([[0, 1, -1, -1]])
    counts, same = selection_agreement(a, scores, b, 1e-6)
    assert counts["identical"] == 1 and same.all()


def _run(T=12, D=8, noise=0.0, layer_noise=None):
    layers = []
    for _ in range(3):
        base = {k: rng.standard_normal((T, D)).astype(np.float32) for k in ("attn_out", "mlp_out", "residual")}
        layers.append(base)
    return RunResult("x", rng.standard_normal((T, 16)).astype(np.float32), layers)


def test_compare_runs_pass_and_first_divergent_layer():
    ref = _run()
    same = RunResult("torch-eager", ref.logits.copy(), [{k: v * (1 + 1e-7) for k, v in r.items()} for r in ref.layers])
    rep = compare_runs(ref, same, ["kda", "kda", "kda"], "float32")
    assert rep.passed and rep.first_divergent_layer is None
    bad_layers = [dict(r) for r in same.layers]
    bad_layers[1]["mlp_out"] = bad_layers[1]["mlp_out"] * 1.01
    rep = compare_runs(ref, RunResult("torch-eager", ref.logits, bad_layers), ["kda"] * 3, "float32")
    assert not rep.passed and rep.first_divergent_layer == 1
    assert any("mlp_rel" in f for f in rep.layers[1].failed)


def test_nan_fails():
    ref = _run()
    nan_layers = [dict(r) for r in ref.layers]
    nan_layers[0]["attn_out"] = np.full_like(nan_layers[0]["attn_out"], np.nan)
    rep = compare_runs(ref, RunResult("t", ref.logits, nan_layers), ["kda"] * 3, "float32")
    assert not rep.passed and rep.first_divergent_layer == 0


def test_tolerances_named_per_dtype():
    assert set(TOLERANCES) == {"float32", "bfloat16"}
    assert TOLERANCES["float32"].attn_rel < TOLERANCES["bfloat16"].attn_rel
    assert rel_err(np.ones(3), np.ones(3)) == 0.0


def _dsa_run(ref_logits, topk, scores, T=12, D=8):
    layers = [
        {k: np.ones((T, D), np.float32) for k in ("attn_out", "mlp_out", "residual")}
        | {"topk_indices": topk, "index_scores": scores}
    ]
    return RunResult("x", ref_logits, layers)


def test_logits_bound_after_near_tie_flips():
    """fp32: a near-tie flip of a row's keys (every layer passing) moves every later row of a full run, so the
    logits bound widens by TIE_FLIP_LOGITS_FACTOR and says why; without a flip, or past the widened bound, or in
    bf16, the plain bound holds."""
    from kimi_tools.compare import TIE_FLIP_LOGITS_FACTOR

    T = 12
    scores = np.tile(np.arange(T, 0, -1, dtype=np.float32), (T, 1))  # key 0 scores highest
    scores[5, 1] = scores[5, 0]  # row 5: keys 0 and 1 tie
    topk = np.zeros((T, 1), np.int64)
    flipped = topk.copy()
    flipped[5, 0] = 1  # the tied twin: a near-tie flip
    logits = rng.standard_normal((T, 16)).astype(np.float32)
    tol = TOLERANCES["float32"].logits_rel

    def other(rel, sel):
        noisy = logits * (1 + rel)  # logits rel = rel exactly
        return RunResult("torch-eager", noisy, _dsa_run(logits, sel, scores).layers)

    ref = _dsa_run(logits, topk, scores)
    assert compare_runs(ref, other(3 * tol, flipped), ["dsa"], "float32").passed
    rep = compare_runs(ref, other(3 * tol, topk), ["dsa"], "float32")  # no flip: the plain bound
    assert not rep.passed and rep.tie_flipped_rows == 0
    rep = compare_runs(ref, other(2 * TIE_FLIP_LOGITS_FACTOR * tol, flipped), ["dsa"], "float32")
    assert not rep.passed and rep.tie_flipped_rows == 1
    assert "flipped at near-ties" in format_table([compare_runs(ref, other(3 * tol, flipped), ["dsa"], "float32")])


def test_run_torch_records_the_moe_kernel(tmp_path):
    """``kimi compare --json`` carries ``RunResult.kernels``: the routed experts' kernel is among them (the loop on the
    eager backend), so a report says which MoE path produced its numbers."""
    import numpy as np

    from kimi.config import load_config
    from kimi.init import init_checkpoint
    from kimi_tools.compare import run_torch

    cfg = load_config("tiny").truncated(2)  # layer 1 is a MoE layer
    init_checkpoint(tmp_path, cfg, seed=0)
    ids = np.random.default_rng(0).integers(0, 256, 24)
    run = run_torch(tmp_path, ids, backend="eager", dtype="float32", device="cpu")
    assert run.kernels.get("moe") == {"loop": 1}
