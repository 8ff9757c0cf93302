"""LoRA on the torch twin, built on ``peft`` itself, and ``kimi lora merge``.

The adapters are peft's own ``LoraLayer`` (``peft.inject_adapter_in_model``): ``lora_A`` ``[r, in]`` and ``lora_B``
``[out, r]`` around an untouched, frozen ``base_layer``, ``y = x Wᵀ + scale * dropout(x) Aᵀ Bᵀ`` with scale
``alpha / r`` (``alpha / sqrt(r)`` under rsLoRA, Kalajdzievski 2023), B starting at zero (Hu et al. 2021, sec. 4.1).
On disk: peft's format, ``adapter_config.json`` + ``adapter_model.safetensors`` with keys
``base_model.model.<module path>.lora_A.weight`` / ``.lora_B.weight``, so ``peft.PeftModel.from_pretrained`` loads
an adapter onto a :class:`kernels_torch.model.KimiK3Model` directly.

Footguns handled here:

* A wrapped layer's ``.weight`` is the base weight alone. MLA's absorbed form (the ``cudnn`` backend's DSA layers,
  and ``mla_form="absorbed"``) uses ``kv_b_proj``'s weight split into W_UK / W_UV instead of calling the layer; it
  reads :func:`kernels_torch.common.effective_weight`, i.e. ``W + scale * B A``. LoRA is never silently skipped
  (vLLM shipped that bug): the tests check that every adapter gets a gradient and changes the output on every path.
* LoRA dropout acts on the layer's input, which the absorbed form never forms: dropout on ``kv_b_proj`` is refused
  under ``cudnn`` (and raises at forward time under ``mla_form="absorbed"`` in training mode). DoRA is refused.
* The DSA indexer is frozen (no LM-loss gradient through hard top-k) and never gets adapters; nor do layers whose
  weight is read directly rather than called (AttnRes ``*_res_proj``, ``lm_head``, the MoE router ``gate``), nor the
  routed experts: they are stacked ``[E, out, in]`` banks run as grouped GEMMs (``kernels_torch.moe.GroupedExperts``),
  not ``nn.Linear`` layers, and in the real checkpoint MXFP4 (a merge would re-quantise them).

The wrapped model's ``state_dict`` keys are peft's (``...q_proj.base_layer.weight``, ``...lora_A.default.weight``);
:func:`merge_lora` folds the adapters in and gives back the canonical names (``kernels_torch.model.save_model``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from kimi_tools.common import ADAPTER_CONFIG  # peft's CONFIG_NAME (what refuse_adapter_folder looks for)

if TYPE_CHECKING:  # torch is imported where it is used: `kimi --help` stays fast
    import torch
    from torch import nn

__all__ = [
    "DEFAULT_TARGETS",
    "LoraSettings",
    "check_lora_supported",
    "resolve_targets",
    "apply_lora",
    "initial_adapters",
    "lora_modules",
    "adapters_without_gradient",
    "save_adapter",
    "base_fingerprint",
    "adapter_base_fingerprint",
    "load_adapter",
    "merge_lora",
    "add_parser",
    "cmd_lora",
]

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's SAFETENSORS_WEIGHTS_NAME
_KEY_PREFIX = "base_model.model."  # peft's PeftModel -> LoraModel -> model path prefix in saved keys
_ADAPTER = "default"  # peft's default adapter name (stripped in the saved keys, as peft does)

# Module-name suffixes (peft's ``target_modules`` list rule). MLA: q_proj (no q-LoRA) or q_a_proj/q_b_proj,
# kv_a_proj_with_mqa, kv_b_proj (absorbed form handled), o_proj. KDA: q_proj, k_proj, v_proj, o_proj.
# Not the gates (g_proj is MLA's output gate in MLA layers and KDA's in KDA layers: one name, two roles), never the
# indexer (wq_b, wk, weights_proj).
DEFAULT_TARGETS: tuple[str, ...] = (
    "q_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "k_proj",
    "v_proj",
    "o_proj",
)

# Linear layers whose weight the model reads directly (never calls): an adapter there would be silently skipped.
_READ_DIRECTLY = re.compile(r"(^|.*\.)(self_attention_res_proj|mlp_res_proj|output_attn_res_proj)$|^lm_head$")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters (peft ``LoraConfig`` names in brackets).

    Args:
        rank: r >= 1 [``r``]. alpha: > 0 [``lora_alpha``]; the update is scaled by alpha / r (alpha / sqrt(r) with
            ``use_rslora``). dropout: in [0, 1) on the adapter's input [``lora_dropout``]. targets: module-name
            patterns [``target_modules``]: a pattern matches a module whose full name equals it or ends with
            ``"." + pattern`` (peft's list rule), or that it matches as a regular expression (``re.fullmatch``).
        use_dora: always refused (kept so that a DoRA request gets a clear error, not a silent LoRA).
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    use_rslora: bool = False
    use_dora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def peft_config(self, names: Sequence[str]):
        """The peft ``LoraConfig`` that wraps exactly the modules ``names``."""
        _import_peft()
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(names),
            use_rslora=self.use_rslora,
            bias="none",
        )


def _import_peft():
    """Import peft (once) with torchao's import noise held back: peft imports transformers, which imports torchao
    when it is installed, and on a CPU (or a torch other than torchao's build) that logs "Failed to load ..._C_*.so"
    and pytree deprecation lines although LoRA uses nothing of torchao
    (:func:`kernels_torch.fp8.quiet_torchao_import`). Raises ImportError when peft is missing."""
    import sys

    if "peft" not in sys.modules:
        from kernels_torch.fp8 import quiet_torchao_import

        with quiet_torchao_import():
            import peft  # noqa: F401


def require_peft() -> None:
    """Raises ImportError with the install line when peft (the ``lora`` extra) is missing."""
    try:
        _import_peft()
        import peft  # noqa: F401
    except ImportError:
        raise ImportError("LoRA needs the peft package: pip install 'kimi-k3[lora]' (or pip install peft)") from None


def _matches(name: str, pattern: str) -> bool:
    if name == pattern or name.endswith("." + pattern):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


def _absorbed_kv_b(settings: LoraSettings) -> bool:
    return any(_matches("model.layers.0.self_attn.kv_b_proj", t) for t in settings.targets)


def check_lora_supported(settings: LoraSettings, backend: str) -> None:
    """Refuse settings the backend cannot honour, before anything is built.

    Raises:
        ValueError: rank < 1, alpha <= 0, dropout outside [0, 1), no targets, an invalid target regex, DoRA, an
            unknown backend, or dropout > 0 with ``kv_b_proj`` targeted under ``cudnn`` (its DSA layers use
            kv_b_proj in absorbed form, where dropout on the layer input cannot be applied).
    """
    from kernels_torch.model import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"backend: got {backend!r}, expected one of {list(BACKENDS)}")
    if isinstance(settings.rank, bool) or not isinstance(settings.rank, int) or settings.rank < 1:
        raise ValueError(f"lora rank: got {settings.rank!r}, expected an integer >= 1")
    if not settings.alpha > 0:
        raise ValueError(f"lora alpha: got {settings.alpha!r}, expected a number > 0")
    if not 0.0 <= settings.dropout < 1.0:
        raise ValueError(f"lora dropout: got {settings.dropout!r}, expected a probability in [0, 1)")
    if isinstance(settings.targets, str) or not settings.targets:
        raise ValueError(f"lora targets: got {settings.targets!r}, expected a non-empty tuple of module-name patterns")
    for t in settings.targets:
        if not isinstance(t, str) or not t:
            raise ValueError(f"lora targets: got {t!r}, expected a module name, suffix or regular expression")
        try:
            re.compile(t)
        except re.error as e:
            raise ValueError(f"lora targets: got {t!r}, not a valid regular expression ({e})") from None
    if settings.use_dora:
        raise ValueError(
            "lora use_dora: DoRA is not supported (its magnitude vector needs the layer input, which MLA's "
            "absorbed kv_b_proj never forms); use plain LoRA"
        )
    if settings.dropout > 0 and backend == "cudnn" and _absorbed_kv_b(settings):
        raise ValueError(
            f"lora dropout: got {settings.dropout} with kv_b_proj among the targets on the cudnn backend, whose DSA "
            "layers use kv_b_proj in absorbed form (W_UK folded into the query, W_UV after attention): dropout on its "
            "input cannot be applied there; use --lora-dropout 0 or leave kv_b_proj out of --lora-targets"
        )


def resolve_targets(model: nn.Module, settings: LoraSettings) -> list[str]:
    """The full names of the modules of ``model`` that ``settings.targets`` select, in module order.

    Raises:
        ValueError: a target matching an indexer module (the indexer is frozen and never gets adapters), a layer
            whose weight is read directly (``*_res_proj``, ``lm_head``: an adapter would be skipped), the routed
            experts (``w1``/``w2``/``w3``, not offered), a module that is not an ``nn.Linear``, a non-default pattern that matches
            nothing, or no module at all.
    """
    from torch import nn

    from kernels_torch.moe import GroupedExperts

    names, hit = [], dict.fromkeys(settings.targets, 0)
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for t in settings.targets:
                named = [f"{name}.{w}" for w in ("w1", "w3", "w2") if _matches(f"{name}.{w}", t)]
                if named or _matches(name, t):
                    raise ValueError(
                        f"lora targets: {t!r} matches the routed experts {(named or [name])[0]!r}: LoRA on routed "
                        "experts is not offered (stacked [E, out, in] banks run as grouped GEMMs, MXFP4 in the real "
                        "checkpoint); target the attention projections or the shared experts instead"
                    )
            continue
        pats = [t for t in settings.targets if _matches(name, t)]
        if not pats:
            continue
        for t in pats:
            hit[t] += 1
        if ".indexer" in f".{name}" or name.startswith("indexer"):
            raise ValueError(
                f"lora targets: {pats[0]!r} matches the DSA indexer module {name!r}; the indexer is frozen (no LM-loss "
                "gradient through hard top-k) and never gets adapters"
            )
        if _READ_DIRECTLY.fullmatch(name):
            raise ValueError(
                f"lora targets: {pats[0]!r} matches {name!r}, whose weight the model reads directly (not called as a "
                "layer): an adapter there would be silently skipped"
            )
        if type(module) is not nn.Linear:
            raise ValueError(
                f"lora targets: {pats[0]!r} matches {name!r} ({type(module).__name__}), expected nn.Linear projections only"
            )
        names.append(name)
    missing = [t for t, n in hit.items() if n == 0 and t not in DEFAULT_TARGETS]
    if missing:
        raise ValueError(f"lora targets: {missing[0]!r} matches no module of the model (e.g. 'kv_b_proj', 'o_proj')")
    if not names:
        raise ValueError(f"lora targets: {list(settings.targets)} match no nn.Linear module of the model")
    return names


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The LoRA-wrapped layers of ``model`` (peft ``LoraLayer``), by full module name."""
    _import_peft()
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def apply_lora(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Wrap the target layers of ``model`` in peft LoRA layers, in place; freeze every base parameter.

    Args:
        model: a :class:`kernels_torch.model.KimiK3Model` (any backend) without adapters.
        settings: :class:`LoraSettings`.

    Returns:
        The wrapped module names (``model.layers.3.self_attn.kv_b_proj``, ...). Afterwards only the ``lora_A`` /
        ``lora_B`` weights (in the base layer's dtype, A kaiming-uniform, B zero: peft's init) have ``requires_grad``.

    Raises:
        ValueError: see :func:`check_lora_supported` and :func:`resolve_targets`; a model that has adapters already.
        ImportError: peft (the ``lora`` extra) is not installed.
    """
    require_peft()
    _import_peft()
    from peft import inject_adapter_in_model

    check_lora_supported(settings, getattr(model, "backend", "eager"))
    if lora_modules(model):
        raise ValueError("model: already has LoRA adapters; merge_lora or build a fresh model first")
    names = resolve_targets(model, settings)
    model.requires_grad_(False)
    inject_adapter_in_model(settings.peft_config(names), model, adapter_name=_ADAPTER)
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_A." in n or ".lora_B." in n)
    return names


def initial_adapters(model: nn.Module, settings: LoraSettings) -> dict[str, torch.Tensor]:
    """The adapter tensors that ``apply_lora(model, settings)`` called now gives ``model``, without touching the
    model or the torch RNG: for a model built on ``meta`` (no values), whose adapters a sharded run fills after
    materialising (``kernels_torch.parallel.load.load_sharded(..., extra=)``), equal to one process's.

    peft creates each adapter on the CPU in fp32 (``nn.Linear(in, r)``, ``nn.Linear(r, out)``, then A
    kaiming-uniform and B zero), drawing from the global CPU generator layer after layer, and then casts it to its
    base layer's device and dtype. Here peft itself wraps a stand-in of the target layers (the same names, order,
    shapes and dtypes; each base weight a zero-stride CPU tensor, one element of memory) from the current RNG state,
    under ``torch.random.fork_rng``; ``apply_lora`` afterwards draws the same numbers again (on ``meta`` too: peft
    creates and initialises on the CPU, then moves to the base's device).

    Returns:
        ``{"<module>.lora_A.default.weight": [r, in], "<module>.lora_B.default.weight": [out, r]}`` (the wrapped
        model's ``state_dict`` names), CPU tensors in each base weight's dtype.

    Raises:
        ValueError, ImportError: as :func:`apply_lora`.
    """
    import torch
    from torch import nn

    require_peft()
    _import_peft()
    from peft import inject_adapter_in_model

    check_lora_supported(settings, getattr(model, "backend", "eager"))
    if lora_modules(model):
        raise ValueError("model: already has LoRA adapters; initial_adapters needs the model before apply_lora")
    names = resolve_targets(model, settings)
    shadow = nn.Module()
    for name in names:
        base = model.get_submodule(name)
        stand_in = nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
        w = torch.zeros((), dtype=base.weight.dtype).expand(base.weight.shape)
        stand_in.weight = nn.Parameter(w, requires_grad=False)
        *path, leaf = name.split(".")
        parent = shadow
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        parent.add_module(leaf, stand_in)
    with torch.random.fork_rng(devices=[]):
        inject_adapter_in_model(settings.peft_config(names), shadow, adapter_name=_ADAPTER)
    return {n: p.detach() for n, p in shadow.named_parameters() if ".lora_A." in n or ".lora_B." in n}


def adapters_without_gradient(model: nn.Module) -> list[str]:
    """After a backward pass: the wrapped layers whose ``lora_A`` or ``lora_B`` got no gradient (``.grad is None``),
    i.e. adapters some code path skipped. A training loop can check this once after its first backward and refuse
    to go on (an empty list is the healthy answer)."""
    out = []
    for name, layer in lora_modules(model).items():
        if any(m[_ADAPTER].weight.grad is None for m in (layer.lora_A, layer.lora_B)):
            out.append(name)
    return out


def _settings_of(model: nn.Module) -> dict:
    cfg = getattr(model, "peft_config", {}).get(_ADAPTER)
    if cfg is None:
        raise ValueError("model: has no LoRA adapter (apply_lora or load_adapter first)")
    return cfg


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors under peft's saved key names (``base_model.model.<path>.lora_A.weight``), on the CPU.
    Under FSDP2 the adapters are sharded DTensors and this gathers them (``full_tensor``, a collective: call it on
    every rank)."""
    _import_peft()
    from peft import get_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    sd = get_peft_model_state_dict(model, adapter_name=_ADAPTER)
    sd = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
    return {_KEY_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def base_fingerprint(checkpoint: str | Path) -> str:
    """A fingerprint of a base checkpoint folder: ``"sha256:<hex>"`` over its config (``KimiConfig.to_dict()``) and,
    for every tensor in name order, its name, its safetensors dtype code and shape (``f"{name}|BF16|[out, in]|"``)
    and every stored byte (the tensor's data as the file holds it, little-endian).

    The bytes are read with plain file reads through one 4 MiB buffer (the offsets from the safetensors header,
    which ``kimi.checkpoint.CheckpointReader`` has checked), not through a memory map: the process's resident
    memory grows by that buffer only, whatever the checkpoint's size (a mapped file would keep every page it read
    resident until closed: a whole shard). Any edit of the config or of any stored value changes it. It reads the
    whole checkpoint once, about as long as loading the model.

    Raises:
        kimi.checkpoint.CheckpointError: not a checkpoint folder, a missing or unreadable shard, a shard shorter
            than its header says.
    """
    import hashlib

    from kimi.checkpoint import CheckpointError, CheckpointReader

    reader = CheckpointReader(checkpoint)
    h = hashlib.sha256(json.dumps(reader.config.to_dict(), sort_keys=True).encode())
    prefix = reader.config.key_prefix
    by_file: dict[str, list[str]] = {}
    for name in sorted(reader.keys()):
        reader.shape(name)  # the shard's header checked (a damaged file is refused in the reader's words)
        by_file.setdefault(reader.file_of(name), []).append(name)
    buf = memoryview(bytearray(1 << 22))
    for file in sorted(by_file):
        path = reader.path / file
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
                for name in by_file[file]:
                    entry = header[prefix + name]
                    h.update(f"{name}|{entry['dtype']}|{list(entry['shape'])}|".encode())
                    begin, stop = entry["data_offsets"]
                    f.seek(8 + n + begin)
                    left = stop - begin
                    while left:
                        got = f.readinto(buf[: min(left, len(buf))])
                        if not got:
                            raise EOFError(f"{name}: the file ends {left} bytes early")
                        h.update(buf[:got])
                        left -= got
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - an unreadable or damaged file, whatever the reason
            raise CheckpointError(f"{path}: cannot read it for the base fingerprint ({e})") from None
    return "sha256:" + h.hexdigest()


FINGERPRINT_KEY = "kimi_base_fingerprint"  # in adapter_model.safetensors' metadata, beside peft's "format": "pt"


def adapter_base_fingerprint(adapter_dir: str | Path) -> str | None:
    """The base fingerprint an adapter folder records (:func:`save_adapter`), or None (an adapter trained on a
    random-init preset, or written by another tool)."""
    from safetensors import safe_open

    with safe_open(str(Path(adapter_dir) / ADAPTER_WEIGHTS), framework="pt") as f:
        return (f.metadata() or {}).get(FINGERPRINT_KEY)


def save_adapter(
    model: nn.Module,
    settings: LoraSettings,
    out_dir: str | Path,
    base_checkpoint: str | Path | None = None,
    base_fingerprint: str | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the adapter in peft's format: ``adapter_model.safetensors`` then ``adapter_config.json`` (each file
    atomic, mode 0644 under the usual umask: :func:`kimi.checkpoint.write_atomic`; the config last, so a folder
    with a config always has its weights).

    ``adapter_config.json`` is peft's ``LoraConfig.to_dict()`` with ``target_modules`` the wrapped module names and
    ``base_model_name_or_path`` the base checkpoint (when given). ``base_fingerprint`` (:func:`base_fingerprint` of
    the base) goes into the safetensors metadata beside peft's ``format`` (key :data:`FINGERPRINT_KEY`), where
    ``kimi lora merge`` checks it. ``tensors``: :func:`adapter_state_dict` of the model, taken already (under FSDP2
    every rank gathers them, one rank writes). Returns ``out_dir``.

    Raises:
        ValueError: ``model`` has no adapter, or it was wrapped with other settings than ``settings``.
    """
    from safetensors.torch import save

    from kimi.checkpoint import write_atomic

    cfg = _settings_of(model)
    if (cfg.r, float(cfg.lora_alpha), bool(cfg.use_rslora)) != (
        settings.rank,
        float(settings.alpha),
        settings.use_rslora,
    ):
        raise ValueError(
            f"settings: rank {settings.rank}, alpha {settings.alpha}, rslora {settings.use_rslora} differ from the "
            f"model's adapter (rank {cfg.r}, alpha {cfg.lora_alpha}, rslora {cfg.use_rslora})"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"}
    if base_fingerprint is not None:
        meta[FINGERPRINT_KEY] = base_fingerprint
    tensors = adapter_state_dict(model) if tensors is None else tensors
    write_atomic(out / ADAPTER_WEIGHTS, save(tensors, metadata=meta))
    d = cfg.to_dict()
    d = {k: (sorted(v) if isinstance(v, (set, frozenset)) else v) for k, v in d.items()}
    d["target_modules"] = sorted(lora_modules(model))
    d["inference_mode"] = True
    d["base_model_name_or_path"] = None if base_checkpoint is None else str(base_checkpoint)
    write_atomic(out / ADAPTER_CONFIG, json.dumps(d, indent=2, sort_keys=True).encode())
    return out


def read_adapter_config(adapter_dir: str | Path):
    """peft's ``LoraConfig`` of an adapter folder, checked. Returns ``(LoraConfig, LoraSettings)``.

    Raises:
        ValueError: no folder / files, not LoRA, DoRA, or settings we refuse (see :func:`check_lora_supported`).
    """
    require_peft()
    _import_peft()
    from peft import LoraConfig

    d = Path(adapter_dir)
    for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (d / f).is_file():
            raise ValueError(f"adapter: no {f} in {d} (expected a peft LoRA adapter folder)")
    try:
        raw = json.loads((d / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"adapter: {d / ADAPTER_CONFIG} is not valid JSON ({e})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter: peft_type {raw.get('peft_type')!r} in {d}, expected 'LORA'")
    if raw.get("use_dora"):
        raise ValueError(f"adapter: {d} is a DoRA adapter (use_dora true); DoRA is not supported")
    cfg = LoraConfig.from_pretrained(str(d))
    targets = cfg.target_modules
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets or ()))
    if cfg.rank_pattern or cfg.alpha_pattern:
        raise ValueError(f"adapter: {d} has per-module rank_pattern/alpha_pattern; not supported here")
    settings = LoraSettings(
        rank=int(cfg.r),
        alpha=float(cfg.lora_alpha),
        dropout=float(cfg.lora_dropout),
        targets=targets,
        use_rslora=bool(cfg.use_rslora),
    )
    return cfg, settings


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> list[str]:
    """Wrap ``model`` with the adapter of ``adapter_dir`` (peft format) and load its weights, strictly.

    Returns the wrapped module names. Raises ValueError: see :func:`read_adapter_config`; a key of the file that
    the model has no place for, or a wrapped layer the file has no weights for, or a tensor whose shape is not the
    model's (named, with both shapes: a rank other than adapter_config.json's ``r``, or another model's sizes).
    """
    _, settings = read_adapter_config(adapter_dir)
    names = apply_lora(model, settings)
    try:
        _load_checked(model, adapter_dir, settings)
    except BaseException:
        _remove_lora(model)  # a refused adapter leaves the model as it was (a retry must not meet its zero adapters)
        raise
    return names


def _remove_lora(model: nn.Module) -> None:
    """Put the plain base layers back without merging (undo :func:`apply_lora`)."""
    for name, layer in lora_modules(model).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config


def _load_checked(model: nn.Module, adapter_dir: str | Path, settings) -> None:
    _import_peft()
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    raw = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    sd = {(k[len(_KEY_PREFIX) :] if k.startswith(_KEY_PREFIX) else k): v for k, v in raw.items()}
    want = adapter_state_dict(model)  # the freshly wrapped model's tensors: the shapes the file must have
    expected, got = set(want), {_KEY_PREFIX + k for k in sd}
    if got != expected:
        extra, lost = sorted(got - expected), sorted(expected - got)
        raise ValueError(
            f"adapter: {Path(adapter_dir) / ADAPTER_WEIGHTS} does not fit the model: "
            + (f"unexpected key {extra[0]!r}" if extra else f"missing key {lost[0]!r}")
            + f" ({len(extra)} unexpected, {len(lost)} missing)"
        )
    for k in sorted(sd):  # torch's own size-mismatch error is one line per tensor, and its first says nothing
        have, need = list(sd[k].shape), list(want[_KEY_PREFIX + k].shape)
        if have != need:
            a_or_b = ".lora_A." in k
            r_have = have[0 if a_or_b else -1] if len(have) == 2 else None
            why = (
                f"adapter_config.json says r={settings.rank} but the tensors have rank {r_have}"
                if len(have) == 2 and r_have != settings.rank
                else "an adapter trained for a model with other layer sizes"
            )
            raise ValueError(
                f"adapter: {Path(adapter_dir) / ADAPTER_WEIGHTS}: tensor {_KEY_PREFIX + k!r} has shape {have}, "
                f"expected {need} ({'lora_A [r, in]' if a_or_b else 'lora_B [out, r]'}; {why})"
            )
    set_peft_model_state_dict(model, sd, adapter_name=_ADAPTER)


def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its base weight and put the plain ``nn.Linear`` back, so the ``state_dict`` has the
    canonical names again. In place; returns the merged module names. Parameters stay frozen.

    ``W <- round(W + scale * B A)``, the sum formed in fp32 (fp64 for an fp64 ``W``) from the stored ``W``, ``A``
    and ``B`` and rounded once to ``W``'s dtype, so a bf16 base gets ``bf16(fp32(W) + fp32(dW))`` (adding in bf16
    would round twice); ``scale`` is :attr:`LoraSettings.scale` of the model's adapter (alpha / r, alpha / sqrt(r)
    under rsLoRA), the scale peft's forward applies.

    Raises:
        ValueError: a merge that gives non-finite weights (naming the module), or a model without an adapter.
    """
    import torch

    cfg = _settings_of(model)
    scale = LoraSettings(rank=int(cfg.r), alpha=float(cfg.lora_alpha), use_rslora=bool(cfg.use_rslora)).scale
    merged = []
    for name, layer in lora_modules(model).items():
        base = layer.get_base_layer()
        A, B = layer.lora_A[_ADAPTER].weight, layer.lora_B[_ADAPTER].weight  # [r, in], [out, r]
        with torch.no_grad():
            acc = torch.float64 if base.weight.dtype == torch.float64 else torch.float32
            w = base.weight.to(acc) + (B.to(acc) @ A.to(acc)) * scale  # [out, in]
            if not bool(torch.isfinite(w).all()):
                raise ValueError(f"merge: {name}: W + scale * B A is not finite (the adapter holds inf or NaN?)")
            base.weight.copy_(w.to(base.weight.dtype))
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, base)
        merged.append(name)
    if hasattr(model, "peft_config"):
        del model.peft_config
    return merged


# ---------------------------------------------------------------------------------------------- kimi lora merge


def add_parser(subparsers) -> None:
    """``kimi lora merge --checkpoint BASE --adapter DIR --out DIR``."""
    from kimi_tools.common import Parser

    p = subparsers.add_parser("lora", help="LoRA adapters: merge one into a plain checkpoint")
    sub = p.add_subparsers(dest="lora_cmd", required=True, parser_class=Parser)
    m = sub.add_parser("merge", help="write BASE + adapter as a plain checkpoint (JAX reference and torch load it)")
    m.add_argument("--checkpoint", required=True, metavar="BASE", help="the base checkpoint directory")
    m.add_argument("--adapter", required=True, metavar="DIR", help="a peft LoRA adapter folder")
    m.add_argument("--out", required=True, metavar="DIR", help="the merged checkpoint directory (new or empty)")
    m.add_argument("--force", action="store_true", help="write into a non-empty directory")
    m.add_argument(
        "--force-base",
        action="store_true",
        help="merge even when the base fingerprint the adapter records is not --checkpoint's",
    )
    p.set_defaults(func=cmd_lora)


def cmd_lora(args: argparse.Namespace) -> int:
    import torch

    from kernels_torch.model import load_model, save_model
    from kimi_tools.common import CliError, check_out_folder, copy_tokenizer, refuse_adapter_folder

    out = check_out_folder("--out", args.out, force="--force")  # a file, or a path under one: refused here
    for name, src in (("--checkpoint", args.checkpoint), ("--adapter", args.adapter)):
        if out.resolve() == Path(src).resolve():  # even with --force: the inputs are read while the output is written
            raise CliError(f"--out: {args.out} is the {name} folder; write the merged checkpoint to another folder")
    if out.exists() and any(out.iterdir()) and not args.force:
        raise CliError(f"--out: {out} is not empty (use --force to write into it)")
    if not Path(args.checkpoint).is_dir():
        raise CliError(f"--checkpoint: no checkpoint directory at {args.checkpoint}")
    refuse_adapter_folder(args.checkpoint, "the command")  # the adapter given as the base
    try:
        require_peft()
    except ImportError as e:
        raise CliError(str(e)) from None
    read_adapter_config(args.adapter)  # a bad adapter folder fails before the base model is read
    recorded, actual = adapter_base_fingerprint(args.adapter), base_fingerprint(args.checkpoint)
    if recorded is not None and recorded != actual and not args.force_base:
        raise CliError(
            f"--checkpoint: {args.checkpoint} is not the base {args.adapter} was trained on (base fingerprint "
            f"{actual[:19]}..., the adapter records {recorded[:19]}...: another model of the same shapes?); merge "
            "onto its own base, or pass --force-base to merge anyway"
        )
    model = load_model(args.checkpoint, backend="eager", dtype=torch.float32)
    names = load_adapter(model, args.adapter)
    merge_lora(model)
    save_model(model, out)
    copy_tokenizer(Path(args.checkpoint), out)
    if recorded is None:
        check = "; the adapter records no base fingerprint, so the base was not checked"
    elif recorded != actual:
        check = "; the base fingerprint differs from the adapter's (--force-base)"
    else:
        check = ""
    print(
        f"kimi lora merge: {len(names)} adapters from {args.adapter} folded into the weights of {args.checkpoint}; "
        f"wrote {out}{check}"
    )
    return 0
