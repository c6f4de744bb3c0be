"""Training's log-probs: the sampled sequences scored by teacher forcing, with gradients (`sequence_logprobs`) or in
micro-batches without (`batched_logprobs`: the old and the reference log-probs of a step). The same distribution as
the rollout's (distribution.py), so that the first update's ratio is 1 (a test checks it).
"""

from __future__ import annotations

import dataclasses

import torch

from grpo_vision.policy import ImagePolicy
from grpo_vision.sampling.distribution import SamplingParams, token_logprobs
from grpo_vision.sampling.plan import plan_logprobs, plan_width
from grpo_vision.sampling.sequences import Plan


def sequence_logprobs(policy: ImagePolicy, cond: torch.Tensor, tokens: torch.Tensor,
                      params: SamplingParams, with_entropy: bool = False, plan: Plan | None = None):
    """Teacher-forced log-probs `[B, N]` of `tokens` `[B, N]`, with gradients, in one forward pass
    (`with_entropy`: and each position's entropy `[B, N]`, the entropy bonus's and STAGE's).

    Equal to `sample(...).logprobs` for the same policy weights (a test checks ratio == 1). With the rows' `plan`:
    `[B, T + N]`, the plan's log-probs (`plan_logprobs`, 0 after its end) before the image's, from one call of the
    module (`forward(cond, tokens, plan)`), so that DDP's and FSDP's hooks see one forward for both segments.
    """
    B = cond.shape[0]
    plan = plan if plan is not None and plan.width else None  # T = 0: the image segment is the whole sequence
    guided = params.guided and params.logprob_mode == "guided"  # conditional mode needs the conditional branch only
    if guided:
        null = getattr(policy, "module", policy).null_condition(cond)  # a DDP wrapper keeps the policy in .module
        rows, image_tokens = torch.cat([cond, null]), tokens.repeat(2, 1)  # [2B, L], [2B, N]
    else:
        rows, image_tokens = cond, tokens
    # the policy is called (its forward is image_logits), so that a DDP or FSDP wrapper's hooks run
    if plan is None:
        logits, text = policy(rows, image_tokens), None  # [2B or B, N, K]
    else:  # the forward stops at the batch's longest plan's end: [2B or B, N, K], [B, T', V]
        logits, text = policy(rows, image_tokens, dataclasses.replace(plan, tokens=plan.tokens[:, :plan_width(plan)]))
    c, un = (logits[:B], logits[B:]) if guided else (logits, None)
    image = token_logprobs(c, un, tokens, params, with_entropy)  # [B, N]
    if plan is None:
        return image
    planned = plan_logprobs(text.float(), plan, params.plan, with_entropy)  # [B, T]
    if not with_entropy:
        return torch.cat([planned, image], 1)  # [B, T + N]
    return torch.cat([planned[0], image[0]], 1), torch.cat([planned[1], image[1]], 1)


def micro_batches(rows: int | torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
    """Row indices in consecutive chunks of `size`: of `range(rows)`, or of the given index tensor (an
    update's shuffled minibatch). The one way every pass over a step's sequences splits them."""
    rows = torch.arange(rows) if isinstance(rows, int) else rows
    return rows.split(size)


@torch.no_grad()
def batched_logprobs(policy: ImagePolicy, cond: torch.Tensor, tokens: torch.Tensor, params: SamplingParams,
                     micro_batch: int, with_entropy: bool = False, plan: Plan | None = None):
    """`sequence_logprobs` without gradients, `micro_batch` rows a forward pass: `[B, N]` (the old and
    the reference log-probs of a step; `with_entropy`: and the entropies `[B, N]`; with a `plan`, `[B, T + N]`)."""
    parts = [sequence_logprobs(policy, cond[idx], tokens[idx], params, with_entropy,
                               None if plan is None else plan.select(idx))
             for idx in micro_batches(cond.shape[0], micro_batch)]
    if not with_entropy:
        return torch.cat(parts)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

