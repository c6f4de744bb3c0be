"""The salt table (seeds.py) and the split of a step's groups between processes."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo_vision.run.distributed import process_slice
from grpo_vision.run.metrics import PhaseTimer
from grpo_vision.seeds import IMAGE, PASS_ORDER, REFILL, REFILL_IMAGE, REPLAY, step_rng, step_seed


def test_salt_ranges_never_meet():
    # images take IMAGE + j for j < 2**31, passes PASS_ORDER + k for k < 2**31: the replay key lies past both,
    # the refill's prompts past it, and the refill's images past everything
    assert IMAGE + 2**31 - 1 < PASS_ORDER and PASS_ORDER + 2**31 - 1 < REPLAY < REFILL < REFILL_IMAGE


def test_the_prompts_draw_shares_image_0s_key_as_seeds_py_says():
    # numpy pads a SeedSequence key with zeros: [seed, step] is [seed, step, 0]. Kept on purpose (seeds.py):
    # the day the prompts get a salt of their own, this test and every published run change together
    assert step_seed(7, 5, IMAGE) == int(step_rng(7, 5).integers(2**62))


def test_the_replay_draw_is_not_an_images_seed():
    # before the table, the replay generator was default_rng([seed, step, 3]): image 3's own stream
    image_3 = step_seed(7, 5, IMAGE + 3)
    assert image_3 == int(np.random.default_rng([7, 5, 3]).integers(2**62))  # the images' seeds are unchanged
    assert int(step_rng(7, 5, REPLAY).integers(2**62)) != image_3


def test_a_step_is_a_pure_function_of_seed_and_step():
    first = step_seed(0, 3, PASS_ORDER)
    np.random.seed(1)  # the global generators play no part
    torch.manual_seed(1)
    assert step_seed(0, 3, PASS_ORDER) == first
    assert len({step_seed(0, s, IMAGE + j) for s in range(4) for j in range(16)}) == 64  # no repeats


def test_processes_take_whole_contiguous_shares_in_order():
    # B = 4 prompts of G = 3 images on 2 processes: prompts [0, 2) and [2, 4), images [0, 6) and [6, 12)
    accs = [SimpleNamespace(num_processes=2, process_index=i) for i in range(2)]
    assert [process_slice(4, a) for a in accs] == [slice(0, 2), slice(2, 4)]
    assert [process_slice(12, a) for a in accs] == [slice(0, 6), slice(6, 12)]


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
