"""What a rollout is: a text-plan segment of T positions (T = 0 without a text stage), then N image tokens.

`Plan` holds the text stage of B rollouts, `Rollout` the image tokens with the plan beside them; both select and
join rows (`select`, `cat`), so that every container of the step is cut and joined one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class Plan:  # the text stage of B rollouts; every row T = max_tokens wide
    ids: torch.Tensor  # [B, L] the text stage's input ids (the templated prompt)
    tokens: torch.Tensor  # [B, T] plan tokens, the end token included; the end token again after it (never read)
    mask: torch.Tensor  # [B, T] bool, the plan's own tokens, its end token included (T2I-R1 masks after the EOS)
    logprobs: torch.Tensor  # [B, T] float32 the sampler's log-probs, 0 outside the mask
    entropy: torch.Tensor  # [B, T] float32 the entropy of each token's distribution, 0 outside the mask
    texts: list[str]  # [B] each plan as text (policy.plan_text), without its end token
    prompts: list[str]  # [B] the text stage's prompts (the template applied), from which `ids` were encoded

    @classmethod
    def empty(cls, rows: int, device=None) -> "Plan":
        """The text stage of `rows` rollouts drawn without one: T = 0, so that every rollout is one sequence of
        T + N positions, its plan segment empty (`plan_texts` shows no plan for it)."""
        z = torch.zeros(rows, 0, device=device)
        return cls(z.long(), z.long(), z.bool(), z, z.clone(), [""] * rows, [""] * rows)

    @property
    def width(self) -> int:
        """T, the plan segment's positions (0 without a text stage)."""
        return self.tokens.shape[1]

    def clip(self, width: int) -> "Plan":
        """The plan's first `width` positions (T' <= T), every row kept: what a teacher-forced pass reads."""
        return Plan(self.ids, *(getattr(self, f)[:, :width] for f in ("tokens", "mask", "logprobs", "entropy")),
                    self.texts, self.prompts)

    def select(self, rows: torch.Tensor) -> "Plan":
        """The plan of `rows` (an index tensor or a bool mask `[B]`)."""
        index = rows.nonzero().squeeze(1) if rows.dtype == torch.bool else rows
        return Plan(*(getattr(self, f)[rows.to(self.ids.device)] for f in ("ids", "tokens", "mask", "logprobs",
                                                                             "entropy")),
                    [self.texts[int(i)] for i in index.tolist()], [self.prompts[int(i)] for i in index.tolist()])

    def token_lists(self, end: int) -> list[list[int]]:
        """Each row's plan tokens without its end token (what the image stage is conditioned on)."""
        keep = self.mask & (self.tokens != end)  # [B, T]
        return [row[m].tolist() for row, m in zip(self.tokens.cpu(), keep.cpu())]

    @staticmethod
    def cat(plans: Sequence["Plan"], encode=None) -> "Plan":
        """The rows of `plans` in order. Input ids of several widths (a kind that pads each batch to its longest
        prompt, as Janus does) are made again by `encode` (the policy's encode_plan_prompts) for all the prompts."""
        prompts = [t for p in plans for t in p.prompts]
        if len({p.ids.shape[1] for p in plans}) == 1:
            ids = torch.cat([p.ids for p in plans])
        elif encode is None:
            raise ValueError("the plans' input ids differ in width: pass the policy's encode_plan_prompts")
        else:
            ids = encode(prompts)
        return Plan(ids, *(torch.cat([getattr(p, f) for p in plans]) for f in ("tokens", "mask", "logprobs",
                                                                              "entropy")),
                    [t for p in plans for t in p.texts], prompts)


@dataclass
class Rollout:
    """B rollouts. `rollouts.draw` gives each its text stage (`Plan.empty`, T = 0, without sample.plan), so that a
    drawn rollout is one sequence of T + N positions, a plan segment then an image segment: `sequence_logprobs`,
    `count` and `image_segment` are `[B, T + N]` whatever the stage (nanochat's engine masks, torchtune's
    response_padding_masks, TRL's completion_mask carry such a segment as an always-present mask)."""
    tokens: torch.Tensor  # [B, N] int64 codebook ids
    logprobs: torch.Tensor  # [B, N] float32, per `logprob_mode`
    entropy: torch.Tensor  # [B, N] float32, entropy of the sampling distribution at each step
    plan: Plan | None = None  # the text stage before the image (sample.plan); None: none, made `Plan.empty`
    # [B] int64 forward passes each row's image needed, the prefill included (speculative decoding; None: plain
    # decoding, N each): rollout/forwards_per_image in the metrics
    forwards: torch.Tensor | None = None

    def __post_init__(self):
        self.plan = Plan.empty(self.tokens.shape[0], self.tokens.device) if self.plan is None else self.plan

    @property
    def sequence_logprobs(self) -> torch.Tensor:
        """`[B, T + N]` the sampler's log-probs of the plan's tokens (0 after its end), then of the image's."""
        return torch.cat([self.plan.logprobs, self.logprobs], 1)

    def count(self, plan_weight: float = 1.0) -> torch.Tensor:
        """`[B, T + N]` how much each token counts (grpo.TokenWeights.count): `plan_weight` on a plan's tokens, its
        end token included, 0 on its padding, 1 on every image token."""
        return torch.cat([self.plan.mask.float() * plan_weight, torch.ones_like(self.logprobs)], 1)

    @property
    def image_segment(self) -> torch.Tensor:
        """`[B, T + N]` bool, the image positions (the segment mask the image-grid options read)."""
        return torch.cat([torch.zeros_like(self.plan.mask), torch.ones_like(self.tokens, dtype=torch.bool)], 1)

    def image_only(self) -> "Rollout":
        """The image segment alone (an empty plan segment): what a measurement defined on the image grid scores."""
        return Rollout(self.tokens, self.logprobs, self.entropy, forwards=self.forwards)

    def select(self, rows: torch.Tensor) -> "Rollout":
        """The rollouts `rows` (an index tensor), every field kept."""
        pick = lambda x: None if x is None else x[rows.to(x.device)]  # noqa: E731
        return Rollout(pick(self.tokens), pick(self.logprobs), pick(self.entropy), self.plan.select(rows),
                       pick(self.forwards))

    @staticmethod
    def cat(parts: Sequence["Rollout"], encode=None) -> "Rollout":
        """The rows of `parts` in order, every field kept (`encode`: Plan.cat's)."""
        return Rollout(*(torch.cat([getattr(p, f) for p in parts]) for f in ("tokens", "logprobs", "entropy")),
                       Plan.cat([p.plan for p in parts], encode), cat_forwards([p.forwards for p in parts]))


def cat_forwards(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Rollout.forwards of rows put together: None unless every part has them."""
    return torch.cat(list(parts)) if parts and all(f is not None for f in parts) else None
