"""Rewards that need no model: JPEG (in)compressibility and the placebo control."""

from __future__ import annotations

import io

import torch

from grpo_vision.images import to_uint8
from grpo_vision.rewards.base import RewardContext, RewardFn, register_reward


def _jpeg_sizes_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    from PIL import Image

    arr = to_uint8(images)
    sizes = []
    for a in arr:
        buffer = io.BytesIO()
        Image.fromarray(a).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes)


@register_reward("jpeg_compressibility")
def jpeg_compressibility(ctx: RewardContext) -> RewardFn:
    """Minus the JPEG size in kB at quality 95 (ddpo-pytorch's compressibility reward)."""
    return lambda images, prompts, metadata: -_jpeg_sizes_kb(images)


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(ctx: RewardContext) -> RewardFn:
    """The JPEG size in kB at quality 95."""
    return lambda images, prompts, metadata: _jpeg_sizes_kb(images)


@register_reward("placebo")
def placebo(ctx: RewardContext) -> RewardFn:
    """A control that carries no information: each image's score is uniform in [0, 1), a hash of
    its 8-bit pixels and its prompt (deterministic, so a resumed run sees the same values). Train
    on it to measure what GRPO's sampling noise alone does to the other rewards and the checker
    (docs/experiments/previous_world.md measures it on ShapesWorld)."""
    import hashlib

    def reward(images, prompts, metadata):
        arr = to_uint8(images)
        out = []
        for a, prompt in zip(arr, prompts):
            digest = hashlib.sha256(a.tobytes() + prompt.encode()).digest()
            out.append(int.from_bytes(digest[:4], "little") / 2**32)
        return torch.tensor(out)
    return reward
