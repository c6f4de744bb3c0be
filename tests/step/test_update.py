"""The update phase in process on a tiny policy (grpo_vision/step/update.py): what it logs, on a batch built by hand."""

import torch

from grpo_vision.grpo import LossParams
from grpo_vision.run.health import RunHealth
from grpo_vision.sampling import SamplingParams, sample_batched
from grpo_vision.step.update import Learner, UpdateBatch, UpdateSettings, update


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
    return UpdateBatch.of(cond, rollout, rollout.logprobs, rollout.logprobs.clone() if ref else None,
                          torch.tensor([1.0, -1.0, 0.5, -0.5])), params


def test_the_first_update_is_on_policy_and_the_kl_is_read_from_the_batch(tiny_policy, one_thread):
    t = UpdateSettings(LossParams(beta=0.0), micro_batch=2, minibatches=1, reference=True)
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


def test_dapo_is_the_minibatch_token_mean_and_bnpo_the_mean_of_micro_batch_means(tiny_policy, one_thread):
    # lr 0, on the policy (r = 1 up to float order): each token's policy term is its sequence's A, so the logged
    # loss/policy is minus a mean of the advantages A = [1, -1, 0.5, 2] (sum 2.5). One minibatch of 4 rows in
    # micro-batches of 3 and 1 (the drawn order decides which row is alone): dapo divides every micro-batch's
    # token sum by the minibatch's 4 rows * N and logs -2.5/4 = -0.625, as with one micro-batch of 4. bnpo
    # averages the two micro-batch means, -((2.5 - a)/3 + a)/2 = -(2.5 + 2a)/6 for the lone row's a: -0.75,
    # -1/12, -7/12 or -13/12, never -0.625 (that needs a = 0.625); with one micro-batch of 4 it is -0.625 too.
    # Two minibatches of 2 rows: dapo divides by each minibatch's own rows, and the mean of the two minibatch
    # means is again -2.5/4 (the whole step's 4 rows as divisor would halve it).
    batch, params = batch_of(tiny_policy, ref=False)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, 2.0])
    logged = {(loss_type, micro, mbs): update(learner_of(tiny_policy), batch, params,
                                              UpdateSettings(LossParams(loss_type=loss_type), minibatches=mbs,
                                                         micro_batch=micro), 0, 0)
              for loss_type, micro, mbs in (("dapo", 3, 1), ("dapo", 4, 1), ("dapo", 2, 2), ("bnpo", 3, 1),
                                            ("bnpo", 4, 1))}
    for key in (("dapo", 3, 1), ("dapo", 4, 1), ("dapo", 2, 2), ("bnpo", 4, 1)):
        assert abs(logged[key]["loss/policy"] - -0.625) < 1e-5, key
    bnpo = logged["bnpo", 3, 1]["loss/policy"]
    assert min(abs(bnpo - v) for v in (-0.75, -1 / 12, -7 / 12, -13 / 12)) < 1e-5, bnpo
    assert logged["dapo", 3, 1]["loss/total"] == logged["dapo", 3, 1]["loss/policy"]  # beta 0


def test_an_update_moves_the_weights_and_the_pass_order_comes_from_seed_and_step(tiny_policy, one_thread):
    import copy

    t = UpdateSettings(LossParams(beta=0.0), micro_batch=2, minibatches=2, reference=False)
    batch, params = batch_of(tiny_policy, ref=False)
    runs = []
    for _ in range(2):
        policy = copy.deepcopy(tiny_policy)
        out = update(learner_of(policy, lr=0.1), batch, params, t, seed=0, step=3)
        runs.append((out, [p.detach().clone() for p in policy.parameters()]))
    assert any(not torch.equal(a, b) for a, b in zip(runs[0][1], tiny_policy.parameters()))  # it learned
    assert runs[0][0] == runs[1][0]  # the same (seed, step): the same order, the same numbers
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_the_update_settings_decide_once_whether_a_reference_is_measured_and_whether_its_kl_is_in_the_loss():
    from grpo_vision.config import Config, SampleConfig, TrainConfig

    def settings(**train):
        return UpdateSettings.from_config(Config(train=TrainConfig(**train),
                                                 sample=SampleConfig(mixed_precision="bf16")))

    logged = settings(beta=0.0, reference="frozen", kl_metric_sequences=3)
    assert logged.reference and not logged.kl_in_loss and logged.recompute_old
    assert [logged.reference_sequences(n) for n in (2, 3, 8)] == [2, 3, 3]  # the first 3, or fewer when fewer
    in_loss = settings(beta=0.04, reference="frozen", kl_metric_sequences=3)  # beta > 0: all, whatever N says
    assert in_loss.kl_in_loss and in_loss.reference_sequences(8) == 8
    none = settings(beta=0.0, reference="none")
    assert not none.reference and not none.kl_in_loss and none.reference_sequences(8) == 0
