"""Kimi K3 / K3.1 Pro / Kimi-Linear text-model configuration, read from the checkpoint's own ``config.json``.

One frozen dataclass, :class:`KimiConfig`, mirrors the published ``text_config`` field for field (names kept,
see ``docs/spec.md`` section 1). Three ``config.json`` forms are accepted by
:meth:`KimiConfig.from_dict`:

* the top-level multimodal form (``KimiK3ForConditionalGeneration`` / ``KimiK31ForConditionalGeneration``) with a
  nested ``text_config``; its text keys live under the ``language_model.`` checkpoint prefix;
* a bare text config (``KimiK3ForCausalLM``), keys under ``language_model.`` too;
* a Kimi-Linear config (``KimiLinearForCausalLM``), keys without a prefix.

Routing is on the architecture name, never on ``text_config.model_type``: K3's text config says ``kimi_linear``
too (spec 1.1).

Footguns handled here, once:
* ``linear_attn_config.kda_layers`` / ``full_attn_layers`` and the DSA layer list are **1-based** in the JSON; this
  class stores **0-based** tuples (``kda_layers``, ``mla_layers``, ``dsa_layers``).
* ``dsa_config`` key names are not published (spec section 9): DeepSeek-style ``index_n_heads``,
  ``index_head_dim``, ``index_topk`` are accepted at the text-config top level or inside ``dsa_config``, with the
  layer list under ``layers`` / ``dsa_layers`` / ``indexer_layers`` (1-based).
* MLA's q_a/kv_a RMSNorm eps defaults to 1e-6 (HF reference), not ``rms_norm_eps`` (spec 3.4); field ``mla_norm_eps``.

Every invalid value raises :class:`ConfigError` naming the key, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["ConfigError", "KimiConfig", "PRESETS", "load_config"]


class ConfigError(ValueError):
    """A config value is missing, malformed or inconsistent. The message names the key, the value and the expectation."""


# Architecture names that route to each checkpoint flavour.
_K3_MULTIMODAL = ("KimiK3ForConditionalGeneration", "KimiK31ForConditionalGeneration")
_K3_TEXT = ("KimiK3ForCausalLM", "KimiK31ForCausalLM")
_KIMI_LINEAR = ("KimiLinearForCausalLM",)

_ACTIVATIONS = ("situ", "silu")
_ROUTER_ACTIVATIONS = ("sigmoid", "softmax")
_INDEXER_ROPE = ("none", "half", "interleaved")


@dataclass(frozen=True)
class KimiConfig:
    """The text backbone's hyper-parameters. Layer lists are 0-based tuples.

    Optional features switch off by value, never by a separate model class:
    ``q_lora_rank=None`` (plain ``q_proj``, Kimi-Linear), ``routed_expert_hidden_size=None`` (standard MoE, no latent
    projection), ``attn_res_block_size=None`` (plain residual stream), ``gate_lower_bound=None`` (softplus decay gate),
    ``use_full_rank_gate=False`` (low-rank ``g_a_proj``/``g_b_proj`` KDA output gate), ``dsa_layers=()`` (no indexer),
    ``quant_method=None`` (bf16 experts instead of MXFP4).
    """

    # --- identity and checkpoint layout ---
    architecture: str = "KimiK3ForCausalLM"
    key_prefix: str = "language_model."  # "" for Kimi-Linear checkpoints
    dtype: str = "bfloat16"
    # --- trunk ---
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839
    max_position_embeddings: int = 1048576
    # --- MLP activation (spec 5.1) ---
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    intermediate_size: int = 33792  # dense MLP width (layers < first_k_dense_replace)
    # --- gated MLA (spec 3) ---
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    mla_norm_eps: float = 1e-6
    # --- KDA (spec 2); from linear_attn_config ---
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = True
    gate_lower_bound: float | None = -5.0
    kda_gate_rank: int = 128  # f_a_proj rank; also g_a_proj rank for the low-rank output gate
    kda_layers: tuple[int, ...] = ()  # 0-based
    mla_layers: tuple[int, ...] = ()  # 0-based ("full_attn_layers")
    # --- DSA lightning indexer (spec 4) ---
    dsa_layers: tuple[int, ...] = ()  # 0-based; must be a subset of mla_layers
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    indexer_rope: str = "none"
    # --- MoE (spec 5.3) ---
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584  # latent width; None = standard MoE
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    # --- AttnRes (spec 5.4) ---
    attn_res_block_size: int | None = 12
    # --- routed-expert quantisation (spec 6) ---
    quant_method: str | None = "mxfp4"
    quant_group_size: int = 32
    # The original JSON, kept so that a written checkpoint round-trips its config.json.
    raw: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _validate(self)

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the expanded MLA form: qk_nope + qk_rope (192 for K3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_softmax_scale(self) -> float:
        """(qk_nope + qk_rope)^-1/2, used in the expanded *and* the absorbed form (spec 3.3)."""
        return self.qk_head_dim**-0.5

    @property
    def a_log_storage(self) -> int:
        """Entries of ``A_log`` on disk in K3 checkpoints: the active heads zero-padded to a multiple of 128
        (96 -> 128; spec 2.1, Megatron-Bridge audit). Loaders slice ``[:H]``, exporters re-pad."""
        return -(-self.kda_num_heads // 128) * 128

    @property
    def is_kimi_linear(self) -> bool:
        """True for ``KimiLinearForCausalLM`` checkpoints (keys without prefix, ``A_log`` ``[1, 1, H, 1]``)."""
        return self.architecture in _KIMI_LINEAR

    @property
    def has_attn_res(self) -> bool:
        """True when the residual stream is Block Attention Residuals (``attn_res_block_size`` set; spec 5.4)."""
        return self.attn_res_block_size is not None

    @property
    def has_latent_moe(self) -> bool:
        """True when routed experts work in a latent width (``routed_expert_hidden_size`` set; spec 4.1)."""
        return self.routed_expert_hidden_size is not None

    def layer_type(self, idx: int) -> str:
        """'kda', 'dsa' (MLA with an indexer) or 'mla' for the 0-based layer ``idx``."""
        _check_layer_idx(self, idx)
        if idx in self.kda_layers:
            return "kda"
        return "dsa" if idx in self.dsa_layers else "mla"

    def is_moe_layer(self, idx: int) -> bool:
        """MoE iff idx >= first_k_dense_replace and idx % moe_layer_freq == 0 (spec 1.3)."""
        _check_layer_idx(self, idx)
        return idx >= self.first_k_dense_replace and idx % self.moe_layer_freq == 0

    def is_block_write_layer(self, idx: int) -> bool:
        """AttnRes stores the partial sum as a new block before this layer's attention (idx % block_size == 0)."""
        _check_layer_idx(self, idx)
        return self.has_attn_res and idx % self.attn_res_block_size == 0

    def replace(self, **changes: Any) -> KimiConfig:
        """A copy with ``changes`` applied (validated again). The copy forgets ``raw`` (the JSON it was read from no
        longer describes it), so it is written back from its fields."""
        changes.setdefault("raw", None)
        return dataclasses.replace(self, **changes)

    def truncated(self, num_layers: int) -> KimiConfig:
        """The config of the first ``num_layers`` layers (for ``--layers N``): layer lists are cut to match."""
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise ConfigError(
                f"layers: got {num_layers}, expected an integer in [1, {self.num_hidden_layers}] (num_hidden_layers)"
            )
        keep = lambda xs: tuple(i for i in xs if i < num_layers)  # noqa: E731
        return self.replace(
            num_hidden_layers=num_layers,
            kda_layers=keep(self.kda_layers),
            mla_layers=keep(self.mla_layers),
            dsa_layers=keep(self.dsa_layers),
        )

    # ------------------------------------------------------------- (de)serialise
    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> KimiConfig:
        """Build from a parsed ``config.json`` (top-level multimodal, bare text, or Kimi-Linear form).

        Raises:
            ConfigError: unknown architecture, a missing required key, or any invalid value.
        """
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"config: got {type(cfg).__name__}, expected a JSON object")
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch in _K3_MULTIMODAL or (arch is None and "text_config" in cfg):
            text = cfg.get("text_config")
            if not isinstance(text, Mapping):
                raise ConfigError(f"text_config: got {text!r}, expected an object for architecture {arch!r}")
            merged = {k: v for k, v in cfg.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
            merged.update(text)
            return _from_text_config(merged, architecture="KimiK3ForCausalLM", key_prefix="language_model.", raw=cfg)
        if arch in _K3_TEXT:
            return _from_text_config(cfg, architecture="KimiK3ForCausalLM", key_prefix="language_model.", raw=cfg)
        if arch in _KIMI_LINEAR:
            return _from_text_config(cfg, architecture="KimiLinearForCausalLM", key_prefix="", raw=cfg)
        known = _K3_MULTIMODAL + _K3_TEXT + _KIMI_LINEAR
        raise ConfigError(f"architectures: got {archs!r}, expected one of {list(known)}")

    @classmethod
    def from_json(cls, path: str | Path) -> KimiConfig:
        """Read ``config.json`` (a file, or a checkpoint directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config.json: no file at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config.json: {path} is not valid JSON ({e})") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` this config is written as (K3: top-level multimodal form; Kimi-Linear: flat)."""
        text = _to_text_config(self)
        if self.is_kimi_linear:
            return {"architectures": ["KimiLinearForCausalLM"], **text}
        top = {
            "architectures": [
                "KimiK31ForConditionalGeneration" if self.dsa_layers else "KimiK3ForConditionalGeneration"
            ],
            "model_type": "kimi_k3",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
        }
        return top


# ---------------------------------------------------------------------------------------------- parsing helpers


def _get(d: Mapping[str, Any], key: str, default: Any, kind: type | tuple[type, ...], where: str = "") -> Any:
    """``d[key]`` checked against ``kind``; a missing key or JSON null gives ``default``."""
    v = d.get(key)
    if v is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise ConfigError(f"{where}{key}: got {v!r}, expected {' or '.join(k.__name__ for k in kinds)}")
    return v


def _one_based(values: Any, key: str, n_layers: int) -> tuple[int, ...]:
    """Convert a 1-based layer list from config.json to a sorted 0-based tuple, refusing anything malformed."""
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{key}: got {values!r}, expected a list of 1-based layer numbers")
    bad = [v for v in values if not 1 <= v <= n_layers]
    if bad:
        hint = " (the list is 1-based: 0 is not a layer)" if 0 in bad else ""
        raise ConfigError(f"{key}: got {bad} out of range, expected 1-based layer numbers in [1, {n_layers}]{hint}")
    if len(set(values)) != len(values):
        raise ConfigError(f"{key}: got duplicates in {values!r}, expected each layer once")
    return tuple(sorted(v - 1 for v in values))


def _from_text_config(
    t: Mapping[str, Any], *, architecture: str, key_prefix: str, raw: Mapping[str, Any]
) -> KimiConfig:
    num = (int, float)
    n_layers = _get(t, "num_hidden_layers", None, int)
    if n_layers is None or n_layers < 1:
        raise ConfigError(f"num_hidden_layers: got {n_layers!r}, expected a positive integer")
    lin = t.get("linear_attn_config")
    if lin is None:
        lin = {}
    if not isinstance(lin, Mapping):
        raise ConfigError(f"linear_attn_config: got {lin!r}, expected an object")
    w = "linear_attn_config."
    kda_layers = _one_based(lin.get("kda_layers", []), w + "kda_layers", n_layers)
    mla_layers = _one_based(lin.get("full_attn_layers", []), w + "full_attn_layers", n_layers)
    if not lin:  # no linear attention at all: every layer is MLA
        mla_layers = tuple(range(n_layers))

    # DSA settings: DeepSeek-style keys at top level or inside dsa_config (spec section 9).
    dsa = t.get("dsa_config") or {}
    if not isinstance(dsa, Mapping):
        raise ConfigError(f"dsa_config: got {dsa!r}, expected an object")

    def dsa_get(key: str, default: Any, kind: Any) -> Any:  # noqa: E306
        if key in dsa:
            return _get(dsa, key, default, kind, "dsa_config.")
        return _get(t, key, default, kind)

    dsa_list = None
    for key in ("layers", "dsa_layers", "indexer_layers", "index_layers"):
        if key in dsa:
            dsa_list = _one_based(dsa[key], "dsa_config." + key, n_layers)
            break
    if dsa_list is None:
        dsa_list = mla_layers if (dsa or "index_topk" in t) else ()

    quant = t.get("quantization_config") or raw.get("quantization_config")
    quant_method, group = None, 32
    if quant:
        if not isinstance(quant, Mapping):
            raise ConfigError(f"quantization_config: got {quant!r}, expected an object")
        fmt = str(quant.get("format", quant.get("quant_method", "")))
        if "mxfp4" in fmt:
            quant_method = "mxfp4"
        else:
            groups = quant.get("config_groups") or {}
            fmts = [str(g.get("format", "")) for g in groups.values() if isinstance(g, Mapping)]
            if any("mxfp4" in f for f in fmts):
                quant_method = "mxfp4"
            else:
                raise ConfigError(f"quantization_config.format: got {fmt!r}, expected 'mxfp4-pack-quantized'")
        for g in (quant.get("config_groups") or {}).values():
            gs = (g.get("weights") or {}).get("group_size") if isinstance(g, Mapping) else None
            if gs is not None:
                group = gs
        group = quant.get("group_size", group)

    act = _get(t, "hidden_act", "silu", str)
    situ_lin = _get(t, "activation_situ_linear_beta", 25.0 if act == "situ" else None, num)
    kw: dict[str, Any] = dict(
        architecture=architecture,
        key_prefix=key_prefix,
        dtype=str(t.get("dtype", t.get("torch_dtype", "bfloat16"))),
        vocab_size=_get(t, "vocab_size", None, int),
        hidden_size=_get(t, "hidden_size", None, int),
        num_hidden_layers=n_layers,
        rms_norm_eps=float(_get(t, "rms_norm_eps", 1e-5, num)),
        tie_word_embeddings=bool(_get(t, "tie_word_embeddings", raw.get("tie_word_embeddings", False), bool)),
        bos_token_id=t.get("bos_token_id"),
        eos_token_id=t.get("eos_token_id"),
        pad_token_id=t.get("pad_token_id"),
        max_position_embeddings=_get(t, "max_position_embeddings", 1048576, int),
        hidden_act=act,
        activation_situ_beta=float(_get(t, "activation_situ_beta", 4.0, num)),
        activation_situ_linear_beta=None if situ_lin is None else float(situ_lin),
        intermediate_size=_get(t, "intermediate_size", None, int),
        num_attention_heads=_get(t, "num_attention_heads", None, int),
        num_key_value_heads=_get(t, "num_key_value_heads", t.get("num_attention_heads"), int),
        q_lora_rank=_get(t, "q_lora_rank", None, int),
        kv_lora_rank=_get(t, "kv_lora_rank", 512, int),
        qk_nope_head_dim=_get(t, "qk_nope_head_dim", 128, int),
        qk_rope_head_dim=_get(t, "qk_rope_head_dim", 64, int),
        v_head_dim=_get(t, "v_head_dim", 128, int),
        mla_use_nope=bool(_get(t, "mla_use_nope", True, bool)),
        mla_use_output_gate=bool(_get(t, "mla_use_output_gate", False, bool)),
        mla_norm_eps=float(_get(t, "mla_norm_eps", 1e-6, num)),
        kda_num_heads=_get(lin, "num_heads", t.get("num_attention_heads"), int, w),
        kda_head_dim=_get(lin, "head_dim", 128, int, w),
        short_conv_kernel_size=_get(lin, "short_conv_kernel_size", 4, int, w),
        use_full_rank_gate=bool(_get(lin, "use_full_rank_gate", False, bool, w)),
        gate_lower_bound=None
        if lin.get("gate_lower_bound") is None
        else float(_get(lin, "gate_lower_bound", None, num, w)),
        # f_a/f_b (and Kimi-Linear's g_a/g_b) have rank = the KDA head_dim (128 in K3 and Kimi-Linear).
        kda_gate_rank=_get(lin, "gate_rank", _get(lin, "head_dim", 128, int, w), int, w),
        kda_layers=kda_layers,
        mla_layers=mla_layers,
        dsa_layers=dsa_list,
        index_n_heads=dsa_get("index_n_heads", 32, int),
        index_head_dim=dsa_get("index_head_dim", 128, int),
        index_topk=dsa_get("index_topk", 2048, int),
        indexer_rope=str(dsa_get("indexer_rope", "none", str)),
        num_experts=_get(t, "num_experts", 0, int),
        num_experts_per_token=_get(t, "num_experts_per_token", 1, int),
        num_shared_experts=_get(t, "num_shared_experts", 0, int),
        moe_intermediate_size=_get(t, "moe_intermediate_size", 0, int),
        routed_expert_hidden_size=_get(t, "routed_expert_hidden_size", None, int),
        latent_moe_use_norm=bool(_get(t, "latent_moe_use_norm", False, bool)),
        moe_router_activation_func=_get(t, "moe_router_activation_func", "sigmoid", str),
        moe_renormalize=bool(_get(t, "moe_renormalize", True, bool)),
        routed_scaling_factor=float(_get(t, "routed_scaling_factor", 1.0, num)),
        first_k_dense_replace=_get(t, "first_k_dense_replace", 0, int),
        moe_layer_freq=_get(t, "moe_layer_freq", 1, int),
        use_grouped_topk=bool(_get(t, "use_grouped_topk", False, bool)),
        num_expert_group=_get(t, "num_expert_group", 1, int),
        topk_group=_get(t, "topk_group", 1, int),
        attn_res_block_size=_get(t, "attn_res_block_size", None, int),
        quant_method=quant_method,
        quant_group_size=group,
        raw=raw,
    )
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads"):
        if kw[key] is None:
            raise ConfigError(f"{key}: missing, expected a positive integer")
    return KimiConfig(**kw)


def _to_text_config(c: KimiConfig) -> dict[str, Any]:
    one = lambda xs: [i + 1 for i in xs]  # noqa: E731  (back to the JSON's 1-based lists)
    lin: dict[str, Any] = {
        "num_heads": c.kda_num_heads,
        "head_dim": c.kda_head_dim,
        "short_conv_kernel_size": c.short_conv_kernel_size,
        "use_full_rank_gate": c.use_full_rank_gate,
        "gate_lower_bound": c.gate_lower_bound,
        "kda_layers": one(c.kda_layers),
        "full_attn_layers": one(c.mla_layers),
    }
    if c.kda_gate_rank != c.kda_head_dim:
        lin["gate_rank"] = c.kda_gate_rank
    t: dict[str, Any] = {
        "model_type": "kimi_linear",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "intermediate_size": c.intermediate_size,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "mla_use_nope": c.mla_use_nope,
        "mla_use_output_gate": c.mla_use_output_gate,
        "num_experts": c.num_experts,
        "num_experts_per_token": c.num_experts_per_token,
        "num_shared_experts": c.num_shared_experts,
        "moe_intermediate_size": c.moe_intermediate_size,
        "moe_router_activation_func": c.moe_router_activation_func,
        "moe_renormalize": c.moe_renormalize,
        "routed_scaling_factor": c.routed_scaling_factor,
        "first_k_dense_replace": c.first_k_dense_replace,
        "moe_layer_freq": c.moe_layer_freq,
        "use_grouped_topk": c.use_grouped_topk,
        "num_expert_group": c.num_expert_group,
        "topk_group": c.topk_group,
        "dtype": c.dtype,
        "linear_attn_config": lin,
    }
    if c.mla_norm_eps != 1e-6:
        t["mla_norm_eps"] = c.mla_norm_eps
    if c.hidden_act == "situ":
        t["activation_situ_beta"] = c.activation_situ_beta
        t["activation_situ_linear_beta"] = c.activation_situ_linear_beta
    if c.has_latent_moe:
        t["routed_expert_hidden_size"] = c.routed_expert_hidden_size
        t["latent_moe_use_norm"] = c.latent_moe_use_norm
    if c.has_attn_res:
        t["attn_res_block_size"] = c.attn_res_block_size
    if c.dsa_layers:
        t["dsa_config"] = {
            "index_n_heads": c.index_n_heads,
            "index_head_dim": c.index_head_dim,
            "index_topk": c.index_topk,
            "indexer_rope": c.indexer_rope,
            "layers": one(c.dsa_layers),
        }
    if c.quant_method == "mxfp4":
        t["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "float", "group_size": c.quant_group_size},
                    "format": "mxfp4-pack-quantized",
                }
            },
            "ignore": ["re:.*shared_experts.*", "re:.*self_attn.*", "re:.*mlp.*", "lm_head", "re:.*gate$"],
        }
    return t


# ---------------------------------------------------------------------------------------------- validation

_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "max_position_embeddings",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
    "kda_num_heads",
    "kda_head_dim",
    "short_conv_kernel_size",
    "kda_gate_rank",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "num_experts_per_token",
    "moe_layer_freq",
    "num_expert_group",
    "topk_group",
    "quant_group_size",
)
_NONNEGATIVE_INTS = (
    "qk_rope_head_dim",
    "num_experts",
    "num_shared_experts",
    "moe_intermediate_size",
    "first_k_dense_replace",
)
_OPTIONAL_POSITIVE_INTS = ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size")
_POSITIVE_REALS = ("rms_norm_eps", "mla_norm_eps", "activation_situ_beta", "routed_scaling_factor")
_BOOLS = (
    "tie_word_embeddings",
    "mla_use_nope",
    "mla_use_output_gate",
    "use_full_rank_gate",
    "latent_moe_use_norm",
    "moe_renormalize",
    "use_grouped_topk",
)


def _check_layer_idx(c: KimiConfig, idx: int) -> None:
    if not 0 <= idx < c.num_hidden_layers:
        raise IndexError(f"layer index: got {idx}, expected a 0-based index in [0, {c.num_hidden_layers})")


def _validate(c: KimiConfig) -> None:
    def need(ok: bool, key: str, value: Any, expected: str) -> None:
        if not ok:
            raise ConfigError(f"{key}: got {value!r}, expected {expected}")

    # Types and ranges of every scalar field first (values can also come from --set or replace(), unparsed).
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_real(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for key in _POSITIVE_INTS:
        v = getattr(c, key)
        need(is_int(v) and v >= 1, key, v, "a positive integer")
    for key in _NONNEGATIVE_INTS:
        v = getattr(c, key)
        need(is_int(v) and v >= 0, key, v, "an integer >= 0")
    for key in _OPTIONAL_POSITIVE_INTS:
        v = getattr(c, key)
        need(v is None or is_int(v) and v >= 1, key, v, "null or a positive integer")
    for key in _POSITIVE_REALS:
        v = getattr(c, key)
        need(is_real(v) and v > 0, key, v, "a finite positive number")
    for key in _BOOLS:
        v = getattr(c, key)
        need(isinstance(v, bool), key, v, "true or false")
    v = c.activation_situ_linear_beta
    need(v is None or is_real(v) and v > 0, "activation_situ_linear_beta", v, "null or a finite positive number")
    v = c.gate_lower_bound
    need(
        v is None or is_real(v) and v < 0, "linear_attn_config.gate_lower_bound", v, "null or a finite negative number"
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(c, key)
        need(v is None or is_int(v) and 0 <= v < c.vocab_size, key, v, f"null or a token id in [0, {c.vocab_size})")
    for key in ("kda_layers", "mla_layers", "dsa_layers"):
        v = getattr(c, key)
        need(
            isinstance(v, tuple) and all(is_int(i) and 0 <= i < c.num_hidden_layers for i in v),
            key,
            v,
            f"a tuple of 0-based layer indices in [0, {c.num_hidden_layers})",
        )
    need(c.hidden_act in _ACTIVATIONS, "hidden_act", c.hidden_act, f"one of {list(_ACTIVATIONS)}")
    need(
        c.moe_router_activation_func in _ROUTER_ACTIVATIONS,
        "moe_router_activation_func",
        c.moe_router_activation_func,
        f"one of {list(_ROUTER_ACTIVATIONS)}",
    )
    need(c.indexer_rope in _INDEXER_ROPE, "indexer_rope", c.indexer_rope, f"one of {list(_INDEXER_ROPE)}")
    need(c.rms_norm_eps > 0, "rms_norm_eps", c.rms_norm_eps, "a positive number")
    need(c.mla_norm_eps > 0, "mla_norm_eps", c.mla_norm_eps, "a positive number")
    need(c.dtype in ("bfloat16", "float32", "float16"), "dtype", c.dtype, "'bfloat16', 'float16' or 'float32'")
    need(
        c.num_key_value_heads == c.num_attention_heads,
        "num_key_value_heads",
        c.num_key_value_heads,
        f"{c.num_attention_heads} (= num_attention_heads; MLA has no GQA)",
    )
    need(c.index_topk >= 1, "index_topk", c.index_topk, "an integer >= 1")
    if c.gate_lower_bound is not None:
        need(
            c.gate_lower_bound < 0,
            "linear_attn_config.gate_lower_bound",
            c.gate_lower_bound,
            "a negative number or null",
        )

    # Layer lists: every layer in exactly one of kda_layers / full_attn_layers (1-based in the JSON).
    n = c.num_hidden_layers
    kda, mla = set(c.kda_layers), set(c.mla_layers)
    both = sorted(kda & mla)
    need(
        not both,
        "linear_attn_config",
        [i + 1 for i in both],
        "no layer in both kda_layers and full_attn_layers (1-based numbers shown)",
    )
    neither = sorted(set(range(n)) - kda - mla)
    need(
        not neither,
        "linear_attn_config",
        [i + 1 for i in neither],
        "every layer in kda_layers or full_attn_layers (1-based numbers of the missing layers shown)",
    )
    stray = sorted(set(c.dsa_layers) - mla)
    need(not stray, "dsa_config.layers", [i + 1 for i in stray], "only full-attention (MLA) layers (1-based shown)")

    if kda:  # KDA widths
        need(
            c.kda_num_heads * c.kda_head_dim > 0, "linear_attn_config.num_heads", c.kda_num_heads, "a positive integer"
        )
    if c.hidden_act == "situ":
        need(c.activation_situ_beta > 0, "activation_situ_beta", c.activation_situ_beta, "a positive number")

    # MoE
    n_moe = sum(1 for i in range(n) if i >= c.first_k_dense_replace and i % c.moe_layer_freq == 0)
    need(c.first_k_dense_replace >= 0, "first_k_dense_replace", c.first_k_dense_replace, "an integer >= 0")
    if n_moe:
        need(c.num_experts >= 1, "num_experts", c.num_experts, "a positive integer (MoE layers are present)")
        need(
            1 <= c.num_experts_per_token <= c.num_experts,
            "num_experts_per_token",
            c.num_experts_per_token,
            f"an integer in [1, num_experts={c.num_experts}]",
        )
        need(c.moe_intermediate_size >= 1, "moe_intermediate_size", c.moe_intermediate_size, "a positive integer")
        need(c.num_shared_experts >= 0, "num_shared_experts", c.num_shared_experts, "an integer >= 0")
        need(
            c.num_expert_group >= 1 and c.num_experts % c.num_expert_group == 0,
            "num_expert_group",
            c.num_expert_group,
            f"a positive divisor of num_experts={c.num_experts}",
        )
        need(
            1 <= c.topk_group <= c.num_expert_group,
            "topk_group",
            c.topk_group,
            f"an integer in [1, num_expert_group={c.num_expert_group}]",
        )
        if c.routed_expert_hidden_size is not None:
            need(
                c.routed_expert_hidden_size >= 1,
                "routed_expert_hidden_size",
                c.routed_expert_hidden_size,
                "null or a positive integer",
            )
        if c.quant_method == "mxfp4":
            d_in = c.routed_expert_hidden_size or c.hidden_size
            for key, width in (
                ("routed_expert_hidden_size (expert w1/w3 input)", d_in),
                ("moe_intermediate_size (expert w2 input)", c.moe_intermediate_size),
            ):
                need(
                    width % c.quant_group_size == 0 and width % 2 == 0,
                    key,
                    width,
                    f"a multiple of the MXFP4 group size {c.quant_group_size}",
                )
    if c.quant_method is not None:
        need(c.quant_method == "mxfp4", "quantization_config.format", c.quant_method, "'mxfp4-pack-quantized'")
        need(c.quant_group_size == 32, "quantization_config.group_size", c.quant_group_size, "32 (MXFP4)")
    if c.has_attn_res:
        need(c.attn_res_block_size >= 1, "attn_res_block_size", c.attn_res_block_size, "null or a positive integer")


# ---------------------------------------------------------------------------------------------- presets


def _k31_pro() -> KimiConfig:
    """The published K3 text_config (spec 1.2) plus the K3.1 indexer (spec 1.4)."""
    n = 93
    mla = tuple(i for i in range(n) if (i + 1) % 4 == 0) + (92,)  # 1-based 4, 8, ..., 92, 93
    kda = tuple(i for i in range(n) if i not in mla)
    return KimiConfig(kda_layers=kda, mla_layers=mla, dsa_layers=mla)


def _k3() -> KimiConfig:
    return _k31_pro().replace(dsa_layers=())


def _tiny() -> KimiConfig:
    """The embedded default: every kind of layer and feature, small enough for CPU tests.

    9 layers in the real pattern (1-based MLA at 4, 8 and the last, 9; KDA elsewhere), every MLA layer DSA,
    layer 0 dense, latent MoE with MXFP4 experts after it, AttnRes blocks of 4 (block writes at 0, 4, 8: three
    stored blocks, four sources in the final mix), K != V in MLA (qk 24, v 16), index_topk 64 so that a few
    hundred tokens exercise real sparse selection. Byte-level vocabulary (256 bytes + specials).
    """
    n = 9
    mla = (3, 7, 8)
    return KimiConfig(
        vocab_size=512,
        hidden_size=96,
        num_hidden_layers=n,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        max_position_embeddings=8192,
        intermediate_size=192,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        kda_num_heads=4,
        kda_head_dim=16,
        kda_gate_rank=16,
        kda_layers=tuple(i for i in range(n) if i not in mla),
        mla_layers=mla,
        dsa_layers=mla,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=64,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=2,
        moe_intermediate_size=32,
        routed_expert_hidden_size=64,
        attn_res_block_size=4,
    )


def _tiny_linear() -> KimiConfig:
    """A tiny Kimi-Linear-shaped config (``KimiLinearForCausalLM``): softplus decay gate, low-rank output gate,
    SiLU-gated MLPs, a standard MoE with ``routed_scaling_factor``, MLA without q-LoRA and without output gate,
    plain residuals, no indexer, no quantisation, keys without the ``language_model.`` prefix."""
    n = 6
    mla = (3, 5)
    return _tiny().replace(
        architecture="KimiLinearForCausalLM",
        key_prefix="",
        num_hidden_layers=n,
        kda_layers=tuple(i for i in range(n) if i not in mla),
        mla_layers=mla,
        dsa_layers=(),
        gate_lower_bound=None,
        use_full_rank_gate=False,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        hidden_act="silu",
        activation_situ_linear_beta=None,
        q_lora_rank=None,
        mla_use_output_gate=False,
        routed_expert_hidden_size=None,
        latent_moe_use_norm=False,
        num_shared_experts=1,
        routed_scaling_factor=2.446,
        attn_res_block_size=None,
        quant_method=None,
    )


PRESETS = {"k3.1-pro": _k31_pro, "k3": _k3, "tiny": _tiny, "tiny-linear": _tiny_linear}


def load_config(
    preset: str | None = None, config: str | Path | None = None, checkpoint: str | Path | None = None
) -> KimiConfig:
    """Exactly one source: a preset name, a config.json path, or a checkpoint directory.

    Raises:
        ConfigError: none or several sources, or an unknown preset.
    """
    given = [x for x in (preset, config, checkpoint) if x is not None]
    if len(given) > 1:
        raise ConfigError("config source: got several of --preset/--config/--checkpoint, expected one")
    if checkpoint is not None:
        return KimiConfig.from_json(Path(checkpoint) / "config.json")
    if config is not None:
        return KimiConfig.from_json(config)
    name = preset or "tiny"
    if name not in PRESETS:
        raise ConfigError(f"preset: got {name!r}, expected one of {sorted(PRESETS)}")
    return PRESETS[name]()
