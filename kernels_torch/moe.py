"""SiTU-GLU, the dense MLP, the router and the (latent) MoE: the PyTorch twin of ``reference_jax.moe`` (spec 5.1-5.3).

Same names, arguments and numerics as the reference:

* :func:`situ` / :func:`glu_act` compute in fp32 (fp64 for fp64 input) and cast back to the input dtype;
* :func:`route` runs the router in fp32 from the full-width x; the ``e_score_correction_bias`` chooses experts
  only; DeepSeek-V3 grouped top-k; ties go to the lower expert index (a stable descending sort, because
  ``torch.topk`` does not promise any order among equal values);
* :class:`KimiMoE` differs from the reference only in *how* it runs the experts (:class:`GroupedExperts`): each
  expert sees just the tokens routed to it, with each expert output rounded to the activation dtype, weighted by the
  fp32 router weight and summed in fp32, as the reference's dense loop. Two kernels (``kernels_torch.kernel_choice``,
  op ``moe``): ``loop``, one Python iteration per expert (gather, expert, weighted ``index_add_`` in expert order; the
  readable twin), and ``grouped_mm``, the pairs sorted by expert on the device and one ``torch._grouped_mm`` per
  projection over all experts (``kernels_torch.ops.moe_grouped``; no host sync; summed in slot order).

The routed experts are held **stacked**, one ``[E, out, in]`` parameter per projection (``experts.w1``, ``experts.w3``,
``experts.w2``), as grouped GEMMs, FSDP2 and DCP want them; slice ``e`` is the checkpoint's ``experts.{e}.w1.weight``
(``kimi.layout.stacked_expert_name``), and ``kernels_torch.model`` maps the per-expert checkpoint keys to the stacks
when it loads and back when it saves.

The MLP modules take the model's ``backend``: ``cudnn`` runs the activation as the fused, memory-lean
``kernels_torch.ops.situ.glu_act_fused`` (saves only a and b; Triton on CUDA), ``eager`` / ``sdpa`` the plain ops
below (the dense references). The choice is the plain attribute ``fused_glu`` (not in ``state_dict()``).

``state_dict()`` keys equal the names of ``kimi.layout.stacked_layout`` relative to ``mlp.`` / ``block_sparse_moe.``.
Note: ``gate.e_score_correction_bias`` is fp32 in the checkpoint; ``module.to(torch.bfloat16)`` would round it, so
cast the model with care (the router upcasts whatever it gets).
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from kernels_torch import kernel_choice
from kernels_torch.activations import glu_act, situ
from kernels_torch.common import RMSNorm, check_activation_dtype, compute_dtype
from kernels_torch.ops.custom import recompute_op
from kernels_torch.ops.moe_grouped import (
    combine_rows,
    expert_layout,
    grouped_mm,
    grouped_mm_supported,
    permute_rows,
    unpermute_rows,
)
from kernels_torch.ops.situ import glu_act_fused
from kimi.config import KimiConfig

__all__ = [
    "situ",
    "glu_act",
    "topk_ids",
    "route",
    "selection_scores",
    "DenseMLP",
    "experts_loop",
    "GroupedExperts",
    "MoEGate",
    "KimiMoE",
]


# ---------------------------------------------------------------------------------------------- router


def topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries along the last axis, best first; among equal scores the **lower** index
    first. ``scores [..., E]`` -> ``[..., k]`` int64. (A stable descending sort: ``torch.topk`` gives no tie order.)"""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def _group_mask(biased: torch.Tensor, config: KimiConfig, has_bias: bool) -> torch.Tensor:
    """DeepSeek-V3 grouped top-k: ``[N, E]`` bool, True for experts of the ``topk_group`` best groups; a group's
    score is the sum of its two best biased scores (its best score without a correction bias)."""
    N, E = biased.shape
    G = config.num_expert_group
    grouped = biased.reshape(N, G, E // G)  # [N, G, E/G]
    if has_bias:
        group_scores = torch.sort(grouped, dim=-1, descending=True).values[..., : min(2, E // G)].sum(-1)  # [N, G]
    else:
        group_scores = grouped.amax(-1)  # [N, G]
    keep = topk_ids(group_scores, config.topk_group)  # [N, topk_group]
    group_keep = torch.zeros(N, G, dtype=torch.bool, device=biased.device).scatter_(1, keep, True)  # [N, G]
    return group_keep.repeat_interleave(E // G, dim=-1)  # [N, E]


def _router_scores(x: torch.Tensor, gate_weight: torch.Tensor, config: KimiConfig) -> torch.Tensor:
    """``act(x_fp32 · W_fp32ᵀ)`` ``[..., E]``, act = sigmoid or softmax (``moe_router_activation_func``)."""
    cd = compute_dtype(x)
    logits = x.to(cd) @ gate_weight.to(cd).T
    if config.moe_router_activation_func == "sigmoid":
        return torch.sigmoid(logits)
    if config.moe_router_activation_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(
        f"moe_router_activation_func: got {config.moe_router_activation_func!r}, expected 'sigmoid' or 'softmax'"
    )


def selection_scores(
    x: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: torch.Tensor | None, config: KimiConfig
) -> torch.Tensor:
    """Twin of ``reference_jax.moe.selection_scores``: ``act(x W_gateᵀ) + bias`` ``[..., E]`` fp32."""
    scores = _router_scores(x, gate_weight, config)
    return scores if e_score_correction_bias is None else scores + e_score_correction_bias.to(scores.dtype)


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: torch.Tensor | None, config: KimiConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router (spec 5.3 steps 1-3); twin of ``reference_jax.moe.route``.

    ``logits = x_fp32 · W_fp32ᵀ``; ``s = sigmoid(logits)`` (or softmax); ``topk_ids = top-k(s + bias)`` within the
    best groups (DeepSeek-V3 ``noaux_tc``); ``w = s[topk_ids]``, ``w / (Σw + 1e-20)`` when ``moe_renormalize``,
    times ``routed_scaling_factor``.

    Args:
        x: ``[N, D]`` (or ``[..., D]``), the full-width router input.
        gate_weight: ``[E, D]``; e_score_correction_bias: ``[E]`` (fp32) or ``None``.

    Returns:
        ``(topk_ids [..., k] int64, topk_weights [..., k] fp32 (fp64 for fp64 x))``; ties: lower expert first.

    Raises:
        ValueError: shapes disagree, or grouping leaves fewer than k experts.
    """
    E, D = gate_weight.shape
    k = config.num_experts_per_token
    if x.shape[-1] != D:
        raise ValueError(
            f"route: x has width {x.shape[-1]}, gate.weight is {tuple(gate_weight.shape)}; expected [E, {x.shape[-1]}]"
        )
    if e_score_correction_bias is not None and tuple(e_score_correction_bias.shape) != (E,):
        raise ValueError(
            f"route: e_score_correction_bias has shape {tuple(e_score_correction_bias.shape)}, expected ({E},)"
        )
    if not 1 <= k <= E:
        raise ValueError(f"route: num_experts_per_token={k}, expected an integer in [1, {E}]")
    lead = x.shape[:-1]
    cd = compute_dtype(x)
    scores = _router_scores(x.reshape(-1, D), gate_weight, config)  # [N, E], fp32 router
    biased = scores if e_score_correction_bias is None else scores + e_score_correction_bias.to(cd)  # selection only
    if config.use_grouped_topk:
        G = config.num_expert_group
        if E % G or not 1 <= config.topk_group <= G or config.topk_group * (E // G) < k:
            raise ValueError(
                f"route: grouping num_experts={E}, num_expert_group={G}, topk_group={config.topk_group} "
                f"expected G | E, 1 <= topk_group <= G and topk_group*E/G >= k={k}"
            )
        mask = _group_mask(biased, config, e_score_correction_bias is not None)
        biased = biased.masked_fill(~mask, float("-inf"))
    ids = topk_ids(biased, k)  # [N, k]

    weights = scores.gather(-1, ids)  # [N, k], uncorrected scores
    if config.moe_renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * config.routed_scaling_factor
    return ids.reshape(*lead, k), weights.reshape(*lead, k)


# ---------------------------------------------------------------------------------------------- modules


def _glu(a: torch.Tensor, b: torch.Tensor, config, fused: bool) -> torch.Tensor:
    """The GLU activation: fused (``cudnn`` backend) or the plain ops (``eager`` / ``sdpa``)."""
    return glu_act_fused(a, b, config) if fused else glu_act(a, b, config)


def _act(module: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The module's GLU activation (:func:`_glu` with its config and ``fused_glu``)."""
    return _glu(a, b, module.config, module.fused_glu)


def _expert_mlp(x, w1, w3, w2, config, fused: bool) -> torch.Tensor:
    """One expert on rows ``x`` ``[n, Dl]``: ``w2 · act(w1 x, w3 x)`` ``[n, Dl]`` in ``x.dtype``; ``w1``, ``w3``
    ``[I, Dl]``, ``w2`` ``[Dl, I]``."""
    return F.linear(_glu(F.linear(x, w1), F.linear(x, w3), config, fused), w2)


class DenseMLP(nn.Module):
    """GLU MLP ``down_proj(act(gate_proj(x), up_proj(x)))`` (spec 5.2): layer-0 ``mlp`` and ``shared_experts``.

    Params ``gate_proj.weight`` / ``up_proj.weight`` ``[I, D]``, ``down_proj.weight`` ``[D, I]``.
    x ``[B, T, D]`` -> ``[B, T, D]`` (x and the weights in one dtype; the activation runs in fp32).
    ``backend='cudnn'`` sets ``fused_glu`` (the fused activation); other backends run the plain ops.
    """

    def __init__(self, config: KimiConfig, intermediate_size: int, backend: str = "eager"):
        super().__init__()
        self.config = config
        self.fused_glu = backend == "cudnn"
        D, I = config.hidden_size, intermediate_size
        self.gate_proj = nn.Linear(D, I, bias=False)
        self.up_proj = nn.Linear(D, I, bias=False)
        self.down_proj = nn.Linear(I, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_activation_dtype(x, "DenseMLP")
        return self.down_proj(_act(self, self.gate_proj(x), self.up_proj(x)))


def experts_loop(
    z: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    config: KimiConfig,
    fused: bool = False,
) -> torch.Tensor:
    """The ``loop`` kernel of :class:`GroupedExperts`: ``r = sum_k w_k · E_{ids_k}(z)``, one Python iteration per
    expert over the tokens routed to it (a host sync per expert), summed in expert order.

    ``z`` ``[N, Dl]``; ``ids`` ``[N, k]`` int64 in ``[0, E)``; ``weights`` ``[N, k]`` fp32; ``stacks`` ``(w1, w3,
    w2)``, ``[E, I, Dl]``, ``[E, I, Dl]``, ``[E, Dl, I]``; ``config`` gives the activation (``hidden_act`` and the
    SiTU betas); ``fused``: the fused activation (``kernels_torch.ops.situ``). Returns ``[N, Dl]`` fp32 (fp64 for
    fp64 z): each expert output rounded to z's dtype, weighted by the fp32 router weight. Under ``torch.compile``
    :class:`GroupedExperts` runs it as the op ``kimi::experts_loop`` (``kernels_torch.ops.custom``)."""
    w1, w3, w2 = (w.unbind(0) for w in stacks)  # unbound once per call: GroupedExperts.per_expert says why
    r = torch.zeros(z.shape, dtype=compute_dtype(z), device=z.device)  # [N, Dl]
    for e in range(len(w1)):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)  # tokens routed to e, and the rank it holds there
        if tok.numel() == 0:
            continue
        out = _expert_mlp(z[tok], w1[e], w3[e], w2[e], config, fused)  # [n, Dl] in z's dtype
        r.index_add_(0, tok, out.to(r.dtype) * weights[tok, slot, None].to(r.dtype))
    return r


def _experts_loop_flat(z, ids, weights, w1, w3, w2, hidden_act, beta, linear_beta, fused):
    """:func:`experts_loop` with the stacks and the activation's config fields as separate arguments."""
    act = types.SimpleNamespace(
        hidden_act=hidden_act, activation_situ_beta=beta, activation_situ_linear_beta=linear_beta
    )
    return experts_loop(z, ids, weights, (w1, w3, w2), act, fused)


# experts_loop as one op for torch.compile (kernels_torch.ops.custom): torch.nonzero gives each expert a
# data-dependent row count; the backward recomputes the loop under autograd
_experts_loop_op = recompute_op(
    "kimi::experts_loop",
    _experts_loop_flat,
    "(Tensor z, Tensor ids, Tensor weights, Tensor w1, Tensor w3, Tensor w2, str hidden_act, float beta, "
    "float? linear_beta, bool fused) -> Tensor",
    lambda z, *_: z.new_empty(z.shape, dtype=compute_dtype(z)),
)


class GroupedExperts(nn.Module):
    """The routed experts of one MoE layer (spec 5.3 step 5), each projection stacked over experts:
    ``E_e(z) = w2[e] · act(w1[e] z, w3[e] z)``.

    Parameters (``nn.Linear`` orientation ``[out, in]`` per expert, slice ``e`` = the checkpoint's
    ``experts.{e}.w*.weight``): ``w1`` ``[E, I, Dl]`` (gate), ``w3`` ``[E, I, Dl]`` (up), ``w2`` ``[E, Dl, I]`` (down);
    ``Dl`` the latent width (or D), ``I`` = ``moe_intermediate_size``. Under expert parallelism a rank holds only its
    experts: ``expert_ids`` is the ``range`` of global ids its rows stand for (``range(E)`` otherwise).

    Attributes (plain, not in ``state_dict()``):
        moe_kernel: ``"auto"`` | ``"grouped_mm"`` | ``"loop"`` or None (``$KIMI_MOE_KERNEL``, else auto); see
            ``kernels_torch.kernel_choice``. ``auto`` is ``grouped_mm`` on the ``cudnn`` backend where
            ``torch._grouped_mm`` takes the dtype and widths, else ``loop``.
        fused_glu: the fused activation (``cudnn`` backend). align: rows per group start of the grouped buffer
            (1; FP8 grouped GEMMs want 16).
    """

    def __init__(self, config: KimiConfig, hidden_size: int, backend: str = "eager", num_experts: int | None = None):
        super().__init__()
        self.config = config
        self.backend = backend
        self.fused_glu = backend == "cudnn"
        self.moe_kernel: str | None = None
        self.align = 1
        E = config.num_experts if num_experts is None else num_experts
        I, Dl = config.moe_intermediate_size, hidden_size
        self.expert_ids = range(E)
        self.w1 = nn.Parameter(torch.empty(E, I, Dl))
        self.w3 = nn.Parameter(torch.empty(E, I, Dl))
        self.w2 = nn.Parameter(torch.empty(E, Dl, I))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init per expert: U(-1/sqrt(in), 1/sqrt(in))."""
        with torch.no_grad():
            for w in (self.w1, self.w3, self.w2):
                if w.device.type != "meta":
                    bound = 1.0 / math.sqrt(w.shape[-1])
                    w.uniform_(-bound, bound)

    @property
    def num_experts(self) -> int:
        """Experts held here (all of the layer's, or this rank's under expert parallelism)."""
        return len(self.expert_ids)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w1, w3, w2)`` as plain tensors of this rank's experts: under expert parallelism the stacks are
        DTensors (``Shard(0)`` over the ``ep`` mesh; ``kernels_torch.parallel.expert``) and this is their local
        ``[E / ep, ...]`` part (``DTensor.to_local``: differentiable, the gradient goes back as a DTensor)."""
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2))

    def kernel(self, z: torch.Tensor) -> str:
        """The kernel this call runs (``"grouped_mm"`` or ``"loop"``), from :attr:`moe_kernel` and the inputs.

        Raises:
            ValueError: a bad ``moe_kernel`` / ``$KIMI_MOE_KERNEL``, or ``grouped_mm`` forced where it cannot run."""
        chosen = kernel_choice.resolve("moe", self.moe_kernel)
        if chosen == "loop":
            return "loop"
        why = grouped_mm_supported(z, self.local_weights()[0])
        if chosen == "grouped_mm":
            if why is not None:
                raise ValueError(f"moe_kernel='grouped_mm' cannot run: {why}")
            return "grouped_mm"
        return "grouped_mm" if self.backend == "cudnn" and why is None else "loop"

    def mlp_grouped(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Every expert on its group of rows: ``x`` ``[R, Dl]`` grouped by expert, ``offsets`` ``[E]`` int32
        cumulative row ends -> ``[R, Dl]`` in ``x.dtype`` (three ``torch._grouped_mm`` and the activation)."""
        w1, w3, w2 = self.local_weights()
        h = grouped_mm(x, w1, offsets, kernel="grouped_mm")  # [R, I]
        g = grouped_mm(x, w3, offsets, kernel="grouped_mm")
        return grouped_mm(_act(self, h, g), w2, offsets, kernel="grouped_mm")  # [R, Dl]

    def expert(self, e: int, x: torch.Tensor, weights: tuple | None = None) -> torch.Tensor:
        """Local expert ``e`` on rows ``x`` ``[n, Dl]`` -> ``[n, Dl]`` in ``x.dtype`` (the loop's body).
        ``weights``: the stacks already split by :meth:`per_expert` (one backward node for all experts)."""
        w1, w3, w2 = (w[e] for w in (self.local_weights() if weights is None else weights))
        return _expert_mlp(x, w1, w3, w2, self.config, self.fused_glu)

    def per_expert(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """``(w1, w3, w2)``, each stack unbound into its experts' ``[out, in]`` views. The loop takes these once per call:
        indexing ``w1[e]`` in each iteration would give every expert a backward that writes a whole-stack gradient
        (E of them: 13 s for 448 real-size experts on an H200), where unbinding stacks the slices' gradients once."""
        return tuple(w.unbind(0) for w in self.local_weights())

    def forward(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``r = sum_k w_k · E_{ids_k}(z)`` (spec 5.3 steps 4-6): each expert output in z's dtype, weighted and summed
        in fp32 (fp64 for fp64 z); ``loop`` sums in expert order, ``grouped_mm`` in slot order.

        ``z`` ``[N, Dl]``, ``ids`` ``[N, k]`` int64 local expert ids in ``[0, num_experts)``, ``weights`` ``[N, k]``
        fp32 -> ``[N, Dl]`` fp32 (fp64). Records the kernel that ran (``kernel_choice.used()``, op ``moe``)."""
        run = self.kernel(z)
        kernel_choice.record("moe", run)
        if run == "grouped_mm":
            layout = expert_layout(ids, self.num_experts, self.align)
            y = self.mlp_grouped(permute_rows(z, layout), layout.offsets)  # [R, Dl] in z's dtype
            return combine_rows(y, weights, layout)
        if torch.compiler.is_compiling():  # a data-dependent row count per expert: one op for the compiler
            c = self.config
            act = (c.hidden_act, float(c.activation_situ_beta), c.activation_situ_linear_beta, self.fused_glu)
            return _experts_loop_op(z, ids, weights, *self.local_weights(), *act)
        return experts_loop(z, ids, weights, self.local_weights(), self.config, self.fused_glu)

    def rows_forward(self, x: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """Each row through its own expert, no weighting: ``x`` ``[R, Dl]``, ``expert_of_row`` ``[R]`` int64 local
        ids -> ``[R, Dl]`` in ``x.dtype``, row order kept (expert parallelism's received rows)."""
        if x.shape[0] == 0:  # no row: still a (zero) gradient for every local stack, as on the ranks that received
            # rows (FSDP2 reduce-scatters the expert stacks over the ranks that hold the same experts: same gradients)
            return x * 0 + sum(w.sum() for w in self.local_weights()).to(x.dtype) * 0
        run = self.kernel(x)
        kernel_choice.record("moe", run)
        if run == "grouped_mm":
            layout = expert_layout(expert_of_row[:, None], self.num_experts, self.align)
            return unpermute_rows(self.mlp_grouped(permute_rows(x, layout), layout.offsets), layout)
        out = x * 0  # [R, Dl], downstream of x even with no row at all (expert parallelism's backward all-to-all)
        ws = self.per_expert()
        for e in range(self.num_experts):
            (rows,) = torch.nonzero(expert_of_row == e, as_tuple=True)
            if rows.numel():
                out = out.index_copy(0, rows, self.expert(e, x[rows], ws))
        return out


class MoEGate(nn.Module):
    """Router parameters ``weight`` ``[E, D]`` and ``e_score_correction_bias`` ``[E]`` (fp32, frozen: no gradient);
    calling it runs :func:`route`."""

    def __init__(self, config: KimiConfig):
        super().__init__()
        self.config = config
        E, D = config.num_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(E, D).normal_(0.0, D**-0.5))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.weight, self.e_score_correction_bias, self.config)


class KimiMoE(nn.Module):
    """The (latent) MoE layer ``block_sparse_moe`` (spec 5.3 steps 1-9); twin of ``reference_jax.moe.KimiMoE``.

    Submodules (checkpoint names): ``gate``, ``experts`` (:class:`GroupedExperts`, stacked ``w1``/``w3``/``w2``),
    ``routed_expert_down_proj`` / ``routed_expert_norm`` (only with ``latent_moe_use_norm``) /
    ``routed_expert_up_proj`` (latent MoE only), ``shared_experts`` (absent when ``num_shared_experts == 0``).

    ``forward(x, return_aux=False)``: x ``[B, T, D]`` -> ``[B, T, D]`` in x's dtype (and, with ``return_aux``,
    ``{"expert_ids", "expert_scores"}`` as the JAX twin). ``backend='cudnn'`` gives the experts and shared experts
    the fused activation (``fused_glu``) and the grouped experts (``experts.moe_kernel``).

    ``routed_and_shared`` (a plain attribute, None by default): a callable ``(x, z, ids, weights) -> (r [N, Dl],
    shared [B, T, D] or None)`` that replaces the routed-expert step and the shared experts together, set by
    expert parallelism's overlap (``kernels_torch.parallel.expert``: the shared experts run while the last combine
    travels); the numbers are those of :meth:`routed_experts` and ``shared_experts``.
    """

    def __init__(self, config: KimiConfig, backend: str = "eager"):
        super().__init__()
        c = self.config = config
        D = c.hidden_size
        Dl = c.routed_expert_hidden_size or D
        self.gate = MoEGate(c)
        self.experts = GroupedExperts(c, Dl, backend)
        if c.has_latent_moe:
            self.routed_expert_down_proj = nn.Linear(D, Dl, bias=False)
            if c.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(Dl, c.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(Dl, D, bias=False)
        if c.num_shared_experts:
            self.shared_experts = DenseMLP(c, c.num_shared_experts * c.moe_intermediate_size, backend)
        self.routed_and_shared = None

    def routed_experts(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``r = Σ_k w_k · E_{ids_k}(z)`` (spec 5.3 steps 4-6) through :class:`GroupedExperts`: ``z`` ``[N, Dl]``,
        ``ids`` ``[N, k]`` int64, ``weights`` ``[N, k]`` fp32 -> ``[N, Dl]`` fp32 (fp64 for fp64 z).
        ``kernels_torch.parallel.expert`` replaces this method on the instance (expert parallelism)."""
        return self.experts(z, ids, weights)

    def forward(self, x: torch.Tensor, return_aux: bool = False):
        c = self.config
        check_activation_dtype(x, "KimiMoE")
        if x.ndim != 3 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"KimiMoE: x has shape {tuple(x.shape)}, expected [B, T, {c.hidden_size}]")
        B, T, D = x.shape
        xf = x.reshape(B * T, D)  # [N, D]
        ids, weights = self.gate(xf)  # [N, k], [N, k] fp32 -- router on the full-width x
        z = self.routed_expert_down_proj(xf) if c.has_latent_moe else xf  # [N, Dl]
        if self.routed_and_shared is None:
            r, shared = self.routed_experts(z, ids, weights), None
        else:  # expert parallelism's overlap: the shared experts computed inside, beside the all-to-alls
            r, shared = self.routed_and_shared(x, z, ids, weights)
        r = r.to(x.dtype).reshape(B, T, -1)  # [B, T, Dl]

        # [B, T, ...] from here: the output is then a fresh tensor, not a view (FSDP2 warns of a wrapped layer that
        # returns a view: an in-place op on it would skip the pre-backward all-gather)
        if c.has_latent_moe:  # norm after the combine, then back up to D
            if c.latent_moe_use_norm:
                r = self.routed_expert_norm(r)
            r = self.routed_expert_up_proj(r)  # [B, T, D]
        if c.num_shared_experts:  # shared experts on the un-projected x
            r = r + (self.shared_experts(x) if shared is None else shared)
        if r._base is not None:  # neither latent projection nor shared experts: r is a view of the combine
            r = r.clone()
        if not return_aux:
            return r
        sel = selection_scores(x, self.gate.weight, self.gate.e_score_correction_bias, c)
        return r, {"expert_ids": ids.reshape(B, T, -1), "expert_scores": sel}
