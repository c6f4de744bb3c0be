"""The report's judge tables (ShapesWorld's checker as the judge): per attribute and per prompt form."""

import numpy as np
import torch

from grpo_vision.config import load_config
from grpo_vision.evaluate import eval_params
from grpo_vision.judge import Judge, judge_tables
from grpo_vision.shapes.judge import ShapesJudge
from grpo_vision.shapes.scene import render, scene_for_caption


def test_judge_tables_count_renders_right_per_form():
    judge = ShapesJudge()
    assert isinstance(judge, Judge)
    rng = np.random.default_rng(0)
    captions = ["a red circle", "a small blue square", "a green triangle on a black background",
                "a red circle left of a blue square"]
    images = torch.from_numpy(np.stack([render(scene_for_caption(c, rng)) for c in captions])).permute(0, 3, 1, 2)
    prompts = captions + ["a red square"] * 4  # the same images under a caption none of them fits
    images = torch.cat([images, images])
    table, by_form = judge_tables(judge, images, prompts)
    assert list(by_form) == ["plain", "size", "background", "relation"]
    assert [by_form[f]["mean"] for f in by_form] == [0.2, 1.0, 1.0, 1.0]  # plain: 1 of its 5 images
    assert [by_form[f]["n"] for f in by_form] == [5, 1, 1, 1]
    assert table["correct"]["mean"] == 0.5
    assert judge_tables(judge, images[:1], ["a photo of a cat"]) == (None, None)
    assert judge_tables(None, images[:1], ["a red circle"]) == (None, None)  # a policy kind without a judge
    assert judge_tables(judge, images[:1], ["A Red  circle"])[1]["plain"]["mean"] == 1.0  # read as the policy reads it


def test_eval_params_take_the_given_then_the_headline_then_the_training_temperature():
    cfg = load_config(None, ["sample.temperature=0.9", "sample.top_k=32", "log.eval_temperatures=[0.7,1.0]"])
    assert (eval_params(cfg).temperature, eval_params(cfg, 0.5).temperature) == (0.7, 0.5)
    assert eval_params(cfg).top_k == 32  # only the temperature changes
    assert eval_params(load_config(None, ["sample.temperature=0.9"])).temperature == 0.9
