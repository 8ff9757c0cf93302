"""GPU checks of cached generation on the ``cudnn`` backend (``kernels_torch.decode_cudnn``) against ``eager``:

* one DSA layer with K3.1's attention dims (kv_lora 512 + rope 64: the Triton ``sparse_mla_fwd`` path; indexer
  32 x 128, top-k 2048): a 3000-token prefill in chunks then 40 decode steps past it, cudnn (bf16) vs eager (fp32,
  same bf16-rounded weights, its own cache), per step;
* one KDA layer with K3's head dims (96 x 128): prefill then decode through fla's ``fused_recurrent_kda`` vs the eager
  recurrence, outputs and state;
* the tiny preset end to end: greedy ``generate`` on cudnn equals eager (bf16) for most tokens, and the cached
  logits follow the cache-free cudnn forward.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from _helpers import init_layer, rel  # noqa: E402

import kernels_torch.cache as tc  # noqa: E402
import kernels_torch.kda as tk  # noqa: E402
import kernels_torch.mla as tm  # noqa: E402
from kimi.config import load_config  # noqa: E402

TOL_DSA_STEP = 3e-2  # bf16 cudnn layer vs fp32 eager layer, same bf16-rounded weights (test_gpu_dsa_cudnn: 2e-2)
TOL_KDA_OUT = 2e-2  # bf16 fla recurrent vs fp32 eager recurrence
TOL_KDA_STATE = 2e-2
COSINE_MIN = 0.99  # tiny model logits, cached cudnn vs cache-free cudnn (bf16)


def _layer_cache(cfg, i, B, max_len, dtype):
    return tc.init_cache(cfg, B, max_len, dtype=dtype, device="cuda").layers[i]


@torch.no_grad()
def test_dsa_layer_cached_decode_matches_eager():
    cfg = load_config("k3.1-pro").replace(hidden_size=1024)  # layer 3 is DSA; real attention dims
    ref = tm.GatedMLA(cfg, 3, backend="eager")
    init_layer(ref, 0)
    fast = tm.GatedMLA(cfg, 3, backend="cudnn")
    fast.load_state_dict(ref.state_dict())
    fast = fast.cuda().bfloat16()
    ref = ref.cuda().bfloat16().float()  # the same bf16-rounded weights, fp32 compute
    B, T, steps = 2, 3000, 40
    x = torch.randn(B, T + steps, cfg.hidden_size, device="cuda")
    caches = _layer_cache(cfg, 3, B, T + steps, torch.float32), _layer_cache(cfg, 3, B, T + steps, torch.bfloat16)
    pos = torch.zeros(B, dtype=torch.int64)
    for a, b in ((0, 1000), (1000, 2048), (2048, T)):  # chunked prefill (the per-row sparse path)
        n = torch.full((B,), b - a)
        want, _ = ref(x[:, a:b], cache=caches[0], cache_pos=pos, lengths=n)
        got, _ = fast(x[:, a:b].bfloat16(), cache=caches[1], cache_pos=pos, lengths=n)
        assert rel(got, want) <= TOL_DSA_STEP, f"prefill chunk [{a}, {b})"
        pos = pos + n
    one = torch.ones(B, dtype=torch.int64)
    for t in range(T, T + steps):  # decode (the gathered sparse path), top-k 2048 of a growing cache
        want, _ = ref(x[:, t : t + 1], cache=caches[0], cache_pos=pos, lengths=one)
        got, _ = fast(x[:, t : t + 1].bfloat16(), cache=caches[1], cache_pos=pos, lengths=one)
        assert rel(got, want) <= TOL_DSA_STEP, f"decode position {t}"
        pos = pos + one


@torch.no_grad()
def test_kda_layer_decode_through_fla_matches_eager():
    cfg = load_config("tiny").replace(hidden_size=256, kda_num_heads=96, kda_head_dim=128, kda_gate_rank=64)
    ref = tk.KimiDeltaAttention(cfg, 0, backend="eager")
    init_layer(ref, 1)
    fast = tk.KimiDeltaAttention(cfg, 0, backend="cudnn")
    fast.load_state_dict(ref.state_dict())
    fast, ref = fast.cuda(), ref.cuda()
    for name, p in fast.named_parameters():  # checkpoint dtypes: A_log, dt_bias, conv, o_norm stay fp32 (spec 6)
        if not any(k in name for k in ("A_log", "dt_bias", "conv1d", "o_norm")):
            p.data = p.data.bfloat16()
    ref.load_state_dict({k: v.float() for k, v in fast.state_dict().items()})  # same rounded values, fp32 compute
    x = torch.randn(3, 200, cfg.hidden_size, device="cuda")
    from kernels_torch.decode_cudnn import kda_decode_fla

    _, want_cache = ref(x[:, :150])
    _, got_cache = fast(x[:, :150].bfloat16())
    for t in range(150, 200):
        want, want_cache = ref(x[:, t : t + 1], cache=want_cache, mode="recurrent")
        got, got_cache = kda_decode_fla(fast, x[:, t : t + 1].bfloat16(), got_cache)
        assert rel(got, want) <= TOL_KDA_OUT, f"position {t}"
    assert rel(got_cache.S, want_cache.S) <= TOL_KDA_STATE


@torch.no_grad()
def test_tiny_model_cached_generation_on_cudnn():
    import tempfile

    from kernels_torch.model import load_model
    from kimi.init import init_checkpoint
    from kimi_tools.generate import generate

    with tempfile.TemporaryDirectory() as d:
        init_checkpoint(d, load_config("tiny"), seed=0)
        fast = load_model(d, backend="cudnn", dtype=torch.bfloat16, device="cuda")
        eager = load_model(d, backend="eager", dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 256, (2, 160), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    free = fast(ids).float()
    logits, cache, _ = tc.prefill(fast, ids[:, :130], tc.init_cache(fast.config, 2, 160, torch.bfloat16, "cuda"), 64)
    steps = [logits.float()]
    for t in range(130, 160):
        out, cache = fast(ids[:, t : t + 1], cache=cache)
        steps.append(out.float())
    cos = torch.nn.functional.cosine_similarity(torch.cat(steps, 1).flatten(0, 1), free.flatten(0, 1), dim=-1)
    assert float(cos.min()) >= COSINE_MIN, float(cos.min())
    prompt = ids[0, :40].tolist()
    a = generate(fast, prompt, 16, stop_token=None).tokens[0]
    b = generate(eager, prompt, 16, stop_token=None).tokens[0]
    agree = sum(x == y for x, y in zip(a, b)) / len(a)
    assert a[:4] == b[:4] and agree >= 0.75, (a, b)  # bf16 near-ties may flip a late greedy pick
