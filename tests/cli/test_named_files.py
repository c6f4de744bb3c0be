"""Every file a config names is checked by `grpo-vision config` and at the start of `train`, before any model
loads, and all the missing ones are named in one line."""

import pytest

from grpo_vision.cli import main
from tests.helpers import ROOT

T2I_R1 = ROOT / "configs" / "janus_pro_t2i_r1.yaml"
NAMED = [("policy.path", "models/Janus-Pro-7B"), ("data.train_prompts", "data/t2i_r1_train.jsonl"),
         ("data.eval_prompts", "data/t2i_r1_eval.jsonl"),
         ("reward.options.hpsv2.checkpoint", "models/hpsv2/HPS_v2.1_compressed.pt"),
         ("reward.options.geneval.detector_path", "models/owlv2-base-patch16-ensemble"),
         ("reward.options.vlm_judge.path", "models/Qwen2.5-VL-3B-Instruct")]


def error_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", ["config", "train"])
def test_every_missing_file_of_the_t2i_r1_config_is_named_in_one_line_before_a_model_loads(command, tmp_path,
                                                                                          monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the config's paths are relative to where the command runs
    err = error_of([command, str(T2I_R1)], capsys)
    assert err == ("grpo-vision: error: 6 file(s) the config names are missing: "
                   + "; ".join(f"{key} {path}" for key, path in NAMED)
                   + "; put them there or point the keys elsewhere (docs/real_models.md says where each model comes "
                     "from and how to make a prompts file)\n")
    assert not (tmp_path / "runs").exists()  # train stopped before its run folder
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t2i_r1_train.jsonl").write_text('{"prompt": "a red apple"}\n')
    err = error_of([command, str(T2I_R1)], capsys)
    assert "5 file(s)" in err and "data/t2i_r1_train.jsonl" not in err and "data/t2i_r1_eval.jsonl" in err


def test_config_passes_once_every_named_file_is_there(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for _, path in NAMED:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    main(["config", str(T2I_R1)])
    assert "# derived: " in capsys.readouterr().out


def test_a_reward_not_trained_on_or_monitored_names_no_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = error_of(["config", str(ROOT / "configs" / "shapes.yaml"), "reward.options.hpsv2.checkpoint=nowhere.pt",
                    f"policy.path={ROOT / 'worlds' / 'shapes'}", "data.train_prompts=none.txt"], capsys)
    assert err.startswith("grpo-vision: error: 1 file(s) the config names are missing: data.train_prompts none.txt; ")


def test_a_missing_world_is_named_with_the_command_that_builds_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for command in ("config", "train"):
        assert error_of([command, str(ROOT / "configs" / "shapes_micro.yaml")], capsys) == (
            "grpo-vision: error: world directory not found: worlds/shapes_micro; build it with: grpo-vision world "
            "build --out worlds/shapes_micro\n")
