"""A paired draw's numbers (rollouts.compare -> a dict): each reward's mean and 95% interval for policy and
reference, the judge's tables, the paired changes with intervals over captions, and what a reward that gives
reasons held against each side. `evaluate_loaded` (evaluation/evaluate.py) keeps one per set and temperature."""

from __future__ import annotations

import torch

from grpo_vision.evaluation.intervals import caption_interval
from grpo_vision.evaluation.judge import judge_tables, paired_differences
from grpo_vision.policy import Judge
from grpo_vision.rollouts import Paired
from grpo_vision.run.metrics import interval


def summarize(paired: Paired, judge: Judge | None = None) -> dict:
    """`evaluate`'s result of a paired draw (rollouts.compare)."""
    prompts, entries = paired.prompts, paired.entries[::paired.n]
    strata = [judge.form(p) for p in prompts] if judge is not None else None  # the sets are balanced by form
    result = {"prompts": len(entries), "captions": len({e.prompt for e in entries}), "images_per_prompt": paired.n,
              "models": {}}
    sides = {"policy": paired.policy, "reference": paired.reference}
    for name, scored in sides.items():
        table, by_form = judge_tables(judge, paired.images[name], prompts, scored.verdicts if judge else None)
        result["models"][name] = {"rewards": {k: reward_interval(v, paired.n) for k, v in scored.raw.items()},
                                  "judge": table,
                                  "judge_by_form": by_form}
    result["difference"] = {k: _diff(result, "rewards", k) for k in result["models"]["policy"]["rewards"]}
    # paired per image (the same prompt and seed on both sides); the interval resamples captions, all
    # their images with them: another draw of captions is what a reader would re-draw (evaluation/intervals.py)
    diffs = {k: paired.policy.raw[k].double() - paired.reference.raw[k].double() for k in paired.policy.raw}
    result["difference_ci"] = {k: caption_interval(d, prompts, strata) for k, d in diffs.items()}
    result["difference_ci_per_image"] = {k: interval(d) for k, d in diffs.items()}  # these captions held fixed
    if paired.policy.reasons:
        result["reasons"] = {k: failure_summary(paired.policy.reasons[k], paired.reference.reasons[k], prompts, strata)
                             for k in paired.policy.reasons}
    if result["models"]["policy"]["judge"]:
        keys = list(result["models"]["policy"]["judge"])
        result["judge_difference"] = {k: _diff(result, "judge", k) for k in keys}
        diffs = paired_differences(paired.policy.verdicts, paired.reference.verdicts, keys)
        result["judge_difference_ci"] = {k: caption_interval(d, prompts, strata) for k, d in diffs.items()}
        result["judge_difference_ci_per_image"] = {k: interval(d) for k, d in diffs.items()}
    if paired.policy.plan_verdicts and paired.reference.plan_verdicts:  # the plans against their prompts
        for name, scored in sides.items():
            result["models"][name]["plan_judge"] = judge_tables(judge, None, prompts, scored.plan_verdicts)[0]
        keys = list(result["models"]["policy"]["plan_judge"] or [])
        diffs = paired_differences(paired.policy.plan_verdicts, paired.reference.plan_verdicts, keys)
        result["plan_judge_difference_ci"] = {k: caption_interval(d, prompts, strata) for k, d in diffs.items()}
    return result


def reward_interval(values: torch.Tensor, n: int) -> dict:
    """A reward's mean and interval over the images it applies to (NaN excluded, e.g. `ocr` on a prompt that quotes
    no text); a reward that skips some prompts also says on how many it scored ("prompts": entries, n images each)."""
    out = interval(values)
    applies = ~values.isnan().view(-1, n)  # [E, n]
    if not bool(applies.all()):
        out["prompts"] = int(applies.any(1).sum())
    return out


def failure_summary(policy: list[list[tuple[str, str]]], reference: list[list[tuple[str, str]]],
                    prompts: list[str], strata: list | None = None, common: int = 3) -> dict:
    """What a reward that gives reasons (rewards/base.py) held against each model's images, on the same
    prompts and seeds: per kind of failure, the fraction of images with one (each model's, and the paired
    change with its interval over captions), and each model's most frequent reason texts."""
    kinds = list(dict.fromkeys(kind for side in (reference, policy) for image in side for kind, _ in image))
    rate = lambda side, kind: torch.tensor([float(any(k == kind for k, _ in image)) for image in side],  # noqa: E731
                                           dtype=torch.float64)  # [B] 1 where the image failed that way
    out = {"kinds": kinds, "images": len(prompts)}
    for name, side in (("policy", policy), ("reference", reference)):
        texts: dict[str, int] = {}
        for image in side:
            for text in dict.fromkeys(text for _, text in image):  # an image counts once per text
                texts[text] = texts.get(text, 0) + 1
        out[name] = {"failing": {k: round(float(rate(side, k).mean()), 5) for k in kinds},
                     "common": sorted(texts.items(), key=lambda kv: (-kv[1], kv[0]))[:common]}
    out["change"] = {k: caption_interval(rate(policy, k) - rate(reference, k), prompts, strata) for k in kinds}
    return out


def _diff(result: dict, table: str, key: str):
    p, r = (result["models"][m][table][key]["mean"] for m in ("policy", "reference"))
    return None if p is None or r is None else round(p - r, 5)
