"""Programs built on the library: the comparison demo (demo.py, demo_app.py), the reward-swap matrix
(matrix.py, matrix_jobs.py, matrix_score.py, matrix_report.py), the benchmarks (bench.py,
bench_train.py, bench_gpu.py, bench_reward.py; their clock, timing.py), the reward server (reward_server.py), the
memory planner (fit.py) and the released model sizes it and the benches build (presets.py). The CLI
(grpo_vision/cli) runs them. This file imports nothing."""
