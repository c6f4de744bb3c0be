"""The training benchmarks: `bench step` (phases of the real loop) and `bench trl` (TRL's GRPOTrainer
on the same exported model and reward). Timings are not checked here, only that they are measured."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_step_prints_each_phase_through_the_cli(micro_world):
    out = subprocess.run([sys.executable, "-m", "grpo_vision.cli", "bench", "step", "configs/shapes_micro.yaml",
                          f"policy.path={micro_world}", "--steps", "2", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["steps_timed"] == 2 and result["images_per_step"] == 8  # 2 prompts x 4 images
    assert set(result["phases_s"]) == {"sample", "decode", "reward", "logprobs", "update"}
    assert all(v >= 0 for v in result["phases_s"].values()) and result["phases_s"]["update"] > 0
    assert sum(result["phases_s"].values()) <= result["step_s"] * 1.5  # phases are parts of a step
    assert result["images_per_s"] == pytest.approx(8 / result["step_s"], rel=0.01)
    assert result["peak_rss_gib"] > 0.1


def test_bench_trl_trains_the_exported_policy_with_trl_beside_the_loop(micro_world):
    pytest.importorskip("trl")
    from grpo_vision.bench_train import bench_trl

    result = bench_trl(str(ROOT / "configs" / "shapes_micro.yaml"), [f"policy.path={micro_world}"],
                       rounds=1, steps_per_round=2)
    assert result["steps_timed_each"] == 1
    assert "sample.cfg_scale=1.0" in result["overrides"]  # TRL has no CFG: both run without
    for name in ("grpo_vision", "trl"):
        assert math.isfinite(result["images_per_s"][name]) and result["images_per_s"][name] > 0
    assert all(-1 <= v <= 1 for v in result["reward_mean"].values())  # a CLIP cosine, both trainers
    assert result["speedup_vs_trl"] == pytest.approx(result["step_s"]["trl"] / result["step_s"]["grpo_vision"],
                                                     rel=0.02)


def test_bench_trl_refuses_a_policy_it_cannot_export():
    pytest.importorskip("trl")
    from grpo_vision.bench_train import bench_trl
    from grpo_vision.config import ConfigError

    with pytest.raises(ConfigError, match="policy kind 'janus' is not one: use a config with policy.kind llama"):
        bench_trl(str(ROOT / "configs" / "janus_pro_1b.yaml"), [], rounds=1, steps_per_round=2)
