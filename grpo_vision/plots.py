"""The run's figures: reward and KL curves (report and demo) and the judge's bar chart (report).

matplotlib's object API only, no pyplot: no global state, so demo requests may draw concurrently.
"""

from __future__ import annotations

import math
from pathlib import Path


def curve_keys(metrics: list[dict]) -> list[str]:
    """One panel per `reward/<name>/mean` logged, then the KL to the reference."""
    return sorted({k for m in metrics for k in m if k.startswith("reward/") and k.endswith("/mean")}) + ["loss/kl"]


def curves_figure(metrics: list[dict]):
    """Each reward's mean and the KL over steps, three panels a row (a note when nothing is logged yet)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    keys = curve_keys(metrics)
    cols = min(len(keys), 3)
    fig = Figure(figsize=(3.6 * cols, 2.8 * math.ceil(len(keys) / cols)))
    if not metrics:
        fig.text(0.5, 0.5, "no metrics.jsonl yet: the run has not logged a step", ha="center")
        return fig
    steps = [m["step"] for m in metrics]
    for i, key in enumerate(keys):
        ax = fig.add_subplot(math.ceil(len(keys) / cols), cols, i + 1)
        ax.plot(steps, [math.nan if m.get(key) is None else m[key] for m in metrics], lw=1, marker=".")
        ax.set_title(key.replace("/mean", ""), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    return fig


def judge_figure(result: dict):
    """The judge's accuracy per attribute, reference beside policy (an eval.json result)."""
    from matplotlib.figure import Figure

    names = [k for k, v in result["models"]["policy"]["checker"].items() if v["mean"] is not None]
    fig = Figure(figsize=(6.4, 2.8))
    ax = fig.add_subplot()
    for offset, model in ((-0.2, "reference"), (0.2, "policy")):
        table = result["models"][model]["checker"]
        ax.bar([i + offset for i in range(len(names))], [table[n]["mean"] for n in names], width=0.4, label=model)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    fig.savefig(path, dpi=dpi)
    return path
