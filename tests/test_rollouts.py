"""The step's first half that training and every measurement share (grpo_vision/rollouts.py): one seed rule,
one KL estimator."""

import copy

import pytest
import torch

from grpo_vision.config import EVAL_SEED
from grpo_vision.grpo import LossParams
from grpo_vision.prompts import PromptEntry
from grpo_vision.rollouts import draw, eval_seeds, kl_to, repeat
from grpo_vision.sampling import SamplingParams, batched_logprobs
from grpo_vision.step.update import UpdateBatch, UpdateSettings, update
from tests.step.test_update import learner_of


def test_eval_seeds_give_image_j_of_prompt_i_seed_plus_1000_i_plus_j():
    assert eval_seeds(2, 3) == [EVAL_SEED, EVAL_SEED + 1, EVAL_SEED + 2, EVAL_SEED + 1000, EVAL_SEED + 1001,
                                EVAL_SEED + 1002]
    assert eval_seeds(1, 2, seed=5) == [5, 6]


class NoImages:  # a tokenizer whose images nothing reads
    def decode(self, tokens):
        return torch.zeros(len(tokens), 3, 1, 1)


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
    samples = draw(tiny_policy, NoImages(), entries, seeds, params, 4)
    cond, rollout = samples.cond, samples.rollout
    measured = kl_to(reference, samples, params, 4)  # [4]
    ref = batched_logprobs(reference, cond, rollout, params, 4)
    batch = UpdateBatch.of(cond, rollout, rollout.logprobs, ref, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    logged = update(learner_of(tiny_policy), batch, params, UpdateSettings(LossParams(), micro_batch=2, reference=True),
                    seed=0, step=0)["loss/kl"]
    assert measured.mean().item() > 0.05
    assert abs(measured.mean().item() - logged) < 1e-5


def test_the_seed_bound_is_the_last_eval_seeds_image():
    # 2 prompts x 3 images: the last image is seed + 1000 + 2, which must stay within MAX_SEED
    from grpo_vision.config import MAX_SEED, ConfigError
    from grpo_vision.rollouts import check_seeds

    check_seeds(MAX_SEED - 1002, 2, 3)
    with pytest.raises(ConfigError, match=f"--seed {MAX_SEED - 1001}: the last image would get seed {MAX_SEED + 1}, "
                                          f".*use --seed {MAX_SEED - 1002} or less"):
        check_seeds(MAX_SEED - 1001, 2, 3)
    check_seeds(MAX_SEED - 2, 1, 3)  # one prompt: seed + j
