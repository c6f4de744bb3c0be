"""Threads and the shared-machine warning (machine.py)."""

import os

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
    # blamed for the failed mmap, and the process segfaulted on exit (issue 33)
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
