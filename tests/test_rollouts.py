"""The step's first half that training and every measurement share (grpo_vision/rollouts.py): one seed rule,
one KL estimator."""

import copy

import pytest
import torch

from grpo_vision.config import EVAL_SEED
from grpo_vision.grpo import LossParams
from grpo_vision.prompts import PromptEntry
from grpo_vision.rollouts import Samples, eval_seeds, kl_to, repeat, sample_rows
from grpo_vision.sampling import SamplingParams, batched_logprobs
from grpo_vision.step.update import UpdateBatch, UpdatePlan, update
from tests.step.test_update import learner_of


def test_eval_seeds_give_image_j_of_prompt_i_seed_plus_1000_i_plus_j():
    assert eval_seeds(2, 3) == [EVAL_SEED, EVAL_SEED + 1, EVAL_SEED + 2, EVAL_SEED + 1000, EVAL_SEED + 1001,
                                EVAL_SEED + 1002]
    assert eval_seeds(1, 2, seed=5) == [5, 6]


def test_the_kl_a_measurement_reports_is_the_one_training_logs(tiny_policy, one_thread):
    # the matrix's KL column (rollouts.kl_to) and the update's loss/kl both average grpo.k3_kl over the same
    # tokens: with lr 0 the update's teacher-forced log-probs are the sampler's up to float order
    reference = copy.deepcopy(tiny_policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(1.3)  # another model: a KL well above rounding
    params = SamplingParams(cfg_scale=3.0)
    entries = repeat([PromptEntry("a red circle"), PromptEntry("a blue square")], 2)
    seeds = eval_seeds(2, 2)
    cond, rollout = sample_rows(tiny_policy, entries, seeds, params, 4)
    measured = kl_to(reference, Samples(entries, seeds, cond, rollout, images=torch.empty(0)), params, 4)  # [4]
    ref = batched_logprobs(reference, cond, rollout.tokens, params, 4)
    mask = torch.ones_like(rollout.tokens, dtype=torch.bool)
    batch = UpdateBatch(cond, rollout.tokens, mask, rollout.logprobs, rollout.logprobs, ref,
                        torch.tensor([1.0, -1.0, 0.5, -0.5]), mask)
    logged = update(learner_of(tiny_policy), batch, params, UpdatePlan(LossParams(), micro_batch=2, reference=True),
                    seed=0, step=0)["loss/kl"]
    assert measured.mean().item() > 0.05
    assert abs(measured.mean().item() - logged) < 1e-5


def test_take_groups_puts_the_picked_groups_of_several_samplings_in_place():
    # two samplings of groups of 2: the step's own (groups a, b) and a refill (groups c, d); picks keep a and put
    # the refill's d in b's place: rows a0 a1 d0 d1, every field following its rows
    import numpy as np

    from grpo_vision.rollouts import Scored, take_groups
    from grpo_vision.sampling import Rollout

    def part(names, first, chosen):
        n = len(names)
        values = torch.arange(first, first + n, dtype=torch.float32)
        rollout = Rollout(values.long()[:, None].repeat(1, 3), values[:, None] / 10, values[:, None] / 100)
        samples = Samples([PromptEntry(x) for x in names], list(range(first, first + n)), values.long()[:, None],
                          rollout, values[:, None, None, None].expand(n, 3, 2, 2), np.array(chosen), slice(0, n))
        scored = Scored(values, {"r": values * 2}, {"r": torch.ones(n)}, {"r": [("ok", x) for x in names]},
                        [None] * n, {"correct": values % 2}, 0.5)
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
    assert scored.judged["correct"].tolist() == [0, 1, 0, 1] and len(scored.verdicts) == 4

    # a kind that pads each batch to its longest prompt (Janus): ids of two widths are encoded again together
    narrow, wide = part(["a", "a", "b", "b"], 0, [7, 8]), part(["c", "c", "d", "d"], 10, [3, 4])
    wide[0].cond = torch.zeros(4, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="differ in width: pass the policy's encode_prompts"):
        take_groups([narrow, wide], [(0, 0), (1, 1)], 2)
    samples, _ = take_groups([narrow, wide], [(0, 0), (1, 1)], 2,
                             encode=lambda prompts: torch.tensor([[ord(p)] * 3 for p in prompts]))
    assert samples.cond[:, 0].tolist() == [97, 97, 100, 100] and samples.cond.shape == (4, 3)
