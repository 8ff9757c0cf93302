"""Checkpoint I/O in the real K3 / Kimi-Linear layout (spec section 6): lazy sharded reads, validated loads,
atomic writes.

A checkpoint is a directory holding ``config.json`` and either one ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {key: file}}``), the Hugging
Face convention. Keys on disk carry ``config.key_prefix`` (``language_model.`` for K3, ``""`` for Kimi-Linear);
names in this module never do. Vision keys (``vision_tower.*``, ``mm_projector.*``) are ignored.

Framework: the work is done in numpy (bf16 as ``ml_dtypes.bfloat16``, MXFP4 decoded by :mod:`kimi.mxfp4`), so the
JAX reference reads checkpoints without torch (:func:`load_arrays`, :meth:`CheckpointReader.get_array`); torch is
imported only by the functions that return torch tensors (:func:`load_params`, :meth:`CheckpointReader.get`) or when
torch tensors are handed in. Both give the same bits.

* :class:`CheckpointReader` opens a directory; shapes and dtypes come from the safetensors headers (through
  ``safetensors.safe_open``, no tensor data read), tensors are read one at a time, opening only the shard that holds
  them.
* :func:`load_params` (torch tensors) and :func:`load_arrays` (numpy arrays) return the **canonical** parameters
  (:func:`kimi.layout.param_layout`) of the requested layers plus the global tensors, after checking every stored
  tensor of those layers against :func:`kimi.layout.stored_layout` and reporting all problems in one
  :class:`CheckpointError`. Accepted storage variants (spec 2.1; exporters differ, so every form that names the
  same tensor loads): conv weights ``[C, W]``; ``A_log`` as ``[a_log_storage]`` (K3, sliced to ``[:H]``),
  ``[1, 1, H, 1]`` (Kimi-Linear) or ``[H]``; a DSA layer without ``indexer.k_norm.bias`` (zeros, spec 9).
  MXFP4 experts are dequantised to ``experts.{E}.w{1,2,3}.weight`` in the config dtype.
* :func:`to_stored` is the inverse; :func:`write_checkpoint` writes atomically (temporary names, fsync,
  ``os.replace``; the index is written last and is the commit point); :func:`save_params` = both. All three take
  torch tensors or numpy arrays.

``layers`` arguments everywhere: ``None`` (all layers), an int ``N`` (the first N layers) or an iterable of 0-based
layer indices.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
from safetensors import safe_open

from kimi.arrays import dtype_name, is_array, is_torch_tensor, numpy_dtype, to_numpy, to_torch
from kimi.config import KimiConfig
from kimi.layout import TensorSpec, layer_of, param_layout, stored_layout
from kimi.mxfp4 import dequantize_mxfp4, quantize_mxfp4

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "DiskFullError",
    "is_disk_full",
    "load_params",
    "nonfinite_tensors",
    "load_arrays",
    "iter_arrays",
    "check_checkpoint",
    "read_canonical_block",
    "slice_A_log",
    "pad_A_log",
    "to_stored",
    "write_checkpoint",
    "write_atomic",
    "check_replaceable",
    "save_params",
    "normalise_layers",
    "stored_items",
    "write_stream",
    "plan_files",
    "fsync_dir",
    "tmp_name",
    "write_tensor_data",
    "index_bytes",
    "config_bytes",
    "shard_header",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_NAME",
    "SINGLE_NAME",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default "5GB"
_VISION_PREFIXES = ("vision_tower.", "mm_projector.")
_MAX_LISTED = 200  # problems spelled out in one error message; all of them stay in CheckpointError.problems

# safetensors dtype codes <-> dtype names (the names TensorSpec uses; torch's and numpy/ml_dtypes' names alike).
_ST_TO_TORCH = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_TORCH_TO_ST = {v: k for k, v in _ST_TO_TORCH.items()}


class CheckpointError(ValueError):
    """A checkpoint directory or tensor dict does not match the expected layout.

    ``problems`` lists every problem found (one line each, by tensor name, with expected and found shape/dtype);
    the message spells out the first 200.
    """

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems or [])


class DiskFullError(OSError):
    """A write that failed because the file system is full (``ENOSPC``, or ``EDQUOT``: the user's quota): one line
    naming the path being written and saying so, instead of a bare ``[Errno 28]``. An ``OSError`` (``errno`` kept,
    ``filename`` the path), so callers that handle ``OSError`` keep working."""

    def __init__(self, path: str | os.PathLike, code: int = errno.ENOSPC, what: str = "writing"):
        super().__init__(code, os.strerror(code), str(path))
        self.what = what

    def __str__(self) -> str:
        try:
            n = _free_bytes(Path(self.filename))
            free = f" ({n / 2**30:.1f} GiB free there now)" if n >= 2**30 else f" ({n / 2**20:.1f} MiB free there now)"
        except OSError:
            free = ""
        return (
            f"{self.what} {self.filename} failed: the disk is full ({self.strerror}){free}; nothing was left "
            "half-written: free some space (or write somewhere else) and run the command again"
        )


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (its nearest existing parent)."""
    import shutil

    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# What a short write looks like once torch's zip writer (``torch.save``, DCP's shards) has swallowed the OSError.
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "unexpected pos")


def is_disk_full(exc: BaseException | None) -> int | None:
    """The errno (``ENOSPC`` / ``EDQUOT``) when ``exc`` (or an exception it was raised from, or, for a DCP
    ``CheckpointException``, one of its ranks' failures) says the disk is full; else None. torch's zip writer
    reports a short write as ``RuntimeError: ... unexpected pos``, which counts as ``ENOSPC``."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS:
            return e.errno
        if isinstance(e, (OSError, RuntimeError)) and any(t in str(e) for t in _DISK_FULL_TEXT):
            return errno.EDQUOT if "quota" in str(e) else errno.ENOSPC
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException: rank -> error
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


def _fmt(shape: Iterable[int], dtype: str) -> str:
    return f"{list(shape)} {dtype}"


def normalise_layers(cfg: KimiConfig, layers: int | Iterable[int] | None) -> list[int]:
    """The sorted 0-based layer indices a ``layers`` argument names (the module docstring's convention): ``None``
    -> all ``num_hidden_layers``, an int ``N`` -> the first N, an iterable -> its distinct indices, sorted.

    Raises:
        TypeError: a bool (``True`` is an int in Python, but never a layer count here).
        ValueError: a count outside ``[1, num_hidden_layers]`` or an index outside ``[0, num_hidden_layers)``.
    """
    n = cfg.num_hidden_layers
    if layers is None:
        return list(range(n))
    if isinstance(layers, bool):
        raise TypeError(f"layers: got {layers!r}, expected None, an int or an iterable of layer indices")
    if isinstance(layers, int):
        if not 1 <= layers <= n:
            raise ValueError(f"layers: got {layers}, expected a layer count in [1, {n}] (num_hidden_layers)")
        return list(range(layers))
    idx = sorted({int(i) for i in layers})
    bad = [i for i in idx if not 0 <= i < n]
    if bad:
        raise ValueError(f"layers: got indices {bad}, expected 0-based indices in [0, {n})")
    return idx


def _safe_layer_of(name: str) -> int | None:
    """layer_of(), but a malformed ``model.layers.x.…`` name counts as a global (then reported as unexpected)."""
    try:
        return layer_of(name)
    except ValueError:
        return None


def _raise_problems(what: str, problems: list[str]) -> None:
    if not problems:
        return
    shown = problems[:_MAX_LISTED]
    more = len(problems) - len(shown)
    tail = f"\n  ... and {more} more (see CheckpointError.problems)" if more else ""
    raise CheckpointError(f"{what}: {len(problems)} problem(s):\n  " + "\n  ".join(shown) + tail, problems)


# ---------------------------------------------------------------------------------------------- safetensors header


# What safetensors' header errors mean for a shard, in the words of this module's messages (first match wins).
_HEADER_ERRORS = (
    ("header too small", "not a safetensors file (shorter than the 8-byte header length)"),
    ("invalid header length", "not a safetensors file (its header length points past the end of the file)"),
    (
        "incomplete metadata",
        "cannot read tensor data: the file's length does not match its header (a truncated or damaged shard)",
    ),
)


def _read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """A safetensors header as ``{key: (shape, dtype name)}`` through ``safetensors.safe_open`` (its ``keys()`` and
    ``get_slice(key).get_shape()`` / ``get_dtype()``); no tensor data is read. The ``__metadata__`` entry
    (``metadata()``) holds free-form strings and is not needed here.

    Raises:
        CheckpointError: the file is missing, or safetensors refuses it (too short, a header length past the end,
            a header that is not valid UTF-8 JSON of tensor entries, an unknown dtype, or data that does not cover
            exactly what the header lists, i.e. a truncated or damaged shard), with safetensors' reason.
    """
    try:
        with safe_open(str(path), framework="numpy") as f:
            out = {}
            for key in f.keys():
                info = f.get_slice(key)
                code = info.get_dtype()
                out[key] = (tuple(int(d) for d in info.get_shape()), _ST_TO_TORCH.get(code, f"unknown dtype {code}"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard file missing") from None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError for every damaged header
        reason = str(e)
        what = next((w for k, w in _HEADER_ERRORS if k in reason), "not a safetensors file (bad header)")
        raise CheckpointError(f"{path}: {what}; safetensors says: {reason}") from None
    return out


# ---------------------------------------------------------------------------------------------- reader


class CheckpointReader:
    """Lazy reader of a checkpoint directory (``config.json`` + ``model.safetensors`` or an index and shards).

    Attributes:
        path: the directory.
        config: :class:`KimiConfig` from ``config.json``.
        read_names: names (without prefix) whose data was read by :meth:`get` / :meth:`get_slice_array`, in a set
            (proves laziness).
        bytes_read: bytes of tensor data this reader has returned (:meth:`get_array` counts whole tensors,
            :meth:`get_slice_array` only the sub-block), an int a caller may reset; what a sharded load reads.
        unprefixed: disk keys that lack ``config.key_prefix`` and are not vision keys (reported as unexpected by
            :func:`load_params`).

    Raises (constructor):
        CheckpointError: not a directory, no ``config.json``, neither an index nor ``model.safetensors``, or an
            index without a ``weight_map`` object. A shard that the index names but that is absent is reported
            when one of its tensors is first needed (so a partial download can still serve the layers it holds);
            :attr:`missing_files` lists such shards up front.
        kimi.config.ConfigError: an invalid ``config.json``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a checkpoint directory (no such directory)")
        if not (self.path / CONFIG_NAME).is_file():
            raise CheckpointError(f"{self.path}: not a checkpoint directory (no {CONFIG_NAME})")
        self.config = KimiConfig.from_json(self.path / CONFIG_NAME)
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                data = json.loads(index.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{index}: not valid JSON ({e})") from None
            wm = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise CheckpointError(f"{index}: expected an object with a 'weight_map' of key -> shard file name")
            weight_map = dict(wm)
        elif (self.path / SINGLE_NAME).is_file():
            weight_map = dict.fromkeys(_read_header(self.path / SINGLE_NAME), SINGLE_NAME)
        else:
            raise CheckpointError(f"{self.path}: not a checkpoint directory (neither {INDEX_NAME} nor {SINGLE_NAME})")
        prefix = self.config.key_prefix
        self._where: dict[str, tuple[str, str]] = {}  # name -> (file, disk key)
        self.unprefixed: list[str] = []
        for key, file in weight_map.items():
            if key.startswith(_VISION_PREFIXES):
                continue
            if not key.startswith(prefix):
                self.unprefixed.append(key)
                continue
            self._where[key[len(prefix) :]] = (file, key)
        self.read_names: set[str] = set()
        self.bytes_read = 0
        self._headers: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
        self._handles: dict[str, object] = {}

    # -- listing and metadata ------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Stored tensor names without the key prefix (vision tensors and unprefixed keys left out)."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    @property
    def files(self) -> list[str]:
        """Shard file names referenced (sorted)."""
        return sorted({f for f, _ in self._where.values()})

    @property
    def missing_files(self) -> list[str]:
        """Shard files referenced by the index that do not exist in the directory."""
        return [f for f in self.files if not (self.path / f).is_file()]

    def file_of(self, name: str) -> str:
        """The shard file holding ``name``. Raises CheckpointError for an unknown name."""
        try:
            return self._where[name][0]
        except KeyError:
            raise CheckpointError(
                f"{self.path}: no tensor named {name!r} (prefix {self.config.key_prefix!r} is added on disk)"
            ) from None

    def _header(self, file: str) -> dict[str, tuple[tuple[int, ...], str]]:
        if file not in self._headers:
            p = self.path / file
            if not p.is_file():
                raise CheckpointError(f"{self.path}: shard {file!r} named in {INDEX_NAME} is missing")
            self._headers[file] = _read_header(p)
        return self._headers[file]

    def _meta(self, name: str) -> tuple[tuple[int, ...], str]:
        file = self.file_of(name)
        key = self._where[name][1]
        hdr = self._header(file)
        if key not in hdr:
            raise CheckpointError(f"{self.path / file}: tensor {key!r} listed in the index is not in this shard")
        return hdr[key]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` from the safetensors header (no data read)."""
        return self._meta(name)[0]

    def dtype(self, name: str) -> str:
        """Dtype name (``"bfloat16"``, ``"uint8"``, …) of ``name`` from the header (no data read)."""
        return self._meta(name)[1]

    # -- data ----------------------------------------------------------------------------------------------
    def get(self, name: str) -> Any:
        """Read one tensor as a CPU ``torch.Tensor`` (stored dtype and shape); see :meth:`get_array`.

        Raises:
            CheckpointError: unknown name, missing shard, or the shard lacks the key.
        """
        return to_torch(self.get_array(name))

    def get_array(self, name: str) -> np.ndarray:
        """Read one tensor as a numpy array (stored dtype and shape; bf16 as ``ml_dtypes.bfloat16``), opening only
        its shard (handles are cached). No torch involved.

        Raises:
            CheckpointError: unknown name, missing shard, or the shard lacks the key.
        """
        self._meta(name)  # validates name, shard and key with clear errors
        file, key = self._where[name]
        try:
            h = self._handles.get(file)
            if h is None:
                h = self._handles[file] = safe_open(str(self.path / file), framework="numpy")
            t = h.get_tensor(key)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise self._unreadable(file, name, e) from None
        self.read_names.add(name)
        self.bytes_read += t.nbytes
        return t

    def _unreadable(self, file: str, name: str, e: Exception) -> CheckpointError:
        """The error of a tensor that safetensors could not read from ``file`` (a truncated or damaged shard)."""
        return CheckpointError(
            f"{self.path / file}: cannot read tensor {name} ({type(e).__name__}: {e}); "
            f"expected a complete safetensors file (truncated or damaged shard?)"
        )

    def get_slice_array(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Read the sub-block ``t[index]`` of one stored tensor (stored dtype; ``index`` one ``slice(start, stop)``
        per leading dimension, step 1, missing trailing dimensions whole) through safetensors' lazy
        ``safe_open(...).get_slice``: only the block's bytes are copied out of the file. The shard is opened for this
        read alone (not cached as :meth:`get_array` does), so the file pages the read touched leave the process's
        resident set when it returns: a sharded load holds its own shard plus the block in flight, not every page it
        has read. Counts the block's bytes in :attr:`bytes_read`.

        Raises:
            CheckpointError: unknown name, missing shard, the shard lacks the key, an index that is not step-1
                slices inside the stored shape, or an unreadable file.
        """
        shape, _ = self._meta(name)
        file, key = self._where[name]
        index = tuple(index)
        if len(index) > len(shape) or any(
            not isinstance(sl, slice) or sl.step not in (None, 1) or not 0 <= (sl.start or 0) <= (sl.stop or 0) <= n
            for sl, n in zip(index, shape)
        ):
            raise CheckpointError(
                f"{self.path / file}: {name}: slice {index} is not a block of step-1 slices inside the stored shape "
                f"{list(shape)}"
            )
        try:
            with safe_open(str(self.path / file), framework="numpy") as h:
                t = h.get_slice(key)[index] if index else h.get_tensor(key)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise self._unreadable(file, name, e) from None
        self.read_names.add(name)
        self.bytes_read += t.nbytes
        return t

    def close(self) -> None:
        """Drop the cached shard handles."""
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, {len(self._where)} tensors in {len(self.files)} file(s))"


# ---------------------------------------------------------------------------------------------- variants


def _accepted_variant(spec: TensorSpec, shape: tuple[int, ...], cfg: KimiConfig) -> bool:
    """True when ``shape`` is an accepted storage variant of ``spec`` (same dtype still required)."""
    n = spec.name
    if n.endswith(("_conv1d.weight",)) and len(spec.shape) == 3 and spec.shape[1] == 1:
        return shape == (spec.shape[0], spec.shape[2])  # [C, W]: some exporters squeeze the axis; vLLM accepts it too
    if n.endswith(".self_attn.A_log"):
        H = cfg.kda_num_heads
        return shape in ((cfg.a_log_storage,), (1, 1, H, 1), (H,))  # K3 padded, Kimi-Linear 4-D, plain (spec 2.1)
    return False


def _optional(spec: TensorSpec) -> bool:
    """Stored tensors that may be absent (filled on load): the indexer LayerNorm bias (spec 9)."""
    return spec.name.endswith(".indexer.k_norm.bias")


def _check_stored_meta(
    expected: list[TensorSpec],
    found: Mapping[str, tuple[tuple[int, ...], str]],
    cfg: KimiConfig | None,
    extra: Iterable[str] = (),
) -> list[str]:
    """Compare found ``{name: (shape, dtype)}`` with ``expected``; every problem as one line.

    ``cfg`` given: reading (variants and optional tensors accepted); ``None``: writing (exact layout only).
    """
    problems = []
    exp = {s.name: s for s in expected}
    for s in expected:
        if s.name not in found:
            if cfg is not None and _optional(s):
                continue
            problems.append(f"missing: {s.name} (expected {_fmt(s.shape, s.dtype)})")
            continue
        shape, dtype = found[s.name]
        shape_ok = shape == s.shape or (cfg is not None and _accepted_variant(s, shape, cfg))
        dtype_ok = dtype == s.dtype
        if not shape_ok and not dtype_ok:
            problems.append(
                f"wrong shape and dtype: {s.name} (expected {_fmt(s.shape, s.dtype)}, found {_fmt(shape, dtype)})"
            )
        elif not shape_ok:
            problems.append(f"wrong shape: {s.name} (expected {_fmt(s.shape, s.dtype)}, found {_fmt(shape, dtype)})")
        elif not dtype_ok:
            problems.append(f"wrong dtype: {s.name} (expected {_fmt(s.shape, s.dtype)}, found {_fmt(shape, dtype)})")
    for name in found:
        if name not in exp:
            shape, dtype = found[name]
            problems.append(f"unexpected: {name} (found {_fmt(shape, dtype)})")
    problems.extend(extra)
    return problems


# ---------------------------------------------------------------------------------------------- load


def load_params(
    source: str | os.PathLike | CheckpointReader,
    config: KimiConfig | None = None,
    layers: int | Iterable[int] | None = None,
    *,
    check_finite: bool = True,
) -> dict[str, Any]:
    """Canonical parameters as CPU ``torch.Tensor``s: :func:`load_arrays` (same arguments, checks and errors,
    including ``check_finite``), each array handed to torch without a copy (bf16 bit for bit)."""
    return {n: to_torch(a) for n, a in load_arrays(source, config, layers, check_finite=check_finite).items()}


def load_arrays(
    source: str | os.PathLike | CheckpointReader,
    config: KimiConfig | None = None,
    layers: int | Iterable[int] | None = None,
    *,
    check_finite: bool = True,
) -> dict[str, np.ndarray]:
    """Canonical parameters of the requested layers plus all global tensors, validated first, as numpy arrays
    (bf16 as ``ml_dtypes.bfloat16``); no torch involved (the JAX reference loads through this).

    Args:
        source: a checkpoint directory or an open :class:`CheckpointReader`.
        config: the layout to expect; default the checkpoint's own ``config.json``. A truncated config
            (``config.truncated(N)``) reads the first N layers of a bigger checkpoint.
        layers: ``None`` (all), an int N (first N) or 0-based indices. Only these layers' tensors are read.
        check_finite: refuse tensors holding NaN or +-inf (:func:`nonfinite_tensors`, after dequantisation). One
            extra pass over the weights; ``False`` skips it for speed on trusted checkpoints.

    Returns:
        ``{name: tensor}`` with exactly the names, shapes and dtypes of ``param_layout(config, layers)``: MXFP4
        experts dequantised to ``config.dtype``, ``A_log`` ``[H]`` fp32, conv weights ``[C, 1, W]``,
        ``indexer.k_norm.bias`` zeros when absent.

    Raises:
        CheckpointError: every missing, unexpected, misshaped or wrongly typed tensor of the requested layers and the
            globals, all in one error (nothing is read before this check), or a missing shard file; with
            ``check_finite``, every tensor holding NaN or inf, by name with counts (all in one error).
    """
    reader = source if isinstance(source, CheckpointReader) else CheckpointReader(source)
    cfg = reader.config if config is None else config
    out = dict(iter_arrays(reader, cfg, layers, check_finite=check_finite))
    _check_params(out, cfg, normalise_layers(cfg, layers), what="load_params result")  # internal consistency
    return out


def check_checkpoint(reader: CheckpointReader, cfg: KimiConfig, layers: int | Iterable[int] | None = None) -> None:
    """Check the stored tensors of ``layers`` (the module docstring's convention) and the globals against
    ``stored_layout(cfg, layers)`` from the safetensors headers alone (no tensor data read): what :func:`iter_arrays`
    and ``kernels_torch.parallel.load.load_sharded`` check before reading.

    Raises:
        CheckpointError: every missing, unexpected, misshaped or wrongly typed tensor, all in one error (by name,
            with the expected and found shape and dtype), or shard files the index names that are absent.
    """
    idx = normalise_layers(cfg, layers)
    wanted = set(idx)
    expected = stored_layout(cfg, idx)

    # Which stored names belong to this request: globals always, and layers past the checkpoint's own
    # num_hidden_layers always (stray tensors: its config.json and its tensors disagree), whatever config the
    # caller passes; a truncated config legitimately leaves the checkpoint's later layers unread.
    names = []
    extra = [f"unexpected: {k} (key lacks the prefix {cfg.key_prefix!r})" for k in reader.unprefixed]
    for name in reader.keys():
        li = _safe_layer_of(name)
        if li is None or li in wanted or not 0 <= li < reader.config.num_hidden_layers:
            names.append(name)
    need_files = sorted({f for f in (reader.file_of(n) for n in names) if not (reader.path / f).is_file()})
    if need_files:
        raise CheckpointError(
            f"{reader.path}: shard file(s) named in {INDEX_NAME} are missing: {need_files}",
            [f"missing shard: {f}" for f in need_files],
        )
    found = {n: (reader.shape(n), reader.dtype(n)) for n in names}
    where = f"{reader.path} (layers {idx if len(idx) < 20 else f'{idx[0]}..{idx[-1]}'} + globals)"
    _raise_problems(where, _check_stored_meta(expected, found, cfg, extra))


def iter_arrays(
    source: str | os.PathLike | CheckpointReader,
    config: KimiConfig | None = None,
    layers: int | Iterable[int] | None = None,
    *,
    check_finite: bool = True,
) -> Iterator[tuple[str, np.ndarray]]:
    """:func:`load_arrays` one tensor at a time: ``(name, array)`` in ``param_layout(config, layers)`` order, each
    read (and dequantised) just before it is yielded, so a consumer that copies each array into its place and drops
    it holds at most one tensor of the checkpoint at a time, plus up to ``2 x min(8, cpu_count)`` MXFP4 experts that
    threads decode ahead (``kernels_torch.model.load_model`` streams a layer's routed experts into their stacked
    parameters this way). Same arguments and checks as :func:`load_arrays`.

    Raises:
        CheckpointError: the layout problems of :func:`load_arrays` before the first tensor is yielded (a generator:
            at the first ``next``); with ``check_finite``, the non-finite tensors after the last one.
    """
    reader = source if isinstance(source, CheckpointReader) else CheckpointReader(source)
    cfg = reader.config if config is None else config
    idx = normalise_layers(cfg, layers)
    check_checkpoint(reader, cfg, idx)

    def read(spec: TensorSpec) -> tuple[np.ndarray, list[str]]:
        a = _read_canonical(reader, cfg, spec)
        return a, nonfinite_tensors({spec.name: a}) if check_finite else []

    # MXFP4 experts are read and decoded ahead by a few threads (numpy releases the GIL), in a window of
    # 2 x workers experts: a real layer's hundreds of experts would take minutes one by one. Other tensors are read
    # when reached, so the look-ahead holds at most the window's experts beside the tensor being yielded.
    specs = param_layout(cfg, idx)
    ahead = [i for i, s in enumerate(specs) if ".experts." in s.name and cfg.quant_method == "mxfp4"]
    workers = max(1, min(8, os.cpu_count() or 1)) if len(ahead) > 1 else 0
    nonfinite: list[str] = []
    pending: dict[int, Future] = {}
    pool = ThreadPoolExecutor(max_workers=workers) if workers else None
    try:
        nxt = 0
        for i, spec in enumerate(specs):
            while pool is not None and nxt < len(ahead) and len(pending) < 2 * workers:
                pending[ahead[nxt]] = pool.submit(read, specs[ahead[nxt]])
                nxt += 1
            a, bad = pending.pop(i).result() if i in pending else read(spec)
            nonfinite += bad
            yield spec.name, a
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)  # a consumer that stops early leaves no reads running
    if nonfinite:
        where = f"{reader.path}: non-finite weights (load_params(..., check_finite=False) skips this check)"
        _raise_problems(where, nonfinite)


def _read_canonical(reader: CheckpointReader, cfg: KimiConfig, spec: TensorSpec) -> np.ndarray:
    """One canonical parameter from its stored tensor(s): MXFP4 experts dequantised, ``A_log`` sliced (a copy),
    conv weights reshaped to ``[C, 1, W]``, an absent optional tensor as zeros (spec 9)."""
    n = spec.name
    if ".experts." in n and cfg.quant_method == "mxfp4":
        base = n.removesuffix(".weight")
        try:
            return dequantize_mxfp4(
                reader.get_array(base + ".weight_packed"),
                reader.get_array(base + ".weight_scale"),
                dtype=cfg.dtype,
                group_size=cfg.quant_group_size,
            )
        except ValueError as e:
            raise CheckpointError(f"{reader.path}: {base}.weight_scale / .weight_packed: {e}") from None
    if n.endswith(".self_attn.A_log"):
        try:
            return slice_A_log(reader.get_array(n), cfg.kda_num_heads).copy()
        except ValueError as e:
            raise CheckpointError(f"{reader.path}: {n}: {e}") from None
    if n.endswith("_conv1d.weight"):
        return reader.get_array(n).reshape(spec.shape)  # [C, W] -> [C, 1, W]
    if _optional(spec) and n not in reader:
        return np.zeros(spec.shape, dtype=numpy_dtype(spec.dtype))  # spec 9: absent bias = 0
    return reader.get_array(n)


def read_canonical_block(
    reader: CheckpointReader, cfg: KimiConfig, spec: TensorSpec, block: tuple[tuple[int, int], ...]
) -> np.ndarray:
    """The block ``[start, stop)`` per dimension of one canonical parameter (``spec`` from
    ``kimi.layout.param_layout(cfg)``), reading from the files only what the block needs: the stored tensor's
    sub-block through :meth:`CheckpointReader.get_slice_array`. MXFP4 experts decode only the block's rows and the
    scale groups its columns touch (a column range is widened to whole 32-column groups for the read, then cut);
    ``A_log`` is read whole (its zero padding is checked, spec 2.1; a few hundred bytes) and sliced; conv weights
    stored ``[C, W]`` are read as the ``[C, 1, W]`` block; an absent ``indexer.k_norm.bias`` gives zeros (spec 9).
    Same dtypes as :func:`iter_arrays` (experts decoded to ``cfg.dtype``). The layout is assumed checked
    (:func:`check_checkpoint`).

    Raises:
        CheckpointError: a block outside ``spec.shape``, an unreadable shard, a bad MXFP4 scale or ``A_log``.
    """
    n = spec.name
    block = tuple((int(a), int(b)) for a, b in block)
    if len(block) != len(spec.shape) or any(not 0 <= a <= b <= d for (a, b), d in zip(block, spec.shape)):
        raise CheckpointError(f"{reader.path}: {n}: block {list(block)} is not inside its shape {list(spec.shape)}")
    sl = tuple(slice(a, b) for a, b in block)
    if ".experts." in n and cfg.quant_method == "mxfp4":
        (r0, r1), (c0, c1) = block
        g = cfg.quant_group_size
        g0, g1 = c0 // g, -(-c1 // g)  # the scale groups the columns touch
        base = n.removesuffix(".weight")
        try:
            w = dequantize_mxfp4(
                reader.get_slice_array(base + ".weight_packed", (slice(r0, r1), slice(g0 * g // 2, g1 * g // 2))),
                reader.get_slice_array(base + ".weight_scale", (slice(r0, r1), slice(g0, g1))),
                dtype=cfg.dtype,
                group_size=g,
            )
        except ValueError as e:
            raise CheckpointError(f"{reader.path}: {base}.weight_scale / .weight_packed: {e}") from None
        return w[:, c0 - g0 * g : c1 - g0 * g] if (c0, c1) != (g0 * g, g1 * g) else w
    if n.endswith(".self_attn.A_log"):
        try:
            return slice_A_log(reader.get_array(n), cfg.kda_num_heads)[sl].copy()
        except ValueError as e:
            raise CheckpointError(f"{reader.path}: {n}: {e}") from None
    if _optional(spec) and n not in reader:
        return np.zeros([b - a for a, b in block], dtype=numpy_dtype(spec.dtype))  # spec 9: absent bias = 0
    stored = reader.shape(n)
    if n.endswith("_conv1d.weight") and len(stored) == 2:  # stored [C, W]: the [C, 1, W] block without its axis 1
        return reader.get_slice_array(n, (sl[0], sl[2]))[:, None, :]
    return reader.get_slice_array(n, sl)


def nonfinite_tensors(params: Mapping[str, Any]) -> list[str]:
    """One line per floating tensor (numpy array, bf16 included, or torch tensor) of ``params`` that holds NaN or
    +-inf: ``"non-finite: {name}: {n_nan} NaN, {n_inf} inf of {numel} values"`` (in ``params``' order; empty when
    every value is finite). Integer tensors are skipped. One pass over each tensor (two more over the few that fail)."""
    problems = []
    for name, t in params.items():
        if hasattr(t, "is_floating_point") and hasattr(t, "detach"):  # a torch tensor (no torch import here)
            if not t.is_floating_point():
                continue
            a = t.detach().float().cpu().numpy()  # fp32 holds bf16/fp16 exactly; NaN/inf survive
        else:
            a = np.asarray(t)
            if a.dtype.kind not in "fV" and a.dtype.name != "bfloat16":
                continue
            if a.dtype.kind != "f":
                a = a.astype(np.float32)  # ml_dtypes bfloat16 -> fp32 (exact)
        if np.isfinite(a).all():
            continue
        problems.append(
            f"non-finite: {name}: {int(np.isnan(a).sum())} NaN, {int(np.isinf(a).sum())} inf of {a.size} values"
        )
    return problems


def _array_meta(
    tensors: Mapping[str, Any],
) -> tuple[dict[str, tuple[tuple[int, ...], str]], list[str]]:
    """``({name: (shape, dtype name)}, problems)`` of numpy arrays / torch tensors; anything else is a problem."""
    found, extra = {}, []
    for n, t in tensors.items():
        if not is_array(t):
            extra.append(f"not a numpy array or torch tensor: {n} (found {type(t).__name__})")
            continue
        found[n] = (tuple(t.shape), dtype_name(t))
    return found, extra


def _check_params(params: Mapping[str, Any], cfg: KimiConfig, idx: list[int], what: str) -> None:
    found, extra = _array_meta(params)
    _raise_problems(what, _check_stored_meta(param_layout(cfg, idx), found, None, extra))


# ---------------------------------------------------------------------------------------------- to stored form


def slice_A_log(A_log: np.ndarray, num_heads: int) -> np.ndarray:
    """Canonical ``A_log`` ``[H]`` (fp32) from the stored one (spec 2.1: each form an exporter writes): K3's zero-padded
    ``[a_log_storage]`` (128 stored, 96 used), Kimi-Linear's ``[1, 1, H, 1]`` or a plain ``[H]``. A view, no copy.

    Raises:
        ValueError: any other shape, or non-zero entries past the ``num_heads`` active ones (96 active + 32 zeros is
            the layout; anything else there means the tensor is not what the config says).
    """
    a = np.asarray(A_log)
    if a.shape != (1, 1, num_heads, 1) and not (a.ndim == 1 and a.shape[0] >= num_heads):
        raise ValueError(
            f"A_log: got shape {list(a.shape)}, expected [{num_heads}], [S >= {num_heads}] zero-padded or "
            f"[1, 1, {num_heads}, 1]"
        )
    a = a.reshape(-1)
    pad = a[num_heads:]
    if (pad != 0).any():
        raise ValueError(
            f"A_log: got {int((pad != 0).sum())} non-zero entries past the {num_heads} active heads, expected zero "
            "padding (spec 2.1)"
        )
    return a[:num_heads]


def pad_A_log(A_log: np.ndarray, shape: Iterable[int]) -> np.ndarray:
    """Stored ``A_log`` of ``shape`` (from :func:`kimi.layout.stored_layout`) from the canonical ``[H]``: zero-padded
    to ``[S]`` (K3: 128 for 96 heads) or reshaped to Kimi-Linear's ``[1, 1, H, 1]``; the inverse of
    :func:`slice_A_log`.

    Raises:
        ValueError: ``A_log`` not 1-D, or a ``shape`` that cannot hold it.
    """
    a = np.asarray(A_log)
    shape = tuple(int(s) for s in shape)
    if a.ndim != 1:
        raise ValueError(f"A_log: got shape {list(a.shape)}, expected the canonical [H]")
    H = a.shape[0]
    if shape == (1, 1, H, 1):
        return np.ascontiguousarray(a.reshape(shape))
    if len(shape) == 1 and shape[0] >= H:
        return np.concatenate([a, np.zeros(shape[0] - H, a.dtype)])
    raise ValueError(f"shape: got {list(shape)}, expected [S >= {H}] or [1, 1, {H}, 1] for A_log [{H}]")


def stored_items(name: str, t: np.ndarray, cfg: KimiConfig) -> Iterator[tuple[str, np.ndarray]]:
    """One canonical parameter -> its stored ``(name, array)`` pair(s), names without the key prefix: routed
    experts as MXFP4 ``weight_packed`` + ``weight_scale`` when ``cfg.quant_method == "mxfp4"``, ``A_log`` ``[H]``
    re-padded to its storage shape, anything else unchanged. ``t`` is a numpy array; so are the results.
    The per-tensor step of :func:`to_stored`, for writers that stream (``kimi.init.init_checkpoint``)."""
    if ".experts." in name and cfg.quant_method == "mxfp4":
        base = name.removesuffix(".weight")
        packed, scale = quantize_mxfp4(t, group_size=cfg.quant_group_size)
        yield base + ".weight_packed", packed
        yield base + ".weight_scale", scale
    elif name.endswith(".self_attn.A_log"):  # re-padded with zeros to a_log_storage, as K3's readers expect (spec 2.1)
        H = cfg.kda_num_heads
        yield name, pad_A_log(t, (1, 1, H, 1) if cfg.is_kimi_linear else (cfg.a_log_storage,))
    else:
        yield name, t


def to_stored(
    params: Mapping[str, Any], config: KimiConfig, layers: int | Iterable[int] | None = None
) -> dict[str, Any]:
    """Canonical params -> the tensors as stored on disk (names without prefix), the inverse of :func:`load_params`.

    ``params`` holds torch tensors or numpy arrays; each stored tensor comes back in the kind of its canonical
    parameter (CPU torch tensors for torch input).

    Experts quantised to MXFP4 when ``config.quant_method == "mxfp4"`` (exact for weights that are a round trip
    of MXFP4, as :func:`kimi.init.init_params` and :func:`load_params` produce); ``A_log`` ``[H]`` re-padded with
    zeros to ``[a_log_storage]`` (K3) or reshaped to ``[1, 1, H, 1]`` (Kimi-Linear).

    Raises:
        CheckpointError: ``params`` does not match ``param_layout(config, layers)`` (all problems at once).
    """
    idx = normalise_layers(config, layers)
    _check_params(params, config, idx, what="to_stored: params")
    out: dict[str, Any] = {}
    for spec in param_layout(config, idx):
        t = params[spec.name]
        for name, a in stored_items(spec.name, to_numpy(t), config):
            out[name] = to_torch(a) if is_torch_tensor(t) else a
    return out


# ---------------------------------------------------------------------------------------------- write


def _config_json(config: KimiConfig) -> dict:
    """``config.raw`` when it still describes ``config`` (so a read config round-trips), else ``to_dict()``."""
    if config.raw is not None:
        try:
            if KimiConfig.from_dict(config.raw) == config:
                return dict(config.raw)
        except ValueError:
            pass
    return config.to_dict()


def _nbytes(spec: TensorSpec) -> int:
    return spec.numel * numpy_dtype(spec.dtype).itemsize


def _plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy shards in layout order (globals, then layer by layer), so one layer spans few files."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        b = _nbytes(s)
        if shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += b
    return shards


def plan_files(specs: list[TensorSpec], max_shard_bytes: int) -> list[tuple[str, list[TensorSpec]]]:
    """The files :func:`write_stream` writes ``specs`` (the stored layout, in order) into: ``[(file name, specs)]``,
    greedy in order up to ``max_shard_bytes`` per file (a larger tensor alone), named ``model.safetensors`` when one
    file, else ``model-{i:05d}-of-{n:05d}.safetensors`` (1-based). A parallel writer that follows the same plan
    (``kernels_torch.parallel.export``) writes the same files byte for byte."""
    shards = _plan_shards(specs, max_shard_bytes)
    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return list(zip(names, shards))


def index_bytes(plan: list[tuple[str, list[TensorSpec]]], prefix: str) -> bytes:
    """The ``model.safetensors.index.json`` of a :func:`plan_files` plan: ``metadata.total_size`` (bytes of tensor
    data) and the ``weight_map`` of prefixed keys to file names, as UTF-8 JSON."""
    index = {
        "metadata": {"total_size": sum(_nbytes(s) for _, g in plan for s in g)},
        "weight_map": {prefix + s.name: fname for fname, g in plan for s in g},
    }
    return (json.dumps(index, indent=2) + "\n").encode()


def config_bytes(config: KimiConfig) -> bytes:
    """The ``config.json`` a writer stores for ``config`` (``config.raw`` when it still describes it)."""
    return (json.dumps(_config_json(config), indent=2) + "\n").encode()


def shard_header(specs: list[TensorSpec], prefix: str) -> bytes:
    """The safetensors header (length word and 8-byte-aligned JSON) of a file holding ``specs`` in order, keys
    prefixed with ``prefix``; the tensors' raw bytes follow it in the same order."""
    return _shard_header(specs, prefix)


def _shard_header(specs: list[TensorSpec], prefix: str) -> bytes:
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    off = 0
    for s in specs:
        b = _nbytes(s)
        meta[prefix + s.name] = {"dtype": _TORCH_TO_ST[s.dtype], "shape": list(s.shape), "data_offsets": [off, off + b]}
        off += b
    h = json.dumps(meta, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)  # safetensors pads the header to 8-byte alignment with spaces
    return struct.pack("<Q", len(h)) + h


def _write_tensor_data(f, t: Any) -> None:
    """Append the raw little-endian bytes of ``t`` (a numpy array or torch tensor, C order) to the open file ``f``."""
    flat = np.ascontiguousarray(to_numpy(t)).reshape(-1)
    if flat.size:
        f.write(flat.view(np.uint8).data)


def write_tensor_data(f, t: Any) -> None:
    """Append the raw little-endian bytes of ``t`` (a numpy array or torch tensor, C order) to the open file ``f``:
    a safetensors file's data, after its :func:`shard_header`."""
    _write_tensor_data(f, t)


def fsync_dir(path: Path) -> None:
    """fsync the folder ``path`` (so a rename in it is durable); errors ignored (some filesystems refuse it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def tmp_name(path: Path, final: str) -> Path:
    """A fresh temporary name in folder ``path`` for the file ``final`` (hidden, with the pid and a random tag)."""
    return path / f".{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _not_a_file(path: Path) -> str | None:
    """What ``path`` is when it exists and is not a regular file (a link is followed): ``"a character device"``,
    ``"a folder"``, ...; None when it is absent or a regular file."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if path.is_symlink() else None
    except OSError:
        return None  # unreadable: the write itself reports it
    if stat.S_ISREG(mode):
        return None
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")]  # fmt: skip
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def check_replaceable(path: str | os.PathLike) -> None:
    """Refuse an atomic write (temporary file renamed over ``path``) onto something that is not a regular file.

    A rename replaces whatever entry ``path`` names, so writing ``/dev/full`` or ``/dev/stdout`` this way would
    replace the device node with a regular file (as root: silently) instead of writing to it.

    Raises:
        FileExistsError: ``path`` exists and is a folder, a device, a named pipe, a socket or a broken symbolic link
            (the message names the path and what it is).
    """
    what = _not_a_file(Path(path))
    if what is not None:
        raise FileExistsError(
            f"{path}: exists and is {what}, not a regular file; a file is written by renaming a new one over it, "
            "which would replace it: give the path of a file"
        )


def _write_bytes_tmp(path: Path, final: str, data: bytes) -> Path:
    """``data`` written and fsynced to a fresh temporary file in folder ``path`` (named after ``final``), opened as
    ``open(..., "wb")`` would (mode ``0o666`` less the umask); the caller renames it into place."""
    tmp = tmp_name(path, final)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # e.g. the disk filled up part-way: no temporary file stays behind
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never a part: the project's
    one single-file atomic write (a checkpoint's several files are committed by :func:`write_stream`, the index last).

    The bytes go to a temporary file beside ``path`` created as ``open(path, "wb")`` would (0644 under the usual
    umask 022, where ``tempfile`` and safetensors' own ``save_file`` create 0600 files: serialise to bytes first,
    e.g. ``safetensors.torch.save``), are fsynced, and the file is renamed over ``path`` (``os.replace``, atomic on
    POSIX). The parent folder is created if needed. On an error the temporary file is removed and ``path`` is
    untouched.

    Raises:
        FileExistsError: ``path`` exists and is not a regular file (a device such as ``/dev/full``, a folder, a
            named pipe: :func:`check_replaceable`); nothing is written.
        OSError: the write itself fails (no permission).
        DiskFullError: the disk (or the quota) is full, naming ``path``; the temporary file is removed.
    """
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        tmp = _write_bytes_tmp(path.parent, path.name, data)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        if is_disk_full(e) and not isinstance(e, DiskFullError):
            raise DiskFullError(path, is_disk_full(e)) from e
        raise
    finally:
        if tmp is not None and tmp.exists():
            tmp.unlink()


def write_stream(
    path: str | os.PathLike,
    specs: list[TensorSpec],
    produce: Callable[[TensorSpec], Any],
    config: KimiConfig,
    max_shard_bytes: int,
) -> None:
    """Write the tensors of ``specs`` (in order), each made by ``produce(spec)`` just before it is written: the
    streaming core of :func:`write_checkpoint`, for writers that cannot hold every tensor at once
    (``kimi.init.init_checkpoint``). ``specs`` is the stored layout (names without prefix); ``produce`` returns a
    numpy array or torch tensor of exactly ``spec.shape`` and ``spec.dtype``.

    Every file goes to a temporary name in the target directory and is fsynced; only when all are complete are
    they ``os.replace``d to their final names, shards and ``config.json`` first, the index last (the commit point).
    An exception removes the temporary files and leaves no final-named partial file; an existing index is removed
    just before the replacements so that a stale index never points at a mix of old and new shards.

    Raises:
        ValueError: ``max_shard_bytes`` not a positive int.
        CheckpointError: a produced tensor whose shape or dtype differs from its spec (nothing is committed).
        FileExistsError: one of the final names exists and is not a regular file (:func:`check_replaceable`).
        DiskFullError: the disk (or the quota) filled up, naming the folder; the temporary files are removed, and
            the folder too when this call created it and it is left empty.
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: got {max_shard_bytes!r}, expected a positive integer")
    path = Path(path)
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    prefix = config.key_prefix
    plan = plan_files(specs, max_shard_bytes)
    names = [f for f, _ in plan]
    shards = [g for _, g in plan]
    for fname in (*names, CONFIG_NAME, INDEX_NAME):
        check_replaceable(path / fname)
    tmps: list[tuple[Path, str]] = []
    try:
        for fname, group in zip(names, shards):
            tmp = tmp_name(path, fname)
            tmps.append((tmp, fname))
            with open(tmp, "wb") as f:
                f.write(_shard_header(group, prefix))
                for s in group:
                    t = produce(s)
                    got = (tuple(t.shape), dtype_name(t))
                    if got != (s.shape, s.dtype):
                        raise CheckpointError(f"write: {s.name} expected {_fmt(s.shape, s.dtype)}, found {_fmt(*got)}")
                    _write_tensor_data(f, t)
                f.flush()
                os.fsync(f.fileno())
        tmps.append((_write_bytes_tmp(path, CONFIG_NAME, config_bytes(config)), CONFIG_NAME))
        index_tmp = _write_bytes_tmp(path, INDEX_NAME, index_bytes(plan, prefix))
        tmps.append((index_tmp, INDEX_NAME))
    except BaseException as e:
        for tmp, _ in tmps:
            tmp.unlink(missing_ok=True)
        if created and not any(path.iterdir()):
            path.rmdir()
        code = is_disk_full(e) if isinstance(e, OSError) else None
        if code and not isinstance(e, DiskFullError):
            raise DiskFullError(path, code, what="writing the checkpoint into") from e
        raise
    # Commit: drop any old index (de-commit), move the data files in place, then the index.
    old_files: set[str] = set()
    old_index = path / INDEX_NAME
    if old_index.exists():
        try:
            old_files = set(json.loads(old_index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        except (ValueError, AttributeError):
            pass
        old_index.unlink()
        fsync_dir(path)
    for tmp, fname in tmps[:-1]:
        os.replace(tmp, path / fname)
    fsync_dir(path)
    os.replace(index_tmp, path / INDEX_NAME)
    fsync_dir(path)
    for stale in old_files - set(names):  # shards of an overwritten checkpoint that the new index does not use
        if "/" not in stale and stale.endswith(".safetensors"):
            (path / stale).unlink(missing_ok=True)


def write_checkpoint(
    path: str | os.PathLike,
    stored: Mapping[str, Any],
    config: KimiConfig,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write a checkpoint directory atomically: ``config.json``, shards, ``model.safetensors.index.json``.

    Args:
        path: target directory (created if needed; an existing checkpoint there is replaced).
        stored: ``{name: torch tensor or numpy array}`` exactly as :func:`kimi.layout.stored_layout` ``(config)``
            (names without prefix).
        config: written as ``config.raw`` when that still parses to ``config``, else ``config.to_dict()``.
        max_shard_bytes: shard size limit (a single larger tensor gets a shard of its own). One shard is written
            as ``model.safetensors``; several as ``model-00001-of-0000N.safetensors``. The index (with
            ``metadata.total_size`` in bytes and the ``weight_map`` of prefixed keys) is always written, last.

    Raises:
        CheckpointError: ``stored`` does not match the stored layout (all problems in one error); nothing is written.
    """
    specs = stored_layout(config)
    found, extra = _array_meta(stored)
    _raise_problems(f"write_checkpoint {path}", _check_stored_meta(specs, found, None, extra))
    write_stream(path, specs, lambda s: stored[s.name], config, max_shard_bytes)


def save_params(path: str | os.PathLike, params: Mapping[str, Any], config: KimiConfig, **kw) -> None:
    """``write_checkpoint(path, to_stored(params, config), config, **kw)``: canonical params (torch tensors or numpy
    arrays) to a checkpoint."""
    write_checkpoint(path, to_stored(params, config), config, **kw)
