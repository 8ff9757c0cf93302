"""The static-shape decode step of the torch path (``kernels_torch.decode``) on the CPU, on the tiny preset cut to its
first 4 layers (``KKKD``: three KDA layers, one DSA layer with ``index_topk`` 64), fp32, eager:

* the step (``Decoder``, mode ``static``: the code the CUDA graph captures) equals today's cached path
  (``KimiK3Model.step``, T = 1) token for token for 64 greedy tokens, rows of different lengths (prompts of 40 and
  100 tokens: shorter and longer than ``index_topk``), logits per step within fp32 rounding;
* its positions are one device tensor and the step reads nothing on the host (a torch-function mode records every
  host read: ``item``, ``tolist``, ``bool``, ``nonzero``, ...);
* a reset and reuse equals a fresh decoder; a ``ModelCache`` copied in (``rows`` of a batch-1 prefill) decodes as the
  cached path does; a step past ``max_len`` is refused before anything is written;
* the device sampler: temperature first, then the nucleus (at temperature 3 and top-p 0.8 the draws cover exactly the
  tempered nucleus), as the numpy sampler of ``kimi_tools.generate``;
* ``generate(decode="static")`` equals ``decode="loop"`` for greedy tokens, streams, and stops at the stop token;
* the fused KDA decode kernel (``kernels_torch.ops.kda_decode``, Triton) against the layer's readable recurrence,
  under ``TRITON_INTERPRET=1`` only (GPU: ``tests/gpu/test_gpu_generate_captured.py``).

Mutations each test here was checked against: see the report of the change that added them (attention over
``pos + 1`` keys instead of ``pos``, no ``pos += 1``, the window not shifted, top-p before temperature, ...).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import rel
from torch.overrides import TorchFunctionMode

from kernels_torch import cache as tcache
from kernels_torch import kernel_choice
from kernels_torch.decode import DecodeCache, Decoder, sample_device
from kernels_torch.model import KimiK3Model
from kernels_torch.model import load_model as load_torch
from kimi.config import load_config
from kimi_tools.generate import generate, sample

LAYERS = 4  # KKKD
TOL_LOGITS = 1e-5  # fp32: the static step sums over all max_len rows (masked ones add exact zeros): ~1e-7 seen
STEPS = 64


@pytest.fixture(scope="module")
def tmodel(tiny_ckpt):
    return load_torch(tiny_ckpt, layers=LAYERS, backend="eager")


def _prompts(lengths, seed=0):
    g = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), max(lengths)), np.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = g.integers(0, 256, n)
    return torch.from_numpy(ids)


def _pad(rows):
    out = np.zeros((len(rows), max(map(len, rows))), np.int64)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out


def _cached_greedy(model, ids, lengths, steps, max_len):
    """Today's cached path, greedy: (tokens [steps][B], logits [steps][B, V]) of each step."""
    cache = tcache.init_cache(model.config, ids.shape[0], max_len)
    logits, cache = model.step(ids, cache, lengths)
    last = logits[torch.arange(ids.shape[0]), torch.tensor(lengths) - 1]
    toks, outs = [], []
    for _ in range(steps):
        nxt = last.argmax(-1)
        toks.append(nxt.tolist())
        logits, cache = model.step(nxt[:, None], cache)
        last = logits[:, 0]
        outs.append(last)
    return toks, outs


def _static_greedy(dec, ids, lengths, steps):
    last = dec.prefill(ids, lengths)
    nxt = dec.sample(last, torch.zeros(ids.shape[0]))
    toks, outs = [], []
    for _ in range(steps):
        toks.append(nxt.tolist())
        nxt, logits = dec.step(nxt)
        outs.append(logits.clone())
    return toks, outs


@torch.no_grad()
def test_static_step_equals_the_cached_path(tmodel):
    lengths = [40, 100]  # shorter and longer than index_topk = 64: the selection is active for row 1 from the start
    ids = _prompts(lengths)
    max_len = max(lengths) + STEPS + 1
    want_toks, want = _cached_greedy(tmodel, ids, lengths, STEPS, max_len)
    dec = Decoder(tmodel, 2, max_len, mode="static")
    got_toks, got = _static_greedy(dec, ids, lengths, STEPS)
    assert got_toks == want_toks
    errs = [rel(g, w) for g, w in zip(got, want)]
    assert max(errs) <= TOL_LOGITS, max(errs)
    assert dec.positions == [n + STEPS for n in lengths]
    assert dec.cache.pos.tolist() == dec.positions


class _HostReads(TorchFunctionMode):
    """Records the torch calls that read a tensor's value on the host (on CUDA each is a sync)."""

    NAMES = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu", "unique"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in self.NAMES or name == "masked_select":
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_step_position_is_a_device_tensor_and_nothing_is_read_on_the_host():
    # the MoE layers on the grouped experts (the cudnn backend's default; the eager loop finds each expert's tokens
    # with nonzero, a host read)
    from kernels_torch.moe import GroupedExperts

    torch.manual_seed(0)
    model = KimiK3Model(load_config("tiny").truncated(LAYERS)).eval()
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.moe_kernel = "grouped_mm"
    dec = Decoder(model, 2, 64, mode="static")
    dec.prefill(_prompts([9, 30], seed=1), [9, 30])
    assert isinstance(dec.cache.pos, torch.Tensor) and dec.cache.pos.dtype == torch.int64
    tok = torch.tensor([5, 7])
    kernel_choice.reset_used()  # count the steps' calls only (the counter is process-global)
    with _HostReads() as reads:
        for _ in range(3):
            tok, _ = dec.step(tok)
    assert reads.calls == [], reads.calls
    assert kernel_choice.used()["moe"] == {"grouped_mm": 3 * 3}  # three MoE layers, three steps
    assert dec.cache.pos.tolist() == [12, 33]  # one step serves rows at different positions


@torch.no_grad()
def test_reset_and_reuse_equals_a_fresh_decoder(tmodel):
    a, b = _prompts([70, 20], seed=2), _prompts([33, 90], seed=3)
    dec = Decoder(tmodel, 2, 130, mode="static")
    _static_greedy(dec, a, [70, 20], 12)
    dec.reset()
    assert dec.positions == [0, 0] and dec.cache.pos.tolist() == [0, 0]
    got_toks, got = _static_greedy(dec, b, [33, 90], 12)
    want_toks, want = _static_greedy(Decoder(tmodel, 2, 130, mode="static"), b, [33, 90], 12)
    assert got_toks == want_toks
    assert max(rel(g, w) for g, w in zip(got, want)) == 0.0  # the same buffers, the same math


@torch.no_grad()
def test_a_model_cache_copied_in_decodes_as_the_cached_path(tmodel):
    prompt = _prompts([50], seed=4)
    cache = tcache.init_cache(tmodel.config, 1, 60)
    logits, cache = tmodel.step(prompt, cache)
    rows = cache.rows([0, 0])
    dec = Decoder(tmodel, 2, 80, mode="static").load(rows)
    assert dec.positions == [50, 50]
    tok = torch.tensor([3, 200])
    for _ in range(5):
        want, rows = tmodel.step(tok[:, None], rows)
        nxt, got = dec.step(tok)
        assert rel(got, want[:, 0]) <= TOL_LOGITS
        tok = nxt
    with pytest.raises(ValueError, match="expected 2 rows of at most 80"):
        dec.load(tcache.init_cache(tmodel.config, 2, 81))


@torch.no_grad()
def test_a_step_past_max_len_is_refused_before_anything_is_written(tmodel):
    dec = Decoder(tmodel, 1, 12, mode="static")
    dec.prefill(_prompts([10], seed=5))
    tok = torch.tensor([1])
    tok, _ = dec.step(tok)
    tok, _ = dec.step(tok)  # writes row 11, the last one
    before = [t.clone() for t in dec.cache.tensors()]
    with pytest.raises(ValueError, match="a row holds 12 tokens, the capacity max_len=12"):
        dec.step(tok)
    assert all(torch.equal(x, y) for x, y in zip(before, dec.cache.tensors()))
    with pytest.raises(ValueError, match="past its end"):  # the prefill's own capacity check
        Decoder(tmodel, 1, 8, mode="static").prefill(_prompts([10], seed=5))
    with pytest.raises(ValueError, match="mode: got 'graph', which captures CUDA graphs"):
        Decoder(tmodel, 1, 8, mode="graph")
    with pytest.raises(ValueError, match="indexer_rope: got 'half'"):
        DecodeCache.empty(tmodel.config.replace(indexer_rope="half"), 1, 8)


# ---------------------------------------------------------------------------------------------- cudnn pieces


@pytest.mark.parametrize("kind", ["dsa", "dsa-separate-buffers", "mla"])
def test_cudnn_static_mla_pieces_on_cpu(tmodel, kind):
    """``decode_cudnn.gated_mla_decode_static`` (the code of the cudnn backend that needs no GPU: fp32 runs the sparse
    kernel's torch twin over the latent buffer in place, or over gathered rows) against the dense static step, 80
    steps from an empty cache (past ``index_topk`` = 64); ``mla``: a layer without an indexer (SDPA, absorbed)."""
    from kernels_torch import decode, decode_cudnn
    from kernels_torch.mla import GatedMLA

    cfg = tmodel.config if kind != "mla" else tmodel.config.replace(dsa_layers=())
    layer = tmodel.model.layers[3].self_attn if kind != "mla" else GatedMLA(cfg, 3)
    caches = [DecodeCache.empty(cfg, 2, 90) for _ in range(2)]
    latent = None if kind == "dsa-separate-buffers" else caches[1].latent[3]
    x = torch.randn(2, 80, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    pos = torch.tensor([0, 5])
    with torch.no_grad():
        for t in range(80):
            want = decode._gated_mla_static(layer, x[:, t : t + 1], caches[0].layers[3], pos, form="absorbed")
            got = decode_cudnn.gated_mla_decode_static(layer, x[:, t : t + 1], caches[1].layers[3], pos, latent)
            assert rel(got, want) <= TOL_LOGITS, t
            pos = pos + 1
    for a, b in zip(caches[0].layers[3], caches[1].layers[3]):
        assert a is None or rel(a, b) <= TOL_LOGITS


def test_cudnn_kda_decode_glue_on_cpu(tmodel, monkeypatch):
    """``decode_cudnn.kda_decode_inplace`` with ``kernel="fla"`` against the layer's recurrence, fla's
    ``fused_recurrent_kda_fwd`` replaced by a torch stand-in of its documented contract (raw gate and beta in, the
    gate ``lb sigmoid(exp(A_log) (g + dt_bias))``, the beta sigmoid and the q/k L2 norms in the kernel, the state
    updated in place): what is checked is the glue (raw inputs, flags, the conv windows shifted in place)."""
    import sys
    import types

    from kernels_torch import decode_cudnn
    from kernels_torch.kda import kda_gate, kda_recurrent, l2norm

    def fake_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, inplace_final_state, scale, **flags):
        assert inplace_final_state and flags == dict(
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0
        )
        gate = kda_gate(g, A_log, dt_bias, flags["lower_bound"])
        o, S = kda_recurrent(l2norm(q), l2norm(k), v, gate, torch.sigmoid(beta.float()), scale, initial_state)
        initial_state.copy_(S)
        return o, initial_state

    mod = types.ModuleType("fla.ops.kda.fused_recurrent")
    mod.fused_recurrent_kda_fwd = fake_fwd
    for name in ("fla", "fla.ops", "fla.ops.kda"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.kda.fused_recurrent", mod)
    kda = tmodel.model.layers[0].self_attn
    assert tmodel.config.gate_lower_bound == -5.0
    want_c, got_c = (DecodeCache.empty(tmodel.config, 2, 4).layers[0] for _ in range(2))
    x = torch.randn(2, 6, tmodel.config.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        for t in range(6):
            want = decode_cudnn.kda_decode_inplace(kda, x[:, t : t + 1], want_c, "torch")
            got = decode_cudnn.kda_decode_inplace(kda, x[:, t : t + 1], got_c, "fla")
            assert rel(got, want) <= TOL_LOGITS, t
    assert rel(got_c.S, want_c.S) <= TOL_LOGITS and all(torch.equal(a, b) for a, b in zip(got_c[:3], want_c[:3]))
    if os.environ.get("TRITON_INTERPRET") != "1":  # no Triton on CPU tensors: named, not a Triton crash
        with pytest.raises(ValueError, match="kda_decode_triton: cannot run: (x is on cpu|Triton is not installed)"):
            decode_cudnn.kda_decode_inplace(kda, x[:, :1], got_c, "triton")


# ---------------------------------------------------------------------------------------------- sampling

# At temperature 1 token 0 holds 0.92 of the mass, so a 0.8 nucleus of the *untempered* distribution is {0}; at
# temperature 3 it holds 0.43 and tokens 1-4 0.11 each: the mass before token 4 is 0.77 < 0.8, before token 5 it is
# 0.89, so the tempered nucleus is {0, 1, 2, 3, 4} (token 5 ties with 1-4 and goes last: ties to the lower id).
NUCLEUS_LOGITS = [4.0, 0.0, 0.0, 0.0, 0.0, 0.0]
NUCLEUS_SUPPORT = {0, 1, 2, 3, 4}
# the tempered nucleus renormalised: e^(4/3) / (e^(4/3) + 4) = 0.487 for token 0, 1 / (e^(4/3) + 4) = 0.128 each
NUCLEUS_PROBS = np.array([np.exp(4 / 3), 1, 1, 1, 1, 0]) / (np.exp(4 / 3) + 4)
DRAWS = 2000  # each kept token but 0 is drawn with probability 0.128: missing one is a 1e-118 event
# The device sampler is an inverse CDF of u: DRAWS evenly spaced u give each token its mass x DRAWS within one draw.
TOL_STRATIFIED = 1.5 / DRAWS
# The numpy sampler draws from a seeded generator: NUMPY_DRAWS draws, 5 standard deviations of a 0.128 frequency
# (0.0075: a 6% reweighting of one token fails, a correct sampler fails with probability < 1e-6, and never: seeded)
NUMPY_DRAWS = 50_000
TOL_FREQ = 5 * np.sqrt(0.128 * 0.872 / NUMPY_DRAWS)


def test_sampling_tempers_before_the_nucleus_cut():
    """Both samplers at temperature 3, top-p 0.8: the support is the tempered nucleus and each token's frequency its
    renormalised tempered probability (the device sampler exactly, the numpy one within 5 standard deviations)."""
    rng = np.random.default_rng(0)
    logits = np.tile(np.array(NUCLEUS_LOGITS), (DRAWS, 1))
    assert set(sample(logits, 3.0, 0.8, rng).tolist()) == NUCLEUS_SUPPORT
    u = torch.rand(DRAWS, generator=torch.Generator().manual_seed(0))
    got = sample_device(torch.tensor(logits, dtype=torch.float32), 3.0, 0.8, u)
    assert set(got.tolist()) == NUCLEUS_SUPPORT
    assert set(sample_device(torch.tensor(logits, dtype=torch.float32), 3.0, 1.0, u).tolist()) == set(range(6))
    even = (torch.arange(DRAWS, dtype=torch.float64) + 0.5) / DRAWS
    got = sample_device(torch.tensor(logits, dtype=torch.float32), 3.0, 0.8, even)
    counts = np.bincount(got.numpy(), minlength=6) / DRAWS
    assert np.abs(counts - NUCLEUS_PROBS).max() <= TOL_STRATIFIED, counts
    many = np.tile(np.array(NUCLEUS_LOGITS), (NUMPY_DRAWS, 1))
    counts = np.bincount(sample(many, 3.0, 0.8, np.random.default_rng(1)), minlength=6) / NUMPY_DRAWS
    assert np.abs(counts - NUCLEUS_PROBS).max() <= TOL_FREQ, counts


def test_device_sampler_greedy_and_tiny_temperatures():
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0], [5.0, 1.0, 0.0, 0.0]])
    assert sample_device(logits, 0.0, 1.0, torch.zeros(2)).tolist() == [1, 0]  # ties to the lowest id
    # a temperature small enough to overflow logits / T is fine here: the max is subtracted first
    assert sample_device(logits, 1e-40, 0.5, torch.tensor([0.99, 0.5])).tolist() == [1, 0]


# ---------------------------------------------------------------------------------------------- generate


@torch.no_grad()
def test_generate_static_equals_loop(tmodel):
    prompts = [_prompts([30], seed=6)[0].tolist(), _prompts([75], seed=7)[0].tolist()]
    want = generate(tmodel, prompts, 20, stop_token=None, decode="loop").tokens
    streamed = []
    got = generate(tmodel, prompts, 20, stop_token=None, decode="static", on_token=lambda r, t: streamed.append((r, t)))
    assert got.tokens == want
    assert streamed == [(r, want[r][s]) for s in range(20) for r in range(2)]  # step by step, rows in order
    stop = want[0][4]  # row 0 stops at its 5th token (or earlier, where that id appears first)
    stopped = generate(tmodel, prompts, 20, stop_token=stop, decode="static").tokens
    for row, ref in zip(stopped, want):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert row == ref[:cut]
    # sampling: step s draws row n's token at u[s, n] of torch.rand(max_new_tokens, B) from the seeded generator
    a = generate(tmodel, prompts, 8, temperature=1.5, top_p=0.9, seed=3, stop_token=None, decode="static").tokens
    u = torch.rand(8, 2, generator=torch.Generator().manual_seed(3))
    dec = Decoder(tmodel, 2, 100, mode="static", temperature=1.5, top_p=0.9)
    nxt, want_sampled = dec.sample(dec.prefill(torch.from_numpy(_pad(prompts)), [30, 75]), u[0]), []
    for s in range(8):
        want_sampled.append(nxt.tolist())
        nxt, _ = dec.step(nxt, u[min(s + 1, 7)])
    assert a == [list(r) for r in zip(*want_sampled)]
    assert (
        a != generate(tmodel, prompts, 8, temperature=1.5, top_p=0.9, seed=4, stop_token=None, decode="static").tokens
    )
    with pytest.raises(ValueError, match="decode: got 'fast'"):
        generate(tmodel, prompts, 2, decode="fast")
    with pytest.raises(ValueError, match="a Decoder of 1 rows"):
        generate(tmodel, prompts, 2, decode=Decoder(tmodel, 1, 200, mode="static"))


# ---------------------------------------------------------------------------------------------- Triton kernel

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton KDA decode kernel on CPU needs triton and TRITON_INTERPRET=1 (GPU: test_gpu_generate_captured)",
)
TOL_KERNEL_FP32 = 1e-6  # fp32: only the order of the sums differs (~2e-7 seen)


@needs_interpreter
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower-bound", "softplus"])
def test_fused_kda_decode_kernel_equals_the_layer(lower_bound):
    import kernels_torch.kda as tk
    from kernels_torch.common import linear
    from kernels_torch.decode_cudnn import _kda_projections
    from kernels_torch.ops.kda_decode import KDADecodeWeights, kda_decode_triton

    cfg = load_config("tiny").replace(
        hidden_size=64, kda_num_heads=3, kda_head_dim=32, kda_gate_rank=16, gate_lower_bound=lower_bound
    )
    torch.manual_seed(1)
    layer = tk.KimiDeltaAttention(cfg, 0)
    N, P, W = 2, 96, cfg.short_conv_kernel_size
    x = torch.randn(N, 1, 64)
    cache = tk.KDACache(*(torch.randn(N, P, W - 1) for _ in range(3)), 0.3 * torch.randn(N, 3, 32, 32))
    with torch.no_grad():
        want, new = layer(x, cache=cache, mode="recurrent")
        windows, S = [c.clone() for c in cache[:3]], cache.S.clone()
        weights = KDADecodeWeights(
            layer.q_conv1d.weight,
            layer.k_conv1d.weight,
            layer.v_conv1d.weight,
            layer.A_log,
            layer.dt_bias,
            layer.o_norm.weight,
            layer.o_norm.eps,
            lower_bound,
            tk.A_LOG_MAX,
            tk.G_MIN,
        )
        y = kda_decode_triton(*_kda_projections(layer, x), windows, weights, S)
        got = linear(y[:, None], layer.o_proj)
    assert rel(got, want) <= TOL_KERNEL_FP32
    assert rel(S, new.S) <= TOL_KERNEL_FP32
    for a, b in zip(windows, new[:3]):
        assert torch.equal(a, b)  # the window shift is a copy
    from kernels_torch.decode_cudnn import kda_decode_inplace  # the layer-level wrapper, in place on the cache

    with torch.no_grad():
        assert rel(kda_decode_inplace(layer, x, cache, "triton"), want) <= TOL_KERNEL_FP32
    assert rel(cache.S, new.S) <= TOL_KERNEL_FP32 and torch.equal(cache.conv_q, new.conv_q)


# ---------------------------------------------------------------------------------------------- buffers


@torch.no_grad()
def test_a_too_small_decoder_is_refused_before_the_first_token_streams(tmodel):
    """``generate(decode=Decoder)`` with a max_len one short of prompt + max_new_tokens - 1 is refused before the
    prefill (nothing streamed); exactly that capacity is enough (the last token is sampled, never written)."""
    prompts = [_prompts([30], seed=8)[0].tolist()] * 2
    streamed = []
    with pytest.raises(ValueError, match="expected 2 rows and max_len >= 39"):
        generate(tmodel, prompts, 10, stop_token=None, decode=Decoder(tmodel, 2, 38, mode="static"),
                 on_token=lambda r, t: streamed.append(t))  # fmt: skip
    assert streamed == []
    got = generate(tmodel, prompts, 10, stop_token=None, decode=Decoder(tmodel, 2, 39, mode="static")).tokens
    assert got == generate(tmodel, prompts, 10, stop_token=None, decode="loop").tokens


@torch.no_grad()
def test_bf16_static_decode_keeps_the_kda_state_in_fp32(tmodel):
    """bf16 model: the decode cache's KDA state ``S`` is fp32 (its recurrence sums thousands of rank-1 updates), the
    conv windows and the latent buffers bf16, before and after a prefill and steps."""
    import copy

    model = copy.deepcopy(tmodel).to(torch.bfloat16)
    dec = Decoder(model, 1, 24, mode="static")

    def dtypes():
        kda = [e for e in dec.cache.layers if hasattr(e, "S")]
        assert len(kda) == 3
        return (
            {e.S.dtype for e in kda},
            {t.dtype for e in kda for t in e[:3]},
            {b.dtype for b in dec.cache.latent if b is not None},
        )

    assert dtypes() == ({torch.float32}, {torch.bfloat16}, {torch.bfloat16})
    last = dec.prefill(_prompts([12], seed=9))
    tok = dec.sample(last, torch.zeros(1))
    for _ in range(3):
        tok, logits = dec.step(tok)
    assert dtypes() == ({torch.float32}, {torch.bfloat16}, {torch.bfloat16})
    assert torch.isfinite(logits).all()


@torch.no_grad()
def test_load_into_used_buffers_equals_a_fresh_load(tmodel):
    """A ModelCache loaded into a Decoder that decoded a longer batch (its rows past the loaded capacity hold old
    keys) gives the same buffers as a load into a fresh Decoder: every tensor reset, old rows zero; a NaN seen by the
    earlier batch no longer fails the new one."""
    cache = tcache.init_cache(tmodel.config, 1, 40)
    _, cache = tmodel.step(_prompts([30], seed=10), cache)
    rows = cache.rows([0, 0])
    used = Decoder(tmodel, 2, 120, mode="static")
    _static_greedy(used, _prompts([90, 100], seed=11), [90, 100], 5)
    used.sample(torch.full((2, tmodel.config.vocab_size), float("nan")), torch.zeros(2))  # flags the batch
    used.load(rows)
    fresh = Decoder(tmodel, 2, 120, mode="static").load(rows)
    for a, b in zip(used.cache.tensors(), fresh.cache.tensors()):
        assert torch.equal(a, b)
    tok = torch.tensor([3, 200])
    nxt_used, got = used.step(tok)
    nxt_fresh, want = fresh.step(tok)
    assert torch.equal(got, want)
    assert used.read_tokens(nxt_used[:, None]) == fresh.read_tokens(nxt_fresh[:, None])
