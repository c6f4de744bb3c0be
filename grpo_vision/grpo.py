"""GRPO math: group-relative advantages, the clipped surrogate, the k3 KL and the loss.

Every function here is pure: tensors and floats in, tensors out. Shapes: `B*G` sequences (B prompts
times a group of G samples each, groups contiguous), `N` image tokens per sequence.

Advantages (GRPO, DeepSeekMath arXiv 2402.03300; TRL GRPOTrainer): each sample is scored against
its own group, A_i = (R_i - mean_group(R)) / (std + eps). The divisor is the group's std ("group"),
the whole batch's std ("batch", TRL's `scale_rewards="batch"`) or nothing ("none", Dr. GRPO
arXiv 2503.20783, which argues that dividing by the std over-weights near-uniform groups). A NaN
reward means "does not apply to this sample": it is left out of the statistics and gets A = 0.

Loss (PPO-clip applied per token, with the sequence's advantage on every token):

    r_t = exp(logp_t - old_logp_t)
    l_t = min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) - beta * k3_t
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      (Schulman, "Approximating KL divergence")
    loss = -aggregate(l)

`eps_high > eps_low` is DAPO's clip-higher (arXiv 2503.14476). The aggregation is TRL's
`loss_type`: "grpo" averages each sequence's tokens then the sequences; "bnpo" averages the
batch's tokens (DAPO's token-level loss); "dr_grpo" divides the token sum by the constant
sequences * N (Dr. GRPO); "dapo" divides the token sum by the tokens of the whole global batch
(all micro-batches and processes of one optimizer update), TRL's default. TRL's types differ in how
sequences of different lengths weigh their tokens; every image here has the same N tokens, so within
one call the first three are one value up to float rounding. "dapo" differs from "bnpo" across calls,
where an update's micro-batches (or processes) hold unequal row counts: groups dropped.

Variants (names and formulas as in TRL's GRPOTrainer, `grpo_trainer.py` `_compute_loss`):

* "cispo" (MiniMax-M1, arXiv 2506.13585): l_t = sg(min(r_t, eps_high)) * A * logp_t, the importance
  weight clipped and detached instead of the surrogate; every token keeps a gradient. Here eps_high
  is the weight's upper bound itself (ScaleRL's eps_max, 5.0), not 1 + eps_high. Aggregated as "dapo".
* importance_sampling_level "sequence" (GSPO, arXiv 2507.18071): one ratio per sequence,
  s_i = exp(mean_t(logp_t - old_t)), the geometric mean of its token ratios, clipped per sequence.
* delta (INTELLECT-2, arXiv 2505.07291): r_t is also capped at delta in the unclipped term, so a
  token with A < 0 and a huge ratio cannot dominate (two-sided clipping; delta > 1 + eps_high).
* policy_mask (top_entropy_quantile, "Beyond the 80/20 rule", arXiv 2506.01939): only the tokens it
  keeps carry the policy term; the KL and the normalisation still count every token.

Per-token weights (credit assignment, `credit.py`: STAGE, GCPO, guidance-contrastive; None = off). With a
policy weight w the policy term is the weighted mean the sources use instead of the loss type's normaliser,
and with a KL weight m the KL term is aggregated as the loss type says, of m * k3:

    s_t = min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)      (the policy term of l_t)
    loss = -sum_t(w_t a_t s_t) / W + beta * aggregate(m_t * k3_t),   W = sum_t w_t + 1e-6 (or the update's)

`a_t` (advantage_weight) multiplies the token's surrogate outside the normaliser: GCPO's dynamic advantage
weight, which may carry a gradient (a_t > 0, so a_t min(r A, clip(r) A) = min(r A a_t, clip(r) A a_t)).
Tokens outside policy_mask or the off-policy mask have s_t = 0 but keep their w_t in the sum below.

Segments of unequal length (a text plan before the image, T2I-R1, arXiv 2505.00703): a count c_t >= 0 per token
(`TokenWeights.count`: 0 after a plan's end, `train.plan_weight` on plan tokens, 1 on image tokens; always there,
all ones without a plan, so the loss has one path) multiplies every token term, and the token means divide by
sum_t c_t: "bnpo" is then T2I-R1's sum(mask * l) / sum(mask) over both segments (with plan_weight 1), "grpo" each
sequence's weighted mean, GSPO's s_i the c-weighted geometric mean, the entropy bonus a mean over counted tokens.

TRL 1.16 options (`grpo_config.py`, `_compute_loss`):

* use_bias_correction_kl (DeepSeek-V3.2 arXiv 2512.02556): k3_t * r_t, the ratio *not* detached, so the
  KL's gradient is the unbiased reverse-KL gradient for samples of the old policy; off by default here.
* off_policy_mask_threshold (DeepSeek-V3.2 eq. 9): a sequence with A < 0 whose mean old_t - logp_t
  (detached) exceeds the threshold loses its policy term; its KL stays.
* entropy bonus: loss -= coef * mean_t(H_t) over the tokens that carry the policy term, whatever the loss
  type; `adaptive_entropy_coef` is Skywork-OR1's controller (arXiv 2505.22312) as TRL steps it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
IS_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class LossParams:
    """The loss's settings (TRL's names; `train.*` in a config), like `sampling.SamplingParams`."""
    beta: float = 0.0  # weight of the k3 KL to the reference; > 0 needs ref_logprobs
    epsilon_low: float = 0.2  # ratio clip [1 - epsilon_low, 1 + epsilon_high]
    epsilon_high: float = 0.2  # DAPO's clip-higher when > epsilon_low; cispo: the weight's cap itself
    loss_type: str = "grpo"  # one of LOSS_TYPES: how token terms become the loss
    importance_sampling_level: str = "token"  # "sequence": GSPO's one ratio per sequence
    delta: float | None = None  # INTELLECT-2's cap on the unclipped ratio; None = off
    use_bias_correction_kl: bool = False  # k3 times the (differentiable) ratio; TRL 1.16 defaults to True
    off_policy_mask_threshold: float | None = None  # drop A < 0 sequences drifted past it; None = off
    entropy_coef: float = 0.0  # entropy bonus weight (an adaptive controller's current value); 0 = off

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; choose one of {LOSS_TYPES}")
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(f"unknown importance_sampling_level {self.importance_sampling_level!r}; "
                             f"choose one of {IS_LEVELS}")

    @classmethod
    def from_config(cls, train_cfg) -> "LossParams":
        """The settings of a config's `train` section (delta and off_policy_mask_threshold 0 there mean off)."""
        t = train_cfg
        return cls(t.beta, t.epsilon_low, t.epsilon_high, t.loss_type, t.importance_sampling_level, t.delta or None,
                   t.use_bias_correction_kl, t.off_policy_mask_threshold or None, t.entropy_coef)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over entries where `mask` is true; 0 where nothing is unmasked.

    `torch.where`, not `x * mask`, so that NaN/inf in masked entries cannot leak (NaN * 0 = NaN).
    """
    mask = mask.bool()
    total = torch.where(mask, x, torch.zeros_like(x)).sum(dim)  # [] or x.shape without dim
    count = mask.sum(dim).clamp(min=1)  # [] or x.shape without dim
    return total / count


def _group_view(rewards: Tensor, group_size: int) -> Tensor:
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (advantages are relative to the group), got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B*G], got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"len(rewards)={rewards.numel()} is not divisible by group_size={group_size}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.float()
    return rewards.view(-1, group_size)  # [B, G]


def _constant_groups(r: Tensor) -> Tensor:
    """True for groups whose non-NaN rewards are all equal (or that have no non-NaN reward).

    Tested with max == min rather than std == 0: the float mean of equal values can be off by an
    ulp, which would turn "no signal" into a tiny nonzero advantage.
    """
    valid = ~r.isnan()  # [B, G]
    hi = torch.where(valid, r, torch.full_like(r, -torch.inf)).amax(dim=1)  # [B]
    lo = torch.where(valid, r, torch.full_like(r, torch.inf)).amin(dim=1)  # [B]
    return (hi == lo) | ~valid.any(dim=1)  # [B]


def _nanstd(r: Tensor, dim: int | None = None) -> Tensor:
    """Unbiased (Bessel) std over non-NaN entries, like TRL's `nanstd`; 0 with fewer than 2."""
    valid = ~r.isnan()
    mean = masked_mean(r, valid, dim)  # [] or [B]
    mean = mean.unsqueeze(dim) if dim is not None else mean
    sq = torch.where(valid, r - mean, torch.zeros_like(r)) ** 2  # r.shape
    count = valid.sum(dim)  # [] or [B]
    return (sq.sum(dim) / (count - 1).clamp(min=1)).sqrt()  # [] or [B]


def group_advantages(
    rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4
) -> Tensor:
    """Group-relative advantages `[B*G]` from rewards `[B*G]` (groups are contiguous runs).

    NaN rewards are excluded from the group mean/std and get advantage 0; an all-NaN group and a
    group whose rewards are all equal get exactly 0 (no learning signal, never NaN).
    """
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {SCALES}")
    r = _group_view(rewards, group_size)  # [B, G]
    valid = ~r.isnan()  # [B, G]
    mean = masked_mean(r, valid, dim=1)  # [B]
    centered = r - mean[:, None]  # [B, G]
    if scale == "group":
        centered = centered / (_nanstd(r, dim=1)[:, None] + eps)  # [B, G]
    elif scale == "batch":
        # Group mean, batch std: TRL `scale_rewards="batch"` (std of the raw rewards of the batch).
        centered = centered / (_nanstd(r) + eps)  # [B, G]
    zero = ~valid | _constant_groups(r)[:, None]  # [B, G]
    adv = torch.where(zero, torch.zeros_like(centered), centered)  # [B, G]
    return adv.reshape(-1)  # [B*G]


def normalize_then_sum(rewards: Tensor, weights: Tensor, group_size: int, eps: float = 1e-4) -> Tensor:
    """Multi-reward totals `[B*G]` the GDPO way (TRL `multi_objective_aggregation="normalize_then_sum"`):
    each reward is z-scored within its group first, so a reward on a larger scale cannot drown the
    others, then weighted and summed. rewards, weights: `[B*G, R]`. A NaN reward (does not apply) or a
    zero weight adds nothing; a sample to which no weighted reward applies gets NaN, as in the plain sum.
    """
    z = torch.stack([group_advantages(rewards[:, j], group_size, "group", eps)  # [B*G] each
                     for j in range(rewards.shape[1])], dim=1)  # [B*G, R]
    applies = ~rewards.isnan() & (weights != 0)  # [B*G, R]
    total = torch.where(applies, z * weights, torch.zeros_like(z)).sum(1)  # [B*G]
    return torch.where(applies.any(1), total, torch.full_like(total, float("nan")))  # [B*G]


def frac_zero_std(rewards: Tensor, group_size: int) -> float:
    """Fraction of groups with zero reward std (all non-NaN rewards equal): metric `adv/frac_zero_std`.

    These groups give zero advantage, so they contribute nothing to the policy gradient.
    """
    return _constant_groups(_group_view(rewards, group_size)).float().mean().item()


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """`[B]` bool: the groups with a reward spread (not all non-NaN rewards equal), whose advantages are not all
    0; what `train.zero_std_groups: drop` keeps (DAPO's dynamic sampling, arXiv 2503.14476)."""
    return ~_constant_groups(_group_view(rewards, group_size))  # [B]


def group_std(rewards: Tensor, group_size: int) -> float:
    """Mean within-group std (unbiased, NaN-aware) over the groups with two or more values; NaN when none
    has: metric `reward/<name>/group_std`, the spread advantages are made of (variance collapse watches it).
    Unlike `reward/<name>/std` it leaves out the spread between prompts."""
    r = _group_view(rewards, group_size)  # [B, G]
    enough = (~r.isnan()).sum(1) >= 2  # [B]
    return _nanstd(r, dim=1)[enough].mean().item() if bool(enough.any()) else float("nan")


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || ref): exp(d) - d - 1 with d = ref - logp.

    Unbiased for samples from the policy and always >= 0 (Schulman, "Approximating KL
    divergence", 2020); the estimator TRL GRPOTrainer uses for its `beta` term. Written as
    expm1(d) - d, the same number, because exp(d) - d - 1 rounds to small negatives near d = 0.
    """
    d = ref_logprobs - logprobs  # same shape as inputs
    return torch.expm1(d) - d  # same shape as inputs


def _token_mean(x: Tensor, dim: int | None = None) -> Tensor:
    """Mean over tokens as `masked_mean` computes it, the sum divided by the count (torch.mean on CUDA
    multiplies by 1/n instead, another rounding)."""
    n = x.numel() if dim is None else x.shape[dim]
    return (x.sum() if dim is None else x.sum(dim)) / x.new_full((), n)  # [] or [B*G]


def _aggregate(x: Tensor, loss_type: str, sequences: Tensor | float | None, count: Tensor) -> Tensor:
    """Reduce per-token values `[B*G, N]` (already multiplied by each token's `count` `[B*G, N]`) to a scalar the
    way TRL's `loss_type` does: its token means divide by the count's sums (every token counting 1: the token
    counts, bit for bit). "dr_grpo" divides by Dr. GRPO's constant, sequences * N; "dapo" / "cispo" the token sum
    by `sequences` * N (default: this batch's count)."""
    if loss_type == "grpo":
        return (x.sum(1) / count.sum(1).clamp(min=1e-6)).mean()
    if loss_type == "dr_grpo":
        return x.sum() / x.numel()
    if loss_type == "bnpo" or sequences is None:
        return x.sum() / count.sum().clamp(min=1e-6)
    return x.sum() / (torch.as_tensor(sequences, dtype=x.dtype, device=x.device) * x.shape[1])  # dapo, cispo


def high_entropy_mask(entropy: Tensor, quantile: float) -> Tensor:
    """Tokens `[B*G, N]` whose entropy is in the top `quantile` of them all (1.0: all).

    The threshold is the (1 - quantile) quantile of the entropies, ties kept, as TRL's
    `get_high_entropy_mask` (top_entropy_quantile; the paper keeps the top 20%). Pass the whole
    global batch's entropies so every process uses one threshold.
    """
    if quantile >= 1.0 or not entropy.numel():
        return torch.ones_like(entropy, dtype=torch.bool)
    threshold = torch.quantile(entropy.flatten().float(), 1.0 - quantile)  # []
    return entropy >= threshold.to(entropy.dtype)  # [B*G, N]


def surrogate_terms(logp: Tensor, old: Tensor, adv: Tensor, p: LossParams, count: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token policy terms l_t `[B*G, N]` (to maximise) and the ratios `[B*G, N]` they used.

    logp, old, count (how much each token counts, grpo_loss's): `[B*G, N]`; adv: `[B*G, 1]`.
    """
    # old is detached, so at logp == old the ratio is 1 with d ratio / d logp = 1: the
    # exp(x - x.detach()) identity, giving the plain policy-gradient A * grad(logp).
    log_ratio = logp - old  # [B*G, N]
    if p.importance_sampling_level == "sequence":  # GSPO: the geometric mean of the sequence's counted token ratios
        counted = torch.where(count > 0, log_ratio * count, torch.zeros_like(log_ratio))  # [B*G, N]
        log_ratio = (counted.sum(1) / count.sum(1).clamp(min=1e-6))[:, None].expand_as(logp)  # [B*G, N] one a row
    ratio = log_ratio.exp()  # [B*G, N]
    if p.loss_type == "cispo":
        weight = ratio.clamp(max=p.epsilon_high).detach()  # [B*G, N] the clipped IS weight, a constant
        return weight * adv * logp, ratio  # [B*G, N] gradient weight * A * grad(logp) on every token
    capped = ratio if p.delta is None else ratio.clamp(max=p.delta)  # [B*G, N] INTELLECT-2's upper cap
    clipped = ratio.clamp(1 - p.epsilon_low, 1 + p.epsilon_high) * adv  # [B*G, N]
    return torch.minimum(capped * adv, clipped), ratio  # [B*G, N]


def off_policy_mask(advantages: Tensor, logprobs: Tensor, sampling_logprobs: Tensor, threshold: float) -> Tensor:
    """`[B*G, 1]` bool, False for the sequences to drop: A < 0 and mean_t(sampling_t - logp_t) > threshold.

    TRL's `get_off_policy_mask` (DeepSeek-V3.2 eq. 9, arXiv 2512.02556): the detached forward-KL estimate of the
    sampling policy to the current one, averaged over the sequence's tokens; a NaN token counts 0.
    Sequences that gain (A >= 0) are always kept: only pushing down drifted samples is what destabilises.
    """
    kl = torch.nan_to_num(sampling_logprobs - logprobs.detach(), nan=0.0)  # [B*G, N]
    drift = _token_mean(kl, dim=1)  # [B*G]
    return ((advantages >= 0) | (drift <= threshold))[:, None]  # [B*G, 1]


def adaptive_entropy_coef(coef: float, entropy: float, target: float, step: float, low: float, high: float) -> float:
    """The entropy coefficient for the next optimizer update: +step when the update's mean entropy is at or below
    `target`, -step above it, kept in [low, high]. Skywork-OR1's adaptive entropy control (arXiv 2505.22312) as TRL
    1.16 steps it (`entropy_coef_delta`, `entropy_coef_min`, `entropy_coef_max`, `entropy_target`)."""
    return min(coef + step, high) if entropy <= target else max(coef - step, low)


def entropy_coef_to_apply(coef: float, last_entropy: float, target: float) -> float:
    """The adaptive coefficient an update applies: `coef` while the previous update's mean entropy is at or below
    `target`, else 0 (TRL: the bonus only engages on collapse; its first update, with no entropy yet, applies 0)."""
    return coef if last_entropy <= target else 0.0


@torch.no_grad()
def mixup_state_dict(policy: dict[str, Tensor], ref: dict[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """The reference after a TR-DPO sync (arXiv 2404.09656; TRL `ref_model_mixup_alpha`, `SyncRefModelCallback`):
    ref = alpha * policy + (1 - alpha) * ref per floating tensor, in the reference's dtype, computed as TRL does
    (`ref.mul_(1 - alpha).add_(policy, alpha=alpha)`), so alpha = 1 is an exact copy. Tensors that are not floating
    point (counters, ids) are the policy's. Both dicts must have the same keys and shapes; neither is changed."""
    if policy.keys() != ref.keys():
        raise ValueError(f"mixup needs the same keys; only in policy: {sorted(policy.keys() - ref.keys())[:5]}, "
                         f"only in ref: {sorted(ref.keys() - policy.keys())[:5]}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"ref_model_mixup_alpha must be in [0, 1], got {alpha}")
    out = {}
    for k, r in ref.items():
        p = policy[k]
        if p.shape != r.shape:
            raise ValueError(f"mixup: {k} is {tuple(p.shape)} in the policy and {tuple(r.shape)} in the reference")
        if r.is_floating_point():
            out[k] = r.mul(1.0 - alpha).add_(p.to(device=r.device, dtype=r.dtype), alpha=alpha)
        else:
            out[k] = p.to(r.device).clone()
    return out


def _check(logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None, advantages: Tensor,
           beta: float) -> None:
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs (the KL term is measured against the reference)")
    if old_logprobs.shape != logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and old_logprobs {tuple(old_logprobs.shape)} "
                         f"must have the same shape [B*G, N]")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B*G]={logprobs.shape[0]}, got {tuple(advantages.shape)}")


@dataclass(frozen=True)
class TokenWeights:
    """Which tokens carry the policy term and how much each token counts (module docstring), `[B*G, N]` each;
    None: every token alike (the plain loss, bit for bit)."""
    policy_mask: Tensor | None = None  # bool, the tokens that carry the policy term (top_entropy_quantile)
    policy_weight: Tensor | None = None  # w, a constant: the policy term becomes sum(w l) / policy_total
    kl_weight: Tensor | None = None  # m: each token's KL counts m times
    advantage_weight: Tensor | None = None  # a_t > 0 (may carry grad): GCPO's dynamic weight on the surrogate
    # W, the weighted mean's divisor: the update's sum(w) over processes where micro-batch losses are summed
    # (dapo / cispo: one weighted mean over the update, not one per micro-batch); None: this call's sum(w) + 1e-6
    policy_total: Tensor | float | None = None
    # c >= 0 `[B*G, T + N]`, how much each token counts (module docstring): 1 on an image token, the plan weight on
    # a plan's tokens, 0 after its end; the default 1.0 counts every token once
    count: Tensor | float = 1.0


def _weighted_policy_term(surrogate: Tensor, weight: Tensor, total: Tensor | float | None) -> Tensor:
    """sum_t(w_t l_t) / W, the sources' weighted mean (STAGE `grpo_trainer.py` L1039-1070; jacklishufan/gcpo
    `grpo_trainer.py` L1084)."""
    w = weight.detach().to(surrogate.dtype)  # [B*G, N]
    total = w.sum() + 1e-6 if total is None else torch.as_tensor(total, dtype=surrogate.dtype)
    return (w * surrogate).sum() / total


def grpo_loss(logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None, advantages: Tensor,
              p: LossParams = LossParams(), weights: TokenWeights = TokenWeights(), entropy: Tensor | None = None,
              sequences: Tensor | float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GRPO loss (scalar, to minimise) and detached 0-d metrics.

    logprobs/old_logprobs/ref_logprobs: `[B*G, N]` (a plan's and an image's tokens: T + N), constants but the
    first, ref_logprobs None only with beta 0; advantages: `[B*G]`. Each token counts `weights.count` times.
    `sequences`: the "dapo" / "cispo" divisor, this process's share of the update's sequences (default: this batch's).
    `entropy` `[B*G, N]` (with grad) adds -p.entropy_coef * mean(H) over the counted tokens with a policy term."""
    _check(logprobs, old_logprobs, ref_logprobs, advantages, p.beta)
    old, zeros = old_logprobs.detach(), torch.zeros_like(logprobs)  # [B*G, N] each
    count = torch.as_tensor(weights.count, dtype=logprobs.dtype, device=logprobs.device).detach().expand_as(zeros)
    adv = advantages.detach().to(logprobs.dtype)[:, None]  # [B*G, 1]
    surrogate, ratio = surrogate_terms(logprobs, old, adv, p, count)  # [B*G, N] each
    if weights.advantage_weight is not None:  # GCPO's dynamic advantage weight (credit.dynamic_advantage_weight)
        surrogate = surrogate * weights.advantage_weight.to(logprobs.dtype)  # [B*G, N]
    # the tokens with a policy term; TRL's entropy bonus covers the entropy mask's, not the off-policy mask's
    every, counted = torch.ones_like(zeros, dtype=torch.bool), count > 0  # [B*G, N] each
    keep = every if weights.policy_mask is None else weights.policy_mask.bool()  # [B*G, N]
    bonus = keep & counted  # [B*G, N]
    if p.off_policy_mask_threshold is not None:
        kept = off_policy_mask(advantages.detach(), logprobs, old, p.off_policy_mask_threshold)  # [B*G, 1]
        keep = keep & kept  # [B*G, N]
    kl = zeros if ref_logprobs is None else k3_kl(logprobs, ref_logprobs.detach())  # [B*G, N]
    kl = kl * ratio if p.use_bias_correction_kl else kl  # [B*G, N] TRL: per_token_kl * coef_1, not detached
    kl = kl if weights.kl_weight is None else kl * weights.kl_weight.detach().to(logprobs.dtype)  # [B*G, N]
    # torch.where: a token that does not count (or has no policy term) adds nothing, whatever its value
    surrogate, kl = torch.where(keep & counted, surrogate * count, zeros), torch.where(counted, kl * count, zeros)
    if weights.policy_weight is None:
        policy = -_aggregate(surrogate, p.loss_type, sequences, count)
        loss = -_aggregate(surrogate - p.beta * kl, p.loss_type, sequences, count)
    else:
        policy = -_weighted_policy_term(surrogate, weights.policy_weight, weights.policy_total)
        loss = policy + p.beta * _aggregate(kl, p.loss_type, sequences, count)
    metrics = {"policy_loss": policy} | ({} if entropy is None else {"entropy": masked_mean(entropy, bonus)})
    if entropy is not None and p.entropy_coef != 0:
        loss = loss - p.entropy_coef * metrics["entropy"]
    with torch.no_grad():
        # PPO-clip's min picks the clipped (zero-gradient) term on one side per sign of A: A > 0 and
        # r > 1 + eps_high, or A < 0 and r < 1 - eps_low; cispo counts its weight's cap on either sign
        cispo = p.loss_type == "cispo"
        low = ~every if cispo else (adv < 0) & (ratio < 1 - p.epsilon_low)  # [B*G, N]
        high = ratio > p.epsilon_high if cispo else (adv > 0) & (ratio > 1 + p.epsilon_high)  # [B*G, N]
        capped = ~every if p.delta is None else (adv < 0) & (ratio > p.delta)  # [B*G, N] INTELLECT-2's cap
        for key, x in (("clip_frac_low", low), ("clip_frac_high", high), ("delta_frac", capped),
                       ("ratio_mean", ratio), ("policy_token_frac", keep)):
            metrics[key] = masked_mean(x.to(ratio.dtype), counted)
        if p.off_policy_mask_threshold is not None:  # sequences whose policy term the drift dropped
            metrics["off_policy_frac"] = (~kept[:, 0]).to(ratio.dtype).mean()
    return loss, {k: v.detach() for k, v in metrics.items()}
