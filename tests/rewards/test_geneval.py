"""GenEval's rules (grpo_vision/rewards/geneval.py) on hand-built detections, each verdict worked out
by hand in a comment. Agreement with GenEval's own functions on random detections: docs/real_models.md."""

import pytest

from grpo_vision.rewards.geneval import Detection, GenEvalRules, check_metadata, iou, judge, kept, relations


def det(x0, y0, x1, y1, score=0.95):
    return Detection((x0, y0, x1, y1), score)


def verdict(detections, metadata, colours=None, rules=GenEvalRules()):
    return judge(kept(detections, metadata["tag"], rules), metadata, colours, rules)


ONE_BENCH = {"tag": "single_object", "include": [{"class": "bench", "count": 1}]}
TWO_CLOCKS = {"tag": "counting", "include": [{"class": "clock", "count": 2}],
              "exclude": [{"class": "clock", "count": 3}]}
RED_CAR = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
DOG_RIGHT_OF_TEDDY = {"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                                    {"class": "dog", "count": 1, "position": ["right of", 0]}]}


def test_the_confidence_threshold_is_strict():
    # 0.31 > 0.3 counts; 0.3 itself does not
    assert verdict({"bench": [det(0, 0, 9, 9, 0.31)]}, ONE_BENCH).correct
    v = verdict({"bench": [det(0, 0, 9, 9, 0.3)]}, ONE_BENCH)
    assert not v.correct and v.reasons == ["expected bench>=1, found 0"] and v.failures == ["object"]


def test_counting_prompts_use_the_higher_threshold_and_the_exclude_clause():
    # two clocks above 0.9: include met, exclude (3 or more) not triggered -> correct, 2 of 2 clauses
    assert verdict({"clock": [det(0, 0, 9, 9, 0.95), det(20, 0, 29, 9, 0.92)]}, TWO_CLOCKS).met == 2
    # a clock at 0.85 clears 0.3 but not the counting threshold 0.9: one clock, include fails
    v = verdict({"clock": [det(0, 0, 9, 9, 0.95), det(20, 0, 29, 9, 0.85)]}, TWO_CLOCKS)
    assert (v.correct, v.met, v.reasons, v.failures) == (False, 1, ["expected clock>=2, found 1"], ["count"])
    # none above 0.9: the object itself is missing, not miscounted
    assert verdict({"clock": [det(0, 0, 9, 9, 0.85)]}, TWO_CLOCKS).failures == ["object"]
    # three clocks above 0.9: include met, exclude fails -> wrong, 1 of 2 clauses, partial 0.5
    v = verdict({"clock": [det(i * 20, 0, i * 20 + 9, 9, 0.95) for i in range(3)]}, TWO_CLOCKS)
    assert (v.correct, v.partial, v.reasons, v.failures) == (False, 0.5, ["expected clock<3, found 3"], ["count"])


def test_a_class_keeps_its_16_most_confident_boxes():
    # 20 clocks above 0.9: 16 kept, so "fewer than 17" holds and "fewer than 16" does not
    boxes = [det(i * 20, 0, i * 20 + 9, 9, 0.91 + i * 0.001) for i in range(20)]
    found = kept({"clock": boxes}, "counting")
    assert len(found["clock"]) == 16
    assert found["clock"][0].score == pytest.approx(0.91 + 19 * 0.001)  # the most confident first
    few = {"tag": "counting", "include": [{"class": "clock", "count": 1}], "exclude": [{"class": "clock", "count": 17}]}
    assert verdict({"clock": boxes}, few).correct
    few["exclude"][0]["count"] = 16
    assert not verdict({"clock": boxes}, few).correct


def test_iou_counts_pixels_inclusively_and_suppression_is_off_by_default():
    # (0,0,9,9) is 10 x 10 = 100 pixels; (0,0,9,4) is 10 x 5 = 50, all inside: IoU 50 / 100 = 0.5
    a, b = det(0, 0, 9, 9, 0.9), det(0, 0, 9, 4, 0.8)
    assert iou(a.box, b.box) == 0.5
    assert len(kept({"cat": [a, b]}, "single_object")["cat"]) == 2  # max_overlap 1.0: no suppression
    assert len(kept({"cat": [a, b]}, "single_object", GenEvalRules(max_overlap=0.5))["cat"]) == 1  # 0.5 is not < 0.5
    assert len(kept({"cat": [a, b]}, "single_object", GenEvalRules(max_overlap=0.6))["cat"]) == 2


def test_colour_is_read_only_for_a_found_object_and_on_its_most_confident_boxes():
    asked = []

    def colours(name, boxes):
        asked.append((name, len(boxes)))
        return ["blue" if b.score > 0.9 else "red" for b in boxes]

    assert not verdict({}, RED_CAR, colours).correct and asked == []  # no car: no colour asked
    # cars at 0.95 (blue) and 0.5 (red): the clause reads only the most confident car, which is blue
    v = verdict({"car": [det(0, 0, 9, 9, 0.5), det(20, 0, 29, 9, 0.95)]}, RED_CAR, colours)
    assert not v.correct and asked == [("car", 1)] and v.reasons == ["expected red car>=1, found 0 (1 blue)"]
    assert v.failures == ["colour"]
    assert verdict({"car": [det(0, 0, 9, 9, 0.5)]}, RED_CAR, colours).correct


def test_relations_by_hand():
    # centres 50 and 350 on x, equal on y; extents 100 + 100: shrunk dx = 300 - 0.1 * 200 = 280, over |offset|
    # 300 = 0.93 > 0.5 -> right of
    assert relations((300, 0, 400, 100), (0, 0, 100, 100)) == {"right of"}
    assert relations((0, 0, 100, 100), (300, 0, 400, 100)) == {"left of"}
    # diagonal: offset (100, 100), 10-pixel boxes: shrunk 100 - 0.1 * 20 = 98 each, / 141.4 = 0.69 -> both
    assert relations((100, 100, 110, 110), (0, 0, 10, 10)) == {"right of", "below"}
    # same centre: no relation; 5 pixels apart with 100-pixel boxes: shrunk to 0 by the margin 20
    assert relations((0, 0, 100, 100), (0, 0, 100, 100)) == set()
    assert relations((5, 0, 105, 100), (0, 0, 100, 100)) == set()
    # offset (100, 30), 10-pixel boxes: shrunk (98, 28) / 104.4 = (0.94, 0.27): right of only
    assert relations((100, 30, 110, 40), (0, 0, 10, 10)) == {"right of"}


def test_position_needs_its_target_and_every_pair_in_relation():
    teddy, dog_right, dog_left = det(0, 0, 100, 100), det(300, 0, 400, 100), det(-300, 0, -200, 100)
    assert verdict({"teddy bear": [teddy], "dog": [dog_right]}, DOG_RIGHT_OF_TEDDY).correct
    v = verdict({"teddy bear": [teddy], "dog": [dog_left]}, DOG_RIGHT_OF_TEDDY)
    assert (v.correct, v.met, v.reasons) == (False, 1, ["expected dog right of target, found left of"])
    assert v.failures == ["position"]
    # the target clause failed (no teddy bear): the dog's clause fails too, whatever its box
    v = verdict({"dog": [dog_right]}, DOG_RIGHT_OF_TEDDY)
    assert v.met == 0 and v.reasons == ["expected teddy bear>=1, found 0", "no target for dog to be right of"]
    assert v.failures == ["object", "position"]


def test_a_prompt_without_clauses_is_met():
    v = judge({}, {"tag": "single_object", "include": []})
    assert v.correct and v.partial == 1.0


@pytest.mark.parametrize("metadata, needle", [
    ({"include": [{"class": "cat", "count": 1}]}, "needs a .tag"),
    ({"tag": "counting", "include": [{"class": "cat"}]}, "clause 0 needs a 'class'"),
    ({"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "teal"}]}, "colour 'teal' is not one"),
    ({"tag": "position", "include": [{"class": "cat", "count": 1, "position": ["above", 0]}]}, "an earlier include"),
])
def test_metadata_the_rules_cannot_read_is_named(metadata, needle):
    with pytest.raises(ValueError, match=needle):
        check_metadata(metadata, "prompts.jsonl, entry 3")
