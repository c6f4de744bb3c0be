"""One run per directory (run/lock.py): the lock on a folder the OS refuses to write."""

import errno
import os

import pytest

from grpo_vision.files import FolderError
from grpo_vision.run.lock import RunLock


def test_a_folder_that_turns_read_only_is_named_when_the_lock_is_taken(tmp_path, monkeypatch):
    """The OS refuses a write (root passes permission checks, so the refusal is simulated where it happens)."""
    run = tmp_path / "run"
    run.mkdir()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(args[0]))

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(FolderError, match=f"^cannot write in {run} \\(Read-only file system\\): make it writable"):
        RunLock(run, fresh=False)
