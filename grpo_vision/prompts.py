"""Prompts files: plain text (one caption per line) or JSONL with a `prompt` field per line.

A JSONL entry may also carry its own reward weights and metadata, which route rewards per entry:

    {"prompt": "a red circle", "rewards": {"clip": 1.0, "shapes_exact": 0.5}, "metadata": {"tag": "x"}}

Blank lines and lines starting with `#` are skipped; the first other line decides the format (a `{`
starts JSONL), as does a `.jsonl` / `.json` suffix; a later line starting with `{` in a plain-text file
is an error, not a caption. Errors name the file and line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from grpo_vision.runfiles import write_file


class PromptsError(ValueError):
    """A prompts file problem; the message names the file and the line."""


@dataclass
class PromptEntry:
    prompt: str
    rewards: dict[str, float] | None = None  # per-entry reward weights; None = the config's weights
    metadata: dict = field(default_factory=dict)  # passed to reward functions as-is
    line: int = 0  # line number in its file, for error messages


def load_prompts(path: str | Path) -> list[PromptEntry]:
    path = Path(path)
    if not path.is_file():
        raise PromptsError(f"prompts file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # -sig: a leading byte-order mark is dropped
    except UnicodeDecodeError as e:
        raise PromptsError(f"{path} is not UTF-8 text ({e}); a prompts file is plain text or JSONL") from None
    first = next((ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")), "")
    jsonl = path.suffix in (".jsonl", ".json") or first.startswith("{")  # decided by the first prompt line
    entries = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if not jsonl and text.startswith("{"):  # else trained on as a literal caption, braces and all
            raise PromptsError(f"{path}, line {number}: looks like JSON, but the file is read as plain text (its "
                               f"first prompt line is not JSON): rename it to {path.stem}.jsonl and write every "
                               "line as JSON, or write this line as a plain caption")
        entries.append(_parse_jsonl_line(text, path, number) if jsonl else PromptEntry(text, line=number))
    if not entries:
        raise PromptsError(f"{path} holds no prompts: write one caption per line, or JSONL with a 'prompt' field")
    return entries


def _parse_jsonl_line(text: str, path: Path, number: int) -> PromptEntry:
    where = f"{path}, line {number}"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptsError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise PromptsError(f"{where}: each JSONL line must be an object with a non-empty string 'prompt'")
    unknown = set(row) - {"prompt", "rewards", "metadata"}
    if unknown:
        raise PromptsError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: prompt, rewards, metadata")
    rewards = row.get("rewards")
    if rewards is not None and (not isinstance(rewards, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for k, v in rewards.items())):
        raise PromptsError(f"{where}: 'rewards' must map reward names to finite numbers, e.g. {{\"clip\": 1.0}}")
    metadata = row.get("metadata", {})
    if not isinstance(metadata, dict):
        raise PromptsError(f"{where}: 'metadata' must be an object")
    return PromptEntry(row["prompt"].strip(), {k: float(v) for k, v in rewards.items()} if rewards else None,
                       metadata, number)


def save_prompts(entries: list[PromptEntry], path: str | Path, root: str | Path | None = None) -> None:
    """Write entries as a JSONL prompts file that `load_prompts` reads back (prompt, rewards, metadata);
    `root`: the run folder that `path` lies in a sub-folder of (runfiles.write_file)."""
    rows = [{"prompt": e.prompt, **({"rewards": e.rewards} if e.rewards else {}),
             **({"metadata": e.metadata} if e.metadata else {})} for e in entries]
    write_file(path, "".join(json.dumps(row) + "\n" for row in rows), root)
