"""Run health: finite weights, steps that cannot teach, skipped updates in a row, the end-of-run warnings."""

import math

import pytest
import torch

from grpo_vision.run.health import RunHealth, learning_warnings, run_summary, weights_finite

NAN = math.nan


def test_weights_finite_sees_nan_and_inf_and_trusts_huge_finite_weights():
    assert weights_finite([torch.ones(3), torch.zeros(2, 2)])
    assert not weights_finite([torch.ones(3), torch.tensor([0.0, NAN])])
    assert not weights_finite([torch.tensor([-math.inf, 1.0])])
    # float32 holds 1e30, but its norm overflows: sqrt(4 * 1e60) > 3.4e38. The full read says finite.
    huge = torch.full((4,), 1e30)
    assert math.isinf(torch._foreach_norm([huge])[0].item()) and weights_finite([huge])
    assert weights_finite([])


def test_a_step_without_any_trained_reward_is_counted_and_warned_about_once(capsys):
    health = RunHealth(None, max_skipped=0, loud=True)
    total = torch.full((4,), NAN)  # two groups of 2; reward 'a' is trained (weight 1) and NaN everywhere
    raw, weights = {"a": torch.full((4,), NAN), "m": torch.ones(4)}, {"a": torch.ones(4), "m": torch.zeros(4)}
    for step in range(2):
        metrics = health.after_rewards(step, total, raw, weights, frac_zero_std=1.0)
    assert metrics == {"train/skipped_updates": 0, "train/steps_no_spread": 2, "train/steps_without_signal": 2}
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1  # not again at step 2
    assert "step 1 has nothing to learn from: the trained rewards ('a') returned NaN for every image they weigh" in err
    assert "'m'" not in err  # monitored (weight 0): its values teach nothing anyway


def test_a_trained_reward_that_never_applies_is_named_when_others_still_teach(capsys):
    health = RunHealth(None, max_skipped=0, loud=True)
    raw = {"a": torch.full((4,), NAN), "b": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    weights = {"a": torch.ones(4), "b": torch.ones(4)}
    health.after_rewards(0, raw["b"], raw, weights, frac_zero_std=0.0)
    err = capsys.readouterr().err
    assert "step 1: reward(s) 'a' returned NaN (does not apply) for every image they are trained on" in err
    assert health.counters["steps_without_signal"] == 0


def test_all_zero_entry_weights_are_named_as_the_reason(capsys):
    health = RunHealth(None, max_skipped=0, loud=True)
    health.after_rewards(0, torch.full((4,), NAN), {"a": torch.ones(4)}, {"a": torch.zeros(4)}, frac_zero_std=1.0)
    assert "every prompt entry of the step gives weight 0 to every reward" in capsys.readouterr().err
    assert health.counters["steps_without_signal"] == 1


def test_a_step_without_spread_is_counted_and_one_with_spread_is_not(capsys):
    health = RunHealth(None, max_skipped=0, loud=True)
    raw, weights = {"a": torch.tensor([1.0, 2.0, 3.0, 3.0])}, {"a": torch.ones(4)}
    # group 1 spreads (1 vs 2), group 2 does not: half the groups have zero std, the step still teaches
    health.after_rewards(0, raw["a"], raw, weights, frac_zero_std=0.5)
    assert health.counters["steps_no_spread"] == 0 and capsys.readouterr().err == ""
    flat = {"a": torch.tensor([1.0, 1.0, 3.0, 3.0])}
    health.after_rewards(1, flat["a"], flat, weights, frac_zero_std=1.0)
    health.after_rewards(2, flat["a"], flat, weights, frac_zero_std=1.0)
    assert (health.counters["steps_no_spread"], health.counters["steps_without_signal"]) == (2, 0)
    assert capsys.readouterr().err.count("in every group all images got the same reward") == 1
    quiet = RunHealth(None, max_skipped=0, loud=False)  # processes other than the main one count silently
    quiet.after_rewards(0, flat["a"], flat, weights, frac_zero_std=1.0)
    assert quiet.counters["steps_no_spread"] == 1 and capsys.readouterr().err == ""


@pytest.mark.parametrize("max_skipped, applied, stops", [
    (3, [False, False, True, False, False], False),  # the applied update ends the streak at 2
    (3, [False, False, True, False, False, False], True),
    (0, [False] * 10, False),  # 0 = never stop
])
def test_skipped_updates_in_a_row_stop_the_run(max_skipped, applied, stops):
    health = RunHealth(None, max_skipped=max_skipped, loud=False)
    for a in applied:
        health.after_update(a)
    assert health.too_many_skipped() == stops
    assert health.counters["skipped_updates"] == applied.count(False)


def test_the_end_of_run_summary_says_what_was_not_learned():
    clean = {"step": 4, "train/skipped_updates": 0, "train/steps_no_spread": 1, "train/steps_without_signal": 0}
    assert run_summary([clean], updates_per_step=2) == (0, 8, ["1 of 4 steps had no reward spread in any group: "
                                                              "every advantage 0"])
    assert run_summary([], updates_per_step=2) == (0, 0, [])
    everything = {"step": 2, "train/skipped_updates": 4, "train/steps_no_spread": 2, "train/steps_without_signal": 2}
    w = learning_warnings(everything, updates_per_step=2)
    assert w[0].startswith("every one of the 4 optimizer updates was skipped")
    assert w[1].startswith("2 of 2 steps had no trained reward for any image")
    assert len(w) == 2  # the steps without signal are not named again as steps without spread
    flat = {"step": 2, "train/steps_no_spread": 2, "train/steps_without_signal": 1}
    assert learning_warnings(flat, 2) == ["1 of 2 steps had no trained reward for any image (NaN, or weight 0): "
                                          "nothing to learn from",
                                          "no step had a reward spread in any group: the rewards taught the policy "
                                          "nothing"]
    assert learning_warnings({"step": 3, "train/skipped_updates": 1}, 2) == [
        "1 of 6 optimizer updates were skipped (non-finite loss or gradient)"]
