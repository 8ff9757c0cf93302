"""The whole Kimi K3 / K3.1 Pro text model on the PyTorch path: the twin of ``reference_jax.model``.

Same recurrence (Block AttnRes, spec 5.4), same per-layer intermediates with ``return_aux=True``; ``state_dict``
keys are the canonical checkpoint names (``model.*``, ``lm_head.weight``) without the ``language_model.`` prefix.
The attention backend (``eager``, ``sdpa``, ``cudnn``) is one setting for the whole model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kernels_torch.attn_res import attn_res_mix
from kernels_torch.cache import check_cache, kda_step
from kernels_torch.common import RMSNorm
from kernels_torch.kda import KimiDeltaAttention
from kernels_torch.kernel_choice import set_model_kernels
from kernels_torch.mla import GatedMLA
from kernels_torch.moe import DenseMLP, KimiMoE
from kimi.config import KimiConfig

__all__ = ["BACKENDS", "DecoderLayer", "KimiK3Model", "load_model", "save_model", "cast_model"]

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


class DecoderLayer(nn.Module):
    """Twin of ``reference_jax.model.DecoderLayer``."""

    def __init__(self, config: KimiConfig, layer_idx: int, backend: str = "eager"):
        super().__init__()
        c, i = config, layer_idx
        self.config, self.layer_idx = c, i
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
            self.block_sparse_moe = KimiMoE(c)
        else:
            self.mlp = DenseMLP(c, c.intermediate_size)

    def attention(self, h, cu_seqlens=None, mla_form="expanded", step=None):
        """Twin of ``reference_jax.model.DecoderLayer.attention``: ``h`` [B, T, D] -> (out [B, T, D], aux)."""
        x = self.input_layernorm(h)
        if step is not None:  # a cached call (kernels_torch.cache): the layer's new cache goes into aux["cache"]
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

    def feed_forward(self, h):
        """Twin of ``reference_jax.model.DecoderLayer.feed_forward``: ``h`` [B, T, D] -> (out [B, T, D], aux)."""
        x = self.post_attention_layernorm(h)
        if self.config.is_moe_layer(self.layer_idx):
            return self.block_sparse_moe(x, return_aux=True)  # (out, {"expert_ids", "expert_scores"})
        return self.mlp(x), {}

    def mix(self, which: str, sources):
        """AttnRes depth mix with this layer's ``{which}_res_norm`` / ``{which}_res_proj`` (which: self_attention or
        mlp); ``sources`` a list of [B, T, D] (spec 5.4)."""
        norm = getattr(self, f"{which}_res_norm").weight
        proj = getattr(self, f"{which}_res_proj").weight
        return attn_res_mix(sources, norm, proj, eps=self.config.rms_norm_eps)

    def forward(self, blocks, p, cu_seqlens=None, mla_form="expanded", step=None):
        c, i = self.config, self.layer_idx
        if not c.has_attn_res:
            a, aux = self.attention(p, cu_seqlens, mla_form, step)
            p = p + a
            m, mlp_aux = self.feed_forward(p)
            p = p + m
            return blocks, p, {"attn_out": a, "mlp_out": m, "residual": p, **aux, **mlp_aux}
        h = self.mix("self_attention", blocks + [p]) if blocks else p
        restart = c.is_block_write_layer(i)
        if restart:
            blocks = blocks + [p]
        a, aux = self.attention(h, cu_seqlens, mla_form, step)
        p = a if restart else p + a
        m, mlp_aux = self.feed_forward(self.mix("mlp", blocks + [p]))
        p = p + m
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

    def forward(self, input_ids, cu_seqlens=None, mla_form="expanded", on_layer=None, step=None):
        p = self.embed_tokens(input_ids)
        blocks: list[torch.Tensor] = []
        auxes = []
        for layer in self.layers:
            p_in, blocks_in = p, tuple(blocks)
            blocks, p, aux = layer(blocks, p, cu_seqlens, mla_form, step)
            aux.update(input_p=p_in, input_blocks=blocks_in)  # the layer's inputs, for layer-local comparisons
            auxes.append(aux)
            if on_layer is not None:
                on_layer(len(auxes) - 1)
        if self.config.has_attn_res:
            p = attn_res_mix(
                blocks + [p],
                self.output_attn_res_norm.weight,
                self.output_attn_res_proj.weight,
                eps=self.config.rms_norm_eps,
            )
        return self.norm(p), auxes


class KimiK3Model(nn.Module):
    """``KimiK3ForCausalLM`` on the torch path.

    ``forward(input_ids [B, T] long, cu_seqlens=None, mla_form="expanded", return_aux=False)`` -> logits
    [B, T, vocab] in the parameters' dtype (and per-layer aux dicts with ``return_aux``).

    Generation: ``cache=`` a ``kernels_torch.cache.ModelCache`` (``init_cache``) with ``lengths=`` ``[B]`` new tokens
    per row (default all T; the rest of a row is right padding) returns ``(logits, cache)`` (``(logits, auxes,
    cache)`` with ``return_aux``); the cache is updated **in place**. See ``kernels_torch.cache``.

    Raises:
        ValueError: an unknown ``backend``; token ids outside [0, vocab_size); invalid ``cu_seqlens``.
    """

    def __init__(self, config: KimiConfig, backend: str = "eager"):
        super().__init__()
        self.config = config
        self.backend = check_backend(backend)
        self.model = _Backbone(config, backend)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self, input_ids, cu_seqlens=None, mla_form="expanded", return_aux=False, on_layer=None, cache=None, lengths=None
    ):
        if input_ids.ndim != 2 or input_ids.numel() == 0:
            raise ValueError(f"input_ids: got shape {tuple(input_ids.shape)}, expected [B, T] with B, T >= 1")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids: got dtype {input_ids.dtype}, expected integer token ids")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"input_ids: got ids in [{lo}, {hi}], expected ids in [0, {self.config.vocab_size})")
        step = None if cache is None else check_cache(cache, self.config, *input_ids.shape, lengths, cu_seqlens)
        h, auxes = self.model(input_ids, cu_seqlens, mla_form, on_layer, step)
        w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = h @ w.t()
        if cache is not None:  # in place: the new layer caches and positions
            cache.layers = [aux.pop("cache") for aux in auxes]
            cache.pos = cache.pos + step.lengths
            return (logits, auxes, cache) if return_aux else (logits, cache)
        return (logits, auxes) if return_aux else logits


def load_model(
    checkpoint: str | Path,
    layers: int | None = None,
    backend: str = "eager",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    sparse_kernel: str | None = None,
    kda_kernel: str | None = None,
) -> KimiK3Model:
    """Read a checkpoint directory lazily (only the first ``layers`` layers when given) into a :class:`KimiK3Model`.

    ``sparse_kernel`` (``auto`` | ``flash_mla`` | ``triton``) and ``kda_kernel`` (``auto`` | ``cudnn`` | ``fla``) pick
    the ``cudnn`` backend's DSA sparse forward and KDA recurrence for every layer (None: ``$KIMI_SPARSE_KERNEL`` /
    ``$KIMI_KDA_KERNEL``, else auto; ``kernels_torch.kernel_choice``); other backends ignore them.

    Raises:
        kimi.checkpoint.CheckpointError, kimi.config.ConfigError, ValueError (backend, kernel choice).
    """
    from kimi.checkpoint import CheckpointReader, load_params

    check_backend(backend)
    set_model_kernels(nn.Module(), sparse_kernel=sparse_kernel, kda_kernel=kda_kernel)  # validate before reading
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device: got {str(device)!r}, but CUDA is not available here"
            + (" (the cudnn backend needs a CUDA GPU; use eager or sdpa on a CPU)" if backend == "cudnn" else "")
        )
    reader = CheckpointReader(checkpoint)
    config = reader.config if layers is None else reader.config.truncated(layers)
    params = load_params(reader, config, layers=range(config.num_hidden_layers))
    with torch.device("meta"):
        model = KimiK3Model(config, backend=backend)
    model.load_state_dict(params, strict=True, assign=True)
    set_model_kernels(model, sparse_kernel=sparse_kernel, kda_kernel=kda_kernel)
    return cast_model(model.to(device), dtype)


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
    (exact when the weights came from a checkpoint), experts re-quantised to MXFP4 when the config says so."""
    from kimi.checkpoint import save_params
    from kimi.layout import param_layout

    dtypes = {s.name: getattr(torch, s.dtype) for s in param_layout(model.config)}
    sd = {k: v.detach().to("cpu", dtypes[k]) for k, v in model.state_dict().items()}
    save_params(path, sd, model.config)
