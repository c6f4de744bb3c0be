"""ShapesWorld v1 scenes: palette, captions, sampling, splits and the exact renderer.

Everything here follows the contract in `docs/shapes_world.md` (64 x 64 images, 3 backgrounds,
6 object colours, 3 shapes, 2 sizes, 4 relations, 4 caption forms). A scene is plain data
(`Scene`), and `render` is a pure function of it, so a seed fixes caption, geometry and pixels.

Geometry conventions: a box is `(x0, y0, side)` in pixels, x to the right, y downwards; the box
covers pixel columns x0 .. x0+side-1. Shapes are filled masks over pixel centres `(x+0.5, y+0.5)`:
square = the box, circle = centres within the inscribed circle, triangle = isosceles with the apex
at the top centre of the box and the base on the box's bottom row.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from grpo_vision.config import ConfigError, brief

IMAGE_SIZE = 64  # H = W, pixels
BACKGROUNDS = {"white": (240, 240, 240), "black": (30, 30, 30), "gray": (128, 128, 128)}
COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 90, 220),
    "yellow": (235, 200, 40),
    "purple": (150, 60, 190),
    "orange": (240, 130, 30),
}
SHAPES = ("circle", "square", "triangle")
SIZES = {"small": (12, 16), "large": (24, 30)}  # inclusive range of the box side, px
RELATIONS = ("left of", "right of", "above", "below")
FORMS = ("plain", "size", "background", "relation")  # the contract's four caption forms, in order
SPLITS = ("train", "heldout", "all")

# Relation rule as data: (axis, sign) with axis 0 = x, 1 = y; "A rel B" holds when
# along = sign * (c_B - c_A)[axis] >= 8 and |c_B - c_A|[other axis] < along (the contract's rule).
RELATION_AXIS = {"left of": (0, 1), "right of": (0, -1), "above": (1, 1), "below": (1, -1)}
RELATION_MIN_DIST = 8  # px between box centres along the relation axis (contract)
RELATION_MARGIN = 2  # px of slack the sampler adds on both inequalities, so reconstructions keep it
MIN_GAP = 2  # px of empty space between two boxes (contract)
CORNER_DIST = 2  # a box within this many px of two perpendicular edges is "cornered"
MAX_CLIP_FRAC = 0.25  # a clipped object loses at most this fraction of its box side
MIN_CLIP = 2  # px; a clipped object loses at least this much, so the factor is visible
MAX_LAYOUT_TRIES = 2000  # rejection-sampling proposals before giving up on a factor combination

# Aesthetic factors and their sampling probabilities (when aesthetic=True).
NOISE_LEVELS = ("none", "light", "heavy")
NOISE_AMPLITUDE = {"none": 0, "light": 12, "heavy": 40}  # uniform integer noise +-A per channel
NOISE_PROBS = (0.5, 0.3, 0.2)
P_CLIPPED = 0.15
P_CORNERED = 0.15

# (color, shape) pairs never named in training captions, in any form. One per shape and with
# three different colours, so every colour and every shape still appears in training.
HELD_OUT = frozenset({("blue", "triangle"), ("yellow", "circle"), ("purple", "square")})


class CaptionError(ConfigError):
    """A caption outside the ShapesWorld grammar (a ConfigError: the CLI prints it as one line)."""


@dataclass
class Obj:
    color: str  # key of COLORS
    shape: str  # one of SHAPES
    size: str  # key of SIZES
    x0: int  # box left, px (negative only when clipped)
    y0: int  # box top, px
    side: int  # box side, px, within SIZES[size]


@dataclass
class Scene:
    background: str  # key of BACKGROUNDS
    objects: list[Obj]  # 1 or 2 objects
    relation: str | None = None  # objects[0] <relation> objects[1], or None
    noise: str = "none"  # one of NOISE_LEVELS, background pixels only
    clipped: bool = False  # an object extends past the canvas edge (see is_clipped)
    cornered: bool = False  # an object is pushed into a corner (see is_cornered)
    noise_seed: int = 0  # seeds the background noise, so render(scene) is pure


@dataclass(frozen=True)
class CaptionSpec:
    form: str  # one of FORMS
    objects: tuple[tuple[str, str], ...]  # (color, shape) per named object, 1 or 2
    size: str | None = None  # "size" form only
    background: str | None = None  # "background" form only
    relation: str | None = None  # "relation" form only: objects[0] <relation> objects[1]


# ---------------------------------------------------------------- captions

_C, _S, _Z = "|".join(COLORS), "|".join(SHAPES), "|".join(SIZES)
_B, _R = "|".join(BACKGROUNDS), "|".join(RELATIONS)
_PATTERNS = {
    "plain": re.compile(rf"a ({_C}) ({_S})"),
    "size": re.compile(rf"a ({_Z}) ({_C}) ({_S})"),
    "background": re.compile(rf"a ({_C}) ({_S}) on a ({_B}) background"),
    "relation": re.compile(rf"a ({_C}) ({_S}) ({_R}) a ({_C}) ({_S})"),
}
GRAMMAR = (
    "captions are lower case words separated by single spaces, one of: "
    "'a {color} {shape}' | 'a {size} {color} {shape}' | "
    "'a {color} {shape} on a {background} background' | "
    "'a {color} {shape} {relation} a {color} {shape}' (the two objects differ in colour or shape), "
    f"with color in {list(COLORS)}, shape in {list(SHAPES)}, size in {list(SIZES)}, "
    f"background in {list(BACKGROUNDS)}, relation in {list(RELATIONS)}"
)


@lru_cache(maxsize=4096)
def parse_caption(text: str) -> CaptionSpec:
    """Parse a caption of the contract's grammar; CaptionError (quoting it) otherwise."""
    match = {f: p.fullmatch(text) for f, p in _PATTERNS.items() if isinstance(text, str)}
    form = next((f for f, m in match.items() if m), None)
    if form is None:
        raise CaptionError(f"caption {brief(text)} is outside the ShapesWorld grammar: {GRAMMAR}")
    g = match[form].groups()
    if form == "plain":
        return CaptionSpec(form, ((g[0], g[1]),))
    if form == "size":
        return CaptionSpec(form, ((g[1], g[2]),), size=g[0])
    if form == "background":
        return CaptionSpec(form, ((g[0], g[1]),), background=g[2])
    a, b = (g[0], g[1]), (g[3], g[4])
    if a == b:
        raise CaptionError(
            f"caption {brief(text)} names two identical objects (same colour and shape); {GRAMMAR}"
        )
    return CaptionSpec(form, (a, b), relation=g[2])


def as_policy_reads(text: str) -> str:
    """`text` in lower case with single spaces, as the built-in policy and CLIP read a prompt. The
    grammar itself is strict (the contract's captions are lower case with single spaces); the
    rewards and the eval use this so that "A red  circle" is scored as the caption it was drawn for."""
    return " ".join(text.lower().split())


def format_caption(spec: CaptionSpec) -> str:
    """The caption of `spec` (inverse of parse_caption); CaptionError if spec is malformed."""
    (c, s), rest = spec.objects[0], spec.objects[1:]
    text = {
        "plain": f"a {c} {s}",
        "size": f"a {spec.size} {c} {s}",
        "background": f"a {c} {s} on a {spec.background} background",
        "relation": f"a {c} {s} {spec.relation} a " + " ".join(rest[0] if rest else ("?", "?")),
    }.get(spec.form, repr(spec))
    if parse_caption(text) != spec:  # e.g. a size on a plain spec: refuse rather than drop it
        raise CaptionError(f"spec {spec!r} gives caption {text!r}, which parses differently")
    return text


def is_held_out(caption_or_spec: str | CaptionSpec) -> bool:
    """True when the caption names a (color, shape) pair of HELD_OUT."""
    spec = caption_or_spec
    if isinstance(spec, str):
        spec = parse_caption(spec)
    return any(obj in HELD_OUT for obj in spec.objects)


def _in_split(spec: CaptionSpec, split: str) -> bool:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split == "all" or is_held_out(spec) == (split == "heldout")


def all_words() -> list[str]:
    """Every word any caption can contain, in a fixed order (the policy's word vocabulary)."""
    words = ["a", *SIZES, *COLORS, *SHAPES, "on", *BACKGROUNDS, "background"]
    for rel in RELATIONS:
        words += [w for w in rel.split() if w not in words]
    return words


@lru_cache(maxsize=None)
def _all_specs(form: str, split: str) -> tuple[CaptionSpec, ...]:
    """Every caption spec of one form in one split, in a fixed order."""
    objs = list(itertools.product(COLORS, SHAPES))
    specs: list[CaptionSpec] = {
        "plain": [CaptionSpec(form, (o,)) for o in objs],
        "size": [CaptionSpec(form, (o,), size=z) for z in SIZES for o in objs],
        "background": [CaptionSpec(form, (o,), background=b) for b in BACKGROUNDS for o in objs],
        "relation": [
            CaptionSpec(form, (a, b), relation=r)
            for r in RELATIONS
            for a in objs
            for b in objs
            if a != b
        ],
    }[form]
    return tuple(s for s in specs if _in_split(s, split))


def all_captions(split: str, form: str | None = None) -> list[str]:
    """Every caption of `split` ("train", "heldout" or "all"), of one form or of all four, in a fixed order."""
    return [format_caption(spec) for f in ((form,) if form else FORMS) for spec in _all_specs(f, split)]


def prompt_list(split: str, n: int, seed: int) -> list[str]:
    """n captions of `split`, round-robin over the four forms, without repeats until a form's
    pool is used up (the held-out plain form has only 3 captions). Deterministic in seed."""
    rng = np.random.default_rng(seed)
    queues: dict[str, list[CaptionSpec]] = {f: [] for f in FORMS}
    out = []
    for i in range(n):
        form = FORMS[i % len(FORMS)]
        if not queues[form]:
            pool = _all_specs(form, split)
            queues[form] = [pool[j] for j in rng.permutation(len(pool))]
        out.append(format_caption(queues[form].pop()))
    return out


# ---------------------------------------------------------------- geometry predicates


def object_mask(obj: Obj, size: int = IMAGE_SIZE) -> np.ndarray:
    """Bool [size, size]: the filled shape, cut to the canvas."""
    ys, xs = np.mgrid[0:size, 0:size]
    in_box = (xs >= obj.x0) & (xs < obj.x0 + obj.side) & (ys >= obj.y0) & (ys < obj.y0 + obj.side)
    xc = xs + 0.5 - (obj.x0 + obj.side / 2)  # pixel centre x relative to the box's centre
    yc = ys + 0.5 - obj.y0  # pixel centre y relative to the box's top
    if obj.shape == "square":
        return in_box
    if obj.shape == "circle":
        r = obj.side / 2
        return in_box & (xc**2 + (yc - r) ** 2 <= r**2)
    if obj.shape == "triangle":
        # half-width grows linearly from 0 at the apex (top) to side/2 at the base (bottom)
        return in_box & (np.abs(xc) <= yc / 2)
    raise ValueError(f"unknown shape {obj.shape!r}")


def mask_box(mask: np.ndarray) -> tuple[int, int, int, int]:
    """(x0, y0, w, h) of the True pixels' bounding box (what the checker measures)."""
    ys, xs = np.nonzero(mask)
    return int(xs.min()), int(ys.min()), int(xs.max() - xs.min() + 1), int(ys.max() - ys.min() + 1)


def box_centre(x0: float, y0: float, w: float, h: float) -> tuple[float, float]:
    return x0 + w / 2, y0 + h / 2


def relation_holds(relation: str, ca, cb, margin: float = 0.0) -> bool:
    """The contract's rule for `A relation B` on box centres ca, cb = (cx, cy); margin > 0 asks
    for that much slack on both inequalities."""
    axis, sign = RELATION_AXIS[relation]
    along = sign * (cb[axis] - ca[axis])
    across = abs(cb[1 - axis] - ca[1 - axis])
    return along >= RELATION_MIN_DIST + margin and across + margin < along


def _edge_gaps(o: Obj) -> tuple[int, int, int, int]:
    """px from the box to the left, right, top, bottom canvas edges (negative = past the edge)."""
    return o.x0, IMAGE_SIZE - o.x0 - o.side, o.y0, IMAGE_SIZE - o.y0 - o.side


def is_clipped(objects: list[Obj]) -> bool:
    """Some object's box extends past a canvas edge."""
    return any(min(_edge_gaps(o)) < 0 for o in objects)


def is_cornered(objects: list[Obj]) -> bool:
    """Some object's box lies within CORNER_DIST px of two perpendicular canvas edges, i.e.
    min(left, right gap) <= 2 and min(top, bottom gap) <= 2 (gaps negative when clipped)."""
    gaps = [_edge_gaps(o) for o in objects]  # (left, right, top, bottom) per object
    return any(min(l, r) <= CORNER_DIST and min(t, b) <= CORNER_DIST for l, r, t, b in gaps)


def boxes_apart(a: Obj, b: Obj, gap: int = MIN_GAP) -> bool:
    """The boxes are separated by at least `gap` empty px along x or along y."""
    return (
        a.x0 + a.side + gap <= b.x0
        or b.x0 + b.side + gap <= a.x0
        or a.y0 + a.side + gap <= b.y0
        or b.y0 + b.side + gap <= a.y0
    )


# ---------------------------------------------------------------- rendering and aesthetics


def render(scene: Scene) -> np.ndarray:
    """uint8 [64, 64, 3]: background (+ its noise), then the filled objects in exact palette RGB."""
    img = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), np.int16)
    img[:] = BACKGROUNDS[scene.background]
    amp = NOISE_AMPLITUDE[scene.noise]
    if amp:
        noise = np.random.default_rng(scene.noise_seed).integers(-amp, amp + 1, img.shape)
        img = np.clip(img + noise, 0, 255)
    for obj in scene.objects:
        img[object_mask(obj)] = COLORS[obj.color]
    return img.astype(np.uint8)


AESTHETIC_BASE = 9.0
AESTHETIC_NOISE_PENALTY = {"none": 0.0, "light": 2.5, "heavy": 5.0}
AESTHETIC_CLIPPED_PENALTY = 2.0
AESTHETIC_CORNERED_PENALTY = 1.5


def aesthetic_label(scene: Scene) -> float:
    """Aesthetic score on 0..10, a fixed function of the factors:

        9 - {none: 0, light: 2.5, heavy: 5}[noise] - 2 * clipped - 1.5 * cornered,
        clamped to [0, 10]

    so a clean scene scores 9.0 and the worst (heavy, clipped, cornered) 0.5. `clipped` and
    `cornered` are the geometric predicates is_clipped / is_cornered of the objects, which the
    sampler keeps equal to the scene's flags.
    """
    score = AESTHETIC_BASE - AESTHETIC_NOISE_PENALTY[scene.noise]
    score -= AESTHETIC_CLIPPED_PENALTY * scene.clipped + AESTHETIC_CORNERED_PENALTY * scene.cornered
    return float(min(10.0, max(0.0, score)))

