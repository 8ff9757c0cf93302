"""The run folder: resume states (``step-N/``), ``run.json``, the final export, and what ``--resume`` /
``--restart`` check.

* **Resume states** (:class:`Checkpointer`, torchtitan's DCP checkpointer): named ``Stateful``s saved by
  ``torch.distributed.checkpoint`` into ``step-N/``, written to a temporary folder and renamed, so a folder is
  complete exactly when it holds its ``.metadata``; the latest ``--keep`` are kept. Before a resume loads one,
  :meth:`Checkpointer.damage` checks that every file the ``.metadata`` names is there and long enough, so a
  truncated ``*.distcp`` is named instead of ending in a bare ``EOFError``; a shard damaged inside (same size) fails
  the read, which is reported the same way, naming the step and the previous complete one. A save that fails
  (a full disk: :class:`kimi.checkpoint.DiskFullError`) removes its temporary folder; one killed mid-save leaves
  ``.step-N.tmp-PID/``, removed when the run resumes (:meth:`Checkpointer.clean_stale`).
* **The export** (:func:`export`): the model in the HF safetensors layout (``kernels_torch.model.save_model``; under
  torchrun gathered from the shards) plus the base's tokenizer files, or with LoRA peft's two adapter files. It is
  written once, when the run reaches ``--steps``: an interrupted, stopped (``--stop-after``) or diverged run leaves
  its resume state and no model, so nothing in the folder looks like a final model that is not one.
* **The folder** (:func:`check_out`, :func:`restart`): a new run needs an empty or absent ``--out``; ``--resume``
  needs ``run.json`` with the same fingerprint and a complete step; ``--restart`` deletes what an earlier run
  wrote (only the trainer's own files) and starts again.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kimi.checkpoint import DiskFullError, is_disk_full
from kimi_tools.common import TOKENIZER_FILES, copy_tokenizer

if TYPE_CHECKING:
    from torch import nn

    from kimi_tools.train.args import TrainArgs

__all__ = [
    "Checkpointer",
    "DIVERGED",
    "RUN_JSON",
    "METRICS",
    "check_out",
    "recorded_args",
    "restart",
    "export",
    "run_files",
]

RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
DIVERGED = "diverged.json"  # written beside step-N when a step's loss or gradient norm is not finite


class Checkpointer:
    """``step-N/`` DCP folders in ``out`` (module docstring). ``par``: the run's
    :class:`kimi_tools.train.parallel.TrainParallel` (all ranks write their shards into one folder; rank 0 renames it)."""

    def __init__(self, out: str | Path, keep: int = 2, par=None):
        self.out, self.keep, self.par = Path(out), keep, par

    def steps(self) -> list[int]:
        """The steps with a complete folder (one holding its ``.metadata``), oldest first."""
        found = []
        for p in self.out.glob("step-*"):
            tail = p.name.removeprefix("step-")
            if tail.isdigit() and (p / ".metadata").is_file():
                found.append(int(tail))
        return sorted(found)

    def save(self, step: int, states: dict[str, Any]) -> Path:
        """Write ``states`` (name -> ``Stateful`` or tensor dict) as ``step-{step}/``; returns its path."""
        import torch.distributed.checkpoint as dcp

        final = self.out / f"step-{step}"
        par = self.par if self.par is not None and self.par.enabled else None
        tmp = self.out / (f".step-{step}.tmp" if par else f".step-{step}.tmp-{os.getpid()}")  # one folder, all ranks
        if par is None or par.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
        if par is not None:
            par.barrier()
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp.save(states, checkpoint_id=str(tmp))
        except BaseException as e:  # DCP raises CheckpointException, a BaseException, wrapping each rank's error
            if par is None or par.is_writer:
                shutil.rmtree(tmp, ignore_errors=True)  # no half-written .step-N.tmp folder stays behind
            code = is_disk_full(e)
            if code:
                raise DiskFullError(final, code, what=f"saving the resume state of step {step} as") from None
            raise
        if par is not None:
            par.barrier()
            if not par.is_writer:
                par.barrier()
                return final
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.out / f"step-{old}", ignore_errors=True)
        if par is not None:
            par.barrier()
        return final

    def damage(self, step: int) -> str | None:
        """What is wrong with ``step-{step}/``, in a few words naming the file, or None when every file its
        ``.metadata`` lists is present and holds the bytes the metadata says (a size check: no file is read)."""
        from torch.distributed.checkpoint import FileSystemReader

        path = self.out / f"step-{step}"
        try:
            md = FileSystemReader(str(path)).read_metadata()
        except Exception as e:  # noqa: BLE001 - a torn .metadata raises pickle's or torch's own error types
            return f".metadata cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'empty'})"
        need: dict[str, int] = {}
        for info in (md.storage_data or {}).values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        for name in sorted(need):
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            size = f.stat().st_size
            if size < need[name]:
                return f"{name} holds {size:,} bytes where its .metadata needs {need[name]:,} (a write cut short)"
        return None

    def load(self, step: int, states: dict[str, Any]) -> set[str]:
        """Load ``step-{step}`` into ``states`` in place; returns the flat keys the checkpoint holds.

        Every part of ``states`` must be there whole (:meth:`lacking`): a step without its AdamW state, schedule,
        data position, ... is refused, since loading it would silently restart that part. The one exception is the
        AdamW state of a single parameter (``optimizer.state.<name>.*``): a parameter that never received a gradient
        (e.g. layer 0's unused AttnRes mix) has none; the caller checks those.

        Raises:
            ValueError: the step is damaged (:meth:`damage`, or a read that fails) or incomplete (:meth:`lacking`),
                naming the file where known and the previous complete step.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        problem = self.damage(step)
        path = str(self.out / f"step-{step}")
        if problem is None:
            try:
                saved = FileSystemReader(path).read_metadata().state_dict_metadata
                for name, st in states.items():  # a part whose form changed over time reads the one written
                    if hasattr(st, "match_saved"):
                        st.match_saved(saved, f"{name}.")
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*single process.*")
                    dcp.load(states, checkpoint_id=path, planner=(planner := _noting_planner()))
                self._expected = set(planner.expected)  # the flat keys of `states`, for lacking()
                lacks = self.lacking(step)
                if lacks:
                    raise ValueError(self.damaged_message(step, lacks))
                return set(FileSystemReader(path).read_metadata().state_dict_metadata)
            except (KeyboardInterrupt, SystemExit, ValueError):
                raise
            except BaseException as e:  # noqa: BLE001 - a damaged shard: EOFError, pickle or torch errors, wrapped
                problem = f"reading it failed ({_first_failure(e)})"  # in DCP's CheckpointException (a BaseException)
        raise ValueError(self.damaged_message(step, problem))

    _expected: set[str] = set()  # the flat keys of the states last loaded (load): what a complete step holds

    def lacking(self, step: int) -> str | None:
        """What ``step-{step}/.metadata`` lacks of the states last given to :meth:`load`, in a few words (each part,
        what it is, how many of its keys and the first), or None when it holds every key of them except per-parameter
        AdamW states ``optimizer.state.<name>.*`` (none for a parameter without gradients; at least one is needed)."""
        from torch.distributed.checkpoint import FileSystemReader

        try:
            held = set(FileSystemReader(str(self.out / f"step-{step}")).read_metadata().state_dict_metadata)
        except Exception:  # noqa: BLE001 - a torn .metadata: damage() names it
            return None
        per_param = "optimizer.state."
        missing = sorted(k for k in self._expected - held if not k.startswith(per_param))
        if any(k.startswith(per_param) for k in self._expected) and not any(k.startswith(per_param) for k in held):
            missing.append(per_param + "*")
        if not missing:
            return None
        parts: dict[str, list[str]] = {}
        for k in missing:
            parts.setdefault(k.partition(".")[0], []).append(k)
        said = " and ".join(
            f"{name} ({_PARTS.get(name, 'a part of the run state')}: {len(keys)} key{'s' * (len(keys) > 1)}, "
            f"e.g. {keys[0]})"
            for name, keys in parts.items()
        )
        them = "those parts" if len(parts) > 1 else "it"
        return f".metadata lacks {said}, so resuming would silently start {them} afresh"

    def clean_stale(self) -> list[Path]:
        """Remove what a killed save left in ``out``: ``.step-N.tmp-PID/`` folders (and ``write_atomic``'s
        ``.NAME.tmp-PID-XXXX`` files) whose process is gone, and the ``.step-N.tmp/`` of a torchrun save (called as
        a run starts, when no save of it is under way). Returns the paths removed."""
        gone = []
        if not self.out.is_dir():
            return gone
        for p in self.out.iterdir():
            name = p.name
            if not name.startswith(".") or ".tmp" not in name:
                continue
            tail = name.rpartition(".tmp")[2]
            if tail == "" and name.startswith(".step-"):
                stale = True  # the shared folder of a torchrun save
            elif tail.startswith("-") and tail[1:].split("-")[0].isdigit():
                pid = int(tail[1:].split("-")[0])
                stale = pid == os.getpid() or not _alive(pid)  # our own pid: reused, as nothing of ours is saving
            else:
                continue
            if stale:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                gone.append(p)
        return gone

    def damaged_message(self, step: int, problem: str) -> str:
        """One line: the damaged step, what is wrong, and the previous complete step to go back to (or none)."""
        earlier = [s for s in self.steps() if s < step and self.damage(s) is None and self.lacking(s) is None]
        where = self.out / f"step-{step}"
        if earlier:
            offer = (
                f"the previous complete step is step-{earlier[-1]}: remove {where} (rm -r) and run the same command "
                f"with --resume to continue from step {earlier[-1]}"
            )
        else:
            offer = "there is no earlier complete step; start the run again with --restart"
        return f"--resume: {where} is damaged: {problem}; {offer}"


# The parts of a resume state (the trainer's ``states()``), as a message names them.
_PARTS = {
    "weights": "the trainable weights",
    "optimizer": "the AdamW state",
    "lr_scheduler": "the learning-rate schedule",
    "dataloader": "the data position",
    "train_state": "the step, token count and RNG state",
}


def _noting_planner():
    """DCP's default load planner with partial loads allowed (:meth:`Checkpointer.load` checks what is missing),
    noting the flat keys of the state it loads into (``.expected``)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        expected: tuple[str, ...] = ()

        def create_local_plan(self):
            self.expected = tuple(self.state_dict)  # flattened by set_up_planner, as the plan reads them
            return super().create_local_plan()

    return Planner(allow_partial_load=True)


def _first_failure(e: BaseException) -> str:
    """``Type: message`` of a failed read, in one line: for DCP's ``CheckpointException`` (whose text is a
    traceback) the first rank's own exception."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return type(e).__name__ + (": " + lines[-1][:200] if lines else "")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_out(a: TrainArgs, fingerprint: str, body: dict) -> None:
    """Check ``--out`` for the run before anything is written.

    Raises:
        ValueError: ``--resume`` without ``run.json``, with another fingerprint (naming each differing setting and
            config key with both values), or without a complete step; a non-empty folder without ``--resume`` or
            ``--restart``; ``--restart`` on a folder that is not a ``kimi train`` run or holds other files.
    """
    from kimi_tools.train.args import as_flags, diff_json, numbers_args

    out = Path(a.out)
    if a.resume:
        run_json = out / RUN_JSON
        if not run_json.is_file():
            if out.exists() and (not out.is_dir() or any(out.iterdir())):
                raise ValueError(_not_a_run(out, "--resume"))
            raise ValueError(f"--resume: {out} holds no run (no {RUN_JSON}); start it without --resume")
        saved = json.loads(run_json.read_text(encoding="utf-8"))
        was = saved.get("fingerprint_of", {})
        was_args = numbers_args(was.get("args", {})) if isinstance(was.get("args"), dict) else {}
        flags = [
            f"--{k.replace('_', '-')} ({v}"
            for k, _, v in (
                d.partition(" (") for d in diff_json(as_flags(was_args), as_flags(numbers_args(body["args"])))
            )
        ]
        cfg_diffs = diff_json(was.get("config", {}), body["config"])
        # an older run.json hashed fields that are run control now (the micro-batch, --compile): its recorded
        # settings, less those, equal to today's are the same run
        if saved.get("fingerprint") != fingerprint and (flags or cfg_diffs or not was):
            parts = []
            for what, diffs in (("another model config", cfg_diffs), ("other settings", flags)):
                if diffs:
                    more = f"; and {len(diffs) - 4} more" if len(diffs) > 4 else ""
                    parts.append(f"{what}: {'; '.join(diffs[:4])}{more}")
            batch = (
                "; --batch-tokens is the run's tokens per step, which a resume keeps: leave it out (the run's value "
                "is taken) and deal it to another layout with --micro-batch-tokens"
                if any(f.startswith("--batch-tokens ") for f in flags)
                else ""
            )
            raise ValueError(
                f"--resume: {out} holds a run with "
                + (" and ".join(parts) or "another fingerprint (run.json has no readable record of its settings)")
                + f"; resume with the run's own settings (the layout, --micro-batch-tokens, --compile and --recompute "
                f"may change), or choose another --out{batch}"
            )
        if not Checkpointer(out).steps():
            raise ValueError(
                f"--resume: {out} has no complete step-N resume state (the run ended before its first save); "
                f"start it again from scratch with --restart"
            )
        return
    if a.restart:
        restart(out, dry_run=True)
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if (out / RUN_JSON).is_file():
            raise ValueError(
                f"--out: {out} exists and is not empty: it holds a run; pass --resume to continue it, --restart to "
                "start it again from scratch (deleting it), or choose another --out"
            )
        raise ValueError(_not_a_run(out, "--out"))


def recorded_args(out: str | Path) -> dict | None:
    """The ``args`` that ``run.json`` in ``out`` records (the resolved arguments of the run's latest launch), or
    None when there is no readable record (:func:`check_out` then says what is wrong)."""
    try:
        args = json.loads((Path(out) / RUN_JSON).read_text(encoding="utf-8")).get("args")
    except (OSError, ValueError, AttributeError):
        return None
    return args if isinstance(args, dict) else None


def _not_a_run(out: Path, flag: str) -> str:
    """The one answer for a non-empty ``--out`` that is no run, with or without ``--resume``: nothing there to
    resume or restart, so another folder."""
    what = "is a file" if not out.is_dir() else f"holds files but no {RUN_JSON}"
    return (
        f"{flag}: {out} {what}, so it is no kimi train run (nothing to --resume or --restart there); choose "
        "another --out (a new or empty folder) and start the run without --resume"
    )


def run_files(out: Path) -> list[Path]:
    """The entries of ``out`` a ``kimi train`` run writes: run.json, metrics, plot, divergence marker, resume states
    (and their temporary folders), the export (config, safetensors shards and index, adapter files, tokenizer)."""
    names = {RUN_JSON, METRICS, "loss.png", DIVERGED, "config.json", "adapter_config.json", *TOKENIZER_FILES}
    names.add("adapter_model.safetensors")
    found = []
    for p in sorted(out.iterdir()):
        n = p.name
        if (
            n in names
            or n.startswith(("step-", ".step-", "tokenizer"))
            or (n.startswith("model") and ".safetensors" in n)
            or (n.startswith(".") and ".tmp-" in n)
        ):
            found.append(p)
    return found


def restart(out: str | Path, dry_run: bool = False) -> list[Path]:
    """``--restart``: delete what an earlier run wrote in ``out`` (:func:`run_files`), so the run starts again from
    scratch there. ``dry_run`` only checks. Returns the entries (to be) removed.

    Raises:
        ValueError: ``out`` is a file, holds no ``run.json`` (not a ``kimi train`` folder: nothing is deleted), or
            holds files no run writes (named; nothing is deleted).
    """
    out = Path(out)
    if not out.exists():
        return []
    if not out.is_dir():
        raise ValueError(f"--restart: {out} is a file, expected a run folder")
    entries = list(out.iterdir())
    if not entries:
        return []
    if not (out / RUN_JSON).is_file():
        raise ValueError(f"--restart: {out} holds no {RUN_JSON}, so it is no kimi train run; refusing to delete it")
    mine = run_files(out)
    other = sorted(set(entries) - set(mine))
    if other:
        raise ValueError(
            f"--restart: {out} also holds {other[0].name!r}"
            + (f" and {len(other) - 1} more" if len(other) > 1 else "")
            + ", which no run writes; move it away first (nothing was deleted)"
        )
    if not dry_run:
        for p in mine:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
    return mine


def export(model: nn.Module, out: Path, par, lora_settings=None, checkpoint: str | None = None, base=None) -> str:
    """Write the trained model into ``out``: with LoRA (``lora_settings``) the adapter in peft's two files
    (``kimi_tools.lora.save_adapter``, the base's fingerprint ``base`` recorded), else the model in the HF safetensors
    layout (``kernels_torch.model.save_model``; gathered from the shards under torchrun) and the tokenizer files of
    ``checkpoint``. Returns what was written, in words."""
    if lora_settings is not None:
        from kimi_tools import lora

        tensors = lora.adapter_state_dict(model)  # every rank: gathers the FSDP2 shards (a collective)
        if par.is_writer:
            lora.save_adapter(
                model, lora_settings, out, base_checkpoint=checkpoint, base_fingerprint=base, tensors=tensors
            )
        return "adapter (adapter_config.json, adapter_model.safetensors)"
    par.save_model(model, out)
    if par.is_writer:
        copy_tokenizer(checkpoint, out)
    return "model (safetensors)"
