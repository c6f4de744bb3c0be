"""`grpo-vision matrix`: reward specs, run states, paired changes, and the whole command on a micro world
(the e2e tier: matrix runs through the CLI, stopped by signals)."""

import fcntl
import json
import re
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_vision.config import ConfigError, load_config
from grpo_vision.tools.matrix import DONE, parse_reward_spec, plan, run_matrix
from grpo_vision.tools.matrix_jobs import OutLock
from grpo_vision.tools.matrix_score import pairwise_distance, pool_seeds, summarize
from grpo_vision.run.metrics import load_metrics
from grpo_vision.prompts import PromptsError
from grpo_vision.run.lock import RunLock, RunLockedError
from tests.helpers import ROOT, cli_cmd, run_cli


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
    # no --kl: the config's own train.beta, so the default matrix row is the config's run
    assert [s.name for s in plan(load_config(None, ["train.beta=0.04"]), ["clip"], None, [0])] == ["clip-kl0.04-s0"]


def test_a_variant_is_a_row_of_training_options_under_every_reward():
    cfg = load_config(None, [])
    specs = plan(cfg, ["clip", "aesthetic"], None, [0, 1], ["base:", "stage:train.token_weighting=stage,train.lr=1e-4"])
    assert [s.name for s in specs[:4]] == ["clip-kl0-s0-base", "clip-kl0-s1-base", "clip-kl0-s0-stage",
                                           "clip-kl0-s1-stage"]
    assert specs[2].label == "clip [stage]" and specs[0].options == ()
    assert specs[2].overrides(Path("o"))[:2] == ["train.token_weighting=stage", "train.lr=1e-4"]
    assert [s.name for s in plan(cfg, ["clip"], None, [0])] == ["clip-kl0-s0"]  # no variant: the names of before
    lists = plan(cfg, ["clip"], None, [0], ["lora:train.adapter=lora,train.adapter_targets=[q_proj,v_proj]"])
    assert lists[0].options == ("train.adapter=lora", "train.adapter_targets=[q_proj,v_proj]")
    for bad, needle in ((["Stage:x=1"], "expected NAME:key=value"), (["a:train.lr"], "is not a training option"),
                        (["a:run.seed=3"], r"it sets run\., "), (["a:train.beta=0.1"], "train.beta: --kl"),
                        (["a:", "a:train.lr=1"], "--variant: a is given twice")):
        with pytest.raises(ConfigError, match=needle):
            plan(cfg, ["clip"], None, [0], bad)


def test_a_run_given_twice_is_refused_naming_it():
    cfg = load_config(None, ["reward.weights={clip: 4.0, aesthetic: 1.0}"])  # two runs in one folder, before
    for rewards, betas, seeds, message in [
        (["clip", "clip"], [0.0], [0], "--rewards: clip is given twice; give each reward mix once"),
        (["clip", "1*clip"], [0.0], [0], "--rewards: clip and 1*clip are the same reward mix; give it once"),
        (["clip+aesthetic", "aesthetic+4*clip"], [0.0], [0],  # the config's weights: clip 4
         "--rewards: clip+aesthetic and aesthetic+4*clip are the same reward mix; give it once"),
        (["clip"], [0.0, 0.04, 0.0], [0], "--kl: 0 is given twice; give each KL coefficient once"),
        (["clip"], [0.0], [1, 2, 1], "--seeds: 1 is given twice; give each seed once"),
        (["clip"], [float("nan")], [0], "--kl nan: KL coefficients must be finite numbers >= 0"),
        (["clip"], [-0.1], [0], "--kl -0.1: KL coefficients must be finite numbers >= 0"),
        (["clip"], [0.0], [-1], "--seeds -1: seeds must be whole numbers from 0 to 4294967295"),
        (["clip"], [0.0], [2**32], "--seeds 4294967296: seeds must be whole numbers from 0 to 4294967295"),
    ]:
        with pytest.raises(ConfigError) as err:
            plan(cfg, rewards, betas, seeds)
        assert str(err.value) == message
    assert len(plan(cfg, ["clip", "2*clip", "clip+aesthetic"], [0.0], [0])) == 3  # distinct mixes stay


def test_pairwise_distance_by_hand():
    # prompt 0: two identical images and one orthogonal: distances 0, 1, 1 -> mean 2/3
    emb = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    assert pairwise_distance(emb).tolist() == pytest.approx([2 / 3])
    assert math.isnan(pairwise_distance(emb[:, :1])[0])


def test_changes_are_paired_per_image():
    def scores(clip):
        return {"sets": {"test": {"rewards": {"clip": clip}, "judge": {"correct": [1.0, 0.0, None]},
                                  "diversity": [0.5, 0.4, 0.3], "entropy": [1.0, 1.0, 1.0], "kl": [0.0, 0.1, 0.2]}}}

    ref, run = scores([0.1, 0.5, 0.9]), scores([0.2, 0.6, 1.0])  # 3 prompts x 1 image, each up by exactly 0.1
    table = summarize(run, ref, {"test": ["a red circle", "a blue square", "a green circle"]})["test"]
    assert table["clip"]["change"]["mean"] == pytest.approx(0.1)
    lo, hi = table["clip"]["change"]["ci95"]  # a paired change with no spread has a zero-width interval,
    assert lo == pytest.approx(0.1) and hi == pytest.approx(0.1)  # though the values spread by 0.8
    # None: does not apply; the interval resamples the two captions that have a value
    assert table["judge/correct"]["change"] == {"mean": 0.0, "ci95": [0.0, 0.0], "n": 2, "captions": 2}
    assert table["kl"]["mean"] == pytest.approx(0.1) and "change" not in table["kl"]


def test_seeds_pool_into_one_mean_whose_interval_resamples_them():
    from types import SimpleNamespace

    from grpo_vision.tools.matrix_report import judge_attributes

    def scores(clip, correct=(0.0,) * 4):
        return {"sets": {"test": {"rewards": {"clip": clip}, "judge": {"correct": list(correct)},
                                  "diversity": [0.5] * 4, "entropy": [1.0] * 4, "kl": [0.0] * 4}}}

    scorer = SimpleNamespace(captions={"test": ["a", "b", "c", "d"]}, strata={"test": [None] * 4})
    ref = scores([0.0] * 4)
    # seed 0 changes every caption by 0.1, seed 1 by 0.3: the mean is 0.2 and, the captions saying
    # nothing (each seed constant), the interval is the seeds' own [0.1, 0.3]
    pooled = pool_seeds(scorer, ref, [scores([0.1] * 4, [1, 0, 0, 0]), scores([0.3] * 4, [1, 1, 0, 0])])["test"]
    assert pooled["clip"]["change"]["mean"] == pytest.approx(0.2)
    assert pooled["clip"]["change"]["ci95"] == pytest.approx([0.1, 0.3])
    assert pooled["clip"]["change"]["seeds"] == 2 and "kl" not in pooled
    # the judge pools too, and the per-attribute table shows it: (+25 + +50) / 2 points
    group = {"reward": "clip", "beta": 0.0, "seeds": [0, 1], "sets": {"test": pooled}}
    reference = {"test": {"judge/correct": {"mean": 0.0}}}
    row = judge_attributes("test", reference, [], [group])[-1]
    assert row.startswith("| **clip, mean of seeds** | 0 | 0,1 | +37.5 [")


def test_a_variant_is_compared_with_the_baseline_seed_by_seed():
    from types import SimpleNamespace

    from grpo_vision.tools.matrix import compare_variants
    from grpo_vision.tools.matrix_report import compared_table
    from grpo_vision.tools.matrix_score import against_baseline

    def scores(clip, correct):
        return {"sets": {"test": {"rewards": {"clip": clip}, "judge": {"correct": correct, "count": [1.0] * 4},
                                  "diversity": [0.5] * 2, "entropy": [1.0] * 4, "kl": [0.0] * 4}}}

    scorer = SimpleNamespace(captions={"test": ["a", "b"]}, strata={"test": [None] * 2})  # 2 prompts x 2 images
    # the baseline's seeds 0 and 1, the variant's: per seed the variant is 0.05 and 0.2 above, on every caption,
    # so the mean difference is 0.125 and the interval, the captions saying nothing, the seeds' own [0.05, 0.2]
    base = [scores([0.1] * 4, [0.0, 0.0, 1.0, None]), scores([0.2] * 4, [0.0, 0.0, 0.0, None])]
    variant = [scores([0.15] * 4, [1.0, 0.0, 1.0, None]), scores([0.4] * 4, [0.0, 0.0, 0.0, None])]
    table = against_baseline(scorer, base, variant)["test"]
    assert table["clip"]["mean"] == pytest.approx(0.125) and table["clip"]["ci95"] == pytest.approx([0.05, 0.2])
    # the judge: +1 on one of seed 0's three images that have a verdict, 0 on seed 1's: (1/3 + 0) / 2
    assert table["judge/correct"]["mean"] == pytest.approx(1 / 6, abs=1e-5) and table["judge/correct"]["n"] == 3
    assert table["kl"]["mean"] == 0.0 and table["diversity"]["mean"] == 0.0

    # the pairs: by seed, the baseline being the first variant; a seed the variant did not score is left out
    cfg = load_config(None, [])
    specs = plan(cfg, ["clip"], None, [0, 1, 2], ["base:", "stage:train.token_weighting=stage"])
    runs = [{"name": sp.name, "summary": None if sp.name == "clip-kl0-s2-stage" else {}} for sp in specs]
    seen = []
    compared = compare_variants(specs, runs, lambda b, v: seen.append(([r["name"] for r in b], [r["name"] for r in v]))
                                or {"test": table})
    assert seen == [(["clip-kl0-s0-base", "clip-kl0-s1-base"], ["clip-kl0-s0-stage", "clip-kl0-s1-stage"])]
    assert [(c["reward"], c["variant"], c["baseline"], c["seeds"]) for c in compared] == [
        ("clip [stage]", "stage", "base", [0, 1])]
    assert compare_variants(plan(cfg, ["clip"], None, [0]), [], None) == []  # no variants: nothing to compare
    reference = {"test": {"clip": {}, "judge/correct": {}, "judge/count": {}, "diversity": {}, "entropy": {}, "kl": {}}}
    lines = compared_table("test", reference, compared)
    assert "| variant | KL | seeds | clip | judge/correct | diversity | entropy | kl | count |" in lines
    assert lines[-1].startswith("| clip [stage] | 0 | 0,1 | +0.125 [+0.050, +0.200] | +16.7 [")


def test_a_reward_a_score_cache_lacks_is_added_from_its_tokens_not_by_sampling_again(micro_world, tmp_path):
    from grpo_vision.tools.matrix_score import Scorer, cached_scores

    path = tmp_path / "scores" / "reference.json"
    first = Scorer(load_config("configs/shapes_micro.yaml", _overrides(micro_world, tmp_path)), 2)
    first.use_rewards(["placebo"])  # the config's clip, aesthetic and shapes_exact, and a row's placebo
    full = cached_scores(first, path, 0, lambda: first.base)
    assert path.with_suffix(".tokens.pt").is_file()

    # a later call without the placebo row: the cache serves it, with this call's rewards only
    second = Scorer(load_config("configs/shapes_micro.yaml", _overrides(micro_world, tmp_path)), 2)
    second.use_rewards([])
    second.score = lambda model: pytest.fail("sampled again")
    fewer = cached_scores(second, path, 0, lambda: second.base)
    assert all(set(s["rewards"]) == {"clip", "aesthetic", "shapes_exact"} for s in fewer["sets"].values())
    assert fewer["sets"]["test"]["rewards"]["clip"] == full["sets"]["test"]["rewards"]["clip"]

    # a call that watches a reward the cache lacks: scored on the cached tokens, the values sampling gives
    path.write_text(json.dumps({**full, "sets": {k: {**s, "rewards": {n: v for n, v in s["rewards"].items()
                                                                      if n != "placebo"}}
                                                 for k, s in full["sets"].items()}}))
    first.score = lambda model: pytest.fail("sampled again")
    added = cached_scores(first, path, 0, lambda: first.base)
    del first.score
    for set_name, s in added["sets"].items():
        assert s["rewards"]["placebo"] == full["sets"][set_name]["rewards"]["placebo"], set_name
    assert "placebo" in json.loads(path.read_text())["sets"]["heldout"]["rewards"]  # kept in the cache

    path.with_suffix(".tokens.pt").write_bytes(b"torn")  # unreadable tokens: the model is sampled again
    path.write_text(json.dumps({**full, "sets": {k: {**s, "rewards": {}} for k, s in full["sets"].items()}}))
    calls = []
    first.score = lambda model, score=first.score: calls.append(1) or score(model)  # the class's method
    again = cached_scores(first, path, 0, lambda: first.base)
    assert calls == [1] and again["sets"]["test"]["rewards"] == full["sets"]["test"]["rewards"]


def _overrides(world, folder):
    prompts = folder / "prompts"  # small eval sets keep the test quick: 4 test and 3 held-out captions
    if not prompts.is_dir():
        prompts.mkdir()
        (prompts / "test.txt").write_text("a red circle\na small green square\na red square left of a green circle\n"
                                          "a purple triangle on a white background\n")
        (prompts / "heldout.txt").write_text("a blue triangle\na yellow circle\na large purple square\n")
    return [f"policy.path={world}", "log.eval_images=2", f"data.eval_prompts={prompts / 'test.txt'}",
            f"data.heldout_prompts={prompts / 'heldout.txt'}"]


def _matrix_args(world, out, rewards, *extra):
    return ["matrix", "configs/shapes_micro.yaml", *_overrides(world, out.parent), *extra, "--out", out,
            "--rewards", rewards, "--kl", "0"]  # the config as a user names it: the resume line quotes it


def _matrix(world, out, *extra):
    return run_cli(*_matrix_args(world, out, "clip,placebo", *extra), timeout=1800)


@pytest.mark.e2e
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
    assert set(result["reference"]) == {"test", "heldout", "train_sample"}  # both eval sets, some training prompts
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

    (out / "scores" / "placebo-kl0-s0.png").unlink()  # a score cache copied without its picture
    (out / "strips" / "placebo-kl0-s0.png").unlink()
    third = _matrix(micro_world, out)
    assert third.returncode == 0 and third.stdout.count(": reused") == 2 and "scoring" not in third.stdout
    assert not (out / "strips" / "placebo-kl0-s0.png").exists()  # its rows are written, without a strip
    assert "strips/placebo-kl0-s0.png" not in (out / "matrix.md").read_text()
    assert json.loads((out / "matrix.json").read_text())["reference"] == result["reference"]

    other = _matrix(micro_world, out, "train.lr=1e-4")  # the same --out with another config is refused
    assert other.returncode == 2 and "holds a run with another config" in other.stderr


def test_options_scoring_needs_are_refused_before_anything_trains(micro_world, tmp_path):
    out = tmp_path / "matrix"
    base = _overrides(micro_world, tmp_path)
    for overrides, images, message in [  # each was a traceback or error after every run had trained
        ([], 1, "--images 1: matrix measures diversity between a prompt's images, so it needs at least 2"),
        (["log.eval_images=1"], None, "log.eval_images=1 (the default of --images): matrix measures diversity"),
        (["reward.monitor=[clpi]"], None, "the config's reward 'clpi' (scored for every run) is not a reward"),
        ([f"data.heldout_prompts={tmp_path / 'missing.txt'}"], None, "missing.txt"),
        (["sample.group_size=3"], None, "must be divisible by"),  # every run's config, as train checks it
    ]:
        with pytest.raises((ConfigError, PromptsError), match=message.replace("(", r"\(").replace(")", r"\)")):
            run_matrix("configs/shapes_micro.yaml", [*base, *overrides], ["placebo"], [0.0], [0], out, images=images)
        assert not out.exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file; give a folder"):
        run_matrix("configs/shapes_micro.yaml", base, ["placebo"], [0.0], [0], tmp_path / "file")


def test_the_matrix_writes_through_no_link_planted_in_its_folders(tmp_path, monkeypatch):
    # OUT/matrix.lock and a run's log are emptied, matrix_run.json replaced: through a link, each would
    # empty or overwrite a file outside the folders (as run.lock once did)
    from types import SimpleNamespace

    from grpo_vision.tools import matrix
    from grpo_vision.config import save_config
    from grpo_vision.tools.matrix_jobs import open_log
    from grpo_vision.files import FolderError

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "matrix.lock").symlink_to(victim)
    with pytest.raises(FolderError, match=f"{out / 'matrix.lock'} is a symbolic link"):
        OutLock(out)
    (tmp_path / "log").symlink_to(victim)
    with pytest.raises(FolderError, match="is a symbolic link"):
        open_log(tmp_path / "log", tmp_path)
    config = str(ROOT / "configs" / "shapes_micro.yaml")
    spec = plan(load_config(config), ["placebo"], [0.0], [0])[0]
    run_dir = out / "runs" / spec.name
    run_dir.mkdir(parents=True)
    save_config(matrix.run_config(config, [], spec, out / "runs"), run_dir / "config.yaml")
    monkeypatch.setattr(matrix, "run_child", lambda *_: ((run_dir / matrix.DONE).symlink_to(victim), (0, False))[1])
    assert matrix.train_one(config, [], spec, out, 1, SimpleNamespace(received=[])).status == "resumed"
    assert victim.read_text() == "precious\n" and not (run_dir / matrix.DONE).is_symlink()


def test_a_held_output_folder_or_run_is_refused_and_left_alone(micro_world, tmp_path):
    out = tmp_path / "matrix"
    run, log = out / "runs" / "placebo-kl0-s0", out / "logs" / "placebo-kl0-s0.log"
    log.parent.mkdir(parents=True)
    log.write_text("a live train's output\n")

    def matrix():
        run_matrix("configs/shapes_micro.yaml", _overrides(micro_world, tmp_path), ["placebo"], [0.0], [0], out)

    lock = OutLock(out)  # another matrix on this folder
    try:
        with pytest.raises(RunLockedError, match=f"{out} is in use by another grpo-vision matrix \\(pid {os.getpid()}\\)"):
            matrix()
    finally:
        lock.release()
    with open(log, "a") as held:  # the log a matrix handed its train, which runs on after the matrix was killed
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RunLockedError, match=f"{run} is in use by a running train \\(writing {log}\\)"):
            matrix()
    lock = RunLock(run, fresh=True)  # a train that has loaded holds its run.lock
    try:
        with pytest.raises(RunLockedError, match=f"{run} is in use by a running train \\(pid {os.getpid()}\\), "
                                                 "perhaps one a killed matrix left running"):
            matrix()
    finally:
        lock.release()
    assert log.read_text() == "a live train's output\n" and not (run / DONE).exists()  # neither emptied nor failed


def _steps_logged(run: Path) -> list[int]:
    return [row["step"] for row in load_metrics(run)]


def _start_and_stop(cmd, run: Path, stop) -> subprocess.CompletedProcess:
    """Start a matrix in a session of its own (as a shell starts a command), `stop(proc)` once its
    run has logged a step, and wait for it."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 900
    while not _steps_logged(run) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    stop(proc)
    out, err = proc.communicate(timeout=900)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# only a signal or the end saves a checkpoint; steps enough that a signal sent after the first lands
# before the last on a quiet machine too (a micro step takes a fraction of a second)
STEPS = 12
STOP = (f"train.steps={STEPS}", "log.checkpoint_every=0")


@pytest.mark.e2e
def test_sigterm_is_passed_on_and_the_same_command_resumes_exactly(micro_world, tmp_path):
    straight = run_cli(*_matrix_args(micro_world, tmp_path / "straight", "placebo", *STOP), timeout=1800)
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "stopped"
    run, cmd = out / "runs" / "placebo-kl0-s0", cli_cmd(*_matrix_args(micro_world, tmp_path / "stopped", "placebo",
                                                                      *STOP))
    stopped = _start_and_stop(cmd, run, lambda proc: proc.send_signal(signal.SIGTERM))  # the matrix alone
    assert stopped.returncode == 143, stopped.stderr[-3000:]  # 128 + SIGTERM
    assert "Traceback" not in stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1].startswith(
        "[matrix] stopped by SIGTERM; continue with: grpo-vision matrix configs/shapes_micro.yaml policy.path=")
    done = _steps_logged(run)[-1]
    assert 1 <= done < STEPS
    log = (out / "logs" / "placebo-kl0-s0.log").read_text()
    assert f"stopped by SIGTERM: saved a checkpoint at step {done}" in log  # the train got it and saved
    assert (run / "checkpoints" / "latest").read_text() == f"step_{done:06d}" and not (run / DONE).exists()
    assert not (out / "matrix.md").exists()

    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert resumed.returncode == 0 and "placebo-kl0-s0: resumed" in resumed.stdout, resumed.stderr[-3000:]
    assert _steps_logged(run) == list(range(1, STEPS + 1))
    last = f"step_{STEPS:06d}"
    a = load_file(tmp_path / "straight" / "runs" / "placebo-kl0-s0" / "checkpoints" / last / "policy.safetensors")
    b = load_file(run / "checkpoints" / last / "policy.safetensors")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


@pytest.mark.e2e
def test_ctrl_c_stops_the_runs_at_a_checkpoint_in_one_line(micro_world, tmp_path):
    out = tmp_path / "matrix"
    run = out / "runs" / "placebo-kl0-s0"
    # Ctrl-C in a terminal: SIGINT to every process of the command's group
    stopped = _start_and_stop(cli_cmd(*_matrix_args(micro_world, out, "placebo", *STOP)), run,
                              lambda proc: os.killpg(proc.pid, signal.SIGINT))
    assert stopped.returncode == 130, stopped.stderr[-3000:]  # 128 + SIGINT
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1].startswith("[matrix] stopped by SIGINT; continue with: ")
    log = (out / "logs" / "placebo-kl0-s0.log").read_text()
    assert log.count("SIGINT: finishing this step") == 1  # one signal, from the matrix: the step was saved
    assert f"saved a checkpoint at step {_steps_logged(run)[-1]}" in log


def test_an_interrupted_run_resumes_trusting_only_the_matrixs_own_config(tmp_path, monkeypatch):
    """`train --resume` refuses a python: reward without --trust-run; the matrix gives it, having found the
    run's config to be the one it gives that run (another config is refused before anything runs)."""
    from types import SimpleNamespace

    from grpo_vision.tools import matrix
    from grpo_vision.config import save_config

    config = str(ROOT / "configs" / "shapes_micro.yaml")
    spec = plan(load_config(config), ["python:my_rewards:score"], [0.0], [0])[0]
    run_dir = tmp_path / "runs" / spec.name
    run_dir.mkdir(parents=True)
    save_config(matrix.run_config(config, [], spec, tmp_path / "runs"), run_dir / "config.yaml")  # no DONE: interrupted
    calls, stop = [], SimpleNamespace(received=[])
    monkeypatch.setattr(matrix, "run_child", lambda args, *_: calls.append(args) or (0, False))
    assert matrix.train_one(config, [], spec, tmp_path, 1, stop).status == "resumed"
    assert calls[0][-4:] == ["train", "--resume", str(run_dir), "--trust-run"]
    save_config(matrix.run_config(config, ["train.lr=1e-4"], spec, tmp_path / "runs"), run_dir / "config.yaml")
    with pytest.raises(ConfigError, match="holds a run with another config"):
        matrix.train_one(config, [], spec, tmp_path, 1, stop)
    assert len(calls) == 1
    # the same config.yaml, but an origin.json that makes its relative prompts file resolve inside the run
    # folder (to one naming a python: reward, say): the resume would read another config, so it is refused
    monkeypatch.chdir(tmp_path)
    overrides = ["data.train_prompts=p.txt", f"policy.path={tmp_path}"]
    (tmp_path / "p.txt").write_text("a red circle\n")
    save_config(matrix.run_config(config, overrides, spec, tmp_path / "runs"), run_dir / "config.yaml")
    (run_dir / matrix.DONE).unlink()  # written by the resume above
    assert matrix.train_one(config, overrides, spec, tmp_path, 1, stop).status == "resumed"
    (run_dir / "p.txt").write_text('{"prompt": "a red circle", "rewards": {"python:planted:score": 1}}\n')
    (run_dir / "origin.json").write_text(json.dumps({"cwd": str(run_dir), "cwd_from_run": "."}))
    with pytest.raises(ConfigError, match="holds a run with another config"):
        matrix.train_one(config, overrides, spec, tmp_path, 1, stop)
    assert len(calls) == 2


def test_against_pairs_each_run_with_the_other_matrixs_run_of_the_same_name(tmp_path):
    """`--against OTHER`: the reference minus OTHER's reference, and each run minus OTHER's run of the same name,
    seed by seed; OTHER must have scored the same prompts and images per prompt."""
    from types import SimpleNamespace

    from grpo_vision.prompts import PromptEntry
    from grpo_vision.tools.matrix import compare_matrices
    from grpo_vision.tools.matrix_report import compared_table

    def scores(clip):
        return {"sets": {"test": {"rewards": {"clip": clip}, "judge": {"correct": [0.0, 1.0, 1.0, 0.0]},
                                  "diversity": [0.5] * 2, "entropy": [1.0] * 4, "kl": [0.0] * 4}}}

    scorer = SimpleNamespace(captions={"test": ["a", "b"]}, strata={"test": [None] * 2}, n=2,
                             sets={"test": [PromptEntry("a"), PromptEntry("b")]})
    other = tmp_path / "without_plan"
    (other / "scores").mkdir(parents=True)
    runs = [{"name": f"clip-kl0-s{s}", "reward": "clip", "beta": 0.0, "seed": s, "summary": {}} for s in (0, 1)]
    (other / "matrix.json").write_text(json.dumps({"sets": {"test": ["a", "b"]}, "images_per_prompt": 2,
                                                   "runs": runs}))
    for name, clip in (("reference", 0.1), ("clip-kl0-s0", 0.2), ("clip-kl0-s1", 0.3)):
        (other / "scores" / f"{name}.json").write_text(json.dumps(scores([clip] * 4)))
    ours = {"reference": scores([0.2] * 4), "clip-kl0-s0": scores([0.5] * 4), "clip-kl0-s1": scores([0.4] * 4)}
    for s in ours.values():  # a measure only this matrix has (its plans' verdicts) has no difference, and no error
        s["sets"]["test"]["judge"]["plan_correct"] = [1.0] * 4
    rows = compare_matrices(scorer, other, runs, ours)
    assert "judge/plan_correct" not in rows[1]["sets"]["test"]
    assert [(r["reward"], r["seeds"]) for r in rows] == [("reference", []), ("clip", [0, 1])]
    assert rows[0]["sets"]["test"]["clip"]["mean"] == pytest.approx(0.1)
    assert rows[1]["sets"]["test"]["clip"]["mean"] == pytest.approx(0.2)  # (0.3 + 0.1) / 2, paired by seed
    assert rows[1]["sets"]["test"]["clip"]["ci95"] == pytest.approx([0.1, 0.3])
    reference = {"test": {"clip": {}, "judge/correct": {}, "diversity": {}, "entropy": {}, "kl": {}}}
    assert any(line.startswith("Against [without_plan (--against)]") for line in compared_table("test", reference, rows))
    (other / "matrix.json").write_text(json.dumps({"sets": {"test": ["a", "c"]}, "images_per_prompt": 2, "runs": runs}))
    with pytest.raises(ConfigError, match="--against .* scored other prompts"):
        compare_matrices(scorer, other, runs, ours)
    # --against-reward: runs of another reward paired with OTHER's clip runs of the same KL and seed
    swapped = [dict(r, name=f"clip+2xjudge-kl0-s{r['seed']}", reward="clip+2*judge") for r in runs]
    (other / "matrix.json").write_text(json.dumps({"sets": {"test": ["a", "b"]}, "images_per_prompt": 2,
                                                   "runs": runs}))
    mine = {"reference": ours["reference"], "clip+2xjudge-kl0-s0": ours["clip-kl0-s0"],
            "clip+2xjudge-kl0-s1": ours["clip-kl0-s1"]}
    rows = compare_matrices(scorer, other, swapped, mine, "clip")
    assert [(r["reward"], r["seeds"], r["baseline"]) for r in rows[1:]] == [
        ("clip+2*judge", [0, 1], "without_plan [clip] (--against)")]
    assert rows[1]["sets"]["test"]["clip"]["mean"] == pytest.approx(0.2)
    assert compare_matrices(scorer, other, swapped, mine)[1:] == []  # by name, nothing of theirs matches
    with pytest.raises(ConfigError, match="--against-reward 'aesthetic': .* holds no scored run of that reward"):
        compare_matrices(scorer, other, swapped, mine, "aesthetic")


def test_a_damaged_against_folder_is_one_line_naming_the_file_and_the_fix(tmp_path):
    """`--against OTHER` reads OTHER's matrix.json and scores/ (never runs/): a file missing, torn or of
    another shape is a ConfigError naming it, not a traceback, and a run matrix.json says was scored but whose
    scores are gone is refused rather than left out of the comparison without a word."""
    from types import SimpleNamespace

    from grpo_vision.prompts import PromptEntry
    from grpo_vision.tools.matrix import compare_matrices

    def scores(clip):
        return {"sets": {"test": {"rewards": {"clip": [clip] * 4}, "judge": {"correct": [0.0, 1.0, None, 0.0]},
                                  "diversity": [0.5] * 2, "entropy": [1.0] * 4, "kl": [0.0] * 4}}}

    scorer = SimpleNamespace(captions={"test": ["a", "b"]}, strata={"test": [None] * 2}, n=2,
                             sets={"test": [PromptEntry("a"), PromptEntry("b")]})
    runs = [{"name": "clip-kl0-s0", "reward": "clip", "beta": 0.0, "seed": 0, "summary": {}}]
    ours = {"reference": scores(0.2), "clip-kl0-s0": scores(0.5)}
    header = {"sets": {"test": ["a", "b"]}, "images_per_prompt": 2, "runs": runs}

    def folder(name, matrix=header, files=(("reference", scores(0.1)), ("clip-kl0-s0", scores(0.3)))):
        other = tmp_path / name
        (other / "scores").mkdir(parents=True)
        (other / "matrix.json").write_text(matrix if isinstance(matrix, str) else json.dumps(matrix))
        for stem, content in files:
            (other / "scores" / f"{stem}.json").write_text(content if isinstance(content, str) else json.dumps(content))
        return other

    whole = folder("whole")  # no runs/ folder at all: what --against reads is all there
    assert compare_matrices(scorer, whole, runs, ours)[1]["sets"]["test"]["clip"]["mean"] == pytest.approx(0.2)
    wrong_length = scores(0.3)
    wrong_length["sets"]["test"]["rewards"]["clip"] = [0.3] * 3
    for other, message in [
        (folder("no_reference", files=[("clip-kl0-s0", scores(0.3))]), "scores/reference.json is missing; run that "
                                                                       "matrix's command again"),
        (folder("no_run_scores", files=[("reference", scores(0.1))]), "scores/clip-kl0-s0.json is missing"),
        (folder("torn_reference", files=[("reference", '{"sets": '), ("clip-kl0-s0", scores(0.3))]),
         "scores/reference.json is not readable JSON"),
        (folder("torn_run", files=[("reference", scores(0.1)), ("clip-kl0-s0", "[1, 2")]),
         "scores/clip-kl0-s0.json is not readable JSON"),
        (folder("torn_matrix", matrix='{"runs": ['), "matrix.json is not readable JSON"),
        (folder("no_runs_listed", matrix={k: v for k, v in header.items() if k != "runs"}), "matrix.json lists no runs"),
        (folder("a_list", matrix=[1, 2]), "matrix.json lists no runs"),
        (folder("outside", matrix={**header, "runs": [{**runs[0], "name": "../../x"}]}), "matrix.json lists no runs"),
        (folder("no_sets", files=[("reference", {"key": "k"}), ("clip-kl0-s0", scores(0.3))]),
         "scores/reference.json holds no per-set scores"),
        (folder("short", files=[("reference", scores(0.1)), ("clip-kl0-s0", wrong_length)]),
         "scores/clip-kl0-s0.json does not hold 4 numbers for rewards/clip of the test prompts"),
    ]:
        with pytest.raises(ConfigError, match=f"^{re.escape(f'--against {other}: {message}')}") as err:
            compare_matrices(scorer, other, runs, ours)
        assert "\n" not in str(err.value)
    failed = [{**runs[0], "summary": None}]  # a run that failed there has no scores to read
    assert len(compare_matrices(scorer, folder("failed", matrix={**header, "runs": failed},
                                               files=[("reference", scores(0.1))]), runs, ours)) == 1


def test_a_damaged_against_folder_is_refused_before_anything_trains(micro_world, tmp_path):
    out = tmp_path / "matrix"
    other = tmp_path / "other"
    other.mkdir()
    (other / "matrix.json").write_text('{"runs": []')
    with pytest.raises(ConfigError, match="--against .*other: matrix.json is not readable JSON"):
        run_matrix("configs/shapes_micro.yaml", _overrides(micro_world, tmp_path), ["placebo"], [0.0], [0], out,
                   against=other)
    assert not out.exists()


def test_a_torn_score_cache_of_this_matrix_is_scored_again(micro_world, tmp_path):
    from grpo_vision.tools.matrix_score import Scorer, cached_scores

    scorer = Scorer(load_config("configs/shapes_micro.yaml", _overrides(micro_world, tmp_path)), 2)
    scorer.use_rewards(["placebo"])
    path = tmp_path / "scores" / "reference.json"
    path.parent.mkdir()
    path.write_text('{"key": ')
    result = cached_scores(scorer, path, 0, lambda: scorer.base)
    assert json.loads(path.read_text())["key"] == result["key"] == scorer.key(0)
