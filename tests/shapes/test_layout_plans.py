"""Layout plans (shapes/plan.py): the grammar, a scene's ground-truth plan, and the plan check against a caption."""

import numpy as np
import pytest

from grpo_vision.shapes import plan as P
from grpo_vision.shapes.judge import ShapesJudge
from grpo_vision.shapes.plan import MAX_PLAN_TOKENS, check_plan, format_plan, parse_plan, plan_words, scene_plan
from grpo_vision.shapes.layout import sample_scene
from grpo_vision.shapes.scene import (FORMS, RELATION_AXIS, RELATIONS, CaptionError, Obj, Scene, all_words, box_centre,
                                      mask_box, object_mask)

ATTRS = ("count", "color", "shape", "size", "background", "relation")


def _scenes(n_per_form, seed):
    rng = np.random.default_rng(seed)
    return [sample_scene(rng, form, "all", aesthetic=True) for form in FORMS for _ in range(n_per_form)]


def test_plan_vocabulary_and_length():
    words = plan_words()
    assert words == plan_words() and len(words) == len(set(words)) == 6 + 3 + 2 + 16 + 16 + 3
    assert all(w and " " not in w for w in words)
    assert words[:11] == ["red", "green", "blue", "yellow", "purple", "orange", "circle", "square", "triangle",
                          "small", "large"]
    assert words[11] == "x0" and words[26] == "x15" and words[27] == "y0" and words[-3:] == ["white", "black", "gray"]
    assert MAX_PLAN_TOKENS == 11 and P.CELL * P.PLAN_GRID == 64


def test_scene_plan_by_hand():
    # a small square at x0=10, y0=20, side 14: visible box centre (17, 27) -> cell (17 // 4, 27 // 4) = (4, 6);
    # a large circle at (40, 30) side 24: centre (52, 42) -> (13, 10); a clipped one at x0=-4, side 16: its visible
    # box is columns 0..11, centre x 6 -> column 1 (the nominal centre, 4, would be column 1 too), y0=60: rows 60..63
    # (clipped below), centre 62 -> row 15
    scene = Scene("black", [Obj("red", "square", "small", 10, 20, 14), Obj("blue", "circle", "large", 40, 30, 24)])
    assert scene_plan(scene) == ["red", "square", "small", "x4", "y6", "blue", "circle", "large", "x13", "y10", "black"]
    clipped = Scene("white", [Obj("green", "square", "small", -4, 60, 16)])
    assert scene_plan(clipped) == ["green", "square", "small", "x1", "y15", "white"]


def test_ground_truth_plans_pass_their_caption_on_every_form():
    for scene, caption in _scenes(150, seed=3):
        plan = scene_plan(scene)
        text = " ".join(plan)
        assert len(plan) <= MAX_PLAN_TOKENS and set(plan) <= set(plan_words())
        assert format_plan(parse_plan(text)) == text
        verdict = check_plan(text, caption)
        assert verdict["correct"], (caption, text, verdict)
        # every attribute the caption names is judged, and only those
        named = {"size": caption.split()[1] in ("small", "large"), "background": "background" in caption,
                 "relation": any(r in caption for r in RELATIONS)}
        assert all((verdict[a] is not None) == named[a] for a in named)


def _alter(text, i, word):
    words = text.split()
    words[i] = word
    return " ".join(words)


def test_altered_plans_fail_on_the_altered_attribute():
    other = {"red": "green", "circle": "square", "square": "triangle", "triangle": "circle", "small": "large",
             "large": "small", "white": "black", "black": "gray", "gray": "white"}
    seen = set()
    for scene, caption in _scenes(40, seed=4):
        text = " ".join(scene_plan(scene))
        words = text.split()
        for i, attr in ((0, "color"), (1, "shape"), (2, "size"), (len(words) - 1, "background")):
            word = other.get(words[i], "red")
            verdict = check_plan(_alter(text, i, word), caption)
            if verdict[attr] is None:  # the caption does not name it: the plan may say anything
                assert verdict["correct"]
                continue
            seen.add(attr)
            assert verdict[attr] is False and not verdict["correct"]
            assert all(verdict[a] is not False for a in ATTRS if a != attr), (caption, text, word, verdict)
        if scene.relation is not None:  # the two objects' cells swapped: B lies on A's side
            swapped = words[:3] + words[8:10] + words[5:8] + words[3:5] + words[10:]
            verdict = check_plan(" ".join(swapped), caption)
            assert verdict["relation"] is False and verdict["color"] and verdict["shape"] and not verdict["correct"]
            one = check_plan(" ".join(words[:5] + words[-1:]), caption)  # the second object left out
            assert one["count"] is False and one["relation"] is False and one["color"] is False
            seen.add("relation")
    assert seen == {"color", "shape", "size", "background", "relation"}


def test_check_plan_by_hand():
    caption = "a red circle left of a blue square"
    plan = "red circle small x2 y7 blue square large x10 y8 white"
    assert check_plan(plan, caption) == {"count": True, "color": True, "shape": True, "size": None,
                                         "background": None, "relation": True, "correct": True}
    # the relation from cells, with one cell of slack: B at least one column right of A, and no more rows off than
    # columns along (cells_hold: the contract's rule on cell centres with margin -4 px)
    cases = {("x2", "y7", "x3", "y7"): True,  # 1 column along, 0 rows off
             ("x5", "y2", "x5", "y9"): False,  # the same column: below, not right
             ("x2", "y2", "x4", "y4"): True,  # the diagonal: 2 along, 2 off, read as left of and as above alike
             ("x2", "y2", "x4", "y5"): False,  # 2 along, 3 off
             ("x9", "y7", "x2", "y7"): False}  # B on the left
    for (ax, ay, bx, by), holds in cases.items():
        text = f"red circle small {ax} {ay} blue square large {bx} {by} white"
        assert check_plan(text, caption)["relation"] is holds, text
    # docs/shapes_world.md's example: a small red circle centred at (14, 30) px, a large blue square at (45, 33)
    example = Scene("white", [Obj("red", "circle", "small", 7, 23, 14), Obj("blue", "square", "large", 32, 20, 26)])
    assert " ".join(scene_plan(example)) == "red circle small x3 y7 blue square large x11 y8 white"
    assert check_plan(" ".join(scene_plan(example)), caption)["correct"]
    assert check_plan("red circle small x2 y2 blue square large x4 y4 gray",
                      "a red circle above a blue square")["relation"] is True
    assert check_plan("red circle large x3 y3 gray", "a small red circle")["size"] is False
    assert check_plan("red circle large x3 y3 gray", "a large red circle")["correct"] is True
    assert check_plan("red circle large x3 y3 gray", "a red circle on a gray background")["correct"] is True
    # a plan of two objects for a caption of one: the count is wrong, the named object right
    two = check_plan("red circle large x3 y3 blue square small x9 y9 gray", "a red circle")
    assert (two["count"], two["color"], two["shape"], two["correct"]) == (False, True, True, False)


@pytest.mark.parametrize("plan", ["", "   ", "red circle", "red circle small x2 y7",  # no background
                                  "red circle small x16 y7 white",  # off the grid
                                  "red circle small x2 y7 blue square white",  # an object of 3 words
                                  "red circle small y7 x2 white",  # row before column
                                  "red circle small x2 y7 blue square large x1 y1 green circle small x3 y3 white",
                                  "Red circle small x2 y7 white", None])
def test_a_plan_outside_the_grammar_is_wrong_on_every_attribute(plan):
    assert parse_plan(plan) is None
    for caption in ("a red circle", "a small red circle", "a red circle on a white background",
                    "a red circle left of a blue square"):
        verdict = check_plan(plan, caption)
        assert verdict["correct"] is False
        assert all(v is False for a, v in verdict.items() if v is not None), verdict


def test_check_plan_refuses_a_caption_outside_the_grammar():
    with pytest.raises(CaptionError):
        check_plan("red circle small x2 y7 white", "a red dog")


def test_judge_plan_verdicts_read_prompts_as_the_policy_does():
    judge = ShapesJudge()
    plans = ["red circle small x2 y7 white", "red circle small x2 y7 white", "blue circle small x2 y7 white"]
    out = judge.plan_verdicts(plans, ["A red  circle", "a red dog", "a red circle"])
    assert out[0]["correct"] is True and out[1] is None and out[2]["color"] is False
    assert set(out[0]) == {*judge.attributes, "correct"}


def test_cells_of_a_ground_truth_relation_are_two_apart():
    """The sampler keeps 10 px between relation centres, so their cells differ by 2 or more along the axis: the
    relation read from cells never holds for the swapped pair (cells_hold's docstring)."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        scene, caption = sample_scene(rng, "relation", "all", aesthetic=True)
        a, b = (P.cell_of(*box_centre(*mask_box(object_mask(o)))) for o in scene.objects)
        axis, sign = RELATION_AXIS[scene.relation]
        assert sign * (b[axis] - a[axis]) >= 2, caption
        assert P.cells_hold(scene.relation, a, b) and not P.cells_hold(scene.relation, b, a)


def test_plan_words_and_caption_words_share_the_attribute_names():
    # the plan names colours, shapes, sizes and backgrounds with the caption's own words
    assert set(plan_words()) & set(all_words()) == {"red", "green", "blue", "yellow", "purple", "orange", "circle",
                                                    "square", "triangle", "small", "large", "white", "black", "gray"}
