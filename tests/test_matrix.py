"""`grpo-vision matrix`: reward specs, run states, paired changes, and the whole command on a micro world."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_vision.config import ConfigError, load_config
from grpo_vision.matrix import parse_reward_spec, plan
from grpo_vision.matrix_score import pairwise_distance, summarize

ROOT = Path(__file__).resolve().parents[1]


def test_reward_specs_take_explicit_weights_then_the_configs():
    base = {"clip": 4.0, "aesthetic": 1.0}
    assert parse_reward_spec("clip", base) == (("clip", 1.0),)  # a single reward's scale does not matter
    assert parse_reward_spec("clip+aesthetic", base) == (("clip", 4.0), ("aesthetic", 1.0))
    assert parse_reward_spec("0.5*clip+placebo", base) == (("clip", 0.5), ("placebo", 1.0))
    with pytest.raises(ConfigError, match=r"'clpi' in 'clpi\+aesthetic' is not a reward; registered rewards: .*clip"):
        parse_reward_spec("clpi+aesthetic", base)
    with pytest.raises(ConfigError, match="is not NAME or WEIGHT"):
        parse_reward_spec("x*clip", base)
    with pytest.raises(ConfigError, match="names a reward twice"):
        parse_reward_spec("clip+clip", base)


def test_plan_is_every_reward_kl_and_seed_with_distinct_names():
    cfg = load_config(None, [])
    specs = plan(cfg, ["clip", "2*clip+aesthetic"], [0.0, 0.04], [0, 1])
    assert len(specs) == 8 and len({s.name for s in specs}) == 8
    assert specs[-1].name == "2xclip+aesthetic-kl0.04-s1"
    assert "train.beta=0.04" in specs[-1].overrides(Path("out")) and "reward.monitor=[]" in specs[-1].overrides(Path("o"))
    with pytest.raises(ConfigError, match="needs a reference"):
        plan(load_config(None, ["train.reference=none"]), ["clip"], [0.1], [0])


def test_pairwise_distance_by_hand():
    # prompt 0: two identical images and one orthogonal: distances 0, 1, 1 -> mean 2/3
    emb = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    assert pairwise_distance(emb).tolist() == pytest.approx([2 / 3])
    assert math.isnan(pairwise_distance(emb[:, :1])[0])


def test_changes_are_paired_per_image():
    def scores(clip):
        return {"sets": {"test": {"rewards": {"clip": clip}, "judge": {"correct": [1.0, 0.0, None]},
                                  "diversity": [0.5], "entropy": [1.0, 1.0, 1.0], "kl": [0.0, 0.1, 0.2]}}}

    ref, run = scores([0.1, 0.5, 0.9]), scores([0.2, 0.6, 1.0])  # every image up by exactly 0.1
    table = summarize(run, ref)["test"]
    assert table["clip"]["change"]["mean"] == pytest.approx(0.1)
    lo, hi = table["clip"]["change"]["ci95"]  # a paired change with no spread has a zero-width interval,
    assert lo == pytest.approx(0.1) and hi == pytest.approx(0.1)  # though the values spread by 0.8
    assert table["judge/correct"]["change"] == {"mean": 0.0, "ci95": [0.0, 0.0], "n": 2}  # None: does not apply
    assert table["kl"]["mean"] == pytest.approx(0.1) and "change" not in table["kl"]


def _matrix(world, out, *extra):
    prompts = out.parent / "prompts"  # small eval sets keep the test quick: 4 test and 3 held-out captions
    if not prompts.is_dir():
        prompts.mkdir()
        (prompts / "test.txt").write_text("a red circle\na small green square\na red square left of a green circle\n"
                                          "a purple triangle on a white background\n")
        (prompts / "heldout.txt").write_text("a blue triangle\na yellow circle\na large purple square\n")
    args = ["matrix", "configs/shapes_micro.yaml", f"policy.path={world}", "log.eval_images=2",
            f"data.eval_prompts={prompts / 'test.txt'}", f"data.heldout_prompts={prompts / 'heldout.txt'}", *extra,
            "--out", str(out), "--rewards", "clip,placebo"]
    return subprocess.run([sys.executable, "-m", "grpo_vision.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)


def test_matrix_through_the_cli_goes_on_past_a_failed_run_and_reuses_the_rest(micro_world, tmp_path):
    out = tmp_path / "matrix"
    broken = out / "runs" / "placebo-kl0-s0" / "run.lock"
    broken.mkdir(parents=True)  # a lock that cannot be opened: this run fails at its start
    first = _matrix(micro_world, out)
    assert first.returncode == 1 and "1 failed: placebo-kl0-s0" in first.stdout, first.stderr[-3000:]
    runs = {r["name"]: r for r in json.loads((out / "matrix.json").read_text())["runs"]}
    assert runs["clip-kl0-s0"]["summary"]["step"] == 2
    assert runs["placebo-kl0-s0"]["status"] == "failed" and runs["placebo-kl0-s0"]["summary"] is None
    assert "failed (rc" in (out / "matrix.md").read_text()

    broken.rmdir()
    ckpt = out / "runs" / "clip-kl0-s0" / "checkpoints" / "step_000002" / "trainer_state.json"
    mtime = ckpt.stat().st_mtime_ns
    second = _matrix(micro_world, out)  # the failed run is retried, the finished one reused
    assert second.returncode == 0, second.stderr[-3000:]
    assert "clip-kl0-s0: reused" in second.stdout and "placebo-kl0-s0: trained" in second.stdout
    assert "scoring clip-kl0-s0" not in second.stdout and "scoring reference" not in second.stdout
    assert ckpt.stat().st_mtime_ns == mtime
    result = json.loads((out / "matrix.json").read_text())
    assert [r["name"] for r in result["runs"]] == ["clip-kl0-s0", "placebo-kl0-s0"]
    assert set(result["reference"]) == {"test", "heldout"}  # both eval sets
    for run in result["runs"]:
        assert run["summary"]["step"] == 2
        for set_name, table in run["summary"]["sets"].items():
            assert {"clip", "placebo", "judge/correct", "diversity", "entropy", "kl"} <= set(table)
            for name, entry in table.items():
                if entry["mean"] is None:  # a judge attribute that no prompt of this set names
                    assert result["reference"][set_name][name]["mean"] is None
                    continue
                assert math.isfinite(entry["mean"]), (run["name"], name)
                if "change" in entry:  # one reference for every run: change = run - reference, paired
                    ref = result["reference"][set_name][name]["mean"]
                    assert entry["change"]["mean"] == pytest.approx(entry["mean"] - ref, abs=2e-5)
    for name in ("matrix.md", "matrix.png", "strips/clip-kl0-s0.png", "strips/placebo-kl0-s0.png"):
        assert (out / name).is_file(), name
    md = (out / "matrix.md").read_text()
    assert "| reference (means) |" in md and "Held-out compositions" in md

    third = _matrix(micro_world, out)
    assert third.returncode == 0 and third.stdout.count(": reused") == 2 and "scoring" not in third.stdout
    assert json.loads((out / "matrix.json").read_text())["reference"] == result["reference"]

    other = _matrix(micro_world, out, "train.lr=1e-4")  # the same --out with another config is refused
    assert other.returncode == 2 and "holds a run with another config" in other.stderr


def test_an_interrupted_run_resumes_trusting_only_the_matrixs_own_config(tmp_path, monkeypatch):
    """`train --resume` refuses a python: reward without --trust-run; the matrix gives it, having found the
    run's config to be the one it gives that run (another config is refused before anything runs)."""
    from types import SimpleNamespace

    from grpo_vision import matrix
    from grpo_vision.config import save_config

    config = str(ROOT / "configs" / "shapes_micro.yaml")
    spec = plan(load_config(config), ["python:my_rewards:score"], [0.0], [0])[0]
    run_dir = tmp_path / "runs" / spec.name
    run_dir.mkdir(parents=True)
    save_config(matrix.run_config(config, [], spec, tmp_path / "runs"), run_dir / "config.yaml")  # no DONE: interrupted
    calls = []
    monkeypatch.setattr(matrix.subprocess, "run", lambda args, **_: calls.append(args) or SimpleNamespace(returncode=0))
    assert matrix.train_one(config, [], spec, tmp_path, 1).status == "resumed"
    assert calls[0][-4:] == ["train", "--resume", str(run_dir), "--trust-run"]
    save_config(matrix.run_config(config, ["train.lr=1e-4"], spec, tmp_path / "runs"), run_dir / "config.yaml")
    with pytest.raises(ConfigError, match="holds a run with another config"):
        matrix.train_one(config, [], spec, tmp_path, 1)
    assert len(calls) == 1
