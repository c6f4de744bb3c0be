"""The end-of-run report (evaluation/report.py) of conftest.py's micro_run: report.md prints eval.json's numbers
for each eval set under that set's heading, and counts the prompts the run's prompt files hold."""

import json

from grpo_vision.prompts import load_prompts


def section(report: str, heading: str) -> str:
    """The text under `## heading`, up to the next heading."""
    start = report.index(f"\n## {heading}\n")
    end = report.find("\n## ", start + 1)
    return report[start:] if end == -1 else report[start:end]


def table(text: str) -> dict[str, list[str]]:
    """The rows of the tables in `text`: first cell -> the others."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ")]
    return {cells[0]: cells[1:] for cells in rows}


# report_text.py's units: a reward in its own units to 3 decimals, the judge's rate in percent (its interval kept
# in [0, 100]), a change in points
def reward(e):
    return f"{e['mean']:.3f} [{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}]"


def reward_change(e):
    return f"{e['mean']:+.3f} [{e['ci95'][0]:+.3f}, {e['ci95'][1]:+.3f}]"


def rate(e):
    lo, hi = max(e["ci95"][0], 0.0), min(e["ci95"][1], 1.0)
    return f"{100 * e['mean']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def rate_change(e):
    return f"{100 * e['mean']:+.1f} pts [{100 * e['ci95'][0]:+.1f}, {100 * e['ci95'][1]:+.1f}]"


def test_the_report_tables_the_checker_by_prompt_form(micro_run):
    report = (micro_run / "report.md").read_text()
    assert "Exact checker" in report and "All attributes right, by prompt form" in report
    by_form = json.loads((micro_run / "eval.json").read_text())["models"]["policy"]["judge_by_form"]
    assert by_form and set(by_form) <= {"plain", "size", "background", "relation"}


def test_the_headline_is_the_first_eval_temperature_and_every_temperature_is_tabled(micro_run):
    result = json.loads((micro_run / "eval.json").read_text())
    assert (result["temperature"], result["train_temperature"]) == (0.7, 1.0)
    assert list(result["by_temperature"]) == ["0.7", "1.0"]
    assert result["by_temperature"]["0.7"]["models"] == result["models"]
    report = (micro_run / "report.md").read_text()
    assert "sampled at temperature 0.7 (training sampled at 1.0)" in report
    assert "## By sampling temperature" in report and "| 1.0 |" in report


def test_the_report_tells_the_story_then_tables_test_prompts_then_held_out_compositions(micro_run):
    # two eval sets: test prompts (the headline) and held-out compositions (transfer), fixed in the run
    result = json.loads((micro_run / "eval.json").read_text())
    assert result["eval_set"] == "test" and result["heldout"]["prompts"] == result["prompts"]
    report = (micro_run / "report.md").read_text()
    assert report.index("## What changed") < report.index("## Test prompts") < \
        report.index("## Transfer: held-out compositions")
    # each set counted from the run's own prompt files: prompts, distinct captions
    sets = {"test": result, "heldout": result["heldout"], "train_sample": result["train_sample"]}
    for name, r in sets.items():
        entries = load_prompts(micro_run / "prompts" / f"{name}.jsonl")
        assert (r["prompts"], r["captions"]) == (len(entries), len({e.prompt for e in entries}))
    n = result["images_per_prompt"]
    assert (f"Evaluation: {result['prompts']} test prompts ({result['captions']} distinct captions of the training "
            f"prompts' distribution, never trained on; prompts/test.jsonl) x {n} images") in report
    held = section(report, "Transfer: held-out compositions")
    assert f"\n{result['heldout']['prompts']} prompts that no model trained on (prompts/heldout.jsonl)" in held
    # each set's section tables that set's eval.json numbers (the sets' clip means differ: a swap shows)
    assert len({r["models"]["policy"]["rewards"]["clip"]["mean"] for r in sets.values()}) == 3
    for heading, r in (("Test prompts", result), ("Transfer: held-out compositions", result["heldout"]),
                       ("Training prompts (a sample)", result["train_sample"])):
        text = section(report, heading)
        rows, (ref, pol) = table(text), (r["models"][m] for m in ("reference", "policy"))
        assert f"| change (paired; 95% interval over {r['captions']} captions) |" in text
        for name in ("clip", "aesthetic"):
            assert rows[name] == [reward(ref["rewards"][name]), reward(pol["rewards"][name]),
                                  reward_change(r["difference_ci"][name])]
        # shapes_exact is the judge's all-right rate itself: one row, in percent
        assert "shapes_exact" not in rows
        assert rows["judge: all attributes right (= reward `shapes_exact`)"] == [
            rate(ref["judge"]["correct"]), rate(pol["judge"]["correct"]), rate_change(r["judge_difference_ci"]["correct"])]
    # the table of sets: each set's captions (prompts x images) and the judge's rates
    by_set = table(section(report, "What changed"))
    for label, r in (("training prompts (a sample)", result["train_sample"]), ("test prompts (the headline)", result),
                     ("held-out compositions", result["heldout"])):
        ref, pol = (r["models"][m]["judge"]["correct"] for m in ("reference", "policy"))
        assert by_set[label] == [f"{r['captions']} ({r['prompts']} x {n})", rate(ref), rate(pol),
                                 rate_change(r["judge_difference_ci"]["correct"]),
                                 rate_change(r["judge_difference_ci_per_image"]["correct"])]
