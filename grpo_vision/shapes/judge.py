"""ShapesWorld's judge: the exact checker as the core's `Judge` (docs/shapes_world.md, "The checker")."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from grpo_vision.shapes.checker import ATTRIBUTES, check
from grpo_vision.shapes.layout import scene_for_caption
from grpo_vision.shapes.plan import check_plan
from grpo_vision.shapes.scene import FORMS, CaptionError, as_policy_reads, parse_caption, render


class ShapesJudge:
    """Per-attribute verdicts of the checker; a prompt is read as the policy reads it (lower case,
    single spaces), so "A red  circle" is judged as the caption it was drawn for."""

    name = "Exact checker (ShapesWorld)"
    attributes = ATTRIBUTES
    forms = FORMS

    def verdicts(self, images: torch.Tensor, prompts: Sequence[str]) -> list[dict | None]:
        out = []
        for image, prompt in zip(images, prompts):
            try:
                out.append(check(image, as_policy_reads(prompt)).as_dict())
            except CaptionError:
                out.append(None)
        return out

    def plan_verdicts(self, plans: Sequence[str], prompts: Sequence[str]) -> list[dict | None]:
        """Per-attribute verdicts of each text plan (shapes/plan.py) against its prompt, with the image verdicts' keys;
        None where the prompt is outside the grammar."""
        out = []
        for plan, prompt in zip(plans, prompts, strict=True):
            try:
                out.append(check_plan(plan, as_policy_reads(prompt)))
            except CaptionError:
                out.append(None)
        return out

    def form(self, prompt: str) -> str | None:
        try:
            return parse_caption(as_policy_reads(prompt)).form
        except CaptionError:
            return None

    def render(self, prompt: str, seed: int):
        """The world's own drawing of `prompt`: a scene that satisfies it, uint8 [64, 64, 3]; None when
        the judge cannot read it."""
        try:
            return render(scene_for_caption(as_policy_reads(prompt), np.random.default_rng(seed)))
        except CaptionError:
            return None

    def problem(self, prompt: str) -> str | None:
        try:
            parse_caption(as_policy_reads(prompt))
        except CaptionError as e:
            return str(e)
        return None
