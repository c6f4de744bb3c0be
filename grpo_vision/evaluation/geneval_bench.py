"""GenEval's summary of per-image verdicts, and the paired change of a policy against its reference.

`summary` computes what GenEval's `evaluation/summary_scores.py` prints: each task's accuracy (the
fraction of its images judged correct), the overall score as the mean of the task accuracies (each
task weighs the same, whatever its number of prompts), the fraction of images correct, and the
fraction of prompts with at least one correct image.

`paired_change` compares two models scored on the same prompts and seeds: each task's change and the
overall score's, with a 95% interval that resamples prompts within each task (every image of a drawn
prompt with it: a reader re-draws prompts, not only images; evaluation/intervals.py says why) and
recomputes the task means and their mean in each replicate.
"""

from __future__ import annotations

from typing import Sequence

import torch

REPLICATES = 4000
SEED = 0


def summary(rows: Sequence[dict]) -> dict:
    """GenEval's scores of per-image rows `{"prompt", "tag", "correct"}` (tasks in order of appearance)."""
    if not rows:
        raise ValueError("no verdicts to summarise")
    tasks: dict[str, list[bool]] = {}
    prompts: dict[str, bool] = {}
    for row in rows:
        tasks.setdefault(row["tag"], []).append(bool(row["correct"]))
        prompts[row["prompt"]] = prompts.get(row["prompt"], False) or bool(row["correct"])
    by_task = {tag: {"accuracy": sum(v) / len(v), "correct": sum(v), "images": len(v)} for tag, v in tasks.items()}
    return {"overall": sum(t["accuracy"] for t in by_task.values()) / len(by_task), "tasks": by_task,
            "images": len(rows), "images_correct": sum(sum(v) for v in tasks.values()) / len(rows),
            "prompts": len(prompts), "prompts_correct": sum(prompts.values()) / len(prompts)}


def paired_change(policy: Sequence[dict], reference: Sequence[dict], replicates: int = REPLICATES,
                  seed: int = SEED) -> dict:
    """Policy minus reference on the same images (row i of each: the same prompt and seed): the overall
    score's change and each task's, each {"change", "ci95"}, resampling prompts within each task."""
    if len(policy) != len(reference) or any(p["prompt"] != r["prompt"] for p, r in zip(policy, reference)):
        raise ValueError("policy and reference must be scored on the same prompts, in the same order")
    diff = torch.tensor([float(p["correct"]) - float(r["correct"]) for p, r in zip(policy, reference)],
                        dtype=torch.float64)  # [images]
    g = torch.Generator().manual_seed(seed)
    tags = list(dict.fromkeys(row["tag"] for row in policy))
    per_task, draws = {}, []
    for tag in tags:
        rows = [i for i, row in enumerate(policy) if row["tag"] == tag]
        names = list(dict.fromkeys(policy[i]["prompt"] for i in rows))
        index = {name: k for k, name in enumerate(names)}
        which = torch.tensor([index[policy[i]["prompt"]] for i in rows])  # [images] each image's prompt
        sums = torch.zeros(len(names), dtype=torch.float64).index_add_(0, which, diff[rows])  # [P] per prompt
        counts = torch.bincount(which, minlength=len(names)).double()  # [P] images per prompt
        picks = torch.randint(len(names), (replicates, len(names)), generator=g)  # [R, P] prompts drawn
        task_draws = sums[picks].sum(1) / counts[picks].sum(1)  # [R] the task's change in each replicate
        draws.append(task_draws)
        per_task[tag] = {"change": float(sums.sum() / counts.sum()), "ci95": _ends(task_draws), "prompts": len(names)}
    overall = torch.stack(draws).mean(0)  # [R] the mean over tasks, replicate by replicate
    return {"overall": {"change": sum(t["change"] for t in per_task.values()) / len(per_task), "ci95": _ends(overall)},
            "tasks": per_task}


def _ends(draws: torch.Tensor) -> list[float]:
    lo, hi = torch.quantile(draws, torch.tensor([0.025, 0.975], dtype=draws.dtype)).tolist()
    return [round(lo, 5), round(hi, 5)]


def benchmark(policy, reference, tokenizer, entries: Sequence, reward, n: int, params, seed: int = 0
              ) -> tuple[dict, list[dict]]:
    """GenEval's protocol on a policy and its reference: `n` images of each entry (its metadata in
    GenEval's format) from the same seeds for both (image j of entry i: seed + 1000 i + j, as `eval`),
    GenEval's verdicts from `reward` (the `geneval` reward: its `verdicts(images, prompts, metadata)`),
    each model's summary and the paired change. Returns (that result, one row per image with its
    clauses met and the reasons of the failing ones)."""
    from contextlib import nullcontext

    from grpo_vision.evaluation.evaluate import eval_seeds, generate

    prompts = [e.prompt for e in entries for _ in range(n)]
    metadata = [e.metadata for e in entries for _ in range(n)]
    seeds = eval_seeds(len(entries), n, seed)
    ref_model, ref_ctx = reference.sampler(policy)
    rows: dict[str, list[dict]] = {}
    for name, model, ctx in (("policy", policy, nullcontext()), ("reference", ref_model, ref_ctx)):
        with ctx:
            images = generate(model, tokenizer, prompts, seeds, params)
        rows[name] = [{"model": name, "prompt": p, "tag": m["tag"], "seed": s, "correct": v.correct,
                       "clauses_met": v.met, "clauses": v.clauses, "reasons": v.reasons}
                      for p, m, s, v in zip(prompts, metadata, seeds, reward.verdicts(images, prompts, metadata))]
    result = {"prompts": len(entries), "images_per_prompt": n, "policy": summary(rows["policy"]),
              "reference": summary(rows["reference"]), "change": paired_change(rows["policy"], rows["reference"])}
    return result, rows["policy"] + rows["reference"]
