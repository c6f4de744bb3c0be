"""The study scripts of docs/experiments/scripts/ (documented reproduction commands): a missing or bad argument
is argparse's two lines (usage, then the error; exit status 2) or one line of the script's own, never a
traceback; guidance_sweep.py's settings pass the config's own checks of sample.cfg_scale / sample.temperature."""

import importlib.util
import math
from types import SimpleNamespace

import pytest

from tests.helpers import ROOT

SCRIPTS = ROOT / "docs" / "experiments" / "scripts"


def script(name: str, monkeypatch):
    """The script as a module, its own folder importable (as `python docs/experiments/scripts/NAME.py` has it)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(call, capsys) -> str:
    """The error line of argparse's usage error (exit status 2, usage and error and nothing else)."""
    with pytest.raises(SystemExit) as exit_:
        call()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 2 and lines[0].startswith("usage: "), lines
    return lines[1]


@pytest.mark.parametrize("name, argv, message", [
    ("plan_following_pilot", [], "the following arguments are required: steps, lr, plan_prob"),
    ("plan_following_pilot", ["ten", "3e-4", "1"], "argument steps: 'ten' is not a whole number"),
    ("plan_following_pilot", ["0", "3e-4", "1"], "argument steps: 0 must be 1 or more"),
    ("plan_following_pilot", ["600", "nan", "1"], "argument lr: nan must be a finite number in (0, 1]"),
    ("plan_following_pilot", ["600", "0", "1"], "argument lr: 0 must be a finite number in (0, 1]"),
    ("plan_following_pilot", ["600", "3e-4", "1.5"], "argument plan_prob: 1.5 must be a finite number in [0, 1]"),
    ("plan_position_pilot", [], "the following arguments are required: steps"),
    ("plan_position_pilot", ["1200", "-3"], "argument n_captions: -3 must be 1 or more"),
    ("plan_position_pilot", ["1200", "48", "1e4"], "argument examples: '1e4' is not a whole number"),
    ("plan_position_pilot", ["1200", "100000"], "argument n_captions: 100000 is more than the 840 relation captions"),
    ("plan_canvas_pilot", [], "the following arguments are required: steps"),
    ("plan_canvas_pilot", ["1200", "48", "canvas,round"], "argument arms: 'canvas,round': give canvas, tied or "
                                                           "canvas,tied"),
    ("guidance_sweep", [], "the following arguments are required: run"),
    ("guidance_sweep", ["runs/x", "--step", "last"], "argument --step: invalid int value: 'last'"),
])
def test_a_bad_argument_is_argparses_two_lines(name, argv, message, monkeypatch, capsys):
    module = script(name, monkeypatch)
    assert message in refused(lambda: module.main(argv), capsys)


@pytest.mark.parametrize("name, argv", [("plan_following_pilot", ["600", "3e-4", "1"]),
                                        ("plan_position_pilot", ["1200"]), ("plan_canvas_pilot", ["1200"])])
def test_the_pilots_name_the_plan_world_they_miss(name, argv, monkeypatch, capsys, tmp_path):
    module = script(name, monkeypatch)
    monkeypatch.chdir(tmp_path)  # not the repository root: no worlds/shapes_plan here
    line = refused(lambda: module.parse_args(argv), capsys)
    assert "world directory not found: worlds/shapes_plan" in line and "run them from there" in line


def sweep_error(module, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert isinstance(exit_.value.code, str) and "\n" not in exit_.value.code
    return exit_.value.code


def test_the_sweep_refuses_a_missing_run_in_one_line(monkeypatch, tmp_path):
    module = script("guidance_sweep", monkeypatch)
    assert sweep_error(module, [str(tmp_path / "no_run")]).startswith("guidance_sweep: ")


def test_the_sweep_refuses_settings_the_config_refuses_before_drawing(micro_run, monkeypatch, capsys):
    """cfg=nan / inf made every logit NaN: every token code 255 and the judge's rates printed as a result; T=0 or
    below was a ValueError from the sampler, which draws and has no greedy mode."""
    module = script("guidance_sweep", monkeypatch)
    drawn = []
    monkeypatch.setattr(module, "draw", lambda *a, **k: drawn.append(1))
    for setting, message in [("cfg=nan", "sample.cfg_scale must be a finite number >= 0 (1 turns guidance off), "
                                         "got nan"),
                             ("cfg=2;cfg=inf", "sample.cfg_scale must be a finite number >= 0"),
                             ("cfg=-1", "sample.cfg_scale must be a finite number >= 0"),
                             ("T=0", "sample.temperature must be a finite number > 0, got 0.0"),
                             ("cfg=2,T=-1", "sample.temperature must be a finite number > 0, got -1.0")]:
        line = sweep_error(module, [str(micro_run), "test", setting])
        assert line.startswith(f"guidance_sweep: setting {setting.split(';')[-1]!r}: {message}"), line
    assert drawn == [] and capsys.readouterr().out == ""


def test_the_sampler_itself_refuses_what_the_config_refuses():
    from grpo_vision.sampling import SamplingParams

    for bad in ({"cfg_scale": math.nan}, {"cfg_scale": math.inf}, {"cfg_scale": -1.0},
                {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": 0.0}):
        with pytest.raises(ValueError, match="must be a finite number"):
            SamplingParams(**bad)


def test_the_sweep_refuses_a_run_whose_policy_brings_no_judge(micro_run, monkeypatch):
    """A Janus run: the rates are a judge's verdicts, and only ShapesWorld policies bring one."""
    from grpo_vision.config import load_config

    module = script("guidance_sweep", monkeypatch)
    cfg = load_config(str(micro_run / "config.yaml"), ["policy.kind=janus"])
    run = SimpleNamespace(cfg=cfg, bundle=SimpleNamespace(judge=None))
    monkeypatch.setattr(module, "load_run", lambda run_dir, step: run)
    monkeypatch.setattr(module, "run_prompt_sets", lambda cfg, run_dir: SimpleNamespace(scored=lambda: {"test": []}))
    line = sweep_error(module, ["runs/janus_run"])
    assert line == ("guidance_sweep: runs/janus_run trained a janus policy, which brings no judge: the sweep reports "
                    "the judge's rates, so give a run on a ShapesWorld policy (policy.kind shapes)")
