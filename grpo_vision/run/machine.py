"""What the machine gives a run: CPU threads, and a warning when other jobs share it.

On a shared 2-core machine the main job can take 91 minutes instead of 10 with no word why: torch's
threads fight other processes for the cores. `run.threads` sets the threads; a 1-minute
load average well above the cores at start-up is reported in one line, so a slow run says why.
More threads than usable cores never speed torch up, and a huge number (100000) makes OpenMP exhaust
the memory and crash: it is refused.
"""

from __future__ import annotations

import os

import torch

from grpo_vision.config import DEVICE_HINT, DEVICE_NAME, ConfigError, brief

BUSY = 1.5  # load per core above which the machine counts as shared


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; a cgroup CPU quota does not show there:
    set run.threads under one), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def set_threads(threads: int, processes: int = 1) -> int:
    """Use `threads` torch threads; 0 keeps OMP_NUM_THREADS where it is set (torchrun and the matrix set
    it), else takes this process's share of the available cores. Returns the number in use; ConfigError
    for more threads than the available cores."""
    cores = available_cores()
    if threads > cores:
        raise ConfigError(f"run.threads={threads} is more than the {cores} cores this process may use: set it to "
                          f"at most {cores}, or to 0 for this process's share of them")
    if threads == 0 and os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    torch.set_num_threads(threads or max(1, cores // processes))
    return torch.get_num_threads()


def load_warning(load: float, cores: int) -> str | None:
    """A one-line warning when the 1-minute load average is well above the cores, else None."""
    if load <= BUSY * cores:
        return None
    return (f"the machine is shared: load {load:.1f} on {cores} cores, so steps will be slower than on a quiet "
            "machine (the README gives the main job's quiet timing); run.threads limits this run's threads")


def check_load() -> str | None:
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available here
        return None
    return load_warning(load, available_cores())


def resolve_device(name: str, key: str = "run.device") -> str:
    """`run.device` (or a command's --device, named by `key`) as a torch device: "auto" is cuda when a GPU
    is visible, else cpu; a device this machine lacks is a ConfigError (never a silent fall back to the CPU)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not DEVICE_NAME.fullmatch(name):
        raise ConfigError(f"{key} {brief(name)} is not a device: use {DEVICE_HINT}")
    kind, _, index = name.partition(":")
    gpus = torch.cuda.device_count() if kind == "cuda" and torch.cuda.is_available() else 0
    if kind == "cuda" and int(index or 0) >= gpus:
        have = f"only cuda:0 to cuda:{gpus - 1}" if gpus > 1 else "only cuda:0" if gpus else "no CUDA GPU torch can use"
        raise ConfigError(f"{key}={name}, and this machine has {have}: use {key}=auto (the best device here) or cpu")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{key}=mps, and this machine has no Apple GPU torch can use: use {key}=auto or cpu")
    return name


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def return_freed_memory() -> bool:
    """Make glibc hand freed blocks of 64 KiB and more back to the system at once (the effect of
    MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0). By default its arenas keep what a step freed for
    reuse, and a float32 Janus-Pro-1B LoRA step on a 2-core CPU grew to more than 23 GiB of resident memory and
    was killed, where the same step with this set peaked at 13.4 GiB against an estimate of 13.7
    (docs/benchmarks.md). True where it took effect (Linux with glibc), False elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 65536)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 0))
    except (OSError, AttributeError):  # not glibc: no mallopt
        return False
