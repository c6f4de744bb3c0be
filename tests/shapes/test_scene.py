"""ShapesWorld scenes: the contract's numbers, caption grammar, geometry invariants, splits."""

import itertools

import numpy as np
import pytest

from grpo_vision.shapes import scene as S
from grpo_vision.shapes.scene import (
    CaptionError,
    CaptionSpec,
    Obj,
    Scene,
    aesthetic_label,
    all_words,
    format_caption,
    is_held_out,
    parse_caption,
    prompt_list,
    render,
)
from grpo_vision.shapes.layout import sample_scene, scene_for_caption


def _samples(n_per_form, seed=0, aesthetic=True, split="train"):
    rng = np.random.default_rng(seed)
    return [sample_scene(rng, f, split, aesthetic) for f in S.FORMS for _ in range(n_per_form)]


def _centre(o):
    return o.x0 + o.side / 2, o.y0 + o.side / 2


# ---------------------------------------------------------------- contract constants and masks


def test_palette_and_sizes_are_the_contracts():
    assert S.IMAGE_SIZE == 64
    assert S.BACKGROUNDS == {
        "white": (240, 240, 240), "black": (30, 30, 30), "gray": (128, 128, 128)
    }  # fmt: skip
    assert S.COLORS == {
        "red": (220, 40, 40), "green": (40, 170, 70), "blue": (40, 90, 220),
        "yellow": (235, 200, 40), "purple": (150, 60, 190), "orange": (240, 130, 30),
    }  # fmt: skip
    assert S.SHAPES == ("circle", "square", "triangle")
    assert S.SIZES == {"small": (12, 16), "large": (24, 30)}
    assert S.RELATIONS == ("left of", "right of", "above", "below")


def test_masks_worked_out_by_hand():
    # side 4 at (0, 0), pixel centres at 0.5 .. 3.5:
    # square: all 16. circle (centre (2, 2), r 2): the 4 corner pixels are 1.5 * sqrt(2) = 2.12
    # away -> 12.
    # triangle: half-width at row centre y is y / 2 -> rows 0.5, 1.5, 2.5, 3.5 keep |x - 2| <= 0.25,
    # 0.75, 1.25, 1.75 -> 0 + 2 + 2 + 4 = 8 pixels.
    def mask(shape):
        return S.object_mask(Obj("red", shape, "small", 0, 0, 4), size=6)

    assert mask("square").sum() == 16
    assert mask("circle").sum() == 12 and not mask("circle")[0, 0] and mask("circle")[1, 0]
    tri = mask("triangle")
    assert tri.sum(1).tolist() == [0, 2, 2, 4, 0, 0]
    assert tri[3, :4].all() and tri[1, 1:3].all()


@pytest.mark.parametrize("side", [12, 15, 24, 30])
def test_filled_shape_fractions(side):
    # circle ~ pi/4 of its box, triangle ~ 1/2, all of them touching all four box sides
    fracs = {}
    for shape in S.SHAPES:
        m = S.object_mask(Obj("red", shape, "x", 10, 10, side))
        fracs[shape] = m.sum() / side**2
        x0, y0, w, h = S.mask_box(m)
        assert x0 == 10 and w == side and y0 + h == 10 + side
        assert y0 == 10 or (shape == "triangle" and y0 == 11)  # even side: apex row is empty
    assert fracs["square"] == 1.0
    assert abs(fracs["circle"] - np.pi / 4) < 0.03
    assert abs(fracs["triangle"] - 0.5) < 0.05


# ---------------------------------------------------------------- rendering


def test_same_seed_same_scene_caption_pixels():
    for seed in range(20):
        (s1, c1), (s2, c2) = (sample_scene(np.random.default_rng(seed)) for _ in range(2))
        assert s1 == s2 and c1 == c2
        assert np.array_equal(render(s1), render(s2))
    pixels = {render(sample_scene(np.random.default_rng(seed))[0]).tobytes() for seed in range(20)}
    assert len(pixels) == 20


def test_object_pixels_have_exact_palette_and_noise_stays_on_background():
    for scene, _ in _samples(60, seed=1):
        img = render(scene)
        assert img.dtype == np.uint8 and img.shape == (64, 64, 3)
        on = np.zeros((64, 64), bool)
        for o in scene.objects:
            m = S.object_mask(o)
            assert (img[m] == S.COLORS[o.color]).all()
            on |= m
        bg = img[~on].astype(int) - S.BACKGROUNDS[scene.background]  # [P, 3]
        amp = S.NOISE_AMPLITUDE[scene.noise]
        assert np.abs(bg).max() <= amp
        if scene.noise == "heavy":
            assert np.abs(bg).max() >= amp - 5  # noise really is there at full amplitude


# ---------------------------------------------------------------- geometry


def test_geometry_follows_the_contract():
    n_rel = n_clip = n_corner = 0
    for scene, caption in _samples(200, seed=2):
        objs = scene.objects
        for o in objs:
            lo, hi = S.SIZES[o.size]
            assert lo <= o.side <= hi
            gaps = S._edge_gaps(o)
            if not scene.clipped:  # clean scenes lie fully inside the canvas
                assert min(gaps) >= 0
            assert min(gaps) >= -S.MAX_CLIP_FRAC * o.side  # never clipped by more than 25%
        assert scene.clipped == S.is_clipped(objs) and scene.cornered == S.is_cornered(objs)
        n_clip += scene.clipped
        n_corner += scene.cornered
        if len(objs) == 2:
            a, b = objs
            # at least 2 empty px between the boxes along x or y
            assert max(b.x0 - (a.x0 + a.side), a.x0 - (b.x0 + b.side),
                       b.y0 - (a.y0 + a.side), a.y0 - (b.y0 + b.side)) >= 2  # fmt: skip
            (ax, ay), (bx, by) = _centre(a), _centre(b)
            rule = {  # the contract's formulas, written out independently of relation_holds
                "left of": ax + 8 <= bx and abs(ay - by) < abs(ax - bx),
                "right of": bx + 8 <= ax and abs(ay - by) < abs(ax - bx),
                "above": ay + 8 <= by and abs(ax - bx) < abs(ay - by),
                "below": by + 8 <= ay and abs(ax - bx) < abs(ay - by),
            }
            assert rule[scene.relation] and sum(rule.values()) == 1
            n_rel += 1
    assert n_rel == 200 and n_clip > 40 and n_corner > 40


def test_cornered_and_clipped_predicates_by_hand():
    def o(x0, y0, side=14):
        return Obj("red", "square", "small", x0, y0, side)

    assert S.is_cornered([o(2, 48)])  # left gap 2, bottom gap 64 - 48 - 14 = 2
    assert not S.is_cornered([o(3, 48)]) and not S.is_cornered([o(0, 20)])
    assert S.is_clipped([o(-1, 20)]) and S.is_clipped([o(51, 20)]) and not S.is_clipped([o(50, 50)])
    assert S.boxes_apart(o(0, 0), o(16, 0)) and not S.boxes_apart(o(0, 0), o(15, 0))


# ---------------------------------------------------------------- captions


def test_captions_agree_with_scene():
    for scene, caption in _samples(100, seed=3):
        spec = parse_caption(caption)
        assert [(o.color, o.shape) for o in scene.objects] == list(spec.objects)
        assert spec.relation == scene.relation
        if spec.size is not None:
            assert scene.objects[0].size == spec.size
        if spec.background is not None:
            assert scene.background == spec.background
        assert caption == " ".join(caption.split()) and caption == caption.lower()


def test_parse_format_round_trip_over_every_caption():
    n = 0
    for form in S.FORMS:
        for spec in S._all_specs(form, "all"):
            text = format_caption(spec)
            assert parse_caption(text) == spec and format_caption(parse_caption(text)) == text
            n += 1
    assert n == 18 + 36 + 54 + 18 * 17 * 4  # every caption of the grammar
    spec = CaptionSpec("size", (("orange", "triangle"),), size="large")
    assert parse_caption("a large orange triangle") == spec
    assert parse_caption("a red circle left of a red square").relation == "left of"


@pytest.mark.parametrize(
    "bad",
    [
        "", "a Red circle", "a  red circle", " a red circle", "a red circle ", "red circle",
        "an orange circle", "a pink circle", "a red circle.", "a red circle on a blue background",
        "a red circle left of a red circle", "a small red circle left of a blue square",
        "a red circle next to a blue square",
        "a red circle on a gray background left of a red square",
    ],
)  # fmt: skip
def test_caption_error_quotes_caption_and_grammar(bad):
    with pytest.raises(CaptionError) as err:
        parse_caption(bad)
    msg = str(err.value)
    assert repr(bad) in msg and "'a {color} {shape}'" in msg and "orange" in msg
    assert isinstance(err.value, ValueError)


def test_format_refuses_malformed_specs():
    with pytest.raises(CaptionError):
        format_caption(CaptionSpec("plain", (("red", "circle"),), size="small"))
    with pytest.raises(CaptionError):
        same = (("red", "circle"), ("red", "circle"))
        format_caption(CaptionSpec("relation", same, relation="above"))


def test_all_words_is_the_caption_vocabulary():
    words = all_words()
    assert words[0] == "a" and len(words) == len(set(words)) == 1 + 2 + 6 + 3 + 1 + 3 + 1 + 5
    used = {w for f in S.FORMS for s in S._all_specs(f, "all") for w in format_caption(s).split()}
    assert used == set(words)
    assert all_words() == words  # fixed order


# ---------------------------------------------------------------- forms, factors, aesthetics


def test_forms_uniform_and_factor_rates():
    samples = [sample_scene(np.random.default_rng(i)) for i in range(1200)]
    forms = np.bincount([S.FORMS.index(parse_caption(c).form) for _, c in samples], minlength=4)
    assert forms.min() > 240  # expectation 300 each
    noise = np.bincount([S.NOISE_LEVELS.index(s.noise) for s, _ in samples], minlength=3) / 1200
    assert np.allclose(noise, S.NOISE_PROBS, atol=0.05)
    assert 0.09 < np.mean([s.clipped for s, _ in samples]) < 0.21
    assert 0.09 < np.mean([s.cornered for s, _ in samples]) < 0.21
    clean = _samples(50, seed=4, aesthetic=False)
    assert all(s.noise == "none" and not s.clipped and not s.cornered for s, _ in clean)


def test_aesthetic_label_documented_values_and_monotone():
    def label(noise="none", clipped=False, cornered=False):
        return aesthetic_label(Scene("white", [], None, noise, clipped, cornered))

    assert label() == 9.0
    assert label("light") == 6.5 and label("heavy") == 4.0
    assert label(clipped=True) == 7.0 and label(cornered=True) == 7.5
    assert label("heavy", True, True) == 0.5  # the worst scene
    for clipped, cornered in itertools.product([False, True], repeat=2):
        vals = [label(n, clipped, cornered) for n in S.NOISE_LEVELS]
        assert vals[0] > vals[1] > vals[2] and all(0 <= v <= 10 for v in vals)


def test_scene_for_caption_satisfies_caption():
    rng = np.random.default_rng(5)
    for caption in prompt_list("all", 80, seed=5):
        scene = scene_for_caption(caption, rng)
        spec = parse_caption(caption)
        assert [(o.color, o.shape) for o in scene.objects] == list(spec.objects)
        assert scene.relation == spec.relation and scene.noise == "none"
        assert spec.size in (None, scene.objects[0].size)
        assert spec.background in (None, scene.background)


# ---------------------------------------------------------------- splits


def test_held_out_pairs_leave_every_colour_and_shape_in_training():
    assert len(S.HELD_OUT) == 3
    train_pairs = set(itertools.product(S.COLORS, S.SHAPES)) - S.HELD_OUT
    assert {c for c, _ in train_pairs} == set(S.COLORS)
    assert {s for _, s in train_pairs} == set(S.SHAPES)


def test_split_sampling():
    train = _samples(150, seed=6, split="train")
    assert not any(is_held_out(c) for _, c in train)
    assert {c for s, _ in train for c in (o.color for o in s.objects)} == set(S.COLORS)
    assert {sh for s, _ in train for sh in (o.shape for o in s.objects)} == set(S.SHAPES)
    held = _samples(50, seed=6, split="heldout")
    assert all(is_held_out(c) for _, c in held)
    assert all(any((o.color, o.shape) in S.HELD_OUT for o in s.objects) for s, _ in held)


def test_prompt_list_deterministic_in_split_and_distinct():
    train = prompt_list("train", 200, seed=7)
    assert train == prompt_list("train", 200, seed=7) and train != prompt_list("train", 200, seed=8)
    assert not any(map(is_held_out, train))
    # 50 per form from pools of 15 plain, 30 size, 45 background and 840 relation captions
    assert len(set(train)) == 15 + 30 + 45 + 50
    assert len(set(prompt_list("train", 60, seed=7))) == 60  # no repeat before a pool runs out
    forms = [parse_caption(c).form for c in train]
    assert all(forms.count(f) == 50 for f in S.FORMS)
    held = prompt_list("heldout", 40, seed=7)
    assert all(map(is_held_out, held))
    assert len(set(held)) == 3 + 6 + 9 + 10  # plain/size/background pools are 3/6/9 captions
    with pytest.raises(ValueError):
        prompt_list("test", 4, seed=0)
