"""The end-of-run report: `eval.json`, plots, and `report.md` that says what RL changed and what it cost."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from grpo_vision.evaluate import eval_temperatures, evaluate, save_sample_grid
from grpo_vision.health import run_summary
from grpo_vision.metrics import load_metrics
from grpo_vision.plots import curves_figure, judge_figure, save_figure
from grpo_vision.report_text import change_table, duplicate_of_judge, rate_change, rate_value, what_changed
from grpo_vision.runfiles import write_file


def _temperature_table(by_temperature: dict) -> list[str]:
    """Both models at each eval temperature: the judge's all-attributes rate (where the policy kind has
    a judge) and each reward's mean."""
    first = next(iter(by_temperature.values()))
    names = [n for n in first["models"]["policy"]["rewards"] if n != duplicate_of_judge(first)]
    checked = bool(first["models"]["policy"]["checker"])
    head = ["temperature"] + (["checker: all right, reference -> policy"] if checked else []) + \
           [f"{n}: reference -> policy" for n in names]
    lines = ["", "## By sampling temperature", "",
             "The same prompts and seeds at each temperature; the first row is the tables above.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t, r in by_temperature.items():
        ref, pol = r["models"]["reference"], r["models"]["policy"]
        cells = [str(t)]
        if checked:
            a, b = ref["checker"]["correct"]["mean"], pol["checker"]["correct"]["mean"]
            cells.append(f"{100 * a:.1f}% -> {100 * b:.1f}% ({100 * (b - a):+.1f} pts)")
        for n in names:
            a, b = ref["rewards"][n]["mean"], pol["rewards"][n]["mean"]
            cells.append("n/a" if a is None or b is None else f"{a:.3f} -> {b:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _warning_paragraph(warnings: list[str]) -> list[str]:
    """A paragraph near the top that says the run may not have learned, and why (empty when it did)."""
    if not warnings:
        return []
    return ["## Warning: this run may not have learned", "", *[f"- {w}" for w in warnings], ""]


def final_report(run_dir: Path, policy, reference, tokenizer, rewards, sets, params, cfg, judge=None) -> dict:
    """Evaluate policy and reference on the run's eval sets (`sets`, a PromptSets): the test prompts at
    every eval temperature (the headline), the held-out compositions at the first; write eval.json, the
    figures and report.md."""
    run_dir = Path(run_dir)
    policy.eval()
    temperatures = eval_temperatures(cfg)
    n, seed = cfg.log.eval_images, cfg.run.seed + 99

    def run_eval(entries, t, what):
        print(f"[report] evaluating on {len(entries)} {what} x {n} images at temperature {t}", flush=True)
        return evaluate(policy, reference, tokenizer, rewards, entries, n, replace(params, temperature=t), judge, seed)

    by_temperature = {t: run_eval(sets.test, t, "test prompts") for t in temperatures}  # same prompts and seeds
    result = {**by_temperature[temperatures[0]], "eval_set": "test", "temperature": temperatures[0],
              "train_temperature": params.temperature}
    if len(temperatures) > 1:
        result["by_temperature"] = {str(t): r for t, r in by_temperature.items()}
    if sets.heldout:
        result["heldout"] = run_eval(sets.heldout, temperatures[0], "held-out-composition prompts")
    write_file(run_dir / "eval.json", json.dumps(result, indent=2))
    metrics = load_metrics(run_dir)
    save_figure(curves_figure(metrics), run_dir / "curves.png")
    save_sample_grid(policy, reference, tokenizer, sets.test[:8], replace(params, temperature=temperatures[0]),
                     run_dir / "final_samples.png", judge=judge)
    last = metrics[-1] if metrics else {}
    skipped, updates, warnings = run_summary(metrics, cfg.train.num_iterations * cfg.train.minibatches_per_pass)
    kl = [m["loss/kl"] for m in metrics if m.get("loss/kl") is not None]
    trained = [k for k, w in cfg.reward.weights.items() if w]
    lines = [f"# GRPO report: {run_dir.name}", "",
             f"{last.get('step', 0)} steps, {cfg.sample.prompts_per_step} prompts x {cfg.sample.group_size} images "
             f"per step, trained on rewards {cfg.reward.weights}, reference `{cfg.train.reference}`, "
             f"beta {cfg.train.beta}, loss `{cfg.train.loss_type}`.", "",
             *_warning_paragraph(warnings),
             *what_changed(result, trained, list(cfg.reward.monitor), kl if cfg.train.reference != "none" else []),
             f"Evaluation: {result['prompts']} test prompts (the training prompts' distribution, never trained on; "
             f"prompts/test.jsonl) x {result['images_per_prompt']} images, the same seeds for policy and reference, "
             f"sampled at temperature {result['temperature']} (training sampled at {params.temperature}); "
             "mean [95% interval]; changes are paired per image.", "",
             "## Test prompts", "", *change_table(result)]
    if result["models"]["policy"]["checker"]:
        save_figure(judge_figure(result), run_dir / "checker.png")
        lines += ["", f"## {judge.name}, per attribute (test prompts)", "",
                  "| attribute | reference | policy | change (paired, 95% interval) |", "|---|---|---|---|"]
        for name in result["checker_difference"]:
            ref, pol = (result["models"][m]["checker"][name] for m in ("reference", "policy"))
            label = "all attributes right" if name == "correct" else name
            lines.append(f"| {label} | {rate_value(ref)} | {rate_value(pol)} | "
                         f"{rate_change(result['checker_difference_ci'].get(name))} |")
        lines += ["", "![checker accuracy](checker.png)", "",
                  "All attributes right, by prompt form:",
                  "", "| form | reference | policy | change |", "|---|---|---|---|"]
        for form, pol in result["models"]["policy"]["checker_by_form"].items():
            ref = result["models"]["reference"]["checker_by_form"][form]
            lines.append(f"| {form} | {rate_value(ref)} | {rate_value(pol)} | "
                         f"{100 * (pol['mean'] - ref['mean']):+.1f} pts |")
    if "heldout" in result:
        lines += ["", "## Transfer: held-out compositions", "",
                  f"{result['heldout']['prompts']} prompts that no model trained on (prompts/heldout.jsonl), the same "
                  "images per prompt and temperature: does what RL taught carry over to compositions never seen?", "",
                  *change_table(result["heldout"])]
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
    return result
