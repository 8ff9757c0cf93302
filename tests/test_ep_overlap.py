"""The two-chunk overlap of the expert all-to-all (``shard_experts(..., overlap="chunks")``, ``kimi train
--ep-overlap chunks``) equals expert parallelism without overlap and one process.

Processes are spawned by the tests (``dist_helpers.run_workers``, gloo on CPU). One MoE layer (``_layer_worker``, 2 ranks): the
overlapped layer against the same layer without overlap and against one process on every rank's tokens, output and
every gradient, in fp64 (the algorithm: to 1e-12) and fp32 (rounding: the experts run each chunk's rows as their own
GEMMs, a BLAS kernel may block one row otherwise than many, and a weight gradient is the sum of two per-chunk GEMMs);
uneven token counts (rank 1 holds a single token, so its second chunk is empty and still joins every all-to-all),
starved experts, the grouped GEMMs; the order of the transfers forward and backward (each chunk's experts run while
the other chunk's all-to-all travels); with row-local experts (no GEMM) the output is bitwise the one without
overlap (each token's combine sums its pairs in the same order). The trainer's layouts (``_train_worker``, 4
ranks): ``TrainParallel`` with ``ep_overlap="chunks"`` at dp 4 x ep 2 (FSDP2 over efsdp 2) and at pp 2 x dp 2 x ep 2
(1F1B), fp32, 3 SGD steps: the loss and every gradient against one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_workers
from helpers import rel
from torch.distributed.tensor import DTensor

from kimi.config import load_config

SHAPES = [(2, 5), (1, 1)]  # [B, T] of rank 0 and 1: 10 tokens and 1 (an empty second chunk)
# relative errors: against EP without overlap (the same algorithm: fp64 seen 1.1e-15; fp32 rounding, from the
# GEMMs' blocking and the two per-chunk weight-gradient sums: seen 3.5e-7, and 1.8e-6 in the router gradient of
# the rank with one token, whose terms cancel) and against one process (as tests/test_expert_parallel.py)
TOL_PLAIN = {torch.float64: 1e-12, torch.float32: 1e-5}
TOL_ONE = {torch.float64: 1e-11, torch.float32: 1e-5}
# the trainer's layouts in fp32 against one process over 3 SGD steps (sums in another order: seen 7.4e-8 on the
# loss, 5.3e-6 on a gradient by step 3, and the same without overlap). Not AdamW: its first steps divide each
# gradient entry by its own size, so the fp32 rounding of near-zero entries becomes a 1e-4 difference in every
# gradient of step 2, with or without overlap (tests/test_mesh.py runs AdamW in fp64 for that reason)
TOL_TRAIN = {"loss": 1e-6, "grad": 5e-5}
FORWARD = [
    "forward issue dispatch 0",
    "forward issue dispatch 1",
    "forward wait dispatch 0",  # then chunk 0's experts, while dispatch 1 travels
    "forward issue combine 0",
    "forward wait dispatch 1",  # then chunk 1's experts, while combine 0 travels
    "forward issue combine 1",  # then the shared experts, while combine 1 travels
    "forward wait combine 0",
    "forward wait combine 1",
]
BACKWARD = [
    "backward issue combine 1",
    "backward issue combine 0",
    "backward wait combine 1",  # then chunk 1's expert backward, while combine 0's gradient travels
    "backward issue dispatch 1",
    "backward wait combine 0",  # then chunk 0's expert backward, while dispatch 1's gradient travels
    "backward issue dispatch 0",
    "backward wait dispatch 1",
    "backward wait dispatch 0",
]


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


# ------------------------------------------------------------------------------------------------ no processes


def test_overlap_refused_in_one_line():
    from kernels_torch.moe import KimiMoE
    from kernels_torch.parallel.expert import shard_experts
    from kimi_tools.train.parallel import TrainParallel

    with pytest.raises(ValueError, match=r"^--ep-overlap: got 'chunks' with --ep 1, expected none, or chunks, fb"):
        TrainParallel(1, "cpu", ep_overlap="chunks")
    with pytest.raises(ValueError, match=r"^--ep-overlap: got 'pairs' with --ep 2"):
        TrainParallel(1, "cpu", ep=2, world=2, ep_overlap="pairs")
    with pytest.raises(ValueError, match=r"^overlap: got 'both', expected one of \['none', 'chunks', 'fb', 'fb\+"):
        shard_experts(KimiMoE(load_config("tiny")), overlap="both")


def test_cli_refuses_overlap_without_ep(tmp_path, capsys):
    from kimi_tools.cli import main

    argv = ["train", "--preset", "tiny", "--layers", "2", "--steps", "1", "--data", "kimi/data/alice_ch1.txt"]
    assert main([*argv, "--ep-overlap", "chunks", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--ep-overlap: got 'chunks' with --ep 1, expected none, or chunks, fb or fb+chunks with "
                            "--ep > 1 (they overlap the expert all-to-all with compute)"), err  # fmt: skip
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ one MoE layer


def _grads(moe) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (this rank's experts' rows of a stack; zeros where none reached it)."""
    return {
        n: (torch.zeros_like(_local(p)) if p.grad is None else _local(p.grad)).clone()
        for n, p in moe.named_parameters()
    }


def _run(moe, x, R):
    """Output, x's gradient and the parameters' gradients of ``moe`` on ``x`` for the loss ``sum(out * R)``."""
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = moe(x)
    (out * R).sum().backward()
    return out.detach(), x.grad, _grads(moe)


def _compare(tag, got, want, tol, errors, replicated_sum=False, experts=None):
    out, xg, grads = got
    w_out, w_xg, w_grads = want
    pairs = [("out", out, w_out), ("x.grad", xg, w_xg)]
    for name, a in grads.items():
        b = w_grads[name]
        if replicated_sum and not name.startswith("experts."):  # one process's gradient: the ranks' parts summed
            a = a.clone()
            dist.all_reduce(a)
        if experts is not None and name.startswith("experts."):  # one process's stack: this rank's rows
            b = b[experts]
        pairs.append((f"{name}.grad", a, b))
    for name, a, b in pairs:
        err = rel(a, b) if float(b.norm()) else float(a.norm())
        if not err <= tol:
            errors.append(f"{tag} {name}: rel err {err:.2e} > {tol:.0e}")


def _layer_case(cfg, dtype, rank, world, errors, tag, bias=None, moe_kernel=None):
    from kernels_torch.moe import KimiMoE
    from kernels_torch.parallel.expert import shard_experts

    torch.manual_seed(0)
    ref = KimiMoE(cfg).to(dtype)
    ref.experts.moe_kernel = moe_kernel
    with torch.no_grad():
        for p in ref.parameters():  # every weight random, also the norm (ones at init)
            p.add_(0.05 * torch.randn_like(p))
        ref.gate.e_score_correction_bias.copy_(bias if bias is not None else 0.1 * torch.randn(cfg.num_experts))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(*SHAPES[j], cfg.hidden_size, generator=g, dtype=dtype) for j in range(world)]
    Rs = [torch.randn(x.shape, generator=g, dtype=dtype) for x in xs]
    D = cfg.hidden_size
    # one process on every rank's tokens; this rank's rows of its output and x gradient
    one = _run(ref, torch.cat([x.reshape(-1, D) for x in xs])[None], torch.cat([r.reshape(-1, D) for r in Rs])[None])
    lo = sum(xs[j].shape[0] * xs[j].shape[1] for j in range(rank))
    hi = lo + xs[rank].shape[0] * xs[rank].shape[1]
    one = (one[0][0, lo:hi].reshape(xs[rank].shape), one[1][0, lo:hi].reshape(xs[rank].shape), one[2])

    moe = KimiMoE(cfg).to(dtype)
    moe.experts.moe_kernel = moe_kernel
    ep = shard_experts(moe, overlap="chunks")
    ep.load_full_state_dict(ref.state_dict())
    experts = slice(ep.local_experts.start, ep.local_experts.stop)
    ep.trace = []
    chunks = _run(moe, xs[rank], Rs[rank])
    if ep.trace != FORWARD + BACKWARD:
        errors.append(f"{tag}: the transfers ran in the order {ep.trace}, expected {FORWARD + BACKWARD}")
    ep.overlap, ep.trace = "none", []
    plain = _run(moe, xs[rank], Rs[rank])
    if ep.trace:
        errors.append(f"{tag}: overlap 'none' ran the overlapped path ({ep.trace})")
    _compare(f"{tag} chunks vs plain EP", chunks, plain, TOL_PLAIN[dtype], errors)
    _compare(f"{tag} chunks vs one process", chunks, one, TOL_ONE[dtype], errors, replicated_sum=True, experts=experts)

    # row-local experts (no GEMM, nothing that depends on the rows' count): the output is bitwise the same
    moe.experts.rows_forward = lambda rows, expert: torch.tanh(rows) * (1.0 + expert[:, None].to(rows.dtype))
    outs = []
    for mode in ("chunks", "none"):
        ep.overlap = mode
        with torch.no_grad():
            outs.append(moe(xs[rank]))
    if not torch.equal(outs[0], outs[1]):
        errors.append(f"{tag}: with row-local experts the overlapped output differs from the plain one")


def _layer_worker(rank: int, world: int) -> None:
    tiny = load_config("tiny")
    errors: list[str] = []
    _layer_case(tiny.replace(routed_scaling_factor=2.5), torch.float64, rank, world, errors, "tiny fp64")
    _layer_case(tiny, torch.float32, rank, world, errors, "tiny fp32")
    E, El = tiny.num_experts, tiny.num_experts // world
    bias = torch.zeros(E)
    bias[0] = bias[E - El :] = -10.0  # the last rank's experts and expert 0 receive nothing
    _layer_case(tiny, torch.float64, rank, world, errors, "starved fp64", bias=bias)
    # no latent projection, no shared experts: the routed sum is the layer's output
    bare = tiny.replace(
        routed_expert_hidden_size=None, num_shared_experts=0, hidden_act="silu", activation_situ_linear_beta=None,
        quant_method=None,
    )  # fmt: skip
    _layer_case(bare, torch.float32, rank, world, errors, "grouped_mm fp32", moe_kernel="grouped_mm")
    if errors:
        raise AssertionError(f"rank {rank}/{world}:\n" + "\n".join(errors))


@pytest.mark.distributed
def test_overlapped_layer_equals_plain_ep_and_one_process():
    run_workers(_layer_worker, 2)


# ------------------------------------------------------------------------------------------------ the trainer's layouts

T = 24  # tokens per micro-batch (one packed row)
M = 4  # micro-batches (rows) per step, dealt round-robin to the dp groups
STEPS = 3
LR = 0.3
CUS = [[0, 5, 13, 24], [0, 24], [0, 2, 3, 17, 24], [0, 11, 24]]


def _cfg():
    # dense layer 0, MoE layers 1-3; AttnRes blocks of 2 layers, so that --pp 2 cuts between them
    return load_config("tiny").replace(index_topk=8, attn_res_block_size=2).truncated(4)


def _model():
    from kernels_torch.model import KimiK3Model

    torch.manual_seed(0)
    model = KimiK3Model(_cfg())
    for n, p in model.named_parameters():  # the LM stage's trainable set: the DSA indexer gets no LM-loss gradient
        if ".indexer." in n:
            p.requires_grad_(False)
    return model


def _batch(step: int):
    """The step's rows: ids [M, T], labels [M, T] with some -100, per-row offsets."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, _cfg().vocab_size, (M, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[torch.rand(M, T, generator=g) < 0.2] = -100
    return ids[:, :T], labels, [torch.tensor(CUS[(r + step) % M]) for r in range(M)]


def _optimizer(params):
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=LR)


def _one_process() -> tuple[list[float], list[dict]]:
    model = _model()
    opt = _optimizer(model.parameters())
    losses, grads = [], []
    for step in range(STEPS):
        ids, labels, cus = _batch(step)
        n = int((labels != -100).sum())
        loss = sum(model.loss(ids[r : r + 1], labels[r : r + 1], cus[r]) for r in range(M)) / n
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train_layout(pp: int, ref, errors: list[str], overlap: str = "chunks") -> None:
    """``TrainParallel`` (the trainer's setup) with ``--ep 2 --ep-overlap chunks`` over the 4 ranks, ``--pp pp``:
    3 SGD steps, the loss and every gradient against one process."""
    from kimi_tools.train.parallel import TrainParallel

    par = TrainParallel(1, "cpu", ep=2, pp=pp, world=4, ep_overlap=overlap)
    par.check_accum(M, T)
    model = _model()
    par.setup(model, lora=False)
    from kernels_torch.moe import KimiMoE

    moes = [m for m in model.modules() if isinstance(m, KimiMoE)]
    assert moes and all(m.routed_and_shared is not None for m in moes), "the overlap is not on every MoE layer"
    module = model if par.pipe is None else par.pipe
    opt = _optimizer(module.parameters())
    dp, my_dp = par.dp_size, par.mesh["dp"].get_local_rank()
    where = f"rank {dist.get_rank()} pp {pp} x dp {dp} x ep 2"
    ref_losses, ref_grads = ref
    for step in range(STEPS):
        ids, labels, cus = _batch(step)
        n = int((labels != -100).sum())
        rows = list(range(my_dp, M, dp))
        if par.pipe is None:
            loss = sum(model.loss(ids[r : r + 1], labels[r : r + 1], cus[r]) for r in rows) / n
            loss.backward()
            par.reduce_replicated()
            loss = par.sum_all(float(loss.detach()))
        else:
            loss = par.pipe.step(ids[rows], labels[rows], [cus[r] for r in rows], n_tokens=n)
            par.reduce_replicated()
            loss = par._sum([float(loss)], par.mesh["dp_cp"].get_group())[0]
        if not abs(loss - ref_losses[step]) <= TOL_TRAIN["loss"] * abs(ref_losses[step]):
            errors.append(f"{where} step {step + 1}: loss {loss} vs one process {ref_losses[step]}")
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            g = torch.zeros_like(_full(p)) if p.grad is None else _full(p.grad)
            want = ref_grads[step].get(name, torch.zeros_like(g))  # none reached it in one process
            err = rel(g, want) if float(want.norm()) else float(g.norm())
            if not err <= TOL_TRAIN["grad"]:
                errors.append(f"{where} step {step + 1}: {name}.grad rel err {err:.2e} > {TOL_TRAIN['grad']:.0e}")
        opt.step()
        opt.zero_grad(set_to_none=True)


def _train_worker(rank: int, world: int) -> None:
    ref = _one_process()
    errors: list[str] = []
    _train_layout(1, ref, errors)  # dp 4 x ep 2: FSDP2 over efsdp 2 runs the experts' unit once per chunk
    _train_layout(2, ref, errors)  # pp 2 x dp 2 x ep 2, 1F1B
    if errors:
        raise AssertionError("\n".join(errors[:30]))


@pytest.mark.distributed
def test_trainer_layouts_with_overlap_equal_one_process():
    run_workers(_train_worker, 4)


# ------------------------------------------------------------------------------------------------ the planner


def test_planner_counts_the_overlap_the_trainer_runs():
    """``kimi plan --overlap-a2a`` (``evaluate(overlap_a2a=True)``) is ``--ep-overlap chunks``: the routed experts
    at the calibrated rate for half the rows per expert; half the all-to-all (the first dispatch and last combine
    of each layer) exposed, the other half only where it outlasts the routed experts' compute; nothing at ep 1."""
    from kimi_tools import plan as P

    cfg = load_config("k3.1-pro")
    cal = P.load_calibration()
    L = P.Layout(pp=1, dp=256, cp=1, ep=8)  # 1,170 rows per expert at 8K tokens: the split runs 585, slower;
    # one stage, so that the micro-batch time is its compute + exposed all-to-all
    kw = dict(seq_len=8192, global_batch=1 << 24)
    for policy in (P.Policy(optimizer="adamw-bf16", recompute="full"), P.Policy(optimizer="adamw-bf16")):
        for hw in (P.Hardware(), P.Hardware(nvlink_gbps=5.0)):  # the half hidden fits behind the experts, or not
            plain = P.evaluate(cfg, L, policy, hw, cal, **kw)
            over = P.evaluate(cfg, L, policy, hw, cal, overlap_a2a=True, **kw)
            rows = plain["rows_per_expert"]
            assert over["rows_per_expert"] == rows
            assert plain["expert_slowdown"] == cal.expert_slowdown(rows, policy.recompute)
            assert over["expert_slowdown"] == cal.expert_slowdown(rows / 2, policy.recompute) > plain["expert_slowdown"]
            t, tp = over["time"], plain["time"]
            assert tp["all_to_all_exposed_per_microbatch"] == tp["all_to_all_per_microbatch"]
            a2a = t["all_to_all_per_microbatch"]
            assert a2a == tp["all_to_all_per_microbatch"] > 0  # the same bytes move
            # the experts' time at the split's rate: the compute grows by the experts' slowdown
            rate = cal.tflops[policy.recompute] * 1e12
            grown = t["compute_per_microbatch"] - tp["compute_per_microbatch"]
            f_exp = grown * rate / (over["expert_slowdown"] - plain["expert_slowdown"])  # the experts' FLOPs
            t_exp = f_exp * over["expert_slowdown"] / rate
            want = a2a / 2 + max(0.0, a2a / 2 - t_exp)
            assert t["all_to_all_exposed_per_microbatch"] == pytest.approx(want, rel=1e-9)
            assert (want > a2a / 2) == (hw.nvlink_gbps == 5.0), (a2a, t_exp)
            m = over["microbatches"]
            busy = t["compute_per_microbatch"] + t["all_to_all_exposed_per_microbatch"]
            assert t["busy"] == pytest.approx(m * (busy + t["pipeline_send_per_microbatch"]), rel=1e-9)
            assert t["bubble"] == 0.0
            assert t["step"] < tp["step"]  # here the hidden half outweighs the slower experts
    # no expert parallelism, nothing to overlap: the same prediction
    one = P.Layout(pp=8, dp=32, cp=1, ep=1)
    assert P.evaluate(cfg, one, P.Policy(), P.Hardware(), cal, overlap_a2a=True, **kw) == P.evaluate(
        cfg, one, P.Policy(), P.Hardware(), cal, **kw
    )


def test_pair_time_replays_two_parties_taking_turns():
    """``kimi_tools.plan.schedule.pair_time``: one ``OVERLAP_F_B`` pair as ``fb_overlap`` runs it, worked by hand
    (each party's compute in equal parts at its hand-overs, one transfer on the network at a time), and its bounds:
    every transfer hidden, or none (the forward then the backward)."""
    from kimi_tools.plan.schedule import pair_time

    assert pair_time(10.0, 1, 10.0, 1, 1.0) == 20.0  # each transfer behind the other's 5-unit part
    assert pair_time(0.0, 1, 0.0, 1, 1.0) == 2.0  # nothing to hide behind: the two transfers in a row
    # F: part 1, issue (travels 1 -> 3); B: part 1 (-> 2), issue (waits for the link: 3 -> 5); F waits 3, part 1
    # (-> 4), ends; B waits 5, part 1 (-> 6): 2 of the 4 units of transfer hidden
    assert pair_time(2.0, 1, 2.0, 1, 2.0) == 6.0
    assert pair_time(3.0, 4, 5.0, 0, 0.0) == pytest.approx(8.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        c_f, c_b, t_x = (torch.rand(3, generator=gen) * 10).tolist()
        n_f, n_b = torch.randint(0, 12, (2,), generator=gen).tolist()
        t = pair_time(c_f, n_f, c_b, n_b, t_x)
        assert c_f + c_b - 1e-9 <= t <= c_f + c_b + (n_f + n_b) * t_x + 1e-9
    with pytest.raises(ValueError, match="pair_time: got c_f=-1"):
        pair_time(-1.0, 1, 1.0, 1, 1.0)


@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_overlap_pairs_are_torchs_overlap_actions(pp):
    """``overlap_pairs``: per rank ``2 m - 3 pp + r + 1`` ``OVERLAP_F_B`` pairs (one fewer on the last rank), each a
    forward and a full backward on the rank's two stages of the V."""
    from kimi_tools.plan.schedule import overlap_pairs, rank_stages

    for m in (2 * pp, 3 * pp + 1):
        for r, pairs in enumerate(overlap_pairs(pp, m)):
            assert sum(n for *_, n in pairs) == 2 * m - 3 * pp + r + 1 - (r == pp - 1), (pp, m, r, pairs)
            for f, b, _ in pairs:
                assert {f, b} == set(rank_stages("DualPipeV", pp, r))


def test_planner_counts_fb_pairs_only_under_dualpipev():
    """``evaluate(overlap_a2a="fb")`` (``kimi train --ep-overlap fb``): under DualPipeV with ep > 1 and cp 1 the
    pairs hide part of the all-to-all (the busy time drops by exactly ``all_to_all_hidden_in_pairs``, the bubble,
    computed from the actions without a partner, stays) and the rank holds one more transfer's buffers; the row's
    command carries the flag. Under 1F1B, or with cp > 1 (the trainer refuses fb there), nothing is counted; with
    transfers that take no time nothing is hidden; an unknown mode is refused."""
    from kimi_tools import plan as P

    cfg = load_config("k3.1-pro")
    cal = P.load_calibration()
    kw = dict(seq_len=8192, global_batch=1 << 24)
    L = P.Layout(pp=2, dp=128, cp=1, ep=64)
    policy = P.Policy(optimizer="adamw-bf16", recompute="full")
    plain = P.evaluate(cfg, L, policy, P.Hardware(), cal, schedule="DualPipeV", **kw)
    fb = P.evaluate(cfg, L, policy, P.Hardware(), cal, schedule="DualPipeV", overlap_a2a="fb", **kw)
    assert (plain["ep_overlap"], fb["ep_overlap"]) == ("none", "fb")
    t, tp = fb["time"], plain["time"]
    assert tp["all_to_all_hidden_in_pairs"] == 0.0 < t["all_to_all_hidden_in_pairs"]
    assert tp["busy"] - t["busy"] == pytest.approx(t["all_to_all_hidden_in_pairs"], rel=1e-9)
    assert t["bubble"] == tp["bubble"] and t["step"] < tp["step"]
    Dl = cfg.routed_expert_hidden_size
    extra = fb["memory"]["activations"] - plain["memory"]["activations"]
    assert extra == 2 * 8192 * cfg.num_experts_per_token * Dl * 2
    assert "--ep-overlap fb" in " ".join(P.train_command(fb, preset="k3.1-pro", seq_len=8192))
    free = P.Hardware(nvlink_gbps=1e12, ib_gbps=1e12)  # transfers of no time: nothing to hide
    assert P.evaluate(cfg, L, policy, free, cal, schedule="DualPipeV", overlap_a2a="fb", **kw)["time"][
        "all_to_all_hidden_in_pairs"
    ] == pytest.approx(0.0, abs=1e-6)
    for where in (dict(schedule="1F1B"), dict(schedule="DualPipeV", layout=P.Layout(pp=2, dp=64, cp=2, ep=64))):
        lay = where.pop("layout", L)
        none = P.evaluate(cfg, lay, policy, P.Hardware(), cal, **where, **kw)
        assert P.evaluate(cfg, lay, policy, P.Hardware(), cal, overlap_a2a="fb", **where, **kw) == none
    with pytest.raises(ValueError, match="overlap_a2a: got 'pairs'"):
        P.evaluate(cfg, L, policy, P.Hardware(), cal, schedule="DualPipeV", overlap_a2a="pairs", **kw)
