"""Deterministic random initialisation of the canonical parameters, and random checkpoints in the real layout.

Every tensor is drawn from its own ``numpy.random.Generator(PCG64(SeedSequence([seed, *sha256(name)])))``, so a
tensor depends only on ``(seed, name, shape)``: ``layers=N`` gives exactly the first N layers of the full model, and
any subset of layers can be generated alone. The scale of residual-branch outputs uses the **full** config's layer
count, so a truncated checkpoint (``init_checkpoint(..., layers=N)``) holds the same weights as the full one.

Distributions (chosen for healthy activations in tests, not for training from scratch):

* linear weights ``[out, in]``: N(0, 1/in); projections writing into the residual stream (``o_proj``, dense and
  shared-expert ``down_proj``, ``routed_expert_up_proj``) additionally times ``1/sqrt(2 * num_hidden_layers)``;
* ``embed_tokens``: N(0, 1); ``lm_head``: N(0, 1/D);
* norm weights: ``1 + 0.05 * N(0, 1)`` (non-trivial, so tests see them); ``indexer.k_norm.bias``: 0.05 * N(0, 1);
* AttnRes ``*_res_proj`` ``[1, D]``: N(0, 1/D), so depth-softmax logits have std ~1 (neither uniform nor saturated);
* KDA ``*_conv1d.weight`` ``[C, 1, W]`` fp32: N(0, 1/W); ``dt_bias``: 0.1 * N(0, 1); ``A_log = log(U(1, 16))``;
* router ``gate.weight``: N(0, 1/D); ``e_score_correction_bias``: 0.01 * N(0, 1);
* routed experts (MXFP4 configs): N(0, 1/in), then replaced by ``dequantize(quantize(w))`` so that saving and
  reloading is exact.

Drawing, casting and the MXFP4 round trip happen in numpy (``init_array``; bf16 through ``ml_dtypes``, round to
nearest even as torch casts), so :func:`init_checkpoint` needs no torch; :func:`init_tensor` and :func:`init_params`
hand the same bits to torch.
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from kimi.arrays import numpy_dtype, to_torch
from kimi.checkpoint import CONFIG_NAME, DEFAULT_MAX_SHARD_BYTES, normalise_layers, stored_items, write_stream
from kimi.config import KimiConfig
from kimi.layout import TensorSpec, param_layout, stored_layout
from kimi.mxfp4 import dequantize_mxfp4, quantize_mxfp4

__all__ = ["init_params", "init_tensor", "init_array", "init_checkpoint", "checkpoint_nbytes", "layer_nbytes"]

_RESIDUAL_OUT = (
    ".o_proj.weight",
    "mlp.down_proj.weight",
    "shared_experts.down_proj.weight",
    "routed_expert_up_proj.weight",
)


def _rng(seed: int, name: str) -> np.random.Generator:
    """A generator for one tensor: PCG64 seeded by (seed, sha256(name)) through SeedSequence (platform-stable)."""
    words = np.frombuffer(hashlib.sha256(name.encode("utf-8")).digest(), dtype="<u4").tolist()
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), *words])))


def _draw(spec: TensorSpec, config: KimiConfig, seed: int) -> np.ndarray:
    """float32 values of one canonical tensor (before the cast to its dtype and the MXFP4 round trip)."""
    g = _rng(seed, spec.name)
    n, shape = spec.name, spec.shape
    normal = lambda std: g.standard_normal(shape, dtype=np.float32) * np.float32(std)  # noqa: E731
    if n.endswith(".A_log"):
        return np.log(g.uniform(1.0, 16.0, size=shape)).astype(np.float32)
    if n.endswith(".dt_bias"):
        return normal(0.1)
    if n.endswith("e_score_correction_bias"):
        return normal(0.01)
    if n.endswith(".indexer.k_norm.bias"):
        return normal(0.05)
    if n.endswith("_conv1d.weight"):
        return normal(1.0 / math.sqrt(shape[-1]))
    if n.endswith("norm.weight"):  # every RMSNorm / LayerNorm weight (layernorm, o_norm, *_res_norm, k_norm, ...)
        return 1.0 + normal(0.05)
    if n == "model.embed_tokens.weight":
        return normal(1.0)
    if len(shape) == 2:  # linear [out, in], lm_head, router, *_res_proj [1, D]
        std = 1.0 / math.sqrt(shape[1])
        if n.endswith(_RESIDUAL_OUT):
            std /= math.sqrt(2 * config.num_hidden_layers)
        return normal(std)
    raise ValueError(f"init: no rule for {n} with shape {list(shape)}")


def init_array(spec: TensorSpec, config: KimiConfig, seed: int = 0) -> np.ndarray:
    """One canonical parameter (``spec`` from :func:`kimi.layout.param_layout`) as a numpy array of ``spec.shape``
    and ``spec.dtype`` (bf16 as ``ml_dtypes.bfloat16``), deterministic in (seed, name); routed experts of an MXFP4
    config are exactly MXFP4-representable (``dequantize(quantize(w))`` in the config dtype).

    Raises:
        ValueError: a tensor name with no initialisation rule.
    """
    return _init_with_packed(spec, config, seed)[0]


def _init_with_packed(
    spec: TensorSpec, config: KimiConfig, seed: int
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """:func:`init_array`, and for a routed expert of an MXFP4 config its ``(weight_packed, weight_scale)`` too
    (``None`` otherwise): the stored bytes, so that the writer need not encode the tensor a second time."""
    a = _draw(spec, config, seed).astype(numpy_dtype(spec.dtype))  # fp32 -> bf16: round to nearest even
    if ".experts." in spec.name and config.quant_method == "mxfp4":
        p, s = quantize_mxfp4(a, group_size=config.quant_group_size)
        return dequantize_mxfp4(p, s, dtype=spec.dtype, group_size=config.quant_group_size), (p, s)
    return a, None


def _init_stored(spec: TensorSpec, config: KimiConfig, out_cfg: KimiConfig, seed: int) -> dict[str, np.ndarray]:
    """The stored ``{name: array}`` of one canonical parameter, as ``stored_items(name, init_array(...))`` gives
    them. The MXFP4 bytes are the quantizer's own: canonical encodings re-encode to themselves (``kimi.mxfp4``)."""
    a, packed = _init_with_packed(spec, config, seed)
    if packed is None:
        return dict(stored_items(spec.name, a, out_cfg))
    base = spec.name.removesuffix(".weight")
    return {base + ".weight_packed": packed[0], base + ".weight_scale": packed[1]}


def init_tensor(spec: TensorSpec, config: KimiConfig, seed: int = 0) -> Any:
    """:func:`init_array` as a CPU ``torch.Tensor`` (same bits)."""
    return to_torch(init_array(spec, config, seed))


def init_params(config: KimiConfig, seed: int = 0, layers: int | Iterable[int] | None = None) -> dict[str, Any]:
    """Random canonical parameters: names, shapes and dtypes of ``param_layout(config, layers)``.

    Args:
        config: the model; its ``num_hidden_layers`` sets the residual-output scale.
        seed: any non-negative int; equal seeds give bit-identical tensors, per tensor name.
        layers: ``None`` (all), int N (first N) or 0-based indices; the global tensors are always included.

    Returns:
        ``{name: CPU torch tensor}``.
    """
    idx = normalise_layers(config, layers)
    return {s.name: init_tensor(s, config, seed) for s in param_layout(config, idx)}


def _checkpoint_files(path: Path) -> list[str]:
    """The checkpoint files in folder ``path`` (``config.json``, ``model*.safetensors``, the index), sorted; [] when
    it is absent or holds none."""
    if not path.is_dir():
        return []
    return sorted(
        f.name
        for f in path.iterdir()
        if f.name == CONFIG_NAME or (f.name.startswith("model") and ".safetensors" in f.name)
    )


_HEADER_BYTES_PER_TENSOR = 160  # a generous bound on one tensor's safetensors header entry (name, dtype, shape)


def layer_nbytes(config: KimiConfig) -> tuple[int, list[int]]:
    """The bytes :func:`init_checkpoint` writes for ``config``: ``(global, per_layer)``, ``global`` for the
    embedding, final norm and head, ``per_layer[i]`` for decoder layer ``i`` (0-based). Each counts the stored
    layout's tensor data (``kimi.layout.stored_layout``: routed experts of an MXFP4 config as packed nibbles and
    scales, their shapes times their dtypes' sizes) plus at most 160 bytes of safetensors header per tensor; the
    ``config.json`` and index (kilobytes) are not counted. A layer's size depends only on its attention kind and
    whether it is an MoE layer, so each kind is laid out once: milliseconds for the full K3.1 model (half a million
    tensors). ``global + sum(per_layer[:N])`` is what ``layers=N`` writes."""

    def size(specs: list[TensorSpec]) -> int:
        return sum(s.numel * numpy_dtype(s.dtype).itemsize + _HEADER_BYTES_PER_TENSOR for s in specs)

    glob = size(stored_layout(config, []))
    kinds: dict[tuple[str, bool], int] = {}
    per_layer = []
    for i in range(config.num_hidden_layers):
        key = (config.layer_type(i), config.is_moe_layer(i))
        if key not in kinds:
            kinds[key] = size(stored_layout(config, [i])) - glob
        per_layer.append(kinds[key])
    return glob, per_layer


def checkpoint_nbytes(config: KimiConfig, layers: int | None = None) -> int:
    """About the bytes ``init_checkpoint(path, config, layers=layers)`` writes (:func:`layer_nbytes`: tensor data
    plus a bound on the headers), for a free-space check before writing."""
    glob, per_layer = layer_nbytes(config)
    return glob + sum(per_layer[: config.num_hidden_layers if layers is None else int(layers)])


def init_checkpoint(
    path: str | os.PathLike,
    config: KimiConfig,
    seed: int = 0,
    layers: int | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    *,
    force: bool = False,
    on_bytes: Callable[[int], None] | None = None,
) -> KimiConfig:
    """Write a random checkpoint in the real layout (atomic, as :func:`kimi.checkpoint.write_checkpoint`).

    Tensors are generated and written one at a time (at most one canonical tensor and its stored form in memory),
    so big configs do not need the whole model in RAM.

    Args:
        layers: ``None`` for all layers, or N: the checkpoint holds ``config.truncated(N)`` and the same first-N-layer
            weights as the full model (the residual scale still uses the full layer count).
        force: replace a checkpoint already in ``path`` (``kimi init --force``); without it one is refused.
        on_bytes: called with each stored tensor's data size in bytes as it is written (a progress bar's
            ``update``; the sizes add up to the data part of :func:`checkpoint_nbytes`).

    Returns:
        The config written to ``config.json``.

    Raises:
        FileExistsError: ``path`` already holds a checkpoint (``config.json``, ``model*.safetensors`` or the index;
            named) and ``force`` is false: its weights, trained perhaps, would be replaced by random ones.
    """
    existing = _checkpoint_files(Path(path))
    if existing and not force:
        raise FileExistsError(
            f"{path}: already holds a checkpoint ({', '.join(existing[:3])}{', ...' if len(existing) > 3 else ''}); "
            "init_checkpoint would replace its weights with random ones: choose another path, or pass force=True "
            "(kimi init --force)"
        )
    out_cfg = config if layers is None else config.truncated(int(layers))
    canon = {s.name: s for s in param_layout(out_cfg)}

    def canonical_name(stored_name: str) -> str:
        for suf in (".weight_packed", ".weight_scale"):
            if stored_name.endswith(suf) and ".experts." in stored_name:
                return stored_name.removesuffix(suf) + ".weight"
        return stored_name

    # Stored tensors are drawn and encoded (MXFP4 for the routed experts) ahead of the writer by a few threads
    # (numpy's generators and ufuncs release the GIL), so the writer only writes. Each tensor has its own generator,
    # so the bytes do not depend on the thread count; the look-ahead window bounds memory to about ``2 * workers``
    # canonical tensors.
    specs = stored_layout(out_cfg)
    order = list(dict.fromkeys(canonical_name(s.name) for s in specs))
    workers = max(1, min(8, os.cpu_count() or 1))
    pending: dict[str, Future] = {}
    nxt = [0]

    def refill(pool: ThreadPoolExecutor) -> None:
        while nxt[0] < len(order) and len(pending) < 2 * workers:
            cn = order[nxt[0]]
            pending[cn] = pool.submit(_init_stored, canon[cn], config, out_cfg, seed)
            nxt[0] += 1

    with ThreadPoolExecutor(max_workers=workers) as pool:
        current: dict[str, np.ndarray] = {}  # packed and scale of one expert are adjacent in the layout

        def produce(spec: TensorSpec) -> np.ndarray:
            if spec.name not in current:
                refill(pool)
                current.clear()
                current.update(pending.pop(canonical_name(spec.name)).result())
                refill(pool)
            t = current.pop(spec.name)
            if on_bytes is not None:
                on_bytes(int(t.nbytes))
            return t

        try:
            write_stream(path, specs, produce, out_cfg, max_shard_bytes)
        except BaseException:  # an error or a signal: do not draw the tensors still queued before unwinding
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return out_cfg
