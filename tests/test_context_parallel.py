"""Context parallelism (kernels_torch.parallel.context) equals one rank: outputs, logits and every gradient.

Processes are spawned by the test (``dist_helpers.run_workers``: gloo on CPU); each rank also runs the
single-rank reference itself from the same seed. fp64 throughout, so the tolerances below measure the algorithm
(summary-and-merge, the all-gathers), not rounding. The packed row: T = 45 tokens (not a multiple of world x chunk
size 64), documents [0, 3) (shorter than a shard), [3, 12), [12, 40) (crosses the shard boundaries; at world 4 rank
2 is carried through, and rank 1 starts exactly at a document start), [40, 45). Also: shards of 1-2 tokens (shorter
than the conv window), batch rows without cu_seqlens, the absorbed MLA form, the indexer's RoPE (``indexer_rope``
"half" and "interleaved": positions are global), and at world 4 ``cu_seqlens = [0, 16, 30, 45]`` (middle ranks
that carry a document in and start a new one).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_workers
from helpers import rel

from kernels_torch.parallel.context import make_shard, shard_bounds
from kimi.config import load_config

T = 45
CU = [0, 3, 12, 40, 45]
# at world 4 (shards 0-12, 12-23, 23-34, 34-45) ranks 1 and 2 continue a document and start one; rank 3 is carried
# through: a carry-in that starts a document resets the state (its summary's A is zero)
CU_CARRY_AND_START = [0, 16, 30, 45]
# named tolerances (relative error, fp64)
TOL = {"out": 1e-10, "x.grad": 1e-9, "param.grad": 1e-9, "logits": 1e-10, "index_scores": 1e-10}


# ------------------------------------------------------------------------------------------------ no processes


def test_shard_bounds_balanced_and_contiguous():
    assert shard_bounds(45, 4) == [(0, 12), (12, 23), (23, 34), (34, 45)]
    assert shard_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="T: got 3 tokens for 4 ranks"):
        shard_bounds(3, 4)


def test_make_shard_geometry():
    s = make_shard(T, torch.tensor(CU), 2, 4)  # tokens 23..34 inside document [12, 40)
    assert (s.start, s.stop, s.doc_start, s.carry_in, s.carry_through) == (23, 34, 12, True, True)
    assert s.local_cu_seqlens.tolist() == [0, 11]
    s = make_shard(T, torch.tensor(CU), 1, 4)  # tokens 12..23: a document starts exactly at the shard start
    assert (s.carry_in, s.carry_through, s.local_cu_seqlens.tolist()) == (False, False, [0, 11])
    s = make_shard(T, torch.tensor(CU), 3, 4)  # 34..45: continues [12, 40), then [40, 45) starts inside
    assert (s.carry_in, s.carry_through, s.local_cu_seqlens.tolist(), s.last_doc_start) == (True, False, [0, 6, 11], 6)
    s = make_shard(T, torch.tensor(CU_CARRY_AND_START), 1, 4)  # 12..23: continues [0, 16), then [16, 30) starts
    assert (s.carry_in, s.carry_through, s.local_cu_seqlens.tolist(), s.last_doc_start) == (True, False, [0, 4, 11], 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        make_shard(T, torch.tensor([0, 50]), 0, 2)


# ------------------------------------------------------------------------------------------------ spawned ranks


def _check(name: str, got: torch.Tensor | None, want: torch.Tensor | None, tol: float, errors: list[str]) -> None:
    if want is None and got is None:
        return
    got = torch.zeros_like(want) if got is None else got
    want = torch.zeros_like(got) if want is None else want
    if want.norm() == 0:
        err = float(got.norm())
    else:
        err = rel(got, want)
    if not err <= tol:
        errors.append(f"{name}: rel err {err:.3e} > {tol:.0e}")


def _grads_summed(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    out = {}
    for n, p in module.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)  # each rank holds its shard's part of every parameter gradient
        out[n] = g
    return out


def _layer_case(layer, x, cu, errors, tag, aux_weight=None, form="expanded"):
    """One layer: reference on the whole row vs CP on this rank's shard; loss sum(out * R) (+ scores term)."""
    from kernels_torch.parallel.context import ContextParallel

    g = torch.Generator().manual_seed(7)
    R = torch.randn(x.shape, generator=g, dtype=x.dtype)
    is_mla = not hasattr(layer, "recurrence_inputs")

    def run(xx, cu_):
        if is_mla:
            out, aux = layer(xx, cu_, form=form, return_aux=True)
            return out, aux.get("index_scores"), aux.get("topk_indices")
        return layer(xx, cu_)[0], None, None

    # reference (one rank): the layer's own forward
    layer.zero_grad()
    xr = x.clone().requires_grad_()
    out_r, sc_r, tk_r = run(xr, None if cu is None else torch.tensor(cu))
    loss = (out_r * R).sum()
    if sc_r is not None and aux_weight is not None:
        loss = loss + (sc_r * aux_weight).sum()
    loss.backward()
    ref_grads = {n: None if p.grad is None else p.grad.clone() for n, p in layer.named_parameters()}

    # context parallel
    cp = ContextParallel(layer)
    layer.zero_grad()
    ids_stub = torch.zeros(x.shape[0], x.shape[1], dtype=torch.long)
    cp.shard(ids_stub, None if cu is None else torch.tensor(cu))
    s = cp.current_shard
    xl = cp.shard_like(x).clone().requires_grad_()
    out, sc, tk = run(xl, s.local_cu_seqlens)
    loss = (out * cp.shard_like(R)).sum()
    if sc is not None and aux_weight is not None:
        loss = loss + (sc * cp.shard_like(aux_weight)).sum()
    loss.backward()
    _check(f"{tag} out", out, cp.shard_like(out_r), TOL["out"], errors)
    _check(f"{tag} x.grad", xl.grad, cp.shard_like(xr.grad), TOL["x.grad"], errors)
    if sc is not None:
        _check(f"{tag} index_scores", sc, cp.shard_like(sc_r), TOL["index_scores"], errors)
        if not torch.equal(tk, cp.shard_like(tk_r)):
            errors.append(f"{tag} topk_indices differ from the single-rank global ids")
    for n, gsum in _grads_summed(layer).items():
        _check(f"{tag} {n}.grad", gsum, ref_grads[n], TOL["param.grad"], errors)
    cp.remove()


def _worker(rank: int, world: int) -> None:
    from kernels_torch.kda import KimiDeltaAttention
    from kernels_torch.mla import GatedMLA
    from kernels_torch.model import KimiK3Model
    from kernels_torch.parallel.context import ContextParallel

    cfg = load_config("tiny").replace(index_topk=8)  # top-8 of up to 45 keys: real sparse selection
    errors: list[str] = []
    g = torch.Generator().manual_seed(0)

    torch.manual_seed(0)
    kda = KimiDeltaAttention(cfg, 0).double()
    x = torch.randn(1, T, cfg.hidden_size, generator=g, dtype=torch.float64)
    _layer_case(kda, x, CU, errors, "kda packed")
    if world == 2:  # batch rows without cu_seqlens (every row one sequence): once is enough
        x2 = torch.randn(2, T, cfg.hidden_size, generator=g, dtype=torch.float64)
        _layer_case(kda, x2, None, errors, "kda B=2")
    # shards of 2 and 1 tokens, shorter than the conv window (W - 1 = 3): the window spans several earlier ranks
    xs = torch.randn(1, 2 * world - 1, cfg.hidden_size, generator=g, dtype=torch.float64)
    _layer_case(kda, xs, [0, 1, 2 * world - 1], errors, "kda short shards")

    torch.manual_seed(1)
    dsa = GatedMLA(cfg, 3).double()
    w_sc = torch.randn(1, T, T, generator=g, dtype=torch.float64)  # a loss on index_scores: indexer grads
    _layer_case(dsa, x, CU, errors, "dsa packed", aux_weight=w_sc)
    _layer_case(dsa, x, CU, errors, "dsa packed absorbed", form="absorbed")
    if world == 2:  # indexer RoPE at global positions: rank 1 starts inside the document [12, 40), at its 11th
        for style in ("half", "interleaved"):
            torch.manual_seed(3)
            dsa_rope = GatedMLA(cfg.replace(indexer_rope=style), 3).double()
            _layer_case(dsa_rope, x, CU, errors, f"dsa indexer_rope={style}", aux_weight=w_sc)
    if world == 4:  # ranks 1 and 2 carry a document in and start a new one: their summaries must not be affine
        _layer_case(kda, x, CU_CARRY_AND_START, errors, "kda carry-in and start")

    # the whole model: 5 layers of the tiny preset (KDA 0-2, DSA 3, KDA 4; dense then MoE; AttnRes writes 0, 4)
    torch.manual_seed(2)
    model = KimiK3Model(cfg.truncated(5)).double()
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    Rl = torch.randn(1, T, cfg.vocab_size, generator=g, dtype=torch.float64)
    logits_r = model(ids, torch.tensor(CU))
    (logits_r * Rl).sum().backward()
    ref = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    cp = ContextParallel(model)
    ids_l, cu_l = cp.shard(ids, torch.tensor(CU))
    logits = model(ids_l, cu_l)
    (logits * cp.shard_like(Rl)).sum().backward()
    _check("model logits", logits, cp.shard_like(logits_r), TOL["logits"], errors)
    for n, gsum in _grads_summed(model).items():
        _check(f"model {n}.grad", gsum, ref[n], TOL["param.grad"], errors)
    if errors:
        raise AssertionError(f"rank {rank}/{world}:\n" + "\n".join(errors))


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_one_rank(world):
    run_workers(_worker, world)
