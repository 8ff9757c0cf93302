"""The training loop: :class:`Trainer`, one object that owns the run's components and is itself the run's
``Stateful`` training state (step, tokens seen, RNG), as torchtitan's ``Trainer`` is.

``Trainer(args)`` checks everything and builds the components, writing nothing: the data (loader and eval batches),
the stage, the model (built, prepared, LoRA, frozen, converted, sharded; under torchrun built on ``meta`` and each
rank's shards materialised and read after the sharding: ``weights.materialise``), the fp32 masters, AdamW and the schedule,
the checkpointer and the metrics log. :meth:`Trainer.run` opens the run folder (``run.json``, or the resume state),
evaluates at step 0, and loops over :meth:`Trainer.train_step` until ``--stop-after`` or ``--steps``, saving the
resume state on schedule (``--save-every``), on the last step and when a SIGINT / SIGTERM asks it to stop
(:mod:`kimi_tools.train.interrupt`); it writes the model only when the run reaches ``--steps``.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kimi.checkpoint import write_atomic
from kimi_tools.common import CliError, refuse_adapter_folder
from kimi_tools.train.args import (
    TrainArgs,
    default_batch_tokens,
    fingerprint,
    parse_save_every,
    resolve,
    resume_defaults,
)
from kimi_tools.train.checkpoint import (
    DIVERGED,
    METRICS,
    RUN_JSON,
    Checkpointer,
    check_out,
    export,
    recorded_args,
    restart,
)
from kimi_tools.train.interrupt import StopRequest, TrainInterrupted, note
from kimi_tools.train.metrics import RECORD_KEYS, MetricsLog, peak_mem_bytes, plot_losses
from kimi_tools.train.schedule import ScheduleState, build_scheduler
from kimi_tools.train.stages import make_stage
from kimi_tools.train.weights import (
    MasterWeights,
    OptimizerState,
    build_model,
    build_optimizer,
    clip_grad_norm,
    convert_model,
    freeze,
    load_run_config,
    materialise,
    step_optimizer,
)

if TYPE_CHECKING:
    from kimi.config import KimiConfig

__all__ = ["Trainer", "TrainResult", "train", "read_data", "check_sizes"]


@dataclass
class TrainResult:
    """What a run did: ``records`` are the metrics.jsonl records of this process (``step`` 0 first on a fresh run);
    ``eval_losses`` maps step -> eval loss over the whole run (earlier records read back on resume)."""

    out: Path
    start_step: int
    step: int
    tokens_seen: int
    records: list[dict[str, Any]]
    eval_losses: dict[int, float]
    trainable_params: int
    total_params: int
    wall_s: float

    @property
    def final_loss(self) -> float | None:
        losses = [r["loss"] for r in self.records if r.get("loss") is not None]
        return losses[-1] if losses else None


def _kinds(kinds: str | None) -> str:
    """The header's ``", kda,dsa layers"`` of ``--recompute-layers`` / ``--offload-layers`` (``""``: every layer)."""
    return f", {kinds} layers" if kinds else ""


def _eval_source(a: TrainArgs) -> str:
    return "--eval-data" if a.eval_data else f"the held-out {a.eval_fraction:g} of --data"


def read_data(a: TrainArgs, cfg: KimiConfig):
    """``(tokenizer, train_docs, eval_docs)``: ``--data`` tokenised with the checkpoint's tokenizer, the eval
    documents from ``--eval-data`` or the held-out tail of ``--data``.

    Raises:
        ValueError: unreadable data, no trainable target on either side, a token id outside the vocabulary.
    """
    from kimi.tokenizer import load_tokenizer
    from kimi_tools.data import num_targets, read_documents, split_tail, tokenize_documents

    tok = load_tokenizer(a.checkpoint, cfg.vocab_size)
    docs = tokenize_documents(read_documents(a.data, "--data"), tok.encode)
    if a.eval_data:
        eval_docs = tokenize_documents(read_documents(a.eval_data, "--eval-data"), tok.encode)
        where = "--eval-data"
    else:
        docs, eval_docs = split_tail(docs, a.eval_fraction)
        where = _eval_source(a)
    if num_targets(docs) == 0:
        raise ValueError("--data: no document has two tokens or more after the held-out split: nothing to predict")
    if num_targets(eval_docs) == 0:
        raise ValueError(
            f"--eval-data: {where} has no document of two tokens or more (pass --eval-data or a larger --eval-fraction)"
        )
    for d in (*docs, *eval_docs):
        if d.size and (d.min() < 0 or d.max() >= cfg.vocab_size):
            raise ValueError(f"data: token id {int(d.max())} outside [0, {cfg.vocab_size}) of the model's vocabulary")
    return tok, docs, eval_docs


def check_sizes(a: TrainArgs, docs, eval_docs, where: str = "the eval data") -> int:
    """Refuse rows and batches longer than the data, before anything is written: a row (``--seq-len``), a
    micro-batch (``--micro-batch-tokens``, what one forward holds in memory) or a step (``--batch-tokens``) longer
    than the training tokens would repeat the text inside itself (the memory grows with the row, not with the data).

    Returns the length of the eval rows: ``--seq-len``, or all the eval tokens in one shorter row when they are
    fewer (no token evaluated twice).

    Raises:
        ValueError: naming the flag, its value, the tokens the data holds and the largest value that fits; with
            ``--cp`` > 1, an eval set shorter than ``--seq-len`` (a row is split across the ranks).
    """
    n_train = sum(len(d) for d in docs)
    n_eval = sum(len(d) for d in eval_docs)
    for flag, value, what in (
        ("--seq-len", a.seq_len, "a row"),
        ("--micro-batch-tokens", a.micro_batch_tokens, "a micro-batch"),
        ("--batch-tokens", a.batch_tokens, "a step"),
    ):
        if value > n_train:
            raise ValueError(
                f"{flag}: got {value:,}, but --data holds {n_train:,} training tokens (after the eval split), so "
                f"{what} would repeat the text; expected at most {n_train:,}, or more --data"
            )
    if a.seq_len <= n_eval:
        return a.seq_len
    if a.cp > 1:
        raise ValueError(
            f"--seq-len: got {a.seq_len:,}, but the eval set ({where}) holds {n_eval:,} tokens, fewer than one row "
            f"to split across --cp {a.cp}; expected --seq-len at most {n_eval:,}, or more eval text (--eval-data, "
            "a larger --eval-fraction)"
        )
    return n_eval


def _lora_settings(a: TrainArgs):
    from kimi_tools import lora

    kw = {"dropout": a.lora_dropout}
    if a.lora_targets:
        kw["targets"] = tuple(a.lora_targets)
    settings = lora.LoraSettings(a.lora_rank, a.lora_alpha, **kw)
    lora.check_lora_supported(settings, a.backend)
    return settings


class Trainer:
    """One training run (module docstring). Attributes are its components: ``args`` (resolved), ``config``,
    ``par`` (:class:`kimi_tools.train.parallel.TrainParallel`), ``loader`` and ``evals``, ``stage``, ``model``, ``masters``
    (:class:`~kimi_tools.train.weights.MasterWeights`), ``optimizer``, ``scheduler``, ``checkpointer``, ``metrics``;
    its own state is ``step`` and ``tokens_seen`` (plus the RNG, in :meth:`state_dict`).

    Raises (constructor; nothing is written before they are checked):
        ValueError (also ConfigError, CheckpointError): a bad argument, data, model source, LoRA option, parallel
            layout or output folder.
    """

    def __init__(self, args: TrainArgs):
        import torch

        from kimi_tools.data import PackedLoader, eval_batches
        from kimi_tools.train.parallel import TrainParallel

        self.t_start = time.perf_counter()
        # --resume: an unset --micro-batch-tokens / --batch-tokens is the run's (its tokens per step stay)
        a = self.args = resolve(resume_defaults(args, recorded_args(args.out) if args.resume and args.out else None))
        self.lora_settings = _lora_settings(a) if a.lora_rank is not None else None
        if a.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "--device: cuda asked for (the cudnn backend runs on CUDA), but CUDA is not available here"
            )
        try:
            refuse_adapter_folder(a.checkpoint, "kimi train")
        except CliError as e:
            raise ValueError(str(e)) from None
        self.config = cfg = load_run_config(a)
        self.fingerprint, self.fingerprint_of = fingerprint(a, cfg)
        low_precision = a.optimizer == "adamw-bf16"  # bf16 weights and moments: no fp32 masters
        self.par = par = TrainParallel(
            a.cp, a.device, dp=a.dp, ep=a.ep, pp=a.pp, pp_schedule=a.pp_schedule, pp_layout=a.pp_layout,
            reduce_dtype=a.reduce_dtype, reshard_after_forward=a.reshard_after_forward, bf16_masters=low_precision,
            offload=a.offload, ep_overlap=a.ep_overlap, pp_fsdp=a.pp_fsdp,
        )  # fmt: skip  # torchrun: one mesh; else a no-op
        par.check_pipeline(a, lora=self.lora_settings is not None)
        if a.compile and par.enabled:
            raise ValueError(
                "--compile: got a torchrun launch, expected one process (compiled blocks were not tried under FSDP2, "
                "CP, EP or PP)"
            )
        a.dp = par.dp_size  # resolved: the rest of the world
        if a.batch_tokens is None:  # not typed, nor the resumed run's: one micro-batch per dp group and pipeline
            a.batch_tokens = default_batch_tokens(a.micro_batch_tokens, par.min_microbatches)  # stage
            self.fingerprint, self.fingerprint_of = fingerprint(a, cfg)  # with the tokens per step
        self.out = Path(a.out)
        check_out(a, self.fingerprint, self.fingerprint_of)
        par.barrier()  # every rank has checked --out before rank 0 writes into it

        # ---- data and objective
        self.tokenizer, docs, eval_docs = read_data(a, cfg)
        self.eval_len = check_sizes(a, docs, eval_docs, _eval_source(a))
        self.rows = a.micro_batch_tokens // a.seq_len
        self.accum = a.batch_tokens // a.micro_batch_tokens
        par.check_accum(self.accum, a.micro_batch_tokens, a.seq_len, resumed=a.resume)
        self.num_docs, self.num_tokens = len(docs), sum(map(len, docs))
        self.loader = PackedLoader(docs, a.seq_len, rows=self.rows, seed=a.seed, shuffle=a.shuffle)
        self.evals = eval_batches(eval_docs, self.eval_len, self.rows, a.eval_tokens)
        self.stage = stage = make_stage(a.stage, cfg, a)
        if hasattr(stage, "check_parallel"):
            stage.check_parallel(par.dp_size, par.cp_size)
        if hasattr(stage, "check_data"):
            stage.check_data(docs, a.seq_len)

        # ---- model: build, prepare, LoRA, trainable set, conversion, sharding; then masters and optimizer
        torch.manual_seed(a.seed)
        # under torchrun the model is built on meta and each rank materialises its shards after the sharding (with
        # LoRA, the adapters' one-process initial values taken on meta before apply_lora: lora.initial_adapters)
        sharded_build = par.enabled
        self.model = model = build_model(a, cfg, meta=sharded_build)
        self.base_fingerprint, adapters = None, None
        if self.lora_settings is not None and a.checkpoint is not None and par.is_writer:  # the writer's export
            from kimi_tools.lora import base_fingerprint

            self.base_fingerprint = base_fingerprint(a.checkpoint)
        if hasattr(stage, "prepare"):  # e.g. the distillation stages unfreeze the cudnn backend's indexers
            stage.prepare(model)
        if self.lora_settings is not None:
            from kimi_tools import lora

            adapters = lora.initial_adapters(model, self.lora_settings) if sharded_build else None
            lora.apply_lora(model, self.lora_settings)
        freeze(model, stage, a.freeze)
        self.conversions = convert_model(model, a)
        # context, experts, pipeline stages, recomputation and activation offload, compile, FSDP2: one parallelize
        par.setup(model, lora=self.lora_settings is not None, replicated=getattr(stage, "replicated", None), args=a)
        self.model = model = par.module  # --pp: this rank's pipeline stages (one-process names), sharded over dp
        if sharded_build:
            materialise(model, a, cfg, partial=par.pipe is not None, adapters=adapters)  # each rank its own shards
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("--freeze/--stage: no parameter is left to train")
        # --offload cpu: the host gradients summed outside .grad between micro-batches
        self.host_sums = par.host_grad_sums(model, a.offload)
        if par.pipe is not None:  # taken after each backward action, given back after the schedule's step
            par.pipe.host_sums, self.host_sums = self.host_sums, None
        self.masters = MasterWeights(model, low_precision=low_precision, replicated=par.replicated)
        self.optimizer = build_optimizer(self.masters, a)
        self.scheduler = build_scheduler(
            self.optimizer, warmup_steps=a.warmup_steps, total_steps=a.steps, min_lr_ratio=a.min_lr_ratio
        )
        self.flops_per_token = None
        if a.peak_tflops is not None:
            from kimi.flops import estimate_flops

            self.flops_per_token = estimate_flops(cfg, a.seq_len, backward=True)["flops_per_token"]

        # ---- state
        self.step, self.tokens_seen, self.start, self.start_tokens = 0, 0, 0, 0
        self.checkpointer = Checkpointer(self.out, a.keep, par)
        self.metrics = MetricsLog(self.out / METRICS, writer=par.is_writer)
        self.trainable_params = int(par.sum_pp(self.masters.numel))  # --pp: each rank holds its stages'
        self.total_params = int(par.sum_pp(sum(p.numel() for p in model.parameters())))
        self._save_steps, self._save_minutes = parse_save_every(a.save_every)
        self._last_save = time.monotonic()

    # ------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The ``train_state`` entry of a resume state: step, tokens seen, the CPU (and CUDA) RNG."""
        import torch

        d = {"step": self.step, "tokens_seen": self.tokens_seen, "rng_cpu": torch.get_rng_state()}
        if self.args.device == "cuda":
            d["rng_cuda"] = torch.cuda.get_rng_state()
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        import torch

        self.step, self.tokens_seen = int(d["step"]), int(d["tokens_seen"])
        torch.set_rng_state(d["rng_cpu"])
        if self.args.device == "cuda":
            torch.cuda.set_rng_state(d["rng_cuda"].cpu())

    def states(self) -> dict[str, Any]:
        """The named ``Stateful``s of a ``step-N/`` folder (torchtitan's names): trainable weights (the fp32
        masters), AdamW, the schedule, the data position, this object."""
        return {
            "weights": self.masters,
            "optimizer": OptimizerState(self.masters.module, self.optimizer),
            "lr_scheduler": ScheduleState(self.scheduler),
            "dataloader": self.loader,
            "train_state": self,
        }

    def save(self) -> Path:
        """Write the resume state ``step-{step}/`` (the latest ``--keep`` are kept)."""
        path = self.checkpointer.save(self.step, self.states())
        self._last_save = time.monotonic()
        return path

    def _save_due(self) -> bool:
        """``--save-every``: N steps, or N minutes since the last save."""
        if self._save_steps and self.step % self._save_steps == 0:
            return True
        return bool(self._save_minutes) and time.monotonic() - self._last_save >= 60 * self._save_minutes

    # ------------------------------------------------------------------------------------------ opening the run

    def _open(self) -> None:
        """A fresh run writes ``run.json`` and an empty ``metrics.jsonl`` (``--restart`` first deletes the earlier
        run); ``--resume`` loads the latest complete step and the records up to it."""
        a, par, out = self.args, self.par, self.out
        if a.resume:
            if par.is_writer:
                self.checkpointer.clean_stale()  # what a killed save left (.step-N.tmp-PID/)
            par.barrier()
            self._load_latest()
            if par.is_writer:  # this launch's arguments and layout (which may differ from the run's earlier ones)
                run = json.loads((out / RUN_JSON).read_text(encoding="utf-8"))
                run.update(fingerprint=self.fingerprint, fingerprint_of=self.fingerprint_of, args=asdict(a))
                run["layout"] = self.layout()
                run["launches"] = [*run.get("launches", []), {"start_step": self.step, "layout": run["layout"]}]
                write_atomic(out / RUN_JSON, json.dumps(run, indent=1).encode())
        else:
            if a.restart and par.is_writer:
                restart(out)
            par.barrier()
            if par.is_writer:
                out.mkdir(parents=True, exist_ok=True)
                run = {
                    "fingerprint": self.fingerprint,
                    "fingerprint_of": self.fingerprint_of,
                    "args": asdict(a),
                    "tokenizer": self.tokenizer.name,
                    "trainable_params": self.trainable_params,
                    "total_params": self.total_params,
                    "layout": self.layout(),
                }
                run["launches"] = [{"start_step": 0, "layout": run["layout"]}]
                if self.conversions:
                    run["conversions"] = self.conversions
                write_atomic(out / RUN_JSON, json.dumps(run, indent=1).encode())
                self.metrics.start()
        self.start, self.start_tokens = self.step, self.tokens_seen
        if a.resume and self.start >= (a.stop_after or a.steps):
            if self.start < a.steps:  # stopped early by --stop-after, and asked to stop there again
                raise ValueError(
                    f"--resume: the run in {out} stopped at step {self.start} of {a.steps}, and --stop-after "
                    f"{a.stop_after} ends there too; drop --stop-after (or give a later step) to continue it"
                )
            raise ValueError(
                f"--resume: the run in {out} already finished step {self.start} of {a.steps}; nothing to train (its "
                f"model and metrics are there; choose another --out for a new run)"
            )

    def layout(self) -> dict[str, Any]:
        """The parallel layout this launch runs (``run.json``'s ``layout``): the world size, ``dp``, ``cp``, ``ep``,
        ``pp``, the pipeline schedule and its layer counts per stage (None without ``--pp``), the micro-batches a
        ``dp`` group runs per step, the process group backend (None in one process), and ``fsdp2``: whether FSDP2
        wraps the model (False in one process, and on one rank where it would only copy:
        ``kernels_torch.parallel.parallelize.fsdp_only_copies``)."""
        par = self.par
        return {
            "world": par.pp_size * par.dp_size * par.cp_size,
            "dp": par.dp_size,
            "cp": par.cp_size,
            "ep": par.ep_size,
            "pp": par.pp_size,
            "pp_schedule": self.args.pp_schedule,
            "pp_layout": None if par.pipe is None else [len(r) for r in par.pipe.layout],
            "microbatches_per_dp_group": self.accum // par.dp_size,
            "backend": ("nccl" if par.device == "cuda" else "gloo") if par.enabled else None,
            "fsdp2": par.sharded,
        }

    def _load_latest(self) -> None:
        a, out = self.args, self.out
        start = self.checkpointer.steps()[-1]
        held = self.checkpointer.load(start, self.states())  # ValueError naming a damaged step and the one before
        weights = self.masters.state_dict()
        missing = [f"weights.{n}" for n in weights if f"weights.{n}" not in held]
        missing += [f"train_state.{k}" for k in ("step", "tokens_seen", "rng_cpu") if f"train_state.{k}" not in held]
        if missing:
            raise ValueError(
                f"--resume: {out}/step-{start} lacks {', '.join(missing[:4])} (not a checkpoint of this run)"
            )
        params = dict(zip(self.masters.names, self.masters.masters))
        for n, m in params.items():  # no AdamW state saved: the parameter never had a gradient; nor now
            if m in self.optimizer.state and f"optimizer.state.{n}.step" not in held:
                del self.optimizer.state[m]
        if start == 0:  # step-0 (saved before the first step) holds the placeholder state that DCP's
            self.optimizer.state.clear()  # get_optimizer_state_dict makes with a zero-lr step: a fresh run has none
        if self.step != start:
            raise ValueError(f"--resume: {out}/step-{start} holds step {self.step}, expected {start}")
        if a.stop_after is not None and a.stop_after < start:
            raise ValueError(f"--stop-after: got {a.stop_after}, but the run in {out} is at step {start} already")
        self.metrics.resume(start)
        if self.par.is_writer:
            (out / DIVERGED).unlink(missing_ok=True)  # continuing: a new divergence writes it again

    # ------------------------------------------------------------------------------------------ steps

    def evaluate(self) -> tuple[float, dict[str, float]]:
        """The stage's loss over the eval batches, in eval mode (no dropout) and without gradients, weighted by
        target count: ``(loss, {"eval_<metric>": value})``. The model's train/eval mode is restored."""
        import torch

        model, par, stage = self.model, self.par, self.stage
        was_training = model.training
        model.eval()
        total, n, extra = 0.0, 0, {}
        try:
            with torch.no_grad():
                if par.pipe is not None:  # --pp: forward only through the pipeline (the LM stage's loss)
                    return par.pipeline_eval(self.evals), {}
                for b in self.evals:
                    loss, m = par.loss(stage, model, b.to(self.args.device))
                    k = b.num_targets
                    total, n = total + float(loss) * k, n + k
                    for key, v in m.items():
                        extra[key] = extra.get(key, 0.0) + float(v) * k
        finally:
            model.train(was_training)
            par.reshard(model)  # the units kept gathered after a forward (FSDP2), as after a backward
        keys = sorted(extra)
        sums = par.sum_cp([total, *(extra[k] for k in keys)])  # context parallel: each rank holds its shard's share
        return sums[0] / max(n, 1), {f"eval_{k}": v / max(n, 1) for k, v in zip(keys, sums[1:])}

    def train_step(self) -> dict[str, Any]:
        """One optimizer step (``accum`` micro-batches, each weighted by its share of the step's targets); returns
        its record (appended to the metrics). Raises ValueError after saving the state before it when the loss or
        the gradient norm is not finite (nothing is updated then)."""
        import torch

        a, par, model, stage = self.args, self.par, self.model, self.stage
        step = self.step + 1
        cuda = a.device == "cuda"
        t0 = time.perf_counter()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        before = (self.loader.state_dict(), self.state_dict())  # what step-(step-1) holds, if this step diverges
        batches = [self.loader.next_batch() for _ in range(self.accum)]
        n_tgt = sum(b.num_targets for b in batches)
        step_loss, extra = 0.0, {}
        if par.pipe is not None:  # --pp: this dp group's micro-batches through the pipeline schedule
            step_loss = par.pipeline_step(par.local(batches), n_tgt)
        else:
            local = par.local(batches)  # torchrun: this dp group's micro-batches
            # --offload cpu: the host gradients are taken out of .grad after each backward but the last (so that
            # FSDP2 copies each one the fast way, kernels_torch.parallel.fsdp.HostGradSums) and given back after it
            sums = self.host_sums if len(local) > 1 else None
            try:
                for i, b in enumerate(local):
                    w = b.num_targets / n_tgt if n_tgt else 0.0
                    loss, m = par.loss(stage, model, b.to(a.device))
                    (loss * w).backward()
                    if sums is not None and i < len(local) - 1:
                        sums.take()
                    step_loss += float(loss.detach()) * w
                    for key, v in m.items():
                        extra[key] = extra.get(key, 0.0) + float(v) * w
            finally:
                if sums is not None:
                    sums.give_back()
            par.reduce_replicated()
            par.reshard(model)  # units a no-grad forward left gathered (the distillation stages' teacher pass)
            step_loss = par.sum_all(step_loss)
            extra = par.sum_all_dict(extra)
        if self.lora_settings is not None and step == self.start + 1:  # LoRA is never silently skipped (vLLM's bug)
            from kimi_tools import lora

            skipped = lora.adapters_without_gradient(model)
            if skipped:
                raise ValueError(
                    f"LoRA: the adapters of {', '.join(skipped[:4])} got no gradient on backend {a.backend} "
                    "(a code path reads the base weight around them); refusing to train"
                )
        self.masters.grads_to_masters()
        grad_norm = clip_grad_norm(
            self.masters.masters, a.grad_clip if a.grad_clip > 0 else math.inf, sum_group=par.norm_group
        )
        if not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
            self._diverged(step, step_loss, grad_norm, before)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the lr this step applies (torchao's: a tensor)
        step_optimizer(self.optimizer, a, step, par.rank)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.masters.to_model()  # masters down to the model (a no-op in fp32)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n_tok = sum(b.num_tokens for b in batches)
        self.step, self.tokens_seen = step, self.tokens_seen + n_tok
        tps = n_tok / dt
        rec = {
            "step": step,
            "loss": step_loss,
            "eval_loss": None,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tps,
            "mfu": None if self.flops_per_token is None else self.flops_per_token * tps / (a.peak_tflops * 1e12),
            "peak_mem_bytes": peak_mem_bytes(a.device),
            **({"fp8": a.fp8} if a.fp8 else {}),
            **extra,
        }
        if step == a.steps or (a.eval_every and step % a.eval_every == 0):
            rec["eval_loss"], ev_extra = self.evaluate()
            rec.update(ev_extra)
        self.metrics.append(rec)
        return rec

    def _diverged(self, step: int, loss: float, grad_norm: float, before) -> None:
        """Nothing has been updated yet (the optimizer steps after the check), so the model, AdamW and the schedule
        are those of step - 1: put the data position and RNG back too and save them as step-(step - 1), the folder
        then being what ``--stop-after step-1`` leaves, plus ``diverged.json``. Raises ValueError."""
        a, par, out = self.args, self.par, self.out
        self.optimizer.zero_grad(set_to_none=True)
        self.masters.zero_grad()
        self.loader.load_state_dict(before[0])
        self.load_state_dict(before[1])
        good = step - 1
        if a.save and good not in self.checkpointer.steps():
            self.save()
        if par.is_writer:
            note = {"step": step, "loss": loss, "grad_norm": grad_norm, "last_good_step": good}
            write_atomic(out / DIVERGED, json.dumps(note).encode())
            if a.plot:
                plot_losses(out / "loss.png", self.metrics.history)
        par.close()
        kept = (
            f"step-{good}/ (the run up to step {good}: --resume continues from it), "
            if a.save
            else "no weights (--no-save) but "
        )
        raise ValueError(
            f"step {step}: the loss is {loss} (gradient norm {grad_norm}), not finite: training stopped; "
            f"{out} keeps {kept}metrics.jsonl and {DIVERGED}; for another try, a lower --lr in a new --out"
        )

    # ------------------------------------------------------------------------------------------ the run

    def run(self) -> TrainResult:
        """Open the run folder, train to ``--stop-after`` or ``--steps``, save and export (module docstring).

        Raises:
            ValueError: a resume that cannot continue (damaged or mismatched state), a diverged step.
            TrainInterrupted: a SIGINT / SIGTERM stopped the run after a finished step (resume state saved).
        """
        from tqdm.auto import tqdm

        a, par = self.args, self.par
        self._open()
        stop = a.stop_after or a.steps
        self._print_header()
        self.model.train()
        quiet_signals = a.quiet or not par.is_writer
        with StopRequest(on_first=lambda name: note(name, quiet_signals)) as stops:
            if self.start == 0 and not self.metrics.history:  # (a resume from step-0 has its record)
                ev, ev_extra = self.evaluate()
                self.metrics.append({"step": 0, **dict.fromkeys(RECORD_KEYS[1:]), "eval_loss": ev, **ev_extra})
            bar = tqdm(
                total=stop, initial=self.start, desc="train", unit="step", disable=a.quiet or not par.is_writer,
                file=sys.stderr,
            )  # fmt: skip
            with contextlib.closing(bar):
                (stop_now,) = par.any_rank(stops.requested)  # a signal during the step-0 evaluation
                while not stop_now and self.step < stop:
                    rec = self.train_step()
                    if rec["eval_loss"] is not None and not a.quiet and par.is_writer:
                        bar.write(f"step {self.step}: eval loss {rec['eval_loss']:.4f}")
                    bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
                    bar.update(1)
                    stop_now, due = par.any_rank(stops.requested, self._save_due())
                    if a.save and (due or self.step == stop):
                        self.save()
                    if a.save and self.step == a.steps:
                        export(self.model, self.out, par, self.lora_settings, a.checkpoint, self.base_fingerprint)
            if stop_now and self.step < stop:
                if a.save and self.step not in self.checkpointer.steps():
                    self.save()
                if a.plot and par.is_writer:
                    plot_losses(self.out / "loss.png", self.metrics.history)
                par.close()
                raise TrainInterrupted(self.step, a.steps, self.out, saved=a.save, signum=stops.signum)
        if a.plot and par.is_writer:
            plot_losses(self.out / "loss.png", self.metrics.history)
        result = TrainResult(
            out=self.out,
            start_step=self.start,
            step=self.step,
            tokens_seen=self.tokens_seen,
            records=self.metrics.records,
            eval_losses=self.metrics.eval_losses(),
            trainable_params=self.trainable_params,
            total_params=self.total_params,
            wall_s=time.perf_counter() - self.t_start,
        )
        if not a.quiet and par.is_writer:
            print(self._summary(result), flush=True)
        par.close()
        return result

    def _print_header(self) -> None:
        a, cfg = self.args, self.config
        if a.quiet or not self.par.is_writer:
            return
        source = f"checkpoint {a.checkpoint}" if a.checkpoint else f"preset {a.preset} (random init, seed {a.seed})"
        print(
            f"kimi train: {source}, {cfg.num_hidden_layers} layers, {self.trainable_params:,} of "
            f"{self.total_params:,} parameters trained"
            + (f" (LoRA rank {a.lora_rank})" if self.lora_settings is not None else "")
            + (f"; stage {a.stage}" if a.stage != "lm" else "")
            + f"; backend {a.backend}, {a.dtype}, {a.device}"
            + (f", {a.optimizer} (torchao, stochastic rounding)" if a.optimizer == "adamw-bf16" else "")
            + (f", offload {a.offload}" if a.offload != "none" else "")
            + (f", recompute ({a.recompute_mode}{_kinds(a.recompute_layers)})" if a.recompute else "")
            + (f", compiled blocks ({a.compile_backend})" if a.compile else "")
            + (f", the first {a.recompute_full_layers} layers whole" if a.recompute_full_layers else "")
            + (
                f", activations offloaded to the host ({a.offload_activations}{_kinds(a.offload_layers)})"
                if a.offload_activations != "none"
                else ""
            )
            + "".join(f"; {c}" for c in self.conversions)
            + f"\n  data: {self.num_docs} documents, {self.num_tokens:,} tokens ({self.tokenizer.name}); eval "
            f"{sum(b.num_tokens for b in self.evals):,} tokens"
            + (f" (one row: fewer than --seq-len {a.seq_len})" if self.eval_len < a.seq_len else "")
            + f"; {a.batch_tokens:,} tokens per step "
            f"({self.accum} x {self.rows} rows of {a.seq_len}); "
            + (
                "no resume state (--no-save)"
                if not a.save
                else "resume state at the end and on Ctrl-C"
                if (self._save_steps, self._save_minutes) == (0, 0.0)
                else f"resume state every {a.save_every}" + (" steps" if self._save_steps else "")
            )
            + (f"\n  resumed from {self.out}/step-{self.start}" if a.resume else "")
            + (f"\n  {self._layout_line()}" if self.par.enabled else "")
            + (
                f"\n  compiling the decoder blocks ({a.compile_backend}) on their first forward: the step-0 evaluation "
                "and step 1 take longer"
                if a.compile
                else ""
            ),
            flush=True,
        )

    def _layout_line(self) -> str:
        """The header's line of the parallel layout (under torchrun), as torchtitan logs its mesh at start-up."""
        lay = self.layout()
        n = lay["microbatches_per_dp_group"]
        line = (
            f"parallel: world {lay['world']} = "
            + f"pp {lay['pp']} x " * (lay["pp"] > 1)
            + f"dp {lay['dp']} x cp {lay['cp']}"
            + f", ep {lay['ep']}" * (lay["ep"] > 1)
            + f" ({lay['backend']}); {n} micro-batch{'es' * (n > 1)} per data-parallel group and step"
        )
        if lay["pp_layout"] is not None:
            line += f"; pipeline {lay['pp_schedule']}, layers per stage {','.join(map(str, lay['pp_layout']))}"
        return line

    def _summary(self, result: TrainResult) -> str:
        """The closing lines: losses, where the eval loss went, and what was written."""
        a = self.args
        evals = result.eval_losses
        first, last = min(evals), max(evals)
        if first == last:  # one evaluation only (e.g. --stop-after before the first --eval-every step)
            nxt = min(a.steps, (last // a.eval_every + 1) * a.eval_every) if a.eval_every else a.steps
            ev = f"eval loss {evals[first]:.4f} (step {first}; the next evaluation is at step {nxt})"
        else:
            ev = f"eval loss {evals[first]:.4f} (step {first}) -> {evals[last]:.4f} (step {last})"
        loss = result.final_loss if result.final_loss is not None else float("nan")
        ran = result.tokens_seen - self.start_tokens  # this launch's tokens, over this launch's time
        tokens = f"{ran:,} tokens in {result.wall_s:.0f} s" + (
            f" (step{'s' * (result.step > result.start_step + 1)} {result.start_step + 1}"
            + f" to {result.step}" * (result.step > result.start_step + 1)
            + f"; {result.tokens_seen:,} in all)"
            if result.start_step
            else ""
        )
        head = f"step {result.step}/{a.steps}" + (" (--stop-after)" if result.step < a.steps else "")
        if not a.save:
            what = "no weights or resume state (--no-save)"
        elif result.step < a.steps:
            what = (
                f"step-{result.step}/ (resume state; the model is written at step {a.steps}: run the same command "
                "with --resume and without --stop-after)"
            )
        else:
            kind = (
                "adapter (adapter_config.json, adapter_model.safetensors)"
                if self.lora_settings
                else "model (safetensors)"
            )
            what = f"{kind}, step-{result.step}/ (resume state)"
        return f"{head}: loss {loss:.4f}; {ev}; {tokens}\nwrote {self.out}: {what}, metrics.jsonl" + (
            ", loss.png" if a.plot else ""
        )


def train(args: TrainArgs) -> TrainResult:
    """Run (or resume) a training run: ``Trainer(args).run()``; see :mod:`kimi_tools.train`.

    Raises:
        ValueError (also ConfigError, CheckpointError): a bad argument, data, model source, LoRA option or output
            folder, before anything is written; a damaged resume state; a non-finite loss or gradient norm during
            training (after the last good step is saved).
        TrainInterrupted: SIGINT / SIGTERM: the step finished, its resume state saved (``KeyboardInterrupt``).
    """
    return Trainer(args).run()
