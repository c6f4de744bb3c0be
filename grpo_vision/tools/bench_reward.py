"""Reward benchmark (`grpo-vision bench reward NAME`): images/s of one registered reward, built and called as
training builds and calls it (make_reward, then its `load`), on images of rendered words whose prompts quote them
('a sign that says "river"'): what a text-rendering reward reads, and plain images to any other reward.

The model load is timed once; the scoring is the median of `repeats` calls after an untimed warm-up call.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from grpo_vision.tools.timing import median_seconds, seconds, sig

WORDS = ("river", "OPEN", "Cafe 24", "grpo", "Hello World", "SALE", "north", "tokens")


def render_text(texts: Sequence[str], size: int = 256, font_size: int = 0) -> torch.Tensor:
    """`[B, 3, size, size]` in [0, 1]: each text in black DejaVu Sans (images.font, matplotlib's copy) centred on
    white; `font_size` 0 = a tenth of the side."""
    from PIL import Image, ImageDraw

    from grpo_vision.images import font

    face = font(font_size or max(8, size // 10))
    out = []
    for text in texts:
        image = Image.new("RGB", (size, size), "white")
        ImageDraw.Draw(image).text((size / 2, size / 2), text, fill="black", font=face, anchor="mm")
        out.append(torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255)  # [3, H, W]
    return torch.stack(out)


def bench_reward(name: str, overrides: Sequence[str] = (), images: int = 16, size: int = 256, repeats: int = 3,
                 device: str = "cpu") -> dict:
    """Seconds to load reward `name` and images/s scoring `images` rendered words of `size` px; `overrides` are
    config `key=value` items (reward.options.NAME.KEY=..., reward.batch_size=...), checked as train checks them."""
    from grpo_vision.config import Config, apply_override
    from grpo_vision.rewards import RewardContext, make_reward

    cfg = Config()
    for item in overrides:
        apply_override(cfg, item)
    fn = make_reward(name, RewardContext(torch.device(device), cfg.reward.batch_size), cfg.reward.options.get(name))
    words = [WORDS[i % len(WORDS)] for i in range(images)]
    pixels, prompts = render_text(words, size), [f'a sign that says "{w}"' for w in words]
    load_s = seconds(getattr(fn, "load", lambda: None))
    scores = []

    def call():
        scores[:] = [torch.as_tensor(fn(pixels, prompts, [{} for _ in prompts]), dtype=torch.float32)]

    median, first = median_seconds(call, repeats, first=True)
    values = scores[0]
    return {"reward": name, "images": images, "size": size, "repeats": repeats, "device": device,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_s": sig(load_s),
            "first_call_s": sig(first), "median_s": sig(median), "images_per_s": sig(images / median),
            "mean_score": None if values.isnan().all() else sig(float(values.nanmean()))}
