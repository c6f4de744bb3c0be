"""The words of report.md, from eval.json's numbers: one unit per quantity, and "What changed".

Rewards are shown in their own units with 3 decimals; the judge's accuracies in percent, their
changes in points. Every change is paired per image (the same prompt and seed for policy and
reference) with a 95% interval that resamples the captions (evaluation/intervals.py), and called a rise or a
fall only when that interval excludes 0.

Possible reward hacking is named the way the reward-hacking literature reads a reward-swap table
(a trained reward up, an independent measure down: Gao et al. 2022, "Scaling laws for reward model
overoptimization"; docs/experiments/reward_matrix.md): a trained reward rises while the exact judge
or a monitored reward falls.
"""

from __future__ import annotations

import math
from statistics import fmean, variance

from grpo_vision.run.trackers import table_cell


def _sign(change: dict | None, rate: bool = False) -> int:
    """+1 / -1 when the change's 95% interval excludes 0 at the precision the report prints it (a rate's
    to 0.1 points, a reward's to 0.001), else 0: an interval of no width (identical paired differences, or a
    single one) says nothing about noise, and a change that prints as 0.000 [-0.000, -0.000] (two steps
    that barely moved the weights) is not a rise or a fall whatever its sign."""
    if not _has_interval(change):
        return 0
    scale, digits = (100, 1) if rate else (1, 3)
    lo, hi = (round(scale * v, digits) for v in change["ci95"])
    if not hi > lo:
        return 0
    return 1 if lo > 0 else -1 if hi < 0 else 0


def _has_interval(change: dict | None) -> bool:
    """A change with a mean and a finite 95% interval (none over fewer than two captions or images)."""
    return bool(change) and change.get("mean") is not None and bool(change.get("ci95")) and all(
        math.isfinite(v) for v in change["ci95"])


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _no_interval(entry: dict) -> str:
    """Why `entry` has no interval: it rests on one caption (a change resamples captions) or one image."""
    if "captions" in entry:
        return f"no interval: {_count(entry['captions'], 'caption')}"
    return f"no interval: {_count(entry.get('n') or 0, 'image')}"


def _fmt(entry: dict | None, scale: float, signed: bool, unit: str, rate: bool = False) -> str:
    """'mean [lo, hi]' scaled, with the sign shown for changes; a rate's interval kept in [0, 100]; 'mean (no
    interval: 1 caption)' where there is nothing to resample."""
    if not entry or entry.get("mean") is None:
        return "n/a"
    digits, sign = 1 if scale == 100 else 3, "+" if signed else ""  # points to 0.1, rewards to 0.001
    f = lambda v: f"{scale * v:{sign}.{digits}f}"  # noqa: E731
    if not _has_interval(entry):
        return f"{f(entry['mean'])}{unit} ({_no_interval(entry)})"
    lo, hi = entry["ci95"]
    if rate:  # a rate's normal-approximation interval can leave [0, 1]
        lo, hi = max(lo, 0.0), min(hi, 1.0)
    return f"{f(entry['mean'])}{unit} [{f(lo)}, {f(hi)}]"


def reward_value(entry: dict) -> str:
    return _fmt(entry, 1, signed=False, unit="")


def reward_change(change: dict | None) -> str:
    return _fmt(change, 1, signed=True, unit="")


def rate_value(entry: dict) -> str:
    return _fmt(entry, 100, signed=False, unit="%", rate=True)


def rate_change(change: dict | None) -> str:
    return _fmt(change, 100, signed=True, unit=" pts")


def duplicate_of_judge(result: dict) -> str | None:
    """The reward that is the judge's all-right rate itself (ShapesWorld's shapes_exact): the same mean
    and interval on both sides. Its row would repeat the judge's."""
    models = result["models"]
    if not models["policy"]["judge"]:
        return None
    for name in models["policy"]["rewards"]:
        if all(models[m]["rewards"][name] == models[m]["judge"]["correct"] for m in ("policy", "reference")):
            return name
    return None


def interval_heading(result: dict) -> str:
    """What a change column's interval resamples, with the number of captions it rests on."""
    return f"change (paired; 95% interval over {_count(result.get('captions', result['prompts']), 'caption')})"


def change_table(result: dict) -> list[str]:
    """One row per reward, then the judge's all-right rate: reference, policy, paired change."""
    lines = [f"| measured by | reference | policy | {interval_heading(result)} |", "|---|---|---|---|"]
    twin = duplicate_of_judge(result)
    for name in result["models"]["policy"]["rewards"]:
        if name == twin:
            continue
        ref, pol = (result["models"][m]["rewards"][name] for m in ("reference", "policy"))
        label = f"{name} ({pol['prompts']} of {result['prompts']} prompts)" if "prompts" in pol else name
        lines.append(f"| {label} | {reward_value(ref)} | {reward_value(pol)} | "
                     f"{reward_change(result.get('difference_ci', {}).get(name))} |")
    if result["models"]["policy"]["judge"]:
        ref, pol = (result["models"][m]["judge"]["correct"] for m in ("reference", "policy"))
        label = "judge: all attributes right" + (f" (= reward `{twin}`)" if twin else "")
        lines.append(f"| {label} | {rate_value(ref)} | {rate_value(pol)} | "
                     f"{rate_change(result.get('judge_difference_ci', {}).get('correct'))} |")
    return lines


def _names(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def rollout_trend(metrics: list[dict], name: str) -> dict | None:
    """Reward `name` on the training rollouts (`reward/<name>/mean` of metrics.jsonl): its mean over the
    first and the last quarter of the steps, and the change with a 95% interval that takes each step's
    mean as one draw (Welch, normal approximation); None with fewer than 8 steps logged."""
    values = [m[f"reward/{name}/mean"] for m in metrics if m.get(f"reward/{name}/mean") is not None]
    if len(values) < 8:
        return None
    q = len(values) // 4
    first, last = values[:q], values[-q:]
    half = 1.96 * (variance(first) / q + variance(last) / q) ** 0.5
    change = fmean(last) - fmean(first)
    return {"first": fmean(first), "last": fmean(last), "steps": q,
            "change": {"mean": change, "ci95": [change - half, change + half]}}


def _rollouts_sentence(trend: dict | None, trained_up: list[str]) -> list[str]:
    """The judge on the training rollouts: flat while a trained reward rose says RL taught the reward."""
    if not trend:
        return []
    rates = (f"{100 * trend['first']:.1f}% over the first {trend['steps']} steps' rollouts and "
             f"{100 * trend['last']:.1f}% over the last {trend['steps']} ({rate_change(trend['change'])})")
    if trained_up and not _sign(trend["change"], rate=True):
        return [f"**On its own training rollouts the judge did not move** ({rates}) while {_names(trained_up)} "
                "rose: what RL taught here is mostly the trained rewards, not the task the judge checks."]
    return [f"On the training rollouts the judge's rate was {rates}."]


def failure_sentences(result: dict) -> list[str]:
    """For each reward that gives reasons (the `geneval` reward's failing clauses): the share of images
    failing each way, reference -> policy with the paired change, and the policy's most frequent reason."""
    said = []
    for name, summary in result.get("reasons", {}).items():
        if not summary["kinds"]:
            said.append(f"No image failed a clause of {name}'s, on either side.")
            continue
        ref, pol, change = summary["reference"]["failing"], summary["policy"]["failing"], summary["change"]
        parts = [f"{kind} {100 * ref[kind]:.1f}% -> {100 * pol[kind]:.1f}% ({rate_change(change[kind])})"
                 for kind in summary["kinds"]]
        said.append(f"Images failing a clause of {name}'s, by what failed (reference -> policy): {'; '.join(parts)}.")
        moved = [(kind, "fewer" if _sign(change[kind], rate=True) < 0 else "more") for kind in summary["kinds"]
                 if _sign(change[kind], rate=True)]
        if moved:
            said.append(f"Beyond their intervals: {_names([f'{how} {kind} failures' for kind, how in moved])}.")
        if summary["policy"]["common"]:
            text, count = summary["policy"]["common"][0]
            said.append(f"The policy's most frequent: \"{text}\" ({count} of {summary['images']} images).")
    return said


def what_changed(result: dict, trained: list[str], monitored: list[str], kl: list[float],
                 rollouts: dict | None = None) -> list[str]:
    """The paragraph at the top of the report: what rose and fell beyond its interval, a plain line
    when that looks like reward hacking, why a reward that gives reasons failed images (GenEval's
    clauses), the judge on the training rollouts (`rollouts`, a `rollout_trend`), and the KL it cost."""
    changes = result.get("difference_ci", {})
    judged = result.get("judge_difference_ci", {})
    up = lambda names: [n for n in names if _sign(changes.get(n)) > 0]  # noqa: E731
    down = lambda names: [n for n in names if _sign(changes.get(n)) < 0]  # noqa: E731
    said = []
    for verb, names in (("rose", up(trained)), ("fell", down(trained))):
        if names:
            said.append(f"The trained reward{'s' if len(names) > 1 else ''} {_names(names)} {verb} "
                        f"({'; '.join(f'{n} {reward_change(changes[n])}' for n in names)}).")
    unknown = [n for n in trained if changes.get(n) and changes[n].get("mean") is not None
               and not _has_interval(changes[n])]
    if unknown:  # one caption: a change, but nothing to tell it from the noise of drawing other captions
        by = (reward_change(changes[unknown[0]]) if len(unknown) == 1 else
              "; ".join(f"{n} {reward_change(changes[n])}" for n in unknown))
        said.append(f"The trained reward{'s' if len(unknown) > 1 else ''} {_names(unknown)} changed by {by}, which "
                    f"{_count(changes[unknown[0]].get('captions', 0), 'caption')} cannot tell from noise: evaluate "
                    "on more prompts (two or more; a few per prompt form) to call it a rise or a fall.")
    flat = [n for n in trained if n not in up(trained) + down(trained) + unknown]
    if flat:
        said.append(f"The trained reward{'s' if len(flat) > 1 else ''} {_names(flat)} did not move beyond "
                    f"{'its interval' if len(flat) == 1 else 'their intervals'}.")
    twin = duplicate_of_judge(result)
    watched = [n for n in monitored if n != twin]
    watched_down = down(watched)
    moved = [f"{n} {'rose' if _sign(changes[n]) > 0 else 'fell'} ({reward_change(changes[n])})"
             for n in watched if _sign(changes.get(n))]
    if moved:
        said.append(f"Monitored, not trained on: {'; '.join(moved)}.")
    if judged:
        ref = result["models"]["reference"]["judge"]["correct"]["mean"]
        pol = result["models"]["policy"]["judge"]["correct"]["mean"]
        said.append(f"The exact judge's all-attributes-right rate went from {100 * ref:.1f}% to {100 * pol:.1f}% "
                    f"({rate_change(judged.get('correct'))}, "
                    f"{_count(result.get('captions', result['prompts']), 'caption')}).")
        attrs = [a for a in judged if a != "correct"]
        for verb, sign in (("Rose", 1), ("Fell", -1)):
            moved = [a for a in attrs if _sign(judged[a], rate=True) == sign]
            if moved:
                said.append(f"{verb} beyond their intervals: "
                            f"{'; '.join(f'{a} {rate_change(judged[a])}' for a in moved)}.")
        big = [a for a in attrs if not _sign(judged[a], rate=True) and judged[a].get("mean") is not None
               and abs(judged[a]["mean"]) >= 0.05]  # 5 points or more, not beyond an interval
        unclear = [a for a in big if _has_interval(judged[a]) and judged[a]["ci95"][1] > judged[a]["ci95"][0]]
        if unclear:
            said.append(f"Moved 5 points or more but within their intervals (more images would tell): "
                        f"{'; '.join(f'{a} {rate_change(judged[a])}' for a in unclear)}.")
        thin = [a for a in big if a not in unclear]  # no interval, or one of no width: nothing to tell noise by
        if thin:
            said.append(f"Moved 5 points or more on too few captions to tell from noise (more prompts that name "
                        f"them would tell): {'; '.join(f'{a} {rate_change(judged[a])}' for a in thin)}.")
    judge_down = [a for a in judged if a != "correct" and _sign(judged[a], rate=True) < 0]
    all_right_down = _sign(judged.get("correct"), rate=True) < 0
    if up(trained) and (judge_down or all_right_down or watched_down):
        fell = (["the judge's all-attributes-right rate"] if all_right_down else []) + \
               ([f"the judge's {_names(judge_down)} accuracy"] if judge_down else []) + watched_down
        said.append(f"**Possible reward hacking:** {_names(up(trained))} rose while {_names(fell)} fell: the "
                    "policy may be learning what the reward model scores rather than what the prompts ask. "
                    "Look at the samples below before trusting the trained reward's gain.")
    rising = [n for n in unknown if changes[n]["mean"] > 0]
    judged_all = judged.get("correct") or {}
    if rising and (judged_all.get("mean") or 0) < 0 and not _has_interval(judged_all):
        said.append(f"Up on {_names(rising)} and down on the judge's rate is the pattern of reward hacking; the "
                    "report names it only when intervals over prompts show both changes, and here neither has one.")
    said += failure_sentences(result)
    said += _rollouts_sentence(rollouts, up(trained))
    if kl:
        said.append(f"It cost a KL to the reference of {kl[-1]:.3f} per token at the last step "
                    f"(max {max(kl):.3f}).")
    return ["## What changed", "", " ".join(said), ""]


def plan_section(result: dict, examples: list[dict] | None = None) -> list[str]:
    """The text plans (sample.plan, T2I-R1's first stage): each model's plans judged against their prompts per
    attribute where the judge checks plans (eval.json's `plan_judge`), with the paired change and its interval as
    the judge's section has them; then `examples` ({prompt, reference, policy}: one image's plan on each side, the
    same seed), as drawn for the report. Empty when the models wrote no plans."""
    ref, pol = (result["models"][m].get("plan_judge") for m in ("reference", "policy"))
    lines = []
    if ref and pol:
        changes = result.get("plan_judge_difference_ci", {})
        lines += ["", "## The plans against their prompts", "",
                  "Each image's text plan, written before the image and judged against its prompt as the images "
                  "are (test prompts, the same seeds):", "",
                  f"| attribute | reference | policy | {interval_heading(result)} |", "|---|---|---|---|"]
        for name in pol:
            if not (pol[name].get("n") or ref[name].get("n")):  # an attribute that no plan's prompt names
                continue
            label = "all attributes right" if name == "correct" else name
            lines.append(f"| {label} | {rate_value(ref[name])} | {rate_value(pol[name])} | "
                         f"{rate_change(changes.get(name))} |")
    if examples:
        lines += ([] if lines else ["", "## The plans"]) + [
            "", "Plans of the first image of the first test prompts (the same seed on both sides):", "",
            "| prompt | reference's plan | policy's plan |", "|---|---|---|",
            *(f"| {table_cell(e['prompt'])} | {table_cell(e['reference'])} | {table_cell(e['policy'])} |"
              for e in examples)]
    return lines
