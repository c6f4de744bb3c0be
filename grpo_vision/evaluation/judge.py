"""A judge's tables: exact per-attribute verdicts on images (the `Judge` protocol, policy.py), for the
report and the demo.

A reward gives one number per image; a judge says which parts of the prompt an image gets right
(count, colour, shape, ...), where a program can tell exactly. ShapesWorld's checker is one; a
GenEval-style detector would be another. A policy kind brings its judge in its `Bundle`; without
one, the report and the demo show rewards only.

A verdict is `{"correct": bool, attribute: bool | None, ...}` (None: the attribute does not apply
to this prompt), or None for a prompt the judge cannot read.
"""

from __future__ import annotations

from typing import Sequence

import torch

from grpo_vision.policy import Judge, Verdict
from grpo_vision.rollouts import verdict_rates
from grpo_vision.run.metrics import interval


def judge_tables(judge: Judge | None, images: torch.Tensor, prompts: list[str],
                 results: list[Verdict | None] | None = None) -> tuple[dict | None, dict | None]:
    """The judge's accuracy per attribute (mean and 95% interval), and its all-attributes-right rate
    per prompt form, from one verdict per image (`results`, when already judged); (None, None)
    without a judge or when it cannot read one of the prompts (a mixed set would compare different
    things)."""
    if judge is None:
        return None, None
    results = judge.verdicts(images, prompts) if results is None else results
    if any(r is None for r in results):
        return None, None
    rates = verdict_rates(results, ["correct", *judge.attributes])  # [n] 1 / 0, NaN where it does not apply
    table = {k: interval(v) for k, v in rates.items()}  # interval leaves the NaN out
    forms = [judge.form(p) for p in prompts]
    by_form = {f: interval(rates["correct"][torch.tensor([g == f for g in forms])]) for f in judge.forms if f in forms}
    return table, by_form


def paired_differences(policy: list[Verdict | None], reference: list[Verdict | None],
                       keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Per attribute: policy minus reference per image (the same prompt and seed), as 0/1 differences;
    NaN where either has no verdict or the attribute does not apply to the prompt."""
    p, r = verdict_rates(policy, keys), verdict_rates(reference, keys)
    return {key: p[key].double() - r[key].double() for key in keys}
