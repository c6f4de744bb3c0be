"""GenEval's summary of per-image verdicts, and the paired change of a policy against its reference.

`summary` computes what GenEval's `evaluation/summary_scores.py` prints: each task's accuracy (the
fraction of its images judged correct), the overall score as the mean of the task accuracies (each
task weighs the same, whatever its number of prompts), the fraction of images correct, and the
fraction of prompts with at least one correct image; and, not GenEval's, the fraction of images that
failed a clause of each kind (a missing object, a count, a colour, a position: rewards/geneval.py).

`paired_change` compares two models scored on the same prompts and seeds: each task's change and the
overall score's, with a 95% interval that resamples prompts within each task (every image of a drawn
prompt with it: a reader re-draws prompts, not only images; evaluation/intervals.py says why) and
recomputes the task means and their mean in each replicate.

`compare_folders` scores folders in GenEval's layout written by any model (`sample --layout geneval`,
GenEval's own generation scripts) with the same rules and detector, so a baseline is scored the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from grpo_vision.rollouts import EVAL_SEED, compare
from grpo_vision.prompts import PromptsError
from grpo_vision.reading import image_size, json_value, read_text, what_is
from grpo_vision.rewards.geneval import FAILURES
from grpo_vision.rewards.geneval_prompts import entry, flat

REPLICATES = 4000
SEED = 0


def summary(rows: Sequence[dict]) -> dict:
    """GenEval's scores of per-image rows `{"prompt", "tag", "correct", "failures"?}` (tasks in order of
    appearance)."""
    if not rows:
        raise ValueError("no verdicts to summarise")
    tasks: dict[str, list[bool]] = {}
    prompts: dict[str, bool] = {}
    failing: dict[str, int] = {}
    for row in rows:
        for kind in set(row.get("failures", ())):
            failing[kind] = failing.get(kind, 0) + 1
        tasks.setdefault(row["tag"], []).append(bool(row["correct"]))
        prompts[row["prompt"]] = prompts.get(row["prompt"], False) or bool(row["correct"])
    by_task = {tag: {"accuracy": sum(v) / len(v), "correct": sum(v), "images": len(v)} for tag, v in tasks.items()}
    return {"overall": sum(t["accuracy"] for t in by_task.values()) / len(by_task), "tasks": by_task,
            "images": len(rows), "images_correct": sum(sum(v) for v in tasks.values()) / len(rows),
            "prompts": len(prompts), "prompts_correct": sum(prompts.values()) / len(prompts),
            "failing": {kind: failing[kind] / len(rows) for kind in FAILURES if kind in failing}}


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


def benchmark(policy, reference, tokenizer, entries: Sequence, reward, n: int, params, seed: int = EVAL_SEED
              ) -> tuple[dict, list[dict]]:
    """GenEval's protocol on a policy and its reference: `n` images of each entry (its metadata in
    GenEval's format) from the same seeds for both (image j of entry i: seed + 1000 i + j, as `eval`),
    GenEval's verdicts from `reward` (the `geneval` reward: its `verdicts(images, prompts, metadata)`),
    each model's summary and the paired change. Returns (that result, one row per image with its
    clauses met and the reasons of the failing ones)."""
    paired = compare(policy, reference, tokenizer, entries, n, params, seed, rewards=None)  # GenEval's verdicts only
    prompts, metadata = paired.prompts, [e.metadata for e in paired.entries]
    rows: dict[str, list[dict]] = {}
    for name in ("policy", "reference"):
        rows[name] = [{"model": name, "prompt": p, "tag": m["tag"], "seed": s, "correct": v.correct,
                       "clauses_met": v.met, "clauses": v.clauses, "reasons": v.reasons, "failures": v.failures}
                      for p, m, s, v in zip(prompts, metadata, paired.seeds,
                                            reward.verdicts(paired.images[name], prompts, metadata))]
    result = {"prompts": len(entries), "images_per_prompt": n, "policy": summary(rows["policy"]),
              "reference": summary(rows["reference"]), "change": paired_change(rows["policy"], rows["reference"])}
    return result, rows["policy"] + rows["reference"]


# ---------------------------------------------------------------- a folder written by any model


class LayoutError(ValueError):
    """A folder that is not in GenEval's layout; the message names the file and the fix."""


def read_folder(folder: str | Path) -> list[tuple[dict, list[Path]]]:
    """GenEval's layout (`sample --layout geneval`, or GenEval's own generation scripts): per prompt, its
    metadata (`<folder>/<i:05d>/metadata.jsonl`, one JSON line, as GenEval's flat line: a nested one, as
    older `sample` versions wrote it, is flattened) and its images (`samples/*.png`, sorted), in the folders'
    order; LayoutError naming the first thing that is not so. Each image's header is read, not its pixels:
    one that declares more pixels than reading.max_pixels() is refused before anything is scored."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LayoutError(f"{folder} is not a folder; give one written by `grpo-vision sample --layout geneval` "
                          "(or GenEval's generation scripts): <i:05d>/metadata.jsonl and <i:05d>/samples/*.png")
    prompts = sorted(p for p in folder.iterdir() if p.is_dir() and p.name.isdigit())
    if not prompts:
        raise LayoutError(f"{folder} holds no prompt folders (00000, 00001, ...); it is not in GenEval's layout")
    out = []
    for p in prompts:
        file, fix = p / "metadata.jsonl", "write GenEval's metadata line of the prompt there"
        missing = what_is(file) == "missing"  # read_text refuses a FIFO unopened: it would wait for ever
        lines = [] if missing else [(n, t) for n, t in enumerate(read_text(file, LayoutError, fix).split("\n"), 1)
                                    if t.strip()]
        if not lines:
            raise LayoutError(f"{file}: not one JSON line of GenEval metadata ({'no such file' if missing else 'empty'}"
                              f"); {fix}")
        number, line = lines[0]
        try:  # the clauses checked now, before any model loads: the file is named, not the folder
            meta = flat(entry(json_value(line, f"{file}, line {number}", LayoutError), str(file)))
        except PromptsError as e:
            raise LayoutError(str(e)) from None
        images = sorted((p / "samples").glob("*.png"))
        if not images:
            raise LayoutError(f"{p / 'samples'} holds no PNG images")
        for image in images:
            image_size(image, LayoutError)
        out.append((meta, images))
    return out


def check_pairs(folder: str | Path, against: str | Path) -> None:
    """LayoutError unless `against` holds the same prompts as `folder`, in the same order, with as many images
    each: known from the folders' metadata and file names, so said before any model loads or any image is scored."""
    ours, theirs = ([m["prompt"] for m, paths in read_folder(f) for _ in paths] for f in (folder, against))
    mismatch = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if len(ours) != len(theirs) or mismatch is not None:
        i = mismatch if mismatch is not None else min(len(ours), len(theirs))
        raise LayoutError(f"{folder} and {against} differ at image {i + 1} (its prompt or the number of images "
                          "per prompt): --against takes a folder of the same prompts, in the same order, with "
                          "as many images each (write both with the same --prompts and --n)")


def _load(paths: Sequence[Path]) -> list[torch.Tensor]:
    """Each PNG as `[3, H, W]` in [0, 1] (RGB, whatever its mode)."""
    from PIL import Image, UnidentifiedImageError

    out = []
    for path in paths:
        image_size(path, LayoutError)  # again: a file replaced since read_folder is not decoded blind
        try:
            with Image.open(path) as img:
                pixels = torch.frombuffer(bytearray(img.convert("RGB").tobytes()), dtype=torch.uint8)
                out.append(pixels.view(img.height, img.width, 3).permute(2, 0, 1).float() / 255)
        except (OSError, UnidentifiedImageError) as e:
            raise LayoutError(f"{path}: not a readable image ({e})") from None
    return out


def score_folder(reward, folder: str | Path, name: str = "folder") -> list[dict]:
    """GenEval's verdict on every image of a folder in its layout, from `reward` (the `geneval` reward:
    its `verdicts`), one row per image as `benchmark` writes them (with the image's file, no seed)."""
    rows = []
    for meta, paths in read_folder(folder):
        clauses = {k: v for k, v in meta.items() if k != "prompt"}
        images = _load(paths)
        same = len({tuple(i.shape) for i in images}) == 1  # one call per prompt, or per image where sizes differ
        verdicts = (reward.verdicts(torch.stack(images), [meta["prompt"]] * len(images), [clauses] * len(images))
                    if same else [reward.verdicts(i[None], [meta["prompt"]], [clauses])[0] for i in images])
        rows += [{"model": name, "prompt": meta["prompt"], "tag": meta.get("tag"), "file": str(path),
                  "correct": v.correct, "clauses_met": v.met, "clauses": v.clauses, "reasons": v.reasons,
                  "failures": v.failures} for path, v in zip(paths, verdicts)]
    return rows


def compare_folders(reward, folder: str | Path, against: str | Path | None = None) -> tuple[dict, list[dict]]:
    """GenEval's summary of `folder`, and with `against` (another model's folder of the same prompts and
    image counts: a baseline scored the same way) its summary and the change, its interval resampling
    prompts within each task. Image j of a prompt is compared with image j of the same prompt; where the
    two models drew their images from other seeds the pairing is by prompt only, which the interval,
    over prompts, already assumes."""
    if against is not None:
        check_pairs(folder, against)
    rows = score_folder(reward, folder, "folder")
    result = {"benchmark": "geneval", "folder": str(folder), "prompts": len({r["prompt"] for r in rows}),
              "images": len(rows), "summary": summary(rows)}
    if against is None:
        return result, rows
    other = score_folder(reward, against, "against")
    result |= {"against": str(against), "against_summary": summary(other), "change": paired_change(rows, other)}
    return result, rows + other
