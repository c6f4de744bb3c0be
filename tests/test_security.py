"""Loading a file runs no code from it unless told to (no pickle): checkpoints, RNG states and CLIP
weights from strangers.

Each attack file carries a payload that unpickling (or TorchScript's __setstate__) would run and that
creates a marker file, so the marker's existence proves it ran. A control loads a twin of each file the
unsafe way and sees its marker appear, so these tests would fail if the files were harmless. Writing in a
run folder never goes through a link planted there: a shared folder cannot make a run overwrite
a file outside it.
"""

import ast
import json
import pickle
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import warnings

import numpy as np
import pytest
import torch

from grpo_vision.run.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from grpo_vision.rewards.clip import ClipLoadError, load_clip
from grpo_vision.run.safe_state import load_state, save_state
from grpo_vision.shapes.plugin import CLIP_CONFIG
from tests.helpers import ROOT, micro_args, micro_cfg, run_cli


class Payload:
    """Unpickled, this calls open(marker, "w"): the marker file appears."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def armed(make, tmp_path) -> bool:
    """Whether a file that `make(path, marker)` writes runs its payload under torch.load(weights_only=False)."""
    path, marker = tmp_path / "control" / "file.pt", tmp_path / "control" / "RAN"
    path.parent.mkdir()
    make(path, marker)
    subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(path)!r}, weights_only=False)"],
                   capture_output=True, timeout=300)
    return marker.exists()


def crafted_optimizer(path, marker):
    torch.save({"optimizer": Payload(marker), "scheduler": {}}, path)


def crafted_rng(path, marker):
    torch.save({"torch": torch.get_rng_state(), "numpy": Payload(marker), "python": random.getstate()}, path)


def crafted_clip(path, marker, decoy=True):
    """A plain pickle dressed as a TorchScript archive: one decoy entry named like its constants file."""
    torch.save({"state_dict": Payload(marker)}, path)
    if decoy:
        with zipfile.ZipFile(path, "a") as z:
            z.writestr(f"{path.stem}/extra/constants.pkl", b"")  # the old check matched */constants.pkl


class ScriptedPayload(torch.nn.Module):
    """A TorchScript module whose scripted __setstate__, run by torch.jit.load, creates its marker file
    (torch.from_file with shared=True creates the file it maps): TorchScript ops only, no pickle."""

    def __init__(self, marker: str):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))
        self.marker = marker

    def forward(self, x):
        return x + self.w

    @torch.jit.export
    def __getstate__(self) -> tuple[str, torch.Tensor, bool]:
        return self.marker, self.w, self.training

    @torch.jit.export
    def __setstate__(self, state: tuple[str, torch.Tensor, bool]) -> None:
        self.marker, self.w, self.training = state[0], state[1], state[2]
        self.w = self.w + torch.from_file(self.marker, shared=True, size=2)  # used, so not optimised away


def scripted_clip(path, marker):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated
        torch.jit.save(torch.jit.script(ScriptedPayload(str(marker))), str(path))


def tiny():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 0.5 ** u)
    for _ in range(2):
        model(torch.randn(4, 3)).square().sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def test_state_files_round_trip_optimizer_scheduler_and_rng_exactly(tmp_path):
    _, opt, sched = tiny()
    tree = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "numpy": np.random.get_state(),
            "python": random.getstate(), "odd": {3: (1.5, float("inf"), None), "nan": float("nan")}}
    save_state(tree, tmp_path / "s.safetensors")
    back = load_state(tmp_path / "s.safetensors")
    state, again = tree["optimizer"]["state"], back["optimizer"]["state"]
    assert list(again) == [0, 1]  # int keys stay ints: load_state_dict matches them to parameters
    for i in state:
        assert set(again[i]) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(state[i][k], again[i][k]) for k in state[i])
    assert back["optimizer"]["param_groups"] == tree["optimizer"]["param_groups"]
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.9)  # a tuple again, not a list
    assert back["scheduler"] == tree["scheduler"]
    assert back["numpy"][0] == "MT19937" and back["numpy"][1].dtype == np.uint32
    assert np.array_equal(back["numpy"][1], tree["numpy"][1]) and back["numpy"][2:] == tree["numpy"][2:]
    assert back["python"] == tree["python"]
    assert back["odd"][3] == (1.5, float("inf"), None) and np.isnan(back["odd"]["nan"])
    np.random.set_state(back["numpy"])  # the states are accepted as they come back
    random.setstate(back["python"])


def test_a_state_file_holds_data_only(tmp_path):
    # JSON that looks like pickle's vocabulary is just a dict of strings
    save_state({"__reduce__": ["os", "system"], "cls": "builtins.open"}, tmp_path / "s.safetensors")
    assert load_state(tmp_path / "s.safetensors") == {"__reduce__": ["os", "system"], "cls": "builtins.open"}
    with pytest.raises(TypeError, match=r"state\.bad: cannot store a Payload"):
        save_state({"bad": Payload(tmp_path / "m")}, tmp_path / "t.safetensors")
    with pytest.raises(ValueError, match="not a grpo_vision.state/1 file"):
        from safetensors.torch import save_file
        save_file({"a": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
        load_state(tmp_path / "plain.safetensors")


@pytest.mark.parametrize("name, make", [("optimizer.pt", crafted_optimizer), ("rng.pt", crafted_rng)])
def test_a_crafted_pickle_in_place_of_a_state_file_is_never_read(tmp_path, name, make):
    assert armed(make, tmp_path)
    model, opt, sched = tiny()
    path = save_checkpoint(tmp_path / "run", 1, model, opt, sched, None, {"counters": {}})
    state_file = path / name.replace(".pt", ".safetensors")
    state_file.unlink()
    make(path / name, tmp_path / "RAN")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, model, opt, sched)
    assert str(err.value) == (f"checkpoint file missing: {state_file}; the step directory is incomplete: delete "
                              f"{path} and use an earlier step")
    assert not (tmp_path / "RAN").exists()


def test_a_pickle_beside_a_checkpoint_is_never_read(tmp_path):
    model, opt, sched = tiny()
    path = save_checkpoint(tmp_path, 1, model, opt, sched, None, {"counters": {"n": 4}})
    crafted_optimizer(path / "optimizer.pt", tmp_path / "RAN")
    crafted_rng(path / "rng.pt", tmp_path / "RAN")
    state, _ = load_checkpoint(path, model, opt, sched)
    assert state["counters"] == {"n": 4} and not (tmp_path / "RAN").exists()


@pytest.mark.parametrize("decoy", [True, False], ids=["dressed-as-torchscript", "plain-pickle"])
def test_a_crafted_clip_checkpoint_is_refused(tmp_path, decoy):
    assert armed(lambda p, m: crafted_clip(p, m, decoy), tmp_path)
    path = tmp_path / "ViT-L-14.pt"
    crafted_clip(path, tmp_path / "RAN", decoy)
    with pytest.raises(ClipLoadError, match="ViT-L-14.pt (is a TorchScript archive|holds pickled)"):
        load_clip(str(CLIP_CONFIG), path)
    with pytest.raises(ClipLoadError, match="ViT-L-14.pt (looks like a TorchScript archive|holds pickled)"):
        load_clip(str(CLIP_CONFIG), path, trust_torchscript=True)  # torch.jit.load refuses it; nothing unpickles it
    assert not (tmp_path / "RAN").exists()


def test_a_torchscript_clip_archive_runs_nothing_without_trust(tmp_path):
    path, marker = tmp_path / "ViT-L-14.pt", tmp_path / "RAN"
    scripted_clip(path, marker)
    assert not marker.exists()
    with pytest.raises(ClipLoadError) as err:
        load_clip(str(CLIP_CONFIG), path)
    assert str(err.value) == (
        f"{path} is a TorchScript archive, and loading one runs the TorchScript code inside it, so it is refused: "
        f"convert it once where you trust it (grpo-vision convert-clip {path} OUT.safetensors) and use "
        "OUT.safetensors, or load it as it is with trust_torchscript: true in the reward's options (docs/security.md)")
    assert not marker.exists()
    with pytest.raises(ClipLoadError, match="weights do not fit"):  # the control: trusted, its code runs
        load_clip(str(CLIP_CONFIG), path, trust_torchscript=True)
    assert marker.exists()


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_raw_pickle_is_refused_as_pickled_objects_never_as_damaged(tmp_path, protocol):
    """pickle.dump's protocols 4 and 5 use opcodes torch's safe unpickler does not read: torch's error then
    names no object and advises weights_only=False; the message names the object and no such advice."""
    from grpo_vision.rewards.aesthetic import load_aesthetic
    from grpo_vision.run.safe_state import UnsafeFileError, load_pickled_tensors

    path = tmp_path / "weights.pt"
    with open(path, "wb") as f:
        pickle.dump({"state_dict": Payload(tmp_path / "RAN")}, f, protocol=protocol)
    refused = f"{path} holds pickled Python objects besides tensors and numbers (it names io.open); unpickling " \
              "it could run code from the file, so it is refused for safety"
    with warnings.catch_warnings(record=True) as noted:  # torch's "Detected pickle protocol 4" note stays out
        warnings.simplefilter("always")
        with pytest.raises(UnsafeFileError) as err:
            load_pickled_tensors(path)
        assert str(err.value) == refused
        with pytest.raises(ClipLoadError) as err:
            load_clip(str(CLIP_CONFIG), path)
    assert not [w for w in noted if "pickle protocol" in str(w.message)]
    assert str(err.value) == refused + ". Use a safetensors copy of the weights; to make one from a file you " \
                                       "trust, see docs/security.md"
    with pytest.raises(ValueError) as err:
        load_aesthetic(path)
    assert str(err.value).startswith(refused + ". Use a safetensors copy of the head") and \
        "docs/security.md" in str(err.value)
    assert not (tmp_path / "RAN").exists()


def test_bytes_that_are_no_pickle_are_damaged_without_torchs_advice(tmp_path):
    from grpo_vision.run.safe_state import load_pickled_tensors

    path = tmp_path / "weights.pt"
    path.write_bytes(bytes([27]) + bytes(range(256)))
    with pytest.raises(ValueError, match=r"^damaged or not a pickle: Unsupported operand 27$"):
        load_pickled_tensors(path)
    with pytest.raises(ClipLoadError) as err:
        load_clip(str(CLIP_CONFIG), path)
    assert str(err.value) == (f"cannot read the CLIP checkpoint {path}: the file is damaged, cut short or not a "
                              "checkpoint (Unsupported operand 27); copy or download it again")


# ---------------------------------------------------------------- no load path unpickles


def unsafe_loads(source: str) -> list[str]:
    """Calls that could unpickle arbitrary objects: torch.load without weights_only=True, any
    weights_only that is not the literal True, pickle-family loads, np.load(allow_pickle=True)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        literal_true = lambda key: isinstance(kw.get(key), ast.Constant) and kw[key].value is True  # noqa: E731
        if "weights_only" in kw and not literal_true("weights_only"):
            found.append(f"line {node.lineno}: {name}(weights_only={ast.unparse(kw['weights_only'])})")
        elif name == "torch.load" and not literal_true("weights_only"):
            found.append(f"line {node.lineno}: torch.load without weights_only=True")
        if name.split(".")[0] in ("pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve") and \
                name.split(".")[-1] in ("load", "loads", "Unpickler", "open"):
            found.append(f"line {node.lineno}: {name}")
        if literal_true("allow_pickle") or literal_true("trust_remote_code"):
            found.append(f"line {node.lineno}: {name} with allow_pickle/trust_remote_code")
    return found


def test_the_checker_finds_unsafe_loads():
    bad = ("torch.load(f, weights_only=False)\ntorch.load(f)\npickle.load(f)\nnp.load(f, allow_pickle=True)\n"
           "open_clip.create_model(n, pretrained=p, weights_only=ws)\nm.from_pretrained(p, trust_remote_code=True)\n")
    assert len(unsafe_loads(bad)) == 6
    assert unsafe_loads("torch.load(f, map_location='cpu', weights_only=True)\ntorch.jit.load(f)\n") == []


def test_no_load_path_in_the_package_unpickles():
    files = sorted((ROOT / "grpo_vision").rglob("*.py")) + sorted((ROOT / "demo").rglob("*.py"))
    assert len(files) > 20
    problems = {str(f.relative_to(ROOT)): unsafe_loads(f.read_text()) for f in files}
    assert {f: p for f, p in problems.items() if p} == {}


# ---------------------------------------------------------------- the real CLI


@pytest.mark.e2e
def test_attack_files_through_the_cli_leave_no_marker(micro_world, tmp_path):
    from grpo_vision.train import train

    run = train(micro_cfg(micro_world, tmp_path, "run.name=base", "train.steps=1"), progress=False)
    cli = run_cli

    for name, make in (("optimizer.pt", crafted_optimizer), ("rng.pt", crafted_rng)):
        shared = tmp_path / f"shared_{name}"
        shutil.copytree(run, shared)
        step = shared / "checkpoints" / "step_000001"
        state_file = step / name.replace(".pt", ".safetensors")
        state_file.unlink()  # a crafted pickle in its place: never read
        make(step / name, tmp_path / f"RAN_{name}")
        out = cli("train", "--resume", str(shared))
        assert out.returncode != 0 and f"checkpoint file missing: {state_file}" in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr and not (tmp_path / f"RAN_{name}").exists()
    crafted_clip(tmp_path / "clip.pt", tmp_path / "RAN_clip")
    out = cli("train", *micro_args(micro_world, tmp_path, "run.name=clip",
                                   f"reward.options.clip.checkpoint={tmp_path / 'clip.pt'}"))
    assert out.returncode != 0 and "clip.pt is a TorchScript archive" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not (tmp_path / "RAN_clip").exists()


# ---------------------------------------------------------------- code a run folder names


# conftest.py's micro_run stands for a run folder someone else made; each test changes a copy of it


def planted(tmp_path, monkeypatch, name: str) -> Path:
    """An importable module `name` whose import writes a marker (returned); its score() is a reward."""
    marker = tmp_path / f"RAN_{name}"
    (tmp_path / f"{name}.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                         "def score(images, prompts, metadata):\n"
                                         "    return images.new_zeros(len(prompts)) + 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return marker


def test_a_run_folder_runs_no_code_it_names_without_trust_run(micro_run, tmp_path, monkeypatch, capsys):
    from grpo_vision.cli import main

    marker = planted(tmp_path, monkeypatch, "planted_in_config")
    run = tmp_path / "shared"
    shutil.copytree(micro_run, run)
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("  weights:\n", "  weights:\n    python:planted_in_config:score: 1.0\n"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    # before: eval imported the module, whoever wrote the run folder
    for args in (["eval", run, "--prompts", prompts, "--n", "1"], ["train", "--resume", run], ["demo", run],
                 ["bench", "demo", run]):
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
        assert exit_info.value.code == 2 and capsys.readouterr().err == (
            f"grpo-vision: error: run folder {run} names reward 'python:planted_in_config:score', which imports and "
            "runs Python module 'planted_in_config'; pass --trust-run if you trust whoever made that folder\n")
        assert not marker.exists(), args[0]
    # a run folder may also tell a reward to trust a TorchScript archive, whose code runs as it loads
    torchscript = run / "torchscript"
    shutil.copytree(micro_run, torchscript)
    scripted_clip(torchscript / "clip.pt", tmp_path / "RAN_torchscript")
    config = torchscript / "config.yaml"
    config.write_text(config.read_text().replace("  options: {}\n", "  options:\n    clip:\n      checkpoint: "
                                                 f"{torchscript / 'clip.pt'}\n      trust_torchscript: true\n"))
    for args in (["eval", torchscript, "--prompts", prompts, "--n", "1"], ["train", "--resume", torchscript]):
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
        assert exit_info.value.code == 2 and capsys.readouterr().err == (
            f"grpo-vision: error: run folder {torchscript} names reward.options.clip.trust_torchscript: true, which "
            "loads a TorchScript archive and runs the code inside it; pass --trust-run if you trust whoever made "
            "that folder\n")
        assert not (tmp_path / "RAN_torchscript").exists()
    main(["eval", str(run), "--prompts", str(prompts), "--n", "1", "--trust-run"])  # the user says so: it runs
    assert marker.exists()
    assert json.loads(capsys.readouterr().out)["models"]["policy"]["rewards"]["python:planted_in_config:score"][
        "mean"] == 0.5


def test_a_reward_named_in_a_run_folders_prompts_is_refused_too(micro_run, tmp_path, monkeypatch, capsys):
    from grpo_vision.cli import main

    marker = planted(tmp_path, monkeypatch, "planted_in_prompts")
    run = tmp_path / "shared"
    shutil.copytree(micro_run, run)
    test_set = run / "prompts" / "test.jsonl"  # eval's default set: the run folder's own file
    test_set.write_text(json.dumps({"prompt": "a red circle", "rewards": {"python:planted_in_prompts:score": 1}}))
    with pytest.raises(SystemExit):
        main(["eval", str(run), "--n", "1"])
    assert "names reward 'python:planted_in_prompts:score'" in capsys.readouterr().err and not marker.exists()


def test_the_resume_command_a_run_prints_trusts_only_its_own_code():
    # a run stopped by a signal says how to continue; one that names a python: reward resumes only with
    # --trust-run, so the line it prints says so (whoever started the run chose that reward)
    from grpo_vision.config import load_config
    from grpo_vision.prompts import PromptEntry
    from grpo_vision.run.folder import resume_command

    plain = load_config(None, ["reward.weights={clip: 1.0}", "reward.monitor=[]"])
    assert resume_command("runs/x", plain) == "grpo-vision train --resume runs/x"
    coded = load_config(None, ["reward.weights={clip: 1.0}", "reward.monitor=[python:m:f]"])
    assert resume_command("runs/x", coded) == "grpo-vision train --resume runs/x --trust-run"
    in_prompts = [PromptEntry("a red circle", rewards={"python:m:f": 1.0})]
    assert resume_command("runs/x", plain, in_prompts) == "grpo-vision train --resume runs/x --trust-run"


# ---------------------------------------------------------------- a shared run folder: links never followed


def outside(tmp_path, name: str) -> Path:
    """A file outside the run folder, which a link planted inside the folder points to."""
    path = tmp_path / "outside" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("precious\n")
    return path


def test_the_run_lock_refuses_a_link_before_and_after_loading(tmp_path):
    from grpo_vision.files import FolderError
    from grpo_vision.run.lock import LOCK_NAME, RunLock, check_run_dir

    run, target = tmp_path / "run", outside(tmp_path, "lock.txt")
    run.mkdir()
    (run / LOCK_NAME).symlink_to(target)
    for take in (lambda: check_run_dir(run, fresh=False), lambda: RunLock(run, fresh=False)):
        with pytest.raises(FolderError, match=f"{run / LOCK_NAME} is a symbolic link \\(to {target}\\); .*remove "
                                              "the link"):
            take()
    assert target.read_text() == "precious\n"  # before: emptied, then holding the lock holder's pid


def test_files_written_whole_replace_a_link_and_leave_its_target_alone(tmp_path):
    from grpo_vision.config import Config, save_config
    from grpo_vision.run.metrics import MetricsLogger
    from grpo_vision.evaluation.plots import save_figure
    from grpo_vision.prompts import PromptEntry, save_prompts

    run = tmp_path / "run"
    model, opt, sched = tiny()
    save_checkpoint(run, 1, model, opt, sched, None, {"counters": {}})
    (run / "prompts").mkdir()
    names = ["config.yaml", "metrics.jsonl", "prompts/train.jsonl", "curves.png", "checkpoints/latest",
             "checkpoints/latest.tmp"]  # the last: the temporary name the pointer was once written through
    targets = {}
    for name in names:
        (run / name).unlink(missing_ok=True)
        targets[name] = outside(tmp_path, name.replace("/", "_"))
        (run / name).symlink_to(targets[name])
    save_config(Config(), run / "config.yaml")
    logger = MetricsLogger(run, 0)
    logger.log(1, {"lr": 0.1})
    logger.close()
    save_prompts([PromptEntry("a red circle")], run / "prompts" / "train.jsonl", root=run)
    import matplotlib.pyplot as plt

    save_figure(plt.figure(), run / "curves.png")
    save_checkpoint(run, 2, model, opt, sched, None, {"counters": {}})
    assert {n: t.read_text() for n, t in targets.items()} == {n: "precious\n" for n in names}
    assert [p.name for p in run.rglob("*") if p.is_symlink()] == ["latest.tmp"]  # never written since: left alone
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"
    assert json.loads((run / "metrics.jsonl").read_text()) == {"step": 1, "lr": 0.1}
    assert (run / "prompts" / "train.jsonl").read_text() == '{"prompt": "a red circle"}\n'


@pytest.mark.parametrize("sub", ["prompts", "checkpoints", "samples", "tensorboard"])
def test_a_sub_folder_that_is_a_link_is_refused_naming_it(tmp_path, sub):
    from grpo_vision.prompts import PromptEntry, save_prompts
    from grpo_vision.files import FolderError, write_file

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (run / sub).symlink_to(elsewhere, target_is_directory=True)
    model, opt, sched = tiny()
    write = {"prompts": lambda: save_prompts([PromptEntry("a red circle")], run / "prompts" / "train.jsonl", root=run),
             "checkpoints": lambda: save_checkpoint(run, 1, model, opt, sched, None, {"counters": {}}),
             "samples": lambda: write_file(run / "samples" / "step_000001.png", b"png", root=run),  # save_sample_grid's
             "tensorboard": lambda: start_trackers(run)}[sub]
    with pytest.raises(FolderError, match=f"{run / sub} is a symbolic link \\(to {elsewhere}\\)"):
        write()
    assert list(elsewhere.iterdir()) == []


def start_trackers(run):
    """The run's trackers as train starts them (TensorBoard: tensorboard/)."""
    from accelerate import Accelerator

    from grpo_vision.config import Config
    from grpo_vision.run.trackers import Trackers, accelerator_options

    return Trackers(Accelerator(cpu=True, **accelerator_options(Config(), run)), run, Config(), 0)


def test_resuming_a_run_with_planted_links_overwrites_nothing_outside_it(micro_world, tmp_path):
    """The finding: run.lock, metrics.jsonl and prompts/train.jsonl replaced by links, then --resume."""
    from grpo_vision.config import load_config
    from grpo_vision.run.metrics import load_metrics
    from grpo_vision.files import FolderError
    from grpo_vision.train import train

    run = train(micro_cfg(micro_world, tmp_path, "log.report=false", "train.steps=1"), progress=False)
    targets = {name: outside(tmp_path, name.replace("/", "_")) for name in ("run.lock", "metrics.jsonl",
                                                                             "prompts/train.jsonl")}
    for name, target in targets.items():
        (run / name).unlink()
        (run / name).symlink_to(target)
    resumed = load_config(run / "config.yaml", ["train.steps=2"])
    with pytest.raises(FolderError, match="run.lock is a symbolic link"):  # refused before anything loads
        train(resumed, resume=run, progress=False)
    (run / "run.lock").unlink()
    train(resumed, resume=run, progress=False)
    assert {n: t.read_text() for n, t in targets.items()} == {n: "precious\n" for n in targets}
    assert not any(p.is_symlink() for p in run.rglob("*"))
    assert [row["step"] for row in load_metrics(run)] == [2]  # the link's target held no step of this run
