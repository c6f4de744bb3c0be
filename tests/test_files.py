"""The files an option names (grpo_vision/files.py: check_output_file, write_output_file): refused before any
work when they cannot be written, and a failed write names the option and the user's path, in one line."""

import errno
import os

import pytest

from grpo_vision.files import FolderError, check_output_file, write_output_file


def test_an_output_file_that_cannot_be_written_is_refused_naming_the_option(tmp_path):
    (tmp_path / "notes.txt").write_text("a file")
    for path, message in ((tmp_path / "notes.txt" / "deeper" / "v.jsonl",
                           f"--verdicts {tmp_path / 'notes.txt' / 'deeper' / 'v.jsonl'}: {tmp_path / 'notes.txt'} is a "
                           "file, not a folder; choose another --verdicts"),
                          (tmp_path, f"--verdicts {tmp_path} is a folder; give the file to write, e.g. "
                                     f"{tmp_path / 'out.jsonl'}")):
        with pytest.raises(FolderError) as err:
            check_output_file(path, "--verdicts")
        assert str(err.value) == message
    check_output_file(tmp_path / "new" / "v.jsonl", "--verdicts")  # a folder still to make is fine


def test_a_failed_write_names_the_option_and_the_users_path_not_the_temporary_file(tmp_path, monkeypatch):
    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))

    monkeypatch.setattr(os, "replace", full)
    path = tmp_path / "v.jsonl"
    with pytest.raises(FolderError) as err:
        write_output_file(path, "{}\n", "--verdicts")
    assert str(err.value) == f"--verdicts {path}: cannot write it (No space left on device); choose another --verdicts"
    assert list(tmp_path.iterdir()) == []  # the temporary file went too
