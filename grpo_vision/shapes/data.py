"""Batches of rendered ShapesWorld scenes for training the world's models."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from grpo_vision.images import to_uint8  # noqa: F401  (re-exported for the world's builders)
from grpo_vision.shapes.layout import sample_scene
from grpo_vision.shapes.scene import Scene, render


@dataclass
class Batch:
    images: np.ndarray  # [n, 64, 64, 3] uint8
    captions: list[str]  # n captions, one per image
    scenes: list[Scene]  # n scenes (ground truth)


def render_batch(rng: np.random.Generator, n: int, split: str = "train", aesthetic: bool = True) -> Batch:
    pairs = [sample_scene(rng, split=split, aesthetic=aesthetic) for _ in range(n)]
    scenes = [s for s, _ in pairs]
    return Batch(np.stack([render(s) for s in scenes]), [c for _, c in pairs], scenes)


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 `[n, H, W, 3]` -> float `[n, 3, H, W]` in [0, 1]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(255.0)


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB of images in [0, 1], `[n]`."""
    mse = (a - b).pow(2).flatten(1).mean(1).clamp_min(1e-10)
    return 10 * torch.log10(1.0 / mse)
