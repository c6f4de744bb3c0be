"""Every random draw of a training step, from `(run.seed, step, salt)`: the table of salts.

A step's randomness depends on nothing but the run's seed and the step, so a resumed run continues
exactly and the processes of a run agree without talking (each computes what it needs). Each draw
has its own salt, listed here once; numpy's SeedSequence hashes the key, so keys of different salts
give unrelated streams. One overlap is known and kept: SeedSequence pads a key with zeros, so
(seed, step) and (seed, step, IMAGE + 0) are the same key, and image 0's seed is the first draw of
the stream that also picks the step's prompts. It ties which prompts a step trains on to one image's
sampling seed, no more; a salt of their own for the prompts would change every run's prompts and every
published number, so it waits for a change that measures them again (tests/test_seeds.py pins it).

| key                            | draws                                             | where        |
|--------------------------------|---------------------------------------------------|--------------|
| (seed, step)                   | the step's prompts                                | train.py     |
| (seed, step, IMAGE + j)        | image j's sampling seed (j: global, group order)  | train.py     |
| (seed, step, PASS_ORDER + k)   | the sequence order of update pass k               | update.py    |
| (seed, step, REPLAY)           | replayed samples at an iteration boundary         | train.py     |
| (seed, step, REFILL)           | the prompts that replace groups without spread    | train.py     |
| (seed, step, REFILL_IMAGE + j) | refill image j's sampling seed (j: in draw order) | train.py     |

Evaluation draws no step keys: its images use fixed seeds (evaluation/evaluate.py), the same for the
policy and the reference.
"""

from __future__ import annotations

import numpy as np

IMAGE = 0  # + j, j < 2**31 images a step
PASS_ORDER = 2**31  # + k, k < 2**31 passes a step
REPLAY = 2**32  # past both ranges: never an image's or a pass's key
REFILL = 2**32 + 1  # train.zero_std_groups=resample: the new prompts of a step
REFILL_IMAGE = 2**33  # + j, j < 2**31: the new groups' images, beyond every key above


def step_rng(seed: int, step: int, *salt: int) -> np.random.Generator:
    """The generator of one draw of step `step` (no salt: the step's prompts)."""
    return np.random.default_rng([seed, step, *salt])


def step_seed(seed: int, step: int, salt: int) -> int:
    """A 62-bit seed for the draw `salt` of step `step` (an image's sampler, a pass's order)."""
    return int(step_rng(seed, step, salt).integers(2**62))
