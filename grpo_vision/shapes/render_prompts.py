"""`grpo-vision world render`: ground-truth ShapesWorld renders for the captions of a prompts file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from grpo_vision.prompts import load_prompts
from grpo_vision.shapes.layout import scene_for_caption
from grpo_vision.shapes.scene import CaptionError, parse_caption, render


def render_prompts(prompts_file: str | Path, out: str | Path, n: int = 1, seed: int = 0) -> list[dict]:
    """Write `n` PNGs per caption and an `index.jsonl` (prompt, file, seed); image j uses seed + j."""
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    entries = load_prompts(prompts_file)
    for e in entries:  # validate every caption before writing anything
        try:
            parse_caption(e.prompt)
        except CaptionError as err:
            raise CaptionError(f"{prompts_file}, line {e.line}: {err}") from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index = []
    for i, entry in enumerate(entries):
        for j in range(n):
            scene = scene_for_caption(entry.prompt, np.random.default_rng([seed + j, i]))
            name = f"{i:05d}_{j:02d}.png"
            Image.fromarray(render(scene)).save(out / name)
            index.append({"prompt": entry.prompt, "file": name, "seed": seed + j})
    (out / "index.jsonl").write_text("".join(json.dumps(row) + "\n" for row in index))
    return index
