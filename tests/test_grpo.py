"""GRPO math checked against numbers worked out by hand (working in the comments)."""

import math

import pytest
import torch
from torch.testing import assert_close

from grpo_vision.grpo import (
    LossParams, TokenWeights, adaptive_entropy_coef, entropy_coef_to_apply, frac_zero_std, group_advantages,
    grpo_loss, high_entropy_mask, informative_groups, k3_kl, masked_mean, mixup_state_dict, normalize_then_sum,
    off_policy_mask,
)

EPS = 1e-4
NAN = float("nan")
F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ---------------------------------------------------------------- advantages


def test_group_scale_worked_example():
    # Group 1 [1,2,3]: mean 2, centered [-1,0,1], unbiased std sqrt((1+0+1)/2) = 1
    #   -> [-1,0,1] / (1 + 1e-4). Group 2 [5,5,5]: all equal -> exactly 0.
    adv = group_advantages(t([1, 2, 3, 5, 5, 5]), group_size=3)
    assert_close(adv, t([-1, 0, 1, 0, 0, 0]) / t([1 + EPS] * 3 + [1] * 3))
    assert torch.equal(adv[3:], torch.zeros(3, dtype=F64))


def test_batch_scale_uses_batch_std():
    # Batch mean 21/6 = 3.5; squared deviations 6.25+2.25+0.25+3*2.25 = 15.5; /5 -> var 3.1.
    # Group mean is still subtracted per group: [-1,0,1] / (sqrt(3.1) + 1e-4); group 2 -> 0.
    adv = group_advantages(t([1, 2, 3, 5, 5, 5]), group_size=3, scale="batch")
    assert_close(adv, t([-1, 0, 1, 0, 0, 0]) / (math.sqrt(3.1) + EPS))


def test_none_scale_is_dr_grpo_centering():
    # Dr. GRPO: no division. [1,2,4] mean 7/3 -> [-4/3, -1/3, 5/3]; [5,5,5] -> 0.
    adv = group_advantages(t([1, 2, 4, 5, 5, 5]), group_size=3, scale="none")
    assert_close(adv, t([-4 / 3, -1 / 3, 5 / 3, 0, 0, 0]))


def test_nan_reward_is_excluded_and_gets_zero():
    # Group 1 [1,NaN,3]: stats over [1,3]: mean 2, std sqrt((1+1)/1) = sqrt 2
    #   -> [-1/(sqrt2+eps), 0, 1/(sqrt2+eps)].
    # Group 2 [0,4,8]: mean 4, std sqrt((16+0+16)/2) = 4 -> [-4/(4+eps), 0, 4/(4+eps)].
    # Group 3 all NaN -> 0; group 4 one valid reward -> 0 (no one to compare with).
    r = t([1, NAN, 3, 0, 4, 8, NAN, NAN, NAN, NAN, NAN, 7])
    adv = group_advantages(r, group_size=3)
    s2 = math.sqrt(2) + EPS
    assert_close(adv, t([-1 / s2, 0, 1 / s2, -4 / (4 + EPS), 0, 4 / (4 + EPS)] + [0] * 6))
    assert not adv.isnan().any()


def test_equal_rewards_exactly_zero_in_every_scale():
    # In float32, mean([0.9]*3) - 0.9 = -6e-8, not 0: a std-based test would leave a tiny
    # nonzero advantage there (-6e-8 / (7e-8 + 1e-4) with scale="group"). It must be exactly 0.
    r = t([0.9, 0.9, 0.9, 0.7, 0.7, 0.7], dtype=torch.float32)
    assert r[:3].mean() != r[0]  # the case this test is about
    for scale in ("group", "batch", "none"):
        adv = group_advantages(r, group_size=3, scale=scale)
        assert torch.equal(adv, torch.zeros(6))
        assert adv.dtype == torch.float32


def test_dtypes():
    assert group_advantages(t([1, 2]), 2).dtype == F64
    assert group_advantages(torch.tensor([1, 2]), 2).dtype == torch.float32


def test_advantage_errors():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(t([1, 2, 3]), group_size=1)
    with pytest.raises(ValueError, match=r"5.*2"):
        group_advantages(t([1, 2, 3, 4, 5]), group_size=2)
    with pytest.raises(ValueError, match="group.*batch.*none"):
        group_advantages(t([1, 2]), group_size=2, scale="rank")


def test_frac_zero_std():
    assert frac_zero_std(t([1, 2, 3, 5, 5, 5]), 3) == 0.5
    # constant / varied / all-NaN (no signal) / [NaN,4,4] constant over valid -> 3 of 4.
    r = t([0.1, 0.1, 0.1, 1, 2, 3, NAN, NAN, NAN, NAN, 4, 4])
    assert frac_zero_std(r, 3) == 0.75


# ---------------------------------------------------------------- loss helpers


def ratios_to_logprobs(ratios):
    """logprobs with old_logprobs = 0, so r = exp(logp - 0) = the given ratio."""
    return t(ratios).log().requires_grad_(), torch.zeros(len(ratios), len(ratios[0]), dtype=F64)


def hand_batch():
    # five sequences of one token (N = 1), rows 0-4:
    # r = 1.0, 1.5, 0.5 with A = +1 -> terms 1 (r=1), min(1.5,1.2)=1.2, min(0.5,0.8)=0.5
    # r = 0.5, 1.5 with A = -1 -> min(-0.5,-0.8)=-0.8, min(-1.5,-1.2)=-1.5
    logp, old = ratios_to_logprobs([[1.0], [1.5], [0.5], [0.5], [1.5]])
    return logp, old, t([1.0, 1.0, 1.0, -1.0, -1.0])


def two_images():
    # two sequences of N = 3 tokens:
    # seq 0: r = [1.0, 1.5, 0.5], A = +1 -> terms 1 (r=1), min(1.5,1.2)=1.2, min(0.5,0.8)=0.5; mean 0.9
    # seq 1: r = [0.5, 1.5, 1.0], A = -1 -> min(-0.5,-0.8)=-0.8, min(-1.5,-1.2)=-1.5, -1; mean -1.1
    logp, old = ratios_to_logprobs([[1.0, 1.5, 0.5], [0.5, 1.5, 1.0]])
    return logp, old, t([1.0, -1.0])


# ---------------------------------------------------------------- loss values


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_types_hand_example(loss_type):
    # token sum 2.7 - 2.3 = 0.4 over 5 tokens = 0.08; loss = -0.08. With one token a sequence the mean of the
    # sequences' means (grpo), the token mean (bnpo, dapo on one call) and sum / (S * N) (dr_grpo) are one number.
    logp, old, adv = hand_batch()
    loss, m = grpo_loss(logp, old, None, adv, LossParams(loss_type=loss_type))
    assert_close(loss, t(-0.08))
    assert_close(m["policy_loss"], t(-0.08))  # beta = 0: no KL term
    # clipped: row 1 (A>0, r=1.5>1.2) high; row 3 (A<0, r=0.5<0.8) low; 1 of 5 each.
    assert_close(m["clip_frac_high"], t(0.2))
    assert_close(m["clip_frac_low"], t(0.2))
    # (1 + 1.5 + 0.5 + 0.5 + 1.5) / 5 = 1
    assert_close(m["ratio_mean"], t(1.0))
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_every_image_has_n_tokens_so_grpo_bnpo_and_dr_grpo_agree():
    # two_images: sequence means 0.9 and -1.1 -> grpo -(-0.1) = 0.1; token sum 2.7 - 3.3 = -0.6 over
    # 2 * 3 tokens -> bnpo and dr_grpo 0.1 too. Gradient: every token weighs 1/(S * N) = 1/6, dl/dlogp = A*r
    # where the unclipped term is the min, 0 where the clipped one is; loss is -l.
    # seq0: A*r = [1, (clipped) 0, 0.5] -> [-1/6, 0, -1/12]
    # seq1: [(clipped) 0, A*r = -1.5, A*r = -1] -> [0, 1.5/6 = 0.25, 1/6]
    for loss_type in ("grpo", "bnpo", "dr_grpo"):
        logp, old, adv = two_images()
        loss, _ = grpo_loss(logp, old, None, adv, LossParams(loss_type=loss_type))
        loss.backward()
        assert_close(loss.detach(), t(0.1))
        assert_close(logp.grad, t([[-1 / 6, 0, -1 / 12], [0, 0.25, 1 / 6]]))


def one_token(r, a, **params):
    """Surrogate term l for a single token with ratio r and advantage a, plus metrics and grad."""
    logp, old = ratios_to_logprobs([[r]])
    loss, m = grpo_loss(logp, old, None, t([a]), LossParams(**params))
    loss.backward()
    return -loss.item(), m, logp.grad.item()


@pytest.mark.parametrize(
    "r, a, term, side, grad",
    [
        (1.5, +1, 1.2, "high", 0.0),  # min(1.5, 1.2) = 1.2: clipped, no gradient
        (1.5, -1, -1.5, None, 1.5),  # min(-1.5, -1.2) = -1.5: unclipped, d(-l)/dlogp = -A*r = 1.5
        (0.5, -1, -0.8, "low", 0.0),  # min(-0.5, -0.8) = -0.8: clipped, no gradient
        (0.5, +1, 0.5, None, -0.5),  # min(0.5, 0.8) = 0.5: unclipped, -A*r = -0.5
    ],
)
def test_clip_sides(r, a, term, side, grad):
    value, m, g = one_token(r, a)
    assert value == pytest.approx(term)
    assert m["clip_frac_high"].item() == (side == "high")
    assert m["clip_frac_low"].item() == (side == "low")
    assert g == pytest.approx(grad)


@pytest.mark.parametrize(
    "r, a, term_dapo, term_swapped",
    [
        # eps_low=0.2, eps_high=0.28 (DAPO clip-higher) vs the sides swapped (0.28, 0.2):
        (1.5, +1, 1.28, 1.2),  # clipped at 1 + eps_high
        (1.25, +1, 1.25, 1.2),  # inside [0.8, 1.28] but above 1.2
        (0.75, -1, -0.8, -0.75),  # below 1 - 0.2 = 0.8 -> -0.8; above 0.72 -> unclipped -0.75
        (0.5, -1, -0.8, -0.72),  # clipped at 1 - eps_low
    ],
)
def test_asymmetric_epsilons(r, a, term_dapo, term_swapped):
    for (lo, hi), term in (((0.2, 0.28), term_dapo), ((0.28, 0.2), term_swapped)):
        value, m, _ = one_token(r, a, epsilon_low=lo, epsilon_high=hi)
        assert value == pytest.approx(term)
        # clipped exactly when the term is not r*A; the side is the sign of A
        clipped = value != pytest.approx(r * a)
        assert m["clip_frac_high"].item() == (clipped and a > 0)
        assert m["clip_frac_low"].item() == (clipped and a < 0)


# ---------------------------------------------------------------- KL


def test_k3_hand_value_and_in_loss():
    # ref - logp = ln 2 -> k3 = 2 - ln 2 - 1 = 1 - ln 2 ~= 0.30685.
    # r = 1, A = 0.5, beta = 0.1: l = 0.5 - 0.1 * 0.30685 = 0.469315 on both tokens -> loss -0.469315.
    # dk3/dlogp = -exp(ln 2) + 1 = -1, so dl/dlogp = A + beta = 0.6; grpo over 2 tokens -> -0.3.
    k3 = 1 - math.log(2)
    logp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    ref = torch.full((1, 2), math.log(2), dtype=F64)
    loss, m = grpo_loss(logp, logp.detach(), ref, t([0.5]), LossParams(beta=0.1))
    loss.backward()
    assert_close(loss, t(-(0.5 - 0.1 * k3)))
    assert_close(m["policy_loss"], t(-0.5))
    assert_close(logp.grad, t([[-0.3, -0.3]]))
    assert_close(k3_kl(torch.zeros(1, dtype=F64), t([math.log(2)])), t([k3]))


def test_k3_nonnegative_and_zero_at_ref():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(1000, generator=g) * 3
    ref = logp + torch.randn(1000, generator=g) * torch.logspace(-10, 1, 1000)
    assert (k3_kl(logp, ref) >= 0).all()
    assert torch.equal(k3_kl(logp, logp), torch.zeros(1000))


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("loss_type, sequences", [("grpo", None), ("bnpo", None), ("dr_grpo", None), ("dapo", None),
                                                  ("dapo", 6.0)])
def test_gradient_at_ratio_one_is_weighted_advantage(loss_type, sequences):
    # r = 1: d loss / d logp_ij = -A_i * w with w = 1/(S*N) = 1/12 (S = 3 sequences, N = 4 tokens) for every
    # type, or 1/(sequences*N) = 1/24 for dapo given the update's 6 sequences
    logp = torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    adv = t([0.5, -2.0, 1.5])
    loss, m = grpo_loss(logp, logp.detach(), None, adv, LossParams(loss_type=loss_type), sequences=sequences)
    loss.backward()
    assert_close(logp.grad, (-adv / (12 if sequences is None else 24))[:, None].expand(3, 4))
    assert m["ratio_mean"].item() == 1.0 and m["clip_frac_low"].item() == m["clip_frac_high"].item() == 0.0


def test_equal_reward_groups_give_zero_loss_and_gradient():
    adv = group_advantages(t([5, 5, 5, 1, 1, 1]), group_size=3)  # [0]*6
    logp = torch.randn(6, 5, dtype=F64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    old = logp.detach() + 0.3  # r != 1, so only A = 0 makes it vanish
    loss, _ = grpo_loss(logp, old, None, adv)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros(6, 5, dtype=F64))


def test_constants_are_detached_and_masked_mean():
    logp = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2, requires_grad=True)
    ref = torch.zeros(1, 2, requires_grad=True)
    loss, _ = grpo_loss(logp, old, ref, torch.ones(1), LossParams(beta=0.1))
    loss.backward()
    assert old.grad is None and ref.grad is None and logp.grad is not None
    # (1 + 3) / 2 = 2 over the unmasked entries; the NaN is masked out.
    assert masked_mean(torch.tensor([1.0, NAN, 3.0]), torch.tensor([1, 0, 1])).item() == 2.0


def test_loss_errors():
    logp, old, adv = hand_batch()
    with pytest.raises(ValueError, match="grpo.*bnpo.*dr_grpo.*dapo.*cispo"):
        LossParams(loss_type="ppo")
    with pytest.raises(ValueError, match="token.*sequence"):
        LossParams(importance_sampling_level="batch")
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logp, old, None, adv, LossParams(beta=0.04))


def test_normalize_then_sum_z_scores_each_reward_within_its_group_then_weighs():
    # Two groups of 2, rewards A and B, weights 1 and 0.5. Group 1: A = [1, 3] -> mean 2, Bessel std
    # sqrt(2), z = [-0.7071, 0.7071]; B = [0, 100] -> mean 50, std 70.71, the same z. Total: z_A + 0.5 z_B
    # = [-1.0607, 1.0607]. Group 2: A constant (z 0); B has one value (no spread, z 0) and a NaN.
    # Row 2: A applies (0), B does not: 0. Row 3 with A's weight 0 and B's value NaN: nothing applies, NaN.
    rewards = torch.tensor([[1.0, 0.0], [3.0, 100.0], [10.0, 5.0], [10.0, float("nan")]])
    weights = torch.tensor([[1.0, 0.5], [1.0, 0.5], [1.0, 0.5], [0.0, 0.5]])
    total = normalize_then_sum(rewards, weights, group_size=2)
    torch.testing.assert_close(total[:3], torch.tensor([-1.0607, 1.0607, 0.0]), atol=2e-4, rtol=0)
    assert total[3].isnan()
    # the point of it: a reward's scale no longer sets its share of the advantage
    scaled = rewards * torch.tensor([1.0, 1000.0])
    torch.testing.assert_close(normalize_then_sum(scaled, weights, 2)[:3], total[:3], atol=2e-4, rtol=0)


# ---------------------------------------------------------------- the algorithm menu (TRL's names)


def test_dapo_is_bnpo_on_one_process_and_the_global_token_mean_across_two():
    # TRL: dapo divides the token sum by the global batch's active tokens over num_processes, and
    # DDP then averages the processes' gradients; bnpo averages each process's own token mean.
    logp, old, adv = hand_batch()  # token sum 0.4 over 5 tokens (see hand_batch)
    bnpo, _ = grpo_loss(logp, old, None, adv, LossParams(loss_type="bnpo"))
    dapo, _ = grpo_loss(logp, old, None, adv, LossParams(loss_type="dapo"))
    assert_close(dapo, bnpo)
    assert_close(dapo, t(-0.08))
    # A second process holds one sequence of one token, r = 1 and A = +1: token sum 1 over 1 token.
    logp2, old2 = ratios_to_logprobs([[1.0]])
    adv2 = t([1.0])
    # bnpo: mean(-0.4/5, -1/1) = -0.54. dapo: global 6 sequences of N = 1, each process divides by 6/2 = 3:
    # mean(-0.4/3, -1/3) = -1.4/6, the token mean of the whole global batch.
    per_proc = [grpo_loss(lp, o, None, a, LossParams(loss_type=lt), sequences=6 / 2 if lt == "dapo" else None)[0]
                for lt in ("bnpo", "dapo") for lp, o, a in ((logp, old, adv), (logp2, old2, adv2))]
    assert_close((per_proc[0] + per_proc[1]) / 2, t(-0.54))
    assert_close((per_proc[2] + per_proc[3]) / 2, t(-1.4 / 6))


@pytest.mark.parametrize(
    "r, a, grad, clipped",
    [
        # loss = -sg(min(r, 5)) * A * logp / 1 token: d loss / d logp = -min(r, 5) * A
        (1.5, +1, -1.5, False),  # the clipped surrogate would give 0 here (r > 1.28): CISPO keeps it
        (6.0, +1, -5.0, True),  # the weight is capped at eps_high = 5
        (0.5, -1, 0.5, False),  # r < 0.8 with A < 0: PPO-clip gives 0, CISPO -r * A = 0.5
    ],
)
def test_cispo_clips_the_detached_weight_not_the_surrogate(r, a, grad, clipped):
    value, m, g = one_token(r, a, loss_type="cispo", epsilon_high=5.0)
    assert g == pytest.approx(grad)
    assert value == pytest.approx(min(r, 5.0) * a * math.log(r))  # l = w * A * logp, logp = ln r (old = 0)
    assert m["clip_frac_high"].item() == clipped and m["clip_frac_low"].item() == 0


def test_cispo_multiplies_the_log_prob_itself_and_counts_a_capped_weight_on_either_sign():
    # TRL's per-token loss is -w * A * logp with the absolute log-prob: logp = -0.5, old = -1.5 -> r = e,
    # w = min(e, 2) = 2; A = -1: l = 2 * -1 * -0.5 = 1, loss -1 (one token); d loss / d logp = -w * A = 2
    logp = t([[-0.5]]).requires_grad_()
    loss, m = grpo_loss(logp, t([[-1.5]]), None, t([-1.0]), LossParams(loss_type="cispo", epsilon_high=2.0))
    loss.backward()
    assert_close(loss, t(-1.0))
    assert_close(logp.grad, t([[2.0]]))
    assert m["clip_frac_high"].item() == 1.0  # the cap bound a negative-advantage token too


def test_sequence_level_ratio_is_the_exponent_of_the_mean_token_log_ratio():
    # token log-ratios [0.1, 0.3]: s = exp(0.2) = 1.2214 (inside [0.8, 1.28]), A = +1, grpo over 2 tokens:
    # loss = -(s + s) / 2 = -s; d loss / d logp_t = -s * (1/2): the sequence ratio moves with each token.
    logp = t([[0.1, 0.3]]).requires_grad_()
    loss, m = grpo_loss(logp, torch.zeros(1, 2, dtype=F64), None, t([1.0]),
                        LossParams(epsilon_high=0.28, importance_sampling_level="sequence"))
    loss.backward()
    s = math.exp(0.2)
    assert_close(loss, t(-s))
    assert_close(logp.grad, t([[-s / 2, -s / 2]]))
    assert m["ratio_mean"].item() == pytest.approx(s)  # both tokens' ratio is s
    # token ratios [4, 1] (geometric mean 2 > 1.28): the whole sequence is clipped, no gradient; token
    # level clips only the first token and keeps the second's gradient
    for level, grad in (("sequence", [0.0, 0.0]), ("token", [0.0, -0.5])):
        logp, old = ratios_to_logprobs([[4.0, 1.0]])
        loss, m = grpo_loss(logp, old, None, t([1.0]), LossParams(epsilon_high=0.28, importance_sampling_level=level))
        loss.backward()
        assert_close(logp.grad, t([grad]))
    assert m["clip_frac_high"].item() == 0.5  # token level: one of two tokens


def test_sequence_level_equals_token_level_on_policy():
    # at r = 1 (the first update) both levels give the same loss and gradient
    g = torch.Generator().manual_seed(4)
    logp0 = torch.randn(3, 5, dtype=F64, generator=g)
    adv = torch.randn(3, dtype=F64, generator=g)
    grads = []
    for level in ("token", "sequence"):
        logp = logp0.clone().requires_grad_()
        loss, _ = grpo_loss(logp, logp0, None, adv, LossParams(loss_type="grpo", importance_sampling_level=level))
        loss.backward()
        grads.append((loss.detach(), logp.grad))
    assert_close(grads[0][0], grads[1][0])
    assert_close(grads[0][1], grads[1][1])


@pytest.mark.parametrize(
    "r, a, delta, term, grad",
    [
        (3.0, -1, 2.0, -2.0, 0.0),  # min(min(3, 2) * -1, 1.28 * -1) = -2: capped, no gradient
        (3.0, -1, None, -3.0, 3.0),  # no cap: -3, d(-l)/dlogp = -A * r = 3
        (1.5, -1, 2.0, -1.5, 1.5),  # below the cap: unchanged
        (3.0, +1, 2.0, 1.28, 0.0),  # A > 0: the usual clip at 1 + eps_high decides (delta > 1.28)
    ],
)
def test_delta_caps_the_ratio_of_negative_advantage_tokens(r, a, delta, term, grad):
    value, m, g = one_token(r, a, epsilon_high=0.28, delta=delta)
    assert value == pytest.approx(term) and g == pytest.approx(grad)
    assert m["delta_frac"].item() == (delta is not None and a < 0 and r > delta)


def test_high_entropy_mask_by_hand():
    # entropies 0.1 0.3 0.5 0.7 0.9; top 40% -> the 0.6 quantile = 0.5 + 0.4 * (0.7 - 0.5) = 0.58
    entropy = t([[0.1, 0.5, 0.9, 0.3, 0.7]])
    assert high_entropy_mask(entropy, 0.4).tolist() == [[False, False, True, False, True]]
    assert high_entropy_mask(entropy, 1.0).all()
    assert high_entropy_mask(t([[1.0, 1.0]]), 0.2).all()  # ties are kept


def test_policy_mask_keeps_the_policy_term_only_where_it_says():
    logp, old, adv = hand_batch()
    # keep row 0 (term 1) and row 4 (term -1.5): bnpo still divides by all 5 tokens -> -(-0.5 / 5)
    keep = torch.tensor([[1], [0], [0], [0], [1]], dtype=torch.bool)
    loss, m = grpo_loss(logp, old, None, adv, LossParams(loss_type="bnpo"), TokenWeights(policy_mask=keep))
    assert_close(loss, t(0.1))
    assert_close(m["policy_token_frac"], t(0.4))
    loss.backward()  # bnpo weight 1/5: row 0 -A*r/5 = -0.2; row 4 -A*r/5 = 1.5/5 = 0.3
    assert_close(logp.grad, t([[-0.2], [0], [0], [0], [0.3]]))
    # the KL term is not masked: at ref - logp = ln 2 every token adds beta * (1 - ln 2)
    logp2 = torch.zeros(1, 2, dtype=F64)
    ref = torch.full((1, 2), math.log(2), dtype=F64)
    none_kept = torch.zeros(1, 2, dtype=torch.bool)
    loss, _ = grpo_loss(logp2, logp2, ref, t([1.0]), LossParams(beta=0.1), TokenWeights(policy_mask=none_kept))
    assert_close(loss, t(0.1 * (1 - math.log(2))))


def test_loss_params_from_a_train_config():
    from grpo_vision.config import TrainConfig

    p = LossParams.from_config(TrainConfig())  # the config's defaults: DAPO's clip-higher, delta 0 = off
    assert (p.epsilon_low, p.epsilon_high, p.delta, p.beta) == (0.2, 0.28, None, 0.0)
    assert LossParams.from_config(TrainConfig(delta=4.0)).delta == 4.0


# ---------------------------------------------------------------- token weights and TRL 1.16's options


def test_policy_weight_makes_the_policy_term_a_weighted_mean():
    # hand_batch's terms: [1, 1.2 (clipped), 0.5, -0.8 (clipped), -1.5].
    # w = [1, 0, 2, 0.5, 1]: sum w = 4.5, sum w l = 1 + 0 + 1 - 0.4 - 1.5 = 0.1
    # -> loss = -0.1 / (4.5 + 1e-6). d loss / d logp = -w A r / 4.5 where unclipped: row 0 -1/4.5,
    # row 2 -2 * 0.5 / 4.5, row 4 -1 * -1.5 / 4.5 = +1/3; the clipped tokens and w = 0 get 0.
    logp, old, adv = hand_batch()
    w = t([[1.0], [0.0], [2.0], [0.5], [1.0]])
    loss, m = grpo_loss(logp, old, None, adv, LossParams(loss_type="bnpo"), TokenWeights(policy_weight=w))
    loss.backward()
    assert_close(loss, t(-0.1 / (4.5 + 1e-6)))
    assert_close(m["policy_loss"], loss.detach())
    assert_close(logp.grad, t([[-1 / 4.5], [0], [-1 / 4.5], [0], [1.5 / 4.5]]), rtol=1e-5, atol=0)
    # a global weight total (an update's micro-batches): the same sum, a different divisor
    loss, _ = grpo_loss(logp.detach(), old, None, adv, weights=TokenWeights(policy_weight=w, policy_total=10.0))
    assert_close(loss, t(-0.01))


def test_kl_weight_scales_each_tokens_kl():
    # ref - logp = ln 2 on both tokens, A = 0: loss = beta * mean(m k3) = 0.1 * (1 - ln 2) * (0.5 + 1) / 2
    logp = torch.zeros(1, 2, dtype=F64)
    ref = torch.full((1, 2), math.log(2), dtype=F64)
    loss, _ = grpo_loss(logp, logp, ref, t([0.0]), LossParams(beta=0.1), TokenWeights(kl_weight=t([[0.5, 1.0]])))
    assert_close(loss, t(0.1 * (1 - math.log(2)) * 0.75))


def test_bias_corrected_kl_multiplies_k3_by_the_ratio_with_its_gradient():
    # TRL: per_token_kl * coef_1, coef_1 = exp(logp - old) not detached. At r = 1 (logp = old = 0) the value is
    # k3 = 1 - ln 2, but d(r k3)/d logp = r k3 + r dk3/dlogp = (1 - ln 2) + (1 - e^(ln 2)) = -ln 2, against -1 for
    # plain k3: beta 0.1 -> gradients -0.0693 and -0.1 (one token, A = 0).
    ref = torch.full((1, 1), math.log(2), dtype=F64)
    for corrected, grad in ((True, -0.1 * math.log(2)), (False, -0.1)):
        logp = torch.zeros(1, 1, dtype=F64, requires_grad=True)
        loss, _ = grpo_loss(logp, torch.zeros(1, 1, dtype=F64), ref, t([0.0]),
                            LossParams(beta=0.1, use_bias_correction_kl=corrected))
        loss.backward()
        assert_close(loss.detach(), t(0.1 * (1 - math.log(2))))
        assert_close(logp.grad, t([[grad]]))
    # off the policy (old = -ln 2, r = 2): the value doubles
    loss, _ = grpo_loss(torch.zeros(1, 1, dtype=F64), t([[-math.log(2)]]), ref, t([0.0]),
                        LossParams(beta=0.1, use_bias_correction_kl=True))
    assert_close(loss, t(0.2 * (1 - math.log(2))))


def test_entropy_bonus_is_the_mean_entropy_of_the_policy_term_tokens():
    # test_policy_mask_...'s batch (loss 0.1) with entropies; the kept tokens hold 1 and 5: bonus mean 3,
    # coef 0.01 -> loss 0.1 - 0.03 = 0.07; d loss / d H = -0.01 / 2 on the kept tokens, 0 elsewhere
    logp, old, adv = hand_batch()
    keep = TokenWeights(policy_mask=torch.tensor([[1], [0], [0], [0], [1]], dtype=torch.bool))
    entropy = t([[1.0], [2.0], [3.0], [4.0], [5.0]]).requires_grad_()
    loss, m = grpo_loss(logp, old, None, adv, LossParams(loss_type="bnpo", entropy_coef=0.01), keep, entropy)
    loss.backward()
    assert_close(loss, t(0.07))
    assert_close(m["entropy"], t(3.0))
    assert_close(entropy.grad, t([[-0.005], [0], [0], [0], [-0.005]]))
    # a coefficient of 0 (the adaptive controller's, while entropy is high) adds nothing; the mean is still measured
    loss, m = grpo_loss(logp.detach(), old, None, adv, LossParams(loss_type="bnpo", entropy_coef=0.0), keep,
                        entropy.detach())
    assert_close(loss, t(0.1))
    assert_close(m["entropy"], t(3.0))


def test_adaptive_entropy_coefficient_steps_toward_the_target():
    # TRL: + delta when entropy <= target, - delta above, within [min, max]; applied only at or below target
    assert adaptive_entropy_coef(0.1, 0.15, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.105)
    assert adaptive_entropy_coef(0.1, 0.2, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.105)
    assert adaptive_entropy_coef(0.1, 0.3, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.095)
    assert adaptive_entropy_coef(0.998, 0.1, 0.2, 0.005, 0.0, 1.0) == 1.0
    assert adaptive_entropy_coef(0.002, 0.3, 0.2, 0.005, 0.0, 1.0) == 0.0
    assert entropy_coef_to_apply(0.1, math.inf, 0.2) == 0.0  # the first update: no entropy measured yet
    assert entropy_coef_to_apply(0.1, 0.15, 0.2) == 0.1


def test_off_policy_mask_drops_drifted_negative_advantage_sequences():
    # two_images seq1 (A = -1): r = [0.5, 1.5, 1] -> old - logp = [ln 2, -ln 1.5, 0], mean 0.0958940.
    # threshold 0.09: dropped -> bnpo policy sum 2.7 (seq0 only) over the 6 tokens -> loss -0.45.
    # threshold 0.1: kept -> 0.1 as without the mask. seq0 (A > 0) is kept whatever its drift.
    logp, old, adv = two_images()
    kept = off_policy_mask(adv, logp, old, 0.09)
    assert kept.tolist() == [[True], [False]]
    for threshold, expected, frac in ((0.09, -0.45, 0.5), (0.1, 0.1, 0.0), (0.0958, -0.45, 0.5), (0.0960, 0.1, 0.0)):
        p = LossParams(loss_type="bnpo", off_policy_mask_threshold=threshold)
        loss, m = grpo_loss(logp, old, None, adv, p)
        assert_close(loss, t(expected))
        assert m["off_policy_frac"].item() == frac


def test_mixup_state_dict_is_trls_tr_dpo_update():
    # ref = 0.6 policy + 0.4 ref: [0.6 + 1.2, 1.2 + 2.4] = [1.8, 3.6]; an integer tensor is the policy's
    policy = {"w": torch.tensor([1.0, 2.0]), "step": torch.tensor(5)}
    ref = {"w": torch.tensor([3.0, 6.0]), "step": torch.tensor(1)}
    out = mixup_state_dict(policy, ref, 0.6)
    assert_close(out["w"], torch.tensor([1.8, 3.6]))
    assert out["step"].item() == 5
    assert torch.equal(ref["w"], torch.tensor([3.0, 6.0]))  # inputs untouched
    assert torch.equal(mixup_state_dict(policy, ref, 1.0)["w"], policy["w"])  # alpha 1: a copy
    with pytest.raises(ValueError, match="same keys"):
        mixup_state_dict({"w": torch.zeros(2)}, {"v": torch.zeros(2)}, 0.5)


def test_informative_groups_are_those_with_a_spread():
    assert informative_groups(t([1, 2, 5, 5, NAN, 3]), 2).tolist() == [True, False, False]


def test_loss_params_carry_trl_116_options_from_the_config():
    from grpo_vision.config import TrainConfig

    p = LossParams.from_config(TrainConfig())  # off by default: today's loss
    assert (p.use_bias_correction_kl, p.off_policy_mask_threshold, p.entropy_coef) == (False, None, 0.0)
    p = LossParams.from_config(TrainConfig(use_bias_correction_kl=True, off_policy_mask_threshold=0.5,
                                           entropy_coef=0.01))
    assert (p.use_bias_correction_kl, p.off_policy_mask_threshold, p.entropy_coef) == (True, 0.5, 0.01)


def test_the_loss_reads_a_mixed_plan_and_image_count_without_a_branch():
    # two sequences of T = 2 plan positions then N = 2 image tokens, on-policy (ratio 1: each term is A); row 0's
    # plan has one token at plan weight 0.5 and padding whose NaN log-prob must add nothing
    logp = torch.tensor([[-1.0, float("nan"), -2.0, -3.0], [-1.0, -1.0, -2.0, -3.0]])
    count = torch.tensor([[0.5, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    bnpo, m = grpo_loss(logp, logp, None, adv, LossParams(loss_type="bnpo"), TokenWeights(count=count))
    assert bnpo.item() == pytest.approx(-(2.5 - 4.0) / 6.5)  # -sum(c A) / sum(c)
    assert m["ratio_mean"].item() == 1.0  # over the counted tokens: the NaN padding is not one
    grpo, _ = grpo_loss(logp, logp, None, adv, LossParams(loss_type="grpo"), TokenWeights(count=count))
    assert grpo.item() == pytest.approx(0.0)  # each row's weighted mean: 2.5 / 2.5 and -4 / 4
    # every token counting once is the default, bit for bit, for every loss type
    x, adv = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([0.5, -1.0, 2.0, 0.0])
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo"):
        p = LossParams(loss_type=loss_type, beta=0.1)
        ones = grpo_loss(x, x.flip(0), x * 1.1, adv, p, TokenWeights(count=torch.ones(4, 6)))
        default = grpo_loss(x, x.flip(0), x * 1.1, adv, p)
        assert torch.equal(ones[0], default[0]) and all(torch.equal(ones[1][k], default[1][k]) for k in ones[1])


def test_gspo_and_the_entropy_bonus_read_only_the_counted_tokens():
    # GSPO's sequence ratio is the count-weighted geometric mean: the padding's log ratio (5.0) is not in it;
    # the entropy bonus averages the counted tokens' entropies (the padding's 100 is not one)
    logp = torch.tensor([[0.3, 5.0, -0.1, 0.1]])
    count = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    entropy = torch.tensor([[2.0, 100.0, 1.0, 3.0]])
    _, m = grpo_loss(logp, torch.zeros(1, 4), None, torch.ones(1), LossParams(importance_sampling_level="sequence",
                                                                             entropy_coef=0.1),
                     TokenWeights(count=count), entropy)
    assert m["ratio_mean"].item() == pytest.approx(math.exp(0.1))
    assert m["entropy"].item() == pytest.approx(2.0)


def test_grpo_loss_stays_within_its_budget():
    # the loss is the one function every option reaches: <= 8 parameters and <= 50 lines keep its switches in
    # LossParams / TokenWeights (the structure budget of docs/architecture.md)
    import ast
    import inspect

    import grpo_vision.grpo as grpo

    tree = ast.parse(inspect.getsource(grpo))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "grpo_loss")
    assert len(fn.args.args) + len(fn.args.kwonlyargs) <= 8
    assert fn.end_lineno - fn.lineno + 1 <= 50
