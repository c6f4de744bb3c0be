"""Scene sampling: a caption spec to a random layout that satisfies it (docs/shapes_world.md, "Aesthetic factors").

Rejection sampling over object positions and sizes, with the aesthetic factors (noise, clipped,
cornered) drawn first, so a scene's flags and its geometry always agree.
"""

from __future__ import annotations

import numpy as np

from grpo_vision.shapes.scene import (
    BACKGROUNDS, COLORS, CORNER_DIST, CaptionSpec, FORMS, IMAGE_SIZE, MAX_CLIP_FRAC, MAX_LAYOUT_TRIES, MIN_CLIP, MIN_GAP, NOISE_LEVELS, NOISE_PROBS, Obj, P_CLIPPED, P_CORNERED, RELATIONS, RELATION_AXIS, RELATION_MARGIN, SHAPES, SIZES, Scene, _in_split, box_centre, boxes_apart, format_caption, is_clipped, is_cornered, mask_box, object_mask, parse_caption, relation_holds,
)


def _pick(rng: np.random.Generator, seq):
    seq = list(seq)
    return seq[int(rng.integers(len(seq)))]


def _sample_spec(rng: np.random.Generator, form: str | None, split: str) -> CaptionSpec:
    """A caption spec, uniform within its form and split (rejection: held-out is 1/6 of pairs)."""
    form = form if form is not None else _pick(rng, FORMS)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    while True:
        n = 2 if form == "relation" else 1
        objs = tuple((_pick(rng, COLORS), _pick(rng, SHAPES)) for _ in range(n))
        spec = CaptionSpec(
            form,
            objs,
            size=_pick(rng, SIZES) if form == "size" else None,
            background=_pick(rng, BACKGROUNDS) if form == "background" else None,
            relation=_pick(rng, RELATIONS) if form == "relation" else None,
        )
        if (n == 1 or objs[0] != objs[1]) and _in_split(spec, split):
            return spec


def _valid_layout(objs: list[Obj], relation: str | None, clipped: bool, cornered: bool) -> bool:
    if is_clipped(objs) != clipped or is_cornered(objs) != cornered:
        return False
    if len(objs) == 2 and not boxes_apart(*objs):
        return False
    if relation is not None:
        nominal = [box_centre(o.x0, o.y0, o.side, o.side) for o in objs]
        visible = [box_centre(*mask_box(object_mask(o))) for o in objs]  # what the checker sees
        for ca, cb in (nominal, visible):
            if not relation_holds(relation, ca, cb, margin=RELATION_MARGIN):
                return False
    return True


def _layout(rng, objs: list[Obj], relation: str | None, clipped: bool, cornered: bool) -> int:
    """Set x0, y0 of `objs` in place by rejection sampling from proposals that already respect
    the relation's order (so two large boxes side by side are found quickly). Returns the number
    of proposals used, 0 when none of MAX_LAYOUT_TRIES fit (some factor combinations cannot:
    two large triangles stacked vertically fill 62 of 64 rows and may only be clipped sideways,
    which always leaves them cornered)."""
    L = IMAGE_SIZE
    for attempt in range(1, MAX_LAYOUT_TRIES + 1):
        pos = [[int(rng.integers(0, L - o.side + 1)) for _ in range(2)] for o in objs]  # [x0, y0]
        if relation is not None:  # first box, gap, second box along the relation axis
            axis, sign = RELATION_AXIS[relation]
            i, j = (0, 1) if sign > 0 else (1, 0)
            si, sj = objs[i].side, objs[j].side
            pos[i][axis] = int(rng.integers(0, L - si - sj - MIN_GAP + 1))
            pos[j][axis] = int(rng.integers(pos[i][axis] + si + MIN_GAP, L - sj + 1))
        if cornered:  # push one object to within 0..CORNER_DIST px of a corner
            k = int(rng.integers(len(objs)))
            for axis in (0, 1):
                g = int(rng.integers(0, CORNER_DIST + 1))
                pos[k][axis] = g if rng.integers(2) else L - objs[k].side - g
        if clipped:  # push one object past one edge by MIN_CLIP .. 25% of its side
            k, axis, end = int(rng.integers(len(objs))), int(rng.integers(2)), int(rng.integers(2))
            if objs[k].shape == "triangle" and axis == 1:
                continue  # a cut apex makes a trapezoid, a cut base shrinks the measured size
            c = int(rng.integers(MIN_CLIP, int(MAX_CLIP_FRAC * objs[k].side) + 1))
            pos[k][axis] = -c if end == 0 else L - objs[k].side + c
        for o, (x0, y0) in zip(objs, pos):
            o.x0, o.y0 = x0, y0
        if _valid_layout(objs, relation, clipped, cornered):
            return attempt
    return 0


def _scene_for_spec(spec: CaptionSpec, rng: np.random.Generator, aesthetic: bool) -> Scene:
    """A random scene satisfying every attribute the spec names; the rest sampled uniformly."""
    background = spec.background or _pick(rng, BACKGROUNDS)
    objs = []
    for color, shape in spec.objects:
        size = spec.size or _pick(rng, SIZES)
        lo, hi = SIZES[size]
        objs.append(Obj(color, shape, size, 0, 0, int(rng.integers(lo, hi + 1))))
    noise, clipped, cornered = "none", False, False
    if aesthetic:
        noise = NOISE_LEVELS[int(rng.choice(len(NOISE_LEVELS), p=NOISE_PROBS))]
        clipped = bool(rng.random() < P_CLIPPED)
        cornered = bool(rng.random() < P_CORNERED)
    noise_seed = int(rng.integers(2**31))
    # The factors are decorations: when a combination does not fit, drop clipping, then cornering.
    fallbacks = dict.fromkeys([(clipped, cornered), (False, cornered), (False, False)])
    for clipped, cornered in fallbacks:
        if _layout(rng, objs, spec.relation, clipped, cornered):
            break
    else:
        raise RuntimeError(f"no clean layout for {spec}")  # unreachable: clean layouts always fit
    return Scene(background, objs, spec.relation, noise, clipped, cornered, noise_seed)


def sample_scene(
    rng: np.random.Generator, form: str | None = None, split: str = "train", aesthetic: bool = True
) -> tuple[Scene, str]:
    """A random (scene, caption): form uniform over FORMS unless given, attributes uniform within
    the split, aesthetic factors sampled when `aesthetic` (else a clean scene)."""
    spec = _sample_spec(rng, form, split)
    return _scene_for_spec(spec, rng, aesthetic), format_caption(spec)


def scene_for_caption(caption: str, rng: np.random.Generator, aesthetic: bool = False) -> Scene:
    """A random scene that satisfies `caption` (ground truth for a prompts file)."""
    return _scene_for_spec(parse_caption(caption), rng, aesthetic)
