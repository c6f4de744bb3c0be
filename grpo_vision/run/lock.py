"""One run per directory: `run.lock`, held with flock(2) for the life of a run.

The kernel drops a flock when its holder exits, however it exits (kill -9 included), so a lock is
never stale and taking it is race-free; the file itself stays. It names its holder (pid, host,
start time) so that a refused start can say who holds the run. A holder that stops cleanly
empties the file, so text found there by the next holder was left by one that died.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from grpo_vision.run.checkpoint import checkpoint_steps
from grpo_vision.config import ConfigError
from grpo_vision.files import FolderError, check_writable, open_kept, refuse_link
from grpo_vision.reading import what_is

LOCK_NAME = "run.lock"
KEPT = (LOCK_NAME, "metrics.jsonl", "alerts.jsonl", "resumes.jsonl")  # files train keeps open, or reads on resume


class RunLockedError(RuntimeError):
    """Another live train holds this run directory; `holder` names it ('pid 12 on HOST, started TIME', or '')."""

    def __init__(self, message: str, holder: str = ""):
        super().__init__(message)
        self.holder = holder


def check_run_dir(run_dir: Path, fresh: bool) -> None:
    """Refuse, before anything is loaded, a directory another train holds, one it cannot write, a lock
    that is a link, and (for a fresh start) one that holds a run. Reads only: a shared flock probe never
    blocks another probe."""
    check_writable(run_dir, "choose another run.out_dir" if fresh else
                   "make it writable, or copy the run elsewhere and resume the copy (--resume COPY)")
    path = Path(run_dir) / LOCK_NAME
    refuse_link(path)  # the probe below would follow it; the lock itself never does (RunLock)
    for name in KEPT:
        refuse_odd(Path(run_dir) / name)
    if path.is_file():
        with open(path) as f:
            _lock_or_refuse(f, fcntl.LOCK_SH, run_dir)
    if fresh:
        _refuse_finished_run(run_dir)


class RunLock:
    """The exclusive lock on `run_dir` (made if absent); raises RunLockedError naming the holder."""

    def __init__(self, run_dir: Path, fresh: bool):
        self.path = Path(run_dir) / LOCK_NAME
        refuse_odd(self.path)
        self.file = open_kept(self.path, "a+")  # never through a link: truncating it would empty another file
        try:
            _lock_or_refuse(self.file, fcntl.LOCK_EX, run_dir)
            if fresh:  # again under the lock: a start that raced this one may have finished meanwhile
                _refuse_finished_run(run_dir)
        except BaseException:
            self.file.close()
            raise
        self.file.seek(0)
        left = _holder(self.file.read())
        if left:
            print(f"[train] {self.path} names {left}, which stopped without releasing it; taking it over",
                  file=sys.stderr, flush=True)
        self.file.seek(0)
        self.file.truncate()
        self.file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                    "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}) + "\n")
        self.file.flush()

    def release(self) -> None:
        if self.file.closed:
            return
        self.file.truncate(0)  # a clean stop: nothing left for the next holder to report
        self.file.flush()
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def refuse_odd(path: Path) -> None:
    """FolderError for a run file that is a folder, a FIFO or a device: locked or read, a FIFO waits for ever,
    and rewriting a folder fails only once the run has loaded."""
    kind = what_is(path)
    if kind not in (None, "missing"):
        raise FolderError(f"{path} is {kind}, not the file train keeps there: move it away (train makes it "
                          "again) and run again")


def _lock_or_refuse(f, mode: int, run_dir: Path, tries: int = 10) -> None:
    """Retries for a second: another start's shared probe holds the lock for a moment only."""
    for attempt in range(tries):
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt + 1 < tries:
                time.sleep(0.1)
    f.seek(0)
    holder = _holder(f.read())
    raise RunLockedError(f"{run_dir} is in use by a running train ({holder or 'another process'}); wait for it to end "
                         "or stop it first, or train in another directory (run.name=NEW_NAME)", holder)


def _holder(text: str) -> str:
    """'pid 12 on HOST, started TIME' from the lock file's text ('' if it names no one)."""
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']}, started {h['started']}"
    except (json.JSONDecodeError, KeyError, TypeError):
        return ""


def _refuse_finished_run(run_dir: Path) -> None:
    """A directory holds a run once it has a checkpoint or a logged step; the config.yaml and empty
    metrics.jsonl of a start that failed before its first step are reused, not refused."""
    from grpo_vision.run.metrics import load_metrics  # imported here: the CLI imports this module at start-up

    if checkpoint_steps(run_dir) or load_metrics(run_dir):
        raise ConfigError(f"{run_dir} already holds a run; continue it with --resume {run_dir}, start a new "
                          f"one beside it with run.name=NEW_NAME, or delete the folder to start over")
