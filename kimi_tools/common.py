"""What the ``kimi`` subcommands share: one-line user errors, argument types, the checkpoint and token source.

Every subcommand module (``cli``, and the tools that add commands: train, generate, ablate, lora) takes its
``--preset`` / ``--checkpoint`` / ``--text`` handling from here, so that the options mean the same everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

from kimi.checkpoint import write_atomic
from kimi.config import PRESETS, KimiConfig, load_config

__all__ = [
    "CliError",
    "Parser",
    "positive_int",
    "add_source",
    "apply_overrides",
    "set_item_error",
    "DEFAULT_TEXT",
    "Progress",
    "materialise_checkpoint",
    "write_random_init",
    "human_bytes",
    "Interrupted",
    "stop_on_signals",
    "is_quiet_rank",
    "check_out_folder",
    "check_out_file",
    "refuse_adapter_folder",
    "token_ids",
    "copy_tokenizer",
]


class CliError(Exception):
    """A user error with a one-line message."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors in the same form as every other failure (``kimi: error: ...``, exit 2);
    ``--help`` still shows the usage."""

    def error(self, message: str):  # type: ignore[override]
        """Print ``kimi: error: <message> (see `<prog> --help`)`` on stderr and exit with status 2 (silently on a
        torchrun rank other than 0: :func:`is_quiet_rank`)."""
        self.exit(2, None if is_quiet_rank() else f"kimi: error: {message} (see `{self.prog} --help`)\n")


def positive_int(s: str) -> int:
    """argparse type: an integer >= 1. Raises ``argparse.ArgumentTypeError`` naming the value otherwise."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {s!r}, expected a positive integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"got {v}, expected a positive integer (>= 1)")
    return v


def add_source(p: argparse.ArgumentParser, config_file: bool = True) -> None:
    """Add the mutually exclusive ``--preset NAME`` / ``--config FILE`` (when ``config_file``) / ``--checkpoint DIR``
    options to ``p`` (none given means the ``tiny`` preset)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", choices=sorted(PRESETS), help="a built-in config (default: tiny)")
    if config_file:
        g.add_argument("--config", metavar="FILE", help="a config.json")
    g.add_argument("--checkpoint", metavar="DIR", help="a checkpoint directory (config.json + safetensors)")


def set_item_error(item: str, fields, form: str) -> CliError:
    """The one-line error for a ``--set`` item without ``=`` or with a key that is no config field: the close
    matches of the key (``difflib``) and the valid keys."""
    import difflib

    key, sep, _ = item.partition("=")
    if not sep:
        return CliError(f"--set: got {item!r}, expected {form} (e.g. num_experts=16)")
    close = difflib.get_close_matches(key, fields, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return CliError(
        f"--set: got {item!r}, expected {form} with key one of the config fields{hint} "
        f"(valid keys: {', '.join(sorted(fields))})"
    )


def apply_overrides(cfg: KimiConfig, sets: Sequence[str]) -> KimiConfig:
    """``--set key=value``: override KimiConfig fields (value parsed as JSON, else a string).

    Raises:
        CliError: an item without ``=`` or an unknown key (naming the close matches and the valid keys).
        ConfigError: a value the config refuses.
    """
    fields = {f.name for f in cfg.__dataclass_fields__.values()} - {"raw"}
    changes: dict[str, Any] = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise set_item_error(item, fields, "key=value")
        try:
            v = json.loads(value)
        except json.JSONDecodeError:
            v = value
        if key.endswith("_layers") and isinstance(v, list):
            v = tuple(v)
        changes[key] = v
    return cfg.replace(**changes) if changes else cfg


DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "kimi" / "data" / "alice_ch1.txt"


class Progress:
    """A per-layer ``tqdm`` bar on stderr, used as the ``on_layer(i)`` callback of a forward pass.

    ``Progress(stage, total, quiet)(i)`` marks layer ``i`` (0-based) done. The bar is opened at the first layer, not
    before, so that an error raised while loading (one ``kimi: error:`` line) is not mixed with a half-drawn bar; it
    closes itself after the last layer. ``quiet=True`` draws nothing.
    """

    def __init__(self, stage: str, total: int, quiet: bool = False):
        self.stage, self.total, self.quiet = stage, total, quiet
        self._bar = None

    def __call__(self, layer: int) -> None:
        if self.quiet:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=f"{self.stage:>12}", unit="layer", file=sys.stderr, leave=True)
        self._bar.update(layer + 1 - self._bar.n)
        if self._bar.n >= self.total:
            self._bar.close()


ADAPTER_CONFIG = "adapter_config.json"  # peft's CONFIG_NAME: what marks a LoRA adapter folder (kimi_tools.lora)


def refuse_adapter_folder(checkpoint: str | Path | None, command: str = "the same command") -> None:
    """Refuse a ``--checkpoint`` that is no folder, or a LoRA adapter folder (peft's ``adapter_config.json``, what
    ``kimi train --lora-rank`` writes): it holds the adapters only, not a model. The one-line error says how to merge it into its
    base (recorded in the adapter's ``base_model_name_or_path`` when known) and then run ``command`` on the merged
    folder. ``checkpoint`` None (a preset) passes.

    Raises:
        CliError: ``checkpoint`` is not a folder (missing, or a file), or is an adapter folder.
    """
    if checkpoint is not None and not Path(checkpoint).is_dir():
        what = "is a file" if Path(checkpoint).exists() else "does not exist"
        raise CliError(f"--checkpoint: {checkpoint} {what}; expected a checkpoint folder (config.json + safetensors)")
    if checkpoint is None or not (Path(checkpoint) / ADAPTER_CONFIG).is_file():
        return
    try:
        base = json.loads((Path(checkpoint) / ADAPTER_CONFIG).read_text(encoding="utf-8")).get(
            "base_model_name_or_path"
        )
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        base = None
    raise CliError(
        f"--checkpoint: {checkpoint} is a LoRA adapter folder ({ADAPTER_CONFIG}), not a checkpoint; merge it into "
        f"its base first: kimi lora merge --checkpoint {base or 'BASE'} --adapter {checkpoint} --out MERGED, then "
        f"run {command} with --checkpoint MERGED"
    )


def materialise_checkpoint(args: argparse.Namespace, stack) -> tuple[Path, str]:
    """The checkpoint to run: ``--checkpoint DIR``, or a deterministic random init of ``--preset`` (default tiny,
    ``--layers N`` its first N layers) written once to a temporary directory (``tempfile``'s, ``$TMPDIR``), removed
    when ``stack`` closes: on return, on an error, and on SIGINT / SIGTERM under :func:`stop_on_signals`. Its size
    is checked against the free space there before anything is written (:func:`write_random_init`). Returns
    (path, description).

    Raises:
        CliError: ``--checkpoint`` is not a folder or is a LoRA adapter folder (:func:`refuse_adapter_folder`); the
            random init does not fit in the temporary folder (naming the preset, its size, the free space and the
            ``--layers N`` that fits).
    """
    if args.checkpoint is not None:
        refuse_adapter_folder(args.checkpoint, f"kimi {getattr(args, 'cmd', None) or '...'}")
        return Path(args.checkpoint), f"checkpoint {args.checkpoint}"
    name = args.preset or "tiny"
    cfg = load_config(name)
    layers = getattr(args, "layers", None)
    layers = None if layers is None else min(layers, cfg.num_hidden_layers)
    seed = getattr(args, "seed", 0)
    tmp_root = Path(tempfile.gettempdir())
    check_fits(cfg, layers, tmp_root, f"--preset {name}", f"the temporary folder {tmp_root}", "run", tmp=True)
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kimi-"))
    write_random_init(tmp, cfg, seed=seed, layers=layers, quiet=getattr(args, "quiet", False))
    return Path(tmp), f"preset {name}, random init seed {seed}"


PROGRESS_BYTES = 1 << 30  # a random init of this many bytes or more draws a progress bar (stderr)


def human_bytes(n: int) -> str:
    """Decimal units, 3 significant digits or more: 1560402206848 -> '1.56 TB', 74000000000 -> '74.0 GB'."""
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            x = n / scale
            return f"{x:.2f} {unit}" if x < 10 else f"{x:.1f} {unit}" if x < 100 else f"{x:.0f} {unit}"
    return f"{n} B"


def _free_space(folder: Path) -> tuple[Path, int]:
    """The nearest existing folder at or above ``folder`` and its free bytes (``shutil.disk_usage``)."""
    p = Path(folder).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p, shutil.disk_usage(p).free


def check_fits(
    cfg: KimiConfig, layers: int | None, folder: Path, source: str, where: str, verb: str, tmp: bool = False
) -> None:
    """Refuse a random init of ``cfg`` (``layers``: its first N, None all) that does not fit in the free space of
    ``folder`` (:func:`kimi.init.checkpoint_nbytes`), before anything is written. ``source`` names the flag
    (``--preset k3.1-pro``), ``where`` the folder in words, ``verb`` what ``--layers N`` does (``run``/``write``),
    ``tmp`` adds the ``TMPDIR`` way out.

    Raises:
        CliError: one line with the preset, the size, the free space and the largest ``--layers N`` that fits.
    """
    from kimi.init import layer_nbytes

    glob, per_layer = layer_nbytes(cfg)
    n = cfg.num_hidden_layers if layers is None else layers
    need = glob + sum(per_layer[:n])
    _, free = _free_space(folder)
    if need <= free:
        return
    fits, total = 0, glob
    for k, b in enumerate(per_layer[: n - 1], start=1):
        if total + b > free:
            break
        fits, total = k, total + b
    hint = (
        f"pass --layers N to {verb} the first N layers (at most --layers {fits} fits: {human_bytes(total)})"
        if fits
        else f"even --layers 1 needs {human_bytes(glob + per_layer[0])}"
    )
    raise CliError(
        f"{source}: a random init of {n} layers is {human_bytes(need)}, to be written to {where}, which has "
        f"{human_bytes(free)} free; {hint}, or give --checkpoint DIR"
        + ("; or set TMPDIR to a folder with more space" if tmp else "")
    )


def write_random_init(
    path: str | Path, cfg: KimiConfig, *, seed: int, layers: int | None, force: bool = False, quiet: bool = False
) -> KimiConfig:
    """:func:`kimi.init.init_checkpoint` with a byte progress bar (``tqdm`` on stderr) when the checkpoint is
    :data:`PROGRESS_BYTES` or more (and not ``quiet``). Returns the config written."""
    from kimi.init import checkpoint_nbytes, init_checkpoint

    need = checkpoint_nbytes(cfg, layers)
    if quiet or need < PROGRESS_BYTES or is_quiet_rank():
        return init_checkpoint(path, cfg, seed=seed, layers=layers, force=force)
    from tqdm import tqdm

    with tqdm(total=need, desc="random init", unit="B", unit_scale=True, file=sys.stderr, leave=False) as bar:
        return init_checkpoint(path, cfg, seed=seed, layers=layers, force=force, on_bytes=bar.update)


def is_quiet_rank() -> bool:
    """Whether this process is a ``torchrun`` rank other than 0 (``$RANK`` set and not 0): such ranks print no
    error line, so that an error that every rank meets is printed once (by rank 0)."""
    return os.environ.get("RANK", "0").strip() not in ("", "0")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM under :func:`stop_on_signals`, raised in the main thread so that ``with`` blocks and
    ``finally`` clauses unwind (temporary folders and half-written files are removed). ``exit_code`` is 128 plus
    the signal number (130 for SIGINT, 143 for SIGTERM); ``signal_name`` is ``"SIGINT"`` or ``"SIGTERM"``."""

    def __init__(self, signum: int):
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(self.signal_name)


@contextlib.contextmanager
def stop_on_signals():
    """Within the block, SIGINT and SIGTERM raise :class:`Interrupted` in the main thread (SIGTERM would otherwise
    end the process without running any cleanup); a repeated SIGTERM while the first unwinds is ignored. A signal
    already ignored (``nohup``, a shell's background job) stays ignored. The previous handlers are restored on exit. Outside the main thread (where no handler can be installed) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[int] = []

    def handle(signum, frame):
        if raised and signum == signal.SIGTERM:
            return
        raised.append(signum)
        raise Interrupted(signum)

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    saved = {s: h for s, h in saved.items() if h is not signal.SIG_IGN}  # ignored (nohup, a background job): stays
    for s in saved:
        signal.signal(s, handle)
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def check_out_folder(flag: str, value: str | Path, force: str | None = None) -> Path:
    """Refuse an output folder that cannot be one, before any work: ``value`` exists and is not a folder, or a
    folder above it is a file (where ``mkdir`` would fail with ``File exists`` / ``Not a directory``), or the
    nearest existing folder above it is not writable. ``force``: the flag that allows writing into a non-empty
    folder, named in the message. Returns ``Path(value)``.

    Raises:
        CliError: one line naming ``flag``, ``value`` and what was expected.
    """
    p = Path(value)
    expected = "a new folder" + (f" (or an existing one with {force})" if force else " or an existing one")
    if p.exists() and not p.is_dir():
        raise CliError(f"{flag}: {value} exists and is not a folder; expected {expected}")
    for parent in p.absolute().parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise CliError(f"{flag}: {value}: {parent} is a file, not a folder; expected {expected}")
            if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
                raise CliError(f"{flag}: {value}: cannot create it, {parent} is not writable; expected {expected}")
            break
    return p


def check_out_file(flag: str, value: str | Path) -> Path:
    """Refuse an output file that cannot be written, before any work: ``value`` is a folder, a device or another
    entry a rename would replace (:func:`kimi.checkpoint.check_replaceable`), or a folder above it is a file, or
    the nearest existing folder above it is not writable. Returns ``Path(value)``.

    Raises:
        CliError: one line naming ``flag``, ``value`` and what was expected.
    """
    from kimi.checkpoint import check_replaceable

    try:
        check_replaceable(value)
    except FileExistsError as e:
        raise CliError(f"{flag}: {e}") from None
    p = Path(value)
    for parent in p.absolute().parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise CliError(f"{flag}: {value}: {parent} is a file, not a folder; expected a file path in a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise CliError(f"{flag}: {value}: {parent} is not writable; expected a file path in a writable folder")
            break
    return p


def token_ids(args: argparse.Namespace, checkpoint: Path, cfg: KimiConfig):
    """Token ids [T] from --ids (JSON list) or --text (default: the bundled text), cut to --tokens; returns
    ``(ids, description)``, the description naming the file read (or the bundled default) and the tokenizer."""
    import numpy as np

    from kimi.tokenizer import load_tokenizer, read_text

    if getattr(args, "ids", None):
        try:
            ids = json.loads(Path(args.ids).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CliError(f"--ids: {args.ids} is not a JSON list of token ids ({e})") from None
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise CliError(f"--ids: {args.ids} must hold a non-empty JSON list of integers")
        tok_name = f"ids from {args.ids}"
    else:
        tok = load_tokenizer(checkpoint, cfg.vocab_size)
        path = args.text or DEFAULT_TEXT
        if not Path(path).is_file():
            raise CliError(f"--text: no file at {path}")
        ids = tok.encode(read_text(path))
        source = f"text {path}" if args.text else f"the bundled text {DEFAULT_TEXT.name}"
        tok_name = f"{source}, {tok.name}"  # headers name what was read
    short = args.tokens is not None and args.tokens > len(ids)
    if args.tokens is not None:
        ids = ids[: args.tokens]
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]  # Python ints: no overflow on huge values
    if bad:
        raise CliError(f"token ids: got {bad[0]}, expected ids in [0, {cfg.vocab_size})")
    if short:  # say so rather than run on fewer tokens without a word
        print(
            f"kimi: note: --tokens {args.tokens} is more than the {len(ids)} tokens of the input; running on {len(ids)}",
            file=sys.stderr,
        )
    return np.asarray(ids, dtype=np.int64), tok_name


TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(src: str | Path | None, dst: str | Path) -> list[str]:
    """Copy the tokenizer files of checkpoint folder ``src`` (``tiktoken.model``, ``tokenizer*`` files,
    ``special_tokens_map.json``: what :func:`kimi.tokenizer.load_tokenizer` and HF tools read) into ``dst``, each
    with :func:`write_atomic`, so a derived checkpoint (a fine-tuned or merged model) tokenises as its base does.
    ``src`` None (a random-init preset: the byte-level tokenizer) copies nothing. Returns the names copied."""
    if src is None:
        return []
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in TOKENIZER_FILES):
            write_atomic(Path(dst) / f.name, f.read_bytes())
            copied.append(f.name)
    return copied
