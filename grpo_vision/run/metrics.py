"""Metrics: the per-step log (metrics.jsonl, and the trackers) and the NaN-aware statistics every
table uses. NaN means "does not apply" throughout (a reward that does not score a sample)."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from grpo_vision.files import FolderError, open_kept, write_file
from grpo_vision.reading import json_lines, what_is


def nanmean(x: torch.Tensor) -> float:
    """Mean over the non-NaN entries; NaN when there are none."""
    return float(x.nanmean()) if (~x.isnan()).any() else float("nan")


def nanstd(x: torch.Tensor) -> float:
    """Unbiased std over the non-NaN entries; 0 with fewer than two."""
    v = x[~x.isnan()]
    return float(v.std()) if v.numel() > 1 else 0.0


def interval(values: torch.Tensor) -> dict:
    """Mean and 95% interval of the non-NaN values (normal approximation, 1.96 standard errors)."""
    v = values[~values.isnan()].double()
    if v.numel() == 0:
        return {"mean": None, "ci95": None, "n": 0}
    half = 1.96 * float(v.std()) / math.sqrt(v.numel()) if v.numel() > 1 else float("nan")
    return {"mean": round(float(v.mean()), 5), "ci95": [round(float(v.mean()) - half, 5),
                                                      round(float(v.mean()) + half, 5)], "n": int(v.numel())}


def load_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows; a line cut short by a crash mid-write, or one that is not a step's row, is skipped."""
    return step_rows(Path(run_dir) / "metrics.jsonl")


def step_rows(path: Path) -> list[dict]:
    """The JSON lines of a per-step log (metrics.jsonl, alerts.jsonl) that hold a step: a line cut short by a
    crash mid-write, or one that is not a step's row, is skipped; no file, no rows."""
    return read_step_rows(path)[0]


def read_step_rows(path: Path) -> tuple[list[dict], list[str]]:
    """`step_rows`, and "<file>, line N: why" for each line skipped (not UTF-8, not JSON, nested too deep, not a
    step's row). FolderError when the log is a folder, a FIFO (reading it would wait for ever) or unreadable."""
    if what_is(path) == "missing":
        return [], []
    values, skipped = json_lines(path, FolderError, f"a run's {path.name} is the per-step log train writes; move "
                                                    "this one away and run again")
    rows = []
    for number, row in values:
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            skipped.append((number, f"{path}, line {number}: not a step's row (a JSON object with a whole-number "
                                    "'step')"))
    return rows, [why for _, why in sorted(skipped)]


def finite_or_none(v: float):
    """JSON has no NaN or inf: a value that is not finite is written as null."""
    return v if math.isfinite(v) else None


class PhaseTimer:
    """Seconds per phase of one step: `perf/<phase>_s`, and `perf/step_s` from its creation to `metrics()`.
    A phase entered inside another is its own: the outer one's clock stops meanwhile (decoding inside
    sampling's gathered weights counts as decode, the gather as sample). On a GPU `sync` (the device's
    synchronize) runs at each boundary: kernels are asynchronous, and without it a phase's time was charged
    to the next one that waited for a result (one H200 step showed a 576-token sampler as 0.5 s of `sample`
    and 4 s of `reward`). A few waits a step cost nothing beside it: each phase ends in one anyway."""

    def __init__(self, sync=None):
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self._open: list[str] = []  # the phases entered and not left, innermost last
        self._since = self.start  # when the innermost open phase's clock last started
        self._sync = sync or (lambda: None)

    def _charge(self, now: float) -> None:
        if self._open:
            phase = self._open[-1]
            self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._since
        self._since = now

    @contextmanager
    def __call__(self, phase: str):
        self._sync()
        self._charge(time.perf_counter())
        self._open.append(phase)
        self.seconds.setdefault(phase, 0.0)
        try:
            yield
        except BaseException:  # no device wait here: after a CUDA error it would raise again, over this error
            self._charge(time.perf_counter())
            self._open.pop()
            raise
        self._sync()
        self._charge(time.perf_counter())
        self._open.pop()

    def metrics(self) -> dict[str, float]:
        self._sync()
        return {"perf/step_s": time.perf_counter() - self.start, **{f"perf/{k}_s": v for k, v in self.seconds.items()}}


class MetricsLogger:
    """metrics.jsonl (one line per step; on resume, lines past the checkpoint are dropped), and the same
    scalars to the run's trackers (run/trackers.py: TensorBoard, W&B, MLflow), when given."""

    def __init__(self, run_dir: Path, start: int, trackers=None):
        self.path = run_dir / "metrics.jsonl"
        keep = [row for row in load_metrics(run_dir) if row["step"] <= start]
        write_file(self.path, "".join(json.dumps(row) + "\n" for row in keep))  # replaces a link, never follows it
        self.file = open_kept(self.path)
        self.trackers = trackers

    def log(self, step: int, metrics: dict) -> dict:
        """Write one step's row; returns it as metrics.jsonl holds it (what the alerts watch)."""
        row = {"step": step, **{k: finite_or_none(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.trackers:
            self.trackers.log(step, metrics)
        return row

    def close(self) -> None:
        self.file.close()
        if self.trackers:
            self.trackers.close()
