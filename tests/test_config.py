"""Config parsing, presets, refusals and parameter counts (spec 1, 9; cases.md 16)."""

import copy
import json

import pytest

from kimi.config import ConfigError, KimiConfig, load_config
from kimi.layout import layer_plan, param_counts, param_layout, stored_layout

# The published K3 config.json in its top-level multimodal form (spec 1.1 / 1.2), text part verbatim from the spec.
K3_KDA_1B = [n for n in range(1, 92) if n % 4 != 0]
K3_FULL_1B = list(range(4, 93, 4)) + [93]
PUBLISHED_K3 = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "media_placeholder_token_id": 163605,
    "tie_word_embeddings": False,
    "vision_config": {"patch_size": 14, "vt_hidden_size": 1152},
    "text_config": {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "num_hidden_layers": 93,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "intermediate_size": 33792,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576,
        "tie_word_embeddings": False,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "attn_res_block_size": 12,
        "dtype": "bfloat16",
        "eos_token_id": 163586,
        "linear_attn_config": {
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
            "kda_layers": K3_KDA_1B,
            "full_attn_layers": K3_FULL_1B,
        },
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {
                "group_0": {"weights": {"num_bits": 4, "group_size": 32}, "format": "mxfp4-pack-quantized"}
            },
            "ignore": ["re:.*shared_experts.*"],
        },
    },
}


def k31_json():
    d = copy.deepcopy(PUBLISHED_K3)
    d["architectures"] = ["KimiK31ForConditionalGeneration"]
    d["text_config"]["dsa_config"] = {
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
        "layers": K3_FULL_1B,
    }
    return d


def test_published_k3_parses_and_equals_preset():
    cfg = KimiConfig.from_dict(PUBLISHED_K3)
    assert cfg == load_config("k3")
    assert cfg.key_prefix == "language_model."
    assert len(cfg.kda_layers) == 69 and len(cfg.mla_layers) == 24
    assert cfg.mla_layers[:3] == (3, 7, 11) and cfg.mla_layers[-2:] == (91, 92)  # last two both MLA (case 16)
    assert cfg.gate_lower_bound == -5.0 and cfg.use_full_rank_gate and cfg.quant_method == "mxfp4"
    assert cfg.mla_norm_eps == 1e-6 and cfg.rms_norm_eps == 1e-5
    assert cfg.mla_softmax_scale == pytest.approx(192**-0.5)
    assert cfg.dsa_layers == ()


def test_k31_dsa_config_parses_and_equals_preset():
    cfg = KimiConfig.from_dict(k31_json())
    assert cfg == load_config("k3.1-pro")
    assert cfg.dsa_layers == cfg.mla_layers and cfg.index_topk == 2048 and cfg.index_n_heads == 32


def test_dsa_keys_at_text_config_top_level():
    d = copy.deepcopy(PUBLISHED_K3)
    d["text_config"].update(index_n_heads=16, index_head_dim=64, index_topk=512)
    cfg = KimiConfig.from_dict(d)
    assert cfg.dsa_layers == cfg.mla_layers and (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (16, 64, 512)


def test_bare_text_config_and_roundtrip(tmp_path):
    d = copy.deepcopy(k31_json()["text_config"])
    d.update(architectures=["KimiK3ForCausalLM"], bos_token_id=163584, pad_token_id=163839)
    cfg = KimiConfig.from_dict(d)
    assert cfg == load_config("k3.1-pro")
    for name in ("k3.1-pro", "k3", "tiny"):
        c = load_config(name)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(c.to_dict()))
        assert KimiConfig.from_json(path) == c


def test_k31_counts_from_shapes():
    counts = param_counts(load_config("k3.1-pro"))
    assert abs(counts["total_params"] / 2.78e12 - 1) < 0.005
    assert abs(counts["active_params"] / 104e9 - 1) < 0.015
    k3 = param_counts(load_config("k3"))
    # The indexers add about 0.18 B (spec 0).
    assert 0.15e9 < counts["total_params"] - k3["total_params"] < 0.21e9


def test_layer_plan_k31():
    plan = layer_plan(load_config("k3.1-pro"))
    assert [p.index for p in plan if p.block_write] == [0, 12, 24, 36, 48, 60, 72, 84]
    assert plan[0].mlp == "dense" and all(p.mlp == "moe" for p in plan[1:])
    assert [p.attention for p in plan].count("dsa") == 24


def test_tiny_has_every_feature():
    c = load_config("tiny")
    plan = layer_plan(c)
    kinds = [p.attention for p in plan]
    assert kinds[-1] == "dsa" and "kda" in kinds and kinds.count("dsa") >= 2
    assert plan[0].mlp == "dense" and plan[1].mlp == "moe"
    assert sum(p.block_write for p in plan) >= 2
    assert c.has_latent_moe and c.quant_method == "mxfp4" and c.gate_lower_bound is not None
    assert c.index_topk < 300 and c.v_head_dim != c.qk_head_dim
    names = {s.name for s in stored_layout(c)}
    assert "model.layers.3.self_attn.indexer.k_norm.bias" in names
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in names
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in {s.name for s in param_layout(c)}


def _text(mut):
    d = copy.deepcopy(PUBLISHED_K3)
    mut(d["text_config"])
    return d


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda t: t["linear_attn_config"].update(kda_layers=K3_KDA_1B + [4]), "no layer in both"),
        (
            lambda t: t["linear_attn_config"].update(kda_layers=K3_KDA_1B[1:]),
            "every layer in kda_layers or full_attn_layers",
        ),
        (lambda t: t["linear_attn_config"].update(kda_layers=[n - 1 for n in K3_KDA_1B]), "1-based"),
        (lambda t: t["linear_attn_config"].update(full_attn_layers=K3_FULL_1B[:-1] + [94]), "out of range"),
        (lambda t: t.update(num_key_value_heads=8), "num_key_value_heads"),
        (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
        (lambda t: t.update(dsa_config={"index_topk": 0}), "index_topk"),
        (lambda t: t.update(num_experts_per_token=1000), "num_experts_per_token"),
        (lambda t: t.update(hidden_size="7168"), "hidden_size"),
        (lambda t: t.update(dsa_config={"layers": [1, 4]}), "dsa_config.layers"),
        (lambda t: t["linear_attn_config"].update(gate_lower_bound=5.0), "gate_lower_bound"),
        (lambda t: t.update(quantization_config={"format": "nvfp4"}), "quantization_config"),
        (lambda t: t.update(intermediate_size=0), "intermediate_size"),
        (lambda t: t.update(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
        (lambda t: t.update(activation_situ_linear_beta="a"), "activation_situ_linear_beta"),
        (lambda t: t.update(num_hidden_layers=0), "num_hidden_layers"),
        (lambda t: t.update(eos_token_id=10**9), "eos_token_id"),
        (
            lambda t: t["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size="32"),
            "quant_group_size",
        ),
    ],
)
def test_refusals_name_key_and_value(mutate, needle):
    with pytest.raises(ConfigError, match="got") as e:
        KimiConfig.from_dict(_text(mutate))
    assert needle in str(e.value)


def test_unknown_architecture_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="architectures"):
        KimiConfig.from_dict({"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match="no file"):
        KimiConfig.from_json(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        KimiConfig.from_json(tmp_path)
    with pytest.raises(ConfigError, match="preset"):
        load_config("k9")


def test_replace_is_validated_too():
    with pytest.raises(ConfigError, match="index_topk: got None"):
        load_config("tiny").replace(index_topk=None)
    with pytest.raises(ConfigError, match="num_experts: got 3.5"):
        load_config("tiny").replace(num_experts=3.5)


def test_truncated_keeps_first_layers():
    c = load_config("k3.1-pro").truncated(4)
    assert c.num_hidden_layers == 4 and c.kda_layers == (0, 1, 2) and c.dsa_layers == (3,)
    with pytest.raises(ConfigError, match="layers"):
        load_config("tiny").truncated(0)
