"""``kimi train``: the parser, derived from :class:`kimi_tools.train.args.TrainArgs` (one flag per field), and the
command, which turns the run's expected endings into one line each: a bad input (``kimi: error: ...``, exit 2,
from ``kimi_tools.cli.main``), an interrupt (``kimi train: stopped by SIGINT after step N ...``, exit 130; 143 for
SIGTERM), no traceback."""

from __future__ import annotations

import argparse
import sys

from kimi_tools.common import CliError
from kimi_tools.train.args import add_arguments, args_from_namespace

__all__ = ["add_parser", "cmd_train"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``kimi train``: every :class:`~kimi_tools.train.args.TrainArgs` field as a flag."""
    from kimi_tools.train.stages import STAGES

    p = subparsers.add_parser(
        "train",
        help="fine-tune (full or LoRA) on text; resumable, saved on Ctrl-C; metrics and a loss curve",
        description="Train the torch model on text. A Ctrl-C (or SIGTERM) finishes the step, saves the resume state "
        "and exits (130; 143 for SIGTERM): run the same command with --resume to continue. The model is written "
        "when the run reaches --steps.",
    )
    add_arguments(p)
    for action in p._actions:  # the registry is open: list what is registered when the parser is built
        if action.dest == "stage":
            action.help = f"training objective, one of {sorted(STAGES)} (default %(default)s)"
    p.set_defaults(func=cmd_train)
    return p


def cmd_train(args: argparse.Namespace) -> int:
    """Run :func:`kimi_tools.train.train` on the parsed flags. Returns 0, or 128 + the signal number after an
    interrupt (130 for SIGINT, 143 for SIGTERM) with one line on stderr saying how to resume."""
    from kimi_tools.train.checkpoint import RUN_JSON, Checkpointer
    from kimi_tools.train.interrupt import TrainInterrupted
    from kimi_tools.train.trainer import train

    a = args_from_namespace(args)
    try:
        train(a)
    except ImportError as e:  # kimi_tools.lora missing, or the gpu extra
        raise CliError(f"kimi train: {e}") from None
    except TrainInterrupted as e:
        print(str(e), file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training began
        from pathlib import Path

        out = Path(a.out)
        steps = Checkpointer(out).steps() if out.is_dir() else []
        if steps:
            then = f"the last saved resume state is {out}/step-{steps[-1]}: run the same command with --resume"
        elif (out / RUN_JSON).is_file():
            then = f"{out} holds no saved step: start it again with --restart"
        else:
            then = "nothing was written"
        print(f"kimi train: interrupted; {then}", file=sys.stderr, flush=True)
        return 130
    return 0
