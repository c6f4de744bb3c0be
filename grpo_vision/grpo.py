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
`loss_type`: "grpo" averages each sequence's tokens then the sequences; "bnpo" averages all
unmasked tokens in the batch (DAPO's token-level loss); "dr_grpo" divides the token sum by a
constant, sequences * max_tokens (Dr. GRPO), so no sequence's length re-weights its tokens;
"dapo" divides the token sum by `num_items`, the active tokens of the whole global batch (all
micro-batches and processes of one optimizer update), TRL's default.

Variants (names and formulas as in TRL's GRPOTrainer, `grpo_trainer.py` `_compute_loss`):

* "cispo" (MiniMax-M1, arXiv 2506.13585): l_t = sg(min(r_t, eps_high)) * A * logp_t, the importance
  weight clipped and detached instead of the surrogate; every token keeps a gradient. Here eps_high
  is the weight's upper bound itself (ScaleRL's eps_max, 5.0), not 1 + eps_high. Aggregated as "dapo".
* importance_sampling_level "sequence" (GSPO, arXiv 2507.18071): one ratio per sequence,
  s_i = exp(mean_t(logp_t - old_t)), the geometric mean of its token ratios, clipped per sequence.
* delta (INTELLECT-2, arXiv 2505.07291): r_t is also capped at delta in the unclipped term, so a
  token with A < 0 and a huge ratio cannot dominate (two-sided clipping; delta > 1 + eps_high).
* policy_mask (top_entropy_quantile, "Beyond the 80/20 rule", arXiv 2506.01939): only the tokens it
  keeps carry the policy term; the KL and the normalisation still count every unmasked token.
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

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; choose one of {LOSS_TYPES}")
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(f"unknown importance_sampling_level {self.importance_sampling_level!r}; "
                             f"choose one of {IS_LEVELS}")

    @classmethod
    def from_config(cls, train_cfg) -> "LossParams":
        """The settings of a config's `train` section (delta 0 there means off)."""
        t = train_cfg
        return cls(t.beta, t.epsilon_low, t.epsilon_high, t.loss_type, t.importance_sampling_level, t.delta or None)


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


def _aggregate(x: Tensor, mask: Tensor, loss_type: str, max_tokens: int | None,
               num_items: float | Tensor | None = None) -> Tensor:
    """Reduce per-token values `[B*G, N]` to a scalar the way TRL's `loss_type` does."""
    x = torch.where(mask, x, torch.zeros_like(x))  # [B*G, N]
    if loss_type == "grpo":
        per_seq = x.sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [B*G]
        return per_seq.mean()
    if loss_type == "bnpo":
        return x.sum() / mask.sum().clamp(min=1)
    if loss_type in ("dapo", "cispo"):  # the global batch's token count, given by the caller
        items = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=x.dtype)
        return x.sum() / items.clamp(min=1)
    n_max = x.shape[1] if max_tokens is None else max_tokens
    return x.sum() / (x.shape[0] * n_max)  # dr_grpo


def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """Tokens `[B*G, N]` whose entropy is in the top `quantile` of the unmasked ones (1.0: all).

    The threshold is the (1 - quantile) quantile of the unmasked entropies, ties kept, as TRL's
    `get_high_entropy_mask` (top_entropy_quantile; the paper keeps the top 20%). Pass the whole
    global batch's entropies so every process uses one threshold.
    """
    mask = mask.bool()
    if quantile >= 1.0 or not mask.any():
        return mask
    threshold = torch.quantile(entropy[mask].float(), 1.0 - quantile)  # []
    return mask & (entropy >= threshold.to(entropy.dtype))  # [B*G, N]


def surrogate_terms(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, p: LossParams) -> tuple[Tensor, Tensor]:
    """Per-token policy terms l_t `[B*G, N]` (to maximise) and the ratios `[B*G, N]` they used.

    logp, old: `[B*G, N]` with masked entries already zeroed; adv: `[B*G, 1]`.
    """
    # old is detached, so at logp == old the ratio is 1 with d ratio / d logp = 1: the
    # exp(x - x.detach()) identity, giving the plain policy-gradient A * grad(logp).
    log_ratio = logp - old  # [B*G, N]
    if p.importance_sampling_level == "sequence":  # GSPO: the geometric mean of the sequence's token ratios
        log_ratio = masked_mean(log_ratio, mask, dim=1)[:, None].expand_as(logp)  # [B*G, N], one value a row
    ratio = log_ratio.exp()  # [B*G, N]
    if p.loss_type == "cispo":
        weight = ratio.clamp(max=p.epsilon_high).detach()  # [B*G, N] the clipped IS weight, a constant
        return weight * adv * logp, ratio  # [B*G, N] gradient weight * A * grad(logp) on every token
    capped = ratio if p.delta is None else ratio.clamp(max=p.delta)  # [B*G, N] INTELLECT-2's upper cap
    clipped = ratio.clamp(1 - p.epsilon_low, 1 + p.epsilon_high) * adv  # [B*G, N]
    return torch.minimum(capped * adv, clipped), ratio  # [B*G, N]


def _check(logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None, advantages: Tensor, mask: Tensor,
           beta: float) -> None:
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs (the KL term is measured against the reference)")
    if old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must have the same shape [B*G, N]"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B*G]={logprobs.shape[0]}, got {tuple(advantages.shape)}")


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    p: LossParams = LossParams(),
    *,
    max_tokens: int | None = None,
    policy_mask: Tensor | None = None,
    num_items: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GRPO loss (scalar, to minimise) and detached 0-d metrics.

    logprobs/old_logprobs/ref_logprobs/mask/policy_mask: `[B*G, N]`; advantages: `[B*G]`. Masked
    tokens never reach the loss or its gradient, even when their inputs are NaN/inf. old_logprobs and
    ref_logprobs are constants; ref_logprobs may be None only when beta == 0. `num_items` is the
    "dapo" / "cispo" normaliser (default: this batch's unmasked tokens); `max_tokens` the "dr_grpo" one.
    """
    _check(logprobs, old_logprobs, ref_logprobs, advantages, mask, p.beta)
    mask = mask.bool()  # [B*G, N]
    pg_mask = mask if policy_mask is None else mask & policy_mask.bool()  # [B*G, N] tokens with a policy term
    zeros = torch.zeros_like(logprobs)  # [B*G, N]
    # Replace masked entries before any arithmetic: where() sends them no gradient and no NaN.
    logp = torch.where(mask, logprobs, zeros)  # [B*G, N]
    old = torch.where(mask, old_logprobs.detach(), zeros)  # [B*G, N]
    adv = advantages.detach().to(logp.dtype)[:, None]  # [B*G, 1]
    surrogate, ratio = surrogate_terms(logp, old, adv, mask, p)  # [B*G, N] each
    surrogate = torch.where(pg_mask, surrogate, zeros)  # [B*G, N]

    if ref_logprobs is not None:
        ref = torch.where(mask, ref_logprobs.detach(), zeros)  # [B*G, N]
        kl = k3_kl(logp, ref)  # [B*G, N]
    else:
        kl = zeros  # [B*G, N]
    per_token = surrogate - p.beta * kl  # [B*G, N]
    loss = -_aggregate(per_token, mask, p.loss_type, max_tokens, num_items)

    with torch.no_grad():
        if p.loss_type == "cispo":  # only the weight's cap clips, counted on either sign of A (TRL: A > 0 only)
            clip_low, clip_high = torch.zeros_like(mask), ratio > p.epsilon_high  # [B*G, N]
        else:
            # The min picks the clipped (constant, zero-gradient) term only on one side per sign of A:
            # A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low. Elsewhere r*A is the min.
            clip_low = (adv < 0) & (ratio < 1 - p.epsilon_low)  # [B*G, N]
            clip_high = (adv > 0) & (ratio > 1 + p.epsilon_high)  # [B*G, N]
        capped_by_delta = (adv < 0) & (ratio > p.delta) if p.delta is not None else torch.zeros_like(mask)  # [B*G, N]
        any_token = mask.any()
        inf = torch.full_like(ratio, torch.inf)  # [B*G, N]
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        metrics = {
            "kl": masked_mean(kl, mask),
            "clip_frac_low": masked_mean(clip_low.to(ratio.dtype), mask),
            "clip_frac_high": masked_mean(clip_high.to(ratio.dtype), mask),
            "clip_frac": masked_mean((clip_low | clip_high).to(ratio.dtype), mask),
            "delta_frac": masked_mean(capped_by_delta.to(ratio.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
            # With no unmasked token at all, report the neutral ratio 1 rather than +-inf.
            "ratio_max": torch.where(any_token, torch.where(mask, ratio, -inf).amax(), one),
            "ratio_min": torch.where(any_token, torch.where(mask, ratio, inf).amin(), one),
            "policy_loss": -_aggregate(surrogate, mask, p.loss_type, max_tokens, num_items),
            "policy_token_frac": masked_mean(pg_mask.to(ratio.dtype), mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}
