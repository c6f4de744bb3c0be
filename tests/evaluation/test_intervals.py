"""The bootstrap over captions (grpo_vision/evaluation/intervals.py): values worked out by hand, and what it must
include that the per-image interval leaves out."""

import pytest
import torch

from grpo_vision.evaluation.intervals import caption_interval
from grpo_vision.run.metrics import interval


def test_mean_is_the_image_mean_and_captions_are_counted():
    # captions a (2 images: 1, 3) and b (1 image: 8): the mean is over images, (1 + 3 + 8) / 3 = 4
    r = caption_interval(torch.tensor([1.0, 3.0, 8.0]), ["a", "a", "b"])
    assert (r["mean"], r["n"], r["captions"]) == (4.0, 3, 2)
    # a resample holds a twice (mean 2), b twice (8) or one of each (4): every replicate is one of the three
    lo, hi = r["ci95"]
    assert 2.0 <= lo <= hi <= 8.0 and lo == 2.0 and hi == 8.0


def test_nan_does_not_apply_and_one_caption_has_no_interval():
    r = caption_interval(torch.tensor([float("nan"), 1.0, 1.0]), ["a", "b", "b"])
    assert r == {"mean": 1.0, "ci95": None, "n": 2, "captions": 1}  # a has no value: one caption left
    assert caption_interval(torch.tensor([float("nan")] * 2), ["a", "b"])["mean"] is None


def test_strata_keep_each_form_in_every_replicate():
    # form x: captions of values 0 and 0; form y: 10 and 10. Resampling within forms cannot move the mean;
    # resampling across forms can draw only x's captions (mean 0) or only y's (mean 10)
    v, caps = torch.tensor([0.0, 0.0, 10.0, 10.0]), ["x1", "x2", "y1", "y2"]
    assert caption_interval(v, caps, ["x", "x", "y", "y"])["ci95"] == [5.0, 5.0]
    lo, hi = caption_interval(v, caps)["ci95"]
    assert lo < 5.0 < hi


def test_wider_than_per_image_when_captions_differ():
    # 32 captions whose true changes spread (sd 0.3) and 8 images each with little noise (sd 0.05): the
    # per-image interval sees 256 near-independent values, the caption bootstrap sees 32
    g = torch.Generator().manual_seed(0)
    caption_effect = torch.randn(32, generator=g) * 0.3
    v = caption_effect.repeat_interleave(8) + torch.randn(256, generator=g) * 0.05
    caps = [f"c{i}" for i in range(32) for _ in range(8)]
    width = lambda r: r["ci95"][1] - r["ci95"][0]  # noqa: E731
    per_image, clustered = interval(v), caption_interval(v, caps)
    assert width(clustered) > 2 * width(per_image)
    # ... and about the standard error of 32 caption means: 2 x 1.96 x sd / sqrt(32)
    expected = 2 * 1.96 * float(v.view(32, 8).mean(1).std()) / 32 ** 0.5
    assert width(clustered) == pytest.approx(expected, rel=0.15)


def test_seeds_are_resampled_too():
    # two seeds on the same 16 captions: one seed's change is 0 everywhere, the other's 1; the captions
    # alone say nothing (each seed is constant), the seeds say everything: replicates are 0, 0.5 or 1
    caps = [f"c{i}" for i in range(16)]
    r = caption_interval(torch.stack([torch.zeros(16), torch.ones(16)]), caps)
    assert (r["mean"], r["seeds"], r["captions"], r["n"]) == (0.5, 2, 16, 16)
    assert r["ci95"] == [0.0, 1.0]


def test_one_value_per_image():
    with pytest.raises(ValueError, match="3 values, 2 captions"):
        caption_interval(torch.zeros(3), ["a", "b"])
