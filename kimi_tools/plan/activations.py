"""Activation bytes a rank keeps for the backward: per layer from the config's widths, and per in-flight
micro-batch under whole-layer recomputation (the layer inputs, the stage's received and sent states, the head)."""

from __future__ import annotations

import functools
import math

from kimi.config import KimiConfig
from kimi_tools.plan.layout import MLP_FULL_LAYERS


def _mix_sources(cfg: KimiConfig, i: int) -> tuple[int, int]:
    """Sources of layer ``i``'s two AttnRes mixes (attention side, MLP side): the blocks stored before it plus the
    partial sum (``kernels_torch.model.DecoderLayer.forward``); (1, 1) without AttnRes (no mix)."""
    if not cfg.has_attn_res:
        return 1, 1
    b = cfg.attn_res_block_size
    return (math.ceil(i / b) + 1 if i else 1), i // b + 2


@functools.lru_cache(maxsize=64)
def activation_table(cfg: KimiConfig, full_layers: int = MLP_FULL_LAYERS) -> tuple[tuple[int, int], ...]:
    """:func:`layer_activation_bytes` of every layer, ("none", "mlp")."""
    return tuple(
        (layer_activation_bytes(cfg, i, "none"), layer_activation_bytes(cfg, i, "mlp", full_layers))
        for i in range(cfg.num_hidden_layers)
    )


def layer_activation_bytes(cfg: KimiConfig, i: int, mode: str = "none", full_layers: int = MLP_FULL_LAYERS) -> int:
    """Bytes per token that layer ``i`` keeps for its backward, from the config's widths (bf16 activations 2 B, the
    tensors the code computes in fp32 4 B), the principal saved tensors of each part (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", section 4's count, for this model's layers):

    * each AttnRes mix over ``M > 1`` sources (:func:`_mix_sources`): three fp32 copies of them, ``12 M D``; each
      RMSNorm ``6 D``;
    * KDA (``P = H x K``): the q/k/v projections and convolutions, the fp32 L2-normalised q, k, the gate and its
      fp32 decay, the output gate and the fp32 gated norm, ``42 P + 2 R + 4 H`` (``R`` the gate rank);
    * MLA: the q and kv latents and their fp32 norms, q, the expanded k and v, the output and its fp32 sigmoid
      gate; DSA adds the selected key ids (``4 x index_topk``);
    * dense MLP ``6 I + 2 D``; MoE: the fp32 router scores (``4 E``), the routing (``12 k``), the latent input, per
      routed slot its rows in and out (``2 Dl + 4 Dl``) and its GLU (``6 I``), the latent norm, up projection and
      shared experts (``6 I x shared``).

    ``mode`` "mlp" (``kernels_torch.activation_memory.recompute_layers(model, "mlp", full_layers)``): the MLP / MoE block with its
    norm keeps only its input (``2 D``), and the first ``full_layers`` layers, recomputed whole, only theirs.
    The count is what a layer saves up to one constant: the planner scales it by each calibration step's measured
    bytes (:class:`Calibration`); ``tests/test_plan.py`` checks its shape against autograd's saved tensors.

    Raises:
        ValueError: ``mode`` not "none" or "mlp"."""
    if mode not in ("none", "mlp"):
        raise ValueError(f"mode: got {mode!r}, expected 'none' or 'mlp'")
    c, D = cfg, cfg.hidden_size
    if mode == "mlp" and i < full_layers:
        return 2 * D
    m_attn, m_mlp = _mix_sources(cfg, i)
    mix = lambda M: 12 * M * D if M > 1 else 0  # noqa: E731
    out = mix(m_attn) + mix(m_mlp) + 6 * D  # the mixes, the attention's input norm
    if c.layer_type(i) == "kda":
        P, H, R = c.kda_num_heads * c.kda_head_dim, c.kda_num_heads, c.kda_gate_rank
        out += 42 * P + 2 * R + 4 * H
    else:
        H, Kn, Rr, V, L = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        out += 6 * (c.q_lora_rank or 0) + 2 * (L + Rr) + 4 * L  # latents, their norms
        out += 2 * H * (Kn + Rr) * 2 + 2 * H * (Kn + V)  # q, k, the kv expansion
        out += 2 * H * V + 8 * H * V + 2 * H * V  # attention output, fp32 gate, gated output
        if c.layer_type(i) == "dsa":
            out += 4 * c.index_topk
    if mode == "mlp":
        return out + 2 * D
    out += 6 * D  # the MLP's input norm
    if c.is_moe_layer(i):
        E, k, inter = c.num_experts, c.num_experts_per_token, c.moe_intermediate_size
        Dl = c.routed_expert_hidden_size or D
        out += 4 * E + 12 * k + 2 * Dl + k * (6 * Dl + 6 * inter) + 4 * Dl + 2 * D
        out += 6 * c.num_shared_experts * inter + 2 * D if c.num_shared_experts else 0
    else:
        out += 6 * c.intermediate_size + 2 * D
    return out


@functools.lru_cache(maxsize=4096)
def _sources_after(cfg: KimiConfig, stop: int) -> int:
    """``M`` of the ``[M, B, T, D]`` state after layers ``0 .. stop - 1`` (the AttnRes blocks stored so far plus the
    partial sum; 1 without AttnRes): ``kernels_torch.parallel.pipeline.sources_after``."""
    return math.ceil(stop / cfg.attn_res_block_size) + 1 if cfg.has_attn_res else 1


def layer_inputs_bytes(layers: range, T: int, D: int, first: bool) -> int:
    """Bytes of the layers' bf16 inputs a stage keeps under whole-layer recomputation (each layer's partial sum
    ``p``, ``T x D x 2``); a later stage's first layer reads a view of the received state (counted with it)."""
    return (len(layers) - (0 if first else 1)) * T * D * 2


def held_per_microbatch(
    cfg: KimiConfig, layers: range, T: int, *, first: bool, last: bool, lm_head_grad: bool = True
) -> int:
    """Bytes one in-flight micro-batch keeps on a pipeline stage between its forward and its backward when every
    layer is recomputed (``kernels_torch.activation_memory.recompute_layers(model, "layer")``), in units of ``u = T x D x 2``
    (bf16 activations, ``T`` tokens per rank), as the stage module (``kernels_torch.parallel.pipeline.
    PipelineStageModule``) and the schedule keep them:

    * each layer's input partial sum: ``len(layers)`` u (a later stage's first layer reads a view of the received
      state instead);
    * a later stage's received state ``[M_in, B, T, D]`` (``M_in = sources_after(start)``): ``M_in`` u; a stage
      before the last its sent state (``torch.distributed.pipelining`` keeps a stage's outputs for its backward):
      ``M_out`` u;
    * the last stage's head: the output AttnRes mix over ``M`` sources keeps three fp32 copies of them (the
      stacked sources, their transposed and flattened forms: ``6 M`` u; none when ``M = 1``), the final RMSNorm its
      fp32 input (2 u) and bf16 output (1 u), ``kernels_torch.loss.linear_cross_entropy`` the hidden-state gradient
      (1 u) and, with a trainable ``lm_head``, its ``[V, D]`` gradient (``V x D x 2`` B), computed in the forward.

    ``tests/test_plan.py`` checks the count against the tensors autograd saves for every stage of a split model.
    """
    D = cfg.hidden_size
    u = T * D * 2
    held = layer_inputs_bytes(layers, T, D, first)
    if not first:
        held += _sources_after(cfg, layers.start) * u
    if not last:
        held += _sources_after(cfg, layers.stop) * u
    else:
        M = _sources_after(cfg, layers.stop)
        held += (6 * M if M > 1 else 0) * u + 4 * u
        if lm_head_grad:
            held += cfg.vocab_size * D * 2
    return held
