"""The report's judge tables (ShapesWorld's checker as the judge): per attribute and per prompt form; the
commands that read a run folder (eval, sample): from any directory, on any device, with checked prompts."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_vision.config import load_config
from grpo_vision.evaluation.evaluate import eval_params
from grpo_vision.policy import Judge
from grpo_vision.evaluation.judge import judge_tables
from grpo_vision.shapes.judge import ShapesJudge
from grpo_vision.shapes.layout import scene_for_caption
from grpo_vision.shapes.scene import render
from tests.helpers import MICRO, ROOT


def test_judge_tables_count_renders_right_per_form():
    judge = ShapesJudge()
    assert isinstance(judge, Judge)
    rng = np.random.default_rng(0)
    captions = ["a red circle", "a small blue square", "a green triangle on a black background",
                "a red circle left of a blue square"]
    images = torch.from_numpy(np.stack([render(scene_for_caption(c, rng)) for c in captions])).permute(0, 3, 1, 2)
    prompts = captions + ["a red square"] * 4  # the same images under a caption none of them fits
    images = torch.cat([images, images])
    table, by_form = judge_tables(judge, images, prompts)
    assert list(by_form) == ["plain", "size", "background", "relation"]
    assert [by_form[f]["mean"] for f in by_form] == [0.2, 1.0, 1.0, 1.0]  # plain: 1 of its 5 images
    assert [by_form[f]["n"] for f in by_form] == [5, 1, 1, 1]
    assert table["correct"]["mean"] == 0.5
    assert judge_tables(judge, images[:1], ["a photo of a cat"]) == (None, None)
    assert judge_tables(None, images[:1], ["a red circle"]) == (None, None)  # a policy kind without a judge
    assert judge_tables(judge, images[:1], ["A Red  circle"])[1]["plain"]["mean"] == 1.0  # read as the policy reads it


def test_failure_summary_by_hand():
    from grpo_vision.evaluation.summary import failure_summary

    # two captions x 2 images; the policy fixed both position failures of "a" and failed one object in "b"
    reference = [[("position", "p1")], [("position", "p1"), ("object", "o1")], [], []]
    policy = [[], [], [("object", "o2")], []]
    s = failure_summary(policy, reference, ["a", "a", "b", "b"])
    assert s["kinds"] == ["position", "object"] and s["images"] == 4
    # reference: position on 2 of 4 images, object on 1; policy: position on none, object on 1
    assert s["reference"]["failing"] == {"position": 0.5, "object": 0.25}
    assert s["policy"]["failing"] == {"position": 0.0, "object": 0.25}
    assert s["reference"]["common"] == [("p1", 2), ("o1", 1)] and s["policy"]["common"] == [("o2", 1)]
    # paired per image: position -1, -1, 0, 0 -> mean -0.5; object 0, -1, +1, 0 -> 0
    assert s["change"]["position"]["mean"] == -0.5 and s["change"]["object"]["mean"] == 0.0
    assert s["change"]["position"]["captions"] == 2


def test_eval_params_take_the_given_then_the_headline_then_the_training_temperature():
    cfg = load_config(None, ["sample.temperature=0.9", "sample.top_k=32", "log.eval_temperatures=[0.7,1.0]"])
    assert (eval_params(cfg).temperature, eval_params(cfg, 0.5).temperature) == (0.7, 0.5)
    assert eval_params(cfg).top_k == 32  # only the temperature changes
    assert eval_params(load_config(None, ["sample.temperature=0.9"])).temperature == 0.9


# ---------------------------------------------------------------------------- reading a run folder


@pytest.fixture(scope="module")
def project_run(micro_world, tmp_path_factory):
    """A one-step run trained as a user trains one: in a project folder, `worlds/` beside `runs/`, and the
    config's relative policy.path (configs/shapes_micro.yaml: worlds/shapes_micro)."""
    from grpo_vision.train import train

    project = tmp_path_factory.mktemp("project")
    shutil.copytree(micro_world, project / "worlds" / "shapes_micro")
    here = os.getcwd()
    os.chdir(project)
    try:
        cfg = load_config(MICRO, ["run.out_dir=runs", "train.steps=1", "log.sample_every=0", "log.report=false"])
        return project / train(cfg, progress=False)
    finally:
        os.chdir(here)


def cli(*args) -> None:
    from grpo_vision.cli import main

    main([str(a) for a in args])


def prompts_file(path: Path, text: str = "a red circle\n") -> Path:
    path.write_text(text)
    return path


def test_a_run_folder_reads_from_any_directory(project_run, tmp_path, monkeypatch, capsys):
    from grpo_vision.step.load import load_run
    from grpo_vision.run.folder import read_run_config

    project, prompts = project_run.parents[1], prompts_file(tmp_path / "p.txt")
    assert read_run_config(project_run).policy.path != "worlds/shapes_micro"  # resolved from here, not as typed
    monkeypatch.chdir(tmp_path)  # before: "world directory not found: worlds/shapes_micro"
    cli("eval", project_run, "--prompts", prompts, "--n", 1)
    assert json.loads(capsys.readouterr().out)["step"] == 1
    moved = tmp_path / "other_machine"  # the run folder copied with the world beside it; the original gone
    for part in ("runs", "worlds"):
        shutil.copytree(project / part, moved / part)
    hidden = project.rename(project.with_name(project.name + "_gone"))
    try:
        run = load_run(moved / "runs" / "shapes_micro")
        assert Path(run.cfg.policy.path).resolve() == (moved / "worlds" / "shapes_micro").resolve()
        assert run.step == 1
    finally:
        hidden.rename(project)
    alone = tmp_path / "alone"  # the run folder alone, on the same machine: its world where train ran
    shutil.copytree(project_run, alone)
    assert Path(read_run_config(alone).policy.path).resolve() == (project / "worlds" / "shapes_micro").resolve()
    assert read_run_config(alone, ["data.eval_prompts=p.txt"]).data.eval_prompts == "p.txt"  # typed here: as typed


def test_a_run_resumes_from_any_directory_and_keeps_reading_from_anywhere(project_run, tmp_path, monkeypatch):
    from grpo_vision.run.folder import read_run_config

    world = (project_run.parents[1] / "worlds" / "shapes_micro").resolve()
    run = tmp_path / "runs" / "copy"
    shutil.copytree(project_run, run)
    (run / "run.lock").unlink(missing_ok=True)
    monkeypatch.chdir(tmp_path / "runs")
    cli("train", "--resume", "copy", "train.steps=2")
    saved = (run / "config.yaml").read_text()  # rewritten from here: policy.path relative to this directory
    assert f"path: {os.path.relpath(world)}" in saved and json.loads((run / "origin.json").read_text()) == {
        "cwd": str(tmp_path / "runs"), "cwd_from_run": ".."}
    monkeypatch.chdir(ROOT)
    assert Path(read_run_config(run).policy.path).resolve() == world


def test_a_run_samples_here_whatever_device_it_saved(project_run, tmp_path, monkeypatch, capsys):
    from grpo_vision.tools.demo import DemoRun

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, GPU box or not
    prompts = prompts_file(tmp_path / "p.txt")
    runs = {}
    for saved in ("cuda", "banana"):  # before: "Found no NVIDIA driver"; a torch RuntimeError
        runs[saved] = tmp_path / saved
        shutil.copytree(project_run, runs[saved])
        config = runs[saved] / "config.yaml"
        config.write_text(config.read_text().replace("device: auto", f"device: {saved}"))
    cli("eval", runs["cuda"], "--prompts", prompts, "--n", 1)
    head = json.loads(capsys.readouterr().out)
    assert head["step"] == 1 and head["device"] == "cpu"
    cli("sample", runs["banana"], "--prompts", prompts, "--n", 1, "--out", tmp_path / "out")
    assert (tmp_path / "out" / "00000_00_policy.png").is_file()
    assert next(DemoRun(runs["cuda"]).load(1).policy.parameters()).device.type == "cpu"
    with pytest.raises(SystemExit) as exit_info:
        cli("eval", runs["cuda"], "--prompts", prompts, "--device", "cuda")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("grpo-vision: error: --device=cuda, and this machine has no CUDA GPU torch can "
                                       "use: use --device=auto (the best device here) or cpu\n")


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_prompts_the_policy_cannot_read_are_refused_naming_the_line(project_run, tmp_path, capsys, command):
    # before: unknown words sampled as <unk> with rc 0; a 13-word prompt was a ValueError traceback
    out = ["--out", tmp_path / "out"] if command == "sample" else []
    for text, needle in [
        ("a red circle\na zebra giraffe\n", "p.txt, line 2: words the policy does not know: 'zebra', 'giraffe'"),
        ("a red circle a red circle a red circle a red circle a\n",
         "p.txt, line 1: caption 'a red circle a red circle a red circle a red circle a' has 13 words; this policy "
         "takes at most 10"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli(command, project_run, "--prompts", prompts_file(tmp_path / "p.txt", text), "--n", 1, *out)
        assert exit_info.value.code == 2 and needle in capsys.readouterr().err
    if command == "sample":
        meta = prompts_file(tmp_path / "meta.jsonl", '{"prompt": "a purple banana", "tag": "single_object", '
                                                     '"include": [{"class": "banana", "count": 1}]}\n')
        with pytest.raises(SystemExit):
            cli("sample", project_run, "--prompts", meta, "--layout", "geneval", *out)
        assert "meta.jsonl, line 1: words the policy does not know: 'banana'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_last_images_seed_must_stay_in_range(project_run, tmp_path, capsys):
    three = prompts_file(tmp_path / "p.txt", "a red circle\na blue square\na green triangle\n")
    for args, last in [(["sample", project_run, "--prompts", three, "--out", tmp_path / "o", "--n", 4,
                         "--seed", 2**32 - 1], 2**32 - 1 + 3),  # seed + j
                       (["eval", project_run, "--prompts", three, "--n", 2, "--seed", 2**32 - 2000],
                        2**32 - 2000 + 2001)]:  # seed + 1000 i + j
        with pytest.raises(SystemExit):
            cli(*args)
        assert f"the last image would get seed {last}, past the largest seed, 4294967295" in capsys.readouterr().err


def test_eval_scores_three_sets_with_intervals_over_captions_and_draws_again(project_run, tmp_path, capsys):
    from grpo_vision.config import ConfigError
    from grpo_vision.prompts import load_prompts

    cli("eval", project_run, "--n", 2)
    sets = json.loads(capsys.readouterr().out)["sets"]
    assert list(sets) == ["test", "heldout", "train_sample"]  # the headline first, then what it trained on
    test = sets["test"]
    assert (test["prompts"], test["images_per_prompt"]) == (8, 2)  # configs/shapes_micro.yaml: data.eval_size 8
    assert test["captions"] == len({e.prompt for e in load_prompts(project_run / "prompts" / "test.jsonl")})
    change = test["judge_difference_ci"]["correct"]
    assert change["captions"] == test["captions"] and change["n"] == 16  # resampled by caption, 16 images
    assert test["judge_difference_ci_per_image"]["correct"]["mean"] == change["mean"]  # the same change
    assert "captions" not in test["judge_difference_ci_per_image"]["correct"]  # labelled: per image
    cli("eval", project_run, "--n", 1, "--draw", 2)
    drawn = json.loads(capsys.readouterr().out)
    assert drawn["draw"] == 2 and list(drawn["sets"]) == ["test", "heldout"]  # the training sample is the run's
    with pytest.raises((ConfigError, SystemExit)) as refused:  # raised, or printed in one line and exit 2
        cli("eval", project_run, "--draw", 2, "--prompts", prompts_file(tmp_path / "p.txt"))
    assert "--draw and --prompts: give one" in str(refused.value) + capsys.readouterr().err


def test_a_graph_decode_run_read_without_cuda_samples_with_the_static_step():
    """sample.decode=graph names a CUDA graph; eval and sample of that run on a CPU take the same fixed-shape step
    unrecorded (the same tokens), not a ValueError at the first image."""
    from grpo_vision.config import load_config
    from grpo_vision.evaluation.evaluate import eval_params
    from tests.helpers import MICRO

    assert eval_params(load_config(MICRO, ["sample.decode=graph", "run.device=cpu"])).decode == "static"
    assert eval_params(load_config(MICRO, ["sample.decode=eager", "run.device=cpu"])).decode == "eager"


def test_a_reward_that_skips_prompts_is_averaged_where_it_applies_and_says_on_how_many():
    """`ocr` scores only prompts that quote text (NaN elsewhere): eval's mean is over those, its entry counts them,
    and report.md's row says "k of P prompts"; a reward that applies everywhere keeps its plain entry."""
    from grpo_vision.evaluation.summary import summarize
    from grpo_vision.evaluation.report_text import change_table
    from grpo_vision.prompts import PromptEntry
    from grpo_vision.rollouts import Paired, Scored

    nan = float("nan")
    entries = [PromptEntry(p) for p in ('a "river" sign', "a red circle", 'a "lake" sign') for _ in range(2)]
    sides = {side: torch.tensor(values) for side, values in
             (("policy", [1.0, 0.5, nan, nan, 0.0, 0.5]), ("reference", [0.5, 0.5, nan, nan, 0.0, 0.0]))}
    scored = {side: Scored(total=v, raw={"ocr": v, "placebo": torch.zeros(6)}, weights={})
              for side, v in sides.items()}
    images = {side: torch.zeros(6, 3, 4, 4) for side in sides}
    paired = Paired(2, entries, list(range(6)), scored["policy"], scored["reference"], images,
                    {side: torch.zeros(6) for side in sides})
    result = summarize(paired)
    ocr = result["models"]["policy"]["rewards"]["ocr"]
    assert (ocr["mean"], ocr["n"], ocr["prompts"]) == (0.5, 4, 2)  # (1 + 0.5 + 0 + 0.5) / 4, on 2 of 3 prompts
    assert result["models"]["reference"]["rewards"]["ocr"]["mean"] == 0.25
    assert result["difference_ci"]["ocr"]["captions"] == 2 and result["difference_ci"]["ocr"]["mean"] == 0.25
    assert "prompts" not in result["models"]["policy"]["rewards"]["placebo"]
    rows = change_table(result)
    assert rows[2].startswith("| ocr (2 of 3 prompts) | 0.250 [") and rows[3].startswith("| placebo | 0.000")


def test_the_runs_eval_json_equals_eval_runs_json_key_for_key(micro_run, capsys):
    """The report wrote eval.json in one shape (the test set's numbers at the top, the other sets beside them) and
    `eval RUN` printed another (the sets under "sets"): one measurement, two results. Now both are
    evaluate_loaded's, equal key for key and number for number; `eval --n` defaults to the run's log.eval_images
    (1 here), as the report's draws do, where it took 4."""
    cli("eval", micro_run)
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((micro_run / "eval.json").read_text())
    assert printed == written
    assert list(written["sets"]) == ["test", "heldout", "train_sample"] and list(written["by_temperature"]) == [
        "0.7", "1.0"]  # conftest.py's micro_run: log.eval_temperatures=[0.7,1.0]
    assert written["sets"]["test"]["images_per_prompt"] == load_config(micro_run / "config.yaml").log.eval_images == 1
