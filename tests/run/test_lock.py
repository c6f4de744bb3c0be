"""One run per directory (run/lock.py): the lock on a folder the OS refuses to write."""

import pytest

from grpo_vision.files import FolderError
from grpo_vision.run.lock import RunLock
from tests.helpers import refuse_writes


def test_a_folder_that_turns_read_only_is_named_when_the_lock_is_taken(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    refuse_writes(monkeypatch)
    with pytest.raises(FolderError, match=f"^cannot write in {run} \\(Read-only file system\\): make it writable"):
        RunLock(run, fresh=False)
