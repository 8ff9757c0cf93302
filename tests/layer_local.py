"""Layer-local comparison of two models under routing and top-k replay, shared by the CPU and GPU FP8 tests (no test
lives here; importing it needs no GPU: ``from layer_local import ...``, ``tests/`` is on pytest's path).

A whole-model comparison of a random-init model compounds every layer's error through the next layers, and each
MoE router or DSA top-k pick that the error flips moves the output further than any rounding. Here instead:

1. :func:`record_layer_inputs` runs the reference model once (no gradients) and keeps, for every decoder layer, the
   inputs it received (the AttnRes blocks and the partial sum ``p``: ``KimiK3Model``'s aux ``input_blocks`` /
   ``input_p``), its MoE routing (``helpers.RouterTape``) and its DSA top-k selection (:class:`TopkTape`).
2. :func:`run_layer` runs one decoder layer on those inputs with that routing and selection replayed, and backward
   of a fixed random projection of its two outputs (``attn_out`` ``a`` and ``mlp_out`` ``m``: the layer's
   contributions, not ``p``, which carries its input along and would dilute them).
3. :func:`compare_models` does this for each layer of both models and returns the relative errors of ``a``, ``m``
   and every parameter gradient (:class:`LayerErrors`).

The replayed routing gives both runs the recorded expert ids **and weights**, so the router's weight gets no
gradient in either run (it is compared nowhere); the indexer gets none anyway (hard top-k).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from helpers import RouterTape, rel

OUTPUTS = ("attn_out", "mlp_out")

# FP8 rounding arithmetic. Rounding to e4m3 (3 mantissa bits) errs by at most half an ulp, 2^-4 of the binade's
# start; its RMS relative error over a log-uniform mantissa is 2^-3 / sqrt(12) * E[1/m^2]^(1/2) = 0.0361 * 0.736.
E4M3_CAST_RMS = 0.0266
# One FP8 GEMM against the exact product: both operands rounded, sqrt(2) * 0.0266 (test_fp8 measured 3.7%).
FP8_GEMM_REL = 2**0.5 * E4M3_CAST_RMS
# A converted layer against the same layer unconverted, on the same inputs, routing and top-k (tests/test_fp8.py,
# tests/gpu/test_gpu_fp8.py). Outputs: each FP8 GEMM in series adds at most its own error (no cancellation assumed):
# attn_out has at most 4 in series (MLA: q_a_proj -> q_b_proj -> attention -> o_proj with the g_proj gate); mlp_out
# adds its own (latent MoE: routed_expert_down_proj -> experts w1/w3 -> w2 -> routed_expert_up_proj, FP8 on the GPU)
# to the attention error it reads: 8 in all. Gradients (each layer's parameter gradients together, norm-weighted):
# the backward chain doubles the GEMMs and normalisations (KDA's l2-normed q / k, the RMSNorm and AttnRes weights)
# amplify rounding; measured under torchao's emulation (tiny, T = 120, seeds 0-3, both recipes, 2026-12-05):
# 0.22-0.52 per layer (every parameter alone: up to 0.89, where rounding the weights to bf16 already moves it 0.03).
# A gradient flushed to zero (FP8 casts without scales: the mutant of tests/test_fp8.py) gives 1.0.
FP8_LAYER_TOL = {"attn_out": 4 * FP8_GEMM_REL, "mlp_out": 8 * FP8_GEMM_REL, "grads": 0.7}


class TopkTape:
    """Records (``replay=None``) or replays (``replay=`` another tape's ``calls``) the DSA layers' top-k selection
    of ``model`` while active (``with tape:``), as ``helpers.RouterTape`` does for the MoE routing.

    * ``eager`` / ``sdpa`` layers: a forward hook on each ``kernels_torch.indexer.Indexer`` records its
      ``topk_indices`` ``[B, T, k]`` or returns the recorded ones (with the indexer's own scores);
    * ``cudnn`` layers (whose indexer module is never called: ``kernels_torch.dsa_cudnn.gated_mla_forward`` calls
      its ``projections`` and then ``indexer_topk_cudnn``): ``indexer_topk_cudnn`` is wrapped for the block, and its
      ``(topk_indices [N, k], topk_length [N])`` recorded or replaced.

    On replay, ``differ`` counts the query rows whose own selected set differs from the recorded one.
    """

    def __init__(self, model: torch.nn.Module, replay: list | None = None):
        from kernels_torch.indexer import Indexer
        from kernels_torch.mla import GatedMLA

        self.calls, self.replay, self.differ, self._next = [], replay, 0, 0
        self.indexers = [m for m in model.modules() if isinstance(m, Indexer)]
        self.cudnn = any(isinstance(m, GatedMLA) and m.backend == "cudnn" for m in model.modules())
        self._handles: list = []
        self._real = None

    def _take(self, mine: tuple) -> tuple:
        if self.replay is None:
            self.calls.append(tuple(t.clone() for t in mine))
            return mine
        if self._next >= len(self.replay):
            raise IndexError(f"TopkTape: top-k call {self._next + 1}, but the recording holds {len(self.replay)}")
        want = self.replay[self._next]
        self._next += 1
        if want[0].shape != mine[0].shape:
            raise ValueError(
                f"TopkTape: recorded top-k {tuple(want[0].shape)}, the layer picked {tuple(mine[0].shape)}"
            )
        a, b = (torch.sort(torch.where(t < 0, t.new_full((), 2**30), t), -1).values for t in (mine[0], want[0]))
        self.differ += int((a != b).any(-1).sum())
        return tuple(t.clone() for t in want)

    def _hook(self, module, args, out):
        topk, scores = out
        return self._take((topk,))[0], scores

    def __enter__(self) -> TopkTape:
        self._handles = [m.register_forward_hook(self._hook) for m in self.indexers]
        if self.cudnn:
            import kernels_torch.dsa_cudnn as dc

            self._real = real = dc.indexer_topk_cudnn
            dc.indexer_topk_cudnn = lambda *a, **k: self._take(real(*a, **k))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._real is not None:
            import kernels_torch.dsa_cudnn as dc

            dc.indexer_topk_cudnn, self._real = self._real, None

    def done(self) -> bool:
        return self.replay is not None and self._next == len(self.replay)


@dataclasses.dataclass
class LayerInputs:
    """What decoder layer ``i`` received in the reference run: ``blocks`` (the stored AttnRes blocks, ``[B, T, D]``
    each), ``p`` ``[B, T, D]``, and its routing (one ``RouterTape`` call, or None for a dense layer) and top-k (one
    ``TopkTape`` call, or None for a layer without an indexer); all detached."""

    blocks: tuple[torch.Tensor, ...]
    p: torch.Tensor
    routing: tuple | None
    topk: tuple | None


@torch.no_grad()
def record_layer_inputs(model, input_ids: torch.Tensor) -> list[LayerInputs]:
    """Run ``model`` (a ``kernels_torch.model.KimiK3Model``) once on ``input_ids`` ``[B, T]`` without gradients;
    return each decoder layer's :class:`LayerInputs`."""
    layers = model.model.layers
    routing, topk = RouterTape(model), TopkTape(model)
    with routing, topk:
        _, auxes = model(input_ids, return_aux=True)
    routing.remove()
    moe = [i for i, layer in enumerate(layers) if hasattr(layer, "block_sparse_moe")]
    dsa = [i for i, layer in enumerate(layers) if getattr(layer.self_attn, "kind", None) == "dsa"]
    if len(routing.calls) != len(moe) or len(topk.calls) != len(dsa):
        raise RuntimeError(
            f"record_layer_inputs: {len(routing.calls)} router calls for {len(moe)} MoE layers, {len(topk.calls)} "
            f"top-k calls for {len(dsa)} DSA layers"
        )
    by_moe, by_dsa = dict(zip(moe, routing.calls)), dict(zip(dsa, topk.calls))
    return [
        LayerInputs(
            blocks=tuple(b.detach().clone() for b in aux["input_blocks"]),
            p=aux["input_p"].detach().clone(),
            routing=by_moe.get(i),
            topk=by_dsa.get(i),
        )
        for i, aux in enumerate(auxes)
    ]


def output_grads(inputs: list[LayerInputs], seed: int, scale: float) -> list[dict[str, torch.Tensor]]:
    """A fixed random projection per layer and output: ``{attn_out, mlp_out}`` ``scale * N(0, 1)`` of ``p``'s shape,
    fp32 on ``p``'s device (CPU generator ``seed``); the backward of :func:`run_layer` starts from them."""
    g = torch.Generator().manual_seed(seed)
    return [{k: (scale * torch.randn(x.p.shape, generator=g)).to(x.p.device) for k in OUTPUTS} for x in inputs]


def run_layer(layer, inputs: LayerInputs, dy: dict[str, torch.Tensor]):
    """Layer ``layer`` (a ``DecoderLayer``) on ``inputs`` with their routing and top-k replayed, then backward of
    ``Σ_k <out_k, dy_k>`` over ``OUTPUTS``. Returns ``(outputs {attn_out, mlp_out} detached, {parameter name:
    gradient fp32}, flips)`` (the parameters that got one; ``flips``: the tokens whose own expert set and the query
    rows whose own top-k set differed from the replayed ones); the layer's gradients are cleared first and after.

    Raises:
        AssertionError: the layer did not consume exactly its recorded routing and top-k.
    """
    layer.zero_grad(set_to_none=True)
    routing = RouterTape(layer, replay=[inputs.routing]) if inputs.routing is not None else None
    topk = TopkTape(layer, replay=[inputs.topk] if inputs.topk is not None else [])
    with topk, routing if routing is not None else _null():
        _, _, aux = layer([b.clone() for b in inputs.blocks], inputs.p.clone())
    if routing is not None:
        routing.remove()
        assert routing.done(), "run_layer: the layer did not replay its routing"
    assert topk.done() or inputs.topk is None, "run_layer: the layer did not replay its top-k"
    flips = topk.differ + (sum(int(torch.isfinite(s).sum()) for s in routing.splits) if routing is not None else 0)
    outs = {k: aux[k] for k in OUTPUTS}
    loss = sum((outs[k].float() * dy[k]).sum() for k in OUTPUTS)
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in outs.items()}, grads, flips


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@dataclasses.dataclass
class LayerErrors:
    """One layer's relative errors (``helpers.rel``) against the reference: ``outputs`` ``{attn_out, mlp_out}``,
    ``grads`` ``{parameter name: error}`` (every parameter with a reference gradient; ``inf`` where the other run
    gave it none), ``all_grads`` (the layer's gradients concatenated: the norm-weighted error), and ``flips`` (what
    the replay overrode in the compared run: tokens routed otherwise, DSA rows selected otherwise)."""

    layer: int
    outputs: dict[str, float]
    grads: dict[str, float]
    all_grads: float
    flips: int


def compare_models(ref_model, model, inputs: list[LayerInputs], dys: list[dict]) -> list[LayerErrors]:
    """Each decoder layer of ``model`` against the same layer of ``ref_model``, both on the reference's recorded
    inputs, routing and top-k (:func:`run_layer`, backward from ``dys``)."""
    out = []
    for i, (ref_layer, layer) in enumerate(zip(ref_model.model.layers, model.model.layers, strict=True)):
        want_out, want_grad, _ = run_layer(ref_layer, inputs[i], dys[i])
        got_out, got_grad, flips = run_layer(layer, inputs[i], dys[i])
        grads = {n: rel(got_grad[n], g) if n in got_grad else math.inf for n, g in want_grad.items()}
        flat = [(got_grad.get(n, torch.zeros_like(g)).reshape(-1), g.reshape(-1)) for n, g in want_grad.items()]
        all_grads = rel(torch.cat([a for a, _ in flat]), torch.cat([b for _, b in flat]))
        outputs = {k: rel(got_out[k], want_out[k]) for k in OUTPUTS}
        out.append(LayerErrors(i, outputs, grads, all_grads, flips))
    return out


def failures(errors: list[LayerErrors], tol: dict[str, float]) -> list[str]:
    """``layer{i}.{kind} {error} > {tolerance}`` for each layer output (``tol[attn_out]``, ``tol[mlp_out]``) and each
    layer's gradients together (``tol[grads]``) over its tolerance; empty when all are within."""
    out = []
    for e in errors:
        for kind, err in (*e.outputs.items(), ("grads", e.all_grads)):
            if not err <= tol[kind]:
                out.append(f"layer{e.layer}.{kind} {err:.3e} > {tol[kind]:.2e}")
    return out


def report(test: str, errors: list[LayerErrors]) -> None:
    """Print every error as ``FP8_ERR {test} layer{i}.{name} {value}`` (outputs, ``grads``, each parameter) and the
    replay's overrides as ``FP8_ERR {test} layer{i}.flips {count}``."""
    for e in errors:
        for name, v in (*e.outputs.items(), ("grads", e.all_grads), *e.grads.items(), ("flips", e.flips)):
            print(
                f"FP8_ERR {test} layer{e.layer}.{name} {v:.3e}"
                if name != "flips"
                else f"FP8_ERR {test} layer{e.layer}.flips {v}"
            )


def worst(errors: list[LayerErrors], pick) -> tuple[float, str]:
    """The largest error over the layers and the name it belongs to (``layer{i}.{name}``); ``pick(e)`` gives one
    layer's ``{name: error}``."""
    items = [(v, f"layer{e.layer}.{n}") for e in errors for n, v in pick(e).items()]
    return max(items) if items else (0.0, "")


@contextlib.contextmanager
def fp8_scales_dropped():
    """A wrong FP8 recipe for the block: torchao's dense casts (``Float8Linear``: inputs, weights, output gradients)
    get scale 1 instead of ``max(e4m3) / amax``, so values are cast as they are: in range they round as before (a
    float format's relative precision does not depend on the scale), but gradients of a mean-token loss's size fall
    below e4m3's smallest subnormal (2^-9) and flush to zero."""
    import torchao.float8.float8_scaling_utils as su

    real = su.tensor_to_scale
    su.tensor_to_scale = lambda hp, *a, **k: torch.ones_like(real(hp, *a, **k))
    try:
        yield
    finally:
        su.tensor_to_scale = real


def assert_wrong_models_fail(ref_model, fp8_model, inputs: list[LayerInputs], dys: list[dict]) -> None:
    """The bounds must see two wrong models: the reference with every ``o_proj`` tripled (every layer's
    ``attn_out`` fails at least) and ``fp8_model`` with torchao's scales dropped (every layer's gradients flush to
    zero and fail)."""
    import copy

    n_layers = len(inputs)
    x3 = copy.deepcopy(ref_model)
    with torch.no_grad():
        for n, p in x3.named_parameters():
            if n.endswith("self_attn.o_proj.weight"):
                p.mul_(3.0)
    x3_errs = compare_models(ref_model, x3, inputs, dys)
    report("tiny_model_layer_local_o_proj_x3", x3_errs)
    assert len(failures(x3_errs, FP8_LAYER_TOL)) >= n_layers
    with fp8_scales_dropped():
        unscaled = compare_models(ref_model, fp8_model, inputs, dys)
    report("tiny_model_layer_local_scales_dropped", unscaled)
    assert len(failures(unscaled, FP8_LAYER_TOL)) >= n_layers
