"""The sample grid: paired draws (rollouts.compare) painted side by side, policy | reference on the same seeds, each
image captioned with the judge's verdicts and its text plan, the judge's own rendering of the prompt last. Training
paints one every log.sample_every steps (samples/), the report its final_samples.png."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Sequence

import torch

from grpo_vision.files import write_file
from grpo_vision.images import Cell, paint_grid, to_uint8
from grpo_vision.policy import Judge
from grpo_vision.rollouts import Paired


def save_sample_grid(parts: Sequence[Paired], path: Path, judge: Judge | None = None, per_prompt: int = 2,
                     prompts: int = 8, scale: int = 2, root: Path | None = None) -> dict:
    """A PNG of paired draws (rollouts.compare, on the eval seeds: the images `eval` scores): a row for each of
    the first `prompts` entries of each part, the policy's first `per_prompt` images on the left, the reference's
    on the same seeds on the right, each image `scale` times its size; under each, the judge's verdict per
    attribute (✓ / ✗) where the policy kind has a judge, then the image's text plan where the policy wrote one
    (sample.plan), and the judge's own rendering of the prompt (ground truth) last, where the judge can draw one
    (ShapesWorld). `root`: the run folder when `path` lies in a sub-folder of it (written as files.write_file
    writes). Returns what it shows, for the trackers: the sheet (PIL), each image's prompt and seed, and per side
    (policy, reference) the images, the verdicts and each reward's values; with plans, per side the plans too."""
    k = min(per_prompt, *(p.n for p in parts))
    rows = [(p, e * p.n + j) for p in parts for e in range(min(prompts, len(p.entries) // p.n)) for j in range(k)]
    entries = [p.entries[r] for p, r in rows[::k]]
    texts, seeds = [p.entries[r].prompt for p, r in rows], [p.seeds[r] for p, r in rows]
    shown = {side: {"images": torch.stack([p.images[side][r] for p, r in rows]),
                    "verdicts": [getattr(p, side).verdicts[r] for p, r in rows],
                    "rewards": {name: torch.stack([getattr(p, side).raw[name][r] for p, r in rows])
                                for name in getattr(parts[0], side).raw}} for side in ("policy", "reference")}
    plans = {side: None if any(p.plans.get(side) is None for p in parts) else [p.plans[side][r] for p, r in rows]
             for side in shown}
    chars = max(8, parts[0].images["policy"].shape[-1] * scale * 19 // 128)  # as verdict_lines fits 128 px
    cells = {side: [Cell(img, marks + plan_lines(plan, chars)) for img, marks, plan in zip(
        to_uint8(v["images"]), verdict_lines(v["verdicts"]), plans[side] or [None] * len(rows))]
        for side, v in shown.items()}
    render = getattr(judge, "render", None)
    truth = [render(e.prompt, 0) if render else None for e in entries]
    grid = [[*cells["policy"][r * k:(r + 1) * k], *cells["reference"][r * k:(r + 1) * k],
             *([Cell(truth[r], ["ground truth"])] if truth[r] is not None else [])] for r in range(len(entries))]
    headings = [(0, "policy"), (k, "reference")] + ([(2 * k, "what the prompt\ndescribes")] if any(
        t is not None for t in truth) else [])
    sheet = paint_grid(grid, headings=headings, row_labels=[textwrap.fill(e.prompt, 26) for e in entries],
                       label_width=180, split=k, scale=scale, line=13)
    write_file(path, lambda f: sheet.save(f, format="PNG"), root)
    return {"sheet": sheet, "prompts": texts, "seeds": seeds, **{
        key: {side: v[key] for side, v in shown.items()} for key in ("images", "verdicts", "rewards")},
        **({"plans": plans} if any(v is not None for v in plans.values()) else {})}


def plan_lines(plan: str | None, width: int = 19, lines: int = 3) -> list[str]:
    """An image's text plan as caption lines: 'plan: ...' wrapped to `width` characters, at most `lines` of them (a
    longer plan cut with '…'; the trackers' text holds it whole); none for an image drawn without a plan."""
    if plan is None:
        return []
    return textwrap.wrap(f"plan: {plan or '(empty)'}", width, max_lines=lines, placeholder=" …")


def verdict_lines(verdicts: list) -> list[list[str]]:
    """Per image, its verdicts as caption lines that fit under a 128 px tile ('✓ count  ✗ color'); none for an
    image without a verdict (no judge, or a prompt it cannot read)."""
    out = []
    for verdict in verdicts:
        lines = []
        for a, ok in (verdict or {}).items():
            if a == "correct" or ok is None:
                continue
            mark = f"{'✓' if ok else '✗'} {a}"
            if lines and len(lines[-1]) + 2 + len(mark) <= 19:
                lines[-1] += "  " + mark
            else:
                lines.append(mark)
        out.append(lines)
    return out
