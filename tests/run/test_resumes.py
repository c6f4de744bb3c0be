"""Which settings trained each step (run/resumes.py): a resume's changes recorded from the step they apply, and an
earlier checkpoint read with the config that trained it."""

import json
import re
import shutil

from grpo_vision.config import load_config, save_config
from grpo_vision.step.load import load_run
from grpo_vision.run.folder import read_run_config
from grpo_vision.run.metrics import load_metrics
from grpo_vision.run.resumes import RESUMES, record_resume, resume_lines
from grpo_vision.train import train
from tests.helpers import micro_cfg


def test_a_resume_records_what_it_changed_from_its_first_step(micro_run, tmp_path):
    """Before, a resume with sample.decode=speculative rewrote config.yaml for the whole run, and only
    metrics.jsonl showed the switch."""
    run = shutil.copytree(micro_run, tmp_path / "run")  # two steps at cfg_scale 2.0, a checkpoint each
    train(load_config(run / "config.yaml", ["train.steps=3", "sample.cfg_scale=3.0", "sample.decode=speculative",
                                            "log.sample_every=0", "log.report=false"]), resume=run, progress=False)
    assert [m["step"] for m in load_metrics(run)] == [1, 2, 3]
    (record,) = [json.loads(line) for line in (run / RESUMES).read_text().splitlines()]
    assert record["step"] == 3 and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}", record["time"])
    assert record["changes"] == {"sample.cfg_scale": [2.0, 3.0], "sample.decode": ["auto", "speculative"],
                                 "train.steps": [2, 3], "log.sample_every": [1, 0], "log.report": [True, False]}
    assert (run / "config.yaml").read_text().startswith(f"# The config in force from step 3 on; {RESUMES} lists ")
    assert read_run_config(run).sample.cfg_scale == 3.0  # the latest, as every reader of config.yaml had it
    # a checkpoint is loaded with the settings that trained it
    assert [(r.step, r.cfg.sample.cfg_scale, r.cfg.sample.decode) for r in (load_run(run, 2), load_run(run))] == [
        (2, 2.0, "auto"), (3, 3.0, "speculative")]
    assert resume_lines(run)[-2] == (f"- from step 3 ({record['time']}): sample.cfg_scale 2.0 -> 3.0, sample.decode "
                                     '"auto" -> "speculative", train.steps 2 -> 3, log.sample_every 1 -> 0, '
                                     "log.report true -> false")


def test_the_config_of_a_step_undoes_the_later_resumes_only(micro_world, tmp_path):
    """The text plan turned off from step 11, speculative decoding from step 21: each checkpoint reads its own."""
    run = tmp_path / "run"
    save_config(micro_cfg(micro_world, tmp_path, "sample.plan.enabled=false", "sample.decode=speculative"),
                run / "config.yaml")
    record_resume(run, 10, {"sample.plan.enabled": [True, False]})
    record_resume(run, 20, {"sample.decode": ["auto", "speculative"]})
    with open(run / RESUMES, "a") as f:
        f.write('{"step": 31, "changes": {"sample.decode": ["spec')  # cut short by a crash: skipped
    in_force = {s: (c.sample.plan.enabled, c.sample.decode)
                for s in (10, 11, 20, 21, 40) for c in [read_run_config(run, step=s)]}
    assert in_force == {10: (True, "auto"), 11: (False, "auto"), 20: (False, "auto"), 21: (False, "speculative"),
                        40: (False, "speculative")}
    assert (read_run_config(run).sample.plan.enabled, read_run_config(run).sample.decode) == (False, "speculative")
