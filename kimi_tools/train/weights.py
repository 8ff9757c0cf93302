"""The model side of a run: build it, convert it, choose what trains, fp32 masters, AdamW, gradient clipping.

Order (:class:`kimi_tools.train.trainer.Trainer` follows it): :func:`build_model` (``--checkpoint`` through
``kernels_torch.model.load_model``, or a ``--preset`` random init), the stage's ``prepare``, LoRA
(``kimi_tools.lora.apply_lora``), :func:`freeze` (the stage's trainable set and ``--freeze``), :func:`convert_model`
(the model-conversion hook: :data:`CONVERTERS`), then FSDP2 (``kimi_tools.train.parallel``), :class:`MasterWeights` and
:func:`build_optimizer`. Under torchrun the model is built on ``meta`` and the same steps run on it (they set flags
and swap modules, never read weights; LoRA's adapters are injected there too, their one-process initial values
taken first by ``kimi_tools.lora.initial_adapters``); after the sharding :func:`materialise` allocates and fills
each rank's shards only. Parameters stay in the checkpoint's dtypes (``A_log``, ``dt_bias``, conv weights,
``o_norm`` in fp32); in bf16 the optimizer steps fp32 master copies of the trainable parameters
(``--optimizer adamw-fp32``), or the bf16 parameters themselves with bf16 moments and stochastic rounding
(``--optimizer adamw-bf16``: torchao's AdamW, :func:`build_optimizer`, :func:`step_optimizer`).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kimi.config import KimiConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kimi_tools.train.args import TrainArgs

__all__ = [
    "load_run_config",
    "build_model",
    "materialise",
    "CONVERTERS",
    "convert_model",
    "freeze",
    "MasterWeights",
    "OptimizerState",
    "decays",
    "build_optimizer",
    "step_optimizer",
    "clip_grad_norm",
]


def load_run_config(a: TrainArgs) -> KimiConfig:
    """The model config of the run: ``--checkpoint``'s ``config.json`` or ``--preset``, cut to ``--layers``."""
    from kimi.config import load_config

    cfg = load_config(a.preset) if a.checkpoint is None else KimiConfig.from_json(Path(a.checkpoint))
    if a.layers is not None:
        cfg = cfg.truncated(a.layers)
    return cfg


def build_model(a: TrainArgs, cfg: KimiConfig, meta: bool = False) -> nn.Module:
    """The :class:`kernels_torch.model.KimiK3Model` to train, on ``a.device`` in ``a.dtype`` (fp32 kept where the
    checkpoint keeps it): ``--checkpoint`` read by ``kernels_torch.model.load_model``, or ``--preset`` from
    :func:`kimi.init.init_params` (``--seed``; the full preset's config sets the residual-output scale, so
    ``--layers N`` gives the first N layers of the whole model).

    ``meta=True`` (under torchrun): the model is built on the ``meta`` device, holding no memory and no weights; the
    trainer shards it (``TrainParallel.setup``), then :func:`materialise` gives each rank its shards of the same
    weights."""
    import torch

    from kernels_torch.model import KimiK3Model, cast_model, load_model, model_from_params

    dtype = getattr(torch, a.dtype)
    if meta:
        with torch.device("meta"):
            return cast_model(KimiK3Model(cfg, backend=a.backend), dtype)
    if a.checkpoint is not None:
        return load_model(a.checkpoint, layers=a.layers, backend=a.backend, dtype=dtype, device=a.device)
    from kimi.config import load_config
    from kimi.init import init_params

    params = init_params(load_config(a.preset), seed=a.seed, layers=cfg.num_hidden_layers)
    return model_from_params(cfg, params, a.backend, dtype, a.device)


def materialise(
    model: nn.Module,
    a: TrainArgs,
    cfg: KimiConfig,
    partial: bool = False,
    adapters: dict[str, torch.Tensor] | None = None,
) -> None:
    """Give a model built by ``build_model(..., meta=True)`` and then sharded its weights, each rank only its shards:
    ``to_empty`` on ``a.device`` allocates the local shards, then ``--checkpoint`` is read by
    ``kernels_torch.parallel.load.load_sharded`` (each rank reads and decodes only its blocks), or the ``--preset``
    init of :func:`build_model` (``kimi.init.init_params``, computed whole on every rank) is copied block by block
    (``fill_sharded``). The weights are those :func:`build_model` gives in one process, bit for bit.

    ``partial``: the model is a pipeline rank's stages (``Pipeline.rank_module``), holding some tensors only.
    ``adapters``: with LoRA, ``kimi_tools.lora.initial_adapters`` of the meta model taken before ``apply_lora``
    (the adapters one process starts from, by ``state_dict`` name); each rank copies its block of them. A LoRA
    base layer (``...q_proj.base_layer.weight``) is filled from the checkpoint's ``...q_proj.weight``.

    Raises:
        kimi.checkpoint.CheckpointError, ValueError: see ``load_sharded``."""
    from kernels_torch.parallel.load import fill_sharded, load_sharded, to_empty

    offload = getattr(a, "offload", "none") == "cpu" and a.device != "cpu"
    to_empty(model, "cpu" if offload else a.device)  # parameters keep their objects (TrainParallel holds some)
    if offload:  # --offload cpu: FSDP2's shards stay on the host; the tensors it does not manage compute on the device
        _plain_to(model, a.device)
    if a.checkpoint is not None:
        load_sharded(model, a.checkpoint, partial=partial, extra=adapters)
        return
    from kimi.config import load_config
    from kimi.init import init_params

    params = init_params(load_config(a.preset), seed=a.seed, layers=cfg.num_hidden_layers)
    fill_sharded(model, params, partial=partial, extra=adapters)


def _plain_to(model: nn.Module, device: str) -> None:
    """Move the parameters FSDP2 does not manage (plain tensors: those it ignores, kept whole on every rank) and the
    buffers of ``model`` to ``device``, in place (each parameter keeps its object); its ``DTensor`` shards stay."""
    import torch
    from torch.distributed.tensor import DTensor

    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None and not isinstance(p, DTensor):  # swapped: .data cannot change some device types
                torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad))
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = b.to(device)


# A model converter rewrites the built model in place before it is sharded and its optimizer built (torchtitan's
# ``model.converters``: float8 training swaps the nn.Linear layers it handles), e.g. ``--fp8 RECIPE``. It is called
# as ``converter(model, args)`` on the model as it will train (LoRA wrapped, trainable set chosen) and returns a
# short description of what it did for the run's header, or None when ``args`` do not ask for it. It must keep
# every parameter's name and ``requires_grad``; the settings it reads are TrainArgs fields, so run.json records them.


def fp8_converter(model: nn.Module, args: TrainArgs) -> str | None:
    """``--fp8 RECIPE``: :func:`kernels_torch.fp8.convert_model_to_fp8` on the model (the LoRA-wrapped projections'
    frozen base layers included; names and ``requires_grad`` unchanged). Returns what it converted, and the routed
    experts it left in bf16 with the reason (:func:`_experts_left_bf16`), for the header and ``run.json``'s
    ``conversions``.

    Raises:
        FP8UnsupportedError: (a ValueError) the device cannot run FP8 or torchao is missing.
    """
    if args.fp8 is None:
        return None
    from kernels_torch.fp8 import convert_model_to_fp8, min_dim_for

    compiled = args.fp8_compile or getattr(args, "compile", False)  # projections compiled alone or in their block
    min_dim = min_dim_for(args.fp8, compiled) if args.fp8_min_dim is None else args.fp8_min_dim
    rec = convert_model_to_fp8(model, args.fp8, device=args.device, compile_linears=args.fp8_compile, min_dim=min_dim)
    experts = f", {len(rec.grouped_experts)} grouped experts ({rec.grouped_recipe})" if rec.grouped_experts else ""
    compiled = " (compiled)" if rec.compiled else ""
    narrow = sum(1 for _, reason in rec.skipped if reason.startswith("narrow"))
    kept = f", {narrow} narrower than {min_dim} kept in bf16" if narrow else ""
    return (
        f"fp8 {rec.recipe}: {len(rec.linears)} projections{compiled}{kept}{experts}, torchao {rec.torchao_version}"
        + _experts_left_bf16(rec, args)
    )


def _experts_left_bf16(rec, args: TrainArgs) -> str:
    """``"; routed experts stay bf16 in N layers (why)"`` when the conversion left grouped experts as they are
    (``FP8Conversion.skipped``), else ``""``: a run whose experts (most of a MoE model's GEMMs) are not FP8 says so
    in its header and ``run.json``. The loop kernel (``--backend eager`` / ``sdpa``, or ``$KIMI_MOE_KERNEL=loop``)
    indexes each expert's weight, which torchao's FP8 grouped GEMM cannot wrap; only ``--backend cudnn`` runs them
    on ``grouped_mm``."""
    reasons: dict[str, int] = {}
    for _, reason in rec.skipped:
        if reason.startswith("grouped experts"):
            reasons[reason] = reasons.get(reason, 0) + 1
    if not reasons:
        return ""
    why = {
        "grouped experts on the loop kernel": f"the loop kernel of --backend {args.backend}; FP8 grouped GEMMs run "
        "on the grouped_mm kernel of --backend cudnn",
        "grouped experts under emulate": "torchao's emulation has no FP8 grouped GEMM",
    }
    n = sum(reasons.values())
    said = "; ".join(why.get(r, r) for r in reasons)
    return f"; routed experts stay bf16 in {n} layer{'s' * (n > 1)} ({said})"


CONVERTERS: list[Callable[[Any, Any], str | None]] = [fp8_converter]


def convert_model(model: nn.Module, args: TrainArgs) -> list[str]:
    """Apply every :data:`CONVERTERS` entry to ``model`` in order; returns the descriptions of those that acted."""
    done = []
    for converter in CONVERTERS:
        what = converter(model, args)
        if what:
            done.append(what)
    return done


def freeze(model: nn.Module, stage, patterns: list[str]) -> None:
    """``requires_grad=False`` on every parameter the stage does not train or a ``--freeze`` glob matches
    (``fnmatch`` on the canonical name); a parameter frozen already stays frozen.

    Raises:
        ValueError: a pattern that matches no parameter name.
    """
    names = [n for n, _ in model.named_parameters()]
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(n, pat) for n in names):
            raise ValueError(f"--freeze: {pat!r} matches no parameter name (e.g. {names[0]!r}; globs: * ?)")
    for n, p in model.named_parameters():
        if p.requires_grad and (not stage.trainable(n) or any(fnmatch.fnmatchcase(n, pat) for pat in patterns)):
            p.requires_grad_(False)


class MasterWeights:
    """The parameters the optimizer steps, and the ``weights`` entry of a ``step-N/`` resume state (a DCP
    ``Stateful``).

    ``low_precision`` (``--optimizer adamw-bf16``): a trainable bf16 parameter is its own master too (the optimizer
    steps it in bf16 with stochastic rounding), except those in ``replicated`` (the parameters a parallel layout
    keeps whole on every rank, ``TrainParallel.replicated``): they keep fp32 masters, stepped without randomness, so
    that every rank holds the same values. Otherwise:

    A trainable parameter in fp32 is its own master (so under ``torchrun``, where FSDP2's mixed precision holds the
    trainable parameters as fp32 shards and computes in bf16, ``kimi_tools.train.parallel``, nothing is copied). Each other
    trainable parameter (bf16 in one process; a bf16 parameter a stage keeps whole on every rank) gets an fp32 copy:
    :meth:`grads_to_masters` moves the gradients up (fp32), the optimizer steps the masters, :meth:`to_model` rounds
    them back into the model (the model's weights are then the masters rounded once, which is what the export holds).
    :attr:`module` holds the masters under the model's parameter names (the model itself when every trainable
    parameter is fp32, else a module tree of the masters alone), for the optimizer's state dict. ``state_dict`` maps
    each trainable name to its master (DCP loads into those tensors in place; ``load_state_dict`` then copies them
    into the model).
    """

    def __init__(self, model: nn.Module, low_precision: bool = False, replicated=()):
        import torch
        from torch import nn

        self.model = model
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        whole = {id(p) for p in replicated}

        def own(p) -> bool:  # the parameter is its own master
            return p.dtype == torch.float32 or (low_precision and p.dtype == torch.bfloat16 and id(p) not in whole)

        if all(own(p) for _, p in trainable):
            self.module = model
        else:
            self.module = nn.Module()
            for n, p in trainable:
                m = p if own(p) else nn.Parameter(p.detach().float().clone())
                *path, leaf = n.split(".")
                parent = self.module
                for part in path:
                    if not hasattr(parent, part):
                        parent.add_module(part, nn.Module())
                    parent = getattr(parent, part)
                parent.register_parameter(leaf, m)
        params = dict(self.module.named_parameters())
        self.names = [n for n, _ in trainable]
        self.pairs = [(p, params[n]) for n, p in trainable]  # (model parameter, its master; the same if its own)

    @property
    def masters(self) -> list[torch.Tensor]:
        return [m for _, m in self.pairs]

    @property
    def numel(self) -> int:
        return sum(m.numel() for m in self.masters)

    def grads_to_masters(self) -> None:
        """The model's gradients, in fp32, become the masters' (a no-op when they are the same tensors)."""
        for p, m in self.pairs:
            if p is not m:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None

    def zero_grad(self) -> None:
        for p, m in self.pairs:
            p.grad = m.grad = None

    def to_model(self) -> None:
        """Round the masters into the model's parameters (a no-op when they are the same tensors)."""
        import torch

        with torch.no_grad():
            for p, m in self.pairs:
                if p is not m:
                    p.copy_(m)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: m.detach() for n, (_, m) in zip(self.names, self.pairs)}

    def load_state_dict(self, state: dict) -> None:
        self.to_model()  # DCP has loaded the masters in place (state holds the tensors of state_dict())


class OptimizerState:
    """The ``optimizer`` entry of a resume state: ``torch.distributed.checkpoint.state_dict``'s optimizer state of
    ``optimizer`` over ``module``, flattened (``flatten_optimizer_state_dict``: every key names a parameter,
    ``state.<name>.exp_avg``, ``param_groups.<name>.lr``), so it loads on another world size and on ranks that hold
    other parameters (pipeline stages: a group's index means other parameters on each rank). A resume state written
    before (``param_groups.<index>.*``) loads as written: :meth:`match_saved` picks the form from its keys."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer):
        self.module, self.optimizer = module, optimizer
        self.flatten = True

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=self.flatten)

    def match_saved(self, keys, prefix: str = "optimizer.") -> None:
        """Read and write the form of the resume state whose flat keys are ``keys`` (indexed param groups: the
        form before the flattened one)."""
        head = prefix + "param_groups."  # indexed: param_groups.<i>.lr; flat: param_groups.<name>.lr
        rest = [k[len(head) :].split(".") for k in keys if k.startswith(head)]
        self.flatten = not any(len(r) == 2 and r[0].isdigit() and r[1] == "lr" for r in rest)

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer, options=self._options())

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state, options=self._options())


def decays(p: torch.Tensor) -> bool:
    """Whether AdamW's weight decay applies to ``p``: matrices (and conv filters) yes; vectors (norm weights and
    biases, ``A_log``, ``dt_bias``) no (nanoGPT's rule: decay 2-D and above)."""
    return p.ndim >= 2


def build_optimizer(masters: MasterWeights, a: TrainArgs) -> torch.optim.Optimizer:
    """AdamW over the masters (``--beta1``, ``--beta2``, eps 1e-8, decoupled decay): ``--weight-decay`` on
    :func:`decays` tensors, 0 on the others (a group only when it holds a tensor).

    ``--optimizer adamw-fp32``: ``torch.optim.AdamW``, fused on CUDA (one kernel, no foreach temporaries) unless
    ``--offload cpu`` (the shards step on the host). ``--optimizer adamw-bf16``: torchao's AdamW
    (``torchao.optim._AdamW``, ``bf16_stochastic_round=True``; step it through :func:`step_optimizer`): each step
    computes in fp32 from the stored tensors, keeps the two moments in the parameter's dtype (bf16, round to
    nearest) and writes a bf16 parameter back rounded stochastically (up with probability equal to the fraction of
    the bf16 spacing, so the rounding is unbiased: Zamirai et al. 2020, arXiv:2010.06192); an fp32 parameter steps
    in fp32 with fp32 moments. Its ``lr`` is a 0-dim tensor (the schedule fills it in place).

    Raises:
        ImportError: ``adamw-bf16`` without torchao (``pip install torchao``)."""
    import torch

    decay = [m for m in masters.masters if decays(m)]
    no_decay = [m for m in masters.masters if not decays(m)]
    groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # an empty group is left out (a pipeline stage holding the embedding alone has no vector; DCP's optimizer
    # state_dict cannot load into a rank that has an empty group)
    groups = [g for g in groups if g["params"]] or groups[:1]
    if getattr(a, "optimizer", "adamw-fp32") == "adamw-bf16":
        return _torchao_adamw()(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=1e-8, bf16_stochastic_round=True)
    on_host = getattr(a, "offload", "none") == "cpu"
    return torch.optim.AdamW(
        groups, lr=a.lr, betas=(a.beta1, a.beta2), fused=(a.device == "cuda" and not on_host) or None
    )


def _torchao_adamw():
    """torchao's AdamW class (``torchao.optim._AdamW`` in torchao 0.17 and 0.18; ``AdamW`` in releases that make it
    public), the one with ``bf16_stochastic_round``."""
    from kernels_torch.fp8 import quiet_torchao_import

    try:
        with quiet_torchao_import():  # its optional CUDA extensions log a failed load on a CPU machine
            import torchao.optim as ao_optim
    except ImportError as e:
        raise ImportError(
            f"--optimizer adamw-bf16: needs torchao (pip install 'torchao>=0.17,<0.19'), got: {e}"
        ) from None
    cls = getattr(ao_optim, "AdamW", None) or getattr(ao_optim, "_AdamW", None)
    if cls is None:
        raise ImportError(f"--optimizer adamw-bf16: torchao {ao_optim.__name__} has no AdamW (_AdamW) class")
    return cls


def sr_seed(seed: int, step: int, rank: int = 0) -> int:
    """The seed of step ``step``'s stochastic rounding on rank ``rank`` of a run of ``--seed`` ``seed``: a 63-bit
    hash of the three, so each step and rank draws its own bits whatever came before (a resumed run rounds as the
    uninterrupted one)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}/{step}/{rank}".encode()).digest()[:8], "little") >> 1


def step_optimizer(optimizer: torch.optim.Optimizer, a: TrainArgs, step: int, rank: int = 0) -> None:
    """``optimizer.step()``; under ``--optimizer adamw-bf16`` with the random bits of the stochastic rounding drawn
    from a generator seeded by :func:`sr_seed` (``torch.random.fork_rng``: the run's own RNG, which dropout and the
    resume state use, is left as it was), and, for parameters on the CPU, torchao's per-parameter step run eagerly
    (``torch.compiler.set_stance("force_eager")``: the same function; inductor's CPU compile costs about 40 s at the
    first step and again for each new shape). With every parameter on CUDA torchao compiles it."""
    import contextlib

    import torch

    if getattr(a, "optimizer", "adamw-fp32") != "adamw-bf16":
        optimizer.step()
        return
    devices = {p.device.type for g in optimizer.param_groups for p in g["params"]}
    eager = torch.compiler.set_stance("force_eager") if "cpu" in devices else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if "cuda" in devices else []), eager:
        torch.manual_seed(sr_seed(a.seed, step, rank))
        optimizer.step()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, sum_group=None) -> float:
    """Clip the gradients of ``params`` to a total L2 norm of ``max_norm`` (``inf``: none) and return the norm before
    clipping (``torch.nn.utils.clip_grad_norm_``). Under FSDP2 the parameters can be DTensors on different meshes
    (the routed experts on the ``(efsdp, ep)`` mesh, the rest on ``dp_cp``) and plain tensors (those a stage keeps
    whole on every rank): the norm of each group is taken apart (a DTensor's over its whole mesh) and combined.
    ``sum_group``: a process group whose ranks hold disjoint parameters (the pipeline's, ``--pp``): the squared norms
    are summed over it, so every rank clips by the whole model's norm."""
    import torch
    import torch.distributed as dist

    grads = [p for p in params if p.grad is not None]
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()
    groups: dict[Any, list] = {}
    for p in grads:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    if len(groups) <= 1 and sum_group is None:
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
    dev = grads[0].grad.device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=dev)  # on the device: the one host read is the norm returned
    for group in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True if dev.type == "cuda" else None)
        n = n.full_tensor() if isinstance(n, DTensor) else n
        sq = sq + n.detach().to(dev, torch.float64) ** 2
    if sum_group is not None:
        dist.all_reduce(sq, group=sum_group)
    total = float(sq.sqrt())
    coef = max_norm / (total + 1e-6)  # clip_grad_norm_'s coefficient, as a number (a DTensor takes no plain tensor)
    if coef < 1.0:
        for group in groups.values():  # one foreach kernel per mesh (a DTensor list shares one mesh)
            torch._foreach_mul_([p.grad for p in group], coef)
    return total
