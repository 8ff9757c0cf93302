"""What the ``kimi`` subcommands share: one-line user errors, argument types, the checkpoint and token source.

Every subcommand module (``cli``, and the tools that add commands: train, generate, ablate, lora) takes its
``--preset`` / ``--checkpoint`` / ``--text`` handling from here, so that the options mean the same everywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
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
        """Print ``kimi: error: <message> (see `<prog> --help`)`` on stderr and exit with status 2."""
        self.exit(2, f"kimi: error: {message} (see `{self.prog} --help`)\n")


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
    """Refuse a LoRA adapter folder (peft's ``adapter_config.json``, what ``kimi train --lora-rank`` writes) given
    as ``--checkpoint``: it holds the adapters only, not a model. The one-line error says how to merge it into its
    base (recorded in the adapter's ``base_model_name_or_path`` when known) and then run ``command`` on the merged
    folder. ``checkpoint`` None (a preset) passes.

    Raises:
        CliError: ``checkpoint`` is an adapter folder.
    """
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
    """The checkpoint to run: ``--checkpoint DIR``, or a deterministic random init of ``--preset`` (default tiny)
    written once to a temporary directory. Returns (path, description).

    Raises:
        CliError: ``--checkpoint`` is a LoRA adapter folder (:func:`refuse_adapter_folder`).
    """
    from kimi.init import init_checkpoint

    if args.checkpoint is not None:
        refuse_adapter_folder(args.checkpoint, f"kimi {getattr(args, 'cmd', None) or '...'}")
        return Path(args.checkpoint), f"checkpoint {args.checkpoint}"
    name = args.preset or "tiny"
    cfg = load_config(name)
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kimi-"))
    init_checkpoint(tmp, cfg, seed=args.seed, layers=args.layers)
    return Path(tmp), f"preset {name}, random init seed {args.seed}"


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
