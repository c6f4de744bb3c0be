"""Build a ShapesWorld directory: a chain of stages, each training one model (docs/shapes_world.md).

Each stage writes into `<name>.tmp/` and renames it into place (atomic), then writes its marker; a
stage whose marker matches the preset, the seed and the recipe (a hash of the stage's
hyper-parameters and of the stages it reads) is skipped, so an interrupted build resumes where it
stopped, and a changed recipe rebuilds that stage and everything trained on it (a new tokenizer
means new codes for the policy). A finished stage whose files do not load, or differ from the sizes and
sha256 world.json records, is rebuilt the same way. world.json records them at the end of a build; a
complete world built before they were gets them once each stage is loaded and found sound.

A world preset names each stage's preset (stages.WORLD_PRESETS: a plan world trains the default, or micro,
recipes but for its policy), and `start_from` (`world build --from`) copies another world's stages of the same
recipe instead of training them.

stages.py chains the stages; train_vq.py, train_clip.py (its captions: clip_captions.py), train_aesthetic.py and
train_policy.py train one model each. Only `grpo-vision world build` imports this subpackage; training and
evaluation never do.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from grpo_vision.shapes.world import (INPUTS, STAGES, VERSIONS, WORLD_VERSION, WorldError, check_world_dir,
                                      checksum_problem, file_checksums, stage_problem, with_dependents)


def write_json(path: Path, data: dict) -> None:
    """Atomic: write a temporary file, then rename over the target."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def recipe_hashes(preset: str) -> dict[str, str]:
    """Per stage, a short hash of its hyper-parameters under `preset` and of its inputs' hashes."""
    from grpo_vision.shapes.build import stages

    hashes: dict[str, str] = {}
    for name in STAGES:
        recipe = {"recipe": stages.recipe(name, stages.stage_preset(preset, name)),
                  "inputs": [hashes[i] for i in INPUTS[name]]}
        hashes[name] = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    return hashes


def stage_done(world: Path, name: str, preset: str, seed: int, recipe: str | None = None) -> dict | None:
    marker = world / "stages" / f"{name}.json"
    if not marker.is_file() or not (world / name).is_dir():
        return None
    try:
        info = json.loads(marker.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):  # unreadable: as good as absent, so the stage is rebuilt
        return None
    if not isinstance(info, dict):
        return None
    same = (info.get("preset"), info.get("seed")) == (preset, seed)
    return info if same and (recipe is None or info.get("recipe") == recipe) else None


def run_stage(world: Path, name: str, preset: str, seed: int, recipe: str, build: Callable[[Path], dict],
              log) -> dict:
    """Run `build(tmp_dir) -> figures` unless already done with this recipe; move tmp_dir into place atomically."""
    built = stage_done(world, name, preset, seed)  # with whatever recipe
    if built is not None and built.get("recipe") == recipe:
        log(f"[world] {name}: already built ({preset}, seed {seed}), skipping")
        return built
    if built is not None:
        why = "its recipe or an input changed" if built.get("recipe") else "no recipe was recorded"
        log(f"[world] {name}: {why} since it was built; rebuilding")
    tmp, final = world / f"{name}.tmp", world / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log(f"[world] {name}: building ({preset}, seed {seed})")
    start = time.monotonic()
    figures = build(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    info = {"preset": preset, "seed": seed, "recipe": recipe, "seconds": round(time.monotonic() - start, 1), **figures}
    (world / "stages").mkdir(exist_ok=True)
    write_json(world / "stages" / f"{name}.json", info)
    return info


def build_world(out: str | Path, preset: str = "default", seed: int = 0, progress: bool = True,
                log: Callable[[str], None] = print, start_from: str | Path | None = None) -> dict:
    """Build every missing stage of the world at `out`, evaluate it, and write world.json. `start_from`: a world
    whose finished stages of the same recipe (preset, seed and hash) are copied rather than trained again."""
    from grpo_vision.shapes.build import stages

    if preset not in stages.WORLD_PRESETS:
        raise ValueError(f"preset must be one of {', '.join(map(repr, stages.WORLD_PRESETS))}, got {preset!r}")
    world = Path(out)
    hashes = recipe_hashes(preset)
    presets = {n: stages.stage_preset(preset, n) for n in STAGES}
    refuse_another_world(world, preset, seed, presets)  # before a stage is copied over or deleted
    before = read_json(world / "world.json")  # what runs trained on this world fingerprinted, timings included
    if start_from is not None:
        copy_stages(Path(start_from), world, presets, seed, hashes, log)
    recorded = recorded_files(world)
    broken = {n: problem for n in STAGES
              if stage_done(world, n, presets[n], seed, hashes[n]) and (problem := load_problem(world, n, recorded))}
    for name in with_dependents(broken):
        why = broken.get(name) or f"it is trained on {', '.join(INPUTS[name])}, which is rebuilt"
        log(f"[world] {name}: {why}; rebuilding")
        (world / "stages" / f"{name}.json").unlink(missing_ok=True)  # as if never built: a stop resumes here
    try:
        info = check_world_dir(world)
        if all(stage_done(world, n, presets[n], seed, hashes[n]) for n in STAGES):
            if not recorded:  # every stage loaded above: its files are sound, so record them
                info["files"] = file_checksums(world)
                write_json(world / "world.json", info)
                log(f"[world] {world}: recorded the size and sha256 of each file in world.json")
            log(f"[world] {world} is complete ({preset}, seed {seed}); nothing to build")
            return info
    except WorldError:
        pass
    world.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    (world / "world.json").unlink(missing_ok=True)  # the world is incomplete until the end
    infos = {}
    for name in STAGES:
        build = getattr(stages, f"build_{name}")
        infos[name] = run_stage(world, name, presets[name], seed, hashes[name],
                                lambda tmp: build(world, tmp, presets[name], seed, progress), log)
    if kept := unchanged_record(world, before, preset, seed, hashes):
        log(f"[world] {world}: the stages built are the files world.json recorded, to the byte; its figures and "
            "timings are kept")
        return kept
    log("[world] evaluating")
    figures = stages.evaluate_world(world, preset, seed, progress)
    stages.contact_sheet(world, world / "contact_sheet.png", seed)
    info = {"version": WORLD_VERSION, "preset": preset, "seed": seed, "stages": infos, "quality": figures,
            **stages.world_constants(world), "files": file_checksums(world)}
    write_json(world / "world.json", info)
    log(f"[world] done: {world / 'world.json'}")
    return info


def refuse_another_world(world: Path, preset: str, seed: int, presets: dict[str, str]) -> None:
    """WorldError when `world` holds a finished stage of another preset or seed than this build's: the build would
    delete it and train this preset's in its place (a complete world is kept, never replaced by another)."""
    other = {}
    for name in STAGES:
        marker = read_json(world / "stages" / f"{name}.json") if (world / name).is_dir() else None
        if marker and (marker.get("preset"), marker.get("seed")) != (presets[name], seed):
            other[name] = (marker.get("preset"), marker.get("seed"))
    if other:
        recorded = read_json(world / "world.json") or {}
        held = recorded.get("preset"), recorded.get("seed")
        if held[0] is None:  # no world.json yet (an unfinished build): the policy's preset names its world
            held = other.get("policy") or next(iter(other.values()))
        raise WorldError(f"--out {world} holds a world of preset '{held[0]}' (seed {held[1]}) and building preset "
                         f"'{preset}' (seed {seed}) there would replace its {', '.join(other)}: choose another --out, "
                         f"or finish or check that world with --preset {held[0]} --seed {held[1]}")


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None (absent, unreadable, not an object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def unchanged_record(world: Path, before: dict | None, preset: str, seed: int, hashes: dict[str, str]) -> dict | None:
    """`before` (world.json as the build found it), written back with the stage markers it holds, when the stages
    now in `world` are the very files it recorded, of this preset, seed and recipes; else None. A rebuild that
    trains the same bytes (the build is deterministic) then leaves every file of the world as it was, so the
    fingerprint that runs trained on it recorded (run/checkpoint.py base_identity reads every .json) still matches;
    new timings would otherwise refuse them all as trained on another base."""
    # an older version's world.json (worlds/shapes_plan is of version 2) describes the same files as well as a new one
    if not before or before.get("version") not in VERSIONS:
        return None
    if (before.get("preset"), before.get("seed")) != (preset, seed):
        return None
    infos = before.get("stages")
    if not isinstance(infos, dict) or any(not isinstance(infos.get(n), dict) or infos[n].get("recipe") != hashes[n]
                                          for n in STAGES):
        return None
    if before.get("files") != file_checksums(world):
        return None
    for name in STAGES:
        write_json(world / "stages" / f"{name}.json", infos[name])
    write_json(world / "world.json", before)
    return before


def copy_stages(source: Path, world: Path, presets: dict[str, str], seed: int, hashes: dict[str, str], log) -> None:
    """Copy into `world` each stage of the world at `source` that `world` lacks and that was built with the same
    preset, seed and recipe hash, once its files are those `source`'s world.json records and it loads: the build
    then skips it, as it skips a stage it trained itself. Its marker says where it came from."""
    recorded = recorded_files(source)
    if not recorded:
        raise WorldError(f"--from {source}: not a complete world (no world.json recording its files); "
                         f"build it first with: grpo-vision world build --out {source}")
    for name in STAGES:
        info = stage_done(source, name, presets[name], seed, hashes[name])
        if stage_done(world, name, presets[name], seed, hashes[name]) or info is None:
            continue
        if problem := load_problem(source, name, recorded):
            raise WorldError(f"--from {source}: {problem}")
        shutil.rmtree(world / f"{name}.tmp", ignore_errors=True)  # left by a copy that stopped
        shutil.copytree(source / name, world / f"{name}.tmp")
        shutil.rmtree(world / name, ignore_errors=True)
        os.replace(world / f"{name}.tmp", world / name)
        (world / "stages").mkdir(parents=True, exist_ok=True)
        write_json(world / "stages" / f"{name}.json", info | {"copied_from": str(source)})
        log(f"[world] {name}: copied from {source} (same recipe: {presets[name]}, seed {seed})")


def recorded_files(world: Path) -> dict:
    """The file checksums world.json records, or {} (no world.json yet, or one without them: the build
    rewrites it)."""
    files = (read_json(world / "world.json") or {}).get("files")  # absent, unreadable: the build rewrites it
    return files if isinstance(files, dict) else {}


def load_problem(world: Path, name: str, recorded: dict | None = None) -> str | None:
    """`stage_problem`, then whether the files are those `recorded` in world.json, then whether the stage's
    model loads through the loader the later stages and training use (files that parse can still hold a
    config that does not fit, or weights that are NaN)."""
    from grpo_vision.shapes.build import stages

    problem = stage_problem(world, name) or (checksum_problem(world, recorded, name) if recorded else None)
    if problem is None:
        try:
            stages.load_stage(world / name, name)
        except Exception as e:
            return f"{world / name} does not load ({type(e).__name__}: {e})"
    return problem
