"""GRPO end to end on the micro world: the real CLI, exact resume, two processes, faults."""

import copy
import json
import shutil
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_vision.config import ConfigError, load_config, save_config
from grpo_vision.grpo import grpo_loss
from grpo_vision.run.health import NonFiniteWeightsError, TrainingHealthError, weights_finite
from grpo_vision.rewards import RewardError
from grpo_vision.run.metrics import load_metrics
from grpo_vision.train import train
from tests.helpers import MICRO, ROOT, cli_cmd, micro_args, micro_cfg, run_cli


def inf_reward(images, prompts, metadata):  # python:tests.test_train:inf_reward
    # One infinite reward per group of 4: the group mean would be inf, its advantages NaN, the loss NaN.
    return torch.tensor([math.inf if i % 4 == 0 else float(i) for i in range(len(prompts))])


def huge_reward(images, prompts, metadata):  # python:tests.test_train:huge_reward
    return torch.tensor([3e38 if i % 2 else 0.0 for i in range(len(prompts))])


def nan_reward(images, prompts, metadata):  # python:tests.test_train:nan_reward
    return torch.full((len(prompts),), math.nan)  # "does not apply", to every image


def raising_reward(images, prompts, metadata):  # python:tests.test_train:raising_reward
    raise ValueError("scorer offline")


def exiting_reward(images, prompts, metadata):  # python:tests.test_train:exiting_reward
    sys.exit(0)  # before: the run ended mid-step with status 0, no message and no checkpoint


CALLS = []  # exiting_later's calls, in the copy of this module that the reward spec imports


def exiting_later(images, prompts, metadata):  # python:tests.test_train:exiting_later
    CALLS.append(len(prompts))
    if len(CALLS) == 2:  # the second step
        sys.exit(0)
    return images.mean((1, 2, 3))


@pytest.mark.e2e
def test_cli_smoke_two_steps_move_parameters_and_log_finite_metrics(micro_world, tmp_path):
    out = run_cli("train", str(MICRO), f"policy.path={micro_world}", f"run.out_dir={tmp_path}", "log.report=false")
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "shapes_micro"
    before = load_file(micro_world / "policy" / "policy.safetensors")
    after = load_file(run / "checkpoints" / "step_000002" / "policy.safetensors")
    assert set(after) == set(before)
    assert max((after[k].float() - before[k].float()).abs().max().item() for k in after) > 0
    lines = load_metrics(run)
    assert [m["step"] for m in lines] == [1, 2]
    required = {"reward/clip/mean", "reward/clip/std", "reward/aesthetic/mean", "reward/shapes_exact/mean",
                "reward/total/mean", "adv/frac_zero_std", "loss/policy", "loss/kl", "loss/clip_frac_low",
                "loss/clip_frac_high", "policy/entropy", "perf/step_s", "perf/sample_tokens_per_s", "lr"}
    for m in lines:
        assert required <= set(m)
        assert all(v is not None and math.isfinite(v) for v in m.values()), m


# The rest of what a finished run holds, on the session's in-process micro run (conftest.py: micro_run,
# two steps, the report at eval temperatures 0.7 and 1.0)


def test_a_run_writes_the_config_it_trained_with_and_a_row_and_a_checkpoint_each_step(micro_run, micro_world):
    # the config conftest.py's micro_run trained with, read back whole
    assert load_config(micro_run / "config.yaml") == micro_cfg(micro_world, micro_run.parent, "log.sample_every=1",
                                                               "log.eval_temperatures=[0.7,1.0]")
    rows = load_metrics(micro_run)
    assert [r["step"] for r in rows] == [1, 2]
    assert all({"reward/total/mean", "loss/policy", "loss/kl", "adv/frac_zero_std", "perf/step_s", "lr"} <= r.keys()
               for r in rows)
    # a checkpoint each step (log.checkpoint_every: 1), the last one named latest; each step moved the weights
    checkpoints = micro_run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000002"
    weights = [load_file(micro_world / "policy" / "policy.safetensors")]
    for step in (1, 2):
        assert json.loads((checkpoints / f"step_{step:06d}" / "trainer_state.json").read_text())["step"] == step
        weights.append(load_file(checkpoints / f"step_{step:06d}" / "policy.safetensors"))
        assert weights[-1].keys() == weights[0].keys()
        assert any(not torch.equal(weights[-1][k], weights[-2][k]) for k in weights[0])


def assert_same_picture(path: Path, other: Path) -> None:
    import numpy as np
    from PIL import Image

    a, b = (np.asarray(Image.open(p)) for p in (path, other))
    assert a.shape == b.shape, (a.shape, b.shape)
    assert not (a != b).any(), f"{int((a != b).any(-1).sum())} pixels of {other} differ"


def test_the_grids_show_the_images_eval_scores_drawn_by_the_last_checkpoint(micro_run, tmp_path):
    # samples/step_000002.png was drawn by the policy in memory after step 2 with rollouts.compare on the eval
    # seeds (prompt i's image j: EVAL_SEED + 1000 i + j, the images `eval` scores): drawn again from the step-2
    # checkpoint on the same prompts, it is the same picture, pixel for pixel
    from PIL import Image

    from grpo_vision.config import EVAL_SEED
    from grpo_vision.evaluation.grid import save_sample_grid
    from grpo_vision.prompts import load_prompts
    from grpo_vision.rollouts import compare
    from grpo_vision.sampling import SamplingParams
    from grpo_vision.step.load import load_run

    run = load_run(micro_run, device="cpu")
    assert run.step == 2
    trained = micro_run / "prompts" / "train_sample.jsonl"
    sets = [load_prompts(micro_run / "prompts" / "test.jsonl")[:4],
            load_prompts(trained if trained.exists() else micro_run / "prompts" / "train.jsonl")[:4]]
    params = SamplingParams.from_config(run.cfg.sample)  # the rollout's, as set-up makes them
    parts = [compare(run.policy, run.reference, run.bundle.tokenizer, entries, 2, params, EVAL_SEED, None,
                     run.bundle.judge) for entries in sets]
    grid = save_sample_grid(parts, tmp_path / "again.png", run.bundle.judge)
    assert grid["seeds"] == [EVAL_SEED + 1000 * i + j for i in range(4) for j in range(2)] * 2
    assert grid["prompts"][::2] == [e.prompt for entries in sets for e in entries]
    assert_same_picture(tmp_path / "again.png", micro_run / "samples" / "step_000002.png")
    assert Image.open(micro_run / "samples" / "step_000001.png").size == Image.open(tmp_path / "again.png").size


def test_the_curves_are_the_runs_metrics_plotted(micro_run, tmp_path):
    from grpo_vision.evaluation.plots import curves_figure, save_figure

    save_figure(curves_figure(load_metrics(micro_run)), tmp_path / "curves.png")
    assert_same_picture(tmp_path / "curves.png", micro_run / "curves.png")


def test_the_final_sample_sheet_has_a_row_per_test_prompt_and_the_ground_truth(micro_run):
    from PIL import Image

    # 8 test prompts, one row each, 128 px tiles and verdicts; the images eval.json scored: up to 2 of each prompt
    sheet = Image.open(micro_run / "final_samples.png")
    k = min(2, json.loads((micro_run / "eval.json").read_text())["sets"]["test"]["images_per_prompt"])
    assert sheet.height >= 8 * 128 and sheet.width >= 2 * k * 128 + 128  # policy x k, reference x k, ground truth


def test_a_run_never_trains_on_its_eval_prompts_and_eval_scores_its_own_sets(micro_run):
    from grpo_vision.prompts import load_prompts
    from grpo_vision.splits import run_prompt_sets  # what `eval RUN` scores without --prompts

    test, heldout, trained, sample = (load_prompts(micro_run / "prompts" / f"{n}.jsonl")
                                      for n in ("test", "heldout", "train", "train_sample"))
    assert not {e.prompt for e in trained} & {e.prompt for e in (*test, *heldout)}
    assert {e.prompt for e in sample} <= {e.prompt for e in trained}  # scored beside them, never held out
    scored = run_prompt_sets(load_config(micro_run / "config.yaml"), micro_run).scored()
    assert {k: [e.prompt for e in v] for k, v in scored.items()} == {
        "test": [e.prompt for e in test], "heldout": [e.prompt for e in heldout],
        "train_sample": [e.prompt for e in sample]}


@pytest.mark.parametrize("options", [[], ["train.zero_std_groups=resample", "reward.monitor=[]",
                                          "reward.weights={python:tests.test_algorithms:flat_for_squares: 1.0}"]])
def test_resume_is_exact(micro_world, tmp_path, options):
    # resample: the refill's prompts and images come from the step's own keys, so the resumed run draws them too
    straight = train(micro_cfg(micro_world, tmp_path, "run.name=straight", "train.steps=4",
                               "train.lr_schedule=cosine", *options), progress=False)
    half = train(micro_cfg(micro_world, tmp_path, "run.name=half", "train.steps=4", "train.lr_schedule=cosine",
                           "log.checkpoint_every=2", *options), progress=False)
    # Simulate a stop after step 2: drop the later checkpoint and resume from step 2.
    shutil.rmtree(half / "checkpoints" / "step_000004")
    (half / "checkpoints" / "latest").write_text("step_000002")
    resumed = train(load_config(half / "config.yaml"), resume=half, progress=False)
    a = load_file(straight / "checkpoints" / "step_000004" / "policy.safetensors")
    b = load_file(resumed / "checkpoints" / "step_000004" / "policy.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    la, lb = load_metrics(straight), load_metrics(resumed)
    assert [m["step"] for m in lb] == [1, 2, 3, 4]
    assert [m["loss/total"] for m in la] == [m["loss/total"] for m in lb]
    if options:
        assert [m["train/groups_resampled"] for m in la] == [m["train/groups_resampled"] for m in lb]
        assert sum(m["train/groups_resampled"] for m in la[2:]) > 0  # the resumed half refilled a group


def test_a_checkpoint_without_the_health_counters_is_refused_at_resume(micro_world, tmp_path):
    from grpo_vision.run.checkpoint import CheckpointError

    run = train(micro_cfg(micro_world, tmp_path, "run.name=counted", "train.steps=1", "log.report=false"),
                progress=False)
    state = run / "checkpoints" / "step_000001" / "trainer_state.json"
    saved = json.loads(state.read_text())
    assert sorted(saved["counters"]) == ["skipped_in_a_row", "skipped_updates", "steps_no_spread",
                                         "steps_without_signal"]
    state.write_text(json.dumps({**saved, "counters": {}}))  # before: a KeyError after the resumed step's work
    with pytest.raises(CheckpointError, match=f"{state} holds the counters {{}}, not skipped_updates, .*: delete "):
        train(load_config(run / "config.yaml", ["train.steps=2"]), resume=run, progress=False)


@pytest.mark.e2e
@pytest.mark.parametrize("options", [[], ["train.loss_type=dapo", "train.top_entropy_quantile=0.3"]])
def test_two_processes_match_one(micro_world, tmp_path, options):
    # Both on the CPU (run.device=cpu: gloo), also where a GPU is present. `accelerate launch --cpu`
    # starts ONE process whatever --num_processes says; --multi_gpu is its torchrun launcher, which
    # starts two (the sizes line proves it). With dapo each process divides by its share of the global
    # token count; the entropy threshold is global. Two micro-batches per update: DDP's no_sync on the first.
    # One thread in every process: a matmul split over two threads sums in another order (run alone, outside
    # pytest-xdist's one-thread workers, 0.13% of the weights came out apart)
    options = [*options, "train.micro_batch_size=2", "run.threads=1"]
    one = train(micro_cfg(micro_world, tmp_path, "run.name=one", "train.steps=1", "run.device=cpu", *options),
                progress=False)
    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                          "-m", "grpo_vision.cli", "train", *micro_args(micro_world, tmp_path, "run.name=two",
                                                                         "train.steps=1", "run.device=cpu", *options)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "processes=2 " in out.stdout and "micro_batches_per_update=2" in out.stdout, out.stdout[-2000:]
    m1, m2 = load_metrics(one)[0], load_metrics(tmp_path / "two")[0]
    for key in m1:
        if key.startswith(("reward/", "adv/")):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        elif key.startswith("loss/"):
            # A loss is a mean of -A * ratio in which the advantages cancel, so it is a residue, most
            # likely float error in the rewards (~1e-7; the reward models see other batches) divided by a
            # group's reward std + 1e-4, small in the micro world (not checked per group). Measured: losses
            # 6.8e-5 apart, ratio means 2e-7 apart, so compare on that absolute scale, and the weights below.
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=2e-4), key
    # The update itself: gradients averaged across the processes give the same step. Adam's first step
    # moves each weight by about lr whatever its gradient's size, so a weight whose gradient is float
    # noise may move either way (at most 2 lr apart); all others agree.
    w1, w2 = (load_file(run / "checkpoints" / "step_000001" / "policy.safetensors") for run in (one, tmp_path / "two"))
    diff = torch.cat([(w1[k] - w2[k]).abs().flatten() for k in w1])
    assert diff.max() <= 2.5e-5 and (diff > 1e-6).float().mean() < 1e-3, (diff.max(), (diff > 1e-6).float().mean())


def nan_loss(*args, **kwargs):  # grpo_loss, poisoned: as an fp16 overflow would make it
    loss, metrics = grpo_loss(*args, **kwargs)
    return loss * math.nan, metrics


def test_a_non_finite_loss_skips_the_update_and_the_run_goes_on(micro_world, tmp_path, monkeypatch):
    monkeypatch.setattr("grpo_vision.step.update.grpo_loss", nan_loss)
    run = train(micro_cfg(micro_world, tmp_path, "run.name=nanloss", "train.max_skipped_updates=0"), progress=False)
    lines = load_metrics(run)
    assert lines[-1]["step"] == 2 and lines[-1]["train/skipped_updates"] == 4  # 2 steps x 2 passes
    before = load_file(Path(micro_world) / "policy" / "policy.safetensors")
    after = load_file(run / "checkpoints" / "step_000002" / "policy.safetensors")
    assert all(torch.equal(after[k], before[k].to(after[k].dtype)) for k in after)
    report = (run / "report.md").read_text()
    assert "## Warning: this run may not have learned" in report
    assert "every one of the 4 optimizer updates was skipped" in report
    assert "Skipped optimizer updates (non-finite loss or gradient): 4 of 4." in report


def test_skipped_updates_in_a_row_stop_the_run_with_a_checkpoint(micro_world, tmp_path, monkeypatch):
    monkeypatch.setattr("grpo_vision.step.update.grpo_loss", nan_loss)
    cfg = micro_cfg(micro_world, tmp_path, "run.name=stuck", "train.steps=5", "train.max_skipped_updates=3",
                    "log.checkpoint_every=0")
    # two updates a step: the third skipped update in a row falls in step 2, checked when step 2 ends
    with pytest.raises(TrainingHealthError, match=r"^4 optimizer updates in a row were skipped .*"
                                                  r"train.max_skipped_updates=3\): saved a checkpoint at step 2"):
        train(cfg, progress=False)
    run = tmp_path / "stuck"
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"
    assert [m["step"] for m in load_metrics(run)] == [1, 2]


def test_non_finite_weights_stop_the_run_and_name_the_last_finite_checkpoint(micro_world, tmp_path, monkeypatch):
    import grpo_vision.step.update as update_module

    calls = []

    def breaks_at_the_third_update(params):  # step 2's first update (two a step)
        calls.append(1)
        return len(calls) < 3 and weights_finite(params)

    monkeypatch.setattr(update_module, "weights_finite", breaks_at_the_third_update)
    cfg = micro_cfg(micro_world, tmp_path, "run.name=broken", "train.steps=3", "log.checkpoint_every=1")
    last = tmp_path / "broken" / "checkpoints" / "step_000001"
    with pytest.raises(NonFiniteWeightsError, match=rf"an optimizer update at step 2 made the policy's weights "
                                                    rf"non-finite .*; the last checkpoint, {last}, holds finite weights"):
        train(cfg, progress=False)
    assert (tmp_path / "broken" / "checkpoints" / "latest").read_text() == "step_000001"  # not overwritten


@pytest.mark.e2e
def test_a_reward_on_an_absurd_scale_stops_the_cli_after_skipped_updates(micro_world, tmp_path):
    # Finite rewards of 3e38 overflow their group's mean to inf: NaN advantages, a NaN loss, every update
    # skipped. The default train.max_skipped_updates=4 stops the run when step 2 ends (two updates a step)
    out = run_cli("train", *micro_args(micro_world, tmp_path, "train.steps=3",
                                       "reward.weights={python:tests.test_train:huge_reward: 1.0}"))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    error = [ln for ln in out.stderr.splitlines() if ln.startswith("grpo-vision: error:")]
    assert error == [f"grpo-vision: error: 4 optimizer updates in a row were skipped (non-finite loss or gradient; "
                     f"train.max_skipped_updates=4): saved a checkpoint at step 2 in {tmp_path / 'shapes_micro'}; "
                     "lower train.lr or check the rewards before resuming"]
    assert (tmp_path / "shapes_micro" / "checkpoints" / "latest").read_text() == "step_000002"


def test_a_reward_that_never_applies_finishes_with_warnings_not_silence(micro_world, tmp_path, capfd):
    from grpo_vision.cli import main

    main(["train", *micro_args(micro_world, tmp_path, "reward.weights={python:tests.test_train:nan_reward: 1.0}")])
    out = capfd.readouterr()  # main returned: exit status 0
    assert "[train] done: " in out.out and out.out.rstrip().endswith("report.md (0 of 4 updates skipped)")
    warnings = [ln for ln in out.err.splitlines() if ln.startswith("[train] WARNING")]
    assert warnings[0].startswith("[train] WARNING: step 1 has nothing to learn from: the trained rewards "
                                  "('python:tests.test_train:nan_reward') returned NaN for every image they weigh")
    assert warnings[1] == "[train] WARNING: 2 of 2 steps had no trained reward for any image (NaN, or weight 0): " \
                          "nothing to learn from"  # the summary after the final line
    run = tmp_path / "shapes_micro"
    last = load_metrics(run)[-1]
    assert (last["train/steps_without_signal"], last["train/steps_no_spread"]) == (2, 2)
    assert "2 of 2 steps had no trained reward" in (run / "report.md").read_text()


def test_prompt_entries_that_weigh_no_reward_are_counted(micro_world, tmp_path, capfd):
    prompts = tmp_path / "zero.jsonl"
    prompts.write_text('{"prompt": "a red circle", "rewards": {"clip": 0}}\n'
                       '{"prompt": "a blue square", "rewards": {"clip": 0, "aesthetic": 0}}\n')
    (tmp_path / "test.txt").write_text("a green circle\n")  # a test set of its own: nothing is held back
    run = train(micro_cfg(micro_world, tmp_path, "run.name=zero", f"data.train_prompts={prompts}",
                          f"data.eval_prompts={tmp_path / 'test.txt'}", "train.steps=1"), progress=False)
    last = load_metrics(run)[-1]
    assert last["train/steps_without_signal"] == 1
    assert "every prompt entry of the step gives weight 0 to every reward" in capfd.readouterr().err


@pytest.mark.parametrize("reward, needle", [
    ("raising_reward", "ValueError: scorer offline"),
    # Before, the inf made its group's advantages NaN and every update of the run was skipped, silently
    ("inf_reward", r"returned inf for 2 of 8 images \(the first for prompt '[a-z ]+'\); a reward must be finite, "
                   "or NaN where it does not apply"),
    ("exiting_reward", r"it called exit\(0\), which would end the run; a reward returns scores or raises an error"),
])
def test_a_reward_failing_at_the_first_step_leaves_the_folder_to_the_same_command(micro_world, tmp_path, reward,
                                                                                   needle):
    cfg = micro_cfg(micro_world, tmp_path, "run.name=stop", f"reward.weights={{python:tests.test_train:{reward}: 1.0}}",
                    "reward.monitor=[]")
    for _ in range(2):  # before: a checkpoint of the untouched weights, then "already holds a run" the second time
        with pytest.raises(RewardError, match=rf"^reward 'python:tests.test_train:{reward}' failed: {needle} \(no step "
                                              r"had finished, nothing was saved: the same command starts again\)$"):
            train(cfg, progress=False)
        assert not (tmp_path / "stop" / "checkpoints").exists()
    cfg.reward.weights = {"clip": 1.0}  # the reward fixed, the same folder
    assert load_metrics(train(cfg, progress=False))[-1]["step"] == 2


def test_a_reward_that_exits_later_stops_the_run_with_a_checkpoint_and_status_1(micro_world, tmp_path, capsys):
    import importlib

    from grpo_vision.cli import main

    importlib.import_module("tests.test_train").CALLS.clear()
    with pytest.raises(SystemExit) as exit_status:  # before: SystemExit(0) from the reward itself
        main(["train", str(MICRO), f"policy.path={micro_world}",
              f"run.out_dir={tmp_path}", "run.name=exit", "reward.weights={python:tests.test_train:exiting_later: 1.0}",
              "reward.monitor=[]", "log.checkpoint_every=0", "log.sample_every=0"])
    assert exit_status.value.code == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == (f"grpo-vision: error: reward 'python:tests.test_train:exiting_later' failed: it called exit(0), "
                   "which would end the run; a reward returns scores or raises an error (checkpoint saved at step 1 "
                   f"in {tmp_path / 'exit'})")
    assert (tmp_path / "exit" / "checkpoints" / "latest").read_text() == "step_000001"


def test_a_corrupt_reward_model_stops_the_run_before_it_starts(micro_world, tmp_path):
    # A reward model of its own (a broken file inside the world is a WorldError: tests/shapes/test_world.py)
    clip_file = tmp_path / "clip.safetensors"
    clip_file.write_bytes((micro_world / "clip" / "clip.safetensors").read_bytes()[:1000])  # cut short, as by a failed copy
    cfg = micro_cfg(micro_world, tmp_path, "run.name=corrupt", f"reward.options.clip.checkpoint={clip_file}")
    with pytest.raises(RewardError, match=r"reward 'clip' failed: its model did not load: .*cannot read the CLIP "
                                          r"checkpoint .*clip\.safetensors: the file is damaged, cut short"):
        train(cfg, progress=False)
    assert not (tmp_path / "corrupt").exists()  # nothing sampled, nothing written


@pytest.mark.e2e
def test_bad_input_is_named(micro_world, tmp_path):
    cli = run_cli
    base = ["train", str(MICRO), f"policy.path={micro_world}", f"run.out_dir={tmp_path}"]
    out = cli(*base, "reward.weights={clipp: 1.0}")
    assert out.returncode == 2 and "unknown reward 'clipp'; registered rewards:" in out.stderr
    assert "shapes_exact" in out.stderr and "Traceback" not in out.stderr
    out = cli("train", str(MICRO), f"policy.path={tmp_path / 'no_world'}")
    assert out.returncode == 2 and f"world directory not found: {tmp_path / 'no_world'}" in out.stderr
    out = cli(*base, "sample.group_size=1")
    assert out.returncode == 2 and "sample.group_size must be >= 2" in out.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a red circle"}\n{"prompt": \n')
    out = cli(*base, f"data.train_prompts={bad}")
    assert out.returncode == 2 and "bad.jsonl, line 2: not valid JSON" in out.stderr
    out = cli("eval", str(tmp_path / "missing_run"), "--prompts", str(bad))
    assert out.returncode == 2 and "missing_run is not a run directory" in out.stderr


@pytest.mark.e2e
def test_unreadable_prompts_and_a_step_too_large_for_memory_are_refused_by_the_cli(micro_world, tmp_path):
    def cli(*args):
        out = run_cli("train", str(MICRO), f"policy.path={micro_world}", f"run.out_dir={tmp_path}", *args)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        errors = [ln for ln in out.stderr.splitlines() if ln.startswith("grpo-vision: error: ")]
        assert len(errors) == 1, out.stderr[-3000:]
        return errors[0]

    # Before: trained on as <unk>, and as a literal caption with its braces
    words = tmp_path / "words.txt"
    words.write_text("a red circle\na teal hexagon\n")
    assert f"{words}, line 2: words the policy does not know: 'teal', 'hexagon' (its vocabulary: a " in \
        cli(f"data.train_prompts={words}", "data.test_prompts=1")
    json_line = tmp_path / "mixed.txt"
    json_line.write_text('a red circle\n{"prompt": "a blue square"}\n')
    assert "mixed.txt, line 2: looks like JSON" in cli(f"data.train_prompts={json_line}", "data.test_prompts=1")
    # Before: minutes of work, then an out-of-memory traceback. 6.4 million images of 64 x 64 are more than
    # 900 GiB as float32, beyond any machine, so this refusal does not depend on where the test runs
    error = cli("sample.prompts_per_step=100000", "sample.group_size=64")
    assert "GiB are available; the largest part is step" in error and "lower sample.prompts_per_step" in error
    assert not (tmp_path / "shapes_micro").exists()  # refused before the run's folder was written


def test_the_memory_estimate_refuses_the_step_of_the_report(micro_world, tmp_path, monkeypatch):
    # The finding itself (prompts_per_step=100000, 400,000 images a step), on a machine with 16 GiB free
    monkeypatch.setattr("grpo_vision.run.memory.available_memory", lambda device: 16 * 2**30)
    with pytest.raises(ConfigError, match=r"this run needs about \d+\.\d GiB but 16.0 GiB are available; the largest "
                                          r"part is step .*lower sample.prompts_per_step"):
        train(micro_cfg(micro_world, tmp_path, "sample.prompts_per_step=100000"), progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA-graph decode runs where there is a GPU")
def test_a_decode_path_the_device_cannot_run_is_refused_before_the_run_folder(micro_world, tmp_path):
    with pytest.raises(ConfigError, match=r"^sample.decode 'graph' needs a CUDA device \(the rows are on cpu\); use "
                                          r"static or auto$"):
        train(micro_cfg(micro_world, tmp_path, "sample.decode=graph"), progress=False)
    assert not (tmp_path / "shapes_micro").exists()


@pytest.mark.e2e
def test_ctrl_c_finishes_the_step_saves_and_resumes(micro_world, tmp_path):
    import signal
    import time

    cmd = cli_cmd("train", *micro_args(micro_world, tmp_path, "train.steps=50", "log.checkpoint_every=0"))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "shapes_micro"
    deadline = time.monotonic() + 300
    while not load_metrics(run) and proc.poll() is None and time.monotonic() < deadline:  # a cut line is skipped
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    done = len(load_metrics(run))
    assert f"saved a checkpoint at step {done}" in err
    assert (run / "checkpoints" / "latest").read_text() == f"step_{done:06d}"
    out = run_cli("train", "--resume", str(run), f"train.steps={done + 1}", "log.eval_images=1", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [m["step"] for m in load_metrics(run)] == list(range(1, done + 2))


@pytest.mark.e2e
def test_bf16_mixed_precision_starts_at_ratio_one_and_zero_kl(micro_world, tmp_path):
    # Old and reference log-probs are taken under the update's autocast, so at the first update the
    # ratio is 1 and the KL to the (still identical) reference is 0, not a bf16-vs-fp32 rounding gap.
    # In its own process: accelerate fixes the mixed-precision mode once per process.
    out = run_cli("train", *micro_args(micro_world, tmp_path, "train.mixed_precision=bf16", "train.steps=1",
                                       "train.num_iterations=1", "train.minibatches_per_pass=1"), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    m = load_metrics(tmp_path / "shapes_micro")[0]
    assert m["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["loss/kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(v is not None and math.isfinite(v) for v in m.values()), m
    # ... but the sampler drew in float32: the on-policy gauge sees the rounding gap (2.6e-3 measured),
    # below the limit for low precision, so no warning
    assert 1e-3 < m["rollout/logp_drift"] < 5e-2
    assert "rollout/logp_drift is" not in out.stderr


def test_bf16_rollouts_show_their_cost_in_the_drift_and_keep_the_first_ratio_at_one(micro_world, tmp_path):
    # sample.mixed_precision: the sampler draws under bf16 autocast while the update runs in float32: the old
    # log-probs are recomputed in the update's precision (ratio 1), and the gauge shows the rounding gap
    run = train(micro_cfg(micro_world, tmp_path, "sample.mixed_precision=bf16", "train.steps=1", "log.report=false",
                          "train.num_iterations=1", "train.minibatches_per_pass=1"), progress=False)
    m = load_metrics(run)[0]
    assert m["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert 1e-3 < m["rollout/logp_drift"] < 5e-2  # float32 rollouts: below 1e-5 (test_algorithms.py)


def test_speculative_rollouts_log_their_forward_passes_and_stay_on_policy(micro_world, tmp_path):
    # sample.decode=speculative draws the plain path's distribution in fewer passes: the metrics count the
    # passes (an image of N tokens needs between N / W and N, the prefill included) and the sampler's log-probs
    # are still the update's (drift at float noise, first ratio 1)
    one_update = ("train.steps=1", "log.report=false", "train.num_iterations=1", "train.minibatches_per_pass=1")
    run = train(micro_cfg(micro_world, tmp_path, "sample.decode=speculative", "sample.speculative_window=4",
                          "sample.speculative_candidates=2", "sample.speculative_branching=1", *one_update),
                progress=False)
    m = load_metrics(run)[0]
    tokens = m["rollout/tokens_per_forward"] * m["rollout/forwards_per_image"]
    assert 1 < m["rollout/tokens_per_forward"] <= 4 and tokens == pytest.approx(round(tokens))
    assert m["rollout/forwards_per_image"] <= m["rollout/forwards_slowest"] <= tokens
    assert m["rollout/logp_drift"] < 1e-5 and m["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    plain = load_metrics(train(micro_cfg(micro_world, tmp_path, "run.name=plain", *one_update), progress=False))[0]
    assert not any(k.startswith("rollout/forwards") for k in plain)


def test_a_sampler_and_a_scorer_that_disagree_are_warned_about_once(micro_world, tmp_path, monkeypatch, capfd):
    from grpo_vision.sampling import sequence_logprobs

    def off_by_a_tenth(*args, **kwargs):  # as a scorer at another temperature than the sampler's would be
        return sequence_logprobs(*args, **kwargs) - 0.1

    monkeypatch.setattr("grpo_vision.step.update.sequence_logprobs", off_by_a_tenth)
    run = train(micro_cfg(micro_world, tmp_path, "run.name=drift", "log.report=false"), progress=False)
    drifts = [m["rollout/logp_drift"] for m in load_metrics(run)]
    assert drifts == pytest.approx([0.1, 0.1], abs=1e-5)  # logged every step
    err = capfd.readouterr().err
    assert err.count("rollout/logp_drift is 0.1 nats per token") == 1 and "temperature, top-k" in err


def test_a_new_run_never_overwrites_an_existing_one(micro_world, tmp_path):
    run = tmp_path / "shapes_micro"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="already holds a run; continue it with --resume"):
        train(micro_cfg(micro_world, tmp_path), progress=False)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_bad_resume_override_leaves_the_run_config_alone(micro_world, tmp_path):
    run = tmp_path / "shapes_micro"
    run.mkdir()
    save_config(micro_cfg(micro_world, tmp_path), run / "config.yaml")
    before = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="unknown reward 'clp'"):
        train(load_config(run / "config.yaml", ["reward.weights.clp=1.0"]), resume=run, progress=False)
    assert (run / "config.yaml").read_text() == before


def test_a_metrics_line_cut_short_by_a_crash_is_skipped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lr": 0.1}\n{"step": 2, "l')
    assert load_metrics(tmp_path) == [{"step": 1, "lr": 0.1}]


def test_kl_measured_on_a_subset_leaves_training_unchanged(micro_world, tmp_path):
    # With beta 0 the reference only yields the logged KL; measuring it on 4 of the 8 sequences a
    # step must not change the update, and the KL it logs stays a finite, non-negative number.
    runs = {k: train(micro_cfg(micro_world, tmp_path, f"run.name=kl{k}", "train.beta=0",
                               f"train.kl_metric_sequences={k}"), progress=False) for k in (0, 4)}
    a, b = (load_file(runs[k] / "checkpoints" / "step_000002" / "policy.safetensors") for k in (0, 4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = {k: load_metrics(runs[k]) for k in (0, 4)}
    assert [m["loss/policy"] for m in rows[0]] == [m["loss/policy"] for m in rows[4]]
    for m0, m4 in zip(rows[0], rows[4]):
        assert math.isfinite(m4["loss/kl"]) and m4["loss/kl"] >= 0
        assert m4["loss/kl"] != m0["loss/kl"] or m0["step"] == 1  # a different sample of the same policy pair


def test_eval_and_sample_cli_sample_at_the_asked_temperature(micro_run, tmp_path, capsys):
    from grpo_vision.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\na small blue square\n")

    def cli(*args):
        capsys.readouterr()
        main(list(args))
        return capsys.readouterr().out

    default, cooler = (json.loads(cli("eval", str(micro_run), "--prompts", str(prompts), "--n", "2", *extra))
                       for extra in ((), ("--temperature", "0.4")))
    assert (default["temperature"], cooler["temperature"]) == (0.7, 0.4)  # the run's headline, then the asked one
    assert default["models"]["policy"]["judge"]["correct"]["n"] == 4
    cli("sample", str(micro_run), "--prompts", str(prompts), "--out", str(tmp_path / "s"), "--n", "1",
        "--temperature", "0.4")
    assert len((tmp_path / "s" / "index.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_training_runs_on_the_device(micro_world, tmp_path, device):
    # The main job's settings (beta 0, the KL logged on a subset), sample grids and the report, on each
    # device: every tensor the loop makes for itself must live on the policy's device (on cuda the
    # logged-KL sums once sat on the CPU and the first update crashed).
    run = train(micro_cfg(micro_world, tmp_path, f"run.device={device}", "train.beta=0", "train.kl_metric_sequences=4",
                          "train.num_iterations=1", "train.minibatches_per_pass=1", "train.lr=1e-3",
                          "train.warmup_steps=0", "log.sample_every=1"), progress=False)
    rows = load_metrics(run)
    assert [m["step"] for m in rows] == [1, 2]
    assert all(v is not None and math.isfinite(v) for m in rows for v in m.values()), rows
    assert rows[0]["loss/kl"] == pytest.approx(0.0, abs=1e-5) and rows[1]["loss/kl"] > 1e-6  # one update apart
    assert (run / "eval.json").exists() and (run / "samples" / "step_000001.png").exists()


def test_without_a_reference_grids_and_report_sample_the_base_policy_loaded_once(micro_world, tmp_path, monkeypatch):
    # train.reference=none: sample grids at every step and the report still compare with the base
    # policy, which is loaded once (not once a grid), on the run's device (not a hard-coded CPU).
    import grpo_vision.step.load as load_module
    from grpo_vision.policy import load_bundle
    from grpo_vision.run.machine import resolve_device

    loads = []

    def counting(pcfg, device):
        loads.append(str(device))
        return load_bundle(pcfg, device)

    monkeypatch.setattr(load_module, "load_bundle", counting)
    device = resolve_device("auto")
    run = train(micro_cfg(micro_world, tmp_path, "run.device=auto", "train.reference=none", "train.beta=0",
                          "train.steps=2", "log.sample_every=1"), progress=False)
    assert len(loads) == 2 and all(d.startswith(device) for d in loads)  # the policy, then the base once
    assert (run / "samples" / "step_000002.png").exists() and (run / "eval.json").exists()
    result = json.loads((run / "eval.json").read_text())["sets"]["test"]
    assert result["models"]["reference"]["rewards"]["clip"]["n"] == result["models"]["policy"]["rewards"]["clip"]["n"]


def test_the_reference_sampler_loads_the_base_once_on_the_policys_device(tiny_policy):
    from grpo_vision.step.reference import Reference

    loads = []

    def load_base():
        loads.append(1)
        return copy.deepcopy(tiny_policy)

    reference = Reference(tiny_policy, "none", load_base=load_base)
    first, _ = reference.sampler(tiny_policy)
    second, _ = reference.sampler(tiny_policy)
    assert first is second and len(loads) == 1 and first is not tiny_policy
    assert next(first.parameters()).device == next(tiny_policy.parameters()).device
    assert not any(p.requires_grad for p in first.parameters())
    frozen = Reference(tiny_policy, "frozen")
    assert frozen.sampler(tiny_policy)[0] is frozen.model
    with pytest.raises(ValueError, match="no way to load its base policy"):
        Reference(tiny_policy, "none").sampler(tiny_policy)


def test_rewards_combined_normalize_then_sum_train_and_log_each_rewards_spread(micro_world, tmp_path):
    run = train(micro_cfg(micro_world, tmp_path, "run.name=gdpo", "train.steps=1", "reward.combine=normalize_then_sum"),
                progress=False)
    row = load_metrics(run)[0]
    for name in ("clip", "aesthetic", "shapes_exact"):
        assert 0.0 <= row[f"reward/{name}/frac_zero_std"] <= 1.0
    # z-scores summed: each group's total has mean 0, so the batch mean is 0 up to rounding (which a
    # group of near-equal CLIP scores amplifies by 1 / (its std + 1e-4))
    assert abs(row["reward/total/mean"]) < 1e-2 and math.isfinite(row["loss/policy"])
    with pytest.raises(ConfigError, match="'reward.combine' expects one of 'sum_then_normalize', 'normalize_then_sum'"):
        load_config(None, ["reward.combine=gdpo"])


def test_a_finished_run_leaves_no_tensors_behind(tmp_path):
    # a LlamaGen run's models sit in reference cycles that only the cycle collector frees: train() collects
    # them when it returns, so a script's next run (bench gpu's next item) does not carry this one's memory
    # into its peak (without it 21 tensors were left here; on one H200 a whole model's weights)
    import gc

    from grpo_vision.tools.bench_gpu import STEP_COMMON
    from grpo_vision.tools.presets import preset_overrides

    def run(name):
        overrides = [*preset_overrides("llamagen-t2i-xl-tiny", tmp_path / "preset", "float32"),
                     *(o.replace("{G}", "2") for o in STEP_COMMON), "train.micro_batch_size=2", "train.steps=1",
                     "log.sample_every=0", "log.report=false", f"run.out_dir={tmp_path}", f"run.name={name}"]
        train(load_config(ROOT / "configs" / "llamagen_t2i.yaml", overrides), progress=False)

    def tensors():
        return {id(t): t for t in gc.get_objects() if isinstance(t, torch.Tensor)}

    run("first")  # the process-wide caches (the caption encoder, reward models) are filled once
    gc.collect()
    before = tensors()
    gc.disable()  # no collection by chance: only train()'s own
    try:
        run("second")
        left = [t for i, t in tensors().items() if i not in before]
    finally:
        gc.enable()
    # the run's weights (a lazily filled cache of some library would hold plain tensors, not parameters)
    assert [t for t in left if isinstance(t, torch.nn.Parameter)] == [], [tuple(t.shape) for t in left]


def test_a_resume_of_a_finished_run_records_no_override(micro_world, tmp_path):
    """A resume that trains nothing rewrote config.yaml with overrides no step used."""
    run = train(micro_cfg(micro_world, tmp_path, "run.name=done", "train.steps=1", "log.report=false"),
                progress=False)
    recorded = (run / "config.yaml").read_bytes()
    train(load_config(run / "config.yaml", ["train.lr=0.5", "log.eval_images=3"]), resume=run, progress=False)
    assert (run / "config.yaml").read_bytes() == recorded
    train(load_config(run / "config.yaml", ["train.steps=2"]), resume=run, progress=False)  # a step trains: kept
    assert "steps: 2" in (run / "config.yaml").read_text()


def test_a_resume_trains_at_its_own_lr(micro_world, tmp_path):
    """A resume's train.lr=0.01 was written to config.yaml, and every step trained at the checkpoint's 1e-5: the
    optimizer's saved param groups and the schedule's base_lrs brought the old lr back."""
    run = train(micro_cfg(micro_world, tmp_path, "train.steps=1", "log.report=false"), progress=False)
    train(load_config(run / "config.yaml", ["train.steps=2", "train.lr=0.01"]), resume=run, progress=False)
    assert [m["lr"] for m in load_metrics(run)] == [1e-5, 0.01]
    a, b = (load_file(run / "checkpoints" / f"step_{s:06d}" / "policy.safetensors") for s in (1, 2))
    # AdamW moves a weight by about lr per update (two here): at 1e-5 no weight moves 1e-3
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-3
