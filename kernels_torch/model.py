"""The whole Kimi K3 / K3.1 Pro text model on the PyTorch path: the twin of ``reference_jax.model``.

Same recurrence (Block AttnRes, spec 5.4), same per-layer intermediates with ``return_aux=True``; ``state_dict``
keys are the checkpoint names (``model.*``, ``lm_head.weight``) without the ``language_model.`` prefix, except that
each MoE layer's routed experts are stacked (``kimi.layout.stacked_layout``; ``kernels_torch.params`` maps them).
The attention backend (``eager``, ``sdpa``, ``cudnn``) is one setting for the whole model.
"""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels_torch import kernel_choice
from kernels_torch.attn_res import attn_res_mix
from kernels_torch.cache import check_cache, kda_step
from kernels_torch.common import RMSNorm, check_cu_seqlens, check_range_async, check_token_ids, compute_dtype
from kernels_torch.decode import StaticStep, static_attention
from kernels_torch.kda import KimiDeltaAttention
from kernels_torch.kernel_choice import set_model_kernels
from kernels_torch.mla import GatedMLA
from kernels_torch.moe import DenseMLP, KimiMoE
from kernels_torch.params import canonical_state_dict, load_canonical
from kimi.config import KimiConfig
from kimi.tokenizer import IGNORE_INDEX

__all__ = ["BACKENDS", "DecoderLayer", "KimiK3Model", "load_model", "model_from_params", "save_model", "cast_model"]

BACKENDS = ("eager", "sdpa", "cudnn")


def check_backend(backend: str) -> str:
    """Return ``backend`` if it is one of :data:`BACKENDS`; raise ValueError naming it otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: got {backend!r}, expected one of {list(BACKENDS)}")
    return backend


class _Weight(nn.Module):
    """A bare ``weight`` vector (AttnRes ``*_res_norm``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class _PassOn(torch.autograd.Function):
    """The identity: a tensor that shares ``x``'s storage (``x.detach()``, not a view of it) with a gradient node of
    its own, whose backward passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _passed_on(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The AttnRes blocks a layer hands on to the next: each the same values as the layer received, as a tensor of
    its own (:class:`_PassOn`: no copy). Under FSDP2 a layer's inputs arrive as views that its pre-forward hook
    makes (``RegisterPostBackwardFunction``, whose backward reshards the layer and reduces its gradients once the
    gradients of all those views are complete) and FSDP2 hooks every output of the layer to gather its parameters
    for the backward (its pre-backward). Handing on those views would hold the layer's post-backward until every
    later layer's backward is done (a later layer reads the block); handing on the caller's tensors would fire the
    layer's pre-backward again once the block's whole gradient is complete, at the block's first layer, after its
    post-backward: the layer's parameters gathered a second time and held until the backward ends. A tensor of the
    layer's own is read only by the next layer: its gradient is complete, and the layer's pre-backward fires, when
    the next layer's backward is done, as for the partial sum ``p``. No view is returned either (FSDP2 warns about
    a wrapped module returning a view: an in-place op on it would skip the all-gather hook)."""
    return [_PassOn.apply(b) for b in blocks]


class DecoderLayer(nn.Module):
    """Twin of ``reference_jax.model.DecoderLayer``.

    The layer's kind is read once here (``is_kda``, ``is_moe``, ``writes_block``: plain attributes) and the
    training forward never reads ``layer_idx``: under ``torch.compile`` (``kernels_torch.compile``) dynamo guards on
    what the forward reads, so layers of one kind and input shapes share one compiled graph."""

    def __init__(self, config: KimiConfig, layer_idx: int, backend: str = "eager"):
        super().__init__()
        c, i = config, layer_idx
        self.config, self.layer_idx = c, i
        self.is_kda = c.layer_type(i) == "kda"
        self.is_moe = c.is_moe_layer(i)
        self.writes_block = c.is_block_write_layer(i)  # AttnRes: the partial sum becomes a block before attention
        D = c.hidden_size
        self.input_layernorm = RMSNorm(D, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, c.rms_norm_eps)
        if c.has_attn_res:
            self.self_attention_res_norm = _Weight(D)
            self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
            self.mlp_res_norm = _Weight(D)
            self.mlp_res_proj = nn.Linear(D, 1, bias=False)
        if c.layer_type(i) == "kda":
            self.self_attn = KimiDeltaAttention(c, i, backend=backend)
        else:
            self.self_attn = GatedMLA(c, i, backend=backend)
        if c.is_moe_layer(i):
            self.block_sparse_moe = KimiMoE(c, backend)
        else:
            self.mlp = DenseMLP(c, c.intermediate_size, backend)

    def attention(self, h, cu_seqlens=None, mla_form="expanded", step=None):
        """Twin of ``reference_jax.model.DecoderLayer.attention``: ``h`` [B, T, D] -> (out [B, T, D], aux)."""
        x = self.input_layernorm(h)
        if isinstance(step, StaticStep):  # a static-shape decode token (kernels_torch.decode): cache written in place
            return static_attention(self.self_attn, x, step.layers[self.layer_idx], step), {}
        if step is not None:  # a cached call (kernels_torch.cache): the layer's new cache goes into aux["cache"]
            layer_cache = step.layers[self.layer_idx]
            if self.is_kda:
                out, new = kda_step(self.self_attn, x, layer_cache, step)
                return out, {"cache": new}
            out, aux, new = self.self_attn(
                x, form=mla_form, return_aux=True, cache=layer_cache, cache_pos=step.pos, lengths=step.lengths
            )
            return out, {**aux, "cache": new}
        if self.is_kda:
            out, _ = self.self_attn(x, cu_seqlens=cu_seqlens)
            return out, {}
        return self.self_attn(x, cu_seqlens=cu_seqlens, form=mla_form, return_aux=True)

    def feed_forward(self, h, return_aux=True):
        """Twin of ``reference_jax.model.DecoderLayer.feed_forward``: ``h`` [B, T, D] -> (out [B, T, D], aux); aux
        is empty without ``return_aux`` (the MoE then skips its selection scores)."""
        x = self.post_attention_layernorm(h)
        if not self.is_moe:
            return self.mlp(x), {}
        if return_aux:
            return self.block_sparse_moe(x, return_aux=True)  # (out, {"expert_ids", "expert_scores"})
        return self.block_sparse_moe(x), {}

    def mix(self, which: str, sources):
        """AttnRes depth mix with this layer's ``{which}_res_norm`` / ``{which}_res_proj`` (which: self_attention or
        mlp); ``sources`` a list of [B, T, D] (spec 5.4)."""
        norm = getattr(self, f"{which}_res_norm").weight
        proj = getattr(self, f"{which}_res_proj").weight
        return attn_res_mix(sources, norm, proj, eps=self.config.rms_norm_eps)

    def forward(self, blocks, p, cu_seqlens=None, mla_form="expanded", step=None):
        c = self.config
        want_aux = not isinstance(step, StaticStep)
        if not c.has_attn_res:
            a, aux = self.attention(p, cu_seqlens, mla_form, step)
            p = p + a
            m, mlp_aux = self.feed_forward(p, want_aux)
            p = p + m
            return blocks, p, {"attn_out": a, "mlp_out": m, "residual": p, **aux, **mlp_aux}
        h = self.mix("self_attention", blocks + [p]) if blocks else p
        restart = self.writes_block
        if restart:
            blocks = blocks + [p]
        a, aux = self.attention(h, cu_seqlens, mla_form, step)
        p = a if restart else p + a
        m, mlp_aux = self.feed_forward(self.mix("mlp", blocks + [p]), want_aux)
        p = p + m
        blocks = _passed_on(blocks)
        return blocks, p, {"attn_out": a, "mlp_out": m, "residual": p, **aux, **mlp_aux}


class _Backbone(nn.Module):
    def __init__(self, config: KimiConfig, backend: str):
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i, backend) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.has_attn_res:
            self.output_attn_res_norm = _Weight(c.hidden_size)
            self.output_attn_res_proj = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, input_ids, cu_seqlens=None, mla_form="expanded", on_layer=None, step=None, keep_aux=True):
        """``(final hidden states [B, T, D], auxes)``: ``auxes`` one dict per layer (its intermediates and its inputs
        ``input_p`` / ``input_blocks``), or ``[]`` without ``keep_aux``. Without it each layer's aux is dropped as the
        layer returns: under whole-layer recomputation its tensors (the attention and MLP outputs, the MoE selection
        scores, the DSA top-k) are outputs of the checkpoint, not saved activations, and kept they would stay on the
        device until the forward ends (K3.1 Pro at 8192 tokens: 0.32 GB per MoE layer beside its 0.117 GB partial
        sum; the expert ids are a slice of a [T, E] int64 storage)."""
        p = self.embed_tokens(input_ids)
        blocks: list[torch.Tensor] = []
        auxes = []
        for i, layer in enumerate(self.layers):
            p_in, blocks_in = p, tuple(blocks)
            blocks, p, aux = layer(blocks, p, cu_seqlens, mla_form, step)
            if keep_aux:
                aux.update(input_p=p_in, input_blocks=blocks_in)  # the layer's inputs, for layer-local comparisons
                auxes.append(aux)
            del aux, p_in, blocks_in
            if on_layer is not None:
                on_layer(i)
        if self.config.has_attn_res:
            p = attn_res_mix(
                blocks + [p],
                self.output_attn_res_norm.weight,
                self.output_attn_res_proj.weight,
                eps=self.config.rms_norm_eps,
            )
        return self.norm(p), auxes


class KimiK3Model(nn.Module):
    """``KimiK3ForCausalLM`` on the torch path. Four calls, each with one return shape (twins of
    ``reference_jax.model.KimiK3Model``'s):

    * ``model(input_ids, cu_seqlens=None, mla_form="expanded", return_aux=False, on_layer=None)``: logits
      ``[B, T, vocab]`` in the parameters' dtype; with ``return_aux`` ``(logits, auxes)``, one dict of per-layer
      intermediates per layer (``kimi_tools.compare``). ``input_ids`` ``[B, T]`` int32/int64; ``cu_seqlens``
      ``[N+1]`` packs documents into one row (B = 1); ``on_layer(i)`` is called after layer ``i``.
    * :meth:`loss` ``(input_ids, labels, cu_seqlens=None, ...)``: the summed next-token NLL, a scalar.
    * :meth:`step` ``(input_ids, cache, lengths=None, ...)``: one cached call (prefill chunk or decode token),
      ``(logits, cache)``.
    * :meth:`padded` ``(input_ids, attention_mask, ...)``: a padded batch, logits with 0 at the pads.

    The keywords ``labels=``, ``loss_chunk_size=``, ``cache=``, ``lengths=`` and ``attention_mask=`` of ``forward``
    are deprecated aliases of these methods (a ``DeprecationWarning``, same result).

    Padding: every row is one sequence starting at its first token. **Right** padding is safe (attention is causal and
    KDA runs forward, so pads after a row's tokens never reach them). **Left** padding is not: the pads enter the KDA
    state, the conv window and the attention of the real tokens and change their logits (rel ~0.35 on the tiny
    preset); use :meth:`padded`.

    Length: a sequence (a row, a packed document, or a masked row's real tokens) longer than
    ``config.max_position_embeddings`` is computed (the model is NoPE, nothing breaks) but gives a UserWarning: it
    is outside the length the checkpoint declares.

    Raises:
        ValueError: an unknown ``backend``; ``input_ids`` not ``[B, T]`` int32/int64 (uint8, bool and floats are
            refused) or outside [0, vocab_size); invalid ``cu_seqlens``; and per method, see there.
    """

    def __init__(self, config: KimiConfig, backend: str = "eager"):
        super().__init__()
        self.config = config
        self.backend = check_backend(backend)
        if self.backend == "cudnn":
            kernel_choice.check_environment()  # a bad $KIMI_*_KERNEL / $KIMI_KDA_PREP fails here, not at its first call
        self.model = _Backbone(config, backend)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, cu_seqlens=None, mla_form="expanded", return_aux=False, on_layer=None, **deprecated):
        if deprecated:
            return self._deprecated_call(input_ids, cu_seqlens, mla_form, return_aux, on_layer, deprecated)
        check_token_ids(input_ids, self.config.vocab_size)  # [B, T] int32/int64 in [0, vocab)
        _warn_past_max_positions(input_ids.shape[1], cu_seqlens, self.config.max_position_embeddings)
        h, auxes = self.model(input_ids, cu_seqlens, mla_form, on_layer, None, keep_aux=return_aux)
        logits = self.logits(h)
        return (logits, auxes) if return_aux else logits

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``lm_head`` (or the tied embedding) on final hidden states ``h`` ``[..., D]`` -> ``[..., vocab]``."""
        return h @ self.output_weight().t()

    def output_weight(self) -> torch.Tensor:
        """The ``[vocab, D]`` weight of the logits: the embedding when tied, else ``lm_head.weight``."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def loss(self, input_ids, labels, cu_seqlens=None, *, mla_form="expanded", on_layer=None, chunk_size=None):
        """The **summed** next-token NLL over the positions with a target: a scalar in nats, fp32 (fp64 for fp64
        weights); divide by ``(labels != -100).sum()`` for the mean.

        ``labels`` ``[B, T]`` int64: the target id of each position, ``-100`` for none (``kimi_tools.data``'s
        convention). The logits are never materialised: :func:`kernels_torch.loss.linear_cross_entropy` runs
        ``chunk_size`` rows at a time (None: 1 GiB of fp32 logits per chunk). Its value and gradients equal
        ``F.cross_entropy(logits.float(), labels, reduction="sum")`` on the logits path. Tied embeddings use the
        embedding weight; an ``lm_head`` that is not a plain ``nn.Linear`` takes the logits path (same value).
        Under FSDP2 this method is registered as a forward method (``kernels_torch.parallel.parallelize.parallelize``), so
        the gathered ``lm_head`` is the one used.

        Raises:
            ValueError: as ``forward``; ``labels`` not ``[B, T]`` int64 or with an id outside [0, vocab_size) other
                than -100; ``chunk_size`` not a positive int (or None). All before the backbone runs.
        """
        from kernels_torch.loss import linear_cross_entropy

        check_token_ids(input_ids, self.config.vocab_size)
        if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.shape != input_ids.shape:
            got = f"shape {tuple(labels.shape)} dtype {labels.dtype}" if isinstance(labels, torch.Tensor) else labels
            raise ValueError(f"labels: got {got}, expected [B, T] = {list(input_ids.shape)} int64 (-100: no target)")
        V = self.config.vocab_size
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= V))
        if labels.device.type != "cpu":  # no host sync in a training step: a device-side assertion
            check_range_async(~bad, f"labels: expected ids in [0, {V}) or -100 (no target)")
        elif bool(bad.any()):  # before the backbone runs
            raise ValueError(f"labels: got {int(labels[bad][0])}, expected ids in [0, {V}) or -100 (no target)")
        if isinstance(chunk_size, bool) or not (
            chunk_size is None or (isinstance(chunk_size, int) and chunk_size >= 1)
        ):
            raise ValueError(f"loss_chunk_size: got {chunk_size!r}, expected a positive int or None")  # before it too
        _warn_past_max_positions(input_ids.shape[1], cu_seqlens, self.config.max_position_embeddings)
        h, _ = self.model(input_ids, cu_seqlens, mla_form, on_layer, None, keep_aux=False)  # [B, T, D]
        head = None if self.config.tie_word_embeddings else self.lm_head
        w = self.output_weight()  # [vocab, D]
        h, y = h.reshape(-1, h.shape[-1]), labels.to(h.device).reshape(-1)  # [B*T, D], [B*T]
        if head is not None and type(head) is not nn.Linear:  # e.g. a wrapped lm_head: the dense path, same value
            logits = h @ w.t()
            return F.cross_entropy(logits.to(compute_dtype(logits)), y, ignore_index=IGNORE_INDEX, reduction="sum")
        return linear_cross_entropy(h, w, y, ignore_index=IGNORE_INDEX, chunk_size=chunk_size)

    def step(self, input_ids, cache, lengths=None, *, mla_form="expanded", return_aux=False):
        """One cached call (a prefill chunk or a decode token): row ``n`` of ``input_ids`` ``[B, T]`` holds
        ``lengths[n]`` new tokens (default all T; the rest is right padding, whose logits are garbage and which is
        written nowhere). ``cache``: a ``kernels_torch.cache.ModelCache`` (``init_cache``), updated **in place** and
        returned. See ``kernels_torch.cache`` (and ``kernels_torch.decode`` for the static-shape, capturable decode
        step).

        Returns:
            ``(logits [B, T, vocab], cache)``, or ``(logits, auxes, cache)`` with ``return_aux``.

        Raises:
            ValueError: as ``forward``; the errors of ``kernels_torch.cache.check_cache`` (a cache of another
                config, batch, dtype or device, ``lengths`` outside ``[1, T]``, a write past ``max_len``).
        """
        check_token_ids(input_ids, self.config.vocab_size)
        w = self.model.embed_tokens.weight  # the activation dtype and device
        step = check_cache(cache, self.config, *input_ids.shape, lengths, None, dtype=w.dtype, device=w.device)
        h, auxes = self.model(input_ids, None, mla_form, None, step)
        logits = self.logits(h)
        cache.layers = [aux.pop("cache") for aux in auxes]  # in place: the new layer caches and positions
        cache.pos = cache.pos + step.lengths
        return (logits, auxes, cache) if return_aux else (logits, cache)

    def padded(self, input_ids, attention_mask, *, mla_form="expanded", on_layer=None):
        """A padded batch: ``attention_mask`` ``[B, T]`` (bool, or 0/1 in an integer or floating dtype; 1 = real
        token). The masked tokens are
        dropped and the rows run as packed documents (``cu_seqlens``), so each row's logits at its real positions
        equal that row run alone, whatever the padding side; logits at padded positions are 0. The same holds in
        ``reference_jax.model.KimiK3Model.padded``.

        Returns:
            logits ``[B, T, vocab]``.

        Raises:
            ValueError: as ``forward``; an ``attention_mask`` that is not [B, T] of 0/1 (or bool) or has no real
                token at all.
        """
        check_token_ids(input_ids, self.config.vocab_size)
        mask = _check_attention_mask(attention_mask, input_ids.shape)
        lengths = mask.sum(1).tolist()  # real tokens per row
        cu = torch.tensor([0] + [n for n in lengths if n]).cumsum(0)  # empty rows are no document
        packed = input_ids[mask.to(input_ids.device)][None]  # [1, N]: row 0's real tokens, then row 1's, ...
        logits = self(packed, cu_seqlens=cu, mla_form=mla_form, on_layer=on_layer)  # [1, N, vocab]
        out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
        out[mask.to(out.device)] = logits[0]
        return out

    def _deprecated_call(self, input_ids, cu_seqlens, mla_form, return_aux, on_layer, kw):
        """``forward``'s old keywords (``labels``, ``loss_chunk_size``, ``cache``, ``lengths``, ``attention_mask``),
        mapped onto :meth:`loss`, :meth:`padded` and :meth:`step` with a ``DeprecationWarning``."""
        unknown = sorted(set(kw) - {"labels", "loss_chunk_size", "cache", "lengths", "attention_mask"})
        if unknown:
            raise TypeError(f"forward() got unexpected keyword arguments {unknown}")
        labels, chunk = kw.get("labels"), kw.get("loss_chunk_size")
        cache, lengths, mask = kw.get("cache"), kw.get("lengths"), kw.get("attention_mask")
        aux = return_aux or None
        if labels is not None:
            name, method, clash = "labels", "loss", {"cache": cache, "lengths": lengths, "attention_mask": mask}
            clash["return_aux"] = aux
        elif mask is not None:
            name, method, clash = "attention_mask", "padded", {"cache": cache, "lengths": lengths}
            clash.update(cu_seqlens=cu_seqlens, return_aux=aux, loss_chunk_size=chunk)
        elif cache is not None:
            name, method = "cache", "step"
            clash = {"cu_seqlens": cu_seqlens, "on_layer": on_layer, "loss_chunk_size": chunk}
        elif lengths is None and chunk is None:  # the old keywords given as None: the plain call
            return self(input_ids, cu_seqlens, mla_form, return_aux, on_layer)
        else:
            name, method = "lengths" if lengths is not None else "loss_chunk_size", "forward"
            clash = {"lengths (without a cache)": lengths, "loss_chunk_size (without labels)": chunk}
        warnings.warn(
            f"KimiK3Model.forward({name}=...) is deprecated: call KimiK3Model.{method} instead", DeprecationWarning, 5
        )
        refused = [k for k, v in clash.items() if v is not None]
        if refused:
            raise ValueError(f"{name}: given with {', '.join(refused)}, expected none of them (KimiK3Model.{method})")
        if labels is not None:
            return self.loss(input_ids, labels, cu_seqlens, mla_form=mla_form, on_layer=on_layer, chunk_size=chunk)
        if mask is not None:
            return self.padded(input_ids, mask, mla_form=mla_form, on_layer=on_layer)
        return self.step(input_ids, cache, lengths, mla_form=mla_form, return_aux=return_aux)


def _check_attention_mask(attention_mask, shape) -> torch.Tensor:
    """``attention_mask`` as a CPU bool ``[B, T]``; ValueError for what the padded forward cannot honour."""
    m = torch.as_tensor(attention_mask)
    if tuple(m.shape) != tuple(shape):
        raise ValueError(f"attention_mask: got shape {tuple(m.shape)}, expected [B, T]={list(shape)} like input_ids")
    if m.is_complex():
        raise ValueError(f"attention_mask: got dtype {m.dtype}, expected bool, integer or floating 0/1 values")
    bad = (m != 0) & (m != 1)  # a float 0./1. mask (torch.ones(B, T)) is as good as an int one; NaN is refused
    if bool(bad.any()):
        raise ValueError(
            f"attention_mask: got the value {m[bad].flatten()[0].item()!r} (dtype {m.dtype}), expected only 0 and 1 "
            "(or bool): 1 = a real token, 0 = padding"
        )
    m = m.to("cpu", torch.bool)
    if not bool(m.any()):
        raise ValueError("attention_mask: got no real token (all zeros), expected at least one 1")
    return m


def _warn_past_max_positions(T: int, cu_seqlens, max_positions: int) -> None:
    """UserWarning when the longest sequence (row, or packed document) exceeds ``max_position_embeddings``; the
    offsets are validated first (``check_cu_seqlens``), so a bad ``cu_seqlens`` gives its ValueError here."""
    longest = T if cu_seqlens is None else int(check_cu_seqlens(torch.as_tensor(cu_seqlens).cpu(), T).diff().max())
    if longest > max_positions:
        warnings.warn(
            f"sequence length {longest} exceeds config.max_position_embeddings={max_positions}: computed anyway "
            "(NoPE), but the checkpoint does not declare lengths this long",
            UserWarning,
            stacklevel=3,
        )


def load_model(
    checkpoint: str | Path,
    layers: int | None = None,
    backend: str = "eager",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    sparse_kernel: str | None = None,
    kda_kernel: str | None = None,
    *,
    kda_prep: str | None = None,
    kda_pieces: str | None = None,
    short_conv_kernel: str | None = None,
    moe_kernel: str | None = None,
    check_finite: bool = True,
) -> KimiK3Model:
    """Read a checkpoint directory lazily (only the first ``layers`` layers when given) into a :class:`KimiK3Model`
    built on ``device`` in ``dtype`` (the tensors the checkpoint keeps in fp32 stay fp32: :func:`cast_model`).
    ``check_finite=False`` skips the NaN/inf scan of the weights (``kimi.checkpoint.load_params``) for speed.

    The weights stream in: the model is allocated once, then each checkpoint tensor is read (MXFP4 experts
    dequantised), copied into its place (a routed expert into its slice of the layer's stacked ``experts.w*``) and
    dropped, so loading holds the model plus one tensor of the checkpoint (and the few experts
    ``kimi.checkpoint.iter_arrays`` decodes ahead), never a second copy of a layer.

    ``sparse_kernel`` (``auto`` | ``flash_mla`` | ``triton``) and ``kda_kernel`` (``auto`` | ``cudnn`` | ``fla``) pick
    the ``cudnn`` backend's DSA sparse forward and KDA recurrence for every layer, ``kda_prep`` (``auto`` |
    ``triton`` | ``outside`` | ``in_kernel``) where its cuDNN KDA op gets the q/k norms, gate and beta, ``kda_pieces``
    (``auto`` | ``one`` | ``cudnn``) how that op's SM90 forward splits a sequence, ``short_conv_kernel`` (``auto`` |
    ``fla`` | ``cudnn``) the KDA layers' short convolutions, ``moe_kernel`` (``auto`` | ``grouped_mm`` | ``loop``) the
    routed experts of every backend (None: ``$KIMI_SPARSE_KERNEL`` / ``$KIMI_KDA_KERNEL`` / ``$KIMI_KDA_PREP`` /
    ``$KIMI_KDA_PIECES`` / ``$KIMI_SHORT_CONV_KERNEL`` / ``$KIMI_MOE_KERNEL``, else auto; ``kernels_torch.kernel_choice``);
    other backends ignore the first five.

    Raises:
        kimi.checkpoint.CheckpointError, kimi.config.ConfigError, ValueError (backend, kernel choice).
    """
    from kimi.checkpoint import CheckpointReader, iter_arrays

    check_backend(backend)
    kernels = {
        "sparse_kernel": sparse_kernel,
        "kda_kernel": kda_kernel,
        "kda_prep": kda_prep,
        "kda_pieces": kda_pieces,
        "short_conv_kernel": short_conv_kernel,
        "moe_kernel": moe_kernel,
    }
    set_model_kernels(nn.Module(), **kernels)  # validate before reading
    if backend == "cudnn":  # a bad $KIMI_* kernel variable: refused before the checkpoint is read, not after
        kernel_choice.check_environment()
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device: got {str(device)!r}, but CUDA is not available here"
            + (" (the cudnn backend needs a CUDA GPU; use eager or sdpa on a CPU)" if backend == "cudnn" else "")
        )
    reader = CheckpointReader(checkpoint)
    config = reader.config if layers is None else reader.config.truncated(layers)
    stream = iter_arrays(reader, config, layers=range(config.num_hidden_layers), check_finite=check_finite)
    first = next(stream, None)  # the layout check runs here, before anything is allocated
    pairs = itertools.chain([first] if first is not None else [], stream)
    return set_model_kernels(model_from_params(config, pairs, backend, dtype, device), **kernels)


def model_from_params(
    config: KimiConfig,
    params,
    backend: str = "eager",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> KimiK3Model:
    """A :class:`KimiK3Model` on ``device`` in ``dtype`` (:func:`cast_model`'s rule) holding the canonical parameters
    ``params`` (``{name: tensor or numpy array}`` as ``kimi.checkpoint.load_params`` / ``kimi.init.init_params`` give
    them, or an iterable of ``(name, tensor)`` pairs), copied in one at a time (routed experts into their stacks).

    Raises:
        ValueError: an unknown backend; the errors of :func:`kernels_torch.params.load_canonical` (missing,
            unexpected or misshaped tensors)."""
    check_backend(backend)
    with torch.device("meta"):
        model = cast_model(KimiK3Model(config, backend=backend), dtype)
    model.to_empty(device=device)
    return load_canonical(model, params, strict=True)


def cast_model(model: KimiK3Model, dtype: torch.dtype) -> KimiK3Model:
    """Cast parameters to ``dtype``, except those the checkpoint keeps in fp32 (``A_log``, ``dt_bias``, conv
    weights, ``o_norm``, ``e_score_correction_bias``: spec 6), which stay fp32 (fp64 when ``dtype`` is fp64)."""
    from kimi.layout import param_layout

    fp32_names = {s.name for s in param_layout(model.config) if s.dtype == "float32"}
    keep = torch.float64 if dtype == torch.float64 else torch.float32
    for name, param in model.named_parameters():
        param.data = param.data.to(keep if name in fp32_names else dtype)
    return model


def save_model(model: KimiK3Model, path: str | Path) -> None:
    """Write the model's weights as a checkpoint in the real layout: each tensor cast to its stored dtype
    (exact when the weights came from a checkpoint), the stacked routed experts split into the checkpoint's
    per-expert tensors (``kernels_torch.params.canonical_state_dict``), re-quantised to MXFP4 when the config says so."""
    from kimi.checkpoint import save_params
    from kimi.layout import param_layout

    dtypes = {s.name: getattr(torch, s.dtype) for s in param_layout(model.config)}
    sd = {k: v.detach().to("cpu", dtypes[k]) for k, v in canonical_state_dict(model).items()}
    save_params(path, sd, model.config)
