"""The salt table (seeds.py) and the split of a step's groups between processes."""

from types import SimpleNamespace

import numpy as np
import torch

from grpo_vision.run.distributed import process_slice
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
