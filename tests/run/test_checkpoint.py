"""Checkpoints: atomic rewrites, a dangling `latest`, unreadable files and files of another kind named."""

import re

import pytest
import torch

from grpo_vision.run.checkpoint import (CheckpointError, checkpoint_steps, find_checkpoint, latest_checkpoint,
                                    load_checkpoint, load_iterative_state, load_training_state, save_checkpoint)


def tiny():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0)


def test_latest_falls_back_to_the_highest_complete_step(tmp_path):
    model, opt, sched = tiny()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, opt, sched, None, {"counters": {}})
    root = tmp_path / "checkpoints"
    (root / "latest").write_text("step_000009")  # dangling
    assert latest_checkpoint(tmp_path) == root / "step_000002"
    (root / "latest").unlink()
    assert find_checkpoint(tmp_path) == root / "step_000002"


def test_a_pointer_or_link_into_another_run_is_refused_naming_it(tmp_path):
    model, opt, sched = tiny()
    mine, other = tmp_path / "mine", tmp_path / "other"
    save_checkpoint(mine, 1, model, opt, sched, None, {"counters": {}})
    save_checkpoint(other, 5, model, opt, sched, None, {"counters": {}})
    pointer = mine / "checkpoints" / "latest"
    for target in ("../../other/checkpoints/step_000005", str(other / "checkpoints" / "step_000005")):
        pointer.write_text(target)  # eval scored the other run's weights under this run's name
        for find in (latest_checkpoint, find_checkpoint):
            with pytest.raises(CheckpointError, match=re.escape(
                    f"{pointer} names '{target}', which resolves to {other / 'checkpoints' / 'step_000005'}, "
                    f"outside this run's checkpoints folder {mine / 'checkpoints'}")):
                find(mine)
    pointer.write_text("step_000001")
    assert find_checkpoint(mine) == mine / "checkpoints" / "step_000001"
    link = mine / "checkpoints" / "step_000007"  # a step folder that is a link, named by step or as the highest
    link.symlink_to(other / "checkpoints" / "step_000005")
    pointer.unlink()
    for find in (lambda run: find_checkpoint(run, 7), latest_checkpoint):
        with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {link} resolves to {other}") + ".*; delete "
                                                  "that pointer or link"):
            find(mine)
    link.unlink()
    weights = mine / "checkpoints" / "step_000001" / "policy.safetensors"  # one file of a step, linked
    weights.unlink()
    weights.symlink_to(other / "checkpoints" / "step_000005" / "policy.safetensors")
    with pytest.raises(CheckpointError, match=re.escape(f"{weights} is a link to {other}")):
        find_checkpoint(mine)
    third = tmp_path / "third"  # the whole checkpoints folder, linked: the run's own name, another run's weights
    third.mkdir()
    (third / "checkpoints").symlink_to(other / "checkpoints")
    with pytest.raises(CheckpointError, match=re.escape(f"{third / 'checkpoints'} is a link to {other / 'checkpoints'}")):
        find_checkpoint(third)


def test_rewriting_a_step_leaves_one_complete_copy(tmp_path):
    model, opt, sched = tiny()
    save_checkpoint(tmp_path, 2, model, opt, sched, None, {"counters": {"n": 1}})
    with torch.no_grad():
        model.weight.add_(1.0)
    save_checkpoint(tmp_path, 2, model, opt, sched, None, {"counters": {"n": 2}})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
    fresh, _, _ = tiny()
    state, _ = load_checkpoint(root / "step_000002", fresh)
    assert state["counters"] == {"n": 2} and torch.equal(fresh.weight, model.weight)
    assert checkpoint_steps(tmp_path) == [2]


@pytest.mark.parametrize("name", ["policy.safetensors", "trainer_state.json", "optimizer.safetensors",
                                  "rng.safetensors"])
def test_an_unreadable_file_is_named(tmp_path, name):
    model, opt, sched = tiny()
    path = save_checkpoint(tmp_path, 1, model, opt, sched, None, {"counters": {}})
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[:len(data) // 2])  # cut short
    # a weights file's recorded sha256 names it first; the other files are read as they are
    what = "has changed since it was written" if name == "policy.safetensors" else "is unreadable"
    with pytest.raises(CheckpointError, match=f"{name} {what} .*delete .*step_000001"):
        load_checkpoint(path, model, opt, sched)


class WithScale(torch.nn.Linear):
    def __init__(self, *args):
        super().__init__(*args)
        self.scale = torch.nn.Parameter(torch.ones(()))


@pytest.mark.parametrize("other, problem", [
    (lambda: torch.nn.Sequential(torch.nn.Linear(3, 2)), "weights this policy does not have"),
    (lambda: WithScale(3, 2), "no weights for \\['scale'\\]"),
    (lambda: torch.nn.Linear(4, 2), "weights of another shape for \\['weight'\\]"),
])
def test_a_checkpoint_of_another_policy_is_refused_naming_the_weights(tmp_path, other, problem):
    model, opt, sched = tiny()
    path = save_checkpoint(tmp_path, 1, model, opt, sched, None, {"counters": {}})
    with pytest.raises(CheckpointError, match=f"does not match this run's policy: {problem}"):
        load_checkpoint(path, other())


def _assert_disk_full_kept_step_1(tmp_path, error):
    assert f"no space left on the disk of {tmp_path}" in str(error) and "the last checkpoint, step_000001," in str(error)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]  # no half-written step
    assert (root / "latest").read_text() == "step_000001"


def test_a_full_disk_is_one_clear_error_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    import errno

    import grpo_vision.run.checkpoint as ckpt

    model, opt, sched = tiny()
    save_checkpoint(tmp_path, 1, model, opt, sched, None, {"counters": {}})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_state", full)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path, 2, model, opt, sched, None, {"counters": {}})
    _assert_disk_full_kept_step_1(tmp_path, e.value)


def test_a_full_disk_through_the_real_writers(tmp_path):
    """On a 1 MiB tmpfs (where the machine lets the test mount one): safetensors reports ENOSPC its own way."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root); the monkeypatched test covers the logic")
    try:
        model = torch.nn.Linear(250, 250)  # 250 KB of weights, 500 KB of Adam moments: one step fits, two do not
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0)
        model(torch.randn(2, 250)).sum().backward()
        opt.step()
        save_checkpoint(disk, 1, model, opt, sched, None, {"counters": {}})
        with pytest.raises(CheckpointError) as e:
            save_checkpoint(disk, 2, model, opt, sched, None, {"counters": {}})
        _assert_disk_full_kept_step_1(disk, e.value)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.parametrize("source, target, lacks", [
    ("rng.safetensors", "optimizer.safetensors", "holds 'torch', 'numpy', 'python', not 'optimizer', 'scheduler'"),
    ("optimizer.safetensors", "rng.safetensors", "holds 'optimizer', 'scheduler', not 'torch', 'numpy', 'python'"),
    ("rng.safetensors", "iterative.safetensors", "not 'buffer', 'rewards'"),
    ("rng.safetensors", "reference.safetensors", "has changed since it was written"),  # its sha256, recorded
    ("step_000001/trainer_state.json", "trainer_state.json", "says step 1 in step_000002 \\(copied from another step"),
])
def test_another_valid_file_copied_over_a_state_file_is_named(tmp_path, source, target, lacks):
    """Before: KeyError: 'optimizer' (and the like) from deep inside the resume."""
    model, opt, sched = tiny()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    for step in (1, 2):
        path = save_checkpoint(tmp_path, step, model, opt, sched, reference, {"counters": {}},
                               iterative={"buffer": {}, "rewards": {}})
    (path / target).write_bytes((path.parent / source if "/" in source else path / source).read_bytes())
    with pytest.raises(CheckpointError, match=f"{path / target}.* {lacks}.*(delete {path} and (resume from|use) an "
                                              "earlier step|another policy)"):
        load_checkpoint(path, model, opt, sched)
        load_iterative_state(path)


def test_an_optimizer_state_of_another_model_is_named(tmp_path):
    model, opt, sched = tiny()
    path = save_checkpoint(tmp_path, 1, model, opt, sched, None, {"counters": {}})
    other = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match="optimizer.safetensors does not fit this run \\(ValueError: .*delete "
                                              ".*step_000001 and resume from an earlier step"):
        load_training_state(path, other_opt, torch.optim.lr_scheduler.LambdaLR(other_opt, lambda u: 1.0))


# ---------------------------------------------------------------------------- resuming: what a resume refuses

def test_base_identity_reads_names_sizes_and_both_ends_of_each_model_file(tmp_path):
    from grpo_vision.config import PolicyConfig
    from grpo_vision.run.checkpoint import FINGERPRINT_BYTES, base_identity, other_base

    world = tmp_path / "world"
    (world / "vq").mkdir(parents=True)
    weights = world / "vq" / "model.safetensors"
    weights.write_bytes(bytes(3 * FINGERPRINT_BYTES))
    (world / "notes.md").write_text("a log line")  # not a model file: left out
    pcfg = PolicyConfig(kind="shapes", path=str(world))
    before = base_identity(pcfg)
    middle = world / "vq" / "tokenizer.json"  # between one and two MiB: its middle counts too
    middle.write_bytes(bytes(FINGERPRINT_BYTES + 10))
    with_middle = base_identity(pcfg)
    middle.write_bytes(bytes(FINGERPRINT_BYTES + 5) + b"x" + bytes(4))
    assert base_identity(pcfg) != with_middle
    middle.unlink()
    linked, empty = tmp_path / "snapshot", tmp_path / "empty"  # a Hugging Face snapshot: links to blobs
    linked.mkdir()
    empty.mkdir()
    (linked / "model.safetensors").symlink_to(weights)
    assert base_identity(PolicyConfig(kind="shapes", path=str(linked)))["policy.path"]["fingerprint"] != \
        base_identity(PolicyConfig(kind="shapes", path=str(tmp_path / "empty")))["policy.path"]["fingerprint"]
    assert set(before) == {"policy.path"} and before["policy.path"]["path"] == str(world)
    (world / "notes.md").write_text("another")
    assert base_identity(pcfg) == before
    moved = tmp_path / "moved"
    world.rename(moved)  # the same files elsewhere: the same base
    assert other_base(before, base_identity(PolicyConfig(kind="shapes", path=str(moved)))) is None
    blob = bytearray((moved / "vq" / "model.safetensors").read_bytes())
    blob[-1] = 1  # the last MiB: a weight of the same shape changed
    (moved / "vq" / "model.safetensors").write_bytes(bytes(blob))
    changed = base_identity(PolicyConfig(kind="shapes", path=str(moved)))
    assert re.fullmatch(rf"it was trained with policy.path {world} \(fingerprint [0-9a-f]{{16}}\) and the config now "
                        rf"names {moved} \(fingerprint [0-9a-f]{{16}}\)", other_base(before, changed))
    assert other_base(None, changed) is None  # a checkpoint that recorded nothing is not judged


@pytest.fixture(scope="module")
def two_step_run(micro_world, tmp_path_factory):
    from grpo_vision.train import train
    from tests.helpers import micro_cfg

    out = tmp_path_factory.mktemp("resume")
    return train(micro_cfg(micro_world, out, "run.name=two", "train.steps=2", "log.checkpoint_every=1",
                           "log.report=false", "log.sample_every=0"), progress=False)


def test_a_resume_asking_for_fewer_steps_than_the_run_holds_is_refused_and_overwrites_nothing(two_step_run):
    from grpo_vision.run.folder import resume_config
    from grpo_vision.train import train

    step1 = two_step_run / "checkpoints" / "step_000001" / "policy.safetensors"
    before = step1.read_bytes()
    with pytest.raises(CheckpointError, match=r"holds step 2 and train.steps is 1: a resume only goes forward .*"
                                              r"set train.steps to 2 or more"):
        train(resume_config(two_step_run, ["train.steps=1"]), resume=two_step_run, progress=False)
    assert step1.read_bytes() == before and (two_step_run / "checkpoints" / "latest").read_text() == "step_000002"


def test_a_finished_run_resumed_keeps_its_last_checkpoint_as_it_is(two_step_run):
    from grpo_vision.run.folder import resume_config
    from grpo_vision.train import train

    last = two_step_run / "checkpoints" / "step_000002"
    stamp = (last / "policy.safetensors").stat().st_mtime_ns
    train(resume_config(two_step_run, []), resume=two_step_run, progress=False)
    assert (last / "policy.safetensors").stat().st_mtime_ns == stamp  # not written again


def test_a_pointer_behind_a_complete_later_step_is_passed_by_and_nothing_is_overwritten(two_step_run, tmp_path):
    # a stop between a step's rename and the pointer's rewrite leaves `latest` one step behind: the resume goes on
    # from the complete later step (before: from the pointer's, writing over the later one)
    import shutil

    from grpo_vision.run.folder import resume_config
    from grpo_vision.train import train

    run = tmp_path / "copy"
    shutil.copytree(two_step_run, run)
    (run / "checkpoints" / "latest").write_text("step_000001")
    assert latest_checkpoint(run).name == "step_000002"
    step2 = (run / "checkpoints" / "step_000002" / "policy.safetensors").read_bytes()
    train(resume_config(run, ["train.steps=3"]), resume=run, progress=False)
    assert (run / "checkpoints" / "step_000002" / "policy.safetensors").read_bytes() == step2
    assert checkpoint_steps(run) == [1, 2, 3]


def test_a_run_refuses_other_base_files_unless_allowed_and_then_says_so(two_step_run, micro_world, tmp_path):
    import hashlib
    import json
    import shutil

    from grpo_vision.step.load import load_run
    from grpo_vision.run.folder import resume_config
    from grpo_vision.train import train

    run, world = tmp_path / "run", tmp_path / "other_world"
    shutil.copytree(two_step_run, run)
    shutil.copytree(micro_world, world)
    vq = next(p for p in sorted(world.rglob("*.safetensors")) if "vq" in str(p))
    blob = bytearray(vq.read_bytes())
    blob[-4:] = bytes(4)  # one weight of the same shape: a world that loads, decodes and scores differently
    vq.write_bytes(bytes(blob))
    info = json.loads((world / "world.json").read_text())  # recorded as its build's own file: a valid other world
    info["files"][str(vq.relative_to(world))] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (world / "world.json").write_text(json.dumps(info))
    cfg = resume_config(run, [f"policy.path={world}", "train.steps=3"])
    with pytest.raises(CheckpointError, match=rf"it was trained with policy.path {micro_world} \(fingerprint "
                                              rf"[0-9a-f]+\) and the config now names {world} .*--allow-other-base"):
        train(cfg, resume=run, progress=False)
    assert checkpoint_steps(run) == [1, 2]
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace(str(micro_world), str(world)))
    with pytest.raises(CheckpointError, match="it was trained with policy.path"):  # eval, sample, demo: load_run
        load_run(run)
    with pytest.warns(UserWarning, match="--allow-other-base: it was trained with"):
        assert load_run(run, allow_other_base=True).other_base.startswith("it was trained with")
    train(cfg, resume=run, progress=False, allow_other_base=True)
    logged = [json.loads(line) for line in (run / "base_changes.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == [2] and str(world) in logged[0]["change"]
    assert checkpoint_steps(run) == [1, 2, 3]  # and step 3 records the new base: a plain resume goes on
    train(resume_config(run, ["train.steps=4"]), resume=run, progress=False)


def rewrite(file, weights: dict) -> None:
    """`weights` saved as `file` of a checkpoint with its sha256 recorded, as if the step had written them."""
    import json

    from safetensors.torch import save_file

    from grpo_vision.run.checkpoint import file_sha256

    save_file(weights, file)
    state_file = file.parent / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["sha256"][file.name] = file_sha256(file)
    state_file.write_text(json.dumps(state))


def test_a_flipped_bit_in_a_weights_file_is_named_with_both_hashes(tmp_path):
    # safetensors reads a damaged tensor without a word (it checks the header only): the sha256 that
    # trainer_state.json recorded when the step was written names the file; a checkpoint without them loads
    import hashlib
    import json

    model, opt, sched = tiny()
    path = save_checkpoint(tmp_path, 1, model, opt, sched, {k: v.clone() for k, v in model.state_dict().items()},
                           {"counters": {}})
    state = json.loads((path / "trainer_state.json").read_text())
    assert set(state["sha256"]) == {"policy.safetensors", "reference.safetensors"}
    for name, digest in state["sha256"].items():
        assert digest == hashlib.sha256((path / name).read_bytes()).hexdigest()
    data = bytearray((path / "policy.safetensors").read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor: the header still reads
    (path / "policy.safetensors").write_bytes(bytes(data))
    found, recorded = hashlib.sha256(data).hexdigest(), state["sha256"]["policy.safetensors"]
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, tiny()[0])
    assert str(err.value) == (f"checkpoint file {path / 'policy.safetensors'} has changed since it was written (sha256 "
                              f"{found[:16]}..., recorded {recorded[:16]}...): a damaged copy or disk; copy it again, "
                              f"or delete {path} and use an earlier step")
    del state["sha256"]  # written before checkpoints recorded them: loaded as it is
    (path / "trainer_state.json").write_text(json.dumps(state))
    load_checkpoint(path, tiny()[0])


def test_integer_tensors_for_float_weights_are_refused(tmp_path):
    from safetensors.torch import load_file

    model, opt, sched = tiny()
    path = save_checkpoint(tmp_path, 1, model, opt, sched, None, {"counters": {}})
    weights = load_file(path / "policy.safetensors")
    rewrite(path / "policy.safetensors", {k: (v * 100).to(torch.int32) for k, v in weights.items()})
    with pytest.raises(CheckpointError, match="integer tensors for the float weights"):
        load_checkpoint(path, tiny()[0])


def test_a_checkpoint_holding_a_nan_is_refused_at_load_by_resume_and_eval(micro_world, tmp_path):
    """A resume from it said "the last checkpoint ... holds finite weights" after a NaN step, and eval returned NaN
    results with exit 0."""
    from safetensors.torch import load_file

    from grpo_vision.config import load_config
    from grpo_vision.evaluation.evaluate import evaluate_run
    from grpo_vision.run.checkpoint import CheckpointError
    from grpo_vision.train import train
    from tests.helpers import micro_cfg

    run = train(micro_cfg(micro_world, tmp_path, "train.steps=2", "log.report=false"), progress=False)
    ckpt = run / "checkpoints" / "step_000002"
    weights = load_file(ckpt / "policy.safetensors")
    name = sorted(weights)[0]
    weights[name].view(-1)[0] = float("nan")
    rewrite(ckpt / "policy.safetensors", weights)  # as a step that went NaN writes it: its sha256 recorded
    says = (f"checkpoint {ckpt / 'policy.safetensors'} holds 1 NaN or infinite values in {name}: these weights "
            f"cannot be trained on or sampled; use an earlier checkpoint (delete {ckpt}, or --step N)")
    with pytest.raises(CheckpointError) as err:
        train(load_config(run / "config.yaml", ["train.steps=3"]), resume=run, progress=False)
    assert str(err.value) == says
    with pytest.raises(CheckpointError) as err:
        evaluate_run(run, n=1, device="cpu")
    assert str(err.value) == says
    assert evaluate_run(run, step=1, n=1, device="cpu")["step"] == 1  # an earlier step still evaluates
