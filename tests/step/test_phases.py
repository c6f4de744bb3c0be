"""The phases of a step (grpo_vision/step/phases.py) that a whole run does not pin down alone."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo_vision.prompts import PromptEntry
from grpo_vision.rollouts import Scored
from grpo_vision.sampling import Plan, Rollout
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
    with pytest.raises(ValueError, match="differ in width: pass the policy"):
        take_groups([narrow, wide], [(0, 0), (1, 1)], 2)
    policy = SimpleNamespace(encode_prompts=lambda prompts: torch.tensor([[ord(p)] * 3 for p in prompts]))
    samples, _ = take_groups([narrow, wide], [(0, 0), (1, 1)], 2, policy)
    assert samples.cond[:, 0].tolist() == [97, 97, 100, 100] and samples.cond.shape == (4, 3)


def test_take_groups_keeps_the_plans_their_verdicts_and_the_notes():
    # resample with a text plan: the joined step keeps each row's plan (tokens, mask, log-probs, texts), the judge's
    # verdicts on it and the rewards' notes, in the picked rows' order; the update reads the plan's log-probs
    def part(names, first):
        n = len(names)
        values = torch.arange(first, first + n, dtype=torch.float32)
        plan = Plan(values.long()[:, None], values.long()[:, None].repeat(1, 2), torch.tensor([[True, False]] * n),
                    torch.stack([-values / 10, torch.zeros(n)], 1), torch.zeros(n, 2), [f"plan {x}" for x in names],
                    [f"make {x}" for x in names])
        rollout = Rollout(values.long()[:, None].repeat(1, 3), values[:, None] / 10, values[:, None] / 100, plan)
        samples = StepSamples([PromptEntry(x) for x in names], list(range(first, first + n)), values.long()[:, None],
                              rollout, values[:, None, None, None].expand(n, 3, 2, 2), np.array([0, 1]), slice(0, n))
        scored = Scored(values, {"r": values}, {"r": torch.ones(n)}, {}, [None] * n, {f"r{first}": "failed"},
                        [{"correct": x} for x in names])
        return samples, scored

    samples, scored = take_groups([part(["a", "a", "b", "b"], 0), part(["c", "c", "d", "d"], 10)],
                                  [(1, 1), (0, 0)], 2)
    plan = samples.rollout.plan
    assert plan.texts == ["plan d", "plan d", "plan a", "plan a"] and plan.prompts[0] == "make d"
    assert plan.tokens[:, 0].tolist() == [12, 13, 0, 1] and plan.mask[:, 0].all() and not plan.mask[:, 1].any()
    assert samples.rollout.sequence_logprobs[:, 0].tolist() == pytest.approx([-1.2, -1.3, 0.0, -0.1])
    assert samples.rollout.count(0.5)[0].tolist() == [0.5, 0.0, 1.0]
    assert [v["correct"] for v in scored.plan_verdicts] == ["d", "d", "a", "a"]
    assert scored.notes == {"r0": "failed", "r10": "failed"}
