"""GRPOTrainer: the run from a script with objects in memory, TRL's option names, and a run folder whose reward
existed only in the script, named (not "unknown") by the commands that read the folder later."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from grpo_vision import GRPOTrainer
from grpo_vision.config import ConfigError
from grpo_vision.config.trl_names import accumulation, trl_overrides
from grpo_vision.prompts import PromptEntry
from grpo_vision.rewards import REGISTRY, check_rewards, reward_origin
from grpo_vision.splits import prompt_lists
from tests.helpers import MICRO, ROOT, cli_cmd


def brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))


@pytest.fixture
def clean_registry():
    """The reward a test registers is gone afterwards (the registry is the process's; plugins stay loaded)."""
    yield
    REGISTRY.pop("brightness", None)


def test_trl_names_map_to_this_configs_fields():
    overrides, lines = trl_overrides({"learning_rate": 3e-6, "num_generations": 16, "epsilon": 0.2, "bf16": True,
                                      "scale_rewards": False, "output_dir": "runs/x", "gradient_checkpointing": True})
    assert overrides == ["train.lr=3e-06", "sample.group_size=16", "train.epsilon_low=0.2",
                         "train.mixed_precision=bf16", "train.adv_scale=none", "run.out_dir=runs", "run.name=x", "train.gradient_checkpointing=true"]
    assert lines[0] == "learning_rate=3e-06 -> train.lr=3e-06"
    # 8 prompts x 8 images = 64 per process; micro-batches of 4, 4 of them per update: 64 / 16 = 4 updates a pass
    assert accumulation(4, 4, 64)[0] == "train.minibatches_per_pass=4"
    with pytest.raises(ConfigError, match="12 sequences per update does not divide the 64 images"):
        accumulation(3, 4, 64)
    with pytest.raises(ConfigError, match="max_completion_length .* has no counterpart here: an image is always"):
        trl_overrides({"max_completion_length": 256})
    with pytest.raises(ConfigError, match="unknown option 'lr': neither a TRL GRPOConfig name"):
        trl_overrides({"lr": 1e-5})


def test_the_trainer_builds_the_same_typed_config(clean_registry, tmp_path, capsys):
    trainer = GRPOTrainer(MICRO, rewards=[brightness, "jpeg_compressibility"], reward_weights=[2.0, 0.5],
                          train_prompts=["a red circle", {"prompt": "a blue square", "metadata": {"k": 1}}],
                          overrides=["sample.prompts_per_step=2"], num_generations=4, per_device_train_batch_size=2,
                          gradient_accumulation_steps=2, output_dir=str(tmp_path / "run"))
    cfg = trainer.cfg
    assert cfg.reward.weights == {"brightness": 2.0, "jpeg_compressibility": 0.5}
    assert (cfg.sample.group_size, cfg.train.micro_batch_size) == (4, 2)
    assert cfg.train.minibatches_per_pass == 2  # 2 x 4 = 8 images / (2 per micro-batch x 2)
    assert (cfg.run.out_dir, cfg.run.name) == (str(tmp_path), "run")
    assert "gradient_accumulation_steps=2 -> train.minibatches_per_pass=2" in capsys.readouterr().out
    assert [e.prompt for e in trainer.prompts["train"]] == ["a red circle", "a blue square"]
    assert trainer.prompts["train"][1].metadata == {"k": 1}
    assert REGISTRY["brightness"].factory(None) is brightness
    with pytest.raises(ConfigError, match="name each function"):
        GRPOTrainer(MICRO, rewards=[lambda images, prompts, metadata: images.mean(dim=(1, 2, 3))])
    with pytest.raises(ConfigError, match="'nope' is not a registered reward"):
        GRPOTrainer(MICRO, rewards={"nope": "nope"})
    with pytest.raises(ConfigError, match="call train\\(\\) first"):
        trainer.export(tmp_path / "out")


def test_prompts_in_memory_replace_the_files():
    from grpo_vision.config import load_config

    cfg = load_config(MICRO, ["data.test_prompts=1", "data.eval_size=2"])
    train = [PromptEntry(p, line=i + 1) for i, p in enumerate(["a red circle", "a blue circle", "a red square"])]
    sets = prompt_lists(cfg, {"train": train, "eval": None})
    assert len(sets.test) == 1 and len(sets.train) == 2 and not sets.heldout  # one held back, as from a file
    assert {e.prompt for e in sets.test} | {e.prompt for e in sets.train} == {e.prompt for e in train}
    given_eval = [PromptEntry("a blue square", line=1)]
    assert prompt_lists(cfg, {"train": train, "eval": given_eval}).test == given_eval
    cfg.data.train_prompts = "prompts.txt"
    with pytest.raises(ConfigError, match="prompts given in memory and in data.train_prompts"):
        prompt_lists(cfg, {"train": train})


def import_root(module: str):
    """The sys.path folder this test module was imported from: tests/.. or tests/, as pytest imported it."""
    return Path(__file__).resolve().parents[module.count(".")]


def test_a_missing_script_reward_is_named_with_its_fix(clean_registry, tmp_path):
    from grpo_vision.config import load_config
    from grpo_vision.rewards import register_callable

    register_callable("brightness", brightness)
    here = brightness.__module__  # test_trainer or tests.test_trainer, as pytest imported this file
    assert reward_origin("brightness") == {"module": here, "function": "brightness",
                                           "spec": f"python:{here}:brightness", "path": str(import_root(here))}
    cfg = load_config(MICRO, ["reward.weights={brightness: 1.0}"])
    check_rewards(cfg, tmp_path)  # registered: nothing to say
    (tmp_path / "rewards.json").write_text(json.dumps({"brightness": {"module": "__main__", "function": "brightness",
                                                                      "script": "train_bright.py"}}))
    del REGISTRY["brightness"]
    with pytest.raises(ConfigError) as e:
        check_rewards(cfg, tmp_path)
    assert str(e.value) == (f"run folder {tmp_path} names reward 'brightness' (made by brightness in __main__, script "
                            "train_bright.py), which is not registered here: give it with --reward "
                            "brightness=python:MODULE:FUNCTION (a function (images, prompts, metadata) -> scores), or "
                            "register it in a plugin (README, \"Bring your own policy, tokenizer and reward\")")
    check_rewards(cfg, tmp_path, given=[f"brightness=python:{here}:brightness"])  # supplied: it loads
    assert REGISTRY["brightness"].factory(None) is brightness
    with pytest.raises(ConfigError, match="must look like NAME=python:package.module:function"):
        check_rewards(cfg, tmp_path, given=["brightness"])
    with pytest.raises(ConfigError, match="'clip' is a registered reward already"):
        check_rewards(cfg, tmp_path, given=[f"clip=python:{here}:brightness"])


SCRIPT = '''\
import sys
import datasets
from grpo_vision import GRPOTrainer

def bright(images, prompts, metadata):  # a reward that exists only in this script
    return images.mean(dim=(1, 2, 3))

world, out = sys.argv[1], sys.argv[2]
prompts = datasets.Dataset.from_dict({"prompt": ["a red circle", "a blue square", "a red square", "a blue circle"]})
trainer = GRPOTrainer("configs/shapes_micro.yaml", policy=world, rewards={"bright": bright}, train_prompts=prompts,
                      eval_prompts=["a red circle left of a blue square"], max_steps=2, num_generations=4,
                      output_dir=out + "/run",
                      overrides=["sample.prompts_per_step=2", "log.sample_every=0", "log.report=false"])
trainer.train()
trainer.export(out + "/exported")
'''


@pytest.mark.e2e
def test_a_fifteen_line_script_trains_exports_and_its_folder_opens_in_eval(micro_world, tmp_path):
    """The README's script: an in-memory reward and a datasets.Dataset, two steps, export; then `eval` on the run
    folder names the missing reward, and runs with it supplied by --reward."""
    (tmp_path / "train_bright.py").write_text(SCRIPT)
    assert len(SCRIPT.strip().splitlines()) <= 17
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    done = subprocess.run([sys.executable, str(tmp_path / "train_bright.py"), str(micro_world), str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "num_generations=4 -> sample.group_size=4" in done.stdout
    run = tmp_path / "run"
    assert json.loads((run / "rewards.json").read_text())["bright"] == {
        "module": "__main__", "function": "bright", "script": "train_bright.py", "code": "code/train_bright.py"}
    assert (run / "code" / "train_bright.py").read_text() == SCRIPT  # the script as it trained
    assert [e["prompt"] for e in map(json.loads, (run / "prompts" / "train.jsonl").read_text().splitlines())]
    assert (tmp_path / "exported" / "model.safetensors").is_file()

    args = [*cli_cmd("eval", run, "--n", "1", "--device", "cpu")]
    missing = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr[-2000:]
    assert "names reward 'bright' (made by bright in __main__, script train_bright.py)" in missing.stderr
    assert "or pass --trust-run to import it as the run recorded it" in missing.stderr
    (tmp_path / "train_bright.py").unlink()  # gone or edited since: the run's copy is what --trust-run reads
    trusted = subprocess.run([*args, "--trust-run"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    assert json.loads(trusted.stdout)["sets"]["test"]["models"]["policy"]["rewards"]["bright"]["mean"] > 0
    (tmp_path / "bright_reward.py").write_text(textwrap.dedent('''
        def bright(images, prompts, metadata):
            return images.mean(dim=(1, 2, 3))
    '''))
    done = subprocess.run([*args, "--reward", "bright=python:bright_reward:bright"], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    bright = result["sets"]["test"]["models"]["policy"]["rewards"]["bright"]["mean"]
    assert result["step"] == 2 and 0 < bright < 1  # a mean brightness


def test_resume_and_demo_name_a_reward_only_the_script_had(micro_run, tmp_path, capsys):
    """The same one line from `train --resume` and the demo, before any model loads; --reward supplies it."""
    import shutil

    from grpo_vision.cli import main
    from grpo_vision.config import load_config, save_config
    from grpo_vision.tools.demo import DemoRun

    run = tmp_path / "run"
    shutil.copytree(micro_run, run)
    cfg = load_config(run / "config.yaml", ["reward.monitor=[shapes_exact, bright]"])
    save_config(cfg, run / "config.yaml")
    (run / "rewards.json").write_text(json.dumps({"bright": {"module": "__main__", "function": "bright",
                                                             "script": "train_bright.py"}}))
    with pytest.raises(SystemExit) as e:
        main(["train", "--resume", str(run)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "names reward 'bright' (made by bright in __main__, script train_bright.py)" in err
    with pytest.raises(ConfigError, match="--reward bright=python:MODULE:FUNCTION"):
        DemoRun(run, "cpu")
    try:  # supplied, the demo loads the run and scores with it
        demo = DemoRun(run, "cpu", rewards=[f"bright=python:{brightness.__module__}:brightness"])
        assert "bright" in demo.rewards.fns
    finally:
        REGISTRY.pop("bright", None)


def test_evaluate_scores_the_images_eval_and_the_report_score(micro_run):
    """GRPOTrainer.evaluate drew on seed 0 where `grpo-vision eval` and the report draw on the eval seed: the same
    run gave two sets of numbers for one question."""
    from grpo_vision.evaluation.evaluate import evaluate_run

    trainer = GRPOTrainer(str(micro_run / "config.yaml"))
    trainer.run_dir = micro_run
    ours, cli = trainer.evaluate(device="cpu"), evaluate_run(micro_run, n=1, device="cpu")
    assert ours["sets"] == cli["sets"]
    # n: the run's log.eval_images (tests/helpers.py: 1), the report's, where it was 4
    assert ours["sets"]["test"]["images_per_prompt"] == trainer.cfg.log.eval_images == 1
    assert trainer.evaluate(n=1, device="cpu", seed=0)["sets"] != cli["sets"]  # seed 0, the old default: other images


def test_a_function_named_as_a_built_in_reward_is_refused_not_swapped_in(clean_registry):
    """GRPOTrainer(rewards={"clip": fn}) replaced the built-in clip for the whole process, silently: every later
    run of the process scored "clip" with fn."""
    built_in = REGISTRY["clip"]
    with pytest.raises(ConfigError) as err:
        GRPOTrainer(MICRO, rewards={"clip": brightness})
    message = str(err.value)
    assert message.startswith("reward 'clip' is a registered reward already (from grpo_vision.rewards")
    assert "{'my_clip': function}" in message and "\n" not in message
    assert REGISTRY["clip"] is built_in
    GRPOTrainer(MICRO, rewards={"brightness": brightness})  # a script's own name: registered, and again when re-run
    GRPOTrainer(MICRO, rewards={"brightness": brightness})


def nowhere(images, prompts, metadata):
    return torch.full((len(prompts),), float("nan"))


def test_train_from_a_script_ends_with_the_clis_done_line_and_warnings(micro_world, tmp_path, capsys):
    """A reward NaN everywhere was said by `grpo-vision train` and not by GRPOTrainer.train(), which printed no
    "done" line either."""
    REGISTRY.pop("nowhere", None)
    trainer = GRPOTrainer(MICRO, rewards={"nowhere": nowhere},
                          overrides=[f"policy.path={micro_world}", f"run.out_dir={tmp_path}", "train.steps=1",
                                     "log.report=false", "log.sample_every=0", "reward.monitor=[]"])
    try:
        run = trainer.train()
    finally:
        REGISTRY.pop("nowhere", None)
    out = capsys.readouterr()
    assert f"[train] done: {run} (0 of 2 updates skipped)" in out.out
    assert "1 of 1 steps had no trained reward for any image (NaN, or weight 0): nothing to learn from" in out.err


def test_prompts_in_memory_take_the_place_of_a_shipped_configs_files(capsys):
    """With configs/janus_pro_1b.yaml (data.train_prompts and data.eval_prompts set) prompts in memory were a
    traceback from the prompt split."""
    trainer = GRPOTrainer("configs/janus_pro_1b.yaml", train_prompts=["a red cat", "a blue dog", "a green bird"],
                          eval_prompts=["a cat"])
    assert (trainer.cfg.data.train_prompts, trainer.cfg.data.eval_prompts) == ("", "")
    out = capsys.readouterr().out
    assert "[trainer] the 3 train prompts given replace data.train_prompts (data/t2i_train.txt)" in out
    assert "[trainer] the 1 eval prompts given replace data.eval_prompts (data/t2i_eval.txt)" in out


def test_the_librarys_warnings_print_in_one_line_from_a_script(tmp_path):
    """Python's default form is `file:line: UserWarning: ...` and then the library's source line: from a script
    (a fresh interpreter: the command line, which some tests run in this process, formats every warning itself),
    the library's warnings print as the command line prints them, one line; anyone else's as Python prints them."""
    script = textwrap.dedent(f"""
        import warnings
        from grpo_vision.config import GrpoVisionWarning, load_config
        load_config({str(MICRO)!r}, ["train.adapter=lora", "train.reference=frozen"])
        warnings.warn("theirs", UserWarning)
    """)
    (tmp_path / "script.py").write_text(script)
    out = subprocess.run([sys.executable, tmp_path / "script.py"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = out.stderr.splitlines()
    assert out.returncode == 0 and lines[0] == (
        "grpo-vision: warning: train.adapter with train.reference: frozen keeps a second full copy of the policy as "
        "the reference; train.reference: adapter is the same reference (the adapter disabled) without it"), lines
    assert lines[1].endswith(": UserWarning: theirs") and lines[2].strip() == 'warnings.warn("theirs", UserWarning)'
    assert len(lines) == 3


def test_every_warning_the_library_says_is_of_its_category():
    """Each `warnings.warn` call of the package names GrpoVisionWarning (or a function giving it), so none prints
    in Python's two-line form."""
    import ast

    bare = []
    for path in (ROOT / "grpo_vision").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warn"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "warnings"):
                category = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "category"), None)
                if not (category is not None and "GrpoVisionWarning" in ast.unparse(category)
                        or ast.unparse(category or ast.Constant(None)) == "_category()"):
                    bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bare == []
