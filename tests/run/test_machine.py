"""Threads and the shared-machine warning (machine.py)."""

import os
import subprocess
import sys

import pytest
import torch

from grpo_vision.run.machine import available_cores, load_warning, set_threads


def test_a_load_well_above_the_cores_is_one_line_naming_the_load_and_the_knob():
    assert load_warning(2.9, 2) is None  # below 1.5 per core: a quiet enough machine
    message = load_warning(7.5, 2)
    assert "load 7.5 on 2 cores" in message and "run.threads" in message and "\n" not in message


def test_threads_follow_run_threads_else_omp_num_threads_else_the_cores(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        assert set_threads(0) == 1  # torchrun and the matrix set it: kept
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert set_threads(0) == available_cores() == len(os.sched_getaffinity(0))
        assert set_threads(0, processes=available_cores() * 2) == 1  # a process's share, at least one
    finally:
        torch.set_num_threads(before)


def test_more_threads_than_usable_cores_is_a_config_error_naming_both(monkeypatch):
    # run.threads=100000 once made OpenMP start 100000 threads: the memory ran out, a world file was
    # blamed for the failed mmap, and the process segfaulted on exit
    import grpo_vision.run.machine as machine
    from grpo_vision.config import ConfigError

    monkeypatch.setattr(machine, "available_cores", lambda: 4)
    before = torch.get_num_threads()
    try:
        with pytest.raises(ConfigError) as err:
            set_threads(100000)
        assert str(err.value) == ("run.threads=100000 is more than the 4 cores this process may use: set it to "
                                  "at most 4, or to 0 for this process's share of them")
        assert torch.get_num_threads() == before  # refused before torch started any thread
        assert set_threads(4) == 4  # every usable core is allowed
    finally:
        torch.set_num_threads(before)


def test_freed_memory_goes_back_to_the_system_where_glibc_allows():
    """A float32 Janus-Pro-1B LoRA step on a 2-core CPU: killed at 23 GiB of resident memory with glibc's default
    arenas, 13.4 GiB with freed blocks returned (docs/benchmarks.md). Here: half of 200 blocks of 1 MiB freed, in
    holes the heap cannot trim, stay resident by default and leave with the setting (measured: 200 MiB, 100 MiB)."""
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    code = """
import sys, torch
from grpo_vision.run.machine import return_freed_memory
from grpo_vision.run.memory import resident_bytes
if sys.argv[1] == "1":
    assert return_freed_memory()
x = torch.ones(2**18); del x  # a freed 1 MiB block: glibc's dynamic threshold rises past it
before = resident_bytes()
blocks = [torch.ones(2**18) for _ in range(200)]  # 200 x 1 MiB, touched
del blocks[::2]  # every other one freed
print((resident_bytes() - before) / 2**20)
"""
    kept = [float(subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True, check=True,
                                 env=os.environ | {"OMP_NUM_THREADS": "1"}).stdout) for flag in ("0", "1")]
    assert kept[0] > 180 and kept[1] < 120, kept
