"""Training's log-probs: the sampled sequences scored by teacher forcing, with gradients (`sequence_logprobs`) or in
micro-batches without (`batched_logprobs`: the old and the reference log-probs of a step). The same distribution as
the rollout's (distribution.py), so that the first update's ratio is 1 (a test checks it).
"""

from __future__ import annotations

import torch

from grpo_vision.policy import ImagePolicy
from grpo_vision.sampling.distribution import PlanParams, SamplingParams, entropy_of, scoring_logp
from grpo_vision.sampling.plan import plan_width
from grpo_vision.sampling.sequences import Rollout


def sequence_logprobs(policy: ImagePolicy, cond: torch.Tensor, rollout: Rollout,
                      params: SamplingParams) -> torch.Tensor:
    """Teacher-forced log-probs `[B, T + N]` of the rollouts' sequences (`Rollout`: a plan segment of T positions,
    T = 0 without a text stage, then N image tokens) given their condition rows `cond` `[B, L]`, with gradients, in
    one call of the module: the plan's log-probs (0 after its end), then the image's.

    Equal to `sample(...).logprobs` for the same policy weights (a test checks ratio == 1)."""
    return _scores(policy, cond, rollout, params, with_entropy=False)[0]


def sequence_logprobs_and_entropy(policy: ImagePolicy, cond: torch.Tensor, rollout: Rollout,
                                  params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logprobs` and each position's entropy `[B, T + N]` (the entropy bonus's and STAGE's), both with
    gradients."""
    return _scores(policy, cond, rollout, params, with_entropy=True)


def _scores(policy, cond: torch.Tensor, rollout: Rollout, params: SamplingParams, with_entropy: bool):
    """(log-probs, entropies or None) `[B, T + N]` of the rollouts' sequences."""
    B, tokens = cond.shape[0], rollout.tokens
    guided = params.guided and params.logprob_mode == "guided"  # conditional mode needs the conditional branch only
    module = getattr(policy, "module", policy)  # a DDP wrapper keeps the policy in .module
    if guided:
        rows, image_tokens = torch.cat([cond, module.null_condition(cond)]), tokens.repeat(2, 1)  # [2B, L], [2B, N]
    else:
        rows, image_tokens = cond, tokens
    # the policy itself is called, so that a DDP or FSDP wrapper's hooks run, once for both segments: a kind that
    # plans (policy.PlanningPolicy: plan_logits) takes the plan segment up to the batch's longest plan's end (T' <= T)
    plan = rollout.plan.clip(plan_width(rollout.plan))
    if callable(getattr(module, "plan_logits", None)):  # a getattr, which a peft wrapper forwards (isinstance of a
        # runtime-checkable Protocol does not look through __getattr__ from Python 3.12)
        logits, text = policy(rows, image_tokens, plan)  # [2B or B, N, K], [B, T', V]
    else:  # a kind without a text stage: its plan segments are empty
        logits, text = policy(rows, image_tokens), logits_of_no_plan(B, cond.device)
    c, un = (logits[:B], logits[B:]) if guided else (logits, None)
    image = picked(scoring_logp(c, un, tokens, params), tokens, with_entropy)  # [B, N] each
    text_logp = scoring_logp(text, None, plan.tokens, (params.plan or PlanParams()).distribution)  # [B, T', V]
    # 0 past each plan's end and past T' (every row's plan segment is T wide)
    planned = [torch.cat([x, x.new_zeros(B, rollout.plan.width - plan.width)], 1).masked_fill(~rollout.plan.mask, 0.0)
               for x in picked(text_logp, plan.tokens, with_entropy)]  # [B, T] each
    scores = [torch.cat([a, b], 1) for a, b in zip(planned, image)]  # [B, T + N] each
    return scores[0], scores[1] if with_entropy else None


def picked(logp: torch.Tensor, tokens: torch.Tensor, with_entropy: bool) -> list[torch.Tensor]:
    """The log-probs `[...]` of `tokens` in `logp` `[..., K]`, and with `with_entropy` each position's entropy."""
    chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return [chosen, entropy_of(logp)] if with_entropy else [chosen]


def logits_of_no_plan(rows: int, device) -> torch.Tensor:
    """The plan logits `[rows, 0, 0]` of a kind that does not plan: a segment of no positions."""
    return torch.zeros(rows, 0, 0, device=device)


def micro_batches(rows: int | torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
    """Row indices in consecutive chunks of `size`: of `range(rows)`, or of the given index tensor (an
    update's shuffled minibatch). The one way every pass over a step's sequences splits them."""
    rows = torch.arange(rows) if isinstance(rows, int) else rows
    return rows.split(size)


@torch.no_grad()
def batched_logprobs(policy: ImagePolicy, cond: torch.Tensor, rollout: Rollout, params: SamplingParams,
                     micro_batch: int) -> torch.Tensor:
    """`sequence_logprobs` `[B, T + N]` without gradients, `micro_batch` rows a forward pass (the old and the
    reference log-probs of a step)."""
    return torch.cat([sequence_logprobs(policy, cond[idx], rollout.select(idx), params)
                      for idx in micro_batches(cond.shape[0], micro_batch)])


@torch.no_grad()
def batched_logprobs_and_entropy(policy: ImagePolicy, cond: torch.Tensor, rollout: Rollout, params: SamplingParams,
                                 micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logprobs_and_entropy` without gradients, in micro-batches (STAGE's entropies)."""
    parts = [sequence_logprobs_and_entropy(policy, cond[idx], rollout.select(idx), params)
             for idx in micro_batches(cond.shape[0], micro_batch)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
