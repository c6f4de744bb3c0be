"""Layout plans: the text a planning base policy writes before it draws (T2I-R1's two stages, arXiv 2505.00703),
and their exact check against the caption (docs/shapes_world.md, "Plans").

A plan lists each object of the scene in caption order, five words each, then the background:

    {color} {shape} {size} x{col} y{row}  [{color} {shape} {size} x{col} y{row}]  {background}

`x{col} y{row}` is the cell of the object's visible box centre (what the checker measures) on a PLAN_GRID x
PLAN_GRID grid of CELL-px cells. Plans are written for the whole scene, sizes and background included, whatever
the caption names: the plan is a layout, the caption a description.

Why 16 x 16 cells of 4 px: the check reads a relation from the two cells (`cells_hold`: the contract's rule on the
cells' centres with one cell of slack on both inequalities). On 20,000 relation scenes of the training
distribution (aesthetic factors included) the ground-truth cells read their caption's relation in 99.995% of
scenes on 16 x 16 cells, 99.7% on 8 x 8, 99.0% on 4 x 4, and accept a second relation besides the true one (a
pair on the diagonal) in 1.5%, 6.0% and 18% of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_vision.shapes.scene import (BACKGROUNDS, COLORS, IMAGE_SIZE, SHAPES, SIZES, Scene, box_centre, mask_box,
                                      object_mask, parse_caption, relation_holds)

PLAN_GRID = 16  # cells per axis
CELL = IMAGE_SIZE // PLAN_GRID  # px per cell side
WORDS_PER_OBJECT = 5  # color, shape, size, column, row
MAX_OBJECTS = 2  # a caption names 1 or 2 objects
MAX_PLAN_TOKENS = MAX_OBJECTS * WORDS_PER_OBJECT + 1  # the background last; the end token is not counted
COLUMNS = tuple(f"x{i}" for i in range(PLAN_GRID))
ROWS = tuple(f"y{i}" for i in range(PLAN_GRID))
PLAN_GRAMMAR = ("a plan is '{color} {shape} {size} x{col} y{row}' per object, 1 or 2 objects in caption order, "
                f"then '{{background}}', with col and row in 0..{PLAN_GRID - 1}")


@dataclass(frozen=True)
class PlanObject:
    color: str  # key of COLORS
    shape: str  # one of SHAPES
    size: str  # key of SIZES
    cell: tuple[int, int]  # (column, row) of the visible box centre, each in 0..PLAN_GRID-1


@dataclass(frozen=True)
class PlanSpec:
    objects: tuple[PlanObject, ...]  # 1 or 2, in caption order
    background: str  # key of BACKGROUNDS


def plan_words() -> list[str]:
    """Every word a plan can contain, in a fixed order (the planning policy's plan vocabulary)."""
    return [*COLORS, *SHAPES, *SIZES, *COLUMNS, *ROWS, *BACKGROUNDS]


def canvas_config() -> dict:
    """The layout canvas (models/llama.py, LlamaPolicyConfig.canvas_*) of a policy that draws its plan onto the token
    grid: each object's colour, shape and size painted over the box the plan asks for (rewards.planned_box: the
    size's middle side, centred on the object's cell)."""
    return {"canvas_attributes": [*COLORS, *SHAPES, *SIZES], "canvas_columns": list(COLUMNS),
            "canvas_rows": list(ROWS), "canvas_extents": {size: sum(px) / 2 / CELL for size, px in SIZES.items()}}


def cell_of(x: float, y: float) -> tuple[int, int]:
    """(column, row) of the cell holding point (x, y) px, clamped to the grid."""
    return tuple(min(PLAN_GRID - 1, max(0, int(v // CELL))) for v in (x, y))


def scene_plan(scene: Scene) -> list[str]:
    """The plan of a scene's ground truth: its objects in order (the caption's), then its background."""
    words = []
    for obj in scene.objects:
        col, row = cell_of(*box_centre(*mask_box(object_mask(obj))))
        words += [obj.color, obj.shape, obj.size, COLUMNS[col], ROWS[row]]
    return words + [scene.background]


def format_plan(spec: PlanSpec) -> str:
    """The text of `spec` (inverse of parse_plan)."""
    words = [w for o in spec.objects for w in (o.color, o.shape, o.size, COLUMNS[o.cell[0]], ROWS[o.cell[1]])]
    return " ".join([*words, spec.background])


def parse_plan(text: str) -> PlanSpec | None:
    """The plan `text` as a PlanSpec, or None when it is outside the plan grammar (PLAN_GRAMMAR)."""
    words = text.split() if isinstance(text, str) else []
    body, n = words[:-1], (len(words) - 1) // WORDS_PER_OBJECT
    if not words or len(body) != n * WORDS_PER_OBJECT or not 1 <= n <= MAX_OBJECTS or words[-1] not in BACKGROUNDS:
        return None
    objects = []
    for i in range(0, len(body), WORDS_PER_OBJECT):
        color, shape, size, col, row = body[i:i + WORDS_PER_OBJECT]
        if color not in COLORS or shape not in SHAPES or size not in SIZES or col not in COLUMNS or row not in ROWS:
            return None
        objects.append(PlanObject(color, shape, size, (COLUMNS.index(col), ROWS.index(row))))
    return PlanSpec(tuple(objects), words[-1])


def cell_centre(cell: tuple[int, int]) -> tuple[float, float]:
    return (cell[0] + 0.5) * CELL, (cell[1] + 0.5) * CELL


def cells_hold(relation: str, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """`A relation B` read from two cells: the contract's rule (scene.relation_holds) on the cells' centres with one
    cell of slack on both inequalities, i.e. B lies at least one cell further in the relation's direction and no
    more cells off its axis than along it. A ground-truth layout is at least 10 px apart along the axis (the
    sampler's margin), so its cells are at least 2 apart and swapping the two objects never reads as the relation."""
    return relation_holds(relation, cell_centre(a), cell_centre(b), margin=-CELL)


def check_plan(plan_text: str, caption: str) -> dict[str, bool | None]:
    """The plan judged against the caption, attribute by attribute as the image checker judges an image (`count`,
    `color`, `shape`, `size`, `background`, `relation`, None where the caption names no such attribute, and
    `correct`, the conjunction of the others). The plan's objects are matched to the caption's in order; a plan
    outside the grammar is wrong on every attribute. CaptionError if the caption is outside its grammar."""
    spec, plan = parse_caption(caption), parse_plan(plan_text)
    objs = list(plan.objects) if plan is not None else []
    paired = [(named, objs[i] if i < len(objs) else None) for i, named in enumerate(spec.objects)]
    verdict = {
        "count": plan is not None and len(objs) == len(spec.objects),
        "color": plan is not None and all(o is not None and o.color == c for (c, _), o in paired),
        "shape": plan is not None and all(o is not None and o.shape == s for (_, s), o in paired),
        "size": None if spec.size is None else plan is not None and objs[0].size == spec.size,
        "background": None if spec.background is None else plan is not None and plan.background == spec.background,
        "relation": None if spec.relation is None else len(objs) >= 2 and cells_hold(spec.relation, objs[0].cell,
                                                                                    objs[1].cell),
    }
    return verdict | {"correct": all(v for v in verdict.values() if v is not None)}
