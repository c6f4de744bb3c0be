"""Caption truth and hard negatives for the world's CLIP: which captions hold of a scene, and the
one-attribute edits of a caption that the contrastive loss pushes away (NegCLIP-style)."""

from __future__ import annotations

import numpy as np

from grpo_vision.shapes.scene import BACKGROUNDS, COLORS, SHAPES, SIZES, CaptionError, CaptionSpec, Scene, format_caption, parse_caption

OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
ATTRIBUTES = ("color", "shape", "size", "background", "relation")  # what a hard negative changes
_OBJ_ID = {(c, s): i for i, (c, s) in enumerate((c, s) for c in COLORS for s in SHAPES)}
_REL_ID = {"left of": 0, "right of": 1, "above": 2, "below": 3}  # opposite = id ^ 1
_SIZE_ID, _BG_ID = {z: i for i, z in enumerate(SIZES)}, {b: i for i, b in enumerate(BACKGROUNDS)}


def caption_holds(scene: Scene, caption: str | CaptionSpec) -> bool:
    """Exact truth of a caption for a sampled scene, from the scene's data (no pixels): the
    number of objects, their colour and shape, and the named size, background and relation.
    "A left of B" also holds as "B right of A"; the four relations exclude each other."""
    spec = parse_caption(caption) if isinstance(caption, str) else caption
    objs = [(o.color, o.shape) for o in scene.objects]
    if len(objs) != len(spec.objects):
        return False
    if spec.form == "relation":
        fwd = (spec.objects[0], spec.objects[1], spec.relation)
        return fwd in {(objs[0], objs[1], scene.relation), (objs[1], objs[0], OPPOSITE[scene.relation])}
    return (
        objs[0] == spec.objects[0]
        and spec.size in (None, scene.objects[0].size)
        and spec.background in (None, scene.background)
    )


def _replace_obj(spec: CaptionSpec, i: int, color: str | None = None,
                 shape: str | None = None) -> CaptionSpec:
    objs = list(spec.objects)
    objs[i] = (color or objs[i][0], shape or objs[i][1])
    return CaptionSpec(spec.form, tuple(objs), spec.size, spec.background, spec.relation)


def hard_negatives(caption: str, perpendicular: bool = False) -> dict[str, list[str]]:
    """Captions that change exactly one attribute the caption names, by attribute:
    color / shape of each named object, size, background, and for relation captions the opposite
    relation and the two objects swapped ("a red circle left of a blue square" -> "a blue square
    left of a red circle"). Never "B right of A", which says the same as "A left of B". Captions
    the grammar forbids (two identical objects) are skipped. Each is false for every scene the
    caption is true of. `perpendicular` adds the two relations at right angles to the named one
    ("left of" -> "above", "below") to "relation"; those are false too (the contract's four
    relations exclude each other) but easier, so evaluate_clip leaves them out."""
    spec = parse_caption(caption)
    out: dict[str, list[CaptionSpec]] = {a: [] for a in ATTRIBUTES}
    for i, (c, s) in enumerate(spec.objects):
        out["color"] += [_replace_obj(spec, i, color=c2) for c2 in COLORS if c2 != c]
        out["shape"] += [_replace_obj(spec, i, shape=s2) for s2 in SHAPES if s2 != s]
    if spec.size is not None:
        out["size"] = [CaptionSpec(spec.form, spec.objects, size=z) for z in SIZES if z != spec.size]
    if spec.background is not None:
        out["background"] = [CaptionSpec(spec.form, spec.objects, background=b) for b in BACKGROUNDS
                             if b != spec.background]
    if spec.relation is not None:
        a, b = spec.objects
        out["relation"] = [CaptionSpec(spec.form, (a, b), relation=OPPOSITE[spec.relation]),
                           CaptionSpec(spec.form, (b, a), relation=spec.relation)]
        if perpendicular:
            out["relation"] += [CaptionSpec(spec.form, (a, b), relation=r) for r in _REL_ID
                                if r not in (spec.relation, OPPOSITE[spec.relation])]
    texts = {}
    for attr, specs in out.items():
        texts[attr] = []
        for sp in specs:
            try:
                texts[attr].append(format_caption(sp))
            except CaptionError:  # two identical objects: not a caption
                pass
    return texts


def _codes(objs, size, background, relation) -> list[int]:
    """[n_objects, obj0, obj1, size, background, relation] as ints, -1 where absent."""
    ids = [_OBJ_ID[o] for o in objs] + [-1] * (2 - len(objs))
    return [len(objs), *ids, _SIZE_ID.get(size, -1), _BG_ID.get(background, -1), _REL_ID.get(relation, -1)]


def holds_matrix(scenes: list[Scene], captions: list[str]) -> np.ndarray:
    """bool `[len(scenes), len(captions)]`: caption_holds for every pair, vectorised (the slow
    reference is caption_holds; tests compare the two)."""
    s = np.array([_codes([(o.color, o.shape) for o in sc.objects], sc.objects[0].size, sc.background,
                         sc.relation) for sc in scenes])[:, None, :]  # [S, 1, 6]
    specs = [parse_caption(c) for c in captions]
    t = np.array([_codes(sp.objects, sp.size, sp.background, sp.relation) for sp in specs])[None]  # [1, T, 6]
    n, o0, o1, size, bg, rel = (t[..., k] for k in range(6))  # each [1, T]
    sn, so0, so1, ssize, sbg, srel = (s[..., k] for k in range(6))  # each [S, 1]
    one = (n == 1) & (sn == 1) & (o0 == so0) & ((size < 0) | (size == ssize)) & ((bg < 0) | (bg == sbg))
    fwd = (o0 == so0) & (o1 == so1) & (rel == srel)
    rev = (o0 == so1) & (o1 == so0) & (rel == (srel ^ 1))
    two = (n == 2) & (sn == 2) & (fwd | rev)
    return one | two
