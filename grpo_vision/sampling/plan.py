"""The text stage: a text plan before the image (`sample.plan`, T2I-R1's two-stage rollout, arXiv 2505.00703;
policy.PlanningPolicy). `sample_plan` draws plan tokens one at a time from the policy's plan logits, with the plan's
own temperature / top-k / top-p and no guidance, until each row's end token or `max_tokens`; `sequence_logprobs`
(score.py) scores them with the same settings (T2I-R1 sampled with transformers' default generation config and
scored with a plain softmax: a gap this closes). A row's plan uniforms are its seed's stream after its N image uniforms, so the
image tokens of a (condition, seed) are the same with or without a plan stage before them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from grpo_vision.sampling.distribution import PlanParams, sample_token, seeded_uniforms
from grpo_vision.sampling.sequences import Plan


@torch.no_grad()
def sample_plan(policy, prompts: Sequence[str], seeds: Sequence[int], params: PlanParams) -> Plan:
    """The text stage of one rollout per prompt (policy.PlanningPolicy), row i from seed `seeds[i]`: plan tokens
    drawn one at a time, without guidance, until each row's end token or `params.max_tokens` (a plan cut there
    keeps its tokens, as T2I-R1's `max_textcot_length` does). Rows that have ended are not read again."""
    B, T, end = len(prompts), params.max_tokens, policy.plan_end_id
    if len(seeds) != B:
        raise ValueError(f"got {len(seeds)} seeds for {B} prompts; pass one seed per image")
    texts = [params.template.format(prompt=p) for p in prompts]
    ids = policy.encode_plan_prompts(texts)  # [B, L]
    device, dist = ids.device, params.distribution
    # each row's stream after its N image uniforms: the image stage draws the same uniforms with or without a plan
    u = seeded_uniforms(seeds, policy.num_image_tokens + T, device)[:, policy.num_image_tokens:]  # [B, T]
    tokens = torch.full((B, T), end, dtype=torch.long, device=device)
    mask = torch.zeros(B, T, dtype=torch.bool, device=device)
    logprobs, entropy = torch.zeros(B, T, device=device), torch.zeros(B, T, device=device)
    cache = policy.new_plan_cache(B, T)
    logits = policy.plan_prefill(ids, cache)  # [B, V]
    alive = torch.ones(B, dtype=torch.bool, device=device)  # rows whose plan has not ended
    for t in range(T):
        token, logp, ent = sample_token(logits, None, u[:, t], dist)  # [B] each
        tokens[:, t] = torch.where(alive, token, end)
        logprobs[:, t], entropy[:, t] = logp * alive, ent * alive
        mask[:, t] = alive
        alive &= token != end
        if t == T - 1 or not bool(alive.any()):  # one host read a plan token: plans are short, images are not
            break
        logits = policy.plan_decode(tokens[:, t], cache)  # [B, V]
    plan = Plan(ids, tokens, mask, logprobs, entropy, [], texts)
    plan.texts = [policy.plan_text(row) for row in plan.token_lists(end)]
    return plan


def plan_width(plan: Plan) -> int:
    """The teacher-forced plan positions a batch needs: up to its longest plan's end token."""
    seen = plan.mask.any(0).nonzero()
    return int(seen[-1]) + 1 if len(seen) else 0
