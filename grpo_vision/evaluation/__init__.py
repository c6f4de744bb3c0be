"""Scoring a run: policy against reference on the same seeds (evaluate.py: one result for eval, GRPOTrainer.evaluate
and eval.json), a draw's numbers (summary.py), the judge's tables (judge.py), intervals over captions and seeds
(intervals.py), the report and its text (report.py, report_text.py), the sample grid (grid.py), figures (plots.py),
benchmark folder layouts (image_layouts.py), and GenEval's summary of per-image verdicts (geneval_bench.py).
Modules are imported by name; this file
imports nothing, so that `import grpo_vision.evaluation.x` loads only x."""
