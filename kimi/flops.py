"""Model FLOPs per token, counted from the config: the numerator of model FLOPs utilisation (MFU).

MFU = ``estimate_flops(cfg, T)["flops_per_token"] * tokens_per_second / peak_flops``, with the peak measured on the
same device in the same run (a large bf16 matmul), as nanochat's ``estimate_flops`` and PaLM's appendix B do.

What is counted (one multiply-add = 2 FLOPs; "useful" work only, whatever a kernel pads or recomputes):

* **Weight matmuls**: 2 x (active matmul parameters) per token in the forward: every 2-D ``*.weight`` of
  :func:`kimi.layout.param_layout` except the input embedding (a lookup) and norm vectors; routed experts count
  ``num_experts_per_token / num_experts`` of their parameters (the experts one token visits); the lm_head counts.
  The depthwise short convolutions of KDA count 2 x ``short_conv_kernel_size`` per channel.
* **KDA recurrence** (the delta rule, per head and token, recurrent form): ``o = q S`` (2KV), the read-out
  ``k S`` (2KV) and the rank-1 update ``S += k (beta (v - k S))^T`` (2KV): 6 x K x V. The chunk algorithm's extra
  intra-chunk work is an implementation choice and is not counted.
* **Dense MLA attention** (non-DSA MLA layers), the expanded form a dense kernel runs: per query, the causal keys
  of its document (on average ``(T + 1) / 2`` for a document of ``T`` tokens), 2 x H x (d_qk + d_v) each with
  d_qk = ``qk_nope_head_dim + qk_rope_head_dim`` and d_v = ``v_head_dim``.
* **DSA layers**: the sparse attention in the absorbed form its kernels run (FlashMLA's count: 2 x H x (576 + 512)
  per selected key for K3.1, i.e. d_qk = ``kv_lora_rank + qk_rope_head_dim``, d_v = ``kv_lora_rank``) over
  ``min(index_topk, t)`` keys for query position t, plus the lightning indexer's scores over all causal keys
  (2 x H_I x D_I per key, and the H_I weighting, 2 x H_I) and its projections -- top-k selection itself is not
  arithmetic.
  ``kv_b_proj`` costs the same per token in both forms (applied to each key's latent in the expanded form, to each
  query and output in the absorbed one), so it is counted once, with the weight matmuls.
* **Backward** (``backward=True``): twice the forward for everything that trains (activations and weight
  gradients), so 3x in all; the DSA indexer is frozen (hard top-k gives it no LM-loss gradient), so its projections
  and scores count once. Activation recomputation is not useful work and is not counted.

Norms, softmax, gates, routing and the AttnRes mix are elementwise and left out (well under 1% at real size).
"""

from __future__ import annotations

from kimi.config import KimiConfig
from kimi.layout import param_layout

__all__ = ["estimate_flops"]


def causal_keys(T: int, window: int | None = None) -> float:
    """Mean number of keys a query of a ``T``-token document attends to, causal, at most ``window`` keys."""
    if window is None or window >= T:
        return (T + 1) / 2
    # positions t = 1..T see min(t, window) keys
    return (window * (window + 1) / 2 + (T - window) * window) / T


def estimate_flops(cfg: KimiConfig, seq_len: int, *, backward: bool = True) -> dict[str, float]:
    """Model FLOPs per token for documents of ``seq_len`` tokens (training with ``backward=True``).

    Args:
        cfg: the model config (all ``cfg.num_hidden_layers`` layers are counted; use ``cfg.truncated(n)`` for
            fewer).
        seq_len: tokens per document (attention spans one document; packed rows of several documents should pass
            the mean document length). Must be >= 1.
        backward: count the backward pass too (training step), else the forward only.

    Returns:
        A dict of FLOPs per token (floats): ``flops_per_token`` (the total) and its parts ``matmul`` (weight
        matmuls, lm_head and convs), ``kda`` (KDA recurrences), ``attention`` (dense MLA and DSA sparse
        attention) and ``indexer`` (the DSA indexer's projections and scores, forward only); also
        ``active_matmul_params`` (without the indexer's) and ``indexer_params``. Multiply by tokens per second and divide by the peak FLOP/s for MFU.

    Raises:
        ValueError: ``seq_len`` < 1.

    Source: the counting conventions of nanochat ``GPT.estimate_flops`` and FlashMLA's sparse FLOPs
    ``2 * S_q * H * k * (d_qk + d_v)`` (docs/kernels.md); see the module docstring for each term.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"estimate_flops: seq_len={seq_len!r}, expected an integer >= 1 (tokens per document)")
    c = cfg
    expert_share = c.num_experts_per_token / c.num_experts if c.num_experts else 0.0
    matmul_params = 0.0
    indexer_params = 0.0  # frozen, and no LM-loss gradient flows through it: forward only
    conv_flops = 0.0
    for s in param_layout(c):
        if s.name == "model.embed_tokens.weight" or not s.name.endswith(".weight"):
            continue
        if "conv1d" in s.name:  # depthwise [P, 1, W]: W multiply-adds per channel
            conv_flops += 2 * s.numel
            continue
        if len(s.shape) != 2:  # norms
            continue
        if ".indexer." in s.name:
            indexer_params += s.numel
            continue
        matmul_params += s.numel * (expert_share if ".experts." in s.name else 1.0)

    kda = attention = 0.0
    indexer = 2 * indexer_params
    for i in range(c.num_hidden_layers):
        kind = c.layer_type(i)
        if kind == "kda":
            kda += 6 * c.kda_num_heads * c.kda_head_dim * c.kda_head_dim
        elif kind == "mla":
            d_qk, d_v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
            attention += 2 * c.num_attention_heads * (d_qk + d_v) * causal_keys(seq_len)
        else:  # dsa: absorbed sparse attention over the selected keys; the indexer scores every causal key
            d_qk, d_v = c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank
            H = c.num_attention_heads
            attention += 2 * H * (d_qk + d_v) * causal_keys(seq_len, c.index_topk)
            indexer += 2 * c.index_n_heads * (c.index_head_dim + 1) * causal_keys(seq_len)

    matmul = 2 * matmul_params + conv_flops
    train = 3.0 if backward else 1.0
    parts = {"matmul": train * matmul, "kda": train * kda, "attention": train * attention, "indexer": indexer}
    return {
        "flops_per_token": sum(parts.values()),
        **parts,
        "active_matmul_params": matmul_params,
        "indexer_params": indexer_params,
    }
