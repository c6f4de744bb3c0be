"""Writing in a run folder without following symbolic links, and naming a folder that cannot be written.

A run folder may be shared (a group's scratch disk). Whoever can write there can replace `metrics.jsonl`
by a link to any file of the person who resumes the run, and a plain open() would truncate or append
to that file. So every file train writes in its run folder goes through here:

* a file written whole (config, prompts, the checkpoint pointer, report, figures) goes to a new file
  beside it, renamed over the name at the end: a link there is replaced, never followed, and a reader
  never sees half a file;
* a file kept open (`metrics.jsonl` appended to, `run.lock`) is opened with O_NOFOLLOW: a link is refused;
* a sub-folder (prompts/, samples/, checkpoints/, tensorboard/) that is a link is refused.

The run folder itself may be a link (run.out_dir on a bigger disk): only what lies below it is checked.
This guards against links left in a folder, not against a process that swaps one in while a file is
being written.
"""

from __future__ import annotations

import errno
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable

UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class FolderError(RuntimeError):
    """A folder grpo_vision writes in holds a link it will not follow, or cannot be written; the message
    names it and the fix."""


def folder(root: str | Path, path: str | Path) -> Path:
    """The folder `path` (`root` or inside it), made where missing; FolderError if a part of it below
    `root` is a symbolic link."""
    root, path = Path(root), Path(path)
    with _writing(root):
        root.mkdir(parents=True, exist_ok=True)
        here = root
        for part in path.relative_to(root).parts:
            here = here / part
            refuse_link(here)
            if not here.is_dir():
                try:
                    here.mkdir()
                except FileExistsError:  # a file holds the folder's name: not ours to remove
                    raise FolderError(f"{here} is a file where a folder belongs: move it away and run again") from None
    return path


def write_file(path: str | Path, data: str | bytes | Callable[[IO[bytes]], None],
               root: str | Path | None = None) -> Path:
    """Write `path` whole: `data`, or what `data(f)` writes to the open binary file. `root` is the run
    folder when `path` lies in a sub-folder of it (default: `path`'s own folder, not checked)."""
    path = Path(path)
    parent = folder(path.parent if root is None else root, path.parent)
    tmp = parent / f".{path.name}.{secrets.token_hex(4)}.tmp"  # a new name: never an existing file or link
    with _writing(parent):
        f = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666), "wb")
        try:
            with f:
                if callable(data):
                    data(f)
                else:
                    f.write(data.encode() if isinstance(data, str) else data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return path


def open_kept(path: str | Path, mode: str = "a", root: str | Path | None = None) -> IO[str]:
    """A file the caller keeps open and writes to, opened for appending ('a', or 'a+' to read it too)
    and made if absent; FolderError if it is a symbolic link."""
    path = Path(path)
    folder(path.parent if root is None else root, path.parent)
    flags = (os.O_RDWR if mode == "a+" else os.O_WRONLY) | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    with _writing(path.parent):
        try:
            return os.fdopen(os.open(path, flags, 0o666), mode)
        except OSError as e:
            if e.errno == errno.ELOOP:
                refuse_link(path)
            raise


def refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise FolderError(f"{path} is a symbolic link (to {os.readlink(path)}); files in a run folder are written "
                          "in place, never through a link, which could overwrite a file outside the folder: remove "
                          "the link and run again")


def check_writable(path: str | Path, fix: str) -> None:
    """Refuse, before any work, a folder that cannot be written (read-only disk, no permission), or the
    nearest existing folder above it; `fix` says what to do instead."""
    here = Path(path).absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    if not os.access(here, os.W_OK | os.X_OK):
        why = "a read-only file system" if os.statvfs(here).f_flag & os.ST_RDONLY else "no permission to write"
        raise FolderError(f"cannot write in {here} ({why}): {fix}")


def disk_full(e: BaseException) -> bool:
    """No space or quota left: an OSError, or safetensors' SafetensorError, which names the OS error only in its
    text ("I/O error: No space left on device (os error 28)", from a full tmpfs)."""
    codes = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
    return (isinstance(e, OSError) and e.errno in codes) or any(f"os error {c})" in str(e) for c in codes)


def check_output_file(path: str | Path, option: str) -> None:
    """Refuse, before any work, the file an option names (`--verdicts F`, `--out F`) where it cannot be
    written: a folder holds its name, a file stands where one of its folders belongs, or its folder cannot
    be written. Found only at the end, such a path cost the whole run and named a hidden temporary file."""
    path, fix = Path(path), f"choose another {option}"
    if path.is_dir():
        raise FolderError(f"{option} {path} is a folder; give the file to write, e.g. {path / 'out.jsonl'}")
    here = path.absolute().parent
    while not os.path.lexists(here) and here != here.parent:
        here = here.parent
    if not here.is_dir():
        raise FolderError(f"{option} {path}: {here} is a file, not a folder; {fix}")
    check_writable(path.absolute().parent, f"make it writable, or {fix}")


def check_output_folder(path: str | Path, option: str) -> None:
    """Refuse, before any work, the folder an option names (`--out DIR`) where it cannot be made or written: a
    file holds its name or a name above it, or the nearest existing folder cannot be written."""
    path, fix = Path(path), f"choose another {option}"
    here = path.absolute()
    while not os.path.lexists(here) and here != here.parent:
        here = here.parent
    if not here.is_dir():
        raise FolderError(f"{option} {path}: {here} is a file, not a folder; {fix}")
    check_writable(here, f"make it writable, or {fix}")


def write_output_file(path: str | Path, data: str | bytes, option: str) -> Path:
    """`write_file` for a file an option names: an OS error names the option and the user's path, not the
    hidden temporary file it was writing."""
    try:
        return write_file(path, data)
    except FolderError:
        raise
    except OSError as e:
        raise FolderError(f"{option} {path}: cannot write it ({e.strerror}); choose another {option}") from None


@contextmanager
def _writing(where: Path):
    """An OS refusal to write becomes a FolderError naming the folder (a disk that became read-only)."""
    try:
        yield
    except OSError as e:
        if e.errno not in UNWRITABLE:
            raise
        raise FolderError(f"cannot write in {where} ({e.strerror}): make it writable, or work on a copy of it "
                          "elsewhere") from None
