"""A self-reward: P(yes) of the policy's own understanding branch asked whether its image shows the prompt.

    reward.weights: {self_judge: 1.0}          train.reference: adapter (LoRA) or frozen
    score = P(yes) / (P(yes) + P(no))          in [0, 1], per image, no extra weights loaded

Janus-Pro reads images as well as it draws them (SigLIP encoder, aligner, the same language model, the text
head), so it can judge its own images with no extra weights. The score is Janus-Pro-R1's (arXiv 2506.01480:
P(yes) of a judge asked about the image, there an InternVL2.5 judge); the judge is the model's own
understanding branch, as in SRUM (arXiv 2510.12784: BAGEL's understanding rewards its generation) and GvU
(CVPR 2026, arXiv 2603.06043, which reads a token-level P(prompt | image) instead of P(yes)). The question
("Does this image show: {prompt}? Answer yes or no.", or the entry's `metadata["questions"]`, as `vlm_judge`)
goes through the model's chat template, and the score is the next-token distribution after "<|Assistant|>:"
restricted to the yes and no variants (vlm_judge.py's `answer_ids` and `yes_share`: yes / Yes / YES, each also
after a space, " Yes", which is how a byte-level BPE answers after the colon).

Which network judges (`model`):
* `reference` (default): the KL reference, the frozen copy (train.reference=frozen) or the policy with its
  adapter disabled (train.reference=adapter, peft's `disable_adapter()`): the base model's judgement, fixed
  while the policy trains (until a `ref_sync_every` moves it), and no second copy of the weights under LoRA.
* `policy`: the policy as it trains, adapter on (GvU's choice). The judge then moves with the generator: a
  policy can learn to please its own reading rather than to draw the prompt. docs/real_models.md.

It runs under `torch.no_grad()`; the adapter is on again after each call (the context manager's exit). Its
memory, the understanding forward of reward.batch_size images, is counted by the estimate (run/memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from grpo_vision.config import ConfigError
from grpo_vision.rewards.base import RewardContext, RewardFn, register_reward
from grpo_vision.rewards.vlm_judge import answer_ids, mean_per_image, questions_asked, yes_share

KEY = "reward.options.self_judge"


@dataclass
class SelfJudgeOptions:
    question: str = "Does this image show: {prompt}? Answer yes or no."  # {prompt}: the image's prompt
    yes_word: str = "yes"  # the answer that scores 1: one token of the policy's tokenizer (quote it in YAML)
    no_word: str = "no"  # the answer that scores 0: one token of the policy's tokenizer (quote it in YAML)
    case_variants: bool = True  # also pool the words' other capitalisations, and each after a space (" Yes")
    model: Literal["reference", "policy"] = "reference"  # which network judges (module docstring)


@register_reward("self_judge", options=SelfJudgeOptions, reads_policy=("janus",))
def self_judge_reward(ctx: RewardContext, opts: SelfJudgeOptions) -> RewardFn:
    """P(yes) / (P(yes) + P(no)) of the policy's own understanding branch (the reference's, or the policy's)."""
    if "{prompt}" not in opts.question:
        raise ConfigError(f"{KEY}.question={opts.question!r} has no {{prompt}}: write where the prompt goes")
    handle = ctx.models.reference if opts.model == "reference" else ctx.models.policy
    model, _ = handle()
    if not callable(getattr(model, "answer_logits", None)):
        raise ConfigError(f"reward 'self_judge' needs a policy with an understanding branch (answer_logits), and "
                          f"{type(model).__name__} has none: use it with policy.kind 'janus'")
    tokenizer = model.answer_tokenizer
    yes = answer_ids(tokenizer, opts.yes_word, f"{KEY}.yes_word", opts.case_variants, spaced=opts.case_variants)
    no = answer_ids(tokenizer, opts.no_word, f"{KEY}.no_word", opts.case_variants, spaced=opts.case_variants)
    if set(yes) & set(no):
        raise ConfigError(f"{KEY}.yes_word and no_word share a token: give two different answers")

    @torch.no_grad()
    def reward(images, prompts, metadata):
        if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
            raise ValueError(f"self_judge scores images [B, 3, H, W] with one prompt each; got images "
                             f"{tuple(images.shape)} and {len(prompts)} prompts")
        asked = questions_asked(prompts, metadata, opts.question)  # [(image index, question)]
        if not asked:
            return torch.zeros(0)
        judge, inside = handle()
        n, scores = ctx.batch_size, []
        with inside:  # the adapter disabled for the reference; on again when it exits
            for k in range(0, len(asked), n):
                chunk = asked[k:k + n]
                logits = judge.answer_logits(images[[i for i, _ in chunk]], [q for _, q in chunk])  # [C, V]
                scores.append(yes_share(logits, yes, no).cpu())  # [C]
        return mean_per_image(asked, torch.cat(scores), len(prompts))  # [B]

    return reward
