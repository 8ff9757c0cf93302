"""The grouped routed experts (``kernels_torch.ops.moe_grouped``, ``GroupedExperts`` with ``moe_kernel="grouped_mm"``)
equal the readable per-expert loop, on the CPU: the layout, outputs and every gradient in fp32 (``torch._grouped_mm``
runs fp32 and bf16 on a CPU), bf16 within its bound, experts that get 0, 1 and many rows, T = 1 and 63, aligned group
starts; the fp64 fallback and refusals; the stacked parameters' loading (streamed, no second copy) and export.
The GPU twin of these checks (bf16 at K3.1's expert shapes, no host sync) is ``tests/gpu/test_gpu_moe_grouped.py``.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch
from helpers import rel

from kernels_torch import kernel_choice
from kernels_torch.moe import GroupedExperts, KimiMoE
from kernels_torch.ops import moe_grouped as G
from kernels_torch.params import canonical_state_dict, load_canonical
from kimi.config import load_config

TOL_FP32 = 1e-5  # grouped vs loop in fp32: outputs, x.grad and every parameter gradient (summation order only)
TOL_BF16 = 1e-2  # grouped vs loop, both bf16 (bf16 GEMM blocking and the fp32 sum's order differ)
# the same on the CPU, where both run the same bf16 GEMMs per expert and sum in fp32: 0 today; gather-sums in bf16
# instead of fp32 give 3e-3 to 6e-3
TOL_BF16_CPU = 1e-4
TOL_TRITON = 1e-6  # Triton gather-sums vs their torch twins (fp32 accumulation, same order)

TINY = load_config("tiny")
CONFIGS = {
    "tiny-latent-situ": TINY,
    "kimi-linear-silu": TINY.replace(
        routed_expert_hidden_size=None,
        hidden_act="silu",
        activation_situ_linear_beta=None,
        routed_scaling_factor=2.446,
        quant_method=None,
    ),
    "grouped-16x4-top4": TINY.replace(num_experts=16, num_experts_per_token=4, num_expert_group=4, topk_group=2),
}


def _moe(cfg, dtype=torch.float32, seed=0, starve=()):
    """A MoE layer with fresh random weights; experts in ``starve`` are biased out of every selection (0 rows) and
    expert 1 biased in (many rows)."""
    torch.manual_seed(seed)
    m = KimiMoE(cfg).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
        bias = 0.1 * torch.randn(cfg.num_experts)
        bias[list(starve)] = -10.0
        bias[1] = 0.5
        m.gate.e_score_correction_bias.copy_(bias)
    return m


def _run(m, x, kernel, align=1, seed=1):
    m.experts.moe_kernel, m.experts.align = kernel, align
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y, aux = m(x, return_aux=True)
    (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)).sum().backward()
    grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads, aux["expert_ids"]


# ---------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("N,k,E,align", [(1, 2, 8, 1), (63, 2, 8, 1), (63, 4, 16, 16), (200, 3, 7, 8), (5, 1, 32, 4)])
def test_expert_layout(N, k, E, align):
    g = torch.Generator().manual_seed(N * 7 + E)
    ids = torch.randint(0, E, (N, k), generator=g)
    ids[:, 0] = torch.where(ids[:, 0] == 0, 1, ids[:, 0])  # expert 0 gets fewer rows; some experts none at small N
    lay = G.expert_layout(ids, E, align)
    P = N * k
    assert lay.rows == (P if align == 1 else -(-(P + E * (align - 1)) // align) * align) and lay.rows % align == 0
    rows = lay.row_of_pair
    assert rows.shape == (P,) and len(set(rows.tolist())) == P and int(rows.min()) >= 0 and int(rows.max()) < lay.rows
    ends = lay.offsets.long().tolist()
    starts = [0, *ends[:-1]]
    counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    for e in range(E):
        assert starts[e] % align == 0
        assert ends[e] - starts[e] == -(-counts[e] // align) * align  # the group, rounded up to align rows
        mine = [int(rows[p]) for p in range(P) if int(ids.reshape(-1)[p]) == e]  # pair order = token order
        assert mine == list(range(starts[e], starts[e] + counts[e]))
    assert torch.equal(lay.order, torch.sort(ids.reshape(-1), stable=True).indices)
    with pytest.raises(ValueError, match="ids"):
        G.expert_layout(ids.float(), E)
    with pytest.raises(ValueError, match="align"):
        G.expert_layout(ids, E, 0)


# ---------------------------------------------------------------------------------------------- grouped == loop


@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("T", [1, 63])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_grouped_equals_loop_fp32(name, T, align):
    cfg = CONFIGS[name]
    m = _moe(cfg, starve=(0, cfg.num_experts - 1))
    x = torch.randn(2, T, cfg.hidden_size, generator=torch.Generator().manual_seed(T))
    y0, gx0, gp0, ids = _run(m, x, "loop")
    counts = torch.bincount(ids.reshape(-1), minlength=cfg.num_experts)
    assert counts[0] == 0 and counts[-1] == 0 and int(counts.max()) > 1  # experts with 0 and many rows
    kernel_choice.reset_used()
    y1, gx1, gp1, ids1 = _run(m, x, "grouped_mm", align)
    assert kernel_choice.used()["moe"] == {"grouped_mm": 1}
    assert torch.equal(ids, ids1)
    assert y1.dtype == torch.float32 and rel(y1, y0) <= TOL_FP32
    assert rel(gx1, gx0) <= TOL_FP32
    assert set(gp1) == set(gp0) and "experts.w2" in gp0 and "gate.weight" in gp0
    for n in gp0:
        assert rel(gp1[n], gp0[n]) <= TOL_FP32, n
    # a starved expert's slice of the stacked gradient is exactly zero on both paths
    assert not gp1["experts.w1"][0].any() and not gp0["experts.w1"][0].any()


def test_grouped_one_row_experts_and_k_equals_experts():
    """Every expert picked by every token (k = E) and one token: each expert gets exactly one row."""
    cfg = TINY.replace(num_experts=4, num_experts_per_token=4)
    m = _moe(cfg)
    x = torch.randn(1, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    y0, gx0, gp0, _ = _run(m, x, "loop")
    y1, gx1, gp1, _ = _run(m, x, "grouped_mm")
    assert rel(y1, y0) <= TOL_FP32 and rel(gx1, gx0) <= TOL_FP32
    assert all(rel(gp1[n], gp0[n]) <= TOL_FP32 for n in gp0)


def test_grouped_equals_loop_bf16():
    """bf16: the grouped path equals the loop within TOL_BF16, and within TOL_BF16_CPU on the CPU (this test's
    device), where a gather-sum (the permutation's backward, the combine) rounded to bf16 per slot shows."""
    cfg = TINY
    m = _moe(cfg, dtype=torch.bfloat16, starve=(3,))
    x = torch.randn(2, 63, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    y0, gx0, gp0, _ = _run(m, x, "loop")
    y1, gx1, gp1, _ = _run(m, x, "grouped_mm")
    assert y1.dtype == torch.bfloat16
    tol = TOL_BF16_CPU if x.device.type == "cpu" else TOL_BF16
    assert rel(y1, y0) <= tol and rel(gx1, gx0) <= tol
    for n in gp0:
        assert rel(gp1[n], gp0[n]) <= tol, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_rows_get_exact_zero_gradients(dtype):
    """With aligned group starts (padding rows), the combine's gradient for the expert outputs is exactly zero in
    every padding row (they are read by the grouped GEMMs' weight gradients, where garbage would add NaN or noise),
    whatever the freed memory held before (filled with NaN here, then freed for the allocator to reuse)."""
    g = torch.Generator().manual_seed(21)
    N, k, E, D, align = 7, 2, 4, 16, 8
    ids = torch.randint(0, E, (N, k), generator=g)
    lay = G.expert_layout(ids, E, align)
    pad = torch.ones(lay.rows, dtype=torch.bool)
    pad[lay.row_of_pair] = False
    assert lay.rows > N * k and pad.sum() > 0
    w = torch.rand(N, k, generator=g)
    dr = torch.randn(N, D, generator=g)
    for _ in range(3):
        y = torch.randn(lay.rows, D, generator=g).to(dtype).requires_grad_()
        r = G.combine_rows(y, w, lay, kernel="torch")
        junk = torch.full((lay.rows, D), float("nan"), dtype=dtype)  # the size of y's gradient, then freed
        del junk
        (dy,) = torch.autograd.grad(r, y, dr)
        assert dy[~pad].abs().sum() > 0
        assert torch.equal(dy[pad], torch.zeros_like(dy[pad])), "padding rows of the gradient are not zero"


def test_fp64_falls_back_to_the_loop_and_forced_grouped_refuses():
    m = _moe(TINY, dtype=torch.float64)
    x = torch.randn(1, 7, TINY.hidden_size, dtype=torch.float64)
    m.experts.backend = "cudnn"  # auto would take grouped_mm ... but torch._grouped_mm has no fp64 kernel
    kernel_choice.reset_used()
    m.experts.moe_kernel = None
    m(x)
    assert kernel_choice.used()["moe"] == {"loop": 1}
    m.experts.moe_kernel = "grouped_mm"
    with pytest.raises(ValueError, match="float64"):
        m(x)
    # the readable fallback of grouped_mm itself (fp64, reads the offsets on the host) equals the per-group products
    lay = G.expert_layout(torch.tensor([[2, 0], [2, 1], [0, 2]]), 3)
    xs = torch.randn(6, 5, dtype=torch.float64)
    w = torch.randn(3, 4, 5, dtype=torch.float64)
    y = G.grouped_mm(xs, w, lay.offsets)
    ends = lay.offsets.tolist()
    for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends)):
        assert torch.allclose(y[s:t], xs[s:t] @ w[e].T, rtol=0, atol=1e-12)


def test_moe_kernel_choice(monkeypatch):
    m = _moe(TINY)
    x = torch.randn(1, 5, TINY.hidden_size)
    assert m.experts.kernel(x) == "loop"  # eager backend: the readable loop
    m.experts.backend = "cudnn"
    assert m.experts.kernel(x) == "grouped_mm"  # cudnn: grouped where torch._grouped_mm runs
    monkeypatch.setenv("KIMI_MOE_KERNEL", "loop")
    assert m.experts.kernel(x) == "loop"
    monkeypatch.setenv("KIMI_MOE_KERNEL", "grouped")
    with pytest.raises(ValueError, match=r"\$KIMI_MOE_KERNEL: got 'grouped' for moe"):
        m.experts.kernel(x)
    with pytest.raises(ValueError, match="moe"):
        kernel_choice.set_model_kernels(m, moe_kernel="fast")


# ---------------------------------------------------------------------------------------------- Triton gather-sums

needs_interpreter = pytest.mark.skipif(
    not (G.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernel tests on CPU need triton importable and TRITON_INTERPRET=1 (GPU: test_gpu_moe_grouped.py)",
)


@needs_interpreter
@pytest.mark.parametrize("align", [1, 8])
def test_triton_gather_sums_equal_torch(align):
    g = torch.Generator().manual_seed(11)
    N, k, E, D = 37, 3, 6, 40
    ids = torch.randint(0, E, (N, k), generator=g)
    lay = G.expert_layout(ids, E, align)
    w0 = torch.rand(N, k, generator=g)
    z0 = torch.randn(N, D, generator=g)
    dr = torch.randn(N, D, generator=g)
    out = {}
    for kern in ("torch", "triton"):
        z, w = z0.clone().requires_grad_(), w0.clone().requires_grad_()
        x = G.permute_rows(z, lay, kernel=kern)
        r = G.combine_rows(x * 1.5 + 0.25, w, lay, kernel=kern)
        (r * dr).sum().backward()
        out[kern] = (r.detach(), z.grad, w.grad)
    for a, b in zip(out["triton"], out["torch"]):
        assert rel(a, b) <= TOL_TRITON


# ---------------------------------------------------------------------------------------------- parameters


def test_canonical_views_and_load_errors():
    m = _moe(TINY)
    canon = canonical_state_dict(m)
    assert [k for k in canon if ".w" in k and "experts." in k][:3] == [
        "experts.0.w1.weight",
        "experts.0.w3.weight",
        "experts.0.w2.weight",
    ]
    fresh = KimiMoE(TINY)
    load_canonical(fresh, canon)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), m.state_dict().values()))
    missing = {k: v for k, v in canon.items() if k != "experts.5.w3.weight"}
    with pytest.raises(ValueError, match=r"missing: 1 expert slice\(s\) of experts.w3 \(experts \[5\]\)"):
        load_canonical(KimiMoE(TINY), missing)
    with pytest.raises(ValueError, match=r"unexpected: experts.8.w1.weight"):
        load_canonical(KimiMoE(TINY), {**canon, "experts.8.w1.weight": canon["experts.0.w1.weight"]})
    with pytest.raises(ValueError, match=r"experts.2.w2.weight: got shape \(64, 31\), expected \(64, 32\)"):
        load_canonical(KimiMoE(TINY), {**canon, "experts.2.w2.weight": torch.randn(64, 31)})
    with torch.device("meta"):
        meta = KimiMoE(TINY)
    with pytest.raises(ValueError, match="meta device"):
        load_canonical(meta, canon)
    # gradients map the same way (a stack without gradient gives None slices)
    grads = canonical_state_dict(m, {n: None for n, _ in m.named_parameters()})
    assert grads["experts.7.w2.weight"] is None and set(grads) == set(canon)


def test_grouped_experts_keep_checkpoint_orientation():
    """Slice e of each stack is expert e in ``nn.Linear`` orientation: ``E_e(z) = w2[e] act(w1[e] z, w3[e] z)``, on
    both kernels."""
    from kernels_torch.moe import glu_act

    ge = GroupedExperts(TINY, 64)
    assert ge.w1.shape == (8, 32, 64) and ge.w3.shape == (8, 32, 64) and ge.w2.shape == (8, 64, 32)
    assert float(ge.w1.abs().max()) <= 64**-0.5 and float(ge.w2.abs().max()) <= 32**-0.5  # nn.Linear's init bound
    g = torch.Generator().manual_seed(9)
    z, w = torch.randn(3, 64, generator=g), torch.rand(3, 2, generator=g)
    ids = torch.tensor([[0, 5], [5, 7], [2, 0]])
    e5 = ge.w2[5] @ glu_act(ge.w1[5] @ z[1], ge.w3[5] @ z[1], TINY)
    e7 = ge.w2[7] @ glu_act(ge.w1[7] @ z[1], ge.w3[7] @ z[1], TINY)
    for kernel in ("loop", "grouped_mm"):
        ge.moe_kernel = kernel
        with torch.no_grad():
            y = ge(z, ids, w)
        assert rel(y[1], w[1, 0] * e5 + w[1, 1] * e7) <= 1e-6, kernel


# ---------------------------------------------------------------------------------------------- streamed loading


def _in_use_bytes() -> int | None:
    """glibc's bytes in use by malloc (heap + mmapped chunks: numpy and torch CPU tensors), or None off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks")] + [
            (f, ctypes.c_size_t) for f in ("fsmblks", "uordblks", "fordblks", "keepcost")
        ]

    fn.restype = Mallinfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)


def test_load_model_streams_experts_into_the_stacks(tmp_path, monkeypatch):
    """``load_model`` holds the model plus one checkpoint tensor: its peak of malloc'd bytes, sampled at every read
    and every copy, stays within 1.1x of the model's bytes (reading everything first, then stacking, would need
    about 2x). The model is one MoE layer whose routed experts hold almost all of its bytes."""
    from kernels_torch import params as tp
    from kernels_torch.model import load_model
    from kimi.checkpoint import CheckpointReader, load_params
    from kimi.init import init_checkpoint

    if _in_use_bytes() is None:
        pytest.skip("needs glibc's mallinfo2 to count malloc'd bytes")
    cfg = TINY.replace(
        num_experts=64, moe_intermediate_size=256, routed_expert_hidden_size=256, quant_method=None
    ).truncated(2)
    init_checkpoint(tmp_path / "ck", cfg, seed=0)
    peak = [0]
    real_get, real_copy = CheckpointReader.get_array, tp._copy

    def get_array(self, name):
        a = real_get(self, name)
        peak[0] = max(peak[0], _in_use_bytes())
        return a

    def copy(dst, src, name):
        peak[0] = max(peak[0], _in_use_bytes())
        real_copy(dst, src, name)

    load_model(tmp_path / "ck", layers=1, check_finite=False)  # warm-up: one-time library allocations (~25 MB)
    monkeypatch.setattr(CheckpointReader, "get_array", get_array)
    monkeypatch.setattr(tp, "_copy", copy)
    base = _in_use_bytes()
    model = load_model(tmp_path / "ck", dtype=torch.bfloat16, check_finite=False)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = model.model.layers[1].block_sparse_moe.experts
    assert experts.w1.numel() * 6 >= 0.9 * model_bytes  # the experts dominate the model (3 stacks of 2-byte values)
    ratio = (peak[0] - base) / model_bytes
    assert ratio <= 1.1, f"peak while loading {ratio:.2f}x the model's bytes, expected <= 1.1x (a second copy?)"
    # and the stacks hold exactly the checkpoint's per-expert tensors
    want = load_params(tmp_path / "ck")
    got = canonical_state_dict(model)
    for e in (0, 31, 63):
        for w in ("w1", "w3", "w2"):
            name = f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
            assert torch.equal(got[name], want[name]), name
    assert np.isfinite(ratio)
