"""Context parallelism (CP) of the torch model over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).

The packed row of ``T`` tokens is cut into ``world`` contiguous **shards**, one per rank (sizes differ by at most
one token: :func:`shard_bounds`); documents (``cu_seqlens``) may cross shard boundaries. Everything in the model is
token-local (embedding, norms, AttnRes depth mixing, MoE, lm_head) except the token mixers, which this module
replaces on the layer instances while a :class:`ContextParallel` is attached (the layers' own code is called for
all the math; ``kernels_torch.model`` holds no process-group code):

* **KDA** (spec 2.2), the summary-and-merge recipe (fla ``fla/ops/cp/README.md``), in fp32 (fp64 for fp64 inputs):

  1. *conv windows*: every rank all-gathers the last ``W-1`` layer inputs of every rank; rank ``r`` projects the
     ``W-1`` tokens before its shard start (zeros before the start of their document) with ``q/k/v_proj``: its
     initial conv windows.
  2. *summary*: the delta rule is affine in the incoming state, ``S_out = A S_in + B`` (``A`` ``[H, K, K]``, ``B``
     ``[H, K, V]``) over the shard's last document. Rank ``r`` gets both from one :func:`kda_chunk` run from a zero
     state with ``v`` widened by ``K`` zero columns and an identity in the initial state's extra columns
     (``[0 | I] -> [B | A]``). ``A = 0`` when a document starts inside the shard (the state resets there).
  3. *merge*: all-gather ``(A, B)``; each rank chains ``S_{r+1} = A_r S_r + B_r`` from ``S_0 = 0``, then runs the
     layer's own forward on its shard with that initial state and those conv windows for its first document.

  Backward: the two all-gathers (:func:`all_gather`) reduce-scatter, i.e. sum the gradients of every rank and
  return each rank its own part, so state and window gradients reach the ranks that produced them.
* **MLA / DSA** (spec 3-4): each rank projects its own queries and keys (the indexer's RoPE, when
  ``indexer_rope`` is set, at the tokens' global positions in their documents), all-gathers the normalised latent
  ``c_kv``, the shared rope key ``k_pe`` and the indexer key ``k_I`` of every token (``L + R + KI`` values a token:
  576 + 128 for K3.1), and attends with the global causal/document geometry: query rows ``[start, stop)`` against keys
  ``[0, T)``, ``topk_indices`` in global key ids. Backward: the gather's reduce-scatter of the latent gradients.

Use::

    cp = ContextParallel(model, group)                            # once; cp.remove() restores the layers
    ids, cu = cp.shard(input_ids, cu_seqlens)                      # this rank's [1, T_r] and local cu_seqlens
    logits = model(ids, cu)                                        # [1, T_r, vocab]: rows start..stop of one rank's
    labels = cp.shard_like(global_labels)                          # shift globally, then shard

Each rank's parameter gradients are its shard's part: sum them over the CP group (FSDP2 over a mesh whose
reduce dimension includes CP does it; :mod:`kernels_torch.parallel.fsdp`).

Glossary: *shard* ``[start, stop)`` of one rank; *carry-in*: the shard's first token continues a document that
started on an earlier rank; *carry-through*: carry-in and no document starts in the shard (its outgoing state then
depends on the incoming one).

Limits: the ``cudnn`` backend's MLA/DSA layer is refused under CP (its cuDNN indexer and sparse kernels take
documents of one rank; use ``eager`` or ``sdpa``); its KDA layers run (fla kernels in step 3, the pure-torch
:func:`kda_chunk` for the summary).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from kernels_torch.common import check_cu_seqlens, effective_weight, segment_ids
from kernels_torch.common import linear as kda_linear  # the layer's own projection rule (dtype, LoRA-wrapped layers)
from kernels_torch.indexer import indexer_scores, rope_positions, sparse_mask, topk_indices
from kernels_torch.kda import KDACache, KimiDeltaAttention, kda_chunk
from kernels_torch.mla import GatedMLA, mla_attention, mla_attention_absorbed

__all__ = [
    "shard_bounds",
    "Shard",
    "make_shard",
    "all_gather",
    "gather_sequence",
    "ContextParallel",
    "attached_context_parallel",
    "recompute_context",
    "cp_attached",
]


def shard_bounds(T: int, world: int) -> list[tuple[int, int]]:
    """Contiguous shards ``[start, stop)`` of ``T`` tokens over ``world`` ranks; the first ``T % world`` shards
    hold one token more.

    Raises:
        ValueError: ``world < 1`` or ``T < world`` (a rank would hold no token).
    """
    if world < 1:
        raise ValueError(f"world: got {world}, expected a positive number of ranks")
    if T < world:
        raise ValueError(f"T: got {T} tokens for {world} ranks, expected at least one token per rank (T >= {world})")
    base, extra = divmod(T, world)
    bounds, s = [], 0
    for r in range(world):
        n = base + (r < extra)
        bounds.append((s, s + n))
        s += n
    return bounds


@dataclass(frozen=True)
class Shard:
    """One rank's part of the packed row.

    Attributes:
        rank, world: position in the CP group. T: global tokens. start, stop: this shard ``[start, stop)``.
        bounds: every rank's ``(start, stop)``. cu_seqlens: global ``[N+1]`` int64 (CPU) or None (every batch row
        one sequence). local_cu_seqlens: the documents cut to the shard, ``[n+1]`` from 0 to ``stop - start``, or
        None. doc_start: global start of the document holding token ``start``.
    """

    rank: int
    world: int
    T: int
    start: int
    stop: int
    bounds: tuple[tuple[int, int], ...]
    cu_seqlens: torch.Tensor | None
    local_cu_seqlens: torch.Tensor | None
    doc_start: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    @property
    def carry_in(self) -> bool:
        """The first token continues a document begun on an earlier rank."""
        return self.start > self.doc_start

    @property
    def carry_through(self) -> bool:
        """No document starts inside the shard: the state leaving it depends on the state entering it."""
        n_local = 1 if self.local_cu_seqlens is None else self.local_cu_seqlens.numel() - 1
        return self.carry_in and n_local == 1

    @property
    def last_doc_start(self) -> int:
        """Local offset of the shard's last document (0 without ``cu_seqlens``)."""
        return 0 if self.local_cu_seqlens is None else int(self.local_cu_seqlens[-2])


def make_shard(T: int, cu_seqlens, rank: int, world: int) -> Shard:
    """The :class:`Shard` of ``rank`` for a packed row of ``T`` tokens with global ``cu_seqlens`` (or None).

    Raises:
        ValueError: invalid ``cu_seqlens`` (see ``check_cu_seqlens``), ``rank`` outside ``[0, world)``, ``T < world``.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank: got {rank}, expected 0 <= rank < world = {world}")
    bounds = shard_bounds(T, world)
    start, stop = bounds[rank]
    if cu_seqlens is None:
        return Shard(rank, world, T, start, stop, tuple(bounds), None, None, 0)
    cu = check_cu_seqlens(torch.as_tensor(cu_seqlens).cpu(), T)
    edges = cu.tolist()
    local = [0] + [b - start for b in edges if start < b < stop] + [stop - start]
    doc_start = max(b for b in edges if b <= start)
    return Shard(rank, world, T, start, stop, tuple(bounds), cu, torch.tensor(local, dtype=torch.int64), doc_start)


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[world, *x.shape]``: every rank's ``x`` (same shape on every rank), differentiable: the backward
    reduce-scatters, so each rank gets the sum over ranks of the gradient of its own ``x``
    (``torch.distributed._functional_collectives.all_gather_single_autograd``, which
    ``torch.distributed.nn.functional.all_gather`` now points to).

    Every rank must run the backward of every gather in the same order; the callers below keep each gather in
    every rank's graph (one-hot selections and zero weights rather than dropping a tensor) for that reason."""
    group = group if group is not None else dist.group.WORLD
    return funcol.wait_tensor(funcol.all_gather_single_autograd(x.unsqueeze(0).contiguous(), 0, group))


def gather_sequence(x: torch.Tensor, shard: Shard, group=None, dim: int = 1) -> torch.Tensor:
    """All-gather every rank's shard of ``x`` along ``dim`` into the global sequence (differentiable).

    Args:
        x: this rank's ``[..., T_r, ...]`` (``T_r = shard.length`` along ``dim``). group: the CP process group.

    Returns:
        ``[..., T, ...]``. Shards are padded to the longest one for the collective and cut back. Backward: each
        rank receives the sum over ranks of the gradient of its own rows (:func:`all_gather`).
    """
    Tm = max(e - s for s, e in shard.bounds)
    pad = Tm - x.shape[dim]
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:dim], pad, *x.shape[dim + 1 :])], dim=dim)
    parts = all_gather(x, group)  # [world, ...]
    return torch.cat([parts[j].narrow(dim, 0, e - s) for j, (s, e) in enumerate(shard.bounds)], dim=dim)


def _first_rows(first: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, ...]``: ``first`` ``[1, ...]`` (the carried row of the first local document), then zero rows."""
    return torch.cat([first, first.new_zeros(n - 1, *first.shape[1:])]) if n > 1 else first


# ------------------------------------------------------------------------------------------------ KDA


def _kda_windows(layer: KimiDeltaAttention, x: torch.Tensor, shard: Shard, group) -> list[torch.Tensor]:
    """Initial conv windows ``[B, P, W-1]`` of q, k, v: the projections of the ``W-1`` tokens before the shard
    start, zero for tokens before the start of their document (or of the row)."""
    B, T_r, D = x.shape
    w1 = layer.q_conv1d.weight.shape[-1] - 1
    tail = x[:, -w1:]
    if T_r < w1:  # a shard shorter than the window: the window spans several earlier ranks
        tail = torch.cat([x.new_zeros(B, w1 - T_r, D), tail], dim=1)
    tails = all_gather(tail, group).transpose(0, 1)  # [B, world, w1, D]
    # Row i of the window is global position start - w1 + i, held by rank j at tail row w1 - (stop_j - pos).
    # Every rank reads from the stacked gather (also rank 0, with zero weights): each all-gather must meet its
    # backward on every rank.
    flat_idx, valid = [], []
    for i in range(w1):
        pos = shard.start - w1 + i
        j = next((j for j, (s, e) in enumerate(shard.bounds) if s <= pos < e), 0)
        flat_idx.append(j * w1 + w1 - (shard.bounds[j][1] - pos) if pos >= 0 else 0)
        valid.append(pos >= shard.doc_start and pos >= 0)
    prev = tails.reshape(B, -1, D)[:, flat_idx]  # [B, w1, D]
    prev = prev * torch.tensor(valid, dtype=x.dtype, device=x.device)[:, None]
    return [kda_linear(prev, p).transpose(1, 2) for p in (layer.q_proj, layer.k_proj, layer.v_proj)]


def _kda_summary(layer: KimiDeltaAttention, x: torch.Tensor, shard: Shard, windows) -> tuple[torch.Tensor, ...]:
    """``(A, B)``: the shard's last document maps an incoming state ``S`` to ``A S + B``; ``A`` ``[Bc, H, K, K]``
    (zero unless carry-through), ``B`` ``[Bc, H, K, V]``, fp32 (fp64 for fp64 x)."""
    s = shard.last_doc_start
    first = s == 0  # the last local document is also the first: it starts from the carried windows
    # (0 * w, not zeros: the summary stays downstream of the window gather on every rank, which fixes the order of
    # the two gathers' backwards: all ranks must run them in the same order)
    cache = KDACache(*(w if first else 0.0 * w for w in windows), None)
    _, k, v, g, beta, _ = layer.recurrence_inputs(x[:, s:], None, cache)
    Bc, _, H, K = k.shape
    V = v.shape[-1]
    dt = g.dtype
    if not shard.carry_through:
        _, B_state = kda_chunk(k, k, v, g, beta)  # q does not reach the final state
        return B_state.new_zeros(Bc, H, K, K), B_state
    v_aug = torch.cat([v.to(dt), v.new_zeros(*v.shape[:-1], K).to(dt)], dim=-1)  # [Bc, n, H, V+K]
    eye = torch.eye(K, dtype=dt, device=x.device).expand(Bc, H, K, K)
    S0 = torch.cat([eye.new_zeros(Bc, H, K, V), eye], dim=-1)  # [0 | I]
    _, S = kda_chunk(k, k, v_aug, g, beta, initial_state=S0)  # [B | A]: affine in (S0, v)
    return S[..., V:], S[..., :V]


def _kda_forward(layer: KimiDeltaAttention, cp: ContextParallel, x, cu_seqlens=None, cache=None, mode="chunk"):
    """``KimiDeltaAttention.forward`` under context parallelism (module docstring, KDA steps 1-3)."""
    shard = cp.current(x)
    if cache is not None:
        raise ValueError("cache: got a KDACache under context parallelism, expected None (CP is for training/prefill)")
    windows = _kda_windows(layer, x, shard, cp.group)  # [B, P, W-1] each
    A, B_state = _kda_summary(layer, x, shard, windows)
    K = A.shape[-1]
    AB = all_gather(torch.cat([A, B_state], dim=-1), cp.group)  # one gather [world, Bc, H, K, K+V]
    A_all, B_all = AB[..., :K], AB[..., K:]
    S = torch.zeros_like(B_all[0])
    states = [S]
    for j in range(shard.world):  # S_{j+1} = A_j S_j + B_j, fp32 (fp64)
        S = torch.einsum("bhkj,bhjv->bhkv", A_all[j], S) + B_all[j]
        states.append(S)
    # one-hot selection (not indexing), so that the gathered summaries are in every rank's graph
    pick = torch.zeros(shard.world + 1, dtype=S.dtype, device=S.device)
    pick[shard.rank] = 1.0 if shard.carry_in else 0.0
    S_in = torch.einsum("n,nbhkv->bhkv", pick, torch.stack(states))
    n = x.shape[0] if shard.local_cu_seqlens is None else shard.local_cu_seqlens.numel() - 1
    if shard.local_cu_seqlens is not None:
        windows, S_in = [_first_rows(w, n) for w in windows], _first_rows(S_in, n)
    return KimiDeltaAttention.forward(layer, x, shard.local_cu_seqlens, KDACache(*windows, S_in), mode)


# ------------------------------------------------------------------------------------------------ MLA / DSA


def _mla_forward(layer: GatedMLA, cp: ContextParallel, x, cu_seqlens=None, form="expanded", return_aux=False):
    """``GatedMLA.forward`` under context parallelism: local queries, all-gathered latent KV and indexer keys,
    global causal/document geometry (module docstring)."""
    shard = cp.current(x)
    c = layer.config
    if layer.backend == "cudnn":
        raise NotImplementedError(
            "backend: got 'cudnn' for an MLA/DSA layer under context parallelism; its cuDNN indexer and sparse "
            "kernels take whole documents of one rank, expected 'eager' or 'sdpa'"
        )
    if form not in ("expanded", "absorbed"):
        raise ValueError(f"form: got {form!r}, expected one of ['expanded', 'absorbed']")
    B, T_r, _ = x.shape
    T = shard.T
    H, Kn, R, V, L = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    c_q, q, q_nope, q_pe, c_kv, k_pe = layer.project(x)
    rows = [c_kv, k_pe]
    if layer.kind == "dsa":
        # RoPE (indexer_rope) by global position in the document: a shard does not restart at 0
        positions = rope_positions(T, shard.cu_seqlens)[shard.start : shard.stop]
        q_I, k_I, weights = layer.indexer.projections(x, c_q, positions=positions)
        rows.append(k_I)
    dt = rows[0].dtype
    keys = gather_sequence(torch.cat([r.to(dt) for r in rows], dim=-1), shard, cp.group)  # [B, T, L+R(+KI)]
    c_kv, k_pe = keys[..., :L], keys[..., L : L + R]

    # global geometry: query t in [start, stop) sees key s <= t of the same document
    seg = segment_ids(shard.cu_seqlens, T, device=x.device)  # [T]
    t = torch.arange(shard.start, shard.stop, device=x.device)[:, None]
    mask = (torch.arange(T, device=x.device)[None] <= t) & (seg[shard.start : shard.stop, None] == seg[None])
    aux: dict = {}
    if layer.kind == "dsa":
        scores = indexer_scores(q_I, keys[..., L + R :].to(k_I.dtype), weights)  # [B, T_r, T]
        topk = topk_indices(scores, mask, c.index_topk)  # global key ids
        mask = mask[None] & sparse_mask(topk, T)
        aux = {"topk_indices": topk, "index_scores": scores}
    scale = c.mla_softmax_scale
    if form == "expanded":
        kvb = layer.kv_b_proj(c_kv).view(B, T, H, Kn + V)
        k = torch.cat([kvb[..., :Kn], k_pe[:, :, None, :].expand(B, T, H, R)], dim=-1)
        o = mla_attention(q, k, kvb[..., Kn:], mask, scale, backend=layer.backend)
    else:
        w = effective_weight(layer.kv_b_proj)  # W (+ LoRA's B A), as GatedMLA.forward
        o = mla_attention_absorbed(q_nope, q_pe, c_kv, k_pe, w, mask, scale, backend=layer.backend)
    out = layer.gate_and_project_out(o, x)
    return (out, aux) if return_aux else out


# ------------------------------------------------------------------------------------------------ the model


class ContextParallel:
    """Context parallelism of a :class:`kernels_torch.model.KimiK3Model` (or any module holding KDA / MLA layers)
    over a process group: attaching replaces the ``forward`` of every KDA and MLA layer instance by its CP version
    (the parameters, ``state_dict`` keys and the model code are untouched); :meth:`remove` restores them.

    Args:
        model: the module; group: the CP process group (default: the world group; ``dist`` must be initialised).

    Call :meth:`shard` before each forward. The layers read the current shard when they run, so a forward that
    runs again in the backward (activation recomputation, ``torch.utils.checkpoint``) must see the shard of its
    first run, whatever :meth:`shard` was called since (a pipeline stage runs later micro-batches' forwards before
    an earlier one's backward): pass ``context_fn=recompute_context`` to the checkpoint around any layer
    (``kernels_torch.activation_memory.recompute_layers`` does).

    Raises:
        RuntimeError: ``torch.distributed`` not initialised; a forward whose token count is not the current
            shard's.
    """

    def __init__(self, model: nn.Module, group=None):
        if not dist.is_initialized():
            raise RuntimeError("ContextParallel: torch.distributed is not initialised (init_process_group first)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._shard: Shard | None = None
        self._layers = [m for m in model.modules() if isinstance(m, (KimiDeltaAttention, GatedMLA))]
        for m in self._layers:
            fn = _kda_forward if isinstance(m, KimiDeltaAttention) else _mla_forward
            m.forward = functools.partial(fn, m, self)
        _ATTACHED.add(self)

    def remove(self) -> None:
        """Give the layers their own ``forward`` back."""
        for m in self._layers:
            if "forward" in vars(m):
                del m.forward
        self._layers = []
        _ATTACHED.discard(self)

    def shard(self, input_ids: torch.Tensor, cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Set the current packed row and return this rank's part of it.

        Args:
            input_ids: ``[B, T]`` global token ids (the same on every rank); cu_seqlens ``[N+1]`` (B == 1) or None.

        Returns:
            ``(input_ids[:, start:stop], local cu_seqlens or None)`` to pass to the model.

        Raises:
            ValueError: ``input_ids`` not 2-D, invalid ``cu_seqlens``, fewer tokens than ranks.
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids: got shape {tuple(input_ids.shape)}, expected [B, T]")
        if cu_seqlens is not None and input_ids.shape[0] != 1:
            raise ValueError(f"cu_seqlens: given with batch size {input_ids.shape[0]}, expected batch size 1")
        self._shard = make_shard(input_ids.shape[1], cu_seqlens, self.rank, self.world)
        s = self._shard
        local = None if s.local_cu_seqlens is None else s.local_cu_seqlens.to(input_ids.device)
        return input_ids[:, s.start : s.stop], local

    def shard_like(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's rows ``[start, stop)`` of a global ``x`` along ``dim`` (labels, loss weights, positions)."""
        s = self.current_shard
        return x.narrow(dim, s.start, s.length)

    @property
    def current_shard(self) -> Shard:
        if self._shard is None:
            raise RuntimeError("ContextParallel: no current shard, call cp.shard(input_ids, cu_seqlens) first")
        return self._shard

    def current(self, x: torch.Tensor) -> Shard:
        """The current shard, checked against a layer input ``x`` ``[B, T_r, D]``."""
        s = self.current_shard
        if x.shape[1] != s.length:
            raise RuntimeError(
                f"ContextParallel: a layer got {x.shape[1]} tokens, expected this rank's shard of {s.length} "
                f"(tokens {s.start}..{s.stop} of {s.T}); call cp.shard(...) for this batch"
            )
        return s


def attached_context_parallel(module: nn.Module) -> ContextParallel | None:
    """The :class:`ContextParallel` whose forward ``module`` or one of its submodules runs (attached and not
    removed), or None: for code that needs every token of a row in one place (the indexer distillation's teacher)
    to refuse a model whose layers see only this rank's shard."""
    for m in module.modules():
        f = vars(m).get("forward")
        if isinstance(f, functools.partial) and f.func in (_kda_forward, _mla_forward):
            return f.args[1]
    return None


_ATTACHED: weakref.WeakSet[ContextParallel] = weakref.WeakSet()  # every attached (not removed) ContextParallel


@contextlib.contextmanager
def _shards_set(saved: list[tuple[ContextParallel, Shard | None]]):
    """Make each ``ContextParallel``'s saved shard the current one for the block, then put back the ones before."""
    before = [(cp, cp._shard) for cp, _ in saved]
    for cp, s in saved:
        cp._shard = s
    try:
        yield
    finally:
        for cp, s in before:
            cp._shard = s


def cp_attached() -> bool:
    """Whether a :class:`ContextParallel` is attached now (its current shard is read by the token mixers)."""
    return len(_ATTACHED) > 0


def recompute_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` around a layer that may
    run under context parallelism: called at the forward, it records every attached :class:`ContextParallel`'s
    current shard, and the recomputation in the backward runs with those shards current (the ones current before
    it are put back after), so it replays the forward's documents, conv windows, carried KDA state and attention
    geometry even when later micro-batches set other shards in between (pipeline schedules). Returns
    ``(forward context, recomputation context)``; with no ``ContextParallel`` attached both do nothing.

    Eager checkpoints only: ``torch.compile`` accepts no ``context_fn`` but selective-checkpoint policies inside a
    compiled region (the token-local MLP / MoE blocks read no shard and need none)."""
    saved = [(cp, cp._shard) for cp in _ATTACHED]
    return contextlib.nullcontext(), _Replay(saved)


class _Replay:
    """:func:`_shards_set` of ``saved`` each time it is entered: a layer may be recomputed more than once (a pipeline
    schedule that splits the backward into input and weight parts, ``ZBVZeroBubble`` / ``DualPipeV``, replays it in
    each)."""

    def __init__(self, saved):
        self.saved, self.open = saved, []

    def __enter__(self):
        cm = _shards_set(self.saved)
        self.open.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc):
        return self.open.pop().__exit__(*exc)
