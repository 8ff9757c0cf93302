"""Checkpoint layout: every tensor name with its shape and dtype, derived from a :class:`KimiConfig` (spec section 6).

Two views of the same model:

* :func:`stored_layout` -- the tensors **as they lie on disk** (names without the ``language_model.`` prefix;
  the prefix is ``config.key_prefix``): routed experts as MXFP4 ``weight_packed``/``weight_scale`` U8 pairs when
  ``quant_method == "mxfp4"``, ``A_log`` padded to ``a_log_storage`` entries (K3) or ``[1, 1, H, 1]``
  (Kimi-Linear), ``indexer.k_norm.bias`` present.
* :func:`param_layout` -- the **canonical parameters** both model paths hold after loading: experts dequantised to
  ``experts.{E}.w{1,2,3}.weight`` in the model dtype, ``A_log`` as ``[H]`` fp32, ``indexer.k_norm.bias`` always
  present. These names are the leaves of the JAX parameter tree and the names a checkpoint is exchanged in.
* :func:`stacked_layout` -- the same parameters as the torch path holds them (its ``state_dict`` keys): each MoE
  layer's routed experts stacked into three ``[E, out, in]`` tensors ``experts.w1`` / ``experts.w3`` / ``experts.w2``
  (torchtitan's ``GroupedExperts`` layout, so grouped GEMMs, FSDP2 and DCP see one tensor per projection), slice
  ``e`` of ``experts.w1`` being the checkpoint's ``experts.{e}.w1.weight``. :func:`stacked_expert_name` and
  :func:`expert_param_name` map one naming to the other.

Parameter counts (:func:`param_counts`) are computed from :func:`param_layout`, never typed in.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kimi.config import KimiConfig

__all__ = [
    "TensorSpec",
    "stored_layout",
    "param_layout",
    "stacked_layout",
    "stacked_expert_name",
    "expert_param_name",
    "EXPERT_PROJECTIONS",
    "param_counts",
    "layer_of",
    "LayerPlan",
    "layer_plan",
]

BF16, F32, U8 = "bfloat16", "float32", "uint8"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: ``name`` without the checkpoint prefix, ``shape``, ``dtype`` (a torch dtype name),
    ``layer`` (0-based decoder layer, ``None`` for global tensors)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layer: int | None = None

    @property
    def numel(self) -> int:
        """Number of elements (the product of ``shape``; 1 for a scalar)."""
        return math.prod(self.shape)


def layer_of(name: str) -> int | None:
    """The 0-based layer of a tensor name (``model.layers.{i}.…``), ``None`` for global tensors."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
        return int(parts[2])
    return None


def _layer_specs(c: KimiConfig, i: int, *, stored: bool) -> list[TensorSpec]:
    dt = c.dtype
    out: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], dtype: str = dt) -> None:
        out.append(TensorSpec(f"model.layers.{i}.{name}", tuple(shape), dtype, i))

    D = c.hidden_size
    add("input_layernorm.weight", (D,))
    add("post_attention_layernorm.weight", (D,))
    if c.has_attn_res:
        add("self_attention_res_norm.weight", (D,))
        add("self_attention_res_proj.weight", (1, D))
        add("mlp_res_norm.weight", (D,))
        add("mlp_res_proj.weight", (1, D))

    kind = c.layer_type(i)
    a = "self_attn."
    if kind == "kda":
        H, K = c.kda_num_heads, c.kda_head_dim
        P = H * K
        for p in ("q", "k", "v"):
            add(f"{a}{p}_proj.weight", (P, D))
        for p in ("q", "k", "v"):
            add(f"{a}{p}_conv1d.weight", (P, 1, c.short_conv_kernel_size), F32)
        add(f"{a}f_a_proj.weight", (c.kda_gate_rank, D))
        add(f"{a}f_b_proj.weight", (P, c.kda_gate_rank))
        add(f"{a}dt_bias", (P,), F32)
        if not stored:
            add(f"{a}A_log", (H,), F32)
        elif c.is_kimi_linear:
            add(f"{a}A_log", (1, 1, H, 1), F32)
        else:
            add(f"{a}A_log", (c.a_log_storage,), F32)
        add(f"{a}b_proj.weight", (H, D))
        if c.use_full_rank_gate:
            add(f"{a}g_proj.weight", (P, D))
        else:
            add(f"{a}g_a_proj.weight", (c.kda_gate_rank, D))
            add(f"{a}g_b_proj.weight", (P, c.kda_gate_rank))
        add(f"{a}o_norm.weight", (K,), F32)
        add(f"{a}o_proj.weight", (D, P))
    else:
        H = c.num_attention_heads
        if c.q_lora_rank is None:
            add(f"{a}q_proj.weight", (H * c.qk_head_dim, D))
        else:
            add(f"{a}q_a_proj.weight", (c.q_lora_rank, D))
            add(f"{a}q_a_layernorm.weight", (c.q_lora_rank,))
            add(f"{a}q_b_proj.weight", (H * c.qk_head_dim, c.q_lora_rank))
        add(f"{a}kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, D))
        add(f"{a}kv_a_layernorm.weight", (c.kv_lora_rank,))
        add(f"{a}kv_b_proj.weight", (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
        if c.mla_use_output_gate:
            add(f"{a}g_proj.weight", (H * c.v_head_dim, D))
        add(f"{a}o_proj.weight", (D, H * c.v_head_dim))
        if kind == "dsa":
            HI, KI = c.index_n_heads, c.index_head_dim
            q_in = c.q_lora_rank if c.q_lora_rank is not None else D
            add(f"{a}indexer.wq_b.weight", (HI * KI, q_in))
            add(f"{a}indexer.wk.weight", (KI, D))
            add(f"{a}indexer.k_norm.weight", (KI,))
            add(f"{a}indexer.k_norm.bias", (KI,))
            add(f"{a}indexer.weights_proj.weight", (HI, D))

    if not c.is_moe_layer(i):
        I = c.intermediate_size
        add("mlp.gate_proj.weight", (I, D))
        add("mlp.up_proj.weight", (I, D))
        add("mlp.down_proj.weight", (D, I))
        return out

    m = "block_sparse_moe."
    E, I = c.num_experts, c.moe_intermediate_size
    Dl = c.routed_expert_hidden_size or D
    add(f"{m}gate.weight", (E, D))
    add(f"{m}gate.e_score_correction_bias", (E,), F32)
    if c.has_latent_moe:
        add(f"{m}routed_expert_down_proj.weight", (Dl, D))
        if c.latent_moe_use_norm:
            add(f"{m}routed_expert_norm.weight", (Dl,))
        add(f"{m}routed_expert_up_proj.weight", (D, Dl))
    if c.num_shared_experts:
        Is = c.num_shared_experts * I
        add(f"{m}shared_experts.gate_proj.weight", (Is, D))
        add(f"{m}shared_experts.up_proj.weight", (Is, D))
        add(f"{m}shared_experts.down_proj.weight", (D, Is))
    g = c.quant_group_size
    for e in range(E):
        for w, (rows, cols) in (("w1", (I, Dl)), ("w3", (I, Dl)), ("w2", (Dl, I))):
            if stored and c.quant_method == "mxfp4":
                add(f"{m}experts.{e}.{w}.weight_packed", (rows, cols // 2), U8)
                add(f"{m}experts.{e}.{w}.weight_scale", (rows, cols // g), U8)
            else:
                add(f"{m}experts.{e}.{w}.weight", (rows, cols))
    return out


def _global_specs(c: KimiConfig) -> list[TensorSpec]:
    D, V = c.hidden_size, c.vocab_size
    out = [TensorSpec("model.embed_tokens.weight", (V, D), c.dtype), TensorSpec("model.norm.weight", (D,), c.dtype)]
    if c.has_attn_res:
        out.append(TensorSpec("model.output_attn_res_norm.weight", (D,), c.dtype))
        out.append(TensorSpec("model.output_attn_res_proj.weight", (1, D), c.dtype))
    if not c.tie_word_embeddings:
        out.append(TensorSpec("lm_head.weight", (V, D), c.dtype))
    return out


def stored_layout(c: KimiConfig, layers: range | list[int] | None = None) -> list[TensorSpec]:
    """Tensors on disk, global ones first, then layer by layer. ``layers`` limits the per-layer part."""
    idx = range(c.num_hidden_layers) if layers is None else layers
    return _global_specs(c) + [s for i in idx for s in _layer_specs(c, i, stored=True)]


def param_layout(c: KimiConfig, layers: range | list[int] | None = None) -> list[TensorSpec]:
    """Canonical parameters held by both model paths (experts dequantised, A_log as [H])."""
    idx = range(c.num_hidden_layers) if layers is None else layers
    return _global_specs(c) + [s for i in idx for s in _layer_specs(c, i, stored=False)]


EXPERT_PROJECTIONS = ("w1", "w3", "w2")  # gate [I, Dl], up [I, Dl], down [Dl, I] per expert (spec 5.3 step 5)
_EXPERT_PARAM = re.compile(r"^(?P<pre>(?:.+\.)?experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")
_STACKED_PARAM = re.compile(r"^(?P<pre>(?:.+\.)?experts)\.(?P<w>w[123])$")


def stacked_expert_name(name: str) -> tuple[str, int] | None:
    """``(stacked name, expert id)`` of a canonical per-expert name, ``None`` for any other name:
    ``"model.layers.3.block_sparse_moe.experts.7.w1.weight"`` -> ``("model.layers.3.block_sparse_moe.experts.w1", 7)``.
    Works on relative names too (``"experts.7.w2.weight"`` -> ``("experts.w2", 7)``)."""
    m = _EXPERT_PARAM.match(name)
    return None if m is None else (f"{m['pre']}.{m['w']}", int(m["e"]))


def expert_param_name(stacked: str, expert: int) -> str:
    """The canonical per-expert name of slice ``expert`` of a stacked name: the inverse of
    :func:`stacked_expert_name` (``"experts.w1", 7`` -> ``"experts.7.w1.weight"``).

    Raises:
        ValueError: ``stacked`` is not a stacked expert name (``...experts.w1`` / ``w2`` / ``w3``)."""
    m = _STACKED_PARAM.match(stacked)
    if m is None:
        raise ValueError(f"stacked: got {stacked!r}, expected a stacked expert name ending in experts.w1/w2/w3")
    return f"{m['pre']}.{expert}.{m['w']}.weight"


def stacked_layout(c: KimiConfig, layers: range | list[int] | None = None) -> list[TensorSpec]:
    """:func:`param_layout` with each MoE layer's routed experts stacked: ``...experts.w1`` / ``w3`` ``[E, I, Dl]``
    and ``...experts.w2`` ``[E, Dl, I]`` in the model dtype, in place of the ``3 E`` per-expert tensors (where the
    layer's expert 0 stood). The torch path's ``state_dict`` keys and shapes."""
    out: list[TensorSpec] = []
    for s in param_layout(c, layers):
        hit = stacked_expert_name(s.name)
        if hit is None:
            out.append(s)
        elif hit[1] == 0:
            out.append(TensorSpec(hit[0], (c.num_experts, *s.shape), s.dtype, s.layer))
    return out


def param_counts(c: KimiConfig) -> dict[str, int]:
    """Total and active parameter counts from :func:`param_layout` shapes.

    ``active`` counts what one token touches: everything except the routed experts it was not routed to
    (``num_experts_per_token`` of ``num_experts`` are), and except the input embedding table (a lookup, spec 0).
    ``active_with_embedding`` adds the embedding back.
    """
    total = routed = embed = 0
    for s in param_layout(c):
        total += s.numel
        if ".experts." in s.name:
            routed += s.numel
        if s.name == "model.embed_tokens.weight":
            embed = s.numel
    active_routed = routed * c.num_experts_per_token // max(c.num_experts, 1) if routed else 0
    active = total - routed + active_routed - embed
    return {
        "total_params": total,
        "active_params": active,
        "active_with_embedding": active + embed,
        "routed_expert_params": routed,
        "embedding_params": embed,
    }


@dataclass(frozen=True)
class LayerPlan:
    """What each 0-based layer is: attention kind, MLP kind, AttnRes block write."""

    index: int
    attention: str  # 'kda' | 'mla' | 'dsa'
    mlp: str  # 'dense' | 'moe'
    block_write: bool


def layer_plan(c: KimiConfig) -> list[LayerPlan]:
    """One :class:`LayerPlan` per decoder layer (0-based): attention kind (``kda`` / ``mla`` / ``dsa``), MLP kind
    (``dense`` / ``moe``) and whether the layer writes an AttnRes block, all read from the config."""
    return [
        LayerPlan(i, c.layer_type(i), "moe" if c.is_moe_layer(i) else "dense", c.is_block_write_layer(i))
        for i in range(c.num_hidden_layers)
    ]
