"""The end-of-run report (evaluation/report.py) of conftest.py's micro_run: report.md prints eval.json's numbers
for each eval set under that set's heading, and counts the prompts the run's prompt files hold."""

from grpo_vision.evaluation.report import headline_view, read_eval
from grpo_vision.prompts import load_prompts


def headline(run):
    """The run's eval.json as report.md's text reads it: the test set's numbers at the top, the other sets by name."""
    return headline_view(read_eval(run / "eval.json"))


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
    by_form = headline(micro_run)["models"]["policy"]["judge_by_form"]
    assert by_form and set(by_form) <= {"plain", "size", "background", "relation"}


def test_the_headline_is_the_first_eval_temperature_and_every_temperature_is_tabled(micro_run):
    result = read_eval(micro_run / "eval.json")
    assert (result["temperature"], result["train_temperature"]) == (0.7, 1.0)
    assert list(result["by_temperature"]) == ["0.7", "1.0"]
    assert result["by_temperature"]["0.7"] == result["sets"]["test"]
    report = (micro_run / "report.md").read_text()
    assert "sampled at temperature 0.7 (training sampled at 1.0)" in report
    assert "## By sampling temperature" in report and "| 1.0 |" in report


def test_the_report_tells_the_story_then_tables_test_prompts_then_held_out_compositions(micro_run):
    # two eval sets: test prompts (the headline) and held-out compositions (transfer), fixed in the run
    assert list(read_eval(micro_run / "eval.json")["sets"]) == ["test", "heldout", "train_sample"]
    result = headline(micro_run)
    assert result["heldout"]["prompts"] == result["prompts"]
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


def copied_run(micro_run, tmp_path):
    """A copy of the micro run (tests never write into it) without the report and eval.json it wrote."""
    import shutil

    run = tmp_path / micro_run.name
    shutil.copytree(micro_run, run)
    for name in ("report.md", "eval.json", "final_samples.png"):
        (run / name).unlink()
    return run


def test_report_run_writes_the_report_training_wrote_without_training(micro_run, tmp_path, monkeypatch):
    """report.md came only from training's end: rewriting it took `train --resume` (the accelerator, the optimizer,
    the memory estimate). `grpo-vision report RUN` writes it from the checkpoint, with the numbers training wrote."""
    from grpo_vision.cli import main
    import grpo_vision.step.setup as setup

    run = copied_run(micro_run, tmp_path)
    monkeypatch.setattr(setup, "set_up", None)  # training's set-up is not called
    main(["report", str(run)])
    assert (run / "report.md").read_text() == (micro_run / "report.md").read_text()
    written, trained = (read_eval(r / "eval.json") for r in (run, micro_run))
    assert written == {**trained, "run": str(run)}  # the numbers and keys; the run where it now lies
    assert (run / "final_samples.png").read_bytes() == (micro_run / "final_samples.png").read_bytes()
    assert not (run / "run.lock").read_text()  # released


def test_report_run_reports_a_stopped_run_at_its_last_checkpoint(micro_run, tmp_path):
    """A run stopped before its last step has no report; `report RUN` writes one from its last checkpoint."""
    import shutil

    from grpo_vision.cli import main

    run = copied_run(micro_run, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_000002")
    main(["report", str(run)])
    assert read_eval(run / "eval.json")["step"] == 1
    assert "## Test prompts" in (run / "report.md").read_text()


def test_report_run_refuses_a_run_a_train_holds_naming_its_pid(micro_run, tmp_path, capsys):
    import os

    import pytest

    from grpo_vision.cli import main
    from grpo_vision.run.lock import RunLock

    run = copied_run(micro_run, tmp_path)
    lock = RunLock(run, fresh=False)  # as a running train holds it
    try:
        with pytest.raises(SystemExit) as stop:
            main(["report", str(run)])
    finally:
        lock.release()
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1
    assert f"report: {run} is in use by a running train (pid {os.getpid()} on " in err and "once it ends" in err
    assert not (run / "report.md").exists()


def old_shape(result: dict) -> dict:
    """An eval.json as the report wrote it before it and `eval` shared one result (evaluation/report.py then)."""
    sets = result["sets"]
    return {**sets["test"], "eval_set": "test", "temperature": result["temperature"],
            "train_temperature": result["train_temperature"], "by_temperature": result["by_temperature"],
            **{k: sets[k] for k in ("heldout", "train_sample")}}


def test_an_eval_json_of_the_old_shape_is_read_in_the_new_one(micro_run, tmp_path):
    import json

    new = read_eval(micro_run / "eval.json")
    (tmp_path / "eval.json").write_text(json.dumps(old_shape(new)))
    old = read_eval(tmp_path / "eval.json")
    assert old == {**new, "run": None, "step": None, "device": None}
    assert headline_view(old) == headline_view(new)  # report.md's text reads both alike
