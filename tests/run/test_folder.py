"""Reading a run folder (run/folder.py): its config from here, on the device this machine has."""

import torch

from grpo_vision.config import load_config, save_config
from grpo_vision.run.folder import read_run_config
from tests.helpers import MICRO


def test_by_default_a_run_samples_where_it_trained_if_this_machine_has_that_device(tmp_path, monkeypatch):
    # a CPU run evaluated on a GPU box samples on the CPU (CUDA's random streams differ, so its report would
    # not reproduce); `auto` asks for the best device here, and a device this machine lacks falls back to it
    run = tmp_path / "cpu_run"
    run.mkdir()
    config = run / "config.yaml"  # all read_run_config reads of a run folder (no origin.json: paths from here)
    save_config(load_config(MICRO, ["run.device=cpu"]), config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert read_run_config(run, device="run").run.device == "cpu"
    assert read_run_config(run, device="auto").run.device == "auto"
    config.write_text(config.read_text().replace("device: cpu", "device: cuda:3"))  # trained on a bigger box
    assert read_run_config(run, device="run").run.device == "auto"


def test_the_resume_command_trusts_a_run_whose_rewards_were_made_in_a_script(tmp_path):
    # a reward made in a script (a copy in code/) or in the user's module (a spec) is imported again only with
    # --trust-run: the "continue with" line a signal or an alert prints must carry it; built-ins need nothing
    import json

    from grpo_vision.config import Config
    from grpo_vision.run.folder import resume_command

    built_in = {"clip": {"module": "grpo_vision.rewards.models", "function": "clip"}}
    (tmp_path / "rewards.json").write_text(json.dumps(built_in))
    assert resume_command(tmp_path, Config()) == f"grpo-vision train --resume {tmp_path}"
    script = {"bright": {"module": "__main__", "function": "bright", "script": "t.py", "code": "code/t.py"}}
    (tmp_path / "rewards.json").write_text(json.dumps(built_in | script))
    assert resume_command(tmp_path, Config()) == f"grpo-vision train --resume {tmp_path} --trust-run"


def test_a_run_folders_rewards_json_that_is_no_json_object_reads_as_none(tmp_path):
    # a run folder may come from anyone: a FIFO in rewards.json's place is never waited on, JSON nested past the
    # parser's limit or of another shape is read as no record, and only object entries count
    import json
    import os

    from grpo_vision.run.folder import reward_records

    assert reward_records(tmp_path) == {}
    os.mkfifo(tmp_path / "rewards.json")
    assert reward_records(tmp_path) == {}
    os.remove(tmp_path / "rewards.json")
    for text in ("[" * 100_000, "[1, 2]", "not json"):
        (tmp_path / "rewards.json").write_text(text)
        assert reward_records(tmp_path) == {}
    (tmp_path / "rewards.json").write_text(json.dumps({"a": {"spec": "python:m:f"}, "b": 3}))
    assert reward_records(tmp_path) == {"a": {"spec": "python:m:f"}}
