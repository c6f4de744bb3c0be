"""GenEval's prompt sets as prompts files: its 553 evaluation prompts, and training prompts drawn from
the same six task templates over the same 80 COCO classes that are never an evaluation prompt.

The evaluation prompts ship unchanged in geneval_data/ (MIT, SOURCE.md there). Training on prompts
generated from the benchmark's templates is what Flow-GRPO did for GenEval; a generated prompt equal to
an evaluation prompt is drawn again, so a run never trains on what it will be scored on. The templates
follow GenEval's `prompts/create_prompts.py`: "a photo of ..." with a / an by the first letter, plurals
by adding "s" ("es" after an s, so "buses" and, as GenEval writes them, "sheeps"), counts 2 to 4 with
"at most that many" as an exclude clause, no colour for a person, a position clause pointing at the
first object.

Each entry is `{"prompt": ..., "metadata": {"tag", "include", "exclude"?}}`, the metadata in GenEval's
format, which the `geneval` reward reads.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import numpy as np

from grpo_vision.prompts import PromptEntry, PromptsError, save_prompts
from grpo_vision.rewards.geneval import COLORS, RELATIONS, TAGS

DATA = Path(__file__).parent / "geneval_data"
EVALUATION = DATA / "evaluation_metadata.jsonl"  # GenEval's 553 prompts, as its scorer reads them
NUMBERS = ("zero", "one", "two", "three", "four")


def classes() -> list[str]:
    """The 80 COCO class names GenEval's prompts use, in its order."""
    return (DATA / "object_names.txt").read_text().split("\n")[:80]


def evaluation_entries() -> list[PromptEntry]:
    """GenEval's 553 evaluation prompts, each with its metadata."""
    rows = [json.loads(line) for line in EVALUATION.read_text().splitlines() if line.strip()]
    return [PromptEntry(row["prompt"], metadata={k: v for k, v in row.items() if k != "prompt"}) for row in rows]


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _plural(word: str) -> str:
    return f"{word}es" if word.endswith("s") else f"{word}s"


def draw(tag: str, rng: np.random.Generator, names: list[str]) -> dict:
    """One prompt of task `tag` in GenEval's format: {"tag", "include", "exclude"?, "prompt"}."""
    a, b = (names[i] for i in rng.choice(len(names), size=2, replace=False))
    colourable = [n for n in names if n != "person"]  # GenEval never colours a person
    if tag == "single_object":
        return {"tag": tag, "include": [{"class": a, "count": 1}], "prompt": f"a photo of {_a(a)}"}
    if tag == "two_object":
        return {"tag": tag, "include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
                "prompt": f"a photo of {_a(a)} and {_a(b)}"}
    if tag == "counting":
        k = int(rng.integers(2, 5))  # 2 to 4
        return {"tag": tag, "include": [{"class": a, "count": k}], "exclude": [{"class": a, "count": k + 1}],
                "prompt": f"a photo of {NUMBERS[k]} {_plural(a)}"}
    if tag == "colors":
        name, colour = colourable[rng.integers(len(colourable))], COLORS[rng.integers(len(COLORS))]
        return {"tag": tag, "include": [{"class": name, "count": 1, "color": colour}],
                "prompt": f"a photo of {_a(colour)} {name}"}
    if tag == "position":
        relation = RELATIONS[rng.integers(len(RELATIONS))]
        return {"tag": tag, "include": [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}],
                "prompt": f"a photo of {_a(a)} {relation} {_a(b)}"}
    if tag == "color_attr":
        x, y = (colourable[i] for i in rng.choice(len(colourable), size=2, replace=False))
        cx, cy = (COLORS[i] for i in rng.choice(len(COLORS), size=2, replace=False))
        return {"tag": tag, "include": [{"class": x, "count": 1, "color": cx}, {"class": y, "count": 1, "color": cy}],
                "prompt": f"a photo of {_a(cx)} {x} and {_a(cy)} {y}"}
    raise ValueError(f"unknown GenEval task {tag!r}; one of {', '.join(TAGS)}")


def training_entries(n: int, seed: int = 0) -> list[PromptEntry]:
    """`n` distinct prompts, the tasks in turn, none of them an evaluation prompt; the same (n, seed)
    gives the same list. Every one of the 80 single-object prompts is an evaluation prompt, so training
    draws the other five tasks."""
    rng, names = np.random.default_rng(seed), classes()
    tasks = [t for t in TAGS if t != "single_object"]
    taken = {e.prompt for e in evaluation_entries()}
    out = []
    while len(out) < n:
        if not tasks:
            raise PromptsError(f"GenEval's templates give only {len(out)} training prompts outside the evaluation "
                               "set: ask for at most that many")
        tag = tasks[len(out) % len(tasks)]
        # counting has 240 prompts (80 classes x 2..4), 80 of them evaluation ones: a task whose draws keep
        # landing on taken prompts is used up, and the others go on
        row = next((r for r in (draw(tag, rng, names) for _ in range(2000)) if r["prompt"] not in taken), None)
        if row is None:
            tasks.remove(tag)
            continue
        taken.add(row["prompt"])
        out.append(PromptEntry(row.pop("prompt"), metadata=row))
    return out


@lru_cache(maxsize=4)
def _grammar(names: tuple[str, ...]) -> list[tuple[str, re.Pattern]]:
    """The six templates as anchored patterns over `names`, the most specific first (a colour word may be
    a class too: "an orange" is one object, "an orange dog" a coloured one)."""
    alt = lambda words: "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))  # noqa: E731
    obj, colour, rel = f"(?:an?) ({alt(names)})", f"(?:an?) ({alt(COLORS)}) ({alt(names)})", alt(RELATIONS)
    plural = f"({'|'.join(NUMBERS[2:])}) ({alt(_plural(n) for n in names)})"
    return [("color_attr", re.compile(f"a photo of {colour} and {colour}")),
            ("position", re.compile(f"a photo of {obj} ({rel}) {obj}")),
            ("colors", re.compile(f"a photo of {colour}")),
            ("counting", re.compile(f"a photo of {plural}")),
            ("two_object", re.compile(f"a photo of {obj} and {obj}")),
            ("single_object", re.compile(f"a photo of {obj}"))]


def parse(prompt: str, names: list[str] | None = None) -> dict | None:
    """The metadata of a prompt in GenEval's grammar (the templates `draw` writes, over `names`, COCO's by
    default), as GenEval's evaluation_metadata.jsonl has it; None for any other prompt. The demo reads
    a typed prompt's clauses with it."""
    names = tuple(names or classes())
    text = " ".join(prompt.strip().lower().split())
    for tag, pattern in _grammar(names):
        m = pattern.fullmatch(text)
        if not m:
            continue
        g = m.groups()
        if tag == "color_attr":
            return {"tag": tag, "include": [{"class": g[1], "count": 1, "color": g[0]},
                                            {"class": g[3], "count": 1, "color": g[2]}]}
        if tag == "position":
            return {"tag": tag, "include": [{"class": g[2], "count": 1},
                                            {"class": g[0], "count": 1, "position": [g[1], 0]}]}
        if tag == "colors":
            return {"tag": tag, "include": [{"class": g[1], "count": 1, "color": g[0]}]}
        if tag == "counting":
            k, name = NUMBERS.index(g[0]), next(n for n in names if _plural(n) == g[1])
            return {"tag": tag, "include": [{"class": name, "count": k}], "exclude": [{"class": name, "count": k + 1}]}
        if tag == "two_object":
            return {"tag": tag, "include": [{"class": g[0], "count": 1}, {"class": g[1], "count": 1}]}
        return {"tag": tag, "include": [{"class": g[0], "count": 1}]}
    return None


def write(entries: list[PromptEntry], path: str | Path) -> None:
    """A prompts file (JSONL) that `data.*` and `--prompts` read."""
    save_prompts(entries, Path(path))
