"""A run's life through the real CLI: stopped by SIGTERM and resumed exactly, one run per directory,
a start killed before its first step, a lock left by a killed holder, a signal during the report, a
folder that cannot be written. Those that start processes are the e2e tier."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from grpo_vision.run.metrics import load_metrics
from grpo_vision.run.lock import LOCK_NAME, RunLock, RunLockedError, check_run_dir
from grpo_vision.run.signals import GracefulStop, Interrupted
from tests.helpers import MICRO, ROOT, cli_cmd, micro_args, run_cli

TIMEOUT = 900  # generous: other jobs may share the CPU; nothing here checks time


def train_args(world, out, *overrides):
    return ["train", *micro_args(world, out, "log.checkpoint_every=0", *overrides)]


def steps_logged(run: Path) -> list[int]:
    return [row["step"] for row in load_metrics(run)]  # a line still being written is skipped


def dying_reward(images, prompts, metadata):  # python:tests.e2e.test_lifecycle:dying_reward
    os._exit(137)  # as the kernel's OOM killer ends a process: no except, no finally, no clean-up


@pytest.mark.e2e
def test_sigterm_finishes_the_step_saves_and_the_resumed_run_is_exact(micro_world, tmp_path):
    steps = 4
    out = run_cli(*train_args(micro_world, tmp_path, "run.name=straight", f"train.steps={steps}"), timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "stopped"
    proc = subprocess.Popen(cli_cmd(*train_args(micro_world, tmp_path, "run.name=stopped", f"train.steps={steps}")),
                            cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + TIMEOUT
    while not steps_logged(run) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 143, err[-3000:]  # 128 + SIGTERM, as a shell reports it
    done = steps_logged(run)[-1]
    assert 1 <= done < steps
    assert f"stopped by SIGTERM: saved a checkpoint at step {done}; continue with: grpo-vision train " \
           f"--resume {run}" in err
    assert (run / "checkpoints" / "latest").read_text() == f"step_{done:06d}"
    assert (run / LOCK_NAME).read_text() == ""  # released on the way out
    out = run_cli("train", "--resume", run, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert steps_logged(run) == list(range(1, steps + 1))
    a = load_file(tmp_path / "straight" / "checkpoints" / f"step_{steps:06d}" / "policy.safetensors")
    b = load_file(run / "checkpoints" / f"step_{steps:06d}" / "policy.safetensors")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


def test_a_second_signal_of_either_kind_stops_at_once_and_handlers_come_back():
    before = {s: signal.getsignal(s) for s in GracefulStop.SIGNALS}
    stop = GracefulStop()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode: the step goes on
        time.sleep(0.05)
        assert stop.signum == signal.SIGTERM
        with pytest.raises(Interrupted) as err:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert err.value.signum == signal.SIGINT and isinstance(err.value, KeyboardInterrupt)
    finally:
        stop.restore()
    assert {s: signal.getsignal(s) for s in GracefulStop.SIGNALS} == before


@pytest.mark.e2e
def test_two_trains_on_one_directory_one_runs_the_other_is_refused(micro_world, tmp_path):
    logs = [tmp_path / f"stderr_{seed}.txt" for seed in (0, 1)]  # files, not pipes: neither blocks on a full pipe
    procs = [subprocess.Popen(cli_cmd(*train_args(micro_world, tmp_path, "train.steps=2", f"run.seed={seed}")),
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"))
             for seed, log in zip((0, 1), logs)]
    results = [(p.wait(timeout=TIMEOUT), log.read_text()) for p, log in zip(procs, logs)]
    assert sorted(rc for rc, _ in results) == [0, 2], [err[-2000:] for _, err in results]
    refused = next(err for rc, err in results if rc == 2)
    # Which message depends on when the second got there: during the first run, or after it
    assert "is in use by a running train (pid " in refused or "already holds a run" in refused, refused[-2000:]
    assert "Traceback" not in refused
    assert steps_logged(tmp_path / "shapes_micro") == [1, 2]  # one run's steps, not two interleaved


@pytest.mark.e2e
def test_a_held_run_directory_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "shapes_micro"
    lock = RunLock(run, fresh=True)
    holder = f"is in use by a running train (pid {os.getpid()} on {socket.gethostname()}, started "
    try:
        # a world that exists: train checks the files a config names before it takes the run's lock
        for args in ([MICRO, f"run.out_dir={tmp_path}", f"policy.path={ROOT / 'worlds' / 'shapes'}"], ["--resume", run]):
            (run / "config.yaml").write_text("run:\n  name: shapes_micro\npolicy:\n  kind: shapes\n  path: worlds/shapes\n")
            out = run_cli("train", *args, timeout=TIMEOUT)
            assert out.returncode == 2 and holder in out.stderr, out.stderr[-2000:]
            assert "Traceback" not in out.stderr
    finally:
        lock.release()
    check_run_dir(run, fresh=True)  # released: free again
    assert (run / LOCK_NAME).read_text() == ""


@pytest.mark.e2e
def test_a_lock_left_by_a_killed_holder_is_taken_over(tmp_path, capfd):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from grpo_vision.run.lock import RunLock\n"
                               "lock = RunLock(Path(sys.argv[1]), fresh=True)\nprint('held', flush=True)\ntime.sleep(600)",
                               str(run)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunLockedError, match=f"in use by a running train \\(pid {holder.pid} on "):
            RunLock(run, fresh=True)
        with pytest.raises(RunLockedError, match=f"pid {holder.pid}"):
            check_run_dir(run, fresh=False)
    finally:
        holder.kill()  # SIGKILL: the holder cannot clean up; the kernel drops its flock
        holder.wait(timeout=TIMEOUT)
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == holder.pid  # what the dead holder left
    capfd.readouterr()
    lock = RunLock(run, fresh=True)
    try:
        assert f"names pid {holder.pid} on " in capfd.readouterr().err
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


@pytest.mark.e2e
def test_a_start_killed_before_its_first_step_is_rerun_by_the_same_command(micro_world, tmp_path):
    run = tmp_path / "shapes_micro"
    out = run_cli(*train_args(micro_world, tmp_path, "train.steps=1", "reward.monitor=[]",
                              "reward.weights={python:tests.e2e.test_lifecycle:dying_reward: 1.0}"), timeout=TIMEOUT)
    assert out.returncode == 137, out.stderr[-3000:]
    assert (run / "config.yaml").is_file() and steps_logged(run) == [] and not (run / "checkpoints").exists()
    out = run_cli(*train_args(micro_world, tmp_path, "train.steps=1"), timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stopped without releasing it; taking it over" in out.stderr  # the killed start's lock
    assert steps_logged(run) == [1]
    assert "dying_reward" not in (run / "config.yaml").read_text()  # the new command's config, not the killed one's


def signalling_reward(images, prompts, metadata):  # python:tests.e2e.test_lifecycle:signalling_reward
    # The report scores 32 prompts at once, a training step 8: SIGTERM arrives while the report is written
    if len(prompts) > 8 and os.environ.get("SIGTERM_IN_REPORT"):
        os.kill(os.getpid(), signal.SIGTERM)
    return images.mean((1, 2, 3))


@pytest.mark.e2e
def test_sigterm_during_the_report_says_the_training_finished_and_resume_writes_it(micro_world, tmp_path):
    run = tmp_path / "shapes_micro"
    out = run_cli(*train_args(micro_world, tmp_path, "reward.monitor=[]", "data.eval_size=32",
                              "reward.weights={python:tests.e2e.test_lifecycle:signalling_reward: 1.0}"),
                  timeout=TIMEOUT, env={**os.environ, "SIGTERM_IN_REPORT": "1"})
    assert out.returncode == 143, out.stderr[-3000:]  # before: 143 too, from the signal itself, and nothing said
    assert out.stderr.splitlines()[-1] == (
        f"[train] stopped by SIGTERM while writing the report; the training finished (checkpoint at step 2): "
        f"grpo-vision train --resume {run} --trust-run writes the report")  # its own python: reward: trusted
    assert not (run / "report.md").exists() and steps_logged(run) == [1, 2]
    out = run_cli("train", "--resume", run, "--trust-run", timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"[train] done: {run / 'report.md'}" in out.stdout
    assert (run / "report.md").read_text().startswith("# GRPO report: shapes_micro")
    assert steps_logged(run) == [1, 2]  # nothing trained again


def test_a_run_folder_that_cannot_be_written_is_refused_naming_it(tmp_path, monkeypatch):
    from grpo_vision.config import load_config
    from grpo_vision.files import FolderError
    from grpo_vision.train import train

    run = tmp_path / "run"
    run.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != run and access(path, mode, **kw))
    cfg = load_config(MICRO, [f"run.out_dir={tmp_path}", "run.name=run"])
    with pytest.raises(FolderError, match=f"^cannot write in {run} \\(no permission to write\\): make it writable, or "
                                          "copy the run elsewhere and resume the copy \\(--resume COPY\\)$"):
        train(cfg, resume=run, progress=False)  # before loading anything: before, an OSError traceback, later
    with pytest.raises(FolderError, match=f"^cannot write in {run} .*: choose another run.out_dir$"):
        train(cfg, progress=False)


def test_a_run_file_that_is_a_fifo_or_a_folder_is_refused_before_anything_loads(tmp_path):
    """run.lock a FIFO, metrics.jsonl a folder: refused in one line. Before, a traceback once train had loaded
    everything (an illegal seek on the lock, IsADirectoryError rewriting the metrics)."""
    from grpo_vision.config import load_config
    from grpo_vision.files import FolderError
    from grpo_vision.train import train
    from tests.helpers import within

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(MICRO, [f"run.out_dir={tmp_path}", "run.name=run"])  # its world is never reached
    os.mkfifo(run / LOCK_NAME)
    fifo = rf"^{run / LOCK_NAME} is a FIFO \(named pipe\), not the file train keeps there: move it away \(train makes "
    with within(60):
        for start in (lambda: train(cfg, progress=False), lambda: train(cfg, resume=run, progress=False),
                      lambda: RunLock(run, fresh=True)):
            with pytest.raises(FolderError, match=fifo):
                start()
    (run / LOCK_NAME).unlink()
    (run / "metrics.jsonl").mkdir()
    with pytest.raises(FolderError, match=rf"^{run / 'metrics.jsonl'} is a folder, not the file train keeps there"):
        train(cfg, resume=run, progress=False)
    with pytest.raises(FolderError, match=rf"^{run / 'metrics.jsonl'} is a folder, not a file: a run's metrics.jsonl "
                                          "is the per-step log train writes; move this one away and run again$"):
        load_metrics(run)  # the report, the demo's curves and `alerts` read it too
