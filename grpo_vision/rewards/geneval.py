"""GenEval's rules over an object detector's output (Ghosh et al., "GenEval", NeurIPS 2023 D&B).

Written from the paper and from the scorer in djghosh13/geneval (`evaluation/evaluate_images.py`,
MIT); not its code. A prompt's requirements come from its metadata in GenEval's format:

    {"tag": "position", "prompt": "a photo of a dog right of a teddy bear",
     "include": [{"class": "teddy bear", "count": 1},
                 {"class": "dog", "count": 1, "position": ["right of", 0]}],
     "exclude": [{"class": "dog", "count": 2}]}        # optional: "at most 1 dog"

The rules, as the scorer applies them:

* **Which detections count** (`kept`): a class's boxes whose confidence is strictly above the threshold
  (0.3; 0.9 for `counting` prompts), the most confident first, at most 16 a class, then a greedy
  non-maximum suppression at IoU `max_overlap` (1.0 = off, GenEval's default).
* **include** clauses hold together (AND): the clause's class has at least `count` kept boxes; with a
  `color`, at least `count` of its `count` most confident boxes are that colour (a CLIP zero-shot
  classifier on the masked crop, in GenEval: `colours` here); with a `position` `[relation, i]`, every
  one of those boxes stands in `relation` to every box that include clause `i` matched, and clause `i`
  must have matched.
* **exclude** clauses: any one fails the image (OR) when its class has at least `count` kept boxes.
* **Position** (`relations`): from box centres, each axis's offset shrunk by `position_threshold`
  (0.1) times the two boxes' summed extent on it; no relation when both shrunk offsets vanish; else
  "left of" / "right of" / "above" / "below" where the shrunk offset, over the length of the raw
  one, passes 0.5 on that axis (image coordinates: y grows downwards).

`partial` credit (not in GenEval) is the fraction of clauses met, so that a group whose images all
fail still has a spread to learn from. docs/real_models.md records the agreement of these rules with
GenEval's own functions on random detections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
# what a failing clause got wrong, for the report's and the demo's summaries (not GenEval's: its reasons
# are the free-text lines below, kept as it writes them): a missing object, a wrong count (too few in a
# counting prompt, or too many: its exclude clause), a wrong colour, a wrong or untestable relation
FAILURES = ("object", "count", "colour", "position")

Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels


@dataclass
class Detection:
    box: Box
    score: float  # the detector's confidence for this class
    mask: object = None  # [H, W] bool, where the detector gives one (the colour check crops with it)


@dataclass(frozen=True)
class GenEvalRules:
    """GenEval's thresholds (its `--options`), its values as the defaults."""
    threshold: float = 0.3  # a detection counts above this confidence
    counting_threshold: float = 0.9  # ... and above this one for a `counting` prompt
    max_objects: int = 16  # the most confident boxes a class keeps
    max_overlap: float = 1.0  # NMS IoU: a box overlapping a kept one this much is dropped; 1.0 = off
    position_threshold: float = 0.1  # the margin of a relation, in units of the two boxes' extents


@dataclass
class Verdict:
    correct: bool  # every clause met: GenEval's 1 / 0
    met: int  # clauses met (include and exclude)
    clauses: int  # clauses in the prompt's metadata
    reasons: list[str] = field(default_factory=list)  # why each failing clause failed, as GenEval words it
    failures: list[str] = field(default_factory=list)  # the kind of each failing clause (FAILURES), reasons' order

    @property
    def partial(self) -> float:
        """The fraction of clauses met (1.0 for a prompt without clauses)."""
        return self.met / self.clauses if self.clauses else 1.0


def iou(a: Box, b: Box) -> float:
    """Intersection over union with inclusive pixel bounds (a box 0..9 is 10 pixels wide), as the scorer."""
    def area(x0, y0, x1, y1):
        return max(x1 - x0 + 1, 0) * max(y1 - y0 + 1, 0)
    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a) + area(*b) - inter
    return inter / union if union else 0.0


def kept(detections: dict[str, Sequence[Detection]], tag: str, rules: GenEvalRules = GenEvalRules()
         ) -> dict[str, list[Detection]]:
    """The detections the rules read: per class, above the prompt's threshold, most confident first,
    at most `max_objects`, then non-maximum suppression. Classes left with none are absent."""
    limit = rules.counting_threshold if tag == "counting" else rules.threshold
    out = {}
    for name, found in detections.items():
        ranked = sorted((d for d in found if d.score > limit), key=lambda d: -d.score)[:rules.max_objects]
        chosen: list[Detection] = []
        for d in ranked:  # greedy: a box survives unless it overlaps a more confident survivor too much
            if rules.max_overlap >= 1 or all(iou(k.box, d.box) < rules.max_overlap for k in chosen):
                chosen.append(d)
        if chosen:
            out[name] = chosen
    return out


def relations(a: Box, b: Box, margin: float = 0.1) -> set[str]:
    """Where box `a` stands relative to box `b`: a subset of RELATIONS (empty when neither axis's
    offset clears the margin)."""
    offset = [(a[0] + a[2]) / 2 - (b[0] + b[2]) / 2, (a[1] + a[3]) / 2 - (b[1] + b[3]) / 2]  # centres, x and y
    extent = [abs(a[2] - a[0]) + abs(b[2] - b[0]), abs(a[3] - a[1]) + abs(b[3] - b[1])]
    shrunk = [math.copysign(max(abs(o) - margin * e, 0.0), o) for o, e in zip(offset, extent)]
    if all(abs(s) < 1e-3 for s in shrunk):
        return set()
    dx, dy = (s / math.hypot(*offset) for s in shrunk)
    return {name for name, holds in (("left of", dx < -0.5), ("right of", dx > 0.5), ("above", dy < -0.5),
                                     ("below", dy > 0.5)) if holds}


def judge(found: dict[str, list[Detection]], metadata: dict,
          colours: Callable[[str, list[Detection]], list[str]] | None = None,
          rules: GenEvalRules = GenEvalRules()) -> Verdict:
    """GenEval's verdict on one image from its kept detections (`kept`). `colours(class, detections)`
    names each detection's colour (one of COLORS); it is called only for a colour clause whose class
    was found often enough."""
    includes, excludes = metadata.get("include", []), metadata.get("exclude", [])
    reasons, failures, met, groups = [], [], 0, []  # groups[i]: the boxes include clause i matched, None if failed
    for req in includes:
        name, count = req["class"], req["count"]
        boxes = found.get(name, [])[:count]
        problem, kind = None, None  # kind: FAILURES' name for what this clause got wrong
        if len(boxes) < count:
            problem = f"expected {name}>={count}, found {len(boxes)}"
            kind = "count" if metadata.get("tag") == "counting" and boxes else "object"  # some, not enough
        elif "color" in req:
            if colours is None:
                raise ValueError(f"the prompt asks for a {req['color']} {name}: judge needs a colour classifier")
            named = colours(name, boxes)
            if named.count(req["color"]) < count:
                seen = ", ".join(f"{named.count(c)} {c}" for c in COLORS if c in named)
                problem = f"expected {req['color']} {name}>={count}, found {named.count(req['color'])} ({seen})"
                kind = "colour"
        if problem is None and "position" in req:
            relation, target = req["position"]
            kind = "position"
            if groups[target] is None:
                problem = f"no target for {name} to be {relation}"
            else:
                for box in boxes:
                    wrong = next((rels for t in groups[target]
                                  if relation not in (rels := relations(box.box, t.box, rules.position_threshold))),
                                 None)
                    if wrong is not None:
                        found_rel = " and ".join(sorted(wrong)) or "no relation"
                        problem = f"expected {name} {relation} target, found {found_rel}"
                        break
        groups.append(None if problem else boxes)
        met += problem is None
        if problem:
            reasons.append(problem)
            failures.append(kind)
    for req in excludes:
        name, count = req["class"], req["count"]
        if len(found.get(name, [])) >= count:
            reasons.append(f"expected {name}<{count}, found {len(found[name])}")
            failures.append("count")
        else:
            met += 1
    total = len(includes) + len(excludes)
    return Verdict(met == total, met, total, reasons, failures)


def check_metadata(metadata: dict, where: str) -> None:
    """Refuse metadata the rules cannot read, naming the entry and the field (one line)."""
    if not isinstance(metadata, dict) or metadata.get("tag") not in TAGS or not metadata.get("include"):
        raise ValueError(f"{where}: GenEval metadata needs a 'tag' (one of {', '.join(TAGS)}) and an 'include' "
                         "list, as in GenEval's evaluation_metadata.jsonl")
    for i, req in enumerate([*metadata["include"], *metadata.get("exclude", [])]):
        if not isinstance(req, dict) or not isinstance(req.get("class"), str) or not isinstance(req.get("count"), int):
            raise ValueError(f"{where}: clause {i} needs a 'class' (text) and a 'count' (a whole number)")
        if "color" in req and req["color"] not in COLORS:
            raise ValueError(f"{where}: colour {req['color']!r} is not one of GenEval's: {', '.join(COLORS)}")
    for i, req in enumerate(metadata["include"]):
        if "position" in req:
            relation, target = req["position"]
            if relation not in RELATIONS or not (isinstance(target, int) and 0 <= target < i):
                raise ValueError(f"{where}: include clause {i}'s position must be [relation, j] with a relation of "
                                 f"{', '.join(RELATIONS)} and j an earlier include clause")
