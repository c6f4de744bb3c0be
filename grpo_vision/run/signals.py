"""Stopping a run cleanly on a signal: the step in progress finishes and is checkpointed."""

from __future__ import annotations

import signal
import sys
import threading

import torch


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal; the CLI exits with 128 + signum, as a shell reports a killed command."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and kill / timeout / job schedulers


def install(handler) -> dict:
    """`handler` for SIGINT and SIGTERM; returns the handlers it replaced, for restore() (none off the main
    thread, where Python sets no handler)."""
    return {s: signal.signal(s, handler) for s in SIGNALS} if _main_thread() else {}


def restore(previous: dict) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)


class GracefulStop:
    """The first Ctrl-C (SIGINT) or SIGTERM (kill, timeout, job schedulers) lets the current step finish,
    so the checkpoint holds a whole step and a resumed run is exact; a second signal of either kind
    stops at once (without a checkpoint). The previous handlers come back with restore()."""

    SIGNALS = SIGNALS

    def __init__(self):
        self.signum = 0
        self.previous = install(self._handle)

    def _handle(self, signum, frame):
        if self.signum:
            raise Interrupted(signum)
        self.signum = signum
        print(f"\n[train] {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              "(Ctrl-C or SIGTERM again to stop now)", file=sys.stderr, flush=True)

    def at_once(self) -> None:
        """From now on a signal stops at once (no step is left to finish): Interrupted is raised where the
        program is, so that the caller can say what was left undone."""
        for s in self.previous:
            signal.signal(s, _raise)

    def agreed(self, acc) -> int:
        """The signal any process got (0: none): every process stops after the same step, as the
        checkpoint is written by all of them together."""
        return int(acc.gather(torch.tensor([self.signum], device=acc.device)).max())

    def restore(self) -> None:
        restore(self.previous)
        self.previous = {}


def _raise(signum, frame):
    raise Interrupted(signum)


def _main_thread() -> bool:  # Python accepts signal handlers from the main thread only
    return threading.current_thread() is threading.main_thread()
