"""GenEval's summary and the paired change (grpo_vision/evaluation/geneval_bench.py), worked out by hand."""

import pytest

from grpo_vision.evaluation.geneval_bench import paired_change, summary


def rows(spec):
    """spec: (prompt, tag, [correct per image])."""
    return [{"prompt": p, "tag": t, "correct": c} for p, t, cs in spec for c in cs]


SPEC = [("a photo of a cat", "single_object", [1, 1, 1, 0]),
        ("a photo of a dog", "single_object", [0, 0, 0, 0]),
        ("a photo of two clocks", "counting", [1, 0, 0, 0])]


def test_summary_is_genevals_mean_over_tasks():
    s = summary(rows(SPEC))
    # single_object: 3 of 8 images = 0.375; counting: 1 of 4 = 0.25; overall (0.375 + 0.25) / 2 = 0.3125
    assert s["tasks"] == {"single_object": {"accuracy": 0.375, "correct": 3, "images": 8},
                          "counting": {"accuracy": 0.25, "correct": 1, "images": 4}}
    assert s["overall"] == 0.3125
    # 4 of 12 images; prompts with at least one correct image: cat and clocks, 2 of 3
    assert s["images_correct"] == pytest.approx(1 / 3) and s["prompts_correct"] == pytest.approx(2 / 3)
    assert (s["images"], s["prompts"]) == (12, 3)
    assert s["failing"] == {}  # these rows say nothing of why


def test_summary_counts_each_image_once_per_kind_of_failure():
    r = rows(SPEC[:1])  # four images of one prompt
    r[0]["failures"], r[1]["failures"] = ["object", "position"], ["position", "position"]
    # position: images 0 and 1 = 2 of 4 (image 1's two position clauses count once); object: 1 of 4
    assert summary(r)["failing"] == {"object": 0.25, "position": 0.5}  # in FAILURES' order


def test_paired_change_by_hand_and_its_interval_over_prompts():
    reference = rows(SPEC)
    policy = rows([("a photo of a cat", "single_object", [1, 1, 1, 1]),  # +1 image
                   ("a photo of a dog", "single_object", [1, 1, 0, 0]),  # +2
                   ("a photo of two clocks", "counting", [1, 0, 0, 0])])  # 0
    out = paired_change(policy, reference, replicates=2000)
    # single_object: +3 of 8 images = +0.375; counting: 0; overall (0.375 + 0) / 2 = 0.1875
    assert out["tasks"]["single_object"]["change"] == 0.375 and out["tasks"]["counting"]["change"] == 0.0
    assert out["overall"]["change"] == 0.1875
    # resampling the two single-object prompts gives +0.25 (cat twice), +0.375 or +0.5 (dog twice): the
    # interval's ends are those extremes; counting has one prompt whose change is 0, so its interval is [0, 0]
    assert out["tasks"]["single_object"]["ci95"] == [0.25, 0.5]
    assert out["tasks"]["counting"]["ci95"] == [0.0, 0.0]
    assert out["overall"]["ci95"] == [0.125, 0.25]  # half of the single-object ends


def test_the_models_must_be_scored_on_the_same_prompts():
    with pytest.raises(ValueError, match="same prompts"):
        paired_change(rows(SPEC), rows(SPEC[:2]))
