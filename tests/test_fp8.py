"""``kernels_torch.fp8`` on the CPU: the refusals, which projections the conversion selects, that FP8 reaches every
one of them in the forward (the KDA layer's fused projections node bypassed), the FP8 error size of one converted
GEMM (torchao's emulation: FP8 rounding, high-precision GEMMs), the grouped experts' contract with torchao's weight
wrapper (a stand-in ``GroupedExperts`` of the lead's shape; torchao's FP8 grouped GEMM replaced by a checker of its
own preconditions, since it runs on SM90 only), and ``kimi compare --fp8``'s refusals and plumbing.

torchao is in the ``dev`` extra: its Python API runs beside the CPU torch."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers import check_rel, rel
from test_kda_cudnn_prep import stub_layer
from torch import nn

import kernels_torch.fp8 as fp8
import kernels_torch.kda as tk
import kernels_torch.kda_cudnn as kc
from kernels_torch.model import KimiK3Model
from kimi.config import load_config

TOL_FP8_OUT = 6e-2  # one emulated FP8 GEMM's output against fp64: e4m3 rounding of x and W (measured 3.7%)
TOL_FP8_GRAD = {"rowwise": 6e-2, "tensorwise": 1e-1}  # dx, dW: e4m3 (rowwise) or e5m2 (tensorwise) gradients
MIN_FP8_EFFECT = 1e-2  # FP8 rounding must show: an fp32 linear is 1e-6 off fp64
TOL_SAME_PRODUCT = 1e-6  # fp32 products of the same numbers in groups padded differently
TOL_SAME_FP8 = 1e-5  # the same FP8 casts and products, two code paths (cudnn stand-in layer vs eager layer)


def tiny_model(seed: int = 0, backend: str = "eager") -> KimiK3Model:
    cfg = load_config("tiny")
    torch.manual_seed(seed)
    model = KimiK3Model(cfg, backend=backend)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


# ---------------------------------------------------------------------------------------------- refusals


def fake_cuda(monkeypatch, cap, name="NVIDIA TEST"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_check_fp8_supported_refuses_the_cpu_and_older_gpus(monkeypatch):
    """CPU and a CUDA device below 8.9 are refused, naming the device, its name and capability; 8.9 (Ada) runs the
    dense GEMMs but not the grouped ones, which need 9.0 or 10.0 exactly (12.0 is refused too)."""
    with pytest.raises(fp8.FP8UnsupportedError, match="got device 'cpu'"):
        fp8.check_fp8_supported("cpu")
    fake_cuda(monkeypatch, (8, 0), "NVIDIA A100")
    with pytest.raises(
        fp8.FP8UnsupportedError, match=r"cuda:0 \(NVIDIA A100\) has compute capability 8.0, expected >= 8.9"
    ):
        fp8.check_fp8_supported("cuda:0")
    fake_cuda(monkeypatch, (8, 9), "NVIDIA L40S")
    assert fp8.check_fp8_supported("cuda") == (8, 9)
    with pytest.raises(fp8.FP8UnsupportedError, match=r"capability 8.9; the grouped .* runs on 9.0 or 10.0 only"):
        fp8.check_fp8_supported("cuda", grouped=True)
    fake_cuda(monkeypatch, (12, 0), "NVIDIA RTX PRO 6000")
    assert fp8.check_fp8_supported("cuda") == (12, 0)
    with pytest.raises(fp8.FP8UnsupportedError, match="12.0"):
        fp8.check_fp8_supported("cuda", grouped=True)
    fake_cuda(monkeypatch, (9, 0), "NVIDIA H200")
    assert fp8.check_fp8_supported("cuda", grouped=True) == (9, 0)
    assert issubclass(fp8.FP8UnsupportedError, ValueError)  # the CLI's one-line error path


def test_conversion_refuses_bad_arguments():
    model = tiny_model()
    with pytest.raises(ValueError, match="fp8 recipe: got 'fp4'"):
        fp8.convert_model_to_fp8(model, "fp4", emulate=True)
    with pytest.raises(ValueError, match="tensorwise recipe only, got 'rowwise'"):
        fp8.convert_model_to_fp8(model, "rowwise", emulate=True, fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match=r"exclude: '\*\.nothing' matches no FP8 candidate"):
        fp8.convert_model_to_fp8(model, "rowwise", emulate=True, exclude=["*.nothing"])
    with pytest.raises(fp8.FP8UnsupportedError, match="got device 'cpu'"):  # no emulation: the CPU is refused
        fp8.convert_model_to_fp8(model, "rowwise")
    with pytest.raises(ValueError, match="holds no FP8 candidate"):
        fp8.convert_model_to_fp8(nn.Sequential(nn.Linear(32, 32)), "rowwise", emulate=True)
    with torch.device("meta"):
        meta = KimiK3Model(load_config("tiny"))
    with pytest.raises(ValueError, match="on 'meta'; pass device="):
        fp8.convert_model_to_fp8(meta, "rowwise", emulate=True)
    assert getattr(model, "fp8", None) is None  # nothing half-done by the refusals
    fp8.convert_model_to_fp8(model, "rowwise", emulate=True)
    with pytest.raises(ValueError, match="already converted to FP8 .recipe 'rowwise'"):
        fp8.convert_model_to_fp8(model, "tensorwise", emulate=True)


# ---------------------------------------------------------------------------------------------- selection


def test_conversion_selects_the_documented_projections_only(tmp_path):
    """Exactly the projections of FP8_LINEARS become Float8Linear, less the default exclusions (KDA f_a / f_b / b),
    the DSA layers' absorbed kv_b_proj and the widths not a multiple of 16 (tiny's kv_a_proj_with_mqa: 40), each
    listed with its reason; lm_head, the router, the indexer and the AttnRes projections stay plain. The parameter
    names are the checkpoint's, the record sits on the model, and the converted model saves in the real layout."""
    from kernels_torch.model import load_model, save_model

    model, plain = tiny_model(), tiny_model()
    keys = list(model.state_dict())
    rec = fp8.convert_model_to_fp8(model, "tensorwise", emulate=True)
    assert model.fp8 is rec and rec.recipe == "tensorwise" and fp8.fp8_record(model)["linears"] == len(rec.linears)
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted == set(rec.linears) and len(converted) > 50
    owners = {type(m).__name__: m for m in model.modules()}
    for name in converted:
        leaf = name.rsplit(".", 1)[1]
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        assert leaf in fp8.FP8_LINEARS[type(owner).__name__], name
    skipped = dict(rec.skipped)
    kda, dsa = load_config("tiny").kda_layers[0], load_config("tiny").dsa_layers[0]
    for leaf in ("f_a_proj", "f_b_proj", "b_proj"):
        assert skipped[f"model.layers.{kda}.self_attn.{leaf}"] in ("excluded", "width not a multiple of 16")
    assert skipped[f"model.layers.{dsa}.self_attn.kv_b_proj"] == "absorbed kv_b_proj (DSA)"
    assert skipped[f"model.layers.{dsa}.self_attn.kv_a_proj_with_mqa"] == "width not a multiple of 16"
    for name, m in model.named_modules():
        if name.endswith(("lm_head", "indexer.wq_b", "indexer.wk", "indexer.weights_proj", "_res_proj")):
            assert type(m) is nn.Linear, name
    assert "MoEGate" in owners and type(owners["MoEGate"]).__name__ == "MoEGate"  # the router is no Linear at all
    assert list(model.state_dict()) == keys
    save_model(model, tmp_path / "fp8")  # the trainer's export: Float8Linear holds the plain weight parameter
    save_model(plain, tmp_path / "plain")
    a, b = (load_model(tmp_path / d, dtype=torch.float32).state_dict() for d in ("fp8", "plain"))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    every = fp8.convert_model_to_fp8(tiny_model(), "rowwise", emulate=True, exclude=())
    assert f"model.layers.{kda}.self_attn.f_b_proj" in every.linears  # exclude=() takes the KDA gate in too


def test_lora_base_layers_are_converted_and_adapters_kept():
    """With LoRA applied first (peft wraps plain nn.Linear only), the frozen base_layer of each wrapped projection
    becomes Float8Linear and the adapters stay plain; the model still runs."""
    from kimi_tools.lora import LoraSettings, apply_lora

    model = tiny_model()
    wrapped = apply_lora(model, LoraSettings(rank=4, alpha=8.0))
    rec = fp8.convert_model_to_fp8(model, "rowwise", emulate=True)
    bases = [n for n in rec.linears if n.endswith(".base_layer")]
    assert bases and {n.removesuffix(".base_layer") for n in bases} <= set(wrapped)
    for name in bases:
        lora = model.get_submodule(name.removesuffix(".base_layer"))
        assert type(lora.lora_A["default"]) is nn.Linear and type(lora.lora_B["default"]) is nn.Linear
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 512, (1, 9)))).all()


# ---------------------------------------------------------------------------------------------- FP8 reaches them


def count_calls(model) -> dict[str, int]:
    calls: dict[str, int] = {}
    for name, m in model.named_modules():
        if type(m).__name__ == "Float8Linear":
            calls[name] = 0
            m.register_forward_hook(lambda mod, inp, out, name=name: calls.__setitem__(name, calls[name] + 1))
    return calls


def test_every_converted_projection_runs_in_the_forward():
    """Each Float8Linear is called in a forward of the eager model (the KDA layers' projections too, which the layer
    applies through kernels_torch.common.linear rather than as module calls), and the logits move by FP8 rounding."""
    ref = tiny_model()
    model = tiny_model()
    fp8.convert_model_to_fp8(model, "rowwise", emulate=True)
    calls = count_calls(model)
    ids = torch.randint(0, 512, (1, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, want = model(ids), ref(ids)
    assert [n for n, c in calls.items() if c == 0] == []
    assert rel(out, want) > MIN_FP8_EFFECT


def test_cudnn_kda_layer_runs_its_projections_in_fp8_not_the_fused_node(monkeypatch):
    """On the cudnn backend (the CPU stand-in layer) a converted KDA layer does not take its six projections of x
    from the shared_input_linears node (which reads .weight, so FP8 would not reach them): each Float8Linear runs,
    and the output equals the eager layer's under the same conversion (same FP8 casts and products)."""
    layer, x = stub_layer(monkeypatch, T=63)
    eager = tk.KimiDeltaAttention(layer.config, layer.layer_idx, backend="eager")
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    eager.load_state_dict(layer.state_dict())
    with torch.no_grad():
        plain = layer(x)[0]
    for m in (layer, eager):
        fp8.convert_model_to_fp8(m, "rowwise", emulate=True)
    calls = count_calls(layer)

    def fused(*args, **kwargs):
        raise AssertionError("shared_input_linears ran on FP8 projections: it reads .weight and skips their FP8")

    monkeypatch.setattr(kc, "shared_input_linears", fused)
    with torch.no_grad():
        out, want = layer(x)[0], eager(x)[0]
    assert calls and all(c == 1 for c in calls.values()), calls
    assert rel(out, want) < TOL_SAME_FP8
    assert rel(out, plain) > MIN_FP8_EFFECT


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("T", [1, 63, 2049])
def test_one_fp8_projection_errors_are_fp8_sized(recipe, T):
    """A converted DenseMLP's down_proj (fp32 model, emulated FP8) against the fp64 product: output, input gradient
    and weight gradient within the FP8 bounds, and off by more than fp32 rounding (FP8 did run). The recipe picks
    the gradients' format: e5m2 under tensorwise, e4m3 under rowwise."""
    from kernels_torch.moe import DenseMLP

    torch.manual_seed(T)
    mlp = DenseMLP(load_config("tiny"), 192)
    fp8.convert_model_to_fp8(mlp, recipe, emulate=True)
    lin = mlp.down_proj
    grad_dtype = torch.float8_e5m2 if recipe == "tensorwise" else torch.float8_e4m3fn
    assert lin.config.cast_config_grad_output.target_dtype == grad_dtype
    assert lin.config.cast_config_input.target_dtype == torch.float8_e4m3fn
    with torch.no_grad():
        lin.weight.normal_(0.0, lin.in_features**-0.5)
    x = torch.randn(T, lin.in_features, requires_grad=True)
    dy = torch.randn(T, lin.out_features)
    y = lin(x)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(True), lin.weight.detach().double().requires_grad_(True)
    y64 = x64 @ w64.T
    y64.backward(dy.double())
    for name, a, b, tol in (
        ("out", y, y64, TOL_FP8_OUT),
        ("dx", x.grad, x64.grad, TOL_FP8_GRAD[recipe]),
        ("dw", lin.weight.grad, w64.grad, TOL_FP8_GRAD[recipe]),
    ):
        assert MIN_FP8_EFFECT < rel(a, b) < tol, (name, rel(a, b))


def test_compiled_fp8_projections_equal_the_eager_ones():
    """``compile_linears=True`` compiles each converted projection (``nn.Module.compile``, inductor on the CPU here;
    its row-padding hooks inside) and records it; forward, input gradient and weight gradients equal the eager
    FP8 module's at an unaligned token count (T = 63: the padding runs inside the compiled call)."""
    from kernels_torch.moe import DenseMLP

    torch.manual_seed(5)
    mlps = [DenseMLP(load_config("tiny"), 192) for _ in range(2)]
    mlps[1].load_state_dict(mlps[0].state_dict())
    eager = fp8.convert_model_to_fp8(mlps[0], "rowwise", emulate=True)
    comp = fp8.convert_model_to_fp8(mlps[1], "rowwise", emulate=True, compile_linears=True)
    assert not eager.compiled and comp.compiled and comp.to_dict()["compiled"]
    assert all(getattr(mlps[1], n)._compiled_call_impl is not None for n in ("gate_proj", "up_proj", "down_proj"))
    assert torch._dynamo.config.cache_size_limit >= fp8.COMPILE_CACHE_LIMIT
    x = torch.randn(1, 63, mlps[0].gate_proj.in_features)
    xs = [x.clone().requires_grad_(True) for _ in mlps]
    ys = [m(xi) for m, xi in zip(mlps, xs, strict=True)]
    dy = torch.randn_like(ys[0])
    for y in ys:
        y.backward(dy)
    check_rel("out", ys[1], ys[0], TOL_SAME_FP8)
    check_rel("dx", xs[1].grad, xs[0].grad, TOL_SAME_FP8)
    for n in ("gate_proj", "up_proj", "down_proj"):
        check_rel(f"d{n}", getattr(mlps[1], n).weight.grad, getattr(mlps[0], n).weight.grad, TOL_SAME_FP8)


TOL_PAD_ROWS = 1e-6  # zero rows padded onto the tokens: the same FP8 casts, only the GEMM's row count differs


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("T", [1, 63, 2049, 64])
def test_fp8_projection_pads_tokens_to_a_multiple_of_16(recipe, T):
    """``torch._scaled_mm`` reduces over the tokens in the weight gradient and needs their count a multiple of 16:
    a converted projection sees ``[ceil16(B T), in]`` rows (zero rows added), gives ``[B, T, out]`` and the same
    output and gradients as the same FP8 projection without the padding; an aligned input passes untouched."""
    from kernels_torch.moe import DenseMLP

    torch.manual_seed(T)
    mlps = [DenseMLP(load_config("tiny"), 192) for _ in range(2)]
    mlps[1].load_state_dict(mlps[0].state_dict())
    for m in mlps:
        fp8.convert_model_to_fp8(m, recipe, emulate=True)
    padded, bare = mlps[0].down_proj, mlps[1].down_proj
    bare._forward_pre_hooks.clear()
    bare._forward_hooks.clear()
    seen = []
    padded.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))  # runs after the padding hook
    x = torch.randn(2, T, padded.in_features)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    dy = torch.randn(2, T, padded.out_features)
    ys = [lin(xi) for lin, xi in zip((padded, bare), xs)]
    for y in ys:
        y.backward(dy)
    rows = -(-2 * T // 16) * 16
    assert seen[0].shape == ((2, T, padded.in_features) if 2 * T == rows else (rows, padded.in_features))
    assert (seen[0] is xs[0]) == (2 * T == rows)
    assert torch.equal(seen[0].reshape(-1, padded.in_features)[2 * T :], torch.zeros(rows - 2 * T, padded.in_features))
    assert ys[0].shape == (2, T, padded.out_features)
    for name, a, b in (
        ("out", ys[0], ys[1]),
        ("dx", xs[0].grad, xs[1].grad),
        ("dw", padded.weight.grad, bare.weight.grad),
    ):
        check_rel(name, a, b, TOL_PAD_ROWS)


# ---------------------------------------------------------------------------------------------- grouped experts


class Holder(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts


def grouped_experts(E: int = 4, I: int = 32, Dl: int = 48, backend: str = "cudnn", seed: int = 0) -> Holder:
    """A ``kernels_torch.moe.GroupedExperts`` of E experts (I, Dl widths; on the ``grouped_mm`` kernel, which also
    runs on the CPU) with fresh random weights, inside a holder module (the conversion walks a model)."""
    from kernels_torch.moe import GroupedExperts

    cfg = load_config("tiny").replace(quant_method=None, moe_intermediate_size=I)
    torch.manual_seed(seed)
    experts = GroupedExperts(cfg, Dl, backend=backend, num_experts=E)
    experts.moe_kernel = "grouped_mm" if backend == "cudnn" else None
    return Holder(experts)


def fp8_grouped_checker(monkeypatch):
    """Replace torchao's dispatch to its FP8 grouped GEMM (``_quantize_then_scaled_grouped_mm``, which the weight
    wrapper calls for ``torch._grouped_mm``) by a check of the preconditions its FP8 forward asserts, then the plain
    product; the device check passes (an SM90 stand-in). Returns the list of calls it saw."""
    import torchao.prototype.moe_training.tensor as wrapper_module

    seen = []

    def checked(A, B_t, config, offs=None, bias=None):
        assert A.ndim == 2 and A.stride(-1) == 1 and A.shape[1] % 16 == 0, ("A", A.shape, A.stride())
        assert A.shape[0] % 16 == 0, ("A's rows (read transposed by the weight gradient) not a multiple of 16", A.shape)
        assert B_t.ndim == 3 and B_t.stride(-2) == 1 and B_t.shape[1] % 16 == 0 and B_t.shape[2] % 16 == 0, (
            "B_t column-major per expert",
            B_t.shape,
            B_t.stride(),
        )
        assert offs is not None and offs.dtype == torch.int32, offs
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        assert bool((sizes % 16 == 0).all()), ("rows per expert not a multiple of 16", sizes.tolist())
        seen.append((tuple(A.shape), tuple(B_t.shape), A.detach().clone()))
        return torch._grouped_mm(A, B_t, offs=offs)

    monkeypatch.setattr(wrapper_module, "_quantize_then_scaled_grouped_mm", checked)
    monkeypatch.setattr(fp8, "check_fp8_supported", lambda device, grouped=False: (9, 0))
    return seen


@pytest.mark.parametrize("align,want", [(1, 16), (24, 48), (32, 32)])
def test_grouped_experts_reach_torchaos_fp8_grouped_gemm(monkeypatch, align, want):
    """The conversion wraps the GroupedExperts weights in torchao's Float8TrainingWeightWrapperTensor and raises
    ``align`` to a multiple of 16; the module's three torch._grouped_mm calls then go to torchao's FP8 grouped GEMM
    with its preconditions met (row-major x, per-expert column-major weights, int32 offsets, 16-row groups: experts
    routed 0, 1 and many rows), forward and backward give what the plain module gives, and the parameter names are
    unchanged."""
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    seen = fp8_grouped_checker(monkeypatch)
    E, I, Dl, N, k = 4, 32, 48, 21, 2
    model, ref = grouped_experts(E, I, Dl), grouped_experts(E, I, Dl)
    model.experts.align = ref.experts.align = align
    rec = fp8.convert_model_to_fp8(model, "tensorwise", device="cpu")
    assert rec.grouped_experts == ("experts",) and rec.grouped_recipe == "fp8_rowwise" and rec.linears == ()
    assert model.experts.align == want
    assert all(isinstance(p, Float8TrainingWeightWrapperTensor) for p in model.experts.parameters())
    assert list(model.state_dict()) == list(ref.state_dict())
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.full((N,), 2), torch.randint(0, 2, (N,), generator=g) * 3], 1)  # expert 1: no row
    ids[0, 1] = 0 if int((ids[:, 1] == 0).sum()) != 1 else 3
    weights = torch.rand(N, k, generator=g)
    z = torch.randn(N, Dl, generator=g)
    dr = torch.randn(N, Dl, generator=g)
    zs = [z.clone().requires_grad_(True) for _ in range(2)]
    from kernels_torch.ops.moe_grouped import expert_layout

    lay = expert_layout(ids, E, want)

    def nan_then_free():  # freed memory of the permuted rows' size, for the allocator to hand out next
        junk = torch.full((lay.rows, Dl), float("nan"), dtype=z.dtype)
        del junk

    outs = []
    for m, zi in zip((model, ref), zs):
        nan_then_free()
        outs.append(m.experts(zi, ids, weights))
    for o in outs:
        o.backward(dr)
    assert len(seen) == 3 and [s[1] for s in seen] == [(E, Dl, I), (E, Dl, I), (E, I, Dl)]
    pad = torch.ones(lay.rows, dtype=torch.bool)
    pad[lay.row_of_pair] = False
    x_rows = seen[0][2]  # the first GEMM's input: the permuted rows, expert 1's group and the padding rows zero
    assert x_rows.shape[0] == lay.rows and pad.any() and x_rows[~pad].abs().sum() > 0
    assert torch.equal(x_rows[pad], torch.zeros_like(x_rows[pad])), "FP8 padding rows are not exactly zero"
    # the same products; the groups' padding differs (align 16 vs the reference's), so the CPU GEMMs may round apart
    assert rel(outs[0], outs[1]) <= TOL_SAME_PRODUCT and rel(zs[0].grad, zs[1].grad) <= TOL_SAME_PRODUCT
    for key in ("w1", "w3", "w2"):
        assert rel(getattr(model.experts, key).grad, getattr(ref.experts, key).grad) <= TOL_SAME_PRODUCT, key


def test_grouped_experts_left_as_they_are_where_fp8_cannot_reach_them(monkeypatch):
    """Widths that are not multiples of 16 and parameters of the wrong shapes are refused naming the module; experts
    on the loop kernel (eager backend: one F.linear per expert on an indexed, unwrapped weight) and under emulation
    are left as they are and listed with the reason."""
    fp8_grouped_checker(monkeypatch)
    with pytest.raises(ValueError, match=r"experts: expert widths I=24, Dl=48, expected multiples of 16"):
        fp8.convert_model_to_fp8(grouped_experts(2, 24, 48), "rowwise", device="cpu")
    bad = grouped_experts(2, 32, 48)
    bad.experts.w2 = nn.Parameter(torch.randn(2, 32, 48))
    with pytest.raises(ValueError, match=r"experts: got w1 \(2, 32, 48\), w3 \(2, 32, 48\), w2 \(2, 32, 48\)"):
        fp8.convert_model_to_fp8(bad, "rowwise", device="cpu")
    rec = fp8.convert_model_to_fp8(grouped_experts(2, 32, 48, backend="eager"), "rowwise", device="cpu")
    assert rec.grouped_experts == () and dict(rec.skipped) == {"experts": "grouped experts on the loop kernel"}
    rec = fp8.convert_model_to_fp8(grouped_experts(2, 32, 48), "rowwise", emulate=True)
    assert rec.grouped_experts == () and dict(rec.skipped) == {"experts": "grouped experts under emulate"}


def test_projections_narrower_than_min_dim_stay_plain():
    """``min_dim`` (the rule by measured shape): every candidate with ``min(in, out) < min_dim`` is left a plain
    ``nn.Linear`` and listed as ``narrow``, the wider ones convert; the record and its summary carry ``min_dim``;
    :func:`min_dim_for` gives the measured widths for compiled projections and 0 for eager ones; a negative or
    non-int ``min_dim`` is refused."""
    every = fp8.convert_model_to_fp8(tiny_model(), "rowwise", emulate=True)
    model = tiny_model()
    widths = {n: min(m.in_features, m.out_features) for n, m in model.named_modules() if n in set(every.linears)}
    cut = sorted(set(widths.values()))[len(set(widths.values())) // 2]  # some narrower, some not
    rec = fp8.convert_model_to_fp8(model, "rowwise", emulate=True, min_dim=cut)
    narrow = {n for n, reason in rec.skipped if reason == f"narrow: min(in, out) < {cut}"}
    assert narrow == {n for n, w in widths.items() if w < cut} and narrow
    assert set(rec.linears) == {n for n, w in widths.items() if w >= cut} and rec.linears
    for n in narrow:
        assert type(model.get_submodule(n)) is nn.Linear, n
    assert rec.min_dim == cut and fp8.fp8_record(model)["min_dim"] == cut
    assert fp8.fp8_record(model)["skipped"][f"narrow: min(in, out) < {cut}"] == len(narrow)
    assert fp8.min_dim_for("tensorwise", True) == 4096 and fp8.min_dim_for("rowwise", True) == 7168
    assert fp8.min_dim_for("rowwise", False) == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_dim: got"):
            fp8.convert_model_to_fp8(tiny_model(), "rowwise", emulate=True, min_dim=bad)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "cudnn"])
def test_trainer_header_says_which_routed_experts_stay_bf16(monkeypatch, backend):
    """``kimi train --fp8`` on CUDA (the device check faked; the conversion itself runs on the CPU): under
    ``--backend eager`` / ``sdpa`` the routed experts run the loop kernel, which FP8 cannot reach, and the
    description that goes into the run's header and ``run.json``'s ``conversions`` says they stay bf16 and why;
    under ``cudnn`` they are converted and nothing is said."""
    from types import SimpleNamespace

    from kimi_tools.train.weights import fp8_converter

    fp8_grouped_checker(monkeypatch)
    cfg = load_config("tiny")
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    args = SimpleNamespace(fp8="rowwise", device="cuda", fp8_compile=False, fp8_min_dim=None, backend=backend)
    said = fp8_converter(KimiK3Model(cfg, backend=backend), args)
    assert said.startswith("fp8 rowwise: "), said
    if backend == "cudnn":
        assert f", {n_moe} grouped experts (fp8_rowwise)" in said and "bf16" not in said, said
        wide = SimpleNamespace(**{**vars(args), "fp8_min_dim": 10**6})  # every projection narrower: all kept bf16
        said = fp8_converter(KimiK3Model(cfg, backend=backend), wide)
        assert said.startswith("fp8 rowwise: 0 projections, ") and " narrower than 1000000 kept in bf16" in said
    else:
        assert said.endswith(
            f"; routed experts stay bf16 in {n_moe} layers (the loop kernel of --backend {backend}; FP8 grouped "
            "GEMMs run on the grouped_mm kernel of --backend cudnn)"
        ), said


@pytest.mark.parametrize(
    "fp8_compile, compile, fp8_min_dim, want",
    [
        (False, False, None, 0),  # eager FP8 projections: every candidate (kept for numerics studies)
        (False, True, None, fp8.MEASURED_MIN_DIM["rowwise"]),  # --compile compiles them in their block
        (True, False, None, fp8.MEASURED_MIN_DIM["rowwise"]),  # --fp8-compile compiles them alone
        (False, True, 0, 0),  # an explicit --fp8-min-dim 0 is kept, not taken for "unset"
        (False, False, 64, 64),
    ],
    ids=["eager", "compile", "fp8-compile", "compile-min-dim-0", "min-dim-64"],
)
def test_trainer_fp8_min_dim_default_and_override(monkeypatch, fp8_compile, compile, fp8_min_dim, want):
    """``kimi train --fp8``'s ``min_dim`` (``weights.fp8_converter``): without ``--fp8-min-dim``, the measured width
    of the recipe when the projections are compiled (``--fp8-compile`` or ``--compile``) and 0 when eager; an
    explicit value, 0 included, as given. The record on the model carries it."""
    from types import SimpleNamespace

    from kimi_tools.train.weights import fp8_converter

    fp8_grouped_checker(monkeypatch)
    args = SimpleNamespace(
        fp8="rowwise", device="cuda", fp8_compile=fp8_compile, compile=compile, fp8_min_dim=fp8_min_dim, backend="eager"
    )
    model = tiny_model()
    fp8_converter(model, args)
    assert model.fp8.min_dim == want


def test_converted_cudnn_model_exports_the_checkpoint_layout(monkeypatch, tmp_path):
    """The tiny model on the cudnn backend (grouped experts on the grouped_mm kernel), converted with its experts
    wrapped: save_model writes what the unconverted model writes (the trainer's export), names and values."""
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    from kernels_torch.model import load_model, save_model

    fp8_grouped_checker(monkeypatch)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(KimiK3Model(load_config("tiny"), backend="cudnn"))
    rec = fp8.convert_model_to_fp8(models[0], "rowwise", device="cpu")
    moe_layers = [i for i in range(load_config("tiny").num_hidden_layers) if load_config("tiny").is_moe_layer(i)]
    assert rec.grouped_experts == tuple(f"model.layers.{i}.block_sparse_moe.experts" for i in moe_layers)
    assert isinstance(
        models[0].model.layers[moe_layers[0]].block_sparse_moe.experts.w2, Float8TrainingWeightWrapperTensor
    )
    for m, d in zip(models, ("fp8", "plain")):
        save_model(m, tmp_path / d)
    a, b = (load_model(tmp_path / d, dtype=torch.float32).state_dict() for d in ("fp8", "plain"))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- kimi compare --fp8


def test_compare_fp8_refusals(capsys):
    """kimi compare --fp8: an unknown recipe, --grad / --against, a dtype other than bf16, and the CPU are each one
    ``kimi: error:`` line (exit 2), before any model is loaded."""
    from kimi_tools.cli import main

    for argv, needle in (
        (["--fp8", "fp4"], "fp8 recipe: got 'fp4'"),
        (["--fp8", "rowwise", "--grad"], "does not combine with --grad or --against"),
        (["--fp8", "rowwise", "--dtype", "float32"], "got --dtype float32 (use bfloat16)"),
        (["--fp8", "rowwise", "--device", "cpu"], "got device 'cpu'"),
    ):
        assert main(["compare", "--quiet", *argv]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("kimi: error:") and needle in err[0], err


def test_compare_fp8_reports_bf16_and_fp8_side_by_side(monkeypatch, tmp_path, capsys):
    """The plumbing, on the CPU with torchao's emulation standing in for the GPU conversion: each backend runs in
    bf16 and again converted to FP8, both against the same oracle, the FP8 one under TOLERANCES_FP8 and carrying the
    conversion record; the per-layer FP8 errors are several times bf16's (the conversion ran); a side-by-side
    table follows. 4 tiny layers (KKKD), 80 tokens."""
    import kimi_tools.cli as cli
    from kimi_tools.compare import TOLERANCES_FP8

    monkeypatch.setattr(cli, "_fp8_device_check", lambda device: None)
    monkeypatch.setattr(
        cli, "_fp8_converter", lambda recipe: functools.partial(fp8.convert_model_to_fp8, recipe=recipe, emulate=True)
    )
    out = tmp_path / "r.json"
    argv = ["compare", "--fp8", "rowwise", "--backends", "eager", "--reference", "eager", "--device", "cpu"]
    rc = cli.main([*argv, "--layers", "4", "--tokens", "80", "--quiet", "--json", str(out)])
    text = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rc == 0, text
    assert rep["fp8"] == "rowwise" and rep["dtype"] == "bfloat16"
    bf16, f8 = rep["reports"]
    assert (bf16["backend"], f8["backend"]) == ("torch-eager", "torch-eager fp8-rowwise")
    assert bf16["fp8"] is None and f8["fp8"]["recipe"] == "rowwise" and f8["fp8"]["linears"] > 0
    assert f8["tolerances"]["attn_rel"] == TOLERANCES_FP8.attn_rel and bf16["passed"] and f8["passed"]
    for a, b in zip(bf16["layers"], f8["layers"]):
        assert b["attn_rel"] > 3 * a["attn_rel"] and b["mlp_rel"] > 3 * a["mlp_rel"], (a, b)
    assert "== torch-eager vs torch-eager fp8-rowwise (both against torch-eager fp32) ==" in text
    assert "tolerances (fp8 rowwise)" in text


def test_fp8_grouped_experts_train_through_fp32_masters(monkeypatch):
    """The trainer's bf16 path on converted grouped experts: fp32 masters copied from the wrapped weights, the
    gradients moved up, an AdamW step, the masters rounded back into the still-wrapped parameters (so the next
    forward runs FP8 again) with the updated values."""
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    from kimi_tools.train.weights import MasterWeights

    seen = fp8_grouped_checker(monkeypatch)
    model = grouped_experts(E=4, I=32, Dl=48).to(torch.bfloat16)
    fp8.convert_model_to_fp8(model, "rowwise", device="cpu")
    masters = MasterWeights(model)
    assert [m.dtype for m in masters.masters] == [torch.float32] * 3
    before = {n: p.detach().float().clone() for n, p in model.experts.named_parameters()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4, (40, 2), generator=g)
    out = model.experts(torch.randn(40, 48, generator=g).bfloat16(), ids, torch.rand(40, 2, generator=g))
    out.float().square().sum().backward()
    masters.grads_to_masters()
    opt = torch.optim.AdamW(masters.masters, lr=1e-2)
    opt.step()
    masters.to_model()
    for (name, p), m in zip(model.experts.named_parameters(), masters.masters):
        assert isinstance(p, Float8TrainingWeightWrapperTensor), (name, type(p))
        assert not torch.equal(p.detach().float(), before[name]), name
        assert torch.equal(p.detach().float(), m.detach().to(torch.bfloat16).float()), name
    n = len(seen)
    model.experts(torch.randn(8, 48).bfloat16(), ids[:8], torch.rand(8, 2))
    assert len(seen) == n + 3  # the next forward reached the FP8 grouped GEMM again


# ---------------------------------------------------------------------------------------------- training


def test_an_fp8_run_resumes_exactly(tmp_path, monkeypatch):
    """A training run with its projections converted (torchao's emulation on the CPU, through the trainer's
    conversion hook as ``--fp8`` does on the GPU): 4 steps equal 2 steps, stopped, then resumed to 4 from the DCP
    resume state (losses, learning rates, gradient norms bitwise; the exported weights equal); the exported keys are
    the checkpoint's; and FP8 changed the numbers (the same run unconverted differs)."""
    from safetensors.torch import load_file
    from test_train import SMALL, _numbers

    from kimi_tools.train import TrainArgs, train
    from kimi_tools.train import weights as tw
    from kimi_tools.train.metrics import read_records

    def emulated(model, args):
        rec = fp8.convert_model_to_fp8(model, "rowwise", emulate=True)
        return f"fp8 {rec.recipe} (emulated): {len(rec.linears)} projections"

    kw = {**SMALL, "steps": 4, "eval_every": 2, "plot": False}
    plain = train(TrainArgs(out=str(tmp_path / "plain"), **kw))
    monkeypatch.setattr(tw, "CONVERTERS", [emulated])
    a = train(TrainArgs(out=str(tmp_path / "a"), **kw))
    b1 = train(TrainArgs(out=str(tmp_path / "b"), stop_after=2, **kw))
    b2 = train(TrainArgs(out=str(tmp_path / "b"), resume=True, **kw))
    assert _numbers(a.records) == _numbers(b1.records + b2.records)
    assert _numbers(a.records) == _numbers(read_records(tmp_path / "b" / "metrics.jsonl"))
    assert json.loads((tmp_path / "b" / "run.json").read_text())["conversions"][0].startswith("fp8 rowwise")
    wa, wb, wp = (load_file(tmp_path / d / "model.safetensors") for d in ("a", "b", "plain"))
    assert wa.keys() == wb.keys() == wp.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.records[-1]["loss"] != plain.records[-1]["loss"]  # the conversion acted


# A KDA layer converted on its own, as the GPU test converts it (K3's 96 x 128 heads at hidden 1024, N(0, 1/in)
# projections, T = 63, rowwise, torchao's emulation) against fp64. The default exclusions (the gate's f_a / f_b and
# beta's b_proj stay bf16) must hold for a top-level ``f_a_proj`` too: when they did not, every gate-path gradient
# was 0.23-0.39 off (dt_bias 0.31-0.35, as the H200 measured on the cudnn layer, 2026-12-03). With them, measured
# over three seeds on 2026-12-03: out 0.067-0.068, dx 0.082-0.084, every parameter gradient 0.062-0.091.
TOL_KDA_FP8 = {"out": 0.12, "dx": 0.15, "grad": 0.15}
KDA_FP8_LINEARS = {"q_proj", "k_proj", "v_proj", "g_proj", "o_proj"}


def test_kda_layer_fp8_error_sizes_under_emulation():
    import copy

    cfg = load_config("tiny").replace(hidden_size=1024, kda_num_heads=96, kda_head_dim=128, kda_gate_rank=64)
    torch.manual_seed(0)  # the 1-D parameters' init
    g = torch.Generator().manual_seed(63)
    layer = tk.KimiDeltaAttention(cfg, cfg.kda_layers[0], backend="eager")
    with torch.no_grad():
        for p in layer.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    ref = copy.deepcopy(layer).double()
    rec = fp8.convert_model_to_fp8(layer, "rowwise", emulate=True)
    assert set(rec.linears) == KDA_FP8_LINEARS
    assert {n for n, why in rec.skipped if why == "excluded"} == {"f_a_proj", "f_b_proj", "b_proj"}
    x = torch.randn(1, 63, cfg.hidden_size, generator=g)
    dy = torch.randn(1, 63, cfg.hidden_size, generator=g)

    def run(m, dt):
        xi = x.to(dt).clone().requires_grad_(True)
        y, _ = m(xi)
        y.backward(dy.to(dt))
        return y, xi.grad, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    got, want = run(layer, torch.float32), run(ref, torch.float64)
    assert MIN_FP8_EFFECT < check_rel("out", got[0], want[0], TOL_KDA_FP8["out"])
    check_rel("dx", got[1], want[1], TOL_KDA_FP8["dx"])
    assert set(got[2]) == set(want[2])
    for n, gp in want[2].items():
        check_rel(f"d{n}", got[2][n], gp, TOL_KDA_FP8["grad"])


def test_fp8_with_recomputation_gives_the_same_loss_and_grads():
    """Activation recomputation over FP8 projections (torchao's emulation, the order ``kimi train`` uses: convert,
    then wrap the layers): the recomputed forward casts again from the same weights, so the loss and every gradient
    equal those without recomputation, bit for bit on the CPU."""
    from test_train import _packed_batch

    from kernels_torch.activation_memory import recompute_layers
    from kernels_torch.model import model_from_params
    from kimi.init import init_params
    from kimi_tools.train import LMStage

    full = load_config("tiny")
    cfg = full.truncated(4)
    batch = _packed_batch()
    out = []
    for mode in (None, "layer", "mlp"):
        model = model_from_params(cfg, init_params(full, seed=1, layers=4), "sdpa")
        rec = fp8.convert_model_to_fp8(model, "rowwise", emulate=True)
        assert rec.linears
        if mode:
            recompute_layers(model, mode)
        loss, _ = LMStage(cfg, None).loss(model, batch)
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0) = out[0]
    for l1, g1 in out[1:]:
        assert torch.equal(l0, l1)
        assert g0.keys() == g1.keys() and len(g0) > 50
        for n in g0:
            assert torch.equal(g0[n], g1[n]), n


# ---------------------------------------------------------------------------------------------- layer-local, whole model

# T = 120: not a multiple of 16 (the projections pad their rows), above index_topk = 64 (the DSA top-k chooses);
# the output gradients have a mean-token loss's size over an 8K-token batch (FP8's scales must carry them).
LAYER_LOCAL_TOKENS = 120
LAYER_LOCAL_GRAD_SCALE = 1.0 / 8192


def test_tiny_model_fp8_layer_by_layer_under_replay():
    """Each decoder layer of the tiny model converted (rowwise, torchao's emulation; fp32) against the same layer
    unconverted, both on the unconverted model's recorded inputs (AttnRes blocks and p) with its MoE routing and DSA
    top-k replayed (``tests/layer_local.py``): attn_out, mlp_out and each layer's parameter gradients within
    ``FP8_LAYER_TOL`` (FP8 rounding arithmetic; every error printed as ``FP8_ERR``), and off by more than fp32
    rounding (FP8 ran); every parameter but the replayed router and indexer weights compared. The replay is what runs:
    the reference with its routers and indexers re-drawn matches it exactly. The same bounds reject the unconverted
    model with every ``o_proj`` tripled and the converted one with its FP8 scales dropped (gradients flushed to zero).
    The routed experts stay fp32 here (torchao has no
    emulated grouped FP8 GEMM): ``tests/gpu/test_gpu_fp8.py`` runs the same comparison with them in FP8."""
    import copy

    from layer_local import (
        FP8_LAYER_TOL,
        assert_wrong_models_fail,
        compare_models,
        failures,
        output_grads,
        record_layer_inputs,
        report,
    )

    ref = tiny_model(seed=0)
    ids = torch.randint(0, 512, (1, LAYER_LOCAL_TOKENS), generator=torch.Generator().manual_seed(1))
    inputs = record_layer_inputs(ref, ids)
    dys = output_grads(inputs, seed=2, scale=LAYER_LOCAL_GRAD_SCALE)
    model = copy.deepcopy(ref)
    rec = fp8.convert_model_to_fp8(model, "rowwise", emulate=True)
    assert rec.linears and not rec.grouped_experts
    errs = compare_models(ref, model, inputs, dys)
    report("tiny_model_layer_local", errs)
    assert failures(errs, FP8_LAYER_TOL) == []
    assert min(min(e.outputs.values()) for e in errs) > MIN_FP8_EFFECT
    cfg = load_config("tiny")
    dsa = cfg.dsa_layers
    assert all(errs[i].flips > 0 for i in dsa)  # FP8 alone would have chosen other keys: the replay is needed
    # every trainable parameter compared, but the router weights and indexers (replayed: no gradient) and layer 0's
    # AttnRes mix (one source: no gradient either)
    for e, layer in zip(errs, ref.model.layers, strict=True):
        left = {n for n, p in layer.named_parameters() if p.requires_grad} - set(e.grads)
        left = {n for n in left if not (n.endswith(".gate.weight") or ".indexer." in n)}
        assert left == ({"self_attention_res_norm.weight", "self_attention_res_proj.weight"} if e.layer == 0 else set())

    # the replay is what the layers run: the reference with its routers and indexers re-drawn gives the same
    # outputs and gradients exactly, though it would have routed and selected otherwise
    redrawn = copy.deepcopy(ref)
    with torch.no_grad():
        for n, p in redrawn.named_parameters():
            if ".indexer." in n or ".block_sparse_moe.gate." in n:
                p.copy_(torch.randn_like(p))
    same = compare_models(ref, redrawn, inputs, dys)
    assert failures(same, dict.fromkeys(FP8_LAYER_TOL, 0.0)) == []
    assert all(e.flips > 0 for e in same if e.layer in dsa or cfg.is_moe_layer(e.layer))

    assert_wrong_models_fail(ref, model, inputs, dys)
