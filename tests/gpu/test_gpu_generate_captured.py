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
from kernels_torch.moe import MoEGate, selection_scores  # noqa: E402
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


class _RouterLog:
    """Forward hooks on every ``MoEGate``: while ``on``, each call's picked experts ``[N, k]`` (sorted) and the gap
    between the k-th and (k+1)-th selection score per row (how near a tie the pick was). Hooks run in eager calls
    only (not in a graph's replay): record the static step, which the captured one equals."""

    def __init__(self, model):
        self.on, self.calls = False, []
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, MoEGate)]

    def _hook(self, gate, args, out):
        if self.on:
            k = gate.config.num_experts_per_token
            x = args[0].reshape(-1, args[0].shape[-1])
            s = selection_scores(x, gate.weight, gate.e_score_correction_bias, gate.config).float()
            top = s.topk(min(k + 1, s.shape[-1]), dim=-1).values
            self.calls.append((out[0].reshape(-1, k).sort(-1).values, top[:, k - 1] - top[:, -1]))

    def per_step(self, steps):
        """[steps] of [(ids, gap) per MoE layer]."""
        n = len(self.calls) // steps
        return [self.calls[t * n : (t + 1) * n] for t in range(steps)]

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def _decode(dec, ids, lengths, steps, log=None):
    """Greedy: (tokens [steps][B], logits [steps] of [B, V] fp32) of the decoder's steps."""
    last = dec.prefill(ids, lengths if len(set(lengths)) > 1 else None)
    nxt = dec.sample(last, torch.zeros(len(lengths), device="cuda"))
    toks, outs = [], []
    for _ in range(steps):
        toks.append(nxt.tolist())
        if log is not None:
            log.on = True
        nxt, logits = dec.step(nxt)
        if log is not None:
            log.on = False
        outs.append(logits.clone())
    return toks, outs, last


@torch.no_grad()
def _cached_path(model, ids, lengths, toks, steps, dtype=torch.bfloat16, log=None):
    """Today's cached path teacher-forced on ``toks``: the logits [steps] of [B, V] fp32 after each fed token."""
    cache = tc.init_cache(model.config, len(lengths), max(lengths) + steps + 1, dtype, "cuda")
    _, cache = model.step(ids, cache, lengths if len(set(lengths)) > 1 else None)
    outs = []
    for t in range(steps):
        if log is not None:
            log.on = True
        logits, cache = model.step(torch.tensor(toks[t], device="cuda")[:, None], cache)
        if log is not None:
            log.on = False
        outs.append(logits[:, 0].float())
    return outs


def _router_diffs(a, b, steps):
    """Per step: (rows x MoE layers whose expert sets differ between logs a and b, the smallest gap among them)."""
    out = []
    for ca, cb in zip(a.per_step(steps), b.per_step(steps)):
        n, gap = 0, float("inf")
        for (ia, ga), (ib, gb) in zip(ca, cb):
            differ = (ia != ib).any(-1)
            n += int(differ.sum())
            if differ.any():
                gap = min(gap, float(torch.minimum(ga, gb)[differ].min()))
        out.append((n, gap))
    return out


@torch.no_grad()
def _fp32_oracle(model, ids, lengths, toks, steps):
    """The eager backend in fp32 on the same (bf16-exact) weights, teacher-forced on ``toks`` one row at a time (the
    dense-mask attention of a 3,000-token prompt fits that way): logits [steps] of [B, V] fp32."""
    ref = KimiK3Model(model.config, backend="eager").cuda()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    rows = [
        _cached_path(ref, ids[b : b + 1, :n], [n], [[toks[t][b]] for t in range(steps)], steps, torch.float32)
        for b, n in enumerate(lengths)
    ]
    return [torch.cat([r[t] for r in rows]) for t in range(steps)]


def _worst(errs, n=4):
    return ", ".join(f"step {t}: {e:.3f}" for e, t in sorted(((e, t) for t, e in enumerate(errs)), reverse=True)[:n])


@pytest.mark.parametrize("B", [1, 8])
def test_captured_greedy_equals_uncaptured(model, B):
    lengths = LENGTHS[B]
    ids = _prompts(lengths, B)
    max_len = max(lengths) + STEPS + 1
    static_log = _RouterLog(model)
    static_toks, static_logits, _ = _decode(Decoder(model, B, max_len, mode="static"), ids, lengths, STEPS, static_log)
    static_log.remove()
    dec = Decoder(model, B, max_len, mode="graph")
    toks, logits, _ = _decode(dec, ids, lengths, STEPS)
    errs = [rel(a, b) for a, b in zip(logits, static_logits)]
    print(f"B={B}: captured vs static, logits rel max {max(errs):.2e}")
    assert toks == static_toks
    assert max(errs) <= TOL_CAPTURED
    loop_log = _RouterLog(model)
    loop = _cached_path(model, ids, lengths, toks, STEPS, log=loop_log)
    loop_log.remove()
    loop_errs = [rel(a, b) for a, b in zip(logits, loop)]
    print(f"B={B}: captured vs cached path, logits rel mean {sum(loop_errs) / STEPS:.2e} max {max(loop_errs):.2e}")
    # which of the two bf16 paths leaves the fp32 eager oracle where they disagree (printed before the asserts)
    oracle = _fp32_oracle(model, ids, lengths, toks, STEPS)
    for name, got in (("captured", logits), ("cached path", loop)):
        e = [rel(a, b) for a, b in zip(got, oracle)]
        print(f"B={B}: {name} vs fp32 eager, logits rel mean {sum(e) / STEPS:.2e}; worst {_worst(e)}")
    print(f"B={B}: captured vs cached path, worst {_worst(loop_errs)}")
    routers = _router_diffs(static_log, loop_log, STEPS)
    for t in sorted(range(STEPS), key=lambda t: -loop_errs[t])[:6]:
        n, gap = routers[t]
        print(
            f"B={B}: step {t}: logits rel {loop_errs[t]:.3f}; expert sets differ in {n} (row, layer) pairs, gap {gap:.2e}"
        )
    print(f"B={B}: steps with a differing expert set: {sum(n > 0 for n, _ in routers)} of {STEPS}")
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
