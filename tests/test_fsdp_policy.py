"""The FSDP2 policy of ``kernels_torch.parallel.fsdp.apply_fsdp``: which units reshard after their forward
(``reshard_after_forward``), the input embedding as a unit of its own, the gradient divide factor on a one-rank mesh
(a plain copy, then an in-place division), ``reshard`` after a forward-only pass, ``master_dtype``, and
``--reduce-dtype``, and the one-rank layout left unwrapped where FSDP2 would only copy. Gloo ranks spawned by the
test, the tiny preset in fp64 (bf16 for the masters and one-rank cases)."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_workers
from helpers import rel

from kimi.config import load_config

TOL = {"loss": 1e-12, "grad": 1e-10}
TOL_ONE_RANK_GRAD = 2**-7  # bf16 gradients summed in another order: about one bf16 rounding (2**-8) apart


def _model(tied: bool = False, dtype=torch.float64):
    from kernels_torch.model import KimiK3Model

    cfg = load_config("tiny").truncated(4).replace(tie_word_embeddings=tied)
    torch.manual_seed(0)
    return KimiK3Model(cfg).to(dtype), cfg


def _ids(cfg, T: int = 33, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, T + 1), generator=g)
    return ids[:, :T], ids[:, 1:]


def test_reshard_policy_values_and_refusal():
    from kernels_torch.parallel.fsdp import RESHARD_POLICIES, _reshard_policy

    class Mesh:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    for mesh in (Mesh(1), Mesh(4)):
        assert _reshard_policy("auto")(mesh, False) and not _reshard_policy("auto")(mesh, True)
        assert _reshard_policy("always")(mesh, True) and _reshard_policy(True)(mesh, True)
        assert not _reshard_policy("never")(mesh, False) and not _reshard_policy(False)(mesh, False)
    assert RESHARD_POLICIES == ("auto", "always", "never")
    with pytest.raises(ValueError, match=r"reshard_after_forward: got 'sometimes', expected a bool or one of"):
        _reshard_policy("sometimes")


def test_own_embedding_only_when_untied():
    from kernels_torch.parallel.fsdp import _own_embedding

    untied, _ = _model(tied=False)
    assert _own_embedding(untied) is untied.model.embed_tokens
    tied, _ = _model(tied=True)
    assert not hasattr(tied, "lm_head")  # the LM head reads the embedding's weight
    assert _own_embedding(tied) is None


def _policy_worker(rank: int, world: int, factor: float) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from kernels_torch.parallel.fsdp import init_mesh, reshard
    from kernels_torch.parallel.parallelize import ParallelPolicy, parallelize

    model, cfg = _model()
    ids, labels = _ids(cfg)
    ref, _ = _model()
    loss_r = ref.loss(ids, labels) / labels.numel()
    loss_r.backward()

    # FSDP2 forced at one rank too (this test measures its one-rank reduce; unforced, parallelize leaves it out)
    policy = ParallelPolicy(gradient_divide_factor=factor, shard_one_rank=True)
    assert parallelize(model, init_mesh(dp=world), policy).sharded
    layers = list(model.model.layers)
    assert isinstance(model.model.embed_tokens, FSDPModule), "the untied embedding is a unit of its own"

    # a forward without backward: "auto" leaves the last layer and the root gathered, reshards the others
    with torch.no_grad():
        model.loss(ids, labels)
    assert all(isinstance(p, DTensor) for p in layers[0].parameters()), "layer 0 resharded after its forward"
    gathered = [p for p in layers[-1].parameters() if not isinstance(p, DTensor)]
    assert gathered, "the last layer keeps its gathered parameters (auto)"
    reshard(model)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "reshard frees every unit"

    # every rank the same batch: the reduce sums world copies of the gradient, divided by factor
    loss = model.loss(ids, labels) / labels.numel()
    loss.backward()
    assert rel(loss.detach(), loss_r.detach()) < TOL["loss"]
    want = {n: p.grad * (world / factor) for n, p in ref.named_parameters() if p.grad is not None}
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    bad = {n: rel(got[n], want[n]) for n in want if rel(got[n], want[n]) > TOL["grad"]}
    assert not bad, bad


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "factor"), [(1, 1.0), (1, 4.0), (2, 1.0), (2, 2.0)], ids=lambda v: str(v))
def test_fsdp_policy_gradients_and_reshard(world, factor):
    """One rank (the plain-copy reduce, and the in-place division by a factor) and two (gloo's forced sum) give the
    single-process gradient times world / factor; the auto policy keeps the last layer gathered after a forward
    until ``reshard``."""
    run_workers(_policy_worker, world, factor)


def _masters_worker(rank: int, world: int) -> None:
    from kernels_torch.parallel.fsdp import fp32_compute_params, init_mesh
    from kernels_torch.parallel.parallelize import ParallelPolicy, parallelize

    model, cfg = _model(dtype=torch.float32)
    from kernels_torch.model import cast_model

    model = cast_model(model, torch.bfloat16)
    ignored = set(fp32_compute_params(model, torch.bfloat16))
    policy = ParallelPolicy(param_dtype=torch.bfloat16, master_dtype=None)
    parallelize(model, init_mesh(dp=world), policy, ignored_params=ignored)
    low = [p for p in model.parameters() if p not in ignored]
    assert low and all(p.dtype == torch.bfloat16 for p in low), "master_dtype=None keeps bf16 shards"
    ids, labels = _ids(cfg)
    (model.loss(ids, labels) / labels.numel()).backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in low if p.grad is not None)


@pytest.mark.distributed
def test_bf16_masters_keep_bf16_shards_and_gradients():
    run_workers(_masters_worker, 2)


def _bf16_model():
    from kernels_torch.model import cast_model
    from kernels_torch.parallel.fsdp import fp32_compute_params

    model, cfg = _model(dtype=torch.float32)
    model = cast_model(model, torch.bfloat16)
    return model, cfg, set(fp32_compute_params(model, torch.bfloat16))


def test_fsdp_only_copies_on_one_rank_without_masters():
    """FSDP2 is left out only where it would copy and nothing else: one rank, no fp32 masters, no offload, no
    divide factor, a reduce no narrower than the parameters; forced by ``shard_one_rank``."""
    from types import SimpleNamespace

    from kernels_torch.parallel.mesh import ParallelDims
    from kernels_torch.parallel.parallelize import ParallelPolicy, fsdp_only_copies

    model, _, ignored = _bf16_model()
    one, two = (SimpleNamespace(dims=ParallelDims.fill(w)) for w in (1, 2))
    bf16 = dict(param_dtype=torch.bfloat16, master_dtype=None, gradient_divide_factor=1.0)
    assert fsdp_only_copies(model, one, ParallelPolicy(**bf16, reduce_dtype=torch.bfloat16), ignored)
    assert fsdp_only_copies(model, one, ParallelPolicy(**bf16, reduce_dtype=torch.float32), ignored)
    kept = {
        "two ranks": (two, ParallelPolicy(**bf16)),
        "fp32 masters": (one, ParallelPolicy(**bf16 | {"master_dtype": torch.float32})),
        "offload": (one, ParallelPolicy(**bf16, offload="cpu")),
        "divide factor": (one, ParallelPolicy(**bf16 | {"gradient_divide_factor": 2.0})),
        "forced": (one, ParallelPolicy(**bf16, shard_one_rank=True)),
    }
    for why, (mesh, policy) in kept.items():
        assert not fsdp_only_copies(model, mesh, policy, ignored), why
    assert not fsdp_only_copies(model, one, ParallelPolicy(**bf16, reduce_dtype=torch.float16), ignored)  # rounds
    fp32_model, _ = _model(dtype=torch.float32)  # a bf16 reduce would round its fp32 gradients
    assert not fsdp_only_copies(fp32_model, one, ParallelPolicy(reduce_dtype=torch.bfloat16))
    assert fsdp_only_copies(fp32_model, one, ParallelPolicy(reduce_dtype=torch.float32, gradient_divide_factor=1.0))
    fp64_model, _ = _model()  # apply_fsdp reduces an fp64 model in fp64 whatever the policy says: a copy
    assert fsdp_only_copies(fp64_model, one, ParallelPolicy(reduce_dtype=torch.float32, gradient_divide_factor=1.0))
    from kernels_torch.parallel.parallelize import parallelize

    with pytest.raises(ValueError, match="shard_one_rank: got True without a mesh"):  # one process: no FSDP2 to force
        parallelize(model, None, ParallelPolicy(shard_one_rank=True))


def _one_rank_worker(rank: int, world: int) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from kernels_torch.parallel.fsdp import init_mesh
    from kernels_torch.parallel.parallelize import ParallelPolicy, parallelize

    mesh = init_mesh(dp=1)
    full = lambda g: g.full_tensor() if isinstance(g, DTensor) else g  # noqa: E731
    for reduce in (torch.bfloat16, torch.float32):  # kimi train's --reduce-dtype bf16 and fp32 (its default)
        policy = dict(param_dtype=torch.bfloat16, master_dtype=None, reduce_dtype=reduce, gradient_divide_factor=1.0)
        grads, losses = {}, {}
        for forced in (False, True):
            model, cfg, ignored = _bf16_model()
            before = dict(model.named_parameters())
            done = parallelize(model, mesh, ParallelPolicy(**policy, shard_one_rank=forced), ignored_params=ignored)
            assert done.sharded == forced
            assert any(isinstance(m, FSDPModule) for m in model.modules()) == forced
            if not forced:  # the model as it was: the same parameter objects
                assert dict(model.named_parameters()) == before
            losses[forced] = []
            for seed in (1, 2):  # two micro-batches, their gradients accumulated
                ids, labels = _ids(cfg, seed=seed)
                loss = model.loss(ids, labels) / labels.numel()
                loss.backward()
                losses[forced].append(loss.detach().float())
            grads[forced] = {n: full(p.grad).float() for n, p in model.named_parameters() if p.grad is not None}
        # FSDP2 at one rank computes the same: its gathers and reduce are copies (bf16 gradients through a bf16 or
        # fp32 reduce); a gradient summed from several uses (the embedding's) or over the micro-batches is summed in
        # another order or precision there: about one bf16 rounding apart
        assert all(rel(a, b) == 0.0 for a, b in zip(losses[False], losses[True])), losses
        assert set(grads[False]) == set(grads[True])
        bad = {n: rel(grads[False][n], grads[True][n]) for n in grads[True]}
        bad = {n: e for n, e in bad.items() if e > TOL_ONE_RANK_GRAD}
        assert not bad, (reduce, bad)


@pytest.mark.distributed
def test_one_rank_without_masters_runs_the_model_as_it_is():
    """On one rank with bf16 parameters stepped as they are (no masters), ``parallelize`` leaves the model
    unwrapped (the same parameters); over two micro-batches, with a bf16 and an fp32 reduce, its losses equal
    FSDP2's forced over that rank bit for bit and its gradients within ``TOL_ONE_RANK_GRAD``."""
    run_workers(_one_rank_worker, 1)
