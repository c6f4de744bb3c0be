"""GenEval's prompt sets as prompts files: its 553 evaluation prompts, and training prompts drawn from
the same six task templates over the same 80 COCO classes that are never an evaluation prompt.

The evaluation prompts ship unchanged in geneval_data/ (MIT, SOURCE.md there). Training on prompts
generated from the benchmark's templates is what Flow-GRPO did for GenEval; a generated prompt equal to
an evaluation prompt is drawn again, so a run never trains on what it will be scored on. The templates
follow GenEval's `prompts/create_prompts.py`: "a photo of ..." with a / an by the first letter, plurals
by adding "s" ("es" after an s, so "buses" and, as GenEval writes them, "sheeps"), counts 2 to 4 with
"at most that many" as an exclude clause, no colour for a person, a position clause pointing at the
first object.

A GenEval prompt comes in two shapes, and every command that takes one reads both (`read`): GenEval's own
line, the clauses beside the prompt (`{"tag", "include", "exclude"?, "prompt"}`, as its
evaluation_metadata.jsonl and each folder's metadata.jsonl hold it), and this tool's prompts-file entry,
the clauses under `metadata` (`{"prompt", "metadata": {"tag", "include", "exclude"?}}`, what `write` and
`prompts geneval --out` write, and what training reads). What leaves the tool for GenEval's scorer is its
own shape (`flat`), since its `evaluation/evaluate_images.py` reads `metadata["tag"]` at the top level.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import numpy as np

from grpo_vision.prompts import PromptEntry, PromptsError, parse_json_line, read_lines, save_prompts
from grpo_vision.reading import what_is
from grpo_vision.rewards.geneval import COLORS, RELATIONS, TAGS, check_metadata

DATA = Path(__file__).parent / "geneval_data"
EVALUATION = DATA / "evaluation_metadata.jsonl"  # GenEval's 553 prompts, as its scorer reads them
NUMBERS = ("zero", "one", "two", "three", "four")


def classes() -> list[str]:
    """The 80 COCO class names GenEval's prompts use, in its order."""
    return (DATA / "object_names.txt").read_text().split("\n")[:80]


def evaluation_entries() -> list[PromptEntry]:
    """GenEval's 553 evaluation prompts, each with its metadata."""
    return read(EVALUATION)


def entry(value, where: str) -> PromptEntry:
    """One GenEval prompt, in either shape (GenEval's `{"tag", "include", ..., "prompt"}` or this tool's
    `{"prompt", "metadata": {...}}`), its clauses checked; PromptsError naming `where` otherwise. A flat
    line's other fields stay in the metadata, so `flat` gives GenEval's line back whole."""
    if not isinstance(value, dict) or not isinstance(value.get("prompt"), str) or not value["prompt"].strip():
        raise PromptsError(f"{where}: a GenEval prompt is a JSON object with a non-empty 'prompt' and its clauses, "
                           'GenEval\'s {"tag": ..., "include": [...], "prompt": ...} or {"prompt": ..., "metadata": '
                           '{"tag": ..., "include": [...]}}')
    if "metadata" in value:
        beside = sorted(set(value) - {"prompt", "metadata", "rewards"})
        if beside:  # half of the clauses beside the prompt, half under metadata: which are meant is a guess
            raise PromptsError(f"{where}: a 'metadata' object and {beside} beside it; write the clauses in one "
                               "place, all under 'metadata' or all beside the prompt as GenEval does")
        metadata = value["metadata"]
    else:
        metadata = {k: v for k, v in value.items() if k != "prompt"}
    try:
        check_metadata(metadata, where)
    except ValueError as e:  # one line naming the file and line, as the prompts readers' errors
        raise PromptsError(str(e)) from None
    # an entry's own reward weights are not kept: GenEval's score is the geneval reward's alone
    return PromptEntry(value["prompt"].strip(), metadata=metadata)


def read(path: str | Path) -> list[PromptEntry]:
    """The GenEval prompts of a JSONL file in either shape, even mixed, each checked (`entry`): what `sample
    --layout geneval` and `eval --benchmark geneval` take as --prompts. Blank lines and lines starting
    with `#` are skipped, and lines split at line breaks only, as in a prompts file (prompts.py)."""
    path = Path(path)
    if what_is(path) == "missing":
        raise PromptsError(f"GenEval prompts file not found: {path}")
    entries = []
    for number, line in enumerate(read_lines(path, "give a JSONL file of GenEval prompts"), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{path}, line {number}"
        found = entry(parse_json_line(text, where), where)
        found.line = number
        entries.append(found)
    if not entries:
        raise PromptsError(f"{path} holds no GenEval prompts: one JSON line per prompt, e.g. GenEval's "
                           "evaluation_metadata.jsonl or what `grpo-vision prompts geneval --out` writes")
    return entries


def flat(e: PromptEntry) -> dict:
    """GenEval's own line for `e`, the clauses beside the prompt and the prompt last (its
    evaluation_metadata.jsonl's order): what its scorer reads from a folder's metadata.jsonl."""
    return {**{k: v for k, v in e.metadata.items() if k != "prompt"}, "prompt": e.prompt}


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


def training_capacity() -> int:
    """How many distinct prompts the five training templates write outside the evaluation set, counted from
    the templates (what `draw` can write of each task, less the evaluation prompts of that task)."""
    names = classes()
    n, c, o = len(names), len(COLORS), len([x for x in names if x != "person"])  # GenEval never colours a person
    space = {"two_object": n * (n - 1), "counting": 3 * n, "colors": o * c, "position": n * (n - 1) * len(RELATIONS),
             "color_attr": o * (o - 1) * c * (c - 1)}
    tags = [((parse(e.prompt, names) or {}).get("tag"), e.metadata["tag"]) for e in evaluation_entries()]
    return sum(space.values()) - sum(1 for written, tag in tags if written == tag and tag in space)


def training_entries(n: int, seed: int = 0) -> list[PromptEntry]:
    """`n` distinct prompts, the tasks in turn, none of them an evaluation prompt; the same (n, seed)
    gives the same list. Every one of the 80 single-object prompts is an evaluation prompt, so training
    draws the other five tasks."""
    most = training_capacity()
    if n > most:  # refused now: drawing until the templates ran dry took minutes
        raise PromptsError(f"{n} training prompts: GenEval's templates give at most {most} outside the evaluation "
                           "set; ask for at most that many")
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
