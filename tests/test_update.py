"""The update phase in process on a tiny policy (grpo_vision/update.py): what it logs, on a batch built by hand."""

import torch

from grpo_vision.config import TrainConfig
from grpo_vision.run.health import RunHealth
from grpo_vision.sampling import SamplingParams, sample_batched
from grpo_vision.update import Learner, UpdateBatch, update


def learner_of(policy, lr=0.0):
    from accelerate import Accelerator

    trainable = list(policy.parameters())
    optimizer = torch.optim.SGD(trainable, lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1.0)
    return Learner(policy, trainable, optimizer, scheduler, Accelerator(cpu=True), RunHealth(None, 0, loud=False))


def batch_of(policy, ref: bool):
    params = SamplingParams(cfg_scale=3.0)
    cond = policy.encode_prompts(["a red circle", "a blue square"] * 2)  # [4, L]
    rollout = sample_batched(policy, cond, [0, 1, 2, 3], params, 4)
    mask = torch.ones_like(rollout.tokens, dtype=torch.bool)
    return UpdateBatch(cond, rollout.tokens, mask, rollout.logprobs, rollout.logprobs,
                       rollout.logprobs.clone() if ref else None, torch.tensor([1.0, -1.0, 0.5, -0.5]), mask), params


def test_the_first_update_is_on_policy_and_the_kl_is_read_from_the_batch(tiny_policy, one_thread):
    t = TrainConfig(micro_batch_size=2, minibatches_per_pass=1, reference="frozen", beta=0.0)
    for ref in (True, False):
        batch, params = batch_of(tiny_policy, ref)
        out = update(learner_of(tiny_policy), batch, params, t, seed=0, step=0)
        # lr 0: the pass scores the rollout's own tokens with unchanged weights, so the ratio is 1 and the
        # teacher-forced log-probs equal the sampler's up to float order
        assert abs(out["loss/ratio_mean"] - 1) < 1e-5 and out["rollout/logp_drift"] < 1e-4
        assert out["loss/clip_frac_low"] == out["loss/clip_frac_high"] == 0.0
        if ref:  # reference log-probs equal to the policy's: k3 is 0 up to float order
            assert 0.0 <= out["loss/kl"] < 1e-6
        else:  # a batch without reference log-probs logs a KL of 0 whatever the config says, never 0 / 0
            assert out["loss/kl"] == 0.0


def test_an_update_moves_the_weights_and_the_pass_order_comes_from_seed_and_step(tiny_policy, one_thread):
    import copy

    t = TrainConfig(micro_batch_size=2, minibatches_per_pass=2, reference="none", beta=0.0)
    batch, params = batch_of(tiny_policy, ref=False)
    runs = []
    for _ in range(2):
        policy = copy.deepcopy(tiny_policy)
        out = update(learner_of(policy, lr=0.1), batch, params, t, seed=0, step=3)
        runs.append((out, [p.detach().clone() for p in policy.parameters()]))
    assert any(not torch.equal(a, b) for a, b in zip(runs[0][1], tiny_policy.parameters()))  # it learned
    assert runs[0][0] == runs[1][0]  # the same (seed, step): the same order, the same numbers
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
