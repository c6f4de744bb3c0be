"""ShapesWorld's rewards from the exact checker (docs/shapes_world.md): its verdict as 1 / 0
(`shapes_exact`), the share of the caption's attributes it finds right (`shapes_partial`), and, for runs with a
text stage, how well the image follows its own layout plan (`shapes_plan_layout`, GoT-R1's R_RI)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from grpo_vision.images import to_uint8
from grpo_vision.rewards import RewardContext, RewardFn, register_reward
from grpo_vision.shapes.checker import ATTRIBUTES, CheckResult, Region, check, find_regions
from grpo_vision.shapes.plan import PlanObject, cell_centre, parse_plan
from grpo_vision.shapes.scene import SIZES, CaptionError, as_policy_reads


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


Box = tuple[float, float, float, float]  # (x0, y0, w, h), px


def planned_box(obj: PlanObject) -> Box:
    """The box a plan asks for: a square of its size's middle side (SIZES: small 14, large 27 px) centred on its
    cell's centre. The cell holds the box centre to within half a cell (2 px), so a drawing that matches the plan
    exactly scores an IoU of about 0.6-1, not 1."""
    side = sum(SIZES[obj.size]) / 2
    cx, cy = cell_centre(obj.cell)
    return cx - side / 2, cy - side / 2, side, side


def iou(a: Box, b: Box) -> float:
    """Intersection over union of two continuous (x0, y0, w, h) boxes; 0 when they do not overlap. Not
    rewards.geneval.iou, whose (x0, y0, x1, y1) bounds are inclusive pixels as GenEval's scorer reads them: a
    planned box has fractional corners (a large object's 13.5 px half side)."""
    w = min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0])
    h = min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1])
    inter = max(0.0, w) * max(0.0, h)
    return inter / (a[2] * a[3] + b[2] * b[3] - inter)


def layout_agreement(plan_text: str, regions: list[Region]) -> float:
    """How well the objects found in an image (`regions`) follow a layout plan, in [0, 1]: each planned object is
    grounded to a region of its colour and shape (what a grounding model finds for "red circle"; each region
    grounds one object at most, the assignment with the largest total IoU), and the sum of the planned boxes' IoU
    with their regions is divided by max(planned objects, regions), so a missing object and an extra region both
    cost their share. 0 for a plan outside the plan grammar. GoT-R1's R_RI (arXiv 2505.17022: the IoU between
    the reasoning chain's boxes and the boxes grounded in the image), with the checker's regions as the grounding."""
    plan = parse_plan(plan_text)
    if plan is None:
        return 0.0
    gains = [[iou(planned_box(o), r.box) if (r.color, r.shape) == (o.color, o.shape) else 0.0 for r in regions]
             for o in plan.objects]  # [objects][regions]
    slots = [*range(len(regions)), *[None] * len(plan.objects)]  # None: the object grounds to nothing
    best = max(sum(0.0 if j is None else g[j] for g, j in zip(gains, pick))
               for pick in itertools.permutations(slots, len(plan.objects)))
    return best / max(len(plan.objects), len(regions))


@register_reward("shapes_plan_layout", reads_plan=True)
def shapes_plan_layout(ctx: RewardContext) -> RewardFn:
    """How well each image follows the layout plan it was drawn from (layout_agreement), in [0, 1]; NaN for an
    image without a plan (a run without `sample.plan`: the reward does not apply). GoT-R1 multiplies this term
    into its reward and reports that alone it collapses the layout (its ablation: 2D-spatial 0.0076): weigh it
    beside a reward that reads the prompt (docs/experiments/text_plans.md)."""
    def reward(images, prompts, metadata):
        arr = to_uint8(images)
        return torch.tensor([math.nan if m.get("plan") is None else
                             layout_agreement(m["plan"], find_regions(np.ascontiguousarray(a)))
                             for a, m in zip(arr, metadata)])
    return reward
