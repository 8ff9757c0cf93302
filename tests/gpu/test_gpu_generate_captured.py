"""GPU checks of the captured decode step (``kernels_torch.decode.Decoder``, mode ``graph``) on the ``cudnn`` backend.

Model: the first 4 layers of K3.1 Pro (``KKKD``: three KDA layers with K3's 96 x 128 heads, one DSA layer with the real
attention dims, kv_lora 512 + rope 64, indexer 32 x 128, top-k 2048) at hidden size 1024 with 8 routed experts (2 a
token), random weights N(0, 1/in), bf16, on one GPU.

* greedy tokens of the captured step equal the uncaptured static step (the same code, eager) for 64 tokens at batch 1
  and 8, rows of different lengths, prompts shorter and longer than ``index_topk`` (1000 .. 3000 tokens); per-step
  logits equal to ``TOL_CAPTURED``; and they follow today's cached path (``KimiK3Model.step``, teacher-forced on the
  same tokens) within the bf16 bound ``TOL_LOOP_LOGITS``, every greedy pick equal to the cached path's except at
  near ties;
* a reset and reuse (the same graph, a new batch of prompts) equals a fresh decoder; a context that reaches the
  graph's ``max_len`` is refused with a ``ValueError`` before anything runs;
* decode makes no host sync: the step runs under ``torch.cuda.set_sync_debug_mode("error")`` (static and graph
  modes, greedy and sampling);
* the fused KDA decode kernel (``kernels_torch.ops.kda_decode``) equals fla's path and follows the fp32 eager layer;
* ``torch.compile(mode="reduce-overhead")`` (mode ``compile``) gives the static step's tokens (slow: it compiles).

Needs the grouped routed experts (``torch._grouped_mm``): the per-expert loop finds each expert's tokens with
``nonzero``, a host sync, which a CUDA graph cannot capture.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from helpers import rel  # noqa: E402

import kernels_torch.cache as tc  # noqa: E402
from kernels_torch.decode import Decoder, sample_device  # noqa: E402
from kernels_torch.model import KimiK3Model, cast_model  # noqa: E402
from kimi.config import load_config  # noqa: E402

STEPS = 64
TOL_CAPTURED = 1e-3  # captured vs eager replay of the same kernels: expected bitwise; room for a reordered reduction
TOL_LOOP_LOGITS = 3e-2  # static vs cached path, bf16: other KDA kernels (fused vs fla + torch conv), top-k over S_max
NEAR_TIE = 0.1  # logits: a greedy pick may differ from the cached path's only where its top-2 margin is below this
LENGTHS = {1: [3000], 8: [3000, 2900, 1000, 2500, 1500, 600, 2047, 2049]}  # around index_topk = 2048


def _config(layers=4):
    return (
        load_config("k3.1-pro")
        .truncated(layers)
        .replace(hidden_size=1024, num_experts=8, num_experts_per_token=2, moe_intermediate_size=512)
        .replace(routed_expert_hidden_size=512)
    )


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = KimiK3Model(_config(), backend="cudnn")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.ndim >= 2 and "conv1d" not in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return cast_model(m, torch.bfloat16).eval()


def _prompts(lengths, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    ids = torch.randint(0, 163840, (len(lengths), max(lengths)), device="cuda", generator=g)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
    return ids


@torch.no_grad()
def _decode(dec, ids, lengths, steps):
    """Greedy: (tokens [steps][B], logits [steps] of [B, V] fp32) of the decoder's steps."""
    last = dec.prefill(ids, lengths if len(set(lengths)) > 1 else None)
    nxt = dec.sample(last, torch.zeros(len(lengths), device="cuda"))
    toks, outs = [], []
    for _ in range(steps):
        toks.append(nxt.tolist())
        nxt, logits = dec.step(nxt)
        outs.append(logits.clone())
    return toks, outs, last


@torch.no_grad()
def _cached_path(model, ids, lengths, toks, steps):
    """Today's cached path teacher-forced on ``toks``: the logits [steps] of [B, V] fp32 after each fed token."""
    cache = tc.init_cache(model.config, len(lengths), max(lengths) + steps + 1, torch.bfloat16, "cuda")
    _, cache = model.step(ids, cache, lengths if len(set(lengths)) > 1 else None)
    outs = []
    for t in range(steps):
        logits, cache = model.step(torch.tensor(toks[t], device="cuda")[:, None], cache)
        outs.append(logits[:, 0].float())
    return outs


@pytest.mark.parametrize("B", [1, 8])
def test_captured_greedy_equals_uncaptured(model, B):
    lengths = LENGTHS[B]
    ids = _prompts(lengths, B)
    max_len = max(lengths) + STEPS + 1
    static_toks, static_logits, _ = _decode(Decoder(model, B, max_len, mode="static"), ids, lengths, STEPS)
    dec = Decoder(model, B, max_len, mode="graph")
    toks, logits, _ = _decode(dec, ids, lengths, STEPS)
    errs = [rel(a, b) for a, b in zip(logits, static_logits)]
    print(f"B={B}: captured vs static, logits rel max {max(errs):.2e}")
    assert toks == static_toks
    assert max(errs) <= TOL_CAPTURED
    loop = _cached_path(model, ids, lengths, toks, STEPS)
    loop_errs = [rel(a, b) for a, b in zip(logits, loop)]
    print(f"B={B}: captured vs cached path, logits rel mean {sum(loop_errs) / STEPS:.2e} max {max(loop_errs):.2e}")
    assert max(loop_errs) <= TOL_LOOP_LOGITS
    for t in range(STEPS - 1):  # the pick after step t is toks[t + 1]; the cached path's own pick is its argmax
        top2 = loop[t].topk(2, dim=-1).values
        for b in range(B):
            if toks[t + 1][b] != int(loop[t][b].argmax()):
                margin = float(top2[b, 0] - top2[b, 1])
                assert margin < NEAR_TIE, f"step {t} row {b}: picks differ at a margin of {margin:.3f}"
    assert dec.positions == [n + STEPS for n in lengths]


def test_reset_reuse_and_max_len(model):
    lengths = [1500, 2600]
    dec = Decoder(model, 2, 2700, mode="graph")
    _decode(dec, _prompts(lengths, 11), lengths, 16)
    graphs = len(dec._graphs)
    dec.reset()
    other = [2100, 700]
    toks, logits, _ = _decode(dec, _prompts(other, 12), other, 16)
    want_toks, want_logits, _ = _decode(Decoder(model, 2, 2700, mode="static"), _prompts(other, 12), other, 16)
    assert len(dec._graphs) == graphs == 1  # the same graph served the second batch
    assert toks == want_toks and max(rel(a, b) for a, b in zip(logits, want_logits)) <= TOL_CAPTURED
    small = Decoder(model, 1, 1004, mode="graph")
    small.prefill(_prompts([1000], 13))
    tok = torch.tensor([5], device="cuda")
    for _ in range(4):  # rows 1000 .. 1003: the last fits
        tok, _ = small.step(tok)
    pos = small.cache.pos.clone()
    with pytest.raises(ValueError, match="capacity max_len=1004"):
        small.step(tok)
    assert torch.equal(small.cache.pos, pos)


@pytest.mark.parametrize("mode, temperature", [("static", 0.0), ("static", 0.8), ("graph", 0.8)])
def test_decode_makes_no_host_sync(model, mode, temperature):
    lengths = [900, 2200]
    dec = Decoder(model, 2, 2300, mode=mode, temperature=temperature, top_p=0.9)
    _decode(dec, _prompts(lengths, 14), lengths, 2)  # warm-up: Triton compiles, the graph is captured
    tok, u = torch.tensor([1, 2], device="cuda"), torch.rand(2, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            for _ in range(3):
                tok, _ = dec.step(tok, u)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert dec.read_tokens(tok[:, None])  # finite logits


@torch.no_grad()
def test_fused_kda_decode_kernel(model):
    """The Triton kernel (bf16) against fla's path (bf16) and the fp32 eager layer (the same bf16-rounded weights)."""
    from kernels_torch.decode import DecodeCache
    from kernels_torch.decode_cudnn import kda_decode_inplace
    from kernels_torch.kda import KimiDeltaAttention

    cfg = model.config
    layer = model.model.layers[1].self_attn
    ref = KimiDeltaAttention(cfg, 1, backend="eager").cuda()
    ref.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    caches = [DecodeCache.empty(cfg, 3, 4, torch.bfloat16, "cuda").layers[1] for _ in range(2)]
    S0 = 0.1 * torch.randn(caches[0].S.shape, device="cuda")
    for c in caches:
        c.S.copy_(S0)
    ref_cache = tc.init_cache(cfg, 3, 4, torch.float32, "cuda").layers[1]._replace(S=S0.clone())
    x = torch.randn(3, 40, cfg.hidden_size, device="cuda")
    for t in range(40):
        a = kda_decode_inplace(layer, x[:, t : t + 1].bfloat16(), caches[0], "triton")
        b = kda_decode_inplace(layer, x[:, t : t + 1].bfloat16(), caches[1], "fla")
        want, ref_cache = ref(x[:, t : t + 1], cache=ref_cache, mode="recurrent")
        assert rel(a, b) <= 1e-2 and rel(a, want) <= 2e-2, (t, rel(a, b), rel(a, want))
    assert rel(caches[0].S, caches[1].S) <= 1e-2 and rel(caches[0].S, ref_cache.S) <= 2e-2


def test_device_sampler_support_on_gpu():
    logits = torch.tensor([[4.0, 0.0, 0.0, 0.0, 0.0, 0.0]], device="cuda").expand(4000, 6).contiguous()
    u = torch.rand(4000, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    assert set(sample_device(logits, 3.0, 0.8, u).tolist()) == {0, 1, 2, 3, 4}  # temperature first, then the cut


@pytest.mark.slow
def test_compiled_step_equals_static(model):
    lengths = [1200, 2500]
    ids = _prompts(lengths, 15)
    want, _, _ = _decode(Decoder(model, 2, 2600, mode="static"), ids, lengths, 12)
    got, _, _ = _decode(Decoder(model, 2, 2600, mode="compile"), ids, lengths, 12)
    assert got == want
