"""The phases of a step (grpo_vision/step/phases.py) that a whole run does not pin down alone."""

import numpy as np
import pytest
import torch

from grpo_vision.prompts import PromptEntry
from grpo_vision.rollouts import Scored
from grpo_vision.sampling import Rollout
from grpo_vision.step.phases import StepSamples, take_groups


def test_take_groups_puts_the_picked_groups_of_several_samplings_in_place():
    # two samplings of groups of 2: the step's own (groups a, b) and a refill (groups c, d); picks keep a and put
    # the refill's d in b's place: rows a0 a1 d0 d1, every field following its rows
    
    def part(names, first, chosen):
        n = len(names)
        values = torch.arange(first, first + n, dtype=torch.float32)
        rollout = Rollout(values.long()[:, None].repeat(1, 3), values[:, None] / 10, values[:, None] / 100)
        samples = StepSamples([PromptEntry(x) for x in names], list(range(first, first + n)), values.long()[:, None],
                          rollout, values[:, None, None, None].expand(n, 3, 2, 2), np.array(chosen), slice(0, n))
        scored = Scored(values, {"r": values * 2}, {"r": torch.ones(n)}, {"r": [("ok", x) for x in names]},
                        [{"correct": bool(v % 2)} for v in values.tolist()])
        return samples, scored

    samples, scored = take_groups([part(["a", "a", "b", "b"], 0, [7, 8]), part(["c", "c", "d", "d"], 10, [3, 4])],
                                  [(0, 0), (1, 1)], 2)
    assert [e.prompt for e in samples.entries] == ["a", "a", "d", "d"] and samples.seeds == [0, 1, 12, 13]
    assert samples.chosen.tolist() == [7, 4] and samples.rows == slice(0, 4)
    assert samples.cond[:, 0].tolist() == [0, 1, 12, 13] and samples.rollout.tokens[:, 0].tolist() == [0, 1, 12, 13]
    assert samples.rollout.entropy[:, 0].tolist() == pytest.approx([0, 0.01, 0.12, 0.13])
    assert samples.images[:, 0, 0, 0].tolist() == [0, 1, 12, 13]
    assert scored.total.tolist() == [0, 1, 12, 13] and scored.raw["r"].tolist() == [0, 2, 24, 26]
    assert scored.reasons["r"] == [("ok", "a"), ("ok", "a"), ("ok", "d"), ("ok", "d")]
    assert [v["correct"] for v in scored.verdicts] == [False, True, False, True]

    # a kind that pads each batch to its longest prompt (Janus): ids of two widths are encoded again together
    narrow, wide = part(["a", "a", "b", "b"], 0, [7, 8]), part(["c", "c", "d", "d"], 10, [3, 4])
    wide[0].cond = torch.zeros(4, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="differ in width: pass the policy's encode_prompts"):
        take_groups([narrow, wide], [(0, 0), (1, 1)], 2)
    samples, _ = take_groups([narrow, wide], [(0, 0), (1, 1)], 2,
                             encode=lambda prompts: torch.tensor([[ord(p)] * 3 for p in prompts]))
    assert samples.cond[:, 0].tolist() == [97, 97, 100, 100] and samples.cond.shape == (4, 3)
