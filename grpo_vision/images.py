"""Images as pixels: the tensor-to-uint8 conversion and the one grid painter."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """float `[n, 3, H, W]` in [0, 1] -> uint8 `[n, H, W, 3]` (rounded, as a PNG would store it)."""
    return images.clamp(0, 1).mul(255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


@dataclass
class Cell:
    image: np.ndarray  # uint8 [H, W, 3]
    caption: Sequence[str] = ()  # text lines under the image


@lru_cache(maxsize=None)  # one load per size: sample grids and demo clicks draw text again and again
def font(size: int):
    """DejaVu Sans (shipped with matplotlib: spaces, ✓ and ✗ render); PIL's own font if it is missing."""
    from PIL import ImageFont

    try:
        import matplotlib

        return ImageFont.truetype(f"{matplotlib.get_data_path()}/fonts/ttf/DejaVuSans.ttf", size)
    except (ImportError, OSError):
        return ImageFont.load_default()


def paint_grid(rows: Sequence[Sequence[Cell | None]], *, title: str = "", headings: Sequence[tuple[int, str]] = (),
               row_labels: Sequence[str] = (), label_width: int = 0, scale: int = 1, split: int | None = None,
               split_gap: int = 10, pad: int = 2, line: int = 11):
    """A PIL image of cells in rows: optional title, headings over columns (`(column, text)`), labels
    left of each row, captions under each image; images upscaled `scale` times without blur, and an
    extra gap before column `split` (policy | reference). Every sample grid, comparison PNG and
    contact sheet is drawn here."""
    from PIL import Image, ImageDraw

    cells = [c for r in rows for c in r if c is not None]
    size = max(c.image.shape[0] for c in cells) * scale if cells else 0
    lines = max((len(c.caption) for c in cells), default=0)
    cell_w, cell_h = size + pad, size + pad + (lines * line + 2 if lines else 0)
    top = (title.count("\n") + 1) * line + 6 if title else 0
    head = max((t.count("\n") + 1 for _, t in headings), default=0) * line + 4 if headings else 0
    x = lambda col: label_width + col * cell_w + (split_gap if split is not None and col >= split else 0)  # noqa: E731
    columns = max((len(r) for r in rows), default=0)
    sheet = Image.new("RGB", (x(columns) + 4, top + head + len(rows) * cell_h), "white")
    draw = ImageDraw.Draw(sheet)
    face = font(line - 2)
    if title:
        draw.text((4, 2), title, fill="black", font=face)
    for col, text in headings:
        draw.text((x(col), top + 2), text, fill="black", font=face)
    for r, row in enumerate(rows):
        y = top + head + r * cell_h
        if r < len(row_labels):  # a label may hold several lines, centred on the row
            label = row_labels[r].split("\n")
            for j, text in enumerate(label):
                draw.text((2, y + size // 2 - len(label) * line // 2 + j * line), text, fill="black", font=face)
        for col, cell in enumerate(row):
            if cell is None:
                continue
            img = Image.fromarray(cell.image)
            sheet.paste(img.resize((size, size), Image.NEAREST) if scale != 1 else img, (x(col), y))
            for j, text in enumerate(cell.caption):
                draw.text((x(col), y + size + 2 + j * line), text, fill="black", font=face)
    return sheet
