"""`world build --out` onto a folder that already holds a world: another preset's is refused before anything is
deleted, and a rebuild of the same preset leaves the fingerprint that runs check as it was. The worlds here are
fake (stage folders and markers as the builder writes them), so no stage is trained."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from grpo_vision.run.checkpoint import fingerprint
from grpo_vision.shapes.build import build_world, recipe_hashes, stages
from grpo_vision.shapes.world import FILES, STAGES, WORLD_VERSION, WorldError, file_checksums


def write_stage(folder: Path, name: str) -> None:
    """Stage `name`'s files, the same bytes on every call (as the deterministic build writes them)."""
    folder.mkdir(parents=True, exist_ok=True)
    for file in FILES[name]:
        if file.endswith(".json"):
            (folder / file).write_text(json.dumps({"stage": name}))
        else:
            save_file({"weight": torch.arange(4.0)}, str(folder / file))


def fake_world(path: Path, preset: str, seed: int = 0) -> Path:
    """A complete world of `preset` as build_world leaves it, its markers recording an hour-long build."""
    hashes = recipe_hashes(preset)
    markers = {n: {"preset": stages.stage_preset(preset, n), "seed": seed, "recipe": hashes[n], "seconds": 3600.0}
               for n in STAGES}
    (path / "stages").mkdir(parents=True)
    for name in STAGES:
        write_stage(path / name, name)
        (path / "stages" / f"{name}.json").write_text(json.dumps(markers[name], indent=2) + "\n")
    info = {"version": WORLD_VERSION, "preset": preset, "seed": seed, "stages": markers, "quality": {"x": 1.0},
            "files": file_checksums(path)}
    (path / "world.json").write_text(json.dumps(info, indent=2) + "\n")
    return path


def contents(world: Path) -> dict:
    return {p.relative_to(world): p.read_bytes() for p in sorted(world.rglob("*")) if p.is_file()}


@pytest.fixture
def no_training(monkeypatch):
    """A stage that would be trained fails at once instead (these worlds' files are fakes that do not load)."""
    def train(world, tmp, preset, *a):
        raise AssertionError(f"trained {tmp.name} ({preset})")
    for name in STAGES:
        monkeypatch.setattr(stages, f"build_{name}", train)


@pytest.mark.parametrize("start_from", [False, True])
def test_out_holding_another_presets_world_is_refused_before_anything_is_deleted(tmp_path, start_from, no_training):
    plan = fake_world(tmp_path / "shapes_plan", "plan")
    source = fake_world(tmp_path / "shapes", "default") if start_from else None
    before = contents(plan)
    with pytest.raises(WorldError) as e:
        build_world(plan, preset="default", seed=0, progress=False, log=print, start_from=source)
    assert str(e.value) == (f"--out {plan} holds a world of preset 'plan' (seed 0) and building preset 'default' "
                            "(seed 0) there would replace its policy: choose another --out, or finish or check that "
                            "world with --preset plan --seed 0")
    assert contents(plan) == before  # its policy, markers and world.json untouched


def test_out_holding_an_unfinished_world_of_another_seed_is_refused(tmp_path, no_training):
    world = fake_world(tmp_path / "w", "micro", seed=3)
    (world / "world.json").unlink()  # a build that stopped during evaluation
    before = contents(world)
    with pytest.raises(WorldError, match=r"holds a world of preset 'micro' \(seed 3\) .* replace its vq, clip, "
                                         r"aesthetic, policy: .* --preset micro --seed 3$"):
        build_world(world, preset="micro", seed=0, progress=False, log=print)
    assert contents(world) == before


def test_rebuilding_a_stage_to_the_same_bytes_keeps_the_world_fingerprint(tmp_path, monkeypatch, no_training):
    world = fake_world(tmp_path / "w", "micro")
    recorded = fingerprint(world)  # what every run trained on this world keeps in its checkpoints
    before = contents(world)
    shutil.rmtree(world / "policy")  # lost, or slipped over: rebuilt with the same preset and seed

    monkeypatch.setattr(stages, "build_policy", lambda world, tmp, *a: write_stage(tmp, "policy") or {})
    monkeypatch.setattr(stages, "load_stage", lambda folder, name: None)
    monkeypatch.setattr(stages, "evaluate_world", lambda *a: {"x": 1.0})
    monkeypatch.setattr(stages, "contact_sheet", lambda *a: None)
    monkeypatch.setattr(stages, "world_constants", lambda world: {})
    messages = []
    build_world(world, preset="micro", seed=0, progress=False, log=messages.append)
    assert [m for m in messages if ": building" in m] == ["[world] policy: building (micro, seed 0)"]
    assert contents(world) == before  # markers and world.json too: the rebuild took other seconds
    assert fingerprint(world) == recorded
