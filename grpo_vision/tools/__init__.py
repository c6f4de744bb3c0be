"""Programs built on the library: the comparison demo (demo.py, demo_app.py), the reward-swap matrix
(matrix.py, matrix_jobs.py, matrix_score.py, matrix_report.py) and the benchmarks (bench.py,
bench_train.py, bench_gpu.py; their clock, timing.py). The CLI (grpo_vision/cli) runs them. This file imports
nothing."""
