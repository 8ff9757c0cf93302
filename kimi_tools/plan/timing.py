"""The time model's parts: model FLOPs per token per layer (``kimi.flops``'s count split by layer) and the
links' times (rings, the expert all-to-all)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kimi.config import KimiConfig
from kimi_tools.plan.layout import GB, Hardware
from kimi_tools.plan.params import is_expert, layout_specs


@dataclass(frozen=True)
class Flops:
    """Model FLOPs per token (:func:`layer_flops`): ``layers`` and ``experts`` (the routed experts' part of each
    layer) per layer, ``head`` (``lm_head`` and the AttnRes output mix); ``attn_fwd`` / ``mlp_fwd``: the forward
    alone of each layer's attention and MLP / MoE block (what recomputing that block runs again), ``experts_fwd``
    the routed experts' part of ``mlp_fwd``."""

    layers: tuple[float, ...]
    experts: tuple[float, ...]
    head: float
    attn_fwd: tuple[float, ...] = ()
    mlp_fwd: tuple[float, ...] = ()
    experts_fwd: tuple[float, ...] = ()

    def recomputed(self, i: int, mode: str) -> tuple[float, float]:
        """``(all, experts)`` FLOPs per token that recompute ``mode`` ("none", "attn", "mlp", "full") adds to layer
        ``i``: the recomputed block's forward again."""
        a = self.attn_fwd[i] if mode in ("attn", "full") else 0.0
        m = self.mlp_fwd[i] if mode in ("mlp", "full") else 0.0
        return a + m, self.experts_fwd[i] if mode in ("mlp", "full") else 0.0

    @property
    def total(self) -> float:
        return sum(self.layers) + self.head


@functools.lru_cache(maxsize=64)
def layer_flops(cfg: KimiConfig, seq_len: int, frozen_weights: bool = False) -> Flops:
    """Model FLOPs per token of a training step (forward + backward) for documents of ``seq_len`` tokens, per layer:
    ``kimi.flops.estimate_flops``'s count split by layer (weight matmuls with the routed experts at ``k / E``, short
    convs, KDA recurrences, attention, the indexer forward only); the parts add up to
    ``estimate_flops(cfg, seq_len)["flops_per_token"]`` (``tests/test_plan.py``). ``frozen_weights`` (LoRA): the
    weights get no gradient, so each weight matmul counts forward + input gradient (2x the forward, not 3x); the
    adapters' own FLOPs (rank r, tiny) are left out."""
    w = 2 if frozen_weights else 3
    # the global matmuls: lm_head and the AttnRes output mix (the embedding is a lookup, norms are not counted)
    glob, per = layout_specs(cfg)
    head = sum(w * 2 * s.numel for s in glob if len(s.shape) == 2 and s.name != "model.embed_tokens.weight")
    share = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 0.0
    out, exp, a_fwd, m_fwd = [], [], [], []
    for i in range(cfg.num_hidden_layers):
        f = e = fa = fm = 0.0
        for s in per[i]:
            mlp = ".mlp." in s.name or ".block_sparse_moe." in s.name
            if ".indexer." in s.name and s.name.endswith(".weight") and len(s.shape) == 2:
                f += 2 * s.numel  # frozen: forward only
                fa += 2 * s.numel
            elif is_expert(s.name):
                e += w * 2 * s.numel * share
            elif ("conv1d" in s.name and s.name.endswith(".weight")) or (
                s.name.endswith(".weight") and len(s.shape) == 2
            ):
                f += w * 2 * s.numel
                if mlp:
                    fm += 2 * s.numel
                else:
                    fa += 2 * s.numel
        att = _attention_flops(cfg, i, seq_len)
        f += att
        fa += att / 3 if cfg.layer_type(i) != "dsa" else _dsa_forward(cfg, i, seq_len)
        out.append(f + e)
        exp.append(e)
        a_fwd.append(fa)
        m_fwd.append(fm + e / w)
    return Flops(tuple(out), tuple(exp), head, tuple(a_fwd), tuple(m_fwd), tuple(e / w for e in exp))


def _dsa_forward(cfg: KimiConfig, i: int, seq_len: int) -> float:
    """The forward alone of a DSA layer's non-matmul terms: the sparse attention (a third of its training count)
    and the indexer scores (forward only)."""
    from kimi.flops import causal_keys

    c = cfg
    d_qk, d_v = c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank
    att = 2 * c.num_attention_heads * (d_qk + d_v) * causal_keys(seq_len, c.index_topk)
    return att + 2 * c.index_n_heads * (c.index_head_dim + 1) * causal_keys(seq_len)


def _attention_flops(cfg: KimiConfig, i: int, seq_len: int) -> float:
    """The non-matmul terms of ``kimi.flops.estimate_flops`` for layer ``i`` (training): KDA recurrence, MLA/DSA
    attention (x 3), the indexer scores (forward only)."""
    from kimi.flops import causal_keys

    c = cfg
    kind = c.layer_type(i)
    if kind == "kda":
        return 3.0 * 6 * c.kda_num_heads * c.kda_head_dim * c.kda_head_dim
    if kind == "mla":
        d_qk, d_v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        return 3.0 * 2 * c.num_attention_heads * (d_qk + d_v) * causal_keys(seq_len)
    d_qk, d_v = c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank
    att = 3.0 * 2 * c.num_attention_heads * (d_qk + d_v) * causal_keys(seq_len, c.index_topk)
    return att + 2 * c.index_n_heads * (c.index_head_dim + 1) * causal_keys(seq_len)


def ring_bandwidth(group: int, stride: int, hw: Hardware) -> float:
    """Effective bandwidth (B/s) of a ring over ``group`` ranks ``stride`` apart: NVLink inside one node, else IB."""
    return (hw.nvlink_gbps if group * stride <= hw.gpus_per_node else hw.ib_gbps) * GB


def a2a_time(nbytes: float, ep: int, hw: Hardware) -> float:
    """Seconds for an all-to-all in which each rank sends ``nbytes`` spread evenly over ``ep`` contiguous ranks:
    the share to ranks on the same node over NVLink, the rest over IB, concurrently."""
    if ep == 1:
        return 0.0
    local = min(ep, hw.gpus_per_node)
    intra = nbytes * (local - 1) / ep
    inter = nbytes * (ep - local) / ep
    return max(intra / (hw.nvlink_gbps * GB), inter / (hw.ib_gbps * GB))
