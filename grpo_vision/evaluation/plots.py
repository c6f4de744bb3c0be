"""The run's figures: reward and KL curves (report and demo) and the judge's bar chart (report).

matplotlib's object API only, no pyplot: no global state, so demo requests may draw concurrently.
"""

from __future__ import annotations

import math
from pathlib import Path

from grpo_vision.files import write_file


def curve_keys(metrics: list[dict]) -> list[str]:
    """One panel per `reward/<name>/mean` logged, then the KL to the reference."""
    return sorted({k for m in metrics for k in m if k.startswith("reward/") and k.endswith("/mean")}) + ["loss/kl"]


def curve_title(key: str) -> tuple[str, str]:
    """(title in words, y-axis label) of a curve's metric key."""
    if key == "loss/kl":
        return "KL to the reference (k3, per token)", "KL"
    name = key.removeprefix("reward/").removesuffix("/mean")
    if name == "total":
        return "total reward (what advantages come from)", "reward"
    return f"{name} (mean over the step's images)", name


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing moving average over the last `window` finite values (NaN where none is finite yet)."""
    out, seen = [], []
    for v in values:
        if v == v:  # not NaN
            seen.append(v)
        recent = seen[-window:]
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


def curves_figure(metrics: list[dict]):
    """Each reward's mean and the KL over training steps, three panels a row: each step's value as a
    faint point, a moving average over a tenth of the run as the line (a note when nothing is logged)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    keys = curve_keys(metrics)
    cols = min(len(keys), 3)
    rows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows + 0.4))
    if not metrics:
        fig.text(0.5, 0.5, "no metrics.jsonl yet: the run has not logged a step", ha="center")
        return fig
    fig.suptitle("During training: each step's own samples (evaluation after training: the report's tables)",
                 fontsize=10)
    steps = [m["step"] for m in metrics]
    window = max(1, round(len(metrics) / 10))
    for i, key in enumerate(keys):
        ax = fig.add_subplot(rows, cols, i + 1)
        values = [math.nan if m.get(key) is None else m[key] for m in metrics]
        ax.plot(steps, values, ls="none", marker=".", ms=3, alpha=0.35, color="tab:blue", label="each step")
        ax.plot(steps, smoothed(values, window), lw=1.6, color="tab:blue", label=f"mean of the last {window}")
        title, ylabel = curve_title(key)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("training step", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def judge_figure(result: dict):
    """The judge's accuracy per attribute, reference beside policy (one set's result, eval.json's `sets`)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    names = [k for k, v in result["models"]["policy"]["judge"].items() if v["mean"] is not None]
    fig = Figure(figsize=(6.4, 2.8))
    ax = fig.add_subplot()
    for offset, model in ((-0.2, "reference"), (0.2, "policy")):
        table = result["models"][model]["judge"]
        ax.bar([i + offset for i in range(len(names))], [table[n]["mean"] for n in names], width=0.4, label=model)
    ax.set_xticks(range(len(names)), ["all right" if n == "correct" else n for n in names], fontsize=8)
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylabel("accuracy")
    ax.set_title("After training: the judge's accuracy per attribute on the test prompts", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    """Written whole, never through a link (files.py)."""
    return write_file(path, lambda f: fig.savefig(f, dpi=dpi, format=Path(path).suffix[1:]))
