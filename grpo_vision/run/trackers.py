"""Trackers: where a run's metrics and pictures go besides metrics.jsonl, through accelerate's tracker
API (`Accelerator(log_with=..., project_config=...)`, `init_trackers`, `accelerator.log`): one code path
for every tracker `log.trackers` names.

    tensorboard  scalars; at log.sample_every the policy-vs-reference grid as an image, and a text with
                 each grid image's prompt, seed, rewards, judge verdict and, where the policy wrote one
                 (sample.plan), its text plan (run_dir/tensorboard/<project>/)
    wandb        scalars, the grid, and the step's rollouts as a table: prompt, image, each reward, the
                 advantage, the judge's verdict and, with sample.plan, the image's plan (pip install
                 'grpo_vision[wandb]'; WANDB_MODE=offline writes run_dir/wandb/ without a network)
    mlflow       scalars and the grid PNGs as artifacts (pip install 'grpo_vision[mlflow]'; where it writes
                 is MLflow's own setting, MLFLOW_TRACKING_URI)

A resumed run logs into the same W&B and MLflow runs: their ids are kept in run_dir/trackers.json.
TensorBoard drops the events past the resumed step (purge_step), as metrics.jsonl drops its lines.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import secrets
from pathlib import Path

import numpy as np

from grpo_vision.config import ConfigError
from grpo_vision.files import folder, write_file

PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # tracker -> the module it needs


def accelerator_options(cfg, run_dir: Path) -> dict:
    """Accelerator(...)'s tracker arguments for this run; a tracker whose package is missing is a
    ConfigError here (accelerate itself would leave it out silently)."""
    from accelerate.utils import ProjectConfiguration

    names = list(dict.fromkeys(cfg.log.trackers))  # a tracker named twice starts once
    for n in names:
        if importlib.util.find_spec(PACKAGE[n]) is None:
            raise ConfigError(f"log.trackers names {n}, and the {PACKAGE[n]} package is not installed: pip install "
                              f"'grpo_vision[{n}]', or leave {n} out of log.trackers")
    return {"log_with": names or None,
            "project_config": ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "tensorboard"))}


def flat_config(cfg, prefix: str = "") -> dict:
    """The config as dotted keys with plain values (W&B's config, MLflow's params): sections walked,
    lists and mappings as JSON."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out |= flat_config(v, f"{prefix}{f.name}.")
        else:
            out[f"{prefix}{f.name}"] = v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
    return out


class Trackers:
    """The run's trackers once started (the main process only): scalars each step, the sample grid and
    the rollouts at log.sample_every."""

    def __init__(self, acc, run_dir: Path, cfg, start: int):
        self.acc, self.run_dir = acc, Path(run_dir)
        self.names = [str(t) for t in acc.log_with]
        if not self.names:
            return
        if "tensorboard" in self.names:
            folder(run_dir, run_dir / "tensorboard")  # a link there is refused (files.py)
        ids_path = self.run_dir / "trackers.json"
        ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
        ids.setdefault("wandb", secrets.token_hex(4))
        kwargs = {"tensorboard": {"purge_step": start + 1},
                  "wandb": {"name": cfg.run.name, "dir": str(run_dir), "id": ids["wandb"], "resume": "allow"},
                  "mlflow": {"run_name": cfg.run.name, "run_id": ids.get("mlflow")}}
        acc.init_trackers(cfg.log.project, init_kwargs={n: kwargs[n] for n in self.names})
        if not start:  # the config, once: TensorBoard's hparams would add a folder per call
            for name in ("wandb", "mlflow"):
                if name in self.names:
                    acc.get_tracker(name).store_init_configuration(flat_config(cfg))
        if "mlflow" in self.names:
            ids["mlflow"] = acc.get_tracker("mlflow").tracker.info.run_id
        if {"wandb", "mlflow"} & set(self.names):
            write_file(ids_path, json.dumps(ids) + "\n")

    def log(self, step: int, metrics: dict) -> None:
        if self.names:
            self.acc.log(metrics, step=step)

    def wants_grid(self) -> bool:
        return bool(self.names)

    def log_grid(self, step: int, sheet, text: str, png: Path) -> None:
        """The sample grid (a PIL image; `png` where it was saved) and its text (markdown)."""
        if "tensorboard" in self.names:
            tb = self.acc.get_tracker("tensorboard", unwrap=True)
            tb.add_image("samples/grid", np.asarray(sheet.convert("RGB")), step, dataformats="HWC")
            tb.add_text("samples/grid", text, step)
            tb.flush()
        if "wandb" in self.names:
            import wandb

            self.acc.get_tracker("wandb").log({"samples/grid": wandb.Image(sheet, caption=f"step {step}: policy | "
                                                                                         "reference, same seeds"),
                                               "samples/grid_text": wandb.Html(_html(text))}, step=step)
        if "mlflow" in self.names:
            self.acc.get_tracker("mlflow").log_artifact(str(png), "samples")

    def log_rollouts(self, step: int, prompts: list[str], images, rewards: dict, advantages, verdicts: list,
                     plans: list[str] | None = None) -> None:
        """W&B's table of this process's rollouts of the step: prompt, image, each reward, the advantage,
        the judge's verdict, and each image's plan where the rollouts have a text stage (other trackers have no
        tables)."""
        if "wandb" not in self.names:
            return
        import wandb

        from grpo_vision.images import to_uint8

        pixels = to_uint8(images)
        names = list(rewards)
        rows = [[p, wandb.Image(pixels[i]), *[_num(rewards[n][i]) for n in names], _num(advantages[i]),
                 verdict_text(verdicts[i]), *([plans[i]] if plans is not None else [])] for i, p in enumerate(prompts)]
        columns = ["prompt", "image", *names, "advantage", "judge", *(["plan"] if plans is not None else [])]
        self.acc.get_tracker("wandb").log_table("rollouts", columns=columns, data=rows, step=step)

    def close(self) -> None:
        """Each tracker's finish (not accelerator.end_training, which also ends the process group, on
        this process only)."""
        for tracker in self.acc.trackers if self.names else []:
            tracker.finish()


def _num(x) -> float | None:
    v = float(x)
    return v if np.isfinite(v) else None


def table_cell(text: str | None) -> str:
    """A text as one markdown table cell ('-' for none): '|' and line breaks would end the cell or the row."""
    return "-" if text is None else " ".join(text.replace("|", "/").split()) or "(empty)"


def _html(markdown_table: str) -> str:
    return "<pre>" + markdown_table.replace("&", "&amp;").replace("<", "&lt;") + "</pre>"


def verdict_text(verdict: dict | None | str) -> str:
    """A judge's verdict in a few words: 'right', 'wrong: color, count', or '' (no judge / cannot read)."""
    if not isinstance(verdict, dict):
        return verdict or ""
    if verdict.get("correct"):
        return "right"
    return "wrong: " + ", ".join(a for a, ok in verdict.items() if a != "correct" and ok is False)


def grid_text(step: int, prompts: list[str], seeds: list[int], rewards: dict, verdicts: dict,
              plans: dict | None = None) -> str:
    """The grid's text (markdown): one row per image, policy and reference side by side on each seed.
    `rewards`: side -> reward name -> [n] values; `verdicts`: side -> [n] verdicts (or None); `plans` (the grid's,
    where the policy writes one): side -> [n] each image's text plan, or None."""
    names = list(rewards["policy"])
    plans = plans if plans and any(v is not None for v in plans.values()) else None
    head = ["prompt", "seed", *[f"{n}: policy / reference" for n in names], "judge: policy / reference",
            *(["plan: policy / reference"] if plans else [])]
    lines = [f"Step {step}: policy vs reference on the same seeds (samples/step_{step:06d}.png).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, (p, s) in enumerate(zip(prompts, seeds)):
        cells = [p.replace("|", "/"), str(s)]
        for n in names:
            a, b = (_num(rewards[side][n][i]) for side in ("policy", "reference"))
            cells.append(" / ".join("n/a" if v is None else f"{v:.3f}" for v in (a, b)))
        cells.append(" / ".join(verdict_text(verdicts[side][i]) or "-" for side in ("policy", "reference")))
        if plans:
            cells.append(" / ".join(table_cell(plans[side] and plans[side][i]) for side in ("policy", "reference")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
