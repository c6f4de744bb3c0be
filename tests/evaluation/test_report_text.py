"""report.md's words from eval.json's numbers: units, the judge's duplicate row, "What changed"."""

from grpo_vision.evaluation.report_text import (change_table, duplicate_of_judge, failure_sentences, rate_change,
                                                reward_change, rollout_trend, what_changed)


def entry(mean, lo, hi):
    return {"mean": mean, "ci95": [lo, hi], "n": 256}


def result():
    """The main job's shape: CLIP and the aesthetic head trained, the judge's rate as a monitored reward;
    colour and relation fall beyond their intervals while count rises (the issue's hacked run)."""
    judge = {"correct": (entry(0.242, 0.19, 0.29), entry(0.371, 0.31, 0.43)),
             "count": (entry(0.70, 0.64, 0.76), entry(0.85, 0.81, 0.89)),
             "color": (entry(0.80, 0.75, 0.85), entry(0.675, 0.62, 0.73)),
             "relation": (entry(0.60, 0.45, 0.75), entry(0.397, 0.25, 0.55))}
    rewards = {"clip": (entry(0.644, 0.63, 0.66), entry(0.695, 0.68, 0.71)),
               "aesthetic": (entry(7.92, 7.8, 8.0), entry(8.35, 8.2, 8.5)),
               "shapes_exact": judge["correct"]}
    models = {m: {"rewards": {k: v[i] for k, v in rewards.items()}, "judge": {k: v[i] for k, v in judge.items()}}
              for i, m in enumerate(("reference", "policy"))}
    return {"models": models, "prompts": 128, "captions": 76,
            "difference_ci": {"clip": entry(0.051, 0.014, 0.088), "aesthetic": entry(0.43, 0.33, 0.53),
                              "shapes_exact": entry(0.129, 0.06, 0.198)},
            "judge_difference_ci": {"correct": entry(0.129, 0.06, 0.198), "count": entry(0.15, 0.08, 0.22),
                                      "color": entry(-0.125, -0.2, -0.05), "relation": entry(-0.203, -0.38, -0.03)}}


def test_units_one_per_quantity():
    assert reward_change(entry(0.05123, 0.0141, 0.0883)) == "+0.051 [+0.014, +0.088]"
    assert rate_change(entry(0.129, 0.06, 0.198)) == "+12.9 pts [+6.0, +19.8]"  # accuracies in points


def test_the_judge_as_a_reward_is_one_row_not_two():
    r = result()
    assert duplicate_of_judge(r) == "shapes_exact"
    table = "\n".join(change_table(r))
    assert "| shapes_exact |" not in table
    assert "| judge: all attributes right (= reward `shapes_exact`) | 24.2% [19.0, 29.0] | 37.1% [31.0, 43.0] | " \
           "+12.9 pts [+6.0, +19.8] |" in table
    assert "| clip | 0.644 [0.630, 0.660] | 0.695 [0.680, 0.710] | +0.051 [+0.014, +0.088] |" in table


def test_what_changed_names_rises_falls_hacking_and_the_kl():
    text = " ".join(what_changed(result(), ["clip", "aesthetic"], ["shapes_exact"], [0.05, 0.20, 0.144]))
    assert "The trained rewards clip and aesthetic rose (clip +0.051 [+0.014, +0.088]; aesthetic +0.430" in text
    assert "from 24.2% to 37.1% (+12.9 pts [+6.0, +19.8], 76 captions)" in text
    assert "Rose beyond their intervals: count +15.0 pts" in text
    assert "Fell beyond their intervals: color -12.5 pts [-20.0, -5.0]; relation -20.3 pts" in text
    assert "**Possible reward hacking:** clip and aesthetic rose while the judge's color and relation accuracy fell" \
        in text
    assert "KL to the reference of 0.144 per token at the last step (max 0.200)" in text
    assert "shapes_exact rose" not in text  # the judge's own rate is said once, as the judge's
    assert "within their intervals" not in text  # every attribute that moved, moved beyond its interval


def test_no_hacking_line_when_nothing_independent_falls():
    r = result()
    r["judge_difference_ci"]["color"] = entry(-0.05, -0.12, 0.02)  # inside its interval: not a fall
    r["judge_difference_ci"]["relation"] = entry(0.01, -0.1, 0.12)
    text = " ".join(what_changed(r, ["clip", "aesthetic"], [], []))
    assert "reward hacking" not in text and "Fell beyond" not in text and "KL" not in text
    # colour's -5 points is said as unresolved; relation's +1 is too small to mention
    assert "Moved 5 points or more but within their intervals (more images would tell): color -5.0 pts " \
           "[-12.0, +2.0]." in text


def test_the_all_right_rate_is_named_apart_and_a_zero_width_interval_says_nothing():
    r = result()
    r["judge_difference_ci"]["correct"] = entry(-0.05, -0.09, -0.01)
    r["judge_difference_ci"]["count"] = entry(-0.03, -0.03, -0.03)  # identical differences: no width
    text = " ".join(what_changed(r, ["clip", "aesthetic"], [], []))
    assert "rose while the judge's all-attributes-right rate and the judge's color and relation accuracy fell" in text
    assert "count" not in text.split("**Possible reward hacking:**")[1]


def test_intervals_say_how_many_captions_they_rest_on():
    r = result()
    assert "95% interval over 76 captions" in change_table(r)[0]
    assert "(+12.9 pts [+6.0, +19.8], 76 captions)" in what_changed(r, ["clip"], [], [])[2]


def test_rollout_trend_by_hand():
    # 8 steps: quarters of 2; first 0.2, 0.4 (mean 0.3, var 0.02), last 0.5, 0.7 (mean 0.6, var 0.02)
    rows = [{"reward/j/mean": v} for v in (0.2, 0.4, 0.3, 0.3, 0.3, 0.3, 0.5, 0.7)]
    t = rollout_trend(rows, "j")
    assert (round(t["first"], 6), round(t["last"], 6), t["steps"]) == (0.3, 0.6, 2)
    half = 1.96 * (0.02 / 2 + 0.02 / 2) ** 0.5  # Welch: sqrt(var1/n1 + var2/n2) = sqrt(0.02) = 0.1414
    assert [round(x, 6) for x in t["change"]["ci95"]] == [round(0.3 - half, 6), round(0.3 + half, 6)]
    assert rollout_trend(rows[:7], "j") is None  # fewer than 8 logged steps say nothing


def test_a_flat_judge_on_the_rollouts_is_named_when_the_rewards_rose():
    flat = [{"reward/j/mean": v} for v in (0.23, 0.27, 0.22, 0.27, 0.22, 0.24, 0.25, 0.24)]
    text = what_changed(result(), ["clip", "aesthetic"], [], [], rollout_trend(flat, "j"))[2]
    assert "**On its own training rollouts the judge did not move** (25.0% over the first 2 steps' rollouts" in text
    assert "while clip and aesthetic rose" in text
    rising = [{"reward/j/mean": v} for v in (0.20, 0.21, 0.25, 0.27, 0.30, 0.33, 0.40, 0.41)]
    text = what_changed(result(), ["clip", "aesthetic"], [], [], rollout_trend(rising, "j"))[2]
    assert "did not move" not in text and "On the training rollouts the judge's rate was 20.5%" in text


def test_the_reasons_of_failing_clauses_are_said_by_kind_with_the_most_frequent():
    r = result()
    r["reasons"] = {"geneval": {
        "kinds": ["object", "position"], "images": 256,
        "reference": {"failing": {"object": 0.3, "position": 0.5}, "common": []},
        "policy": {"failing": {"object": 0.25, "position": 0.2},
                   "common": [["expected dog right of target, found left of", 31], ["expected cat>=1, found 0", 9]]},
        "change": {"object": entry(-0.05, -0.12, 0.02), "position": entry(-0.3, -0.41, -0.19)}}}
    said = " ".join(failure_sentences(r))
    assert ("Images failing a clause of geneval's, by what failed (reference -> policy): object 30.0% -> 25.0% "
            "(-5.0 pts [-12.0, +2.0]); position 50.0% -> 20.0% (-30.0 pts [-41.0, -19.0]).") in said
    assert "Beyond their intervals: fewer position failures." in said  # object's interval holds 0
    assert 'The policy\'s most frequent: "expected dog right of target, found left of" (31 of 256 images).' in said
    assert said in " ".join(what_changed(r, ["geneval"], [], []))
    r["reasons"]["geneval"]["kinds"] = []
    assert failure_sentences(r) == ["No image failed a clause of geneval's, on either side."]
    assert failure_sentences(result()) == []  # no reward gave reasons


def one_caption():
    """The README's GRPOTrainer example as it was: one eval prompt x 4 images; brightness rose, the judge fell from
    100% to 50%; a change over one caption has no interval (intervals.caption_interval: ci95 None)."""
    r = result()
    r["prompts"] = r["captions"] = 1
    r["models"]["reference"]["rewards"] = {"brightness": {"mean": 0.40, "ci95": [0.38, 0.42], "n": 4}}
    r["models"]["policy"]["rewards"] = {"brightness": {"mean": 0.46, "ci95": [0.44, 0.48], "n": 4}}
    r["models"]["reference"]["judge"]["correct"] = {"mean": 1.0, "ci95": [1.0, 1.0], "n": 4}
    r["models"]["policy"]["judge"]["correct"] = {"mean": 0.5, "ci95": [0.0, 1.0], "n": 4}
    r["difference_ci"] = {"brightness": {"mean": 0.06, "ci95": None, "n": 4, "captions": 1}}
    r["judge_difference_ci"] = {"correct": {"mean": -0.5, "ci95": None, "n": 4, "captions": 1}}
    return r


def test_a_change_over_one_caption_says_it_has_no_interval_and_is_not_called_flat():
    r = one_caption()
    table = "\n".join(change_table(r))
    assert "nan" not in table
    assert "| brightness | 0.400 [0.380, 0.420] | 0.460 [0.440, 0.480] | +0.060 (no interval: 1 caption) |" in table
    assert "-50.0 pts (no interval: 1 caption) |" in table
    text = " ".join(what_changed(r, ["brightness"], [], [0.01]))
    assert "nan" not in text and "did not move" not in text
    assert ("The trained reward brightness changed by +0.060 (no interval: 1 caption), which 1 caption "
            "cannot tell from noise: evaluate on more prompts") in text
    assert "went from 100.0% to 50.0% (-50.0 pts (no interval: 1 caption), 1 caption)" in text
    # the hacking line rests on intervals over prompts: not named, but the pattern is, with why it is not
    assert "**Possible reward hacking:**" not in text
    assert "Up on brightness and down on the judge's rate is the pattern of reward hacking; the report names it " \
           "only when intervals over prompts show both changes, and here neither has one." in text
    assert "95% interval over 1 caption)" in table
    # two captions give an interval: then the same changes are a rise, a fall, and the hacking line
    r["captions"] = r["prompts"] = 2
    r["difference_ci"]["brightness"] |= {"ci95": [0.03, 0.09], "captions": 2}
    r["judge_difference_ci"]["correct"] |= {"ci95": [-0.75, -0.25], "captions": 2}
    text = " ".join(what_changed(r, ["brightness"], [], []))
    assert "The trained reward brightness rose (brightness +0.060 [+0.030, +0.090])" in text
    assert "**Possible reward hacking:** brightness rose while the judge's all-attributes-right rate fell" in text
    assert "pattern of reward hacking" not in text


def test_a_value_over_one_image_says_so():
    assert reward_change({"mean": 0.5, "ci95": [float("nan"), float("nan")], "n": 1}) == "+0.500 (no interval: 1 image)"


def test_a_change_that_prints_as_zero_is_not_a_rise_or_a_fall():
    """Two smoke steps move the weights a little: every paired difference of one sign, an interval that
    excludes 0 by 1e-6, printed as -0.000 [-0.000, -0.000]. That is not called a fall (nor a rate's 0.04 points a rise)."""
    r = result()
    r["difference_ci"] = {"clip": entry(-2e-6, -3e-6, -1e-6), "aesthetic": entry(1e-6, 5e-7, 2e-6)}
    r["judge_difference_ci"] = {"correct": entry(0.0004, 0.0001, 0.0007)}
    text = " ".join(what_changed(r, ["clip", "aesthetic"], [], []))
    assert " rose" not in text and " fell" not in text
    assert "The trained rewards clip and aesthetic did not move beyond their intervals." in text
    r["difference_ci"]["clip"] = entry(0.002, 0.0006, 0.0034)  # +0.002 [+0.001, +0.003]: shown, and a rise
    assert "The trained reward clip rose" in " ".join(what_changed(r, ["clip", "aesthetic"], [], []))


def test_an_attribute_change_with_an_interval_of_no_width_is_not_called_within_it():
    """Six eval prompts, two of which name a size: size -25 points on each, an interval [-25, -25] that says
    nothing about noise, was 'within their intervals (more images would tell)'."""
    r = result()
    r["judge_difference_ci"] = {"correct": entry(0.0, -0.083, 0.083), "size": entry(-0.25, -0.25, -0.25),
                                "color": entry(0.083, -0.05, 0.2), "count": {"mean": 0.5, "ci95": None, "captions": 1}}
    text = " ".join(what_changed(r, ["clip"], [], []))
    assert "Moved 5 points or more but within their intervals (more images would tell): color +8.3 pts " \
           "[-5.0, +20.0]." in text
    assert "Moved 5 points or more on too few captions to tell from noise (more prompts that name them would " \
           "tell): size -25.0 pts [-25.0, -25.0]; count +50.0 pts (no interval: 1 caption)." in text
