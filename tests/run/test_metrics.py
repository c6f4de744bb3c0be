"""The step's clock (grpo_vision/run/metrics.py: PhaseTimer): phases, nesting, and the device's synchronize."""

import pytest

from grpo_vision.run.metrics import PhaseTimer


def test_a_phase_inside_another_stops_the_outer_clock(monkeypatch):
    # a fake clock: sample runs 0 -> 10 with decode 3 -> 7 inside it: sample 6 s, decode 4 s, step 12 s
    ticks = iter([0.0, 0.0, 3.0, 7.0, 10.0, 12.0])
    monkeypatch.setattr("grpo_vision.run.metrics.time.perf_counter", lambda: next(ticks))
    timer = PhaseTimer()
    with timer("sample"):
        with timer("decode"):
            pass
    assert timer.metrics() == {"perf/step_s": 12.0, "perf/sample_s": 6.0, "perf/decode_s": 4.0}


def test_phase_timer_adds_up_a_phase_entered_twice(monkeypatch):
    # a fake clock: sample 1 -> 3 and 4 -> 7 (2 + 3 = 5 s), update 7.5 -> 9 (1.5 s), the step 0 -> 10; the gaps
    # between phases (1 + 1 + 0.5 + 1 s) belong to no phase
    ticks = iter([0.0, 1.0, 3.0, 4.0, 7.0, 7.5, 9.0, 10.0])
    monkeypatch.setattr("grpo_vision.run.metrics.time.perf_counter", lambda: next(ticks))
    timer = PhaseTimer()
    for _ in range(2):
        with timer("sample"):
            pass
    with timer("update"):
        pass
    m = timer.metrics()
    assert m == {"perf/step_s": 10.0, "perf/sample_s": 5.0, "perf/update_s": 1.5}
    assert list(m) == ["perf/step_s", "perf/sample_s", "perf/update_s"]  # the order the phases began


def _device_clock(monkeypatch):
    """A fake clock and a fake device: `launch(s)` queues s seconds of kernels; the host waits for them only at
    `wait()`, a result read back (as `.item()` does), or at `sync()`, the device's synchronize."""
    now, queued = [0.0], [0.0]
    monkeypatch.setattr("grpo_vision.run.metrics.time.perf_counter", lambda: now[0])

    def wait():
        now[0] += queued[0]
        queued[0] = 0.0
    return (lambda s: queued.__setitem__(0, queued[0] + s)), wait, now


@pytest.mark.parametrize("sync, sample_s, reward_s", [(True, 5.0, 1.0), (False, 0.0, 6.0)])
def test_with_the_devices_synchronize_a_phase_is_charged_its_own_kernels(monkeypatch, sync, sample_s, reward_s):
    # the sampler queues 5 s of kernels and returns at once; the reward reads them back and adds 1 s of its own.
    # Synchronised at the boundary the 5 s are sample's; without it the reward's (what an H200 step showed)
    launch, wait, now = _device_clock(monkeypatch)
    timer = PhaseTimer(wait if sync else None)
    with timer("sample"):
        launch(5.0)
    with timer("reward"):
        wait()
        now[0] += 1.0
    assert timer.metrics() == {"perf/step_s": 6.0, "perf/sample_s": sample_s, "perf/reward_s": reward_s}


def test_a_phase_that_raises_is_charged_without_waiting_for_the_device(monkeypatch):
    # after a CUDA error the device's synchronize raises again: it must not replace the error the phase raised
    launch, wait, now = _device_clock(monkeypatch)
    waits = []
    timer = PhaseTimer(lambda: waits.append(now[0]))
    with pytest.raises(KeyError):
        with timer("reward"):
            now[0] += 2.0
            raise KeyError("a reward failed")
    assert waits == [0.0] and timer.seconds == {"reward": 2.0}  # the wait on entering only
