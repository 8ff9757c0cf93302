"""The generation cache of both paths (``reference_jax.cache``, ``kernels_torch.cache``) on the tiny preset cut to its
first 4 layers (``KKKD``: three KDA layers and one DSA layer with ``index_topk`` 64), from a checkpoint on disk.

What is checked (fla's ``test_modeling_base`` prefill-then-decode, nanochat's engine-vs-``generate`` oracle):

* chunked prefill (chunks of 1, 17, 64, 128 and uneven) equals one prefill of the whole prompt, logits and every
  cache tensor, for prompts shorter and longer than ``index_topk``; one cached prefill equals the cache-free forward;
* decoding token by token equals the cache-free forward's logits at every position (teacher forcing), 70 steps past
  a 130-token prompt, so the indexer's top-k runs over a growing cache; JAX and torch agree on logits and caches;
* prefix caching: a copy taken at position 128 of a 130-token prompt (mid-chunk) resumes like a cold prefill;
* batches: rows of different lengths (right padding, ``lengths``) each with its own position, against
  per-sequence cache-free forwards; ``rows()`` replicates a batch-1 prefill;
* bad use: another config, another batch size, a write past ``max_len``, bad ``lengths``, a snapshot past the end.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import rel

from kernels_torch import cache as tcache
from kernels_torch.model import load_model as load_torch
from reference_jax import cache as jcache
from reference_jax.model import load_model as load_jax

LAYERS = 4  # KKKD
# Named tolerances (relative error, fp32): chunking changes only summation order (KDA chunk vs recurrent form at
# T = 1, attention over more masked keys), so everything agrees to ~1e-6; 1e-5 leaves room, a wrong cache is O(1).
TOL = {"logits": 1e-5, "conv_q": 1e-5, "conv_k": 1e-5, "conv_v": 1e-5, "S": 1e-5, "c_kv": 1e-5, "k_pe": 1e-5}
TOL["index_k"] = 1e-5
TOL_JAX_TORCH = dict.fromkeys(TOL, 2e-05)  # the two twins in fp32 (tests/test_model.py: logits 1e-5)


def ids_for(B, T, seed):
    return np.random.default_rng(seed).integers(0, 256, size=(B, T))  # byte-level vocabulary


def assert_caches_close(a, b, tol=TOL, what=""):
    assert np.array_equal(np.asarray(a.pos), np.asarray(b.pos)), (what, a.pos, b.pos)
    for i, (la, lb) in enumerate(zip(a.layers, b.layers)):
        for name in la._fields:
            ta, tb = getattr(la, name), getattr(lb, name)
            if ta is None:
                assert tb is None
                continue
            err = rel(ta, tb)
            assert err <= tol[name], f"{what} layer {i} {name}: rel {err:.2e} > {tol[name]}"


@pytest.fixture(scope="module")
def tmodel(tiny_ckpt):
    return load_torch(tiny_ckpt, layers=LAYERS, backend="eager")


# ---------------------------------------------------------------------------------------------- chunked prefill

SPLITS = {
    "1": lambda T: [1] * T,
    "17": lambda T: [17] * (T // 17) + ([T % 17] if T % 17 else []),
    "64": lambda T: [64] * (T // 64) + ([T % 64] if T % 64 else []),
    "128": lambda T: [128] * (T // 128) + ([T % 128] if T % 128 else []),
    "uneven": lambda T: [1, 5, T - 70, 64] if T > 70 else [3, T - 10, 7],
}


@pytest.mark.parametrize(
    "T, split",
    [(40, "1"), (40, "17"), (40, "uneven"), (70, "1"), (130, "17"), (130, "64"), (130, "128"), (130, "uneven")],
    ids=lambda v: f"T{v}" if isinstance(v, int) else f"chunks-{v}",
)
def test_torch_chunked_prefill_equals_one_prefill(tmodel, T, split):
    ids = torch.from_numpy(ids_for(2, T, T))
    sizes = SPLITS[split](T)
    assert sum(sizes) == T
    with torch.no_grad():
        free = tmodel(ids)
        one, one_cache = tmodel.step(ids, tcache.init_cache(tmodel.config, 2, 160))
        assert rel(one, free) <= TOL["logits"], "one cached prefill vs the cache-free forward"
        cache, outs, a = tcache.init_cache(tmodel.config, 2, 160), [], 0
        for n in sizes:
            out, cache = tmodel.step(ids[:, a : a + n], cache)
            outs.append(out)
            a += n
    assert rel(torch.cat(outs, 1), one) <= TOL["logits"]
    assert_caches_close(cache, one_cache, what=f"chunks {sizes[:4]}")
    assert cache.pos.tolist() == [T, T]


# ---------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("backend, form", [("eager", "expanded"), ("sdpa", "absorbed")])
def test_torch_decode_teacher_forcing(tiny_ckpt, backend, form):
    """70 decode steps past a 130-token prompt (> index_topk): logits at every position equal the cache-free ones."""
    model = load_torch(tiny_ckpt, layers=LAYERS, backend=backend)
    ids = torch.from_numpy(ids_for(2, 200, 3))
    with torch.no_grad():
        free = model(ids, mla_form=form)
        logits, cache, _ = tcache.prefill(model, ids[:, :130], tcache.init_cache(model.config, 2, 200), 64)
        assert rel(logits, free[:, :130]) <= TOL["logits"]
        for t in range(130, 200):
            step, cache = model.step(ids[:, t : t + 1], cache, mla_form=form)
            assert rel(step[:, 0], free[:, t]) <= TOL["logits"], f"position {t}"
    assert cache.pos.tolist() == [200, 200]


@pytest.fixture(scope="module")
def jax_model(tiny_ckpt):
    """The reference and one jitted cached call (``lengths`` static), shared so that the tests share compilations."""
    model, params, cfg = load_jax(tiny_ckpt, layers=LAYERS)

    def call(p, i, c, lengths=None):
        return model.apply({"params": p}, i, c, None if lengths is None else np.array(lengths), method="step")

    return model, params, cfg, jax.jit(call, static_argnames="lengths")


@pytest.mark.slow
def test_jax_prefill_decode_prefix_and_torch_agree(jax_model, tmodel):
    """The reference under jax.jit: chunked prefill = one prefill (logits, every cache tensor), 70 decode steps =
    cache-free forward, a snapshot at 128 resumes like the cold cache; and the torch twin's logits and caches agree."""
    model, params, cfg, apply = jax_model
    ids = ids_for(2, 200, 4)
    free = jax.jit(lambda p, i: model.apply({"params": p}, i))(params, ids)
    one, one_cache, _ = jcache.prefill(model, params, ids[:, :130], jcache.init_cache(cfg, 2, 200), apply=apply)
    assert rel(one, free[:, :130]) <= TOL["logits"]
    logits, cache, snaps = jcache.prefill(
        model, params, ids[:, :130], jcache.init_cache(cfg, 2, 200), 64, snapshot_at=[128], apply=apply
    )
    assert rel(logits, one) <= TOL["logits"]
    assert_caches_close(cache, one_cache, what="jax chunks of 64")
    resumed, resumed_cache = apply(params, ids[:, 128:130], snaps[128])  # prefix cache at 128, then 2 more tokens
    assert rel(resumed, one[:, 128:130]) <= TOL["logits"]
    assert_caches_close(resumed_cache, one_cache, what="jax resumed from 128")
    for t in range(130, 200):
        step, cache = apply(params, ids[:, t : t + 1], cache)
        assert rel(step[:, 0], free[:, t]) <= TOL["logits"], f"jax position {t}"

    tids = torch.from_numpy(ids)
    with torch.no_grad():
        tlogits, tc, _ = tcache.prefill(tmodel, tids[:, :130], tcache.init_cache(tmodel.config, 2, 200), 64)
        assert rel(tlogits, logits) <= TOL_JAX_TORCH["logits"]
        for t in range(130, 200):
            tstep, tc = tmodel.step(tids[:, t : t + 1], tc)
    assert rel(tstep[:, 0], step[:, 0]) <= TOL_JAX_TORCH["logits"]
    assert_caches_close(tc, cache, TOL_JAX_TORCH, what="torch vs jax after 70 steps")


# ---------------------------------------------------------------------------------------------- prefix caching


def test_torch_prefix_cache_mid_chunk(tmodel):
    """Chunks of 100 with a snapshot at 128 (inside the chunk [100, 130)): the copy equals a cold prefill of 128
    tokens, and resuming from it equals the cold path token for token; the original cache is left untouched."""
    ids = torch.from_numpy(ids_for(1, 136, 5))
    with torch.no_grad():
        free = tmodel(ids)
        logits, cache, snaps = tcache.prefill(
            tmodel, ids[:, :130], tcache.init_cache(tmodel.config, 1, 140), 100, snapshot_at=[128]
        )
        assert rel(logits, free[:, :130]) <= TOL["logits"]
        _, cold128, _ = tcache.prefill(tmodel, ids[:, :128], tcache.init_cache(tmodel.config, 1, 140))
        assert_caches_close(snaps[128], cold128, what="snapshot at 128 vs cold prefill of 128")
        resumed = snaps[128].copy()
        out, resumed = tmodel.step(ids[:, 128:130], resumed)
        assert rel(out, free[:, 128:130]) <= TOL["logits"]
        for t in range(130, 136):
            out, resumed = tmodel.step(ids[:, t : t + 1], resumed)
            assert rel(out[:, 0], free[:, t]) <= TOL["logits"], f"position {t}"
    assert snaps[128].pos.tolist() == [128] and cache.pos.tolist() == [130]  # copies are independent
    assert_caches_close(snaps[128], cold128, what="snapshot after resuming from a copy of it")


# ---------------------------------------------------------------------------------------------- batches


def test_torch_batch_rows_of_different_lengths(tmodel):
    """Three sequences of 5, 70 and 130 prompt tokens in one call (right padding, ``lengths``), then a call giving
    them 3, 1 and 2 tokens, then decode steps: every row equals its own cache-free forward."""
    lens = [5, 70, 130]
    seqs = [ids_for(1, n + 8, 10 + i)[0] for i, n in enumerate(lens)]
    with torch.no_grad():
        free = [tmodel(torch.from_numpy(s)[None])[0] for s in seqs]
        cache = tcache.init_cache(tmodel.config, 3, 150)
        batch = torch.zeros(3, 130, dtype=torch.int64)  # padding id 0: any valid id, never read
        for b, (s, n) in enumerate(zip(seqs, lens)):
            batch[b, :n] = torch.from_numpy(s[:n])
        out, cache = tmodel.step(batch, cache, lens)
        for b, n in enumerate(lens):
            assert rel(out[b, :n], free[b][:n]) <= TOL["logits"], f"prefill row {b}"
        more = [3, 1, 2]
        step = torch.zeros(3, 3, dtype=torch.int64)
        for b, (s, n, m) in enumerate(zip(seqs, lens, more)):
            step[b, :m] = torch.from_numpy(s[n : n + m])
        out, cache = tmodel.step(step, cache, more)
        for b, (n, m) in enumerate(zip(lens, more)):
            assert rel(out[b, :m], free[b][n : n + m]) <= TOL["logits"], f"second call row {b}"
        pos = [n + m for n, m in zip(lens, more)]
        assert cache.pos.tolist() == pos
        for _ in range(3):
            nxt = torch.tensor([[int(s[p])] for s, p in zip(seqs, pos)])
            out, cache = tmodel.step(nxt, cache)
            for b, p in enumerate(pos):
                assert rel(out[b, 0], free[b][p]) <= TOL["logits"], f"decode row {b} position {p}"
            pos = [p + 1 for p in pos]


def test_torch_rows_replicate_a_prefill(tmodel):
    """nanochat's engine: a batch-1 prefill copied into 3 decode rows, each then fed its own tokens."""
    prompt = ids_for(1, 80, 20)
    conts = ids_for(3, 4, 21)
    with torch.no_grad():
        _, cache = tmodel.step(torch.from_numpy(prompt), tcache.init_cache(tmodel.config, 1, 90))
        rows = cache.rows([0, 0, 0])
        for t in range(4):
            out, rows = tmodel.step(torch.from_numpy(conts[:, t : t + 1]), rows)
        for b in range(3):
            full = tmodel(torch.from_numpy(np.concatenate([prompt[0], conts[b]]))[None])
            assert rel(out[b, 0], full[0, -1]) <= TOL["logits"], f"row {b}"
    assert cache.pos.tolist() == [80]


def test_jax_batch_rows_agree_with_torch(jax_model, tmodel):
    """The reference's per-row lengths (right padding) and positions: equal to the torch twin's per-sequence
    cache-free forwards (tests/test_model.py ties those to the reference's)."""
    model, params, cfg, apply = jax_model
    lens = (5, 12)
    seqs = [ids_for(1, n + 1, 30 + i)[0] for i, n in enumerate(lens)]
    batch = np.zeros((2, 12), np.int64)
    for b, (s, n) in enumerate(zip(seqs, lens)):
        batch[b, :n] = s[:n]
    out, cache = apply(params, batch, jcache.init_cache(cfg, 2, 200), lengths=lens)
    step, cache = apply(params, np.array([[s[n]] for s, n in zip(seqs, lens)]), cache)
    assert np.asarray(cache.pos).tolist() == [n + 1 for n in lens]
    with torch.no_grad():
        for b, (s, n) in enumerate(zip(seqs, lens)):
            free = tmodel(torch.from_numpy(s)[None])[0].numpy()
            assert rel(out[b, :n], free[:n]) <= TOL_JAX_TORCH["logits"], f"prefill row {b}"
            assert rel(step[b, 0], free[n]) <= TOL_JAX_TORCH["logits"], f"decode row {b}"


# ---------------------------------------------------------------------------------------------- bad use


def test_torch_bad_use_is_refused(tmodel, tiny_ckpt):
    cfg = tmodel.config
    ids = torch.from_numpy(ids_for(2, 8, 40))
    with pytest.raises(ValueError, match="another config"):
        tmodel.step(ids, tcache.init_cache(cfg.truncated(3), 2, 16))
    with pytest.raises(ValueError, match="holds 3 rows, input_ids has batch 2"):
        tmodel.step(ids, tcache.init_cache(cfg, 3, 16))
    with pytest.raises(ValueError, match="past its end"):
        tmodel.step(ids, tcache.init_cache(cfg, 2, 7))
    cache = tcache.init_cache(cfg, 2, 16)
    with torch.no_grad():
        tmodel.step(ids, cache)
        with pytest.raises(ValueError, match="row 0 holds 8 tokens and would get 9 more"):
            tmodel.step(torch.from_numpy(ids_for(2, 9, 41)), cache)
    with pytest.raises(ValueError, match="lengths"):
        tmodel.step(ids, tcache.init_cache(cfg, 2, 16), [8, 0])
    with pytest.raises(ValueError, match=r"lengths: got \[9, 8\], expected \[B\]=2 integers in \[1, T=8\]"):
        tmodel.step(ids, tcache.init_cache(cfg, 2, 16), [9, 8])  # more tokens than the call has columns
    top = ids.clone()
    top[1, 3] = cfg.vocab_size - 1  # the last id: fine
    with torch.no_grad():
        tmodel.step(top, tcache.init_cache(cfg, 2, 16))
    top[1, 3] = cfg.vocab_size  # one past: named, not the embedding's IndexError (a device assert on CUDA)
    for call in (lambda: tmodel.step(top, tcache.init_cache(cfg, 2, 16)), lambda: tmodel(top)):
        with pytest.raises(ValueError, match=rf"input_ids: got ids in \[\d+, {cfg.vocab_size}\], expected ids in"):
            call()
    with (
        pytest.raises(ValueError, match="cache: given with cu_seqlens"),
        pytest.warns(DeprecationWarning, match="step"),
    ):
        tmodel(ids[:1], cache=tcache.init_cache(cfg, 1, 16), cu_seqlens=torch.tensor([0, 3, 8]))  # the old alias
    with pytest.raises(ValueError, match="snapshot_at: got 9"):
        tcache.prefill(tmodel, ids, tcache.init_cache(cfg, 2, 16), snapshot_at=[9])
    broken = tcache.init_cache(cfg, 2, 16)
    broken.layers[3] = broken.layers[0]  # a KDA entry where the DSA layer's is expected
    with pytest.raises(ValueError, match="layer 3"):
        tmodel.step(ids, broken)
    with pytest.raises(ValueError, match="idx"):
        cache.rows([2])
    # a cache of another dtype than the model's activations: named, not torch's "m1 and m2" deep inside a layer
    with pytest.raises(ValueError, match=r"layer 3 c_kv is torch.float64 .* expected torch.float32"):
        tmodel.step(ids, tcache.init_cache(cfg, 2, 16, dtype=torch.float64))


def test_jax_bad_use_is_refused(tiny_ckpt):
    model, params, cfg = load_jax(tiny_ckpt, layers=LAYERS)
    ids = ids_for(2, 8, 40)

    def run(cache, lengths=None):
        return model.apply({"params": params}, ids, cache, lengths, method="step")

    with pytest.raises(ValueError, match="another config"):
        run(jcache.init_cache(cfg.truncated(3), 2, 16))
    with pytest.raises(ValueError, match="holds 1 rows, input_ids has batch 2"):
        run(jcache.init_cache(cfg, 1, 16))
    with pytest.raises(ValueError, match="past its end"):
        run(jcache.init_cache(cfg, 2, 7))
    with pytest.raises(ValueError, match=r"lengths: got \[9, 1\], expected \[B\]=2 integers in \[1, T=8\]"):
        run(jcache.init_cache(cfg, 2, 16), lengths=np.array([9, 1]))
    top = ids.copy()
    top[1, 3] = cfg.vocab_size  # the same message as the torch twin's
    with pytest.raises(ValueError, match=rf"input_ids: got ids in \[\d+, {cfg.vocab_size}\], expected ids in"):
        model.apply({"params": params}, top, jcache.init_cache(cfg, 2, 16), method="step")
    with pytest.raises(ValueError, match="snapshot_at: got 0"):
        jcache.prefill(model, params, ids, jcache.init_cache(cfg, 2, 16), snapshot_at=[0])
    empty = jcache.init_cache(cfg, 2, 16)
    assert empty.layers[0].S.dtype == jnp.float32 and int(empty.pos.sum()) == 0


# ---------------------------------------------------------------------------------------------- cudnn pieces on CPU


def test_cudnn_cached_pieces_on_cpu(tmodel, monkeypatch):
    """The code of ``kernels_torch.decode_cudnn`` that does not need a GPU, against the eager layers: the DSA layer's
    gathered (decode) and per-row (prefill) sparse paths, and the KDA decode wrapper with a torch stand-in for fla's
    ``fused_recurrent_kda`` (the real kernel is checked in tests/gpu/test_gpu_generate.py)."""
    import sys
    import types

    from kernels_torch import decode_cudnn
    from kernels_torch.kda import kda_recurrent, l2norm

    def fake_fused_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        assert output_final_state and use_qk_l2norm_in_kernel and initial_state.dtype == torch.float32
        return kda_recurrent(l2norm(q), l2norm(k), v, g, beta, scale=scale, initial_state=initial_state)

    fla = types.ModuleType("fla.ops.kda")
    fla.fused_recurrent_kda = fake_fused_recurrent_kda
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.kda", fla)

    cfg, D = tmodel.config, tmodel.config.hidden_size
    x = torch.randn(2, 100, D)
    dsa, kda = tmodel.model.layers[3].self_attn, tmodel.model.layers[0].self_attn
    with torch.no_grad():
        for T, lengths in ((90, [90, 75]), (1, [1, 1]), (10, [10, 3])):  # per-row prefill, gathered decode, gathered
            caches = [tcache.init_cache(cfg, 2, 100).layers[3] for _ in range(2)]
            pos = torch.tensor([0, 0])
            for a in (0, 90):
                n = torch.tensor(lengths) if a == 0 else torch.tensor([T if T < 10 else 1] * 2)
                xs = x[:, a : a + (T if a == 0 else int(n.max()))]
                want, _, _ = dsa(xs, return_aux=True, cache=caches[0], cache_pos=pos, lengths=n)
                got, _, _ = decode_cudnn.gated_mla_cached(dsa, xs, caches[1], pos, n, return_aux=True)
                for b in range(2):
                    assert rel(got[b, : n[b]], want[b, : n[b]]) <= 1e-5, (T, a, b)
                pos = pos + n
        cache = tcache.init_cache(cfg, 2, 8).layers[0]
        for t in range(3):
            want, wcache = kda(x[:, t : t + 1], cache=cache, mode="recurrent")
            got, gcache = decode_cudnn.kda_decode_fla(kda, x[:, t : t + 1], cache)
            assert (
                rel(got, want) <= 1e-5 and rel(gcache.S, wcache.S) <= 1e-5 and torch.equal(gcache.conv_v, wcache.conv_v)
            )
            cache = gcache


def test_prefix_copy_under_autograd(tmodel):
    """``prefill(..., snapshot_at=)`` and ``ModelCache.copy`` outside ``torch.no_grad()`` (README's snippet): the
    copies are detached buffers, equal to the live cache's values at that point (deepcopy refused non-leaf tensors)."""
    cfg = tmodel.config
    ids = torch.from_numpy(ids_for(1, 20, 43))
    _, cache, snaps = tcache.prefill(tmodel, ids, tcache.init_cache(cfg, 1, 24), chunk_size=8, snapshot_at=[12])
    copy = cache.copy()
    for a, b in zip(copy.layers, cache.layers):
        for x, y in zip(a, b):
            assert (x is None and y is None) or (not x.requires_grad and torch.equal(x, y) and x is not y)
    assert int(snaps[12].pos[0]) == 12


# ---------------------------------------------------------------------------------------------- import layering

CACHE_MODULES = {
    "kernels_torch.kv_cache",
    "kernels_torch.cache",
    "kernels_torch.decode",
    "kernels_torch.decode_cudnn",
    "kernels_torch.model",
    "reference_jax.kv_cache",
    "reference_jax.cache",
    "reference_jax.model",
}


def _import_graph() -> dict[str, set[str]]:
    """Every import of the four packages, module to module, function-level (lazy) imports included (AST)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = {}
    for pkg in ("kimi", "reference_jax", "kernels_torch", "kimi_tools"):
        for f in (root / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            files[name] = f
    graph = {}
    for name, f in files.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def test_cache_primitives_are_a_leaf_and_no_cycle_runs_through_the_cache():
    """The layers import the cache primitives from the leaf (``kv_cache``, which imports no project module), never
    the model-level cache that imports them; no import cycle, lazy imports included, passes through a cache or
    decode module of either twin."""
    graph = _import_graph()
    assert graph["kernels_torch.kv_cache"] == set() and graph["reference_jax.kv_cache"] == set()
    for layer in ("kernels_torch.mla", "kernels_torch.indexer", "kernels_torch.decode_cudnn", "reference_jax.mla"):
        assert not graph[layer] & {"kernels_torch.cache", "reference_jax.cache", "kernels_torch.decode"}, layer

    def reaches(a, b, seen=()):
        return b in graph[a] or any(reaches(n, b, (*seen, a)) for n in graph[a] if n not in seen)

    cyclic = sorted(m for m in CACHE_MODULES if reaches(m, m))
    assert cyclic == [], f"import cycles through {cyclic}"
