"""ShapesWorld's rewards from the exact checker (docs/shapes_world.md): its verdict as 1 / 0
(`shapes_exact`), or the share of the caption's attributes it finds right (`shapes_partial`)."""

from __future__ import annotations

import math

import numpy as np
import torch

from grpo_vision.images import to_uint8
from grpo_vision.rewards import RewardContext, RewardFn, register_reward
from grpo_vision.shapes.checker import ATTRIBUTES, CheckResult, check
from grpo_vision.shapes.scene import CaptionError, as_policy_reads


def _checked(score) -> RewardFn:
    """A reward that is `score` of the checker's result for each image and its caption (read as the
    policy reads it: lower case, single spaces); NaN for captions outside the ShapesWorld grammar (the
    reward does not apply to them)."""
    def reward(images, prompts, metadata):
        arr = to_uint8(images)
        out = []
        for a, prompt in zip(arr, prompts):
            try:
                out.append(score(check(np.ascontiguousarray(a), as_policy_reads(prompt))))
            except CaptionError:
                out.append(math.nan)
        return torch.tensor(out)
    return reward


def partial_credit(result: CheckResult) -> float:
    """The share of the caption's attributes that hold (count, colour, shape, and size, background,
    relation where the caption names them): 1 only when the image is all right. Unlike the 0 / 1
    verdict it still ranks a group in which no image is all right, which is most groups of relation
    captions for the base policy (docs/experiments/reward_signal.md)."""
    named = [v for v in (getattr(result, a) for a in ATTRIBUTES) if v is not None]
    return sum(named) / len(named)


@register_reward("shapes_exact")
def shapes_exact(ctx: RewardContext) -> RewardFn:
    """1 when ShapesWorld's exact checker accepts the image for its caption, else 0."""
    return _checked(lambda result: float(result.correct))


@register_reward("shapes_partial")
def shapes_partial(ctx: RewardContext) -> RewardFn:
    """The share of the caption's attributes the exact checker finds right, in [0, 1] (partial_credit)."""
    return _checked(partial_credit)
