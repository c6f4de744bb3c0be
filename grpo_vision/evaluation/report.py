"""The end-of-run report: `eval.json`, plots, and `report.md` that says what RL changed and what it cost."""

from __future__ import annotations

import json
from pathlib import Path

from grpo_vision.evaluation.evaluate import evaluate_loaded
from grpo_vision.evaluation.grid import save_sample_grid
from grpo_vision.step.load import LoadedRun
from grpo_vision.run.alerts import load_alerts, report_lines as alert_lines
from grpo_vision.run.health import run_summary
from grpo_vision.run.metrics import load_metrics
from grpo_vision.run.resumes import resume_lines
from grpo_vision.evaluation.plots import curves_figure, judge_figure, save_figure
from grpo_vision.evaluation.report_text import (change_table, duplicate_of_judge, interval_heading, plan_section,
                                                rate_change, rate_value, reward_change, reward_value, rollout_trend,
                                                what_changed)
from grpo_vision.files import write_file


def _temperature_table(by_temperature: dict) -> list[str]:
    """Both models at each eval temperature: the judge's all-attributes rate (where the policy kind has
    a judge) and each reward's mean."""
    first = next(iter(by_temperature.values()))
    names = [n for n in first["models"]["policy"]["rewards"] if n != duplicate_of_judge(first)]
    checked = bool(first["models"]["policy"]["judge"])
    head = ["temperature"] + (["judge: all right, reference -> policy"] if checked else []) + \
           [f"{n}: reference -> policy" for n in names]
    lines = ["", "## By sampling temperature", "",
             "The same prompts and seeds at each temperature; the first row is the tables above.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t, r in by_temperature.items():
        ref, pol = r["models"]["reference"], r["models"]["policy"]
        cells = [str(t)]
        if checked:
            a, b = ref["judge"]["correct"]["mean"], pol["judge"]["correct"]["mean"]
            cells.append(f"{100 * a:.1f}% -> {100 * b:.1f}% ({100 * (b - a):+.1f} pts)")
        for n in names:
            a, b = ref["rewards"][n]["mean"], pol["rewards"][n]["mean"]
            cells.append("n/a" if a is None or b is None else f"{a:.3f} -> {b:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


PLAN_EXAMPLES = 4  # test prompts whose plans report.md quotes

SET_NAMES = {"train_sample": "training prompts (a sample)", "test": "test prompts (the headline)",
             "heldout": "held-out compositions"}


def sets_table(result: dict, twin: str | None) -> list[str]:
    """Train sample, test and held-out side by side: the judge's all-right rate (else the first reward),
    its change with the interval over captions and, labelled, the per-image one."""
    sets = {"train_sample": result.get("train_sample"), "test": result, "heldout": result.get("heldout")}
    judged = bool(result["models"]["policy"]["judge"])
    name = "judge: all attributes right" if judged else next(iter(result["difference_ci"]), None)
    if name is None:
        return []
    lines = [f"{name[0].upper()}{name[1:]}" + (f" (= `{twin}`)" if twin else "") + ", by set:", "",
             "| prompts | captions (prompts x images) | reference | policy | change, 95% interval over captions "
             "| per-image interval (captions fixed) |", "|---|---|---|---|---|---|"]
    for key, r in sets.items():
        if r is None:
            continue
        if judged:
            ref, pol = (r["models"][m]["judge"]["correct"] for m in ("reference", "policy"))
            cells = [rate_value(ref), rate_value(pol), rate_change(r["judge_difference_ci"]["correct"]),
                     rate_change(r["judge_difference_ci_per_image"]["correct"])]
        else:
            ref, pol = (r["models"][m]["rewards"][name] for m in ("reference", "policy"))
            cells = [reward_value(ref), reward_value(pol), reward_change(r["difference_ci"][name]),
                     reward_change(r["difference_ci_per_image"][name])]
        lines.append(f"| {SET_NAMES[key]} | {r['captions']} ({r['prompts']} x {r['images_per_prompt']}) | "
                     + " | ".join(cells) + " |")
    return lines + [""]


def _warning_paragraph(warnings: list[str]) -> list[str]:
    """A paragraph near the top that says the run may not have learned, and why (empty when it did)."""
    if not warnings:
        return []
    return ["## Warning: this run may not have learned", "", *[f"- {w}" for w in warnings], ""]


def _judge_section(result: dict, title: str) -> list[str]:
    """The judge per attribute on the test prompts, and its all-right rate per prompt form."""
    lines = ["", f"## {title}, per attribute (test prompts)", "",
             f"| attribute | reference | policy | {interval_heading(result)} |", "|---|---|---|---|"]
    for name in result["judge_difference"]:
        ref, pol = (result["models"][m]["judge"][name] for m in ("reference", "policy"))
        label = "all attributes right" if name == "correct" else name
        lines.append(f"| {label} | {rate_value(ref)} | {rate_value(pol)} | "
                     f"{rate_change(result['judge_difference_ci'].get(name))} |")
    lines += ["", "![judge accuracy](judge.png)", "", "All attributes right, by prompt form:",
              "", "| form | reference | policy | change |", "|---|---|---|---|"]
    for form, pol in result["models"]["policy"]["judge_by_form"].items():
        ref = result["models"]["reference"]["judge_by_form"][form]
        change = 100 * (pol["mean"] - ref["mean"])
        lines.append(f"| {form} | {rate_value(ref)} | {rate_value(pol)} | {change:+.1f} pts |")
    return lines


def _other_sets(result: dict) -> list[str]:
    """The held-out compositions' and the training sample's tables."""
    lines = []
    if "heldout" in result:
        lines += ["", "## Transfer: held-out compositions", "",
                  f"{result['heldout']['prompts']} prompts that no model trained on (prompts/heldout.jsonl), the same "
                  "images per prompt and temperature: does what RL taught carry over to compositions never seen?", "",
                  *change_table(result["heldout"])]
    if "train_sample" in result:
        lines += ["", "## Training prompts (a sample)", "",
                  f"{result['train_sample']['prompts']} prompts the policy trained on (prompts/train_sample.jsonl), "
                  "the same images per prompt and temperature: against the test prompts, what RL fitted on what "
                  "it saw and what carried over to captions it never saw.", "", *change_table(result["train_sample"])]
    return lines


def plan_examples(paired, count: int = PLAN_EXAMPLES) -> list[dict]:
    """The plan of each of the first `count` entries' first image on both sides (the same seed): prompt, reference,
    policy; none without a text stage."""
    if paired.plans.get("policy") is None and paired.plans.get("reference") is None:
        return []
    side = lambda name, row: None if paired.plans.get(name) is None else paired.plans[name][row]  # noqa: E731
    return [{"prompt": paired.entries[row].prompt, "reference": side("reference", row), "policy": side("policy", row)}
            for row in range(0, len(paired.entries), paired.n)[:count]]


def final_report(run_dir: Path, run: LoadedRun, rewards, sets: dict) -> dict:
    """Evaluate the loaded `run` (policy against reference) on its scored sets `sets` (name -> entries, the test
    prompts first) with `rewards`, as `eval RUN` does (evaluate_loaded), and write eval.json (that result),
    final_samples.png, the figures and report.md; returns the result."""
    run_dir, judge, cfg = Path(run_dir), run.bundle.judge, run.cfg
    run.policy.eval()
    examples = []  # with sample.plan: the first plans of the headline's test prompts, on both sides

    def headline(paired):  # final_samples.png shows images eval.json scores
        save_sample_grid([paired], run_dir / "final_samples.png", judge, prompts=8)
        examples.extend(plan_examples(paired))

    full = evaluate_loaded(run_dir, run, rewards, sets, headline=headline,
                           say=lambda line: print(f"[report] {line}", flush=True))
    write_file(run_dir / "eval.json", json.dumps(full, indent=2))
    result, by_temperature = headline_view(full), full.get("by_temperature", {})
    metrics = load_metrics(run_dir)
    twin = duplicate_of_judge(result)
    save_figure(curves_figure(metrics), run_dir / "curves.png")
    last = metrics[-1] if metrics else {}
    skipped, updates, warnings = run_summary(metrics, cfg.train.num_iterations * cfg.train.minibatches_per_pass)
    kl = [m["loss/kl"] for m in metrics if m.get("loss/kl") is not None]
    trained = [k for k, w in cfg.reward.weights.items() if w]
    lines = [f"# GRPO report: {run_dir.name}", "",
             f"{last.get('step', 0)} steps, {cfg.sample.prompts_per_step} prompts x {cfg.sample.group_size} images "
             f"per step, trained on rewards {cfg.reward.weights}, reference `{cfg.train.reference}`, "
             f"beta {cfg.train.beta}, loss `{cfg.train.loss_type}`.", "",
             *_warning_paragraph(warnings), *alert_lines(load_alerts(run_dir)), *resume_lines(run_dir),
             *what_changed(result, trained, list(cfg.reward.monitor), kl if cfg.train.reference != "none" else [],
                           rollout_trend(metrics, twin) if twin else None),
             f"Evaluation: {result['prompts']} test prompts ({result['captions']} distinct captions of the training "
             f"prompts' distribution, never trained on; prompts/test.jsonl) x {result['images_per_prompt']} images, "
             f"the same seeds for policy and reference, sampled at temperature {result['temperature']} (training "
             f"sampled at {full['train_temperature']}); mean [95% interval]. Changes are paired per image; their "
             "interval resamples the captions, all their images with them (a reader's other draw of captions), "
             "within each prompt form; eval.json also holds the per-image interval, which holds the captions fixed "
             "(`*_per_image`).", "",
             *sets_table(result, twin), "## Test prompts", "", *change_table(result)]
    if result["models"]["policy"]["judge"]:
        save_figure(judge_figure(result), run_dir / "judge.png")
        lines += _judge_section(result, judge.name)
    lines += plan_section(result, examples)
    lines += _other_sets(result)
    if len(by_temperature) > 1:
        lines += _temperature_table(by_temperature)
    lines += ["", "## What it cost", "",
              f"KL to the reference (k3, mean per token): last step {kl[-1]:.4f}, max {max(kl):.4f}." if kl else "",
              f"Skipped optimizer updates (non-finite loss or gradient): {skipped} of {updates}.",
              f"Wall time: {sum(m.get('perf/step_s', 0) for m in metrics) / 60:.1f} min of steps.", "",
              "![training curves](curves.png)", "",
              "## Samples (test prompts): policy | reference, the same seeds" +
              (" | what the prompt describes" if getattr(judge, "render", None) else ""), "",
              "![samples](final_samples.png)", ""]
    write_file(run_dir / "report.md", "\n".join(lines))
    print(f"[report] {run_dir / 'report.md'}", flush=True)
    return full


def report_run(run_dir: str | Path, step: int | None = None, device: str = "run", trust: bool = False,
               rewards=(), allow_other_base: bool = False) -> dict:
    """`grpo-vision report RUN`: report.md, eval.json and the figures of a finished or stopped run, from its
    checkpoint at `step` (the latest by default), without training's set-up. Refused while a train holds the run
    (its lock): that train writes the folder, and a finishing run writes its own report."""
    from grpo_vision.run.folder import read_run_config
    from grpo_vision.run.lock import RunLock, RunLockedError
    from grpo_vision.step.load import load_for_eval

    run_dir = Path(run_dir)
    read_run_config(run_dir, device=device)  # not a run folder: said before a lock file is made in it
    try:
        lock = RunLock(run_dir, fresh=False)  # held while the run is read and written: no train starts meanwhile
    except RunLockedError as e:
        raise RunLockedError(f"report: {run_dir} is in use by a running train ({e.holder or 'another process'}); "
                             "run report once it ends, or stop it first", e.holder) from None
    try:
        run, scorer, sets = load_for_eval(run_dir, step, device=device, trust=trust, rewards=rewards,
                                          allow_other_base=allow_other_base)
        return final_report(run_dir, run, scorer, sets)
    finally:
        lock.release()


def headline_view(result: dict) -> dict:
    """An eval result (evaluate_loaded's) as report.md's text reads it: the headline set's numbers at the top, the
    held-out and training-sample sets under their names, and the temperatures."""
    sets = result["sets"]
    return {**sets["test"], "temperature": result["temperature"], "train_temperature": result["train_temperature"],
            **{k: sets[k] for k in ("heldout", "train_sample") if k in sets}}


def read_eval(path: str | Path) -> dict:
    """A run's eval.json in the shape `eval RUN` prints: {run, step, device, temperature, train_temperature, sets:
    {test, heldout, train_sample}, by_temperature}. An eval.json written before the report and `eval` shared one
    result held the test set's numbers at the top, its other sets beside them and no run, step or device; it is
    read into the same shape, those three None."""
    data = json.loads(Path(path).read_text())
    if "sets" in data:
        return data
    old = {k: v for k, v in data.items() if k not in ("eval_set", "temperature", "train_temperature", "by_temperature",
                                                     "heldout", "train_sample")}
    others = {k: data[k] for k in ("heldout", "train_sample") if k in data}
    return {"run": None, "step": None, "device": None, "temperature": data.get("temperature"),
            "train_temperature": data.get("train_temperature"), "sets": {data.get("eval_set", "test"): old, **others},
            **({"by_temperature": data["by_temperature"]} if "by_temperature" in data else {})}
