"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (a scheduler's or torchrun's stop).

While a :class:`StopRequest` is active, the first of these signals only sets :attr:`StopRequest.signal`: the loop
finishes the step it is in, saves the resume state and raises :class:`TrainInterrupted`, whose one-line message
says how to resume. A second SIGINT stops at once (``KeyboardInterrupt``; the resume state is the last one saved).
Handlers are installed only in the main thread (Python delivers signals there) and restored on exit.
"""

from __future__ import annotations

import signal
import sys
import threading

__all__ = ["StopRequest", "TrainInterrupted"]


class TrainInterrupted(KeyboardInterrupt):
    """The run stopped on a signal after finishing step :attr:`step`. A ``KeyboardInterrupt``, so code that does
    not handle it stops as after a Ctrl-C; ``kimi train`` prints ``str(e)`` (one line) and exits with
    :attr:`exit_code` (128 + the signal number: 130 for SIGINT, 143 for SIGTERM, the shell's convention).

    Attributes:
        step: the last finished step. steps: the run's ``--steps``. out: the run folder. saved: whether ``step-{step}``
        was written (False under ``--no-save``). signal_name: "SIGINT" or "SIGTERM".
    """

    def __init__(self, step: int, steps: int, out, saved: bool, signum: int):
        self.step, self.steps, self.out, self.saved, self.signum = step, steps, out, saved, signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(str(self))

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        what = f"kimi train: stopped by {self.signal_name} after step {self.step} of {self.steps}"
        if not self.saved:
            return f"{what}; nothing was saved (--no-save)"
        return (
            f"{what}; its resume state is {self.out}/step-{self.step} (no model is written until step {self.steps}); "
            "to continue, run the same command with --resume"
        )


class StopRequest:
    """A context manager: within it, SIGINT / SIGTERM ask the run to stop after the current step (module
    docstring). ``on_first(name)`` is called from the handler on the first signal (e.g. to print a note)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_first=None):
        self.signum: int | None = None
        self.on_first = on_first
        self._saved: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if self.signum is None:
            self.signum = signum
            if self.on_first is not None:
                self.on_first(signal.Signals(signum).name)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._saved[s] = signal.getsignal(s)
                signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._saved.items():
            signal.signal(s, h)
        self._saved.clear()


def note(name: str, quiet: bool) -> None:
    """The line printed on the first signal (stderr)."""
    if not quiet:
        print(
            f"\nkimi train: {name}: finishing this step, then saving the resume state (Ctrl-C again stops at once)",
            file=sys.stderr,
            flush=True,
        )
