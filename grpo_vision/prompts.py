"""Prompts files: plain text (one caption per line) or JSONL with a `prompt` field per line.

A JSONL entry may also carry its own reward weights and metadata, which route rewards per entry:

    {"prompt": "a red circle", "rewards": {"clip": 1.0, "shapes_exact": 0.5}, "metadata": {"tag": "x"}}

Blank lines and lines starting with `#` are skipped; the first other line decides the format (a `{`
starts JSONL), as does a `.jsonl` / `.json` suffix; a later line starting with `{` in a plain-text file
is an error, not a caption. Lines end at line breaks only: a caption or JSON string may hold U+2028 and
other separators. Errors name the file and line, and quote user text briefly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from grpo_vision.config.load import brief
from grpo_vision.files import write_file

# Lists and objects one JSON line may nest. Python's parser stops near 1,000 with a RecursionError, and
# a value a few hundred deep parses but breaks json.dumps (the run saves its prompts) and copies
MAX_DEPTH = 100


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
    lines = read_lines(path)
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


def read_lines(path: Path) -> list[str]:
    """The lines of the UTF-8 text file `path`, split at line breaks only ("\\n", "\\r\\n", "\\r", which
    reading turns into "\\n"): str.splitlines() also splits at U+2028, U+0085 and other separators that a
    JSON string or a caption may hold. A leading byte-order mark is dropped."""
    try:
        return path.read_text(encoding="utf-8-sig").split("\n")
    except UnicodeDecodeError as e:
        raise PromptsError(f"{path} is not UTF-8 text ({e}); save it as UTF-8") from None


def parse_json_line(text: str, where: str):
    """The JSON value on one line, or PromptsError naming `where` when it is not JSON or nests more
    than MAX_DEPTH lists and objects."""
    too_deep = PromptsError(f"{where}: lists and objects nested more than {MAX_DEPTH} levels deep; write flatter JSON")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptsError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # nested far past MAX_DEPTH: the parser stopped at Python's recursion limit
        raise too_deep from None
    if _depth(value) > MAX_DEPTH:
        raise too_deep
    return value


def _depth(value) -> int:
    """How many levels of lists and objects `value` nests, counted level by level, without recursion."""
    depth, level = 0, [value]
    while level := [v for v in level if isinstance(v, (list, dict))]:
        depth += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def _parse_jsonl_line(text: str, path: Path, number: int) -> PromptEntry:
    where = f"{path}, line {number}"
    row = parse_json_line(text, where)
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise PromptsError(f"{where}: each JSONL line must be an object with a non-empty string 'prompt'")
    unknown = set(row) - {"prompt", "rewards", "metadata"}
    if unknown:
        raise PromptsError(f"{where}: unknown field(s) {brief(sorted(unknown))}; allowed: prompt, rewards, metadata")
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
    `root`: the run folder that `path` lies in a sub-folder of (files.write_file)."""
    rows = [{"prompt": e.prompt, **({"rewards": e.rewards} if e.rewards else {}),
             **({"metadata": e.metadata} if e.metadata else {})} for e in entries]
    write_file(path, "".join(json.dumps(row) + "\n" for row in rows), root)
