"""The training benchmarks: `bench step` (phases of the real loop) and `bench trl` (TRL's GRPOTrainer
on the same exported model and reward). Timings are not checked here, only that they are measured."""

import json
import math

import pytest

from tests.helpers import MICRO, ROOT


def test_bench_step_prints_each_phase_as_json(micro_world, capsys):
    from grpo_vision.cli import main

    main(["bench", "step", str(MICRO), f"policy.path={micro_world}", "--steps", "2", "--json"])
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{"):])  # after the loop's own start-up lines
    assert result["steps_timed"] == 2 and result["images_per_step"] == 8  # 2 prompts x 4 images
    assert set(result["phases_s"]) == {"sample", "decode", "reward", "logprobs", "update"}
    assert all(v >= 0 for v in result["phases_s"].values()) and result["phases_s"]["update"] > 0
    assert sum(result["phases_s"].values()) <= result["step_s"] * 1.5  # phases are parts of a step
    assert result["images_per_s"] == pytest.approx(8 / result["step_s"], rel=0.01)
    # peak memory: the process's resident set on a CPU, the CUDA allocator's peak where training used a GPU
    assert result.get("peak_rss_gib", 0) > 0.1 or result.get("cuda_max_allocated_gib", 0) > 0


@pytest.mark.e2e
def test_bench_trl_trains_the_exported_policy_with_trl_beside_the_loop(micro_world):
    pytest.importorskip("trl")
    from grpo_vision.tools.bench_train import bench_trl

    result = bench_trl(str(ROOT / "configs" / "shapes_micro.yaml"), [f"policy.path={micro_world}"],
                       rounds=1, steps_per_round=2)
    assert result["steps_timed_each"] == 1
    assert "sample.cfg_scale=1.0" in result["overrides"]  # TRL has no CFG: both run without
    for name in ("grpo_vision", "trl"):
        assert math.isfinite(result["images_per_s"][name]) and result["images_per_s"][name] > 0
    assert all(-1 <= v <= 1 for v in result["reward_mean"].values())  # a CLIP cosine, both trainers
    assert result["speedup_vs_trl"] == pytest.approx(result["step_s"]["trl"] / result["step_s"]["grpo_vision"],
                                                     rel=0.02)


@pytest.mark.e2e
def test_bench_trl_refuses_a_policy_it_cannot_export():
    pytest.importorskip("trl")
    from grpo_vision.tools.bench_train import bench_trl
    from grpo_vision.config import ConfigError

    with pytest.raises(ConfigError, match="policy kind 'janus' is not one: use a config with policy.kind llama"):
        bench_trl(str(ROOT / "configs" / "janus_pro_1b.yaml"), [], rounds=1, steps_per_round=2)
