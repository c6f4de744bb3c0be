"""ShapesWorld's reward: the exact checker's verdict as 1 / 0 (docs/shapes_world.md)."""

from __future__ import annotations

import math

import numpy as np
import torch

from grpo_vision.images import to_uint8
from grpo_vision.rewards import RewardContext, RewardFn, register_reward
from grpo_vision.shapes.checker import check
from grpo_vision.shapes.scene import CaptionError, as_policy_reads


@register_reward("shapes_exact")
def shapes_exact(ctx: RewardContext) -> RewardFn:
    """1 when ShapesWorld's exact checker accepts the image for its caption (read as the policy reads
    it: lower case, single spaces), else 0; NaN for captions outside the ShapesWorld grammar (the
    reward does not apply to them)."""
    def reward(images, prompts, metadata):
        arr = to_uint8(images)
        out = []
        for a, prompt in zip(arr, prompts):
            try:
                out.append(float(check(np.ascontiguousarray(a), as_policy_reads(prompt)).correct))
            except CaptionError:
                out.append(math.nan)
        return torch.tensor(out)
    return reward
