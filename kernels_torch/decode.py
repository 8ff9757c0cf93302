"""Decode with static shapes: one new token per row over a preallocated cache whose positions live on the device, so
that one step serves every position and can be captured in a CUDA graph (gpt-fast and nanochat capture the whole
decode step; vLLM and SGLang keep one graph per batch size).

Pieces (spec 2.4 for KDA, 3.2 and 4.2 for MLA/DSA; shapes in ``kimi.cache_layout``):

* :class:`DecodeCache`: ``N`` rows of up to ``max_len`` tokens. Per layer a ``KDACache`` (conv windows and the fp32
  state, updated in place) or an ``MLACache`` whose ``c_kv`` and ``k_pe`` are views of one ``[N, max_len, L + R]``
  latent buffer (so a sparse kernel reads the selected rows where they lie), plus ``pos`` ``[N]`` int64 **on the
  model's device**. A prompt goes in through the chunked cached path (:meth:`Decoder.prefill`, ``KimiK3Model.step``)
  or a ``ModelCache`` is copied in (:meth:`DecodeCache.load`).
* :func:`decode_step`: one token per row. Attention and the indexer span all ``max_len`` rows under the causal mask
  (key ``s`` visible iff ``s <= pos[n]``), the new latent / indexer rows are written at ``pos`` on the device, the
  KDA windows and state in place, then ``pos += 1``. No host read and no shape that depends on a value, so the same
  call runs eagerly on any backend (CPU included) and under CUDA graph capture. Its logits equal the cached path's
  (``KimiK3Model.step`` with T = 1, which spans ``max(pos) + 1`` keys) up to the rounding of sums over the masked
  keys; the ``cudnn`` backend's pieces are in ``kernels_torch.decode_cudnn``.
* :func:`sample_device`: greedy, temperature and top-p on the device from one uniform draw per row (the inverse CDF
  over the nucleus): the semantics of ``kimi_tools.generate.sample`` (temperature first, then the nucleus cut).
* :class:`Decoder`: the step with the sampler inside, in one of three modes: ``"graph"`` (a ``torch.cuda.CUDAGraph``
  per sampler setting for this batch size, captured after one warm-up step whose cache changes are undone),
  ``"compile"`` (``torch.compile(mode="reduce-overhead")``, whose CUDA graphs torch manages), ``"static"`` (the
  same step, eager). The host knows every row's position without reading the device, and refuses a step past
  ``max_len`` (a clear ``ValueError``, nothing written).

Indexer RoPE (``indexer_rope != "none"``) is refused, as the cached path refuses it: cached keys would need their
absolute positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels_torch.cache import ModelCache
from kernels_torch.common import effective_weight
from kernels_torch.indexer import indexer_scores, sparse_mask, topk_indices
from kernels_torch.kda import KDACache, KimiDeltaAttention
from kernels_torch.kv_cache import MLACache, cached_causal_mask, write_token
from kernels_torch.mla import mla_attention, mla_attention_absorbed
from kimi.cache_layout import chunk_bounds, config_id, layer_cache_shapes
from kimi.config import KimiConfig

__all__ = [
    "MODES",
    "KDA_KERNELS",
    "DecodeCache",
    "StaticStep",
    "decode_step",
    "static_attention",
    "check_sampling",
    "sample_device",
    "Decoder",
]

MODES = ("auto", "graph", "compile", "static")
KDA_KERNELS = ("auto", "triton", "fla", "torch")  # the cudnn backend's KDA decode (kernels_torch.decode_cudnn)


def _check_rope(config: KimiConfig) -> None:
    if config.indexer_rope != "none" and config.dsa_layers:
        raise ValueError(
            f"indexer_rope: got {config.indexer_rope!r}, expected 'none' (K3.1) for cached decode: the cached indexer "
            "keys would need their absolute positions"
        )


@dataclass
class DecodeCache:
    """The preallocated cache of a static-shape decode (module docstring): ``layers`` (a ``KDACache`` or
    ``MLACache`` per layer), ``pos`` ``[N]`` int64 on the device, ``latent`` (per MLA layer the ``[N, max_len,
    L + R]`` buffer that ``c_kv`` / ``k_pe`` view; None for KDA layers), ``max_len`` and ``config_id``. Every tensor
    keeps its storage for the cache's life (a captured step holds their addresses): methods write into them."""

    layers: list
    pos: torch.Tensor
    latent: list
    max_len: int
    config_id: str

    @classmethod
    def empty(
        cls, config: KimiConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32, device="cpu"
    ) -> DecodeCache:
        """Zeros for ``batch`` rows of up to ``max_len`` tokens in the activation ``dtype`` (the KDA state in fp32,
        fp64 for fp64), ``pos = 0``.

        Raises:
            ValueError: ``batch`` or ``max_len`` < 1; ``indexer_rope`` other than ``"none"`` on a DSA model.
        """
        _check_rope(config)
        state_dt = torch.float64 if dtype == torch.float64 else torch.float32
        layers, latent = [], []
        for i in range(config.num_hidden_layers):
            shapes = layer_cache_shapes(config, i, batch, max_len)
            if config.layer_type(i) == "kda":
                z = [torch.zeros(s, dtype=state_dt if n == "S" else dtype, device=device) for n, s in shapes.items()]
                layers.append(KDACache(*z))
                latent.append(None)
                continue
            L, R = config.kv_lora_rank, config.qk_rope_head_dim
            buf = torch.zeros(batch, max_len, L + R, dtype=dtype, device=device)
            index_k = torch.zeros(shapes["index_k"], dtype=dtype, device=device) if "index_k" in shapes else None
            layers.append(MLACache(buf[..., :L], buf[..., L:], index_k))
            latent.append(buf)
        pos = torch.zeros(batch, dtype=torch.int64, device=device)
        return cls(layers, pos, latent, int(max_len), config_id(config))

    @property
    def batch(self) -> int:
        return int(self.pos.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the step writes (the KDA entries, the latent and indexer buffers, ``pos``)."""
        out = [self.pos]
        for entry, buf in zip(self.layers, self.latent):
            if buf is None:
                out += list(entry)
            else:
                out += [buf] + ([] if entry.index_k is None else [entry.index_k])
        return out

    def reset(self) -> DecodeCache:
        """Zero everything in place (a new batch of prompts; stale rows would only be masked, but zeros keep a NaN
        of an earlier sequence out of the dense attention's masked products). Returns ``self``."""
        for t in self.tensors():
            t.zero_()
        return self

    def model_cache(self) -> ModelCache:
        """A ``kernels_torch.cache.ModelCache`` over the same MLA buffers (written in place by ``KimiK3Model.step``)
        and copies of the KDA entries' current values, ``pos`` on the CPU (a host read: call it outside a step).
        Hand it back with :meth:`absorb` after the cached calls."""
        return ModelCache(list(self.layers), self.pos.cpu(), self.max_len, self.config_id)

    def absorb(self, cache: ModelCache) -> None:
        """Copy what cached calls on :meth:`model_cache`'s result replaced (the KDA entries, ``pos``) back into this
        cache's buffers; the MLA rows were written in place."""
        for mine, theirs in zip(self.layers, cache.layers):
            if isinstance(mine, KDACache):
                for dst, src in zip(mine, theirs):
                    if src is not dst:
                        dst.copy_(src)
        self.pos.copy_(cache.pos)

    def load(self, cache: ModelCache) -> DecodeCache:
        """Copy a ``ModelCache`` (``init_cache`` + cached calls, e.g. ``ModelCache.rows`` of a batch-1 prefill) into
        this cache, in place. Returns ``self``.

        Raises:
            ValueError: another config, batch size, or a larger capacity than this cache's ``max_len``.
        """
        if not isinstance(cache, ModelCache) or cache.config_id != self.config_id:
            got = cache.config_id if isinstance(cache, ModelCache) else type(cache).__name__
            raise ValueError(f"cache: got {got}, expected a ModelCache of config_id {self.config_id}")
        if cache.batch != self.batch or cache.max_len > self.max_len:
            raise ValueError(
                f"cache: holds {cache.batch} rows of max_len {cache.max_len}, expected {self.batch} rows of at most "
                f"{self.max_len}"
            )
        self.reset()
        m = cache.max_len
        for mine, theirs in zip(self.layers, cache.layers):
            if isinstance(mine, KDACache):
                for dst, src in zip(mine, theirs):
                    dst.copy_(src)
            else:
                for dst, src in zip(mine, theirs):
                    if dst is not None:
                        dst[:, :m].copy_(src)
        self.pos.copy_(cache.pos)
        return self

    def _state(self) -> list[torch.Tensor]:
        """Clones of what one step changes besides the row it writes at ``pos`` (the KDA entries, ``pos``)."""
        out = [self.pos.clone()]
        for entry in self.layers:
            if isinstance(entry, KDACache):
                out += [t.clone() for t in entry]
        return out

    def _restore(self, state: list[torch.Tensor]) -> None:
        mine = [self.pos] + [t for e in self.layers if isinstance(e, KDACache) for t in e]
        for dst, src in zip(mine, state):
            dst.copy_(src)


class StaticStep(NamedTuple):
    """What :func:`decode_step` hands each layer: the cache's ``layers``, ``pos`` ``[N]`` int64 (device), the
    ``latent`` buffers, and the ``cudnn`` backend's KDA decode kernel (:data:`KDA_KERNELS`)."""

    layers: list
    pos: torch.Tensor
    latent: list
    kda_kernel: str


def static_attention(layer, x: torch.Tensor, cache, step: StaticStep) -> torch.Tensor:
    """One decode token of a layer's attention with static shapes: ``x`` ``[N, 1, D]`` (after ``input_layernorm``)
    -> ``[N, 1, D]``, the layer's cache entry updated in place (module docstring)."""
    if isinstance(layer, KimiDeltaAttention):
        if layer.backend == "cudnn":
            from kernels_torch.decode_cudnn import kda_decode_inplace  # lazy: CPU machines never import the GPU path

            return kda_decode_inplace(layer, x, cache, step.kda_kernel)
        out, new = layer(x, cache=cache, mode="recurrent")  # the readable recurrence
        for dst, src in zip(cache, new):
            dst.copy_(src)
        return out
    latent = step.latent[layer.layer_idx]
    if layer.backend == "cudnn":
        from kernels_torch.decode_cudnn import gated_mla_decode_static

        return gated_mla_decode_static(layer, x, cache, step.pos, latent)
    return _gated_mla_static(layer, x, cache, step.pos)


def _gated_mla_static(layer, x: torch.Tensor, cache: MLACache, pos: torch.Tensor, form: str = "expanded"):
    """``GatedMLA.forward`` with a cache for one token per row, on the dense backends (``eager``, ``sdpa``): keys
    span all ``S_max`` cached rows under the mask ``s <= pos[n]`` (and the indexer's selection on DSA layers)."""
    c = layer.config
    N, T, _ = x.shape
    S = cache.c_kv.shape[1]
    H, Kn, R, V = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    c_q, q, q_nope, q_pe, c_kv, k_pe = layer.project(x)  # spec 3.2 steps 1-2
    write_token(cache.c_kv, c_kv, pos)
    write_token(cache.k_pe, k_pe, pos)
    mask = cached_causal_mask(pos, T, S, device=x.device)  # [N, 1, S]
    if layer.kind == "dsa":
        q_I, k_I, weights = layer.indexer.projections(x, c_q)
        write_token(cache.index_k, k_I, pos)
        topk = topk_indices(indexer_scores(q_I, cache.index_k, weights), mask, c.index_topk)
        mask = mask & sparse_mask(topk, S)  # re-apply the causal mask after selection (spec 4.3)
    scale = c.mla_softmax_scale  # (Kn + R)^-1/2 in both forms
    if form == "expanded":  # as GatedMLA.forward
        kvb = layer.kv_b_proj(cache.c_kv).view(N, S, H, Kn + V)
        k = torch.cat([kvb[..., :Kn], cache.k_pe[:, :, None, :].expand(N, S, H, R)], dim=-1)
        o = mla_attention(q, k, kvb[..., Kn:], mask, scale, backend=layer.backend)
    else:
        w = effective_weight(layer.kv_b_proj)
        o = mla_attention_absorbed(q_nope, q_pe, cache.c_kv, cache.k_pe, w, mask, scale, backend=layer.backend)
    return layer.gate_and_project_out(o, x)


@torch.no_grad()
def decode_step(model, cache: DecodeCache, tokens: torch.Tensor, kda_kernel: str = "auto") -> torch.Tensor:
    """One decode token per row on a ``kernels_torch.model.KimiK3Model``: ``tokens`` ``[N]`` int64 on the model's
    device (the previous token of each row; not range-checked here: that would be a host read) -> logits ``[N,
    vocab]`` fp32. The cache is updated in place and ``cache.pos`` advanced by one; the caller guards the capacity
    (:class:`Decoder` does, on the host)."""
    step = StaticStep(cache.layers, cache.pos, cache.latent, kda_kernel)
    h, _ = model.model(tokens[:, None], None, "expanded", None, step)  # [N, 1, D]
    logits = model.logits(h[:, 0]).float()
    cache.pos.add_(1)
    return logits


def check_sampling(temperature: float, top_p: float) -> None:
    """Host check of the sampler settings (those of ``kimi_tools.generate.sample``).

    Raises:
        ValueError: ``temperature`` negative, NaN or infinite; ``top_p`` outside ``(0, 1]`` (NaN included).
    """
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature: got {temperature}, expected a finite number >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: got {top_p}, expected a probability in (0, 1]")


def sample_device(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """Next token ids ``[N]`` int64 from logits ``[N, vocab]`` (fp32) on their device, no host read.

    ``temperature == 0``: argmax (ties to the lowest id). Else ``p = softmax((logits - max) / temperature)`` (the
    max subtracted first, so no temperature overflows), cut to the smallest set of most likely tokens whose mass
    reaches ``top_p`` (a token is kept when the mass before it, most likely first and ties to the lower id, is below
    ``top_p``; nucleus sampling, Holtzman et al. 2020), and drawn by the inverse CDF of the kept mass at ``u[n]
    * total`` (``u`` ``[N]`` uniform in [0, 1)). The temperature applies before the cut, as in
    ``kimi_tools.generate.sample``. NaN logits give an arbitrary id: :class:`Decoder` flags them."""
    if temperature == 0:
        return logits.argmax(-1)
    p = torch.softmax((logits - logits.amax(-1, keepdim=True)) / temperature, dim=-1)
    order = None
    if top_p < 1:
        p, order = torch.sort(p, dim=-1, descending=True, stable=True)
        p = p * ((p.cumsum(-1) - p) < top_p)  # the nucleus, most likely first
    cdf = p.cumsum(-1)
    idx = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1])[:, None], right=True).clamp_(max=p.shape[-1] - 1)
    return (idx if order is None else order.gather(-1, idx))[:, 0]


class Decoder:
    """Static-shape decode of ``batch`` rows of up to ``max_len`` tokens on a ``kernels_torch.model.KimiK3Model``
    (module docstring), with the sampler inside the step.

    ``mode``: ``"graph"`` (CUDA), ``"compile"`` (CUDA), ``"static"`` (any device), ``"auto"`` (graph on CUDA, else
    static). ``kda_kernel`` (``cudnn`` backend): the KDA decode, :data:`KDA_KERNELS` (``kernels_torch.decode_cudnn``).

    Use: :meth:`reset` (a new batch), :meth:`prefill` (the prompts, chunked), :meth:`sample` on its logits, then
    :meth:`step` per token, and :meth:`read_tokens` to bring ids to the host. In graph mode the returned tensors are
    the graph's static outputs, overwritten by the next step (copy what you keep).

    Non-finite logits: :meth:`step` and :meth:`sample` never read the host, so an id drawn from NaN or infinite
    logits is arbitrary; they set a device flag instead, and :meth:`read_tokens` raises ``ValueError`` while it is
    set (until :meth:`reset`). Read every id through :meth:`read_tokens` (``kimi_tools.generate`` does), so none
    drawn from such logits is used.

    Raises:
        ValueError: an unknown mode or kernel, a CUDA mode off CUDA, a bad sampler setting, ``indexer_rope`` set.
    """

    def __init__(
        self,
        model,
        batch: int,
        max_len: int,
        *,
        mode: str = "auto",
        temperature: float = 0.0,
        top_p: float = 1.0,
        kda_kernel: str = "auto",
    ):
        w = model.model.embed_tokens.weight
        if mode not in MODES:
            raise ValueError(f"mode: got {mode!r}, expected one of {list(MODES)}")
        if kda_kernel not in KDA_KERNELS:
            raise ValueError(f"kda_kernel: got {kda_kernel!r}, expected one of {list(KDA_KERNELS)}")
        if mode == "auto":
            mode = "graph" if w.is_cuda else "static"
        if mode in ("graph", "compile") and not w.is_cuda:
            raise ValueError(f"mode: got {mode!r}, which captures CUDA graphs, but the model is on {w.device}")
        self.model, self.mode, self.kda_kernel = model, mode, kda_kernel
        self.cache = DecodeCache.empty(model.config, batch, max_len, w.dtype, w.device)
        self._host_pos = [0] * batch  # every row's position, known without reading the device
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=w.device)
        self._graphs: dict = {}
        self._pool = None
        self._compiled = None
        self.set_sampler(temperature, top_p)

    @property
    def batch(self) -> int:
        return self.cache.batch

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def positions(self) -> list[int]:
        """Tokens each row holds (host copy; no device read)."""
        return list(self._host_pos)

    def set_sampler(self, temperature: float, top_p: float) -> None:
        """The sampler of the next steps (:func:`sample_device`); each setting gets its own captured graph.

        Raises:
            ValueError: see :func:`check_sampling`."""
        check_sampling(temperature, top_p)
        self.temperature, self.top_p = float(temperature), float(top_p)

    def reset(self) -> Decoder:
        """Empty the cache for a new batch (in place; the captured graphs stay valid). Returns ``self``."""
        self.cache.reset()
        self._nonfinite.zero_()
        self._host_pos = [0] * self.batch
        return self

    def load(self, cache: ModelCache) -> Decoder:
        """Continue from a ``ModelCache`` (copied in; :meth:`DecodeCache.load`), a new batch as after :meth:`reset`
        (the NaN flag cleared). Returns ``self``."""
        self.cache.load(cache)
        self._nonfinite.zero_()
        self._host_pos = [int(p) for p in cache.pos.tolist()]
        return self

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths=None, chunk_size: int | None = None) -> torch.Tensor:
        """Feed ``input_ids`` ``[N, T]`` (row ``n``'s first ``lengths[n]`` tokens; default all) after what the rows
        hold, through the chunked cached path (``KimiK3Model.step``, ``chunk_size`` tokens a call; one call when
        None). Returns the fp32 logits ``[N, vocab]`` of each row's last new token.

        Raises:
            ValueError: ``chunk_size`` with rows of different lengths; the errors of ``KimiK3Model.step``
                (``kernels_torch.cache.check_cache``: bad ``lengths``, a write past ``max_len``).
        """
        N, T = input_ids.shape
        n = torch.full((N,), T, dtype=torch.int64) if lengths is None else torch.as_tensor(lengths).cpu()
        if chunk_size is not None and lengths is not None and len(set(n.tolist())) > 1:
            raise ValueError(f"chunk_size: rows of different lengths {n.tolist()} are prefilled in one call; drop it")
        mc = self.cache.model_cache()
        if lengths is not None:
            logits, mc = self.model.step(input_ids, mc, n)
            last = logits[torch.arange(N), (n - 1).to(logits.device)]
        else:
            for a, b in chunk_bounds(T, chunk_size):
                logits, mc = self.model.step(input_ids[:, a:b], mc)
            last = logits[:, -1]
        self.cache.absorb(mc)
        self._host_pos = [int(p) for p in mc.pos.tolist()]
        return last.float()

    def sample(self, logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """:func:`sample_device` with this decoder's sampler (uncaptured: e.g. the first token after a prefill)."""
        self._nonfinite.logical_or_(~torch.isfinite(logits).all())
        return sample_device(logits, self.temperature, self.top_p, u)

    def read_tokens(self, tokens: torch.Tensor) -> list[list[int]]:
        """``tokens`` ``[N, n]`` (ids on the device) as lists, in one host read that also carries the NaN flag.

        Raises:
            ValueError: a step or :meth:`sample` since :meth:`reset` saw a NaN or infinite logit."""
        N, n = tokens.shape
        flat = torch.cat([tokens.reshape(-1), self._nonfinite.to(tokens.dtype).reshape(1)]).tolist()
        if flat[-1]:
            raise ValueError("logits: a decode step produced NaN or inf; expected finite values to sample from")
        return [flat[i * n : (i + 1) * n] for i in range(N)]

    def _step_fn(self, tokens: torch.Tensor, u: torch.Tensor):
        logits = decode_step(self.model, self.cache, tokens, self.kda_kernel)
        self._nonfinite.logical_or_(~torch.isfinite(logits).all())
        return sample_device(logits, self.temperature, self.top_p, u), logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row: ``tokens`` ``[N]`` int64 on the model's device (each row's last token), ``u`` ``[N]``
        uniform draws for the sampler (None: zeros; unused when greedy) -> ``(next [N] int64, logits [N, vocab]
        fp32)``. No host read.

        Raises:
            ValueError: a row would pass ``max_len`` (checked on the host before anything runs), or ``tokens`` of
                another shape.
        """
        if tuple(tokens.shape) != (self.batch,):
            raise ValueError(f"tokens: got shape {tuple(tokens.shape)}, expected [N]=[{self.batch}]")
        longest = max(self._host_pos)
        if longest >= self.max_len:
            raise ValueError(
                f"decode: a row holds {longest} tokens, the capacity max_len={self.max_len}; build the Decoder with a "
                "larger max_len (the step would write past the cache)"
            )
        if u is None:
            u = torch.zeros(self.batch, device=tokens.device)
        if self.mode == "graph":
            out = self._replay(tokens, u)
        elif self.mode == "compile":
            out = self._compiled_step(tokens, u)
        else:
            out = self._step_fn(tokens, u)
        self._host_pos = [p + 1 for p in self._host_pos]
        return out

    def _replay(self, tokens, u):
        key = (self.temperature, self.top_p)
        if key not in self._graphs:
            self._graphs[key] = self._capture()
        tok_in, u_in, graph, out = self._graphs[key]
        tok_in.copy_(tokens)
        u_in.copy_(u)
        graph.replay()
        return out

    def _capture(self):
        """Warm up once on a side stream (Triton compiles, cuBLAS chooses, lazy inits), undo what that step changed
        (the row it wrote at ``pos`` is written again by every real step before it is read), then capture."""
        dev = self.cache.pos.device
        tok_in = torch.zeros(self.batch, dtype=torch.int64, device=dev)
        u_in = torch.zeros(self.batch, device=dev)
        saved, flag = self.cache._state(), self._nonfinite.clone()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self._step_fn(tok_in, u_in)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.cache._restore(saved)
        self._nonfinite.copy_(flag)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._step_fn(tok_in, u_in)
        return tok_in, u_in, graph, out

    def _compiled_step(self, tokens, u):
        if self._compiled is None:
            views = [t for entry in self.cache.layers for t in entry if t is not None]  # c_kv / k_pe views too
            for t in [*self.cache.tensors(), *views, self._nonfinite]:
                torch._dynamo.mark_static_address(t)
            self._compiled = torch.compile(self._step_fn, mode="reduce-overhead", dynamic=False)
        torch.compiler.cudagraph_mark_step_begin()
        return self._compiled(tokens, u)
