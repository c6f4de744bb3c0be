"""The exact ShapesWorld checker: is an image correct for its caption? (docs/shapes_world.md)

1. Objects = 8-connected regions of pixels whose colour is nearest to an object colour and within
   MAX_COLOR_DIST of it (Euclidean, RGB units), ignoring regions under MIN_REGION_PX pixels.
   8-connectivity so that a reconstruction whose edge pixels touch only diagonally stays one
   object; two objects are 2+ px apart, so they never merge.
   Why 30: the closest that heavy background noise (+-40 per channel, clipped to 0..255) can come
   to any object colour is 35.6, gray (88..168)^3 to purple (150,60,190) (sqrt(28^2 + 22^2));
   white and black noise stay > 100 away. So noise never makes object pixels, while the object
   colours are >= 91 apart (red-orange), so a pixel within 30 of one is never ambiguous.
2. Shape from the region's bounding box: fill = area / (w * h) and rel_cy = the mass centre's
   height in the box (0 top, 1 bottom). Exact renders give square fill 1.0; circle 0.78..0.81
   (0.81..0.87 when clipped by <= 25%) with rel_cy 0.45..0.55; triangle 0.50..0.64 with rel_cy
   0.61..0.67 (bottom-heavy). Thresholds sit in the middle of those gaps (see classify_shape).
3. Size from the box side max(w, h) (a one-edge clip keeps the other dimension): small if
   8..20 px, large if 21..36 px (contract 12..16 and 24..30, widened for reconstructions).
   Relation on region box centres by the contract's rule (scene.relation_holds, no margin).
   Background = the background colour nearest to the per-channel median of non-object pixels.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np

from grpo_vision.shapes.scene import BACKGROUNDS, COLORS, parse_caption, relation_holds

ATTRIBUTES = ("count", "color", "shape", "size", "background", "relation")
MAX_COLOR_DIST = 30.0  # RGB Euclidean distance for a pixel to count as an object colour
MIN_REGION_PX = 20  # smaller regions are ignored (contract)
CONNECTIVITY = 8
SIZE_SIDES = {"small": (8, 20), "large": (21, 36)}  # accepted max(w, h) of a region, px, inclusive

_OBJ_NAMES = tuple(COLORS)
_OBJ_RGB = np.array([COLORS[c] for c in _OBJ_NAMES], np.float32)  # [6, 3]
_BG_NAMES = tuple(BACKGROUNDS)
_BG_RGB = np.array([BACKGROUNDS[b] for b in _BG_NAMES], np.float64)  # [3, 3]

_ndimage = ...  # scipy.ndimage once the first check imports it; None without scipy (the flood fill below)


def _scipy_ndimage():
    """scipy's C labeller, ~50x faster than the pure-python flood fill below, imported at the first check: a
    command that loads a world and judges nothing (export) does not pay for scipy's import."""
    global _ndimage
    if _ndimage is ...:
        try:
            from scipy import ndimage as _ndimage
        except ImportError:  # pragma: no cover - exercised by monkeypatching in the tests
            _ndimage = None
    return _ndimage


@dataclass(frozen=True)
class Region:
    color: str  # nearest object colour
    area: int  # px
    box: tuple[int, int, int, int]  # (x0, y0, w, h) of the bounding box, px
    fill: float  # area / (w * h)
    rel_cy: float  # mass centre's height in the box: 0 = top row, 1 = bottom row
    shape: str | None  # classify_shape(fill, rel_cy); None = none of SHAPES

    @property
    def side(self) -> int:
        return max(self.box[2], self.box[3])

    @property
    def centre(self) -> tuple[float, float]:
        x0, y0, w, h = self.box
        return x0 + w / 2, y0 + h / 2


@dataclass
class CheckResult:
    count: bool  # number of regions == number of named objects
    color: bool  # every named object's matched region has its colour
    shape: bool  # ... and its shape
    size: bool | None  # named size holds (None: caption names no size)
    background: bool | None  # named background holds (None: caption names none)
    relation: bool | None  # named relation holds between the matched regions (None: no relation)
    correct: bool  # conjunction of the applicable attributes

    def as_dict(self) -> dict[str, bool | None]:
        return asdict(self)


def classify_shape(fill: float, rel_cy: float) -> str | None:
    """Square fills its box; a circle fills ~pi/4 with its mass centred; a triangle fills ~1/2
    with its mass low (centroid at 2/3 of the height). Anything else is no shape."""
    if fill >= 0.90:
        return "square"
    if 0.70 <= fill and 0.40 <= rel_cy <= 0.60:
        return "circle"
    if 0.35 <= fill < 0.70 and rel_cy >= 0.58:
        return "triangle"
    return None


def size_of(side: int) -> str | None:
    return next((name for name, (lo, hi) in SIZE_SIDES.items() if lo <= side <= hi), None)


def to_uint8_image(image) -> np.ndarray:
    """uint8 [H, W, 3] from uint8 HxWx3, float HxWx3 in [0, 1], or a [3, H, W] tensor/array."""
    if hasattr(image, "detach"):  # a torch tensor; torch is not imported here
        image = image.detach().cpu()
        image = image.numpy() if str(image.dtype) == "torch.uint8" else image.float().numpy()
    a = np.asarray(image)
    if a.ndim == 3 and a.shape[-1] != 3 and a.shape[0] == 3:
        a = a.transpose(1, 2, 0)  # [3, H, W] -> [H, W, 3]
    if a.ndim != 3 or a.shape[-1] != 3:
        raise ValueError(f"expected an RGB image [H, W, 3] or [3, H, W], got shape {a.shape}")
    if a.dtype == np.uint8:
        return a
    return np.clip(np.rint(a.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)


def _label_python(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """8-connected labels [H, W] (0 = off, 1.. in raster order of first pixel), as ndimage.label
    numbers them: the slow, obvious reference for the fast path."""
    h, w = mask.shape
    labels = np.zeros((h, w), np.int32)
    n = 0
    for y, x in zip(*np.nonzero(mask)):
        if labels[y, x]:
            continue
        n += 1
        labels[y, x] = n
        stack = [(y, x)]
        while stack:
            cy, cx = stack.pop()
            for ny in range(max(cy - 1, 0), min(cy + 2, h)):
                for nx in range(max(cx - 1, 0), min(cx + 2, w)):
                    if mask[ny, nx] and not labels[ny, nx]:
                        labels[ny, nx] = n
                        stack.append((ny, nx))
    return labels, n


def label(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """8-connected components of a bool mask: (labels [H, W] int, count)."""
    if (ndimage := _scipy_ndimage()) is not None:
        return ndimage.label(mask, structure=np.ones((3, 3), bool))
    return _label_python(mask)


def object_pixels(img: np.ndarray) -> np.ndarray:
    """int [H, W]: index into COLORS of the nearest object colour, or -1 beyond MAX_COLOR_DIST."""
    p = img.reshape(-1, 3).T.astype(np.float32)  # [3, H*W]
    # |p - c|^2 = |p|^2 - 2 c.p + |c|^2 as one matmul, colours-first so the reductions run over
    # the short axis 0 (~4x faster than broadcasting [H*W, 6, 3]). Exact in float32: every term
    # is an integer below 2^18.
    d2 = (p * p).sum(0) - 2.0 * (_OBJ_RGB @ p) + (_OBJ_RGB**2).sum(1)[:, None]  # [6, H*W]
    nearest = np.where(d2.min(0) <= MAX_COLOR_DIST**2, d2.argmin(0), -1)  # [H*W]
    return nearest.reshape(img.shape[:2])


def find_regions(image) -> list[Region]:
    """The objects in an image: connected same-colour regions of >= MIN_REGION_PX pixels."""
    return _regions(object_pixels(to_uint8_image(image)))


def _regions(cls: np.ndarray) -> list[Region]:
    regions = []
    for k in np.unique(cls[cls >= 0]):
        labels, n = label(cls == k)
        for i in range(1, n + 1):
            ys, xs = np.nonzero(labels == i)
            if len(ys) < MIN_REGION_PX:
                continue
            x0, y0 = int(xs.min()), int(ys.min())
            w, h = int(xs.max()) - x0 + 1, int(ys.max()) - y0 + 1
            fill = len(ys) / (w * h)
            rel_cy = (ys.mean() + 0.5 - y0) / h  # pixel centres, so a full box gives 0.5
            shape = classify_shape(fill, rel_cy)
            regions.append(Region(_OBJ_NAMES[k], len(ys), (x0, y0, w, h), fill, rel_cy, shape))
    return regions


def background_of(image, cls: np.ndarray | None = None) -> str | None:
    """Nearest background colour to the per-channel median of non-object pixels (`cls`:
    object_pixels(image), when the caller has it already)."""
    img = to_uint8_image(image)
    rest = img[(object_pixels(img) if cls is None else cls) < 0]  # [P, 3]
    if len(rest) == 0:
        return None
    med = np.median(rest, axis=0)
    return _BG_NAMES[int(((_BG_RGB - med) ** 2).sum(-1).argmin())]


def _match(spec, regions: list[Region]) -> list[Region | None]:
    """The region for each named object: the injective assignment with most full (colour and
    shape) matches, then most single-attribute matches, then the relation holding; ties go to
    the first in enumeration order. None where there are fewer regions than objects."""
    n = len(spec.objects)
    slots = list(range(len(regions))) + [None] * n  # None = unmatched
    best, best_score = [None] * n, (-1, -1, -1)
    for perm in itertools.permutations(slots, n):  # repeats (from the Nones) are harmless
        cand = [None if i is None else regions[i] for i in perm]
        col = [r is not None and r.color == c for r, (c, _) in zip(cand, spec.objects)]
        shp = [r is not None and r.shape == s for r, (_, s) in zip(cand, spec.objects)]
        rel = spec.relation is not None and None not in cand
        rel = rel and relation_holds(spec.relation, cand[0].centre, cand[1].centre)
        score = (sum(a and b for a, b in zip(col, shp)), sum(col) + sum(shp), int(rel))
        if score > best_score:  # strict: the first best assignment wins, deterministically
            best, best_score = cand, score
    return best


def check(image, caption: str) -> CheckResult:
    """Judge one image against one caption, attribute by attribute (CaptionError if the caption
    is outside the grammar). `image`: uint8 HxWx3, float HxWx3 in [0, 1], or a [3, H, W] tensor."""
    spec = parse_caption(caption)
    img = to_uint8_image(image)
    cls = object_pixels(img)  # [H, W]
    regions = _regions(cls)
    matched = _match(spec, regions)
    color = all(r is not None and r.color == c for r, (c, _) in zip(matched, spec.objects))
    shape = all(r is not None and r.shape == s for r, (_, s) in zip(matched, spec.objects))
    size = None
    if spec.size is not None:
        size = matched[0] is not None and size_of(matched[0].side) == spec.size
    background = None if spec.background is None else background_of(img, cls) == spec.background
    relation = None
    if spec.relation is not None:
        a, b = matched
        found = a is not None and b is not None
        relation = found and relation_holds(spec.relation, a.centre, b.centre)
    count = len(regions) == len(spec.objects)
    values = (count, color, shape, size, background, relation)
    return CheckResult(*values, correct=all(v for v in values if v is not None))
