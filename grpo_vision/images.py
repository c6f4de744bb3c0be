"""Image tensors to pixels: the one conversion every reward, grid and demo gallery uses."""

from __future__ import annotations

import numpy as np
import torch


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """float `[n, 3, H, W]` in [0, 1] -> uint8 `[n, H, W, 3]` (rounded, as a PNG would store it)."""
    return images.clamp(0, 1).mul(255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
