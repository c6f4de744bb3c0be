"""One run per directory (run/lock.py): the lock on a folder the OS refuses to write, and a resume holds it from
before it reads its checkpoint to its end (step/setup.py)."""

import fcntl
import os
import re
import shutil
import socket

import pytest

import grpo_vision.step.setup as setup
from grpo_vision.config import load_config, save_config
from grpo_vision.files import FolderError
from grpo_vision.run.lock import RunLock, RunLockedError
from grpo_vision.train import train
from tests.helpers import micro_cfg, refuse_writes


def test_a_folder_that_turns_read_only_is_named_when_the_lock_is_taken(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    refuse_writes(monkeypatch)
    with pytest.raises(FolderError, match=f"^cannot write in {run} \\(Read-only file system\\): make it writable"):
        RunLock(run, fresh=False)


def held_by_another(run) -> bool:
    """Whether another open of run.lock holds it (flock: two opens conflict, in one process too)."""
    with open(run / "run.lock") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


class _Stop(Exception):
    pass


def test_a_resume_holds_the_run_lock_before_it_reads_its_checkpoint(micro_run, tmp_path, monkeypatch):
    """A resume took the lock only once loaded: another train could run the run on meanwhile, and the resume then
    trained again from the checkpoint it had read, over the other's steps."""
    run = shutil.copytree(micro_run, tmp_path / "run")
    seen = []

    def reading_the_checkpoint(run_dir):  # as another train would look at the run now
        seen.append(held_by_another(run))
        raise _Stop

    monkeypatch.setattr(setup, "latest_checkpoint", reading_the_checkpoint)
    with pytest.raises(_Stop):
        train(load_config(run / "config.yaml", ["train.steps=3"]), resume=run, progress=False)
    assert seen == [True]
    assert not held_by_another(run) and (run / "run.lock").read_text() == ""  # released by the failed start


def test_a_resume_of_a_held_run_says_its_overrides_were_not_applied(micro_world, tmp_path):
    run = tmp_path / "shapes_micro"
    save_config(micro_cfg(micro_world, tmp_path), run / "config.yaml")
    holder = RunLock(run, fresh=False)  # another live train
    try:
        files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        with pytest.raises(RunLockedError) as refused:
            train(load_config(run / "config.yaml", ["train.lr=0.01"]), resume=run, progress=False)
        assert re.fullmatch(rf"{re.escape(str(run))} is in use by a running train \(pid {os.getpid()} on "
                            rf"{re.escape(socket.gethostname())}, started [^)]+\); this resume did not start and its "
                            r"overrides \(train.lr 1e-05 -> 0.01\) were not applied: wait for that train to end, or stop "
                            "it, then resume again", str(refused.value)), str(refused.value)
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files
    finally:
        holder.release()
