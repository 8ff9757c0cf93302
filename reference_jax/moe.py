"""SiTU-GLU, the dense MLP, the router and the (latent) MoE: the JAX reference (spec 5.1-5.3).

What is notable:

* **SiTU** (spec 5.1) is SiLU with the pre-sigmoid factor soft-capped to (-beta, beta), times the up branch
  soft-capped to (-linear_beta, linear_beta); it is computed in fp32 (fp64 for fp64 input) and cast back.
  ``hidden_act='silu'`` (Kimi-Linear) gives the plain SiLU-GLU ``silu(a) * b``, also computed in fp32.
* **Router** (spec 5.3 steps 1-3): logits in fp32 from the *full-width* x, sigmoid (or softmax) scores; the
  ``e_score_correction_bias`` only chooses the experts, the weights are the *uncorrected* scores. Grouped top-k as
  DeepSeek-V3 (``noaux_tc``): a group scores the sum of its two best biased scores, the best ``topk_group`` groups
  survive; with K3's single group this is a no-op. Ties: the lower expert (group) index first.
* **Latent MoE** (spec 5.3 steps 4-9): experts run on ``z = routed_expert_down_proj(x)``; each expert output is
  rounded to the activation dtype, weighted by the fp32 router weight and summed in fp32 (AutoModel
  ``apply_router_weight_after_down``), in expert order; the RMSNorm comes **after** the combine, then the
  up-projection; the shared experts read the un-projected x. ``routed_expert_hidden_size=None`` is the standard
  (Kimi-Linear) MoE: experts on x directly, no down/norm/up.
* This is the oracle: every expert runs on every token (a dense loop) and the unselected ones get weight 0. No
  capacity, no token dropping, no jit.

Axis letters: ``B`` batch, ``T`` tokens, ``D`` model width, ``E`` experts, ``N`` flattened tokens, ``k`` experts
per token.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kimi.config import KimiConfig
from reference_jax.common import Linear, RMSNorm, check_activation_dtype, compute_dtype

__all__ = ["situ", "glu_act", "topk_ids", "route", "selection_scores", "DenseMLP", "RoutedExpert", "MoEGate", "KimiMoE"]


# ---------------------------------------------------------------------------------------------- activations


def situ(a: jax.Array, b: jax.Array, beta: float = 4.0, linear_beta: float | None = 25.0) -> jax.Array:
    """SiTU-GLU (spec 5.1): ``[beta·tanh(a/beta)·sigmoid(a)] · [linear_beta·tanh(b/linear_beta)]``.

    Args:
        a: gate pre-activations ``[..., I]`` (any float dtype).
        b: up pre-activations, same shape as ``a``.
        beta: gate soft-cap (``activation_situ_beta``, 4.0 for K3); the gate factor lies in (-beta, beta).
        linear_beta: up soft-cap (``activation_situ_linear_beta``, 25.0 for K3); ``None`` uses plain ``b``
            (AutoModel's rule; llama.cpp's "<= 0" is spelled ``None`` here).

    Returns:
        ``[..., I]`` in ``a.dtype``; the math runs in fp32 (fp64 for fp64 input) with one rounding at the end.

    Raises:
        ValueError: ``a``/``b`` shapes differ, ``beta <= 0`` or ``linear_beta <= 0``.
    """
    if a.shape != b.shape:
        raise ValueError(f"situ: a has shape {a.shape} and b {b.shape}, expected equal shapes")
    if not beta > 0:
        raise ValueError(f"situ: beta got {beta!r}, expected a positive number (activation_situ_beta)")
    if linear_beta is not None and not linear_beta > 0:
        raise ValueError(f"situ: linear_beta got {linear_beta!r}, expected a positive number or None")
    cd = compute_dtype(a, b)
    af, bf = a.astype(cd), b.astype(cd)
    gate = beta * jnp.tanh(af / beta) * jax.nn.sigmoid(af)  # SiLU with x soft-capped to (-beta, beta)
    up = bf if linear_beta is None else linear_beta * jnp.tanh(bf / linear_beta)
    return (gate * up).astype(a.dtype)


def glu_act(a: jax.Array, b: jax.Array, config: KimiConfig) -> jax.Array:
    """The GLU activation of ``config.hidden_act``: SiTU (K3, :func:`situ` with the config's betas) or SiLU-GLU
    ``silu(a) * b`` (Kimi-Linear). Shapes as :func:`situ`; fp32 math, result in ``a.dtype``.

    Raises:
        ValueError: an unknown ``hidden_act`` (or the errors of :func:`situ`).
    """
    if config.hidden_act == "situ":
        return situ(a, b, config.activation_situ_beta, config.activation_situ_linear_beta)
    if config.hidden_act == "silu":
        cd = compute_dtype(a, b)
        return (jax.nn.silu(a.astype(cd)) * b.astype(cd)).astype(a.dtype)
    raise ValueError(f"hidden_act: got {config.hidden_act!r}, expected 'situ' or 'silu'")


# ---------------------------------------------------------------------------------------------- router


def topk_ids(scores: jax.Array, k: int) -> jax.Array:
    """Indices of the ``k`` largest entries along the last axis, best first; among equal scores the **lower** index
    first (``jax.lax.top_k``'s documented order; ``-0.0`` and ``+0.0`` are equal, which ``lax.top_k`` alone does not
    honour). ``scores [..., E]`` -> ``[..., k]`` int32."""
    # -0.0 -> +0.0 (a tie, as in the torch twin); a where, since XLA folds "+ 0.0" away under jit
    return jax.lax.top_k(jnp.where(scores == 0, jnp.zeros_like(scores), scores), k)[1].astype(jnp.int32)


def _group_mask(biased: jax.Array, config: KimiConfig, has_bias: bool) -> jax.Array:
    """DeepSeek-V3 grouped top-k: ``[N, E]`` bool, True for experts in the ``topk_group`` best of
    ``num_expert_group`` groups. A group's score is the sum of its two best biased scores (its best score when
    there is no correction bias, as DeepSeek-V3)."""
    N, E = biased.shape
    G = config.num_expert_group
    grouped = biased.reshape(N, G, E // G)  # [N, G, E/G]
    if has_bias:
        group_scores = jax.lax.top_k(grouped, min(2, E // G))[0].sum(-1)  # [N, G]
    else:
        group_scores = grouped.max(-1)  # [N, G]
    keep = topk_ids(group_scores, config.topk_group)  # [N, topk_group]
    group_keep = jax.nn.one_hot(keep, G, dtype=jnp.int32).sum(-2) > 0  # [N, G]
    return jnp.repeat(group_keep, E // G, axis=-1)  # [N, E]


def _router_scores(x: jax.Array, gate_weight: jax.Array, config: KimiConfig) -> jax.Array:
    """``act(x_fp32 · W_fp32ᵀ)`` ``[..., E]``, act = sigmoid or softmax (``moe_router_activation_func``)."""
    cd = compute_dtype(x)
    logits = x.astype(cd) @ gate_weight.astype(cd).T  # fp32 router (fp64 for fp64 x)
    if config.moe_router_activation_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    if config.moe_router_activation_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(
        f"moe_router_activation_func: got {config.moe_router_activation_func!r}, expected 'sigmoid' or 'softmax'"
    )


def selection_scores(
    x: jax.Array, gate_weight: jax.Array, e_score_correction_bias: jax.Array | None, config: KimiConfig
) -> jax.Array:
    """The scores the router's top-k ranks: ``act(x W_gateᵀ) + e_score_correction_bias``, ``[..., E]`` fp32 (before
    any group restriction). The equivalence harness uses them to tell routing flips at near-ties from real
    disagreements."""
    scores = _router_scores(x, gate_weight, config)
    return scores if e_score_correction_bias is None else scores + e_score_correction_bias.astype(scores.dtype)


def route(
    x: jax.Array, gate_weight: jax.Array, e_score_correction_bias: jax.Array | None, config: KimiConfig
) -> tuple[jax.Array, jax.Array]:
    """The MoE router (spec 5.3 steps 1-3; ``block_sparse_moe.gate``).

    1. ``logits = x_fp32 · W_fp32ᵀ``; ``s = sigmoid(logits)`` (or softmax over E, ``moe_router_activation_func``).
    2. ``topk_ids = top-k(s + bias)``, restricted to the best groups when ``use_grouped_topk`` (DeepSeek-V3
       ``noaux_tc``; a no-op for one group). The bias chooses experts only.
    3. ``w = s[topk_ids]`` (uncorrected), ``w / (Σw + 1e-20)`` when ``moe_renormalize``, times
       ``routed_scaling_factor``.

    Args:
        x: ``[N, D]`` (or ``[..., D]``) router input, the full-width post-attention-norm output; any float dtype.
        gate_weight: ``[E, D]`` (``gate.weight``).
        e_score_correction_bias: ``[E]`` fp32 (``gate.e_score_correction_bias``) or ``None`` (no correction).
        config: uses ``num_experts_per_token`` (k), the router activation, grouping, renormalisation, scaling.

    Returns:
        ``(topk_ids [..., k] int32, topk_weights [..., k])``; ids best first (ties: lower expert index first);
        weights in fp32 (fp64 for fp64 ``x``).

    Raises:
        ValueError: shapes disagree, or grouping leaves fewer than k experts
            (``topk_group * num_experts / num_expert_group < k``).
    """
    E, D = gate_weight.shape
    k = config.num_experts_per_token
    if x.shape[-1] != D:
        raise ValueError(
            f"route: x has width {x.shape[-1]}, gate.weight is {tuple(gate_weight.shape)}; expected [E, {x.shape[-1]}]"
        )
    if e_score_correction_bias is not None and e_score_correction_bias.shape != (E,):
        raise ValueError(
            f"route: e_score_correction_bias has shape {tuple(e_score_correction_bias.shape)}, expected ({E},)"
        )
    if not 1 <= k <= E:
        raise ValueError(f"route: num_experts_per_token={k}, expected an integer in [1, {E}]")
    lead = x.shape[:-1]
    cd = compute_dtype(x)
    scores = _router_scores(x.reshape(-1, D), gate_weight, config)  # [N, E] fp32 (spec 5.3 step 1)
    # Selection on the corrected scores; the bias never reaches the weights.
    biased = scores if e_score_correction_bias is None else scores + e_score_correction_bias.astype(cd)
    if config.use_grouped_topk:
        G = config.num_expert_group
        if E % G or not 1 <= config.topk_group <= G or config.topk_group * (E // G) < k:
            raise ValueError(
                f"route: grouping num_experts={E}, num_expert_group={G}, topk_group={config.topk_group} "
                f"expected G | E, 1 <= topk_group <= G and topk_group*E/G >= k={k}"
            )
        biased = jnp.where(_group_mask(biased, config, e_score_correction_bias is not None), biased, -jnp.inf)
    ids = topk_ids(biased, k)  # [N, k]

    weights = jnp.take_along_axis(scores, ids, axis=-1)  # [N, k], uncorrected scores (spec 5.3 step 3)
    if config.moe_renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * config.routed_scaling_factor
    return ids.reshape(*lead, k), weights.reshape(*lead, k)


# ---------------------------------------------------------------------------------------------- modules


class DenseMLP(nn.Module):
    """GLU MLP ``down_proj(act(gate_proj(x), up_proj(x)))`` (spec 5.2): the layer-0 ``mlp`` (width
    ``intermediate_size``) and the ``shared_experts`` (width ``num_shared_experts * moe_intermediate_size``).

    Params: ``gate_proj.weight`` / ``up_proj.weight`` ``[I, D]``, ``down_proj.weight`` ``[D, I]``.
    x ``[B, T, D]`` -> ``[B, T, D]`` in x's dtype (weights are cast to it; the activation runs in fp32).
    """

    config: KimiConfig
    intermediate_size: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        check_activation_dtype(x, "DenseMLP")
        D, I = self.config.hidden_size, self.intermediate_size
        a = Linear(I, D, name="gate_proj")(x)  # [B, T, I]
        b = Linear(I, D, name="up_proj")(x)  # [B, T, I]
        return Linear(D, I, name="down_proj")(glu_act(a, b, self.config))  # [B, T, D]


class RoutedExpert(nn.Module):
    """One routed expert ``E_j(z) = w2 · act(w1 z, w3 z)`` (spec 5.3 step 5): ``w1`` (gate) and ``w3`` (up)
    ``[moe_intermediate_size, hidden_size]``, ``w2`` (down) ``[hidden_size, moe_intermediate_size]``.
    ``hidden_size`` is the latent width (``routed_expert_hidden_size``) or D for a standard MoE.
    z ``[..., hidden_size]`` -> ``[..., hidden_size]`` in z's dtype."""

    config: KimiConfig
    hidden_size: int

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        Dl, I = self.hidden_size, self.config.moe_intermediate_size
        a = Linear(I, Dl, name="w1")(z)
        b = Linear(I, Dl, name="w3")(z)
        return Linear(Dl, I, name="w2")(glu_act(a, b, self.config))


class MoEGate(nn.Module):
    """The router's parameters ``weight`` ``[E, D]`` and ``e_score_correction_bias`` ``[E]`` (fp32, frozen);
    calling it runs :func:`route`."""

    config: KimiConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        E, D = self.config.num_experts, self.config.hidden_size
        weight = self.param("weight", nn.initializers.normal(D**-0.5), (E, D))
        bias = self.param("e_score_correction_bias", nn.initializers.zeros, (E,), jnp.float32)
        return route(x, weight, bias, self.config)


class KimiMoE(nn.Module):
    """The (latent) MoE layer, ``block_sparse_moe`` (spec 5.3 steps 1-9).

    Params (names as the checkpoint, ``experts.{e}`` -> ``experts_{e}``): ``gate`` (:class:`MoEGate`),
    ``experts_{0..E-1}`` (:class:`RoutedExpert`), ``routed_expert_down_proj`` ``[Dl, D]``, ``routed_expert_norm``
    ``[Dl]`` (only with ``latent_moe_use_norm``), ``routed_expert_up_proj`` ``[D, Dl]`` (the three only for a latent
    MoE), ``shared_experts`` (:class:`DenseMLP` of width ``num_shared_experts * moe_intermediate_size``; absent
    when ``num_shared_experts == 0``).

    ``__call__(x, return_aux=False)``: x ``[B, T, D]`` (the post-attention-norm output) -> ``[B, T, D]`` in x's
    dtype; with ``return_aux`` also ``{"expert_ids": [B, T, k], "expert_scores": [B, T, E]}`` (the selection scores,
    see :func:`selection_scores`).
    """

    config: KimiConfig

    def setup(self) -> None:
        c = self.config
        D = c.hidden_size
        Dl = c.routed_expert_hidden_size or D
        self.gate = MoEGate(c)
        self.experts = [RoutedExpert(c, Dl) for _ in range(c.num_experts)]  # linen names experts_0, experts_1, ...
        if c.has_latent_moe:
            self.routed_expert_down_proj = Linear(Dl, D)
            if c.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(Dl, c.rms_norm_eps)
            self.routed_expert_up_proj = Linear(D, Dl)
        if c.num_shared_experts:
            self.shared_experts = DenseMLP(c, c.num_shared_experts * c.moe_intermediate_size)

    def __call__(self, x: jax.Array, return_aux: bool = False):
        c = self.config
        check_activation_dtype(x, "KimiMoE")
        if x.ndim != 3 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"KimiMoE: x has shape {x.shape}, expected [B, T, {c.hidden_size}]")
        cd = compute_dtype(x)
        ids, weights = self.gate(x)  # [B, T, k] int32, [B, T, k] fp32 -- router on the full-width x (steps 1-3)
        z = self.routed_expert_down_proj(x) if c.has_latent_moe else x  # [B, T, Dl] (step 4)

        # Steps 5-6: r = Σ_k w_k · E_{ids_k}(z). Dense loop in expert order; each output is rounded to x's dtype
        # (it is computed in it), weighted by the fp32 router weight, and summed in fp32.
        r = jnp.zeros(z.shape, cd)  # [B, T, Dl]
        for e, expert in enumerate(self.experts):
            w_e = jnp.where(ids == e, weights, 0).sum(-1)  # [B, T]; 0 where e was not selected
            r = r + w_e[..., None].astype(cd) * expert(z).astype(cd)
        r = r.astype(x.dtype)

        if c.has_latent_moe:  # step 7: norm after the combine, then back up to D
            if c.latent_moe_use_norm:
                r = self.routed_expert_norm(r)
            r = self.routed_expert_up_proj(r)  # [B, T, D]
        if c.num_shared_experts:  # steps 8-9: shared experts on the un-projected x
            r = r + self.shared_experts(x)
        if not return_aux:
            return r
        gate = self.gate.variables["params"]
        return r, {
            "expert_ids": ids,
            "expert_scores": selection_scores(x, gate["weight"], gate["e_score_correction_bias"], c),
        }
