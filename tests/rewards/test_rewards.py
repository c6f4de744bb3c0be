"""Rewards: the registry, the weighted composite with per-entry routing, and the built-in rewards."""

import math

import numpy as np
import pytest
import torch

from grpo_vision.config import ConfigError
from grpo_vision.rewards import CompositeReward, RewardContext, RewardError, available_rewards, make_reward
from grpo_vision.shapes.data import to_tensor
from grpo_vision.shapes.layout import scene_for_caption
from grpo_vision.shapes.scene import render

CTX = RewardContext()


def constant(images, prompts, metadata):  # used as python:tests.rewards.test_rewards:constant
    return torch.full((len(prompts),), 2.0)


def not_applicable_to_odd(images, prompts, metadata):
    return torch.tensor([1.0 if i % 2 == 0 else math.nan for i in range(len(prompts))])


def minus_inf_for_b(images, prompts, metadata):
    return torch.tensor([-math.inf if p == "b" else 1.0 for p in prompts])


def broken(images, prompts, metadata):
    raise RuntimeError("model exploded")


class Explains:  # a reward that says why an image lost points (rewards/base.py: last_reasons)
    def __call__(self, images, prompts, metadata):
        self.last_reasons = [[("count", f"too few in {p}")] if p == "b" else [] for p in prompts]
        return torch.tensor([0.0 if p == "b" else 1.0 for p in prompts])


EXPLAINS = Explains()  # used as python:tests.rewards.test_rewards:EXPLAINS


def test_unknown_name_lists_the_registered_rewards():
    with pytest.raises(ConfigError) as err:
        make_reward("clipp", CTX)
    message = str(err.value)
    assert "unknown reward 'clipp'" in message
    for name in ("jpeg_compressibility", "shapes_exact", "python:<module>:<function>"):
        assert name in message
    assert set(available_rewards()) >= {"jpeg_compressibility", "jpeg_incompressibility", "shapes_exact"}


def test_python_rewards_import_a_users_callable():
    fn = make_reward("python:tests.rewards.test_rewards:constant", CTX)
    assert fn(torch.zeros(3, 3, 8, 8), ["a"] * 3, [{}] * 3).tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ConfigError, match="cannot import nope from tests.rewards.test_rewards"):
        make_reward("python:tests.rewards.test_rewards:nope", CTX)
    with pytest.raises(ConfigError, match="must look like python:package.module:function"):
        make_reward("python:tests.rewards.test_rewards", CTX)


def test_composite_weights_raw_values_and_nan_means_does_not_apply():
    reward = CompositeReward({"python:tests.rewards.test_rewards:constant": 0.5,
                              "python:tests.rewards.test_rewards:not_applicable_to_odd": 2.0}, [], CTX)
    out = reward(torch.zeros(4, 3, 8, 8), ["p"] * 4, [{}] * 4)
    # Even samples: 0.5 * 2 + 2 * 1 = 3; odd samples: the second reward does not apply -> 0.5 * 2 = 1.
    assert out.total.tolist() == [3.0, 1.0, 3.0, 1.0]
    assert out.raw["python:tests.rewards.test_rewards:constant"].tolist() == [2.0] * 4
    assert math.isnan(out.raw["python:tests.rewards.test_rewards:not_applicable_to_odd"][1])


def test_per_entry_weights_route_rewards_and_monitors_carry_no_weight():
    reward = CompositeReward({"python:tests.rewards.test_rewards:constant": 1.0}, ["jpeg_compressibility"], CTX)
    reward.add(["python:tests.rewards.test_rewards:not_applicable_to_odd"])
    entry = [None, {"python:tests.rewards.test_rewards:not_applicable_to_odd": 1.0}, None,
             {"python:tests.rewards.test_rewards:not_applicable_to_odd": 1.0}]
    out = reward(torch.rand(4, 3, 16, 16), ["p"] * 4, [{}] * 4, entry)
    # Rows 0, 2 use the defaults (constant 2.0); row 1 routes to a reward that does not apply -> NaN;
    # row 3 would too, as its only weighted reward is NaN for odd indices.
    assert out.total[0].item() == 2.0 and out.total[2].item() == 2.0
    assert math.isnan(out.total[1]) and math.isnan(out.total[3])
    assert "jpeg_compressibility" in out.raw  # monitored: logged, weight 0


def test_a_failing_reward_is_named():
    reward = CompositeReward({"python:tests.rewards.test_rewards:broken": 1.0}, [], CTX)
    with pytest.raises(RewardError, match="reward 'python:tests.rewards.test_rewards:broken' failed: RuntimeError: model exploded"):
        reward(torch.zeros(2, 3, 8, 8), ["a", "b"], [{}, {}])


def test_an_infinite_reward_is_an_error_naming_the_reward_and_the_prompt():
    # NaN means "does not apply"; inf has no such meaning, and one inf makes a group's advantages NaN
    reward = CompositeReward({"python:tests.rewards.test_rewards:constant": 1.0}, ["python:tests.rewards.test_rewards:minus_inf_for_b"],
                             CTX)  # even a monitored reward: its logged mean would be -inf
    with pytest.raises(RewardError, match=r"reward 'python:tests.rewards.test_rewards:minus_inf_for_b' failed: returned -inf "
                                          r"for 2 of 3 images \(the first for prompt 'b'\); a reward must be finite"):
        reward(torch.zeros(3, 3, 8, 8), ["a", "b", "b"], [{}] * 3)


def test_the_output_carries_each_samples_weights():
    reward = CompositeReward({"python:tests.rewards.test_rewards:constant": 0.5}, ["python:tests.rewards.test_rewards:not_applicable_to_odd"],
                             CTX)
    out = reward(torch.zeros(2, 3, 8, 8), ["p"] * 2, [{}] * 2, [None, {"python:tests.rewards.test_rewards:constant": 0.0}])
    assert out.weights["python:tests.rewards.test_rewards:constant"].tolist() == [0.5, 0.0]
    assert out.weights["python:tests.rewards.test_rewards:not_applicable_to_odd"].tolist() == [0.0, 0.0]  # monitored
    assert out.total[0].item() == 1.0 and math.isnan(out.total[1])  # row 1 weighs nothing: no signal


def test_the_output_carries_the_reasons_of_the_rewards_that_give_them():
    reward = CompositeReward({"python:tests.rewards.test_rewards:EXPLAINS": 1.0, "python:tests.rewards.test_rewards:constant": 1.0},
                             [], CTX)
    out = reward(torch.zeros(3, 3, 8, 8), ["a", "b", "c"], [{}] * 3)
    assert out.reasons == {"python:tests.rewards.test_rewards:EXPLAINS": [[], [("count", "too few in b")], []]}


def test_jpeg_rewards_prefer_flat_images():
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    comp = make_reward("jpeg_compressibility", CTX)
    incomp = make_reward("jpeg_incompressibility", CTX)
    images = torch.cat([flat, noise])
    c, i = comp(images, ["a", "b"], [{}, {}]), incomp(images, ["a", "b"], [{}, {}])
    assert c[0] > c[1] and i[1] > i[0]
    torch.testing.assert_close(c, -i)


def test_shapes_exact_scores_renders_and_skips_foreign_captions():
    rng = np.random.default_rng(0)
    captions = ["a red circle", "a large blue square", "a green triangle on a black background"]
    images = to_tensor(np.stack([render(scene_for_caption(c, rng)) for c in captions]))
    fn = make_reward("shapes_exact", CTX)
    assert fn(images, captions, [{}] * 3).tolist() == [1.0, 1.0, 1.0]
    wrong = ["a blue circle", "a small blue square", "a photo of a cat"]
    out = fn(images, wrong, [{}] * 3)
    assert out[:2].tolist() == [0.0, 0.0] and math.isnan(out[2])
    # case and spacing do not matter, as for the policy and CLIP, which lowercase and split
    assert fn(images, ["A Red Circle", "a  large blue SQUARE", " a green triangle on a black background\n"],
              [{}] * 3).tolist() == [1.0, 1.0, 1.0]


def test_shapes_partial_is_the_share_of_the_captions_attributes_that_hold():
    rng = np.random.default_rng(0)
    captions = ["a red circle", "a large blue square", "a green triangle on a black background",
                "a red circle left of a blue square"]
    images = to_tensor(np.stack([render(scene_for_caption(c, rng)) for c in captions]))
    fn = make_reward("shapes_partial", CTX)
    assert fn(images, captions, [{}] * 4).tolist() == [1.0, 1.0, 1.0, 1.0]
    wrong = ["a blue circle",  # count, shape right; colour wrong: 2 of 3
             "a small blue square",  # count, colour, shape right; size wrong: 3 of 4
             "a green circle on a white background",  # count, colour right; shape, background wrong: 2 of 4
             "a red circle right of a blue square"]  # all but the relation: 3 of 4
    assert fn(images, wrong, [{}] * 4).tolist() == pytest.approx([2 / 3, 3 / 4, 2 / 4, 3 / 4])
    # a missing second object: count, colour, shape (over both objects) and relation all fail: 0
    assert fn(images[:1], ["a red circle above a green square"], [{}]).tolist() == [0.0]
    assert math.isnan(fn(images[:1], ["a photo of a cat"], [{}]).item())


def _canvas(*squares):
    """A white 64 px image with a filled square (colour, x0, y0, side) for each of `squares`."""
    from grpo_vision.shapes.scene import BACKGROUNDS, COLORS
    img = np.empty((64, 64, 3), np.uint8)
    img[:] = BACKGROUNDS["white"]
    for color, x0, y0, side in squares:
        img[y0:y0 + side, x0:x0 + side] = COLORS[color]
    return img


def test_shapes_plan_layout_is_the_iou_of_planned_and_drawn_boxes_over_the_larger_count():
    """GoT-R1's R_RI in ShapesWorld, worked by hand: "x5 y5" is the cell whose centre is (22, 22) px and a small
    object's planned side is 14 px (SIZES' middle), so the planned box is (15, 15, 14, 14)."""
    fn = make_reward("shapes_plan_layout", CTX)
    plan = "red square small x5 y5 white"
    exact = _canvas(("red", 15, 15, 14))
    shifted = _canvas(("red", 22, 15, 14))  # 7 px right: overlap 7 x 14 = 98 px, union 2 * 196 - 98 = 294
    extra = _canvas(("red", 22, 15, 14), ("blue", 40, 40, 10))  # the same plus a region the plan never asked for
    images = to_tensor(np.stack([exact, shifted, extra, exact, exact, exact]))
    plans = [plan, plan, plan, "blue square small x5 y5 white",  # right place, wrong colour: grounds to nothing
             "red circle big x5 y5 white",  # outside the plan grammar (no size "big"): 0
             None]  # drawn without a plan: the reward does not apply
    out = fn(images, ["a red square"] * 6, [{"plan": p} for p in plans])
    assert out[:5].tolist() == pytest.approx([1.0, 1 / 3, 1 / 6, 0.0, 0.0]) and math.isnan(out[5])
    # two planned objects, one drawn where planned and one missing: (1 + 0) / max(2 planned, 1 region)
    two = "red square small x5 y5 blue square small x12 y12 white"
    assert fn(images[:1], ["a red square above a blue square"], [{"plan": two}]).tolist() == pytest.approx([0.5])
    # each region grounds one planned object at most: two red squares planned, one drawn
    twice = "red square small x5 y5 red square small x5 y5 white"
    assert fn(images[:1], ["a red square"], [{"plan": twice}]).tolist() == pytest.approx([0.5])
    assert math.isnan(fn(images[:1], ["a red square"], [{}]).item())  # no plan key at all


def test_shapes_plan_layout_is_high_for_a_render_of_its_own_plan_and_low_for_another_layout():
    """A render of a scene against the scene's ground-truth plan scores what the cells' 4 px quantisation and the
    sizes' spread allow (0.58 or more on 500 scenes of the training distribution, mean 0.78); the same plan against
    another scene's render is far lower."""
    from grpo_vision.shapes.plan import scene_plan
    from grpo_vision.shapes.layout import sample_scene

    rng = np.random.default_rng(0)
    scenes = [sample_scene(rng)[0] for _ in range(40)]
    images = to_tensor(np.stack([render(s) for s in scenes]))
    plans = [" ".join(scene_plan(s)) for s in scenes]
    fn = make_reward("shapes_plan_layout", CTX)
    own = fn(images, ["a red circle"] * 40, [{"plan": p} for p in plans])
    other = fn(images, ["a red circle"] * 40, [{"plan": p} for p in plans[1:] + plans[:1]])
    assert own.min().item() > 0.5 and own.mean().item() > 0.7
    assert other.mean().item() < 0.2


def test_a_reward_that_reads_plans_is_refused_without_a_text_stage(capsys):
    """A weight on shapes_plan_layout (registered with reads_plan) in a run that samples no plan would score every
    image NaN and train nothing on it: `config` and `train` refuse it in one line naming the key. Monitoring it,
    a weight of 0, or a config with the text stage pass."""
    from grpo_vision.cli import main
    from grpo_vision.config import load_config
    from grpo_vision.rewards import check_options

    with pytest.raises(SystemExit) as exit_info:
        main(["config", "configs/shapes.yaml", "reward.weights={clip: 4.0, shapes_plan_layout: 8.0}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "grpo-vision: error: reward.weights.shapes_plan_layout: reward 'shapes_plan_layout' scores each image against "
        "its text plan, and this config samples none; set sample.plan.enabled=true (with a policy that plans) or drop "
        "the reward\n")
    check_options(load_config("configs/shapes.yaml", ["reward.weights={clip: 4.0, shapes_plan_layout: 0.0}",
                                                      "reward.monitor=[shapes_plan_layout]"]))
    check_options(load_config("configs/shapes_plan.yaml", ["reward.weights={clip: 4.0, shapes_plan_layout: 8.0}"]))


def test_rewards_find_each_images_plan_in_its_metadata():
    """rollouts.score hands each reward its image's plan as metadata["plan"] (beside the entry's own metadata,
    which it does not change), and nothing more for rollouts without a text stage."""
    from grpo_vision.prompts import PromptEntry
    from grpo_vision.rewards.base import REGISTRY, register_reward
    from grpo_vision.rollouts import score

    seen = []

    @register_reward("_sees_metadata")
    def _sees(ctx):
        def fn(images, prompts, metadata):
            seen.append([dict(m) for m in metadata])
            return torch.zeros(len(prompts))
        return fn

    try:
        entries = [PromptEntry("a red circle", metadata={"tag": "x"}), PromptEntry("a blue square")]
        rewards = CompositeReward({"_sees_metadata": 1.0}, [], CTX)
        images = torch.zeros(2, 3, 64, 64)
        score(rewards, images, entries, plans=["red circle small x1 y1 white", "blue square large x9 y9 gray"])
        score(rewards, images, entries)
    finally:
        REGISTRY.pop("_sees_metadata")
    assert seen == [[{"tag": "x", "plan": "red circle small x1 y1 white"}, {"plan": "blue square large x9 y9 gray"}],
                    [{"tag": "x"}, {}]]
    assert entries[0].metadata == {"tag": "x"}


def test_placebo_is_deterministic_uniform_and_blind_to_the_image():
    fn = make_reward("placebo", CTX)
    images = torch.rand(256, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    prompts = ["a red circle"] * 256
    scores = fn(images, prompts, [{}] * 256)
    assert scores.shape == (256,) and ((scores >= 0) & (scores < 1)).all()
    torch.testing.assert_close(fn(images, prompts, [{}] * 256), scores)  # same image, same score
    assert fn(images[:1], ["a blue square"], [{}]).item() != scores[0].item()  # the prompt counts
    # Uniform: mean 1/2, std 1/sqrt(12) = 0.289 (256 draws: the mean's std is 0.018)
    assert abs(scores.mean().item() - 0.5) < 0.08 and abs(scores.std().item() - 0.289) < 0.05
    # Carries no information: uncorrelated with brightness (|r| < 0.2 is over 3 sigma at n = 256)
    brightness = images.mean(dim=(1, 2, 3))
    r = torch.corrcoef(torch.stack([scores, brightness]))[0, 1].item()
    assert abs(r) < 0.2


def test_an_unknown_per_entry_reward_names_the_prompts_line():
    from grpo_vision.config import load_config
    from grpo_vision.prompts import PromptEntry

    cfg = load_config(None, ["reward.weights={jpeg_compressibility: 1.0}", "reward.monitor=[]"])
    entries = [PromptEntry("a red circle", {"jpeg_compressibility": 1.0}, line=1),
               PromptEntry("a blue square", {"clp": 1.0}, line=2)]
    with pytest.raises(ConfigError, match=r"line 2 \('a blue square'\): unknown reward 'clp'; registered"):
        CompositeReward.from_config(cfg.reward, "cpu", None, entries)


SCRIPT = """from __future__ import annotations
from dataclasses import dataclass

import torch

from grpo_vision import register_reward

SCALE = 2.0


@dataclass
class Offset:
    value: float = 1.0


def glow(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3)) * SCALE + Offset().value


@register_reward("beam")
def beam(ctx):
    return lambda images, prompts, metadata: images.mean(dim=(1, 2, 3)) * 0


MODEL = torch.nn.Linear(1, 1)  # made by a call: not run again


def heavy(images, prompts, metadata):
    return MODEL.weight.sum() * images.mean(dim=(1, 2, 3))


open(__file__ + ".ran", "a").write("trained once")
"""


def test_a_trusted_run_imports_its_recorded_rewards_again(tmp_path, monkeypatch):
    # a script's reward: the run folder keeps the script, and --trust-run defines the function from that copy by
    # running the script's imports, definitions (a @register_reward factory registers itself again) and constants
    # only: its top-level training line does not run again, and a global only that code makes is named in one
    # line; a module's reward: imported again from the folder recorded beside its spec, no longer on sys.path
    import json
    import runpy
    import sys

    from grpo_vision.config import load_config
    from grpo_vision.rewards import REGISTRY, check_rewards, register_callable, reward_origin, save_reward_origins
    from tests.helpers import MICRO

    script, mods, run = tmp_path / "train_it.py", tmp_path / "mods", tmp_path / "run"
    script.write_text(SCRIPT)
    mods.mkdir()
    (mods / "my_rewards.py").write_text("def shine(images, prompts, metadata):\n    return images.mean(dim=(1, 2, 3))\n")
    monkeypatch.setattr(sys, "argv", [str(script)])
    monkeypatch.syspath_prepend(str(mods))
    names = ["glow", "shine", "beam", "heavy"]
    cfg = load_config(MICRO, ["reward.weights={glow: 1.0, shine: 1.0, beam: 1.0}", "reward.monitor=[heavy]"])
    try:
        trained = runpy.run_path(str(script), run_name="__main__")  # the script trains: its rewards registered
        register_callable("glow", trained["glow"])
        register_callable("heavy", trained["heavy"])
        register_callable("shine", __import__("my_rewards").shine)
        save_reward_origins(run, cfg)
        records = json.loads((run / "rewards.json").read_text())
        assert records["glow"] == {"module": "__main__", "function": "glow", "script": "train_it.py",
                                   "code": "code/train_it.py"}
        assert records["beam"] == {**records["glow"], "function": "beam"}  # the factory the script registered
        assert records["shine"] == {"module": "my_rewards", "function": "shine", "spec": "python:my_rewards:shine",
                                    "path": str(mods.resolve())}
        # a later process: neither the script nor the module's folder is there
        script.unlink()
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(mods)])
        sys.modules.pop("my_rewards")
        for name in names:
            del REGISTRY[name]
        with pytest.raises(ConfigError, match="names reward 'glow' .*or pass --trust-run to import it as the run"):
            check_rewards(cfg, run)
        with pytest.raises(ConfigError, match="heavy in .*train_it.py reads MODEL, which the script makes by running "
                                              "code at its top level"):
            check_rewards(cfg, run, trust=True)
        del REGISTRY["glow"], REGISTRY["shine"], REGISTRY["beam"]
        check_rewards(load_config(MICRO, ["reward.weights={glow: 1.0, shine: 1.0, beam: 1.0}",
                                          "reward.monitor=[]"]), run, trust=True)
        images = torch.full((2, 3, 4, 4), 0.25)
        assert REGISTRY["glow"].factory(None)(images, ["a", "b"], [{}, {}]).tolist() == [1.5, 1.5]
        assert REGISTRY["shine"].factory(None)(images, ["a", "b"], [{}, {}]).tolist() == [0.25, 0.25]
        assert REGISTRY["beam"].factory(None)(images, ["a", "b"], [{}, {}]).tolist() == [0.0, 0.0]
        assert (tmp_path / "train_it.py.ran").read_text() == "trained once"  # defined, not run again
        assert reward_origin("glow") == records["glow"] and reward_origin("beam") == records["beam"]
    finally:
        for name in names:
            REGISTRY.pop(name, None)
        sys.modules.pop("my_rewards", None)
