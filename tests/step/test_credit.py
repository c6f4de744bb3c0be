"""Token-level credit assignment (credit.py) against values worked out by hand in the comments.

The running example is a group of G = 2 images of N = 4 tokens on a 2x2 grid (raster order t = 0..3).
"""

import math

import pytest
import torch
from torch.testing import assert_close

from grpo_vision.config import ConfigError
from grpo_vision.step.credit import (
    average_rank, causal_smooth, critical_tokens, critical_weights, dynamic_advantage_weight, group_similarity,
    guidance_contrast, guidance_contrastive_weights, spatial_gradient, stage_entropy_reward, stage_similarity,
    stage_weights,
)
from grpo_vision.grpo import LossParams, TokenWeights, grpo_loss
from grpo_vision.policy import check_weighting_hooks

F64 = torch.float64
K3 = 1 - math.log(2)  # k3 at ref - logp = ln 2: e^(ln 2) - ln 2 - 1


def t(x):
    return torch.tensor(x, dtype=F64)


def loss_and_grad(weights=None, adv=(1.0, -1.0), ref=None, beta=0.0, advantage_weight=None):
    """grpo_loss at r = 1 (logp = old = 0) for two images of 4 tokens, and d loss / d logp."""
    logp = torch.zeros(2, 4, dtype=F64, requires_grad=True)
    policy_weight, kl_weight = weights if weights is not None else (None, None)
    loss, m = grpo_loss(logp, torch.zeros(2, 4, dtype=F64), ref, t(list(adv)), LossParams(beta=beta, loss_type="bnpo"),
                        TokenWeights(policy_weight=policy_weight, kl_weight=kl_weight,
                                     advantage_weight=advantage_weight))
    loss.backward()
    return loss.detach(), logp.grad, m


# ---------------------------------------------------------------- STAGE

# Code vectors (D = 2) of two groups of 2. Group 1 (advantages +1, -1): image 0 and image 1 at each cell
#   t0: (1,0) vs (2,0)   cos 1  (the scale does not matter)
#   t1: (1,0) vs (0,3)   cos 0
#   t2: (1,0) vs (-1,0)  cos -1
#   t3: (1,0) vs (-1,1)  cos -1/sqrt2 = -0.7071
# Group 2: its rewards were all equal (advantages 0, 0): S = 1 whatever the codes.
CODES = t([[[1, 0], [1, 0], [1, 0], [1, 0]],
           [[2, 0], [0, 3], [-1, 0], [-1, 1]],
           [[1, 0], [0, 1], [1, 1], [0, 1]],
           [[1, 0], [1, 0], [0, 1], [0, -1]]])
ADV = t([1.0, -1.0, 0.0, 0.0])
R2 = 1 / math.sqrt(2)


def test_stage_similarity_and_weights_by_hand():
    # image 0 (A = +1): the images j with A_0 A_j <= 0 are {1} (itself: 1 > 0), so S_0 = cos(e_0, e_1), and
    # the same for image 1: S = [1, 0, -1, -0.7071] on both. Group 2: no advantage -> S = 1.
    s = stage_similarity(CODES, ADV, group_size=2)
    assert_close(s, t([[1, 0, -1, -R2], [1, 0, -1, -R2], [1] * 4, [1] * 4]))
    # w = clamp((1 - S)/2, 0, 1): [0, 0.5, 1, (1 + 0.7071)/2 = 0.8536]; group 2: 0.
    # m = 0.5 + 0.5 clamp(S + 1, 0, 1): [1, 1, 0.5, 0.5 + 0.5 * 0.2929 = 0.6464]; group 2: 1.
    w, m = stage_weights(CODES, ADV, group_size=2)
    assert_close(w, t([[0, 0.5, 1, (1 + R2) / 2]] * 2 + [[0] * 4] * 2))
    assert_close(m, t([[1, 1, 0.5, 0.5 + 0.5 * (1 - R2)]] * 2 + [[1] * 4] * 2))
    assert w.dtype == F64


def test_stage_counts_the_image_itself_when_its_advantage_is_zero():
    # G = 3, one cell, advantages [1, 0, -1], e = (1,0), (0,1), (1,1):
    #   image 0: j in {1, 2} (1*0 <= 0, 1*-1 <= 0): (cos 0 + cos 0.7071) / 2 = 0.3536
    #   image 1 (A = 0): every j, itself included (adds 0): (0 + 0 + 0.7071) / 3 = 0.2357
    #   image 2: j in {0, 1}: (0.7071 + 0.7071) / 2 = 0.7071
    codes = t([[[1, 0]], [[0, 1]], [[1, 1]]])
    s = stage_similarity(codes, t([1.0, 0.0, -1.0]), group_size=3)
    assert_close(s, t([[R2 / 2], [R2 / 3], [R2]]))


def test_stage_entropy_reward_separates_images_that_tie_at_the_top():
    # R_ent = 1 / (1 + (H_ref - H)^2). Group 1 rewards [1, 0]: image 0 alone is best, its bonus is centred on
    # itself -> + 0.4 * 0 (unchanged); image 1 is not best (unchanged).
    # Group 2 rewards [1, 1] (all equal, both best): H = [2, 1], H_ref = [1, 1] -> R_ent = [1/2, 1], mean 0.75
    # -> [1 + 0.4 * (0.5 - 0.75), 1 + 0.4 * (1 - 0.75)] = [0.9, 1.1]: the group has a spread to learn from.
    out = stage_entropy_reward(t([1.0, 0.0, 1.0, 1.0]), t([2.0, 0.0, 2.0, 1.0]), t([1.0, 0.0, 1.0, 1.0]), 2)
    assert_close(out, t([1.0, 0.0, 0.9, 1.1]))
    # a NaN reward (does not apply) is never best and stays NaN; scale 0 changes nothing
    out = stage_entropy_reward(t([float("nan"), 1.0]), t([0.0, 2.0]), t([5.0, 1.0]), 2)
    assert out[0].isnan() and out[1].item() == 1.0
    assert torch.equal(stage_entropy_reward(t([1.0, 1.0]), t([2.0, 1.0]), t([1.0, 1.0]), 2, scale=0.0), t([1.0, 1.0]))


def test_stage_weights_reach_the_loss():
    w, m = stage_weights(CODES[:2], ADV[:2], group_size=2)
    # r = 1, A = [+1, -1]: policy term sum(w r A) / (sum w + 1e-6), sum w = 2 (0 + 0.5 + 1 + 0.8536) = 4.7071;
    # d loss / d logp_it = -w_it A_i / (4.7071 + 1e-6): token 0 (w = 0, codes alike) gets no gradient.
    loss, grad, _ = loss_and_grad((w, m))
    total = 2 * (1.5 + (1 + R2) / 2) + 1e-6
    row = t([0, 0.5, 1, (1 + R2) / 2])
    assert_close(grad, torch.stack([-row, row]) / total)
    assert grad[:, 0].eq(0).all()
    # KL only (A = 0, ref - logp = ln 2 on every token, beta 0.1): 0.1 * mean(m * k3) over the 8 tokens,
    # mean(m) = (1 + 1 + 0.5 + 0.6464) / 4 = 0.7866, where the unweighted loss is 0.1 * k3
    loss, _, _ = loss_and_grad((w, m), adv=(0.0, 0.0), ref=torch.full((2, 4), math.log(2), dtype=F64), beta=0.1)
    assert_close(loss, t(0.1 * K3 * (2.5 + 0.5 + 0.5 * (1 - R2)) / 4))


# ---------------------------------------------------------------- GCPO critical tokens

# Guided entropies on the 2x2 grid: image 0 [0, 2, 0, 8], image 1 [1, 3, 5, 7].
# Token embeddings (E = 2), image 0 vs image 1: t0 alike (cos 1), t1 orthogonal (0), t2 opposite (-1),
# t3 (1,0) vs (1,1) (0.7071).
ENTROPY = t([[0, 2, 0, 8], [1, 3, 5, 7]])
EMBED = t([[[1, 0], [1, 0], [1, 0], [1, 0]], [[1, 0], [0, 1], [-1, 0], [1, 1]]])


def test_causal_smoothing_and_gradient_by_hand():
    # mean of self, left, up-left, up, up-right where they exist. Image 0 [[0, 2], [0, 8]]:
    #   (0,0): 0; (0,1): (2 + 0)/2 = 1; (1,0): (0 + up 0 + up-right 2)/3 = 2/3; (1,1): (8 + 0 + 0 + 2)/4 = 2.5
    # Image 1 [[1, 3], [5, 7]]: 1; 2; (5 + 1 + 3)/3 = 3; (7 + 5 + 1 + 3)/4 = 4.
    smooth = causal_smooth(ENTROPY.view(2, 2, 2))
    assert_close(smooth, t([[[0, 1], [2 / 3, 2.5]], [[1, 2], [3, 4]]]))
    # width 2: both differences one-sided. Image 0: dx = row0 1 - 0 = 1, row1 2.5 - 2/3 = 11/6;
    # dy = col0 2/3 - 0 = 2/3, col1 2.5 - 1 = 1.5 -> |g| = [sqrt(1 + 4/9), sqrt(1 + 2.25), sqrt(121/36 + 4/9),
    # sqrt(121/36 + 2.25)] = [1.2019, 1.8028, 1.9508, 2.3688]. Image 1: dx 1, dy 2 everywhere -> sqrt 5 (a tie).
    g = spatial_gradient(smooth).view(2, 4)
    expected0 = [math.sqrt(1 + 4 / 9), math.sqrt(3.25), math.sqrt(121 / 36 + 4 / 9), math.sqrt(121 / 36 + 2.25)]
    assert_close(g, t([expected0, [math.sqrt(5)] * 4]))


def test_group_similarity_is_the_mean_over_ordered_pairs():
    # G = 2: the pairs (0,1) and (1,0) have the same cosine, so S-bar = cos, the same for both images.
    assert_close(group_similarity(EMBED, 2), t([[1, 0, -1, R2]] * 2))
    # G = 3 at one position, e = (1,0), (0,1), (1,1): pairs 0, 0.7071, 0.7071, each twice -> 1.4142 * 2 / 6
    assert_close(group_similarity(t([[[1, 0]], [[0, 1]], [[1, 1]]]), 3), t([[2 * R2 / 3]] * 3))


def test_critical_tokens_by_hand():
    # fraction 0.25: K = int(4 * 0.25) = 1. margin 0.1: band [int(0.4), int(0.4) + int(3.2)) = positions 0..2.
    # Image 0: first {0}; largest |g| in the band: 1.9508 at t2 (t3's 2.3688 is outside the band);
    #   least alike outside {0, 2}: t1 (0) before t3 (0.7071) -> M = {0, 1, 2}.
    # Image 1: first {0}; |g| ties at sqrt 5: the lowest position, t0 (already in);
    #   least alike outside {0}: t2 (-1) -> M = {0, 2}.
    m = critical_tokens(ENTROPY, EMBED, (2, 2), group_size=2, fraction=0.25)
    assert m.tolist() == [[True, True, True, False], [True, False, True, False]]
    # margin 0.25: band [1, 3). Image 0: t2 (1.9508 > 1.8028), then t1 -> {0, 1, 2}. Image 1: the tie goes to t1,
    # then t2 (-1) -> {0, 1, 2}
    m = critical_tokens(ENTROPY, EMBED, (2, 2), group_size=2, fraction=0.25, margin=0.25)
    assert m.tolist() == [[True, True, True, False]] * 2
    # fraction 1: the first K = N tokens are every token
    assert critical_tokens(ENTROPY, EMBED, (2, 2), group_size=2, fraction=1.0).all()
    with pytest.raises(ValueError, match="grid"):
        critical_tokens(ENTROPY, EMBED, (1, 4), group_size=2)


def test_dynamic_advantage_weight_by_hand():
    # logp - ref = [0, 1, -1, 0.25] -> c = exp(clamp(., -0.5, 0.5)) = [1, e^0.5, e^-0.5, e^0.25]
    # running means: [1, (1 + 1.6487)/2 = 1.3244, (2.6487 + 0.6065)/3 = 1.0851, (3.2552 + 1.2840)/4 = 1.1348]
    logp = t([[0, 1, -1, 0.25]]).requires_grad_()
    w = dynamic_advantage_weight(logp, torch.zeros(1, 4, dtype=F64))
    c = [1, math.exp(0.5), math.exp(-0.5), math.exp(0.25)]
    assert_close(w, t([[c[0], sum(c[:2]) / 2, sum(c[:3]) / 3, sum(c) / 4]]))
    # not detached: d w_3 / d logp_j = c_j / 4 inside the clamp, 0 where it clamps (j = 1, 2)
    w[0, 3].backward()
    assert_close(logp.grad, t([[0.25, 0, 0, c[3] / 4]]))


def test_critical_weights_reach_the_loss():
    crit = critical_tokens(ENTROPY, EMBED, (2, 2), group_size=2, fraction=0.25)  # [[1,1,1,0], [1,0,1,0]], 5 of 8
    w, m = critical_weights(crit)
    assert_close(w, crit.float())
    assert_close(m, crit.float() * 8 / 5)  # mean(m * k3) over 8 tokens = sum(M k3) / sum(M)
    # logp = old = ref = 0, so r = 1 and the dynamic weight a_s = 1 with d a_s / d logp_t = 1/(s+1) for t <= s
    # (0-based). loss = -sum(M a A) / (5 + 1e-6) = -(3 - 2) / 5. d loss / d logp_it =
    # -A_i (M_it + sum_{s >= t} M_is / (s+1)) / 5:
    #   image 0 (A = +1, M = 1 1 1 0): -[1 + 1 + 1/2 + 1/3, 1 + 1/2 + 1/3, 1 + 1/3, 0] / 5
    #   image 1 (A = -1, M = 1 0 1 0): +[1 + 1 + 1/3, 0 + 1/3, 1 + 1/3, 0] / 5
    # t = 3 (not selected, no selected token after it) gets no gradient; image 1's t1 is not selected either
    # but the dynamic weight of t2 averages over it, and the source does not detach that weight.
    logp = torch.zeros(2, 4, dtype=F64, requires_grad=True)
    daw = dynamic_advantage_weight(logp, torch.zeros(2, 4, dtype=F64))
    loss, _ = grpo_loss(logp, torch.zeros(2, 4, dtype=F64), None, t([1.0, -1.0]), LossParams(loss_type="bnpo"),
                        TokenWeights(policy_weight=w, kl_weight=m, advantage_weight=daw))
    loss.backward()
    total = 5 + 1e-6
    assert_close(loss.detach(), t(-1 / total))
    assert_close(logp.grad, t([[-(2 + 1 / 2 + 1 / 3), -(1 + 1 / 2 + 1 / 3), -(1 + 1 / 3), 0],
                               [2 + 1 / 3, 1 / 3, 1 + 1 / 3, 0]]) / total)
    # with the weight detached, an unselected token gets no gradient of the policy term at all
    _, grad, _ = loss_and_grad((w, m), advantage_weight=daw.detach())
    assert grad[~crit].eq(0).all()
    # KL on the selected tokens only: k3 = 1 - ln 2 where ref - logp = ln 2. On the 3 unselected tokens only:
    # 0 (the unweighted mean would be 3/8 * 0.1 * k3); on the 5 selected only: 0.1 * k3 (unweighted 5/8 of it)
    for where, expected in ((~crit, 0.0), (crit, 0.1 * K3)):
        ref = torch.where(where, math.log(2), 0.0).to(F64)
        loss, _, _ = loss_and_grad((w, m), adv=(0.0, 0.0), ref=ref, beta=0.1)
        assert_close(loss, t(expected))


def test_every_token_selected_is_the_plain_loss():
    # M all true: w = 1, m = 1 everywhere, and the weighted mean sum(l) / (8 + 1e-6) is bnpo's sum(l) / 8
    w, m = critical_weights(critical_tokens(ENTROPY, EMBED, (2, 2), group_size=2, fraction=1.0))
    ref = t([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]])
    weighted, g1, _ = loss_and_grad((w, m), adv=(0.7, -0.7), ref=ref, beta=0.1)
    plain, g2, _ = loss_and_grad(None, adv=(0.7, -0.7), ref=ref, beta=0.1)
    assert_close(weighted, plain)
    assert_close(g1, g2)


# ---------------------------------------------------------------- guidance-contrastive

# d = null - cond per token. Image 0: [0, 1, 0, -3]; image 1: [30, -3, 1, 0] (30 is clamped to 20).
NULL = t([[0, 1, 0, -3], [30, -3, 1, 0]])
COND = torch.zeros(2, 4, dtype=F64)
ALPHA = math.log(0.2) / math.log(0.6) - 1  # 2.1507: the top 40% of tokens carry 80% of the weight


def test_guidance_contrast_and_ranks_by_hand():
    # D = clamp(e^d - d - 1, -10, 10): d = 0 -> 0; d = 1 -> e - 2 = 0.7183; d = -3 -> e^-3 + 2 = 2.0498;
    # d = 30 -> clamp 20 -> e^20 - 21 -> clamp 10
    d = guidance_contrast(COND, NULL)
    assert_close(d, t([[0, math.e - 2, 0, math.exp(-3) + 2], [10, math.exp(-3) + 2, math.e - 2, 0]]))
    # a token impossible under the prompt (cond = -inf) or the null prompt: clamps, never NaN
    assert_close(guidance_contrast(t([[-math.inf, 0.0]]), t([[0.0, -math.inf]])), t([[10.0, 10.0]]))
    # ranks lowest first; image 0's two zeros tie for ranks 1 and 2 -> 1.5 each
    assert_close(average_rank(d), t([[1.5, 3, 1.5, 4], [4, 3, 2, 1]]))
    assert_close(average_rank(t([[2.0, 2.0, 2.0]])), t([[2.0, 2.0, 2.0]]))


def test_guidance_contrastive_weights_by_hand():
    # q = rank / 4: image 0 [0.375, 0.75, 0.375, 1], image 1 [1, 0.75, 0.5, 0.25]; w = q^2.1507, then * 4 / sum:
    #   image 0: q^a = [0.121307, 0.538641, 0.121307, 1], sum 1.781255 -> w = [0.272408, 1.209576, 0.272408, 2.245608]
    #   image 1: q^a = [1, 0.538641, 0.225210, 0.050719], sum 1.814570 -> w = [2.204379, 1.187369, 0.496447, 0.111805]
    # m = 0.5 + 0.5 clamp(2 - 2w, 0, 1): w <= 0.5 -> 1, w >= 1 -> 0.5
    w, m = guidance_contrastive_weights(COND, NULL)
    assert_close(w, t([[0.272408, 1.209576, 0.272408, 2.245608], [2.204379, 1.187369, 0.496447, 0.111805]]),
                 atol=2e-6, rtol=0)
    assert_close(w.mean(1), t([1.0, 1.0]))  # mean 1 per image
    assert_close(m, t([[1, 0.5, 1, 0.5], [0.5, 0.5, 1, 1]]))
    assert ALPHA == pytest.approx(2.150660, abs=1e-6)
    # an m between: top_share 0.5 on top_fraction 0.25 -> alpha = ln 0.5 / ln 0.75 - 1 = 1.409421; two tokens
    # with D = [0, 0.7183]: q = [0.5, 1], q^a = [0.376463, 1], w = 2 q^a / 1.376463 = [0.547000, 1.453000],
    # m = [0.5 + 0.5 (2 - 1.094001), 0.5] = [0.953000, 0.5]
    w2, m2 = guidance_contrastive_weights(torch.zeros(1, 2, dtype=F64), t([[0.0, 1.0]]), 0.5, 0.25)
    assert_close(w2, t([[0.547000, 1.453000]]), atol=1e-6, rtol=0)
    assert_close(m2, t([[0.953000, 0.5]]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="top_fraction < top_share"):
        guidance_contrastive_weights(COND, NULL, top_share=0.4, top_fraction=0.8)


def test_guidance_contrastive_weights_reach_the_loss():
    w, m = guidance_contrastive_weights(COND, NULL)
    # r = 1, A = [+1, -1]: d loss / d logp_it = -w_it A_i / (sum w + 1e-6), sum w = 8 (mean 1 on 8 tokens)
    _, grad, _ = loss_and_grad((w, m))
    assert_close(grad, -w * t([[1.0], [-1.0]]) / (8 + 1e-6))
    # KL only, ref - logp = ln 2 everywhere: 0.1 * k3 * mean(m) = 0.1 * k3 * (1 + .5 + 1 + .5 + .5 + .5 + 1 + 1) / 8
    loss, _, _ = loss_and_grad((w, m), adv=(0.0, 0.0), ref=torch.full((2, 4), math.log(2), dtype=F64), beta=0.1)
    assert_close(loss, t(0.1 * K3 * 6 / 8))


def test_a_zero_policy_weight_gives_no_policy_gradient():
    # any weighting's zero: the token's policy term is multiplied by 0 and leaves the normaliser
    w = t([[0.0, 1.0, 2.0, 1.0], [1.0, 1.0, 0.0, 3.0]])
    _, grad, _ = loss_and_grad((w, None), adv=(0.5, -2.0))
    assert grad[w == 0].eq(0).all() and grad[w != 0].ne(0).all()
    assert_close(grad, -w * t([[0.5], [-2.0]]) / (9 + 1e-6))


# ---------------------------------------------------------------- hooks


def test_a_missing_hook_is_refused_naming_the_kind_and_the_weighting():
    class Bare:  # neither hook
        pass

    for weighting, needle in (("stage", "tokenizer's code_vectors"), ("critical", "policy's token_embeddings")):
        with pytest.raises(ConfigError) as err:
            check_weighting_hooks(weighting, "my_gpt", Bare(), Bare())
        text = str(err.value)
        assert f"train.token_weighting={weighting}" in text and "'my_gpt'" in text and needle in text
        assert "\n" not in text
    check_weighting_hooks("guidance_contrastive", "my_gpt", Bare(), Bare())  # needs only null_condition
    check_weighting_hooks("none", "my_gpt", Bare(), Bare())
