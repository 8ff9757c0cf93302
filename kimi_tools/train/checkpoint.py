"""The run folder: resume states (``step-N/``), ``run.json``, the final export, and what ``--resume`` /
``--restart`` check.

* **Resume states** (:class:`Checkpointer`, torchtitan's DCP checkpointer): named ``Stateful``s saved by
  ``torch.distributed.checkpoint`` into ``step-N/``, written to a temporary folder and renamed, so a folder is
  complete exactly when it holds its ``.metadata``; the latest ``--keep`` are kept. Before a resume loads one,
  :meth:`Checkpointer.damage` checks that every file the ``.metadata`` names is there and long enough, so a
  truncated ``*.distcp`` is named instead of ending in a bare ``EOFError``.
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

from kimi_tools.common import TOKENIZER_FILES, copy_tokenizer

if TYPE_CHECKING:
    from torch import nn

    from kimi_tools.train.args import TrainArgs

__all__ = ["Checkpointer", "DIVERGED", "RUN_JSON", "METRICS", "check_out", "restart", "export", "run_files"]

RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
DIVERGED = "diverged.json"  # written beside step-N when a step's loss or gradient norm is not finite


class Checkpointer:
    """``step-N/`` DCP folders in ``out`` (module docstring). ``par``: the run's
    :class:`kimi_tools.parallel.TrainParallel` (all ranks write their shards into one folder; rank 0 renames it)."""

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
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save(states, checkpoint_id=str(tmp))
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

        Partial loads are allowed because a parameter that never received a gradient (e.g. layer 0's unused
        AttnRes mix) has no AdamW state in the checkpoint; the caller checks the rest.

        Raises:
            ValueError: the step is damaged (:meth:`damage`, or a read that fails), naming the file where known and
                the previous complete step.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        problem = self.damage(step)
        path = str(self.out / f"step-{step}")
        if problem is None:
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*single process.*")
                    dcp.load(states, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
                return set(FileSystemReader(path).read_metadata().state_dict_metadata)
            except (KeyboardInterrupt, ValueError):
                raise
            except Exception as e:  # noqa: BLE001 - a damaged shard raises EOFError, pickle or torch errors
                first = str(e).strip().splitlines()
                problem = f"reading it failed ({type(e).__name__}{': ' + first[-1][:200] if first else ''})"
        raise ValueError(self.damaged_message(step, problem))

    def damaged_message(self, step: int, problem: str) -> str:
        """One line: the damaged step, what is wrong, and the previous complete step to go back to (or none)."""
        earlier = [s for s in self.steps() if s < step and self.damage(s) is None]
        where = self.out / f"step-{step}"
        if earlier:
            offer = (
                f"the previous complete step is step-{earlier[-1]}: remove {where} (rm -r) and run the same command "
                f"with --resume to continue from step {earlier[-1]}"
            )
        else:
            offer = "there is no earlier complete step; start the run again with --restart"
        return f"--resume: {where} is damaged: {problem}; {offer}"


def check_out(a: TrainArgs, fingerprint: str, body: dict) -> None:
    """Check ``--out`` for the run before anything is written.

    Raises:
        ValueError: ``--resume`` without ``run.json``, with another fingerprint (naming each differing setting and
            config key with both values), or without a complete step; a non-empty folder without ``--resume`` or
            ``--restart``; ``--restart`` on a folder that is not a ``kimi train`` run or holds other files.
    """
    from kimi_tools.train.args import as_flags, diff_json

    out = Path(a.out)
    if a.resume:
        run_json = out / RUN_JSON
        if not run_json.is_file():
            raise ValueError(f"--resume: {out} holds no run (no {RUN_JSON}); start it without --resume")
        saved = json.loads(run_json.read_text(encoding="utf-8"))
        if saved.get("fingerprint") != fingerprint:
            was = saved.get("fingerprint_of", {})
            flags = [
                f"--{k.replace('_', '-')} ({v}"
                for k, _, v in (
                    d.partition(" (") for d in diff_json(as_flags(was.get("args", {})), as_flags(body["args"]))
                )
            ]
            parts = []
            cfg_diffs = diff_json(was.get("config", {}), body["config"])
            for what, diffs in (("another model config", cfg_diffs), ("other settings", flags)):
                if diffs:
                    more = f"; and {len(diffs) - 4} more" if len(diffs) > 4 else ""
                    parts.append(f"{what}: {'; '.join(diffs[:4])}{more}")
            raise ValueError(
                f"--resume: {out} holds a run with "
                + (" and ".join(parts) or "another fingerprint (run.json has no readable record of its settings)")
                + "; resume with the run's own settings, or choose another --out"
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
        raise ValueError(
            f"--out: {out} exists and is not empty; pass --resume to continue the run there, or choose another --out"
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
