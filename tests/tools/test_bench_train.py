"""The training benchmarks: `bench step` (phases of the real loop) and `bench trl` (TRL's GRPOTrainer
on the same exported model and reward). How fast is not checked here; that the figures are the medians
of the timed steps is, against the runs' own metrics rows (spied on) or step times given by hand."""

import json
import resource
import statistics
from types import SimpleNamespace

import pytest

from grpo_vision.tools import bench_train
from tests.helpers import MICRO, ROOT


def spy_on_our_steps(monkeypatch) -> list[list[dict]]:
    """The metrics rows of every run the bench trains, as train.py wrote them: what the figures are made from."""
    runs, real = [], bench_train._our_steps

    def spy(*args):
        rows, images = real(*args)
        runs.append(rows)
        return rows, images

    monkeypatch.setattr(bench_train, "_our_steps", spy)
    return runs


def test_bench_step_prints_the_medians_of_the_steps_after_the_warm_up_as_json(micro_world, capsys, monkeypatch):
    from grpo_vision.cli import main

    runs = spy_on_our_steps(monkeypatch)
    main(["bench", "step", str(MICRO), f"policy.path={micro_world}", "--steps", "2", "--json"])
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{"):])  # after the loop's own start-up lines
    (rows,) = runs
    assert [r["step"] for r in rows] == [1, 2, 3]  # one warm-up step (--warmup's default), then the two timed
    timed = rows[1:]
    for r in timed:  # the phases are parts of the step: each row's add up to at most its step, never more
        assert 0 < sum(r[f"perf/{p}_s"] for p in bench_train.PHASES) <= r["perf/step_s"]
    step_s = statistics.median(r["perf/step_s"] for r in timed)
    assert (result["steps_timed"], result["warmup_steps"], result["images_per_step"]) == (2, 1, 8)  # 2 prompts x 4
    assert result["step_s"] == round(step_s, 3)
    assert result["phases_s"] == {p: round(statistics.median(r[f"perf/{p}_s"] for r in timed), 3)
                                  for p in ("sample", "decode", "reward", "logprobs", "update")}
    assert result["images_per_s"] == float(f"{8 / step_s:.3g}")  # 3 significant digits
    assert result["memory_estimate_gib"] == round(rows[-1]["perf/memory_estimate_gib"], 3)
    # peak memory: the process's resident set on a CPU (at most the peak it has now), the CUDA allocator's peak
    # where training used a GPU
    if "peak_rss_gib" in result:
        assert 0.1 < result["peak_rss_gib"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 + 0.001
    else:
        assert result["cuda_max_allocated_gib"] > 0


@pytest.mark.e2e
def test_bench_trl_trains_the_exported_policy_with_trl_beside_the_loop(micro_world, monkeypatch):
    pytest.importorskip("trl")
    from grpo_vision.tools.bench_train import bench_trl

    runs, trl_runs, real_trainer = spy_on_our_steps(monkeypatch), [], bench_train._trl_trainer

    def trl_spy(*args):  # the trainer, its step times and its reward means, as TRL's callbacks record them
        trl_runs.append(real_trainer(*args))
        return trl_runs[-1]

    monkeypatch.setattr(bench_train, "_trl_trainer", trl_spy)
    result = bench_trl(str(ROOT / "configs" / "shapes_micro.yaml"), [f"policy.path={micro_world}"],
                       rounds=1, steps_per_round=2)
    assert "sample.cfg_scale=1.0" in result["overrides"]  # TRL has no CFG: both run without
    # from the raw step times: the round's first step dropped on both sides, the second timed
    ((rows,), ((_, trl_times, trl_means),)) = runs, trl_runs
    assert [r["step"] for r in rows] == [1, 2] and len(trl_times) == len(trl_means) == 2
    ours, theirs = rows[1]["perf/step_s"], trl_times[1]
    assert result["steps_timed_each"] == 1
    assert result["step_s"] == {"grpo_vision": round(ours, 3), "trl": round(theirs, 3)}
    assert result["images_per_s"] == {"grpo_vision": round(8 / ours, 2), "trl": round(8 / theirs, 2)}
    assert result["speedup_vs_trl"] == round(theirs / ours, 2) and result["target_met"] == (theirs / ours >= 2)
    # both train: a CLIP cosine's mean over every step of each trainer
    assert result["reward_mean"] == {"grpo_vision": round(statistics.mean(r["reward/total/mean"] for r in rows), 4),
                                     "trl": round(statistics.mean(trl_means), 4)}
    assert all(-1 <= v <= 1 for v in result["reward_mean"].values())


class ScriptedTrainer:
    """TRL's trainer as bench_trl drives it: each train() appends the next round's step times."""

    def __init__(self, rounds):
        self.rounds, self.times, self.args = iter(rounds), [], SimpleNamespace(max_steps=None)

    def train(self):
        self.times += next(self.rounds)


def test_bench_trl_drops_each_rounds_first_step_and_takes_medians(monkeypatch):
    pytest.importorskip("trl")
    # our rounds take 9 (dropped), 1, 5 and 9 (dropped), 2, 2 s: the median of 1, 5, 2, 2 is 2 s (the mean 2.5);
    # TRL's 50 (dropped), 5, 9 and 50 (dropped), 6, 6 s: median 6 s (mean 6.5); 8 images a step: 4 and 1.33 images/s
    ours = iter([[9.0, 1.0, 5.0], [9.0, 2.0, 2.0]])
    monkeypatch.setattr(bench_train, "_our_steps", lambda *a: (
        [{"perf/step_s": s, "reward/total/mean": 0.5} for s in next(ours)], 8))
    trainer = ScriptedTrainer([[50.0, 5.0, 9.0], [50.0, 6.0, 6.0]])
    monkeypatch.setattr(bench_train, "_trl_trainer", lambda cfg, out: (trainer, trainer.times, [0.1, 0.3]))
    result = bench_train.bench_trl(str(MICRO), [], rounds=2, steps_per_round=3)
    assert result["steps_timed_each"] == 4 and trainer.args.max_steps == 3
    assert result["step_s"] == {"grpo_vision": 2.0, "trl": 6.0}
    assert result["images_per_s"] == {"grpo_vision": 4.0, "trl": 1.33}
    assert (result["speedup_vs_trl"], result["target_met"]) == (3.0, True)
    assert result["reward_mean"] == {"grpo_vision": 0.5, "trl": 0.2}


@pytest.mark.e2e
def test_bench_trl_refuses_a_policy_it_cannot_export():
    pytest.importorskip("trl")
    from grpo_vision.tools.bench_train import bench_trl
    from grpo_vision.config import ConfigError

    with pytest.raises(ConfigError, match="policy kind 'janus' is not one: use a config with policy.kind llama"):
        bench_trl(str(ROOT / "configs" / "janus_pro_1b.yaml"), [], rounds=1, steps_per_round=2)
