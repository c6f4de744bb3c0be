"""The train processes of `grpo-vision matrix`: one matrix per output folder, and signals passed on.

A matrix holds `OUT/matrix.lock` with flock(2) while it runs (as run/lock.py does for a run), so a
second matrix on the same folder is refused instead of sharing its runs and logs. Each train child
starts detached from the terminal (setsid), so a terminal's Ctrl-C reaches the matrix alone and
every child gets each signal exactly once, from the matrix: the first SIGINT or SIGTERM makes a train
finish its step and save a checkpoint, a second stops it at once (as for `grpo-vision train`). The
matrix starts no run after a signal, waits for its children, and stops with `Interrupted`; the same
command resumes.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from grpo_vision.run import signals
from grpo_vision.files import FolderError, open_kept
from grpo_vision.run.lock import LOCK_NAME as RUN_LOCK
from grpo_vision.run.lock import RunLockedError, check_run_dir
from grpo_vision.run.signals import Interrupted

LOCK_NAME = "matrix.lock"
POLL_S = 0.2  # how often a thread waiting on its child looks for a signal to pass on


class OutLock:
    """The exclusive lock on a matrix's output folder; RunLockedError naming the matrix holding it."""

    def __init__(self, out: Path):
        self.file = open_kept(Path(out) / LOCK_NAME, "a+")  # never through a link: it is emptied below
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise RunLockedError(f"{out} is in use by another grpo-vision matrix ({holder}); wait for it to end, "
                                 "stop it (kill -TERM lets its runs save a checkpoint), or choose another --out") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()}\n")
        self.file.flush()

    def release(self) -> None:
        if not self.file.closed:
            self.file.truncate(0)
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def refuse_held(run_dir: Path, log: Path) -> None:
    """A run that a live train holds (one a killed matrix left running, or a user's own) is neither
    retrained nor marked failed, and its log is left alone: RunLockedError. A train holds its run's
    run.lock once it has loaded; the log, which the matrix locks and hands it, from its first moment."""
    try:
        check_run_dir(run_dir, fresh=False)
        if log.is_file():
            open_log(log, run_dir, probe=True)
    except FolderError:  # a run file that is a folder or a FIFO: that run's train names it, and the run fails alone
        return
    except RunLockedError:
        try:
            holder = f"pid {json.loads((run_dir / RUN_LOCK).read_text())['pid']}"
        except (OSError, ValueError, KeyError, TypeError):
            holder = f"writing {log}"
        raise RunLockedError(f"{run_dir} is in use by a running train ({holder}), perhaps one a killed matrix "
                             "left running; wait for it to end or stop it (kill -TERM lets it save a checkpoint), "
                             "then run this matrix again") from None


def open_log(log: Path, run_dir: Path, probe: bool = False):
    """`log`, emptied and locked for a new train, which inherits the lock with the file as its output:
    flock(2) holds while any process has the file open, so the lock outlives a killed matrix for as
    long as its train runs. With `probe`, only checked (and closed)."""
    f = open_kept(log, "a")  # not "w": the log of a live train is not emptied; never through a link
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RunLockedError(f"{run_dir} is in use by a running train writing {log}") from None
    if probe:
        f.close()
        return None
    f.truncate(0)
    return f


class PassOn:
    """SIGINT and SIGTERM while installed: during training (`forwarding`) each is recorded for the
    threads to pass on to their children; before and after it (checks, scoring) it stops at once."""

    def __init__(self):
        self.received: list[int] = []
        self.forwarding = False
        self.previous = signals.install(self._handle)

    def _handle(self, signum, frame):
        self.received.append(signum)
        if not self.forwarding:
            raise Interrupted(signum)
        if len(self.received) == 1:
            print(f"[matrix] {signal.Signals(signum).name}: passed on to the runs in training, which finish their "
                  "step and save a checkpoint (Ctrl-C or SIGTERM again to stop them at once)", file=sys.stderr,
                  flush=True)

    def restore(self) -> None:
        signals.restore(self.previous)
        self.previous = {}


def run_child(cmd: list[str], log: Path, run_dir: Path, env: dict, stop: PassOn) -> tuple[int | None, bool]:
    """(exit code, whether a signal was passed on to it) of `cmd`, its output in `log`; (None, True)
    when a signal came first: then it never starts and `log` is left as it was."""
    if stop.received:
        return None, True
    with open_log(log, run_dir) as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    sent = 0
    while True:
        try:
            return child.wait(timeout=POLL_S), sent > 0
        except subprocess.TimeoutExpired:
            pass
        new = stop.received[sent:]
        for signum in new:
            child.send_signal(signum)
        sent += len(new)
