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


KDA_CHUNK = 64  # the chunk length of the KDA recurrence (kernels_torch.kda.kda_chunk's chunk_size)
RECOMPUTE_MODES = ("none", "attn", "mlp", "full")  # kimi train --recompute-mode attn / mlp / layer ("full")
OFFLOAD_MODES = ("none", "attn", "mlp", "all")  # kimi train --offload-activations


def _mix_bytes(M: int, D: int, T: int) -> int:
    """An AttnRes depth mix over ``M > 1`` sources: three fp32 copies of the stacked sources (stacked, transposed,
    flattened: ``12 M D``) and two fp32 ``[M, T]`` weights (``8 M``) per token, and its norm and projection weights
    in fp32 (``12 D``, once); nothing when ``M = 1``."""
    return T * (12 * M * D + 8 * M) + 12 * D if M > 1 else 0


def _attn_bytes(c: KimiConfig, i: int, T: int) -> int:
    """The attention block of layer ``i`` (``input_layernorm`` and the token mixer), ``T`` tokens."""
    D = c.hidden_size
    norm = T * (8 * D + 4)  # fp32 input, fp32 rstd, bf16 output and its 2-D copy
    if c.layer_type(i) == "kda":
        H, K, R = c.kda_num_heads, c.kda_head_dim, c.kda_gate_rank
        P = H * K
        # the q/k/v short convs (fp32 padded inputs and outputs), the L2-normalised q, k, the gate and its decay,
        # the chunked recurrence's per-chunk tensors (fp32 [H, chunk, K] and the [H, K, K] state of each chunk),
        # the gated norm, the bf16 output; the convs' padding and the chunk masks once
        per = 74 * P + 20 * H + 2 * R
        state = 4 * H * K * K * -(-T // KDA_CHUNK)
        once = 3 * (c.short_conv_kernel_size - 1) * P * 4 + 6 * KDA_CHUNK * KDA_CHUNK + 4 * H
        return norm + T * per + state + once
    H, n, r, v, L = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    q = c.q_lora_rank or 0
    keys = min(T, c.index_topk) if c.layer_type(i) == "dsa" else T
    per = (8 * q + 4 if q else 0) + 8 * L + 4  # the q and kv latents: fp32 norm inputs, rstd, bf16 outputs
    per += 8 * H * (n + r) + 4 * H * keys  # fp32 q and k per head, the attention probabilities over the keys
    per += 14 * H * v + 1  # fp32 values, output and sigmoid gate, the bf16 gated output; the padding mask
    once = 0
    if c.layer_type(i) == "dsa":  # the indexer: fp32 input, q heads, the normed key, head weights
        Hi, dI = c.index_n_heads, c.index_head_dim
        per += 4 * D + 4 * Hi * dI + 8 * dI + 4 * Hi + 8
        once += 8 * dI + 4 * D * Hi
    return norm + T * per + once


def _mlp_bytes(c: KimiConfig, i: int, T: int) -> int:
    """The MLP / MoE block of layer ``i`` (``post_attention_layernorm`` and the feed-forward), ``T`` tokens."""
    D = c.hidden_size
    if not c.is_moe_layer(i):  # the norm (fp32 input, rstd, bf16 output and copy), the SiTU GLU (six fp32, one bf16)
        return T * (8 * D + 4 + 26 * c.intermediate_size)
    E, k, inter = c.num_experts, c.num_experts_per_token, c.moe_intermediate_size
    Dl = c.routed_expert_hidden_size or D
    S = c.num_shared_experts * inter
    per = 6 * D + 4  # the norm
    per += 8 * D + 20 * E + 4 * k + 8  # the router: fp32 input (twice), scores, the top-k ids and weights
    per += 2 * D + 10 * Dl + 4  # the latent down projection, its norm
    per += k * (10 * Dl + 26 * inter + 20)  # per routed row: its latent rows in and out, the GLU, the ids
    per += 26 * S  # the shared experts' GLU
    return T * per + 8 * D * E  # the router's weight in fp32, twice


@functools.lru_cache(maxsize=4096)
def block_bytes(cfg: KimiConfig, i: int, T: int) -> dict[str, int]:
    """Bytes layer ``i`` saves for its backward with ``T`` tokens, by region (``kernels_torch.activation_memory``'s
    blocks), with no recomputation or offload: ``attn`` (``input_layernorm`` and the KDA or MLA/DSA mixer),
    ``mlp`` (``post_attention_layernorm`` and the dense MLP or the MoE), ``glue`` (the two AttnRes depth mixes, in
    the layer's forward only) and ``input`` (what a recomputed region keeps: its bf16 input, ``2 D`` per token).

    From the config's widths, counting the tensors the eager twin (``sdpa`` backend) saves, each storage once
    (``kernels_torch.activation_memory.saved_bytes_by_block``: ``tests/test_plan.py`` compares at the tiny preset
    and at k3.1-pro's widths, ``benchmarks/results/activation_bytes.json``). The fused GPU kernels keep fewer (no
    fp32 copies of the GLU, no attention probabilities): :class:`~kimi_tools.plan.calibration.Calibration` scales
    this count to the measured GPU step."""
    c, D = cfg, cfg.hidden_size
    m_attn, m_mlp = _mix_sources(cfg, i)
    return {
        "attn": _attn_bytes(c, i, T),
        "mlp": _mlp_bytes(c, i, T),
        "glue": _mix_bytes(m_attn, D, T) + _mix_bytes(m_mlp, D, T),
        "input": 2 * D * T,
    }


def policy_bytes(
    cfg: KimiConfig,
    i: int,
    T: int,
    recompute: str = "none",
    offload: str = "none",
    host_ratio: dict | None = None,
    scale: float = 1.0,
) -> tuple[float, float]:
    """``(device, host)`` bytes layer ``i`` keeps between its forward and its backward with ``T`` tokens under a
    recompute mode (:data:`RECOMPUTE_MODES`: ``kimi train --recompute-mode attn|mlp|layer``, ``"full"`` the
    last) and an activation offload (:data:`OFFLOAD_MODES`: ``--offload-activations``), composed as
    ``kernels_torch.activation_memory`` composes them: a recomputed region keeps its input (:func:`block_bytes`'
    ``input``), an offloaded one keeps nothing on the device and its saved tensors on the host, where each saved
    tensor is copied on its own (a storage saved through several views goes several times): ``host_ratio``
    {"attn_kda", "attn_dsa", "attn_mla", "mlp_dense", "mlp_moe", "glue"} host bytes per device byte of each
    offloaded region (measured: ``Calibration.host_ratio``; default 1). ``scale`` multiplies the regions' own bytes
    (the GPU kernels against the eager count: ``Calibration.act_scale``), not the inputs a recomputed region keeps
    (exact). ``benchmarks/results/activation_bytes.json`` has every composition measured at k3.1-pro's widths
    (``tests/test_plan.py``).

    Raises:
        ValueError: a mode outside those tuples, or ``attn`` / ``mlp`` offload with ``full`` recomputation (the
            trainer refuses it: the layer keeps no block activation to offload)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute: got {recompute!r}, expected one of {list(RECOMPUTE_MODES)}")
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload: got {offload!r}, expected one of {list(OFFLOAD_MODES)}")
    b = {k: v * (1.0 if k == "input" else scale) for k, v in block_bytes(cfg, i, T).items()}
    if recompute == "full":
        if offload in ("attn", "mlp"):
            raise ValueError(f"offload: got {offload!r} with recompute 'full', expected 'none' or 'all'")
        return (0, b["input"]) if offload == "all" else (b["input"], 0)
    ratio = host_ratio or {}
    kind = {"attn": "attn_" + cfg.layer_type(i), "mlp": "mlp_" + ("moe" if cfg.is_moe_layer(i) else "dense")}
    device = host = 0
    for block in ("attn", "mlp"):
        kept = b["input"] if recompute == block else b[block]
        if offload in (block, "all"):
            host += kept if recompute == block else kept * ratio.get(kind[block], 1.0)
        else:
            device += kept
    if offload == "all":
        host += b["glue"] * ratio.get("glue", 1.0)
    else:
        device += b["glue"]
    return device, host


def layer_activation_bytes(cfg: KimiConfig, i: int, mode: str = "none", full_layers: int = MLP_FULL_LAYERS) -> float:
    """Device bytes per token that layer ``i`` keeps for its backward under recompute ``mode`` ("none", "attn",
    "mlp", "full"; with "attn" or "mlp" the first ``full_layers`` layers recomputed whole, as
    ``--recompute-full-layers``), no offload: :func:`policy_bytes` for one token's share at 8,192 tokens (the
    per-chunk and once-per-layer terms spread over them).

    Raises:
        ValueError: ``mode`` outside :data:`RECOMPUTE_MODES`."""
    if mode in ("attn", "mlp") and i < full_layers:
        mode = "full"
    return policy_bytes(cfg, i, 8192, mode)[0] / 8192


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
      state instead); nothing else of a layer: its other outputs (the AttnRes blocks it hands on share the partial
      sums' storage; its aux, the attention and MLP outputs, MoE scores and DSA top-k, 0.32 GB beside the 0.117 GB
      partial sum of a K3.1 Pro MoE layer at 8192 tokens) are dropped as the layer returns (``KimiK3Model.loss``,
      the pipeline stage's forward);
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
