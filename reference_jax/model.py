"""The whole Kimi K3 / K3.1 Pro text model in the reference: decoder layers, Block Attention Residuals, head.

Notable (spec 5.4, 5.5):

* The residual stream is **Block AttnRes**: a partial sum ``p`` of layer outputs plus a list of stored ``blocks``.
  Before each attention and each MLP, a learned softmax over depth mixes ``blocks + [p]``. On a block-write layer
  (``idx % attn_res_block_size == 0``) the current ``p`` is stored as a new block *before* the attention and the
  partial sum restarts, so ``blocks[0]`` is the embedding. The output mix sees every block plus the last ``p``.
* ``attn_res_block_size=None`` (Kimi-Linear) gives the plain pre-norm residual stream instead.
* Layer kinds come from the config (:meth:`KimiConfig.layer_type`): KDA, dense MLA, or MLA + DSA indexer.
* ``return_aux=True`` returns per-layer intermediates for the equivalence harness: ``attn_out``, ``mlp_out``,
  ``residual`` (the partial sum ``p`` after the layer; the hidden state for plain residuals), the layer's inputs
  ``input_p`` and ``input_blocks`` (a tuple of stored AttnRes blocks), and, for DSA layers, ``topk_indices`` and
  ``index_scores``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kimi.config import KimiConfig
from kimi.tokenizer import IGNORE_INDEX
from reference_jax.attn_res import attn_res_mix
from reference_jax.cache import check_cache, kda_step
from reference_jax.common import Linear, RMSNorm, Weight, check_cu_seqlens, check_token_ids
from reference_jax.kda import KimiDeltaAttention
from reference_jax.mla import GatedMLA
from reference_jax.moe import DenseMLP, KimiMoE

__all__ = ["DecoderLayer", "KimiK3Model", "load_model", "load_params_tree", "save_params_tree"]


class DecoderLayer(nn.Module):
    """One decoder layer: attention (KDA / MLA / DSA) and MLP (dense / MoE), with AttnRes mixes when configured.

    Params (canonical names under ``model.layers.{i}.``): ``input_layernorm``, ``post_attention_layernorm``,
    ``self_attention_res_{norm,proj}``, ``mlp_res_{norm,proj}``, ``self_attn``, ``mlp`` or ``block_sparse_moe``.
    """

    config: KimiConfig
    layer_idx: int

    def setup(self) -> None:
        c, i = self.config, self.layer_idx
        D = c.hidden_size
        self.input_layernorm = RMSNorm(D, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, c.rms_norm_eps)
        if c.has_attn_res:
            self.self_attention_res_norm = Weight((D,))
            self.self_attention_res_proj = Linear(1, D)
            self.mlp_res_norm = Weight((D,))
            self.mlp_res_proj = Linear(1, D)
        self.self_attn = KimiDeltaAttention(c, i) if c.layer_type(i) == "kda" else GatedMLA(c, i)
        if c.is_moe_layer(i):
            self.block_sparse_moe = KimiMoE(c)
        else:
            self.mlp = DenseMLP(c, c.intermediate_size)

    def attention(self, h: jax.Array, cu_seqlens=None, mla_form: str = "expanded", step=None) -> tuple[jax.Array, dict]:
        """``input_layernorm`` then the layer's attention: ``h`` [B, T, D] -> (out [B, T, D], aux); aux holds
        ``topk_indices`` / ``index_scores`` for DSA layers, nothing for KDA, and the layer's new ``cache`` when
        ``step`` (a cached call, see ``reference_jax.cache``) is given."""
        x = self.input_layernorm(h)
        if step is not None:  # a cached call (reference_jax.cache): the layer's new cache goes into aux["cache"]
            layer_cache = step.layers[self.layer_idx]
            if self.config.layer_type(self.layer_idx) == "kda":
                out, new = kda_step(self.self_attn, x, layer_cache, step)
                return out, {"cache": new}
            out, aux, new = self.self_attn(
                x, form=mla_form, return_aux=True, cache=layer_cache, cache_pos=step.pos, lengths=step.lengths
            )
            return out, {**aux, "cache": new}
        if self.config.layer_type(self.layer_idx) == "kda":
            out, _ = self.self_attn(x, cu_seqlens=cu_seqlens)
            return out, {}
        return self.self_attn(x, cu_seqlens=cu_seqlens, form=mla_form, return_aux=True)

    def feed_forward(self, h: jax.Array) -> jax.Array:
        """``post_attention_layernorm`` then the dense MLP or the MoE: ``h`` [B, T, D] -> (out [B, T, D], aux); aux
        holds ``expert_ids`` / ``expert_scores`` for MoE layers."""
        x = self.post_attention_layernorm(h)
        if self.config.is_moe_layer(self.layer_idx):
            return self.block_sparse_moe(x, return_aux=True)  # (out, {"expert_ids", "expert_scores"})
        return self.mlp(x), {}

    def mix(self, which: str, sources: list[jax.Array]) -> jax.Array:
        """AttnRes depth mix with this layer's ``{which}_res_norm`` / ``{which}_res_proj`` (which: self_attention|mlp)."""
        norm = getattr(self, f"{which}_res_norm")()
        proj = getattr(self, f"{which}_res_proj").variables["params"]["weight"]
        return attn_res_mix(sources, norm, proj, eps=self.config.rms_norm_eps)

    def __call__(self, blocks: list[jax.Array], p: jax.Array, cu_seqlens=None, mla_form: str = "expanded", step=None):
        """One step of the layer recurrence (spec 5.4). Returns ``(blocks, p, aux)``.

        AttnRes: ``blocks`` (list of [B,T,D]) and ``p`` (partial sum [B,T,D]). Plain residuals: ``blocks`` is
        unused and ``p`` is the hidden state. ``step`` (a ``reference_jax.cache.CacheStep``) makes it a cached call.
        """
        c, i = self.config, self.layer_idx
        if not c.has_attn_res:
            a, aux = self.attention(p, cu_seqlens, mla_form, step)
            p = p + a
            m, mlp_aux = self.feed_forward(p)
            p = p + m
            return blocks, p, {"attn_out": a, "mlp_out": m, "residual": p, **aux, **mlp_aux}
        h = self.mix("self_attention", blocks + [p]) if blocks else p
        restart = c.is_block_write_layer(i)
        if restart:  # store the finished block, then restart the partial sum
            blocks = blocks + [p]
        a, aux = self.attention(h, cu_seqlens, mla_form, step)
        p = a if restart else p + a
        m, mlp_aux = self.feed_forward(self.mix("mlp", blocks + [p]))
        p = p + m
        return blocks, p, {"attn_out": a, "mlp_out": m, "residual": p, **aux, **mlp_aux}


class _Backbone(nn.Module):
    """``model.*``: embed_tokens, layers, output AttnRes mix, final norm."""

    config: KimiConfig

    def setup(self) -> None:
        c = self.config
        self.embed_tokens = _Embedding(c.vocab_size, c.hidden_size)
        self.layers = [DecoderLayer(c, i) for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.has_attn_res:
            self.output_attn_res_norm = Weight((c.hidden_size,))
            self.output_attn_res_proj = Linear(1, c.hidden_size)

    def __call__(self, input_ids: jax.Array, cu_seqlens=None, mla_form: str = "expanded", on_layer=None, step=None):
        c = self.config
        p = self.embed_tokens(input_ids)
        blocks: list[jax.Array] = []
        auxes = []
        for layer in self.layers:
            p_in, blocks_in = p, tuple(blocks)
            blocks, p, aux = layer(blocks, p, cu_seqlens, mla_form, step)
            aux.update(input_p=p_in, input_blocks=blocks_in)  # the layer's inputs, for layer-local comparisons
            auxes.append(aux)
            if on_layer is not None:
                on_layer(len(auxes) - 1)
        if c.has_attn_res:
            proj = self.output_attn_res_proj.variables["params"]["weight"]
            h = attn_res_mix(blocks + [p], self.output_attn_res_norm(), proj, eps=c.rms_norm_eps)
        else:
            h = p
        return self.norm(h), auxes


class _Embedding(nn.Module):
    """``embed_tokens.weight`` [vocab, D]; plain lookup, no scaling (spec 5.5)."""

    num_embeddings: int
    features: int

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        table = self.param("weight", nn.initializers.normal(1.0), (self.num_embeddings, self.features))
        return jnp.take(table, ids, axis=0)


class KimiK3Model(nn.Module):
    """``KimiK3ForCausalLM``: ``logits = model(input_ids)``; params ``model.*`` and ``lm_head.weight``. Four calls,
    each with one return shape (twins of ``kernels_torch.model.KimiK3Model``'s):

    * ``model.apply({"params": tree}, input_ids, cu_seqlens=None, mla_form="expanded", return_aux=False,
      on_layer=None)``: logits ``[B, T, vocab]`` in the parameters' dtype (fp32 by default); with ``return_aux``
      ``(logits, auxes)``, one dict per layer (see the module docstring). ``input_ids`` ``[B, T]`` int32/int64.
    * ``method="loss"``: ``(input_ids, labels, cu_seqlens=None, ...)`` -> the summed next-token NLL, a scalar.
    * ``method="step"``: ``(input_ids, cache, lengths=None, ...)`` -> ``(logits, new_cache)``: one cached call, see
      ``reference_jax.cache``.
    * ``method="padded"``: ``(input_ids, attention_mask, ...)`` -> logits with 0 at the pads.

    ``cache=``, ``lengths=`` and ``attention_mask=`` in the plain call are deprecated aliases of ``step`` and
    ``padded`` (a ``DeprecationWarning``, same result).

    Padding: each row is one sequence from its first token. Right padding is safe (causal attention, forward KDA);
    left padding changes the real tokens' logits (the pads enter the KDA state, the conv window and the attention):
    use ``padded``. A sequence longer than ``config.max_position_embeddings`` runs with a UserWarning.

    Raises:
        ValueError: ``input_ids`` not ``[B, T]`` int32/int64 (uint8, bool and floats are refused), ids outside
            [0, vocab_size), invalid ``cu_seqlens`` (from the layers); and per method, see there.
    """

    config: KimiConfig

    def setup(self) -> None:
        self.model = _Backbone(self.config)
        if not self.config.tie_word_embeddings:
            self.lm_head = Linear(self.config.vocab_size, self.config.hidden_size)

    def __call__(
        self, input_ids, cu_seqlens=None, mla_form: str = "expanded", return_aux: bool = False, on_layer=None, **kw
    ):
        if kw:
            return self._deprecated_call(input_ids, cu_seqlens, mla_form, return_aux, on_layer, kw)
        ids = check_token_ids(input_ids, self.config.vocab_size)  # [B, T] int32/int64 in [0, vocab)
        _warn_past_max_positions(ids.shape[1], cu_seqlens, self.config.max_position_embeddings)
        h, auxes = self.model(ids, cu_seqlens, mla_form, on_layer, None)
        logits = self._logits(h)
        return (logits, auxes) if return_aux else logits

    def _logits(self, h: jax.Array) -> jax.Array:
        if self.config.tie_word_embeddings:
            return h @ self.model.embed_tokens.variables["params"]["weight"].T
        return self.lm_head(h)

    def loss(self, input_ids, labels, cu_seqlens=None, mla_form: str = "expanded", on_layer=None):
        """The **summed** next-token NLL over the positions with a target (``labels`` ``[B, T]`` ints, ``-100`` for
        none): ``logsumexp(logits) - logits[label]`` in fp32 (fp64 for fp64 params), nats; twin of
        ``kernels_torch.model.KimiK3Model.loss`` (which never forms the logits; this one does).

        Raises:
            ValueError: as the plain call; ``labels`` not ``[B, T]`` integers or (when concrete) an id outside
                [0, vocab_size) other than -100.
        """
        ids = check_token_ids(input_ids, self.config.vocab_size)
        y = jnp.asarray(labels)
        if y.shape != ids.shape or not jnp.issubdtype(y.dtype, jnp.integer):
            raise ValueError(f"labels: got shape {y.shape} dtype {y.dtype}, expected [B, T] = {list(ids.shape)} ints")
        V = self.config.vocab_size
        if not isinstance(labels, jax.core.Tracer):
            bad = np.asarray((y != IGNORE_INDEX) & ((y < 0) | (y >= V)))
            if bad.any():
                raise ValueError(
                    f"labels: got {int(np.asarray(y)[bad][0])}, expected ids in [0, {V}) or {IGNORE_INDEX}"
                )
        logits = self(ids, cu_seqlens, mla_form, on_layer=on_layer)
        x = logits.astype(jnp.float64 if logits.dtype == jnp.float64 else jnp.float32)
        safe = jnp.where(y == IGNORE_INDEX, 0, y).astype(jnp.int32)
        nll = jax.nn.logsumexp(x, axis=-1) - jnp.take_along_axis(x, safe[..., None], axis=-1)[..., 0]
        return jnp.where(y == IGNORE_INDEX, 0.0, nll).sum()

    def step(self, input_ids, cache, lengths=None, mla_form: str = "expanded", return_aux: bool = False):
        """One cached call: row ``n`` of ``input_ids`` ``[B, T]`` holds ``lengths[n]`` new tokens (default all T;
        the rest is right padding). ``cache``: a ``reference_jax.cache.ModelCache`` (``init_cache``); JAX arrays are
        values, so the updated cache is returned (the torch twin updates its cache in place and returns it too).

        Returns:
            ``(logits [B, T, vocab], new_cache)``, or ``(logits, auxes, new_cache)`` with ``return_aux``.

        Raises:
            ValueError: as the plain call; the errors of ``reference_jax.cache.check_cache``.
        """
        ids = check_token_ids(input_ids, self.config.vocab_size)
        step = check_cache(cache, self.config, *ids.shape, lengths, None)
        h, auxes = self.model(ids, None, mla_form, None, step)
        logits = self._logits(h)
        new_layers = tuple(aux.pop("cache") for aux in auxes)
        cache = cache.replace(layers=new_layers, pos=cache.pos + jnp.asarray(step.lengths, jnp.int32))
        return (logits, auxes, cache) if return_aux else (logits, cache)

    def padded(self, input_ids, attention_mask, mla_form: str = "expanded", on_layer=None):
        """A padded batch, ``attention_mask`` ``[B, T]`` (bool or 0/1, concrete; 1 = real token): the masked tokens
        are dropped and the rows run as packed documents, so each row's real logits equal that row run alone;
        logits at pads are 0. Twin of ``kernels_torch.model.KimiK3Model.padded``.

        Raises:
            ValueError: as the plain call; an ``attention_mask`` that is traced, not [B, T] of 0/1, or has no real
                token.
        """
        ids = check_token_ids(input_ids, self.config.vocab_size)
        mask = _check_attention_mask(attention_mask, ids.shape)
        n_real = mask.sum(1)
        cu = np.concatenate([[0], np.cumsum(n_real[n_real > 0])])  # empty rows are no document
        logits = self(ids[mask][None], cu_seqlens=cu, mla_form=mla_form, on_layer=on_layer)  # [1, N, vocab]
        return jnp.zeros((*ids.shape, logits.shape[-1]), logits.dtype).at[mask].set(logits[0])

    def _deprecated_call(self, input_ids, cu_seqlens, mla_form, return_aux, on_layer, kw):
        """The old keywords ``cache``, ``lengths``, ``attention_mask`` mapped onto ``step`` and ``padded``."""
        kw = dict(kw)
        cache, lengths, mask = kw.pop("cache", None), kw.pop("lengths", None), kw.pop("attention_mask", None)
        if kw:
            raise TypeError(f"__call__() got unexpected keyword arguments {sorted(kw)}")
        if mask is not None:
            name, method = "attention_mask", "padded"
            clash = {"cache": cache, "lengths": lengths, "cu_seqlens": cu_seqlens, "return_aux": return_aux or None}
        elif cache is not None:
            name, method, clash = "cache", "step", {"cu_seqlens": cu_seqlens, "on_layer": on_layer}
        elif lengths is None:  # the old keywords given as None: the plain call
            return self(input_ids, cu_seqlens, mla_form, return_aux, on_layer)
        else:
            name, method, clash = "lengths", "step", {"lengths (without a cache)": lengths}
        warnings.warn(f"KimiK3Model({name}=...) is deprecated: use method={method!r}", DeprecationWarning, 3)
        refused = [k for k, v in clash.items() if v is not None]
        if refused:
            raise ValueError(f"{name}: given with {', '.join(refused)}, expected none of them (KimiK3Model.{method})")
        if mask is not None:
            return self.padded(input_ids, mask, mla_form, on_layer)
        return self.step(input_ids, cache, lengths, mla_form, return_aux)


def _check_attention_mask(attention_mask, shape) -> np.ndarray:
    """``attention_mask`` as a numpy bool ``[B, T]``; ValueError for what the padded forward cannot honour (twin of
    ``kernels_torch.model._check_attention_mask``)."""
    if isinstance(attention_mask, jax.core.Tracer):
        raise ValueError("attention_mask: got a traced array (under jax.jit), expected a concrete one (numpy / list)")
    m = np.asarray(attention_mask)
    if m.shape != tuple(shape):
        raise ValueError(f"attention_mask: got shape {m.shape}, expected [B, T]={list(shape)} like input_ids")
    if m.dtype.kind not in "biuf":
        raise ValueError(f"attention_mask: got dtype {m.dtype}, expected bool, integer or floating 0/1 values")
    bad = (m != 0) & (m != 1)  # a float 0./1. mask (np.ones((B, T))) is as good as an int one; NaN is refused
    if np.any(bad):
        raise ValueError(
            f"attention_mask: got the value {m[bad].flat[0].item()!r} (dtype {m.dtype}), expected only 0 and 1 "
            "(or bool): 1 = a real token, 0 = padding"
        )
    m = m.astype(bool)
    if not m.any():
        raise ValueError("attention_mask: got no real token (all zeros), expected at least one 1")
    return m


def _warn_past_max_positions(T: int, cu_seqlens, max_positions: int) -> None:
    """UserWarning when the longest sequence (row, or packed document) exceeds ``max_position_embeddings``.

    Raises:
        ValueError: invalid ``cu_seqlens`` (``check_cu_seqlens``), before its lengths are read.
    """
    if cu_seqlens is None or isinstance(cu_seqlens, jax.core.Tracer):  # a traced one: the layers refuse it
        longest = T
    else:
        longest = int(np.diff(check_cu_seqlens(cu_seqlens, T)).max())
    if longest > max_positions:
        warnings.warn(
            f"sequence length {longest} exceeds config.max_position_embeddings={max_positions}: computed anyway "
            "(NoPE), but the checkpoint does not declare lengths this long",
            UserWarning,
            stacklevel=3,
        )


def load_model(
    checkpoint: str | Path, layers: int | None = None, dtype: Any = jnp.float32, *, check_finite: bool = True
):
    """Read a checkpoint directory lazily and build the reference: returns ``(model, params_tree, config)``.

    ``layers=N`` keeps the first N decoder layers (then the output mix, final norm and lm_head) and reads only
    their tensors. Parameters are cast to ``dtype`` (fp32 default; fp64 needs ``jax.enable_x64``).
    ``check_finite=False`` skips the NaN/inf scan of the weights (``kimi.checkpoint.load_params``) for speed.

    Raises:
        kimi.checkpoint.CheckpointError: missing, unexpected, misshaped or wrongly typed tensors.
        kimi.config.ConfigError: an invalid config.json.
    """
    from kimi.checkpoint import CheckpointReader, load_arrays
    from reference_jax.params import to_tree

    reader = CheckpointReader(checkpoint)
    config = reader.config if layers is None else reader.config.truncated(layers)
    params = load_arrays(reader, config, layers=range(config.num_hidden_layers), check_finite=check_finite)  # numpy
    return KimiK3Model(config), to_tree(params, dtype), config


def load_params_tree(checkpoint: str | Path, layers: int | None = None, dtype: Any = None):
    """The canonical parameters of a checkpoint as a linen tree (``dtype=None`` keeps the stored dtypes: bf16 as
    ``ml_dtypes.bfloat16``, fp32 as fp32). Returns ``(tree, config)``."""
    from kimi.checkpoint import CheckpointReader, load_arrays
    from reference_jax.params import to_tree

    reader = CheckpointReader(checkpoint)
    config = reader.config if layers is None else reader.config.truncated(layers)
    return to_tree(load_arrays(reader, config, layers=range(config.num_hidden_layers)), dtype), config


def save_params_tree(path: str | Path, tree: dict, config: KimiConfig) -> None:
    """Write a linen parameter tree as a checkpoint in the real layout (each tensor cast to its stored dtype;
    experts re-quantised to MXFP4 when the config says so). Atomic per file, index last. No torch involved."""
    from kimi.checkpoint import save_params
    from kimi.layout import param_layout
    from reference_jax.params import from_tree

    dtypes = {s.name: s.dtype for s in param_layout(config)}
    save_params(path, from_tree(tree, dtypes), config)
