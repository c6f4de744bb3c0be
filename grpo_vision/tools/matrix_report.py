"""What `grpo-vision matrix` writes: matrix.json, matrix.md, matrix.png (the heatmap) and strips/."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

SET_TITLES = {"test": "Test prompts (the headline: the training distribution, never trained on)",
              "heldout": "Held-out compositions (transfer: no model trained on them)",
              "train_sample": "Training prompts (a sample of what the runs trained on)"}


def columns(summary: dict) -> list[str]:
    """Measures in table order: rewards, the judge's all-right rate, diversity, entropy, KL."""
    keys = list(summary)
    return ([k for k in keys if "/" not in k and k not in ("diversity", "entropy", "kl")] +
            [k for k in ("judge/correct",) if k in keys] + ["diversity", "entropy", "kl"])


def _is_rate(name: str) -> bool:
    return name.startswith("judge/")


def _cell(entry: dict | None, rate: bool) -> str:
    if not entry or entry.get("mean") is None:
        return "n/a"
    scale, unit = (100, " pts") if rate else (1, "")
    mean = entry["mean"] * scale
    if not entry.get("ci95"):
        return f"{mean:+.3f}{unit}" if not rate else f"{mean:+.1f}{unit}"
    lo, hi = (v * scale for v in entry["ci95"])
    digits = 1 if rate else 3
    return f"{mean:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]{unit}"


def _absolute(entry: dict, rate: bool) -> str:
    if entry.get("mean") is None:
        return "n/a"
    return f"{100 * entry['mean']:.1f}%" if rate else f"{entry['mean']:.4f}"


def set_table(set_name: str, reference: dict, runs: list[dict], pooled: list[dict] = (),
              captions: int | None = None) -> list[str]:
    """One markdown table: the reference's means, then each run's change against it, then the mean over
    the seeds of each reward that ran with several."""
    cols = columns(reference[set_name])
    lines = [f"### {SET_TITLES.get(set_name, set_name)}", "",
             *([f"Intervals of changes: over {captions} captions (resampled within each prompt form); a mean over "
                "seeds resamples the seeds too.", ""] if captions else []),
             "| trained on | KL | seed | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols),
             "| reference (means) | | | " + " | ".join(_absolute(reference[set_name][c], _is_rate(c)) for c in cols)
             + " |"]
    for run in runs:
        head = f"| {run['reward']} | {run['beta']:g} | {run['seed']} | "
        if run["summary"] is None:
            lines.append(head + f"failed (rc {run['rc']}): see {run['log']} |" + " |" * (len(cols) - 1))
            continue
        table = run["summary"]["sets"][set_name]
        cells = [_cell(table[c], False) if c == "kl" else _cell(table[c].get("change"), _is_rate(c)) for c in cols]
        lines.append(head + " | ".join(cells) + " |")
    for group in pooled:
        table = group["sets"][set_name]
        cells = [_cell(table[c]["change"], _is_rate(c)) if c in table else "" for c in cols]
        lines.append(_pooled_head(group) + " | ".join(cells) + " |")
    return lines


def _pooled_head(group: dict) -> str:
    """The first cells of a row that pools a reward's seeds (pool_seeds), in every table that has one."""
    return f"| **{group['reward']}, mean of seeds** | {group['beta']:g} | {','.join(map(str, group['seeds']))} | "


def judge_attributes(set_name: str, reference: dict, runs: list[dict], pooled: list[dict] = ()) -> list[str]:
    """The judge's rate per attribute: the reference's, each run's change and the mean over each reward's seeds
    (pool_seeds already resamples them for every judge key; without this row a per-attribute claim over seeds
    would need its own computation)."""
    attrs = [k for k in reference[set_name] if k.startswith("judge/")]
    if not attrs:
        return []
    lines = ["", f"Judge per attribute ({set_name} prompts), change in points:", "",
             "| trained on | KL | seed | " + " | ".join(a[6:] for a in attrs) + " |", "|---|---|---|" + "---|" * len(attrs),
             "| reference (rates) | | | " + " | ".join(_absolute(reference[set_name][a], True) for a in attrs) + " |"]
    for run in runs:
        if run["summary"] is not None:
            t = run["summary"]["sets"][set_name]
            lines.append(f"| {run['reward']} | {run['beta']:g} | {run['seed']} | " +
                         " | ".join(_cell(t[a].get("change"), True) for a in attrs) + " |")
    for group in pooled:
        t = group["sets"][set_name]
        lines.append(_pooled_head(group) + " | ".join(_cell(t[a]["change"], True) if a in t else "" for a in attrs)
                     + " |")
    return lines


def compared_table(set_name: str, reference: dict, compared: list[dict]) -> list[str]:
    """Each variant's difference from the baseline variant (the first `--variant`), paired per image and per
    seed: every measure, then the judge per attribute."""
    if not compared:
        return []
    cols = columns(reference[set_name]) + [k for k in reference[set_name] if k.startswith("judge/")
                                           and k != "judge/correct"]
    names = [c[6:] if c.startswith("judge/") and c != "judge/correct" else c for c in cols]
    lines = []
    for baseline in dict.fromkeys(c["baseline"] for c in compared):
        lines += _compared_rows(set_name, cols, names, [c for c in compared if c["baseline"] == baseline])
    return lines


def _compared_rows(set_name: str, cols: list[str], names: list[str], compared: list[dict]) -> list[str]:
    lines = ["", f"Against [{compared[0]['baseline']}] ({set_name} prompts): each row minus the baseline's run with the "
             "same reward, KL and seed; the interval resamples captions and seeds:", "",
             "| variant | KL | seeds | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(cols)]
    for c in compared:
        t = c["sets"][set_name]
        lines.append(f"| {c['reward']} | {c['beta']:g} | {','.join(map(str, c['seeds']))} | "
                     + " | ".join(_cell(t.get(k), _is_rate(k)) for k in cols) + " |")
    return lines


def _std(entry: dict) -> float:
    """The per-item standard deviation behind a 95% interval (1.96 standard errors)."""
    if not entry.get("ci95") or entry.get("n", 0) < 2:
        return math.nan
    lo, hi = entry["ci95"]
    return (hi - lo) / (2 * 1.96) * math.sqrt(entry["n"])


def heatmap(reference: dict, runs: list[dict], path: Path, set_name: str = "test") -> None:
    """Rows: trained on (mean over seeds); columns: measured by; colour: the change in the reference's
    standard deviations of that measure (so rewards on different scales compare); text: the change."""
    from matplotlib.figure import Figure

    cols = [c for c in columns(reference[set_name]) if c not in ("entropy", "kl")]
    groups: dict[str, list[dict]] = {}
    for run in runs:
        if run["summary"] is not None:
            groups.setdefault(f"{run['reward']}, KL {run['beta']:g}", []).append(run["summary"]["sets"][set_name])
    if not groups:
        return
    values = [[sum(t[c]["change"]["mean"] for t in g) / len(g) for c in cols] for g in groups.values()]
    stds = [_std(reference[set_name][c]) for c in cols]
    z = [[v / s if s and math.isfinite(s) else 0.0 for v, s in zip(row, stds)] for row in values]
    fig = Figure(figsize=(1.5 + 1.3 * len(cols), 1.0 + 0.5 * len(groups)))
    ax = fig.add_subplot()
    image = ax.imshow(z, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
    ax.set_xticks(range(len(cols)), [c.replace("judge/correct", "judge: all right") for c in cols], fontsize=8)
    ax.set_yticks(range(len(groups)), list(groups), fontsize=8)
    ax.set_xlabel("measured by", fontsize=8)
    ax.set_ylabel("trained on", fontsize=8)
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            text = f"{100 * v:+.1f} pts" if _is_rate(cols[j]) else f"{v:+.3f}"
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax, label="change / reference std")
    ax.set_title(f"Change against the reference, {set_name} prompts", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def strip(scores_dir: Path, name: str, prompts: list[str], path: Path, scale: int = 2) -> None:
    """The reference's and the run's images of the first test prompts, same seeds, one above the other."""
    import numpy as np
    from PIL import Image

    from grpo_vision.images import Cell, paint_grid

    rows = []
    for model in ("reference", name):
        row = np.asarray(Image.open(scores_dir / f"{model}.png").convert("RGB"))
        h = row.shape[0]
        rows.append([Cell(row[:, k * h:(k + 1) * h]) for k in range(row.shape[1] // h)])
    for k, cell in enumerate(rows[1]):
        cell.caption = textwrap.wrap(prompts[k], 20)[:3]
    paint_grid(rows, title=f"{name}: reference (top) and policy (bottom), same prompts and seeds",
               row_labels=["reference", "policy"], label_width=70, scale=scale).save(path)


def write_outputs(out: Path, header: dict, reference: dict, runs: list[dict], prompts: list[str],
                  pooled: list[dict] = (), compared: list[dict] = ()) -> None:
    (out / "matrix.json").write_text(json.dumps({**header, "reference": reference, "runs": runs,
                                                 "pooled": list(pooled), "compared": list(compared)}, indent=2))
    heatmap(reference, runs, out / "matrix.png")
    (out / "strips").mkdir(exist_ok=True)
    stripped = []  # a score cache copied without its picture still gives its rows, only no strip
    for run in runs:
        pictures = [out / "scores" / f"{m}.png" for m in ("reference", run["name"])]
        if run["summary"] is not None and all(p.is_file() for p in pictures):
            strip(out / "scores", run["name"], prompts, out / "strips" / f"{run['name']}.png")
            stripped.append(run["name"])
    lines = ["# Reward matrix", "", f"`{header['command']}`", "",
             f"Each run trains on the reward of its row ({header['steps']} steps each, everything else as the "
             f"config says) and is scored, like the base policy (the reference row), on the same prompts and "
             f"seeds: {header['images_per_prompt']} images per prompt at temperature {header['temperature']}. "
             "Cells: the change against the reference, paired per image, with a 95% interval that resamples "
             "the captions (all their images with them); the "
             "judge in points of its all-attributes-right rate; diversity: mean pairwise cosine distance "
             f"among a prompt's images ({header['embedding']}); entropy: mean per-token entropy of the "
             "sampling distribution; KL: mean per-token k3 to the reference.", "",
             "![heatmap](matrix.png)", ""]
    for set_name in reference:
        lines += [*set_table(set_name, reference, runs, pooled, header.get("captions", {}).get(set_name)),
                  *judge_attributes(set_name, reference, runs, pooled),
                  *compared_table(set_name, reference, compared), ""]
    lines += ["Sample strips (image 0 of the first test prompts, reference above policy): "
              + ", ".join(f"[{name}](strips/{name}.png)" for name in stripped), ""]
    (out / "matrix.md").write_text("\n".join(lines))
