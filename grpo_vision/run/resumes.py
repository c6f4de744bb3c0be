"""Which settings each step of a run trained with: `resumes.jsonl`, one line per `train --resume` that trained.

A resume may change settings (`train.lr=...`, `sample.decode=speculative`, `sample.plan.enabled=false`), and
the run's `config.yaml` is rewritten with them: it is the config in force from the last resume on, which is what
a later resume continues with and what eval, the report, the demo and the matrix read for the latest checkpoint.
Each resume appends `{"step", "time", "changes": {"train.lr": [old, new], ...}}`: the first step it trained, as
metrics.jsonl numbers steps, and the settings it changed (dotted keys of the config's sections). The config in
force at an earlier step is `config.yaml` with the later resumes' changes undone (`config_at`): a checkpoint is
evaluated with the plan setting it was trained with.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from grpo_vision.files import FolderError, open_kept
from grpo_vision.reading import json_lines, what_is

RESUMES = "resumes.jsonl"


def config_changes(old, new, prefix: str = "") -> dict[str, list]:
    """{dotted key: [old, new]} for each setting of the Config `new` that differs from `old`; a field that is a
    dict or a list (reward.weights, train.adam_betas) is one setting, so no key is split inside a reward's name."""
    changes = {}
    for field in dataclasses.fields(new):
        a, b, key = getattr(old, field.name), getattr(new, field.name), prefix + field.name
        if dataclasses.is_dataclass(b):
            changes |= config_changes(a, b, key + ".")
        elif a != b:
            changes[key] = [a, b]
    return changes


def format_changes(changes: dict[str, list]) -> str:
    """'train.lr 1e-05 -> 0.01, sample.decode "auto" -> "speculative"' (the values as JSON)."""
    return ", ".join(f"{key} {json.dumps(old)} -> {json.dumps(new)}" for key, (old, new) in changes.items())


def record_resume(run_dir: Path, start: int, changes: dict[str, list]) -> None:
    """Append the resume from checkpoint `start` to the run's resumes.jsonl and say what it changed."""
    if changes:
        print(f"[train] from step {start + 1} on: {format_changes(changes)} (recorded in {RESUMES})", flush=True)
    with open_kept(run_dir / RESUMES, root=run_dir) as f:
        record = {"step": start + 1, "time": time.strftime("%Y-%m-%d %H:%M:%S %z"), "changes": changes}
        f.write(json.dumps(record) + "\n")


def resume_records(run_dir: str | Path) -> list[dict]:
    """resumes.jsonl's records in the order written; a line cut short by a crash, or not a record, is skipped."""
    path = Path(run_dir) / RESUMES
    if what_is(path) == "missing":
        return []
    values, _ = json_lines(path, FolderError, f"a run's {RESUMES} records its resumes; move this one away")
    return [r for _, r in values if isinstance(r, dict) and isinstance(r.get("step"), int)
            and isinstance(r.get("changes"), dict)
            and all(isinstance(v, list) and len(v) == 2 for v in r["changes"].values())]


def config_at(raw: dict, records: list[dict], step: int) -> dict:
    """The raw config (config.yaml's mapping) that trained checkpoint `step`: the changes of every resume whose first
    step came after it undone, the latest first."""
    for record in reversed(records):
        if record["step"] <= step:
            break
        for key, (old, _) in record["changes"].items():
            *sections, name = key.split(".")
            node = raw
            for section in sections:
                node = node.setdefault(section, {}) if isinstance(node, dict) else None
            if isinstance(node, dict):  # else not what train writes: from_dict names the problem
                node[name] = old
    return raw


def in_force_header(records: list[dict]) -> str:
    """config.yaml's first line once a resume changed a setting: from which step it holds."""
    changed = [r["step"] for r in records if r["changes"]]
    if not changed:
        return ""
    return (f"# The config in force from step {changed[-1]} on; {RESUMES} lists each resume's step and the "
            "settings it changed (eval of an earlier checkpoint reads that step's)\n")


def resume_lines(run_dir: str | Path) -> list[str]:
    """The report's section: each resume that changed a setting, from which step."""
    changed = [r for r in resume_records(run_dir) if r["changes"]]
    if not changed:
        return []
    return ["## Resumed with other settings", "",
            f"From each step below on, the run trained with the settings changed there ({RESUMES}); config.yaml "
            "holds the latest.", "",
            *(f"- from step {r['step']} ({r.get('time', '?')}): {format_changes(r['changes'])}" for r in changed), ""]
