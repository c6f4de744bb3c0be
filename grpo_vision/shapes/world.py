"""Build, validate and load a ShapesWorld directory: tokenizer, tiny CLIP, aesthetic head, base policy.

    worlds/shapes/
      vq/          diffusers VQModel (config.json + safetensors)
      clip/        open_clip checkpoint (clip.safetensors) + its model config
      aesthetic/   LAION-style aesthetic head (safetensors + config)
      policy/      base policy (policy_config.json + policy.safetensors)
      stages/      one JSON per finished stage: preset, seed, figures
      world.json   every quality figure; written last, so its presence means the world is complete
      contact_sheet.png

The build is a chain of stages. Each stage writes into `<name>.tmp/` and renames it into place
(atomic), then writes its marker; a stage whose marker matches the preset, the seed and the recipe
(a hash of the stage's hyper-parameters and of the stages it reads) is skipped, so an interrupted
build resumes where it stopped, and a changed recipe rebuilds that stage and everything trained on
it (a new tokenizer means new codes for the policy). A finished stage whose files do not load (cut
short by a failed copy, say) is rebuilt the same way. `load_world` refuses an incomplete directory or a
file that does not parse, and says which part is missing or broken and the command that fixes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from grpo_vision.config import ConfigError

WORLD_VERSION = 1
STAGES = ("vq", "clip", "aesthetic", "policy")
INPUTS = {"vq": (), "clip": (), "aesthetic": ("clip",), "policy": ("vq",)}  # stages each one is trained on
FILES = {"vq": ("config.json", "diffusion_pytorch_model.safetensors"), "clip": ("clip.safetensors",),
         "aesthetic": ("aesthetic_config.json", "aesthetic.safetensors"),
         "policy": ("policy_config.json", "policy.safetensors")}  # what each stage saves into its folder


class WorldError(ConfigError):
    """A missing or incomplete world directory; the message says how to build it (a ConfigError:
    policy.path names it, and the CLI prints it as one line)."""


@dataclass
class World:
    path: Path
    info: dict  # world.json
    tokenizer: Any  # grpo_vision.tokenizer.VQTokenizer
    policy: Any  # grpo_vision.llama_policy.LlamaImagePolicy

    @property
    def sampling(self) -> dict:
        return self.info["sampling"]

    @property
    def clip_model_name(self) -> str:
        return self.info["clip_model_name"]

    @property
    def clip_checkpoint(self) -> Path:
        return self.path / "clip" / "clip.safetensors"

    @property
    def aesthetic_dir(self) -> Path:
        return self.path / "aesthetic"


def write_json(path: Path, data: dict) -> None:
    """Atomic: write a temporary file, then rename over the target."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def recipe_hashes(preset: str) -> dict[str, str]:
    """Per stage, a short hash of its hyper-parameters under `preset` and of its inputs' hashes."""
    from grpo_vision.shapes import stages

    hashes: dict[str, str] = {}
    for name in STAGES:
        recipe = {"recipe": stages.recipe(name, preset), "inputs": [hashes[i] for i in INPUTS[name]]}
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
                log: Callable[[str], None] = print) -> dict:
    """Build every missing stage of the world at `out`, evaluate it, and write world.json."""
    from grpo_vision.shapes import stages

    if preset not in ("micro", "default"):
        raise ValueError(f"preset must be 'micro' or 'default', got {preset!r}")
    world = Path(out)
    hashes = recipe_hashes(preset)
    broken = {n: problem for n in STAGES
              if stage_done(world, n, preset, seed, hashes[n]) and (problem := stage_problem(world, n))}
    for name in with_dependents(broken):
        why = broken.get(name) or f"it is trained on {', '.join(INPUTS[name])}, which is rebuilt"
        log(f"[world] {name}: {why}; rebuilding")
        (world / "stages" / f"{name}.json").unlink(missing_ok=True)  # as if never built: a stop resumes here
    try:
        info = check_world_dir(world)
        if all(stage_done(world, n, preset, seed, hashes[n]) for n in STAGES):
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
        infos[name] = run_stage(world, name, preset, seed, hashes[name],
                                lambda tmp: build(world, tmp, preset, seed, progress), log)
    log("[world] evaluating")
    figures = stages.evaluate_world(world, preset, seed, progress)
    stages.contact_sheet(world, world / "contact_sheet.png", seed)
    info = {"version": WORLD_VERSION, "preset": preset, "seed": seed, "stages": infos, "quality": figures,
            **stages.world_constants(world)}
    write_json(world / "world.json", info)
    log(f"[world] done: {world / 'world.json'}")
    return info


def stage_problem(world: Path, name: str, load: bool = True) -> str | None:
    """What is wrong with stage `name`'s files, naming the file, or None. Every file must parse (JSON;
    safetensors, whose header is checked against the file's length); with `load`, the stage's model
    must also load through the loader the later stages and training use."""
    from safetensors import safe_open

    from grpo_vision.shapes import stages

    for path in (world / name / f for f in FILES[name]):
        try:
            if path.suffix == ".json":
                json.loads(path.read_text())
            else:  # the header only: it must cover the file exactly; the weights are read once, by the loader
                with safe_open(str(path), framework="pt"):
                    pass
        except Exception as e:  # absent, cut short, not UTF-8, not JSON, a bad header: each its own kind
            return f"{path} does not load ({type(e).__name__}: {e})"
    if load:
        try:
            stages.load_stage(world / name, name)
        except Exception as e:  # the files parse but do not make a model (a config that does not fit)
            return f"{world / name} does not load ({type(e).__name__}: {e})"
    return None


def with_dependents(names) -> list[str]:
    """`names` and every stage trained on one of them, in build order."""
    out: list[str] = []
    for n in STAGES:  # a stage's inputs come before it
        if n in names or any(i in out for i in INPUTS[n]):
            out.append(n)
    return out


def rebuild_command(world: Path, info: dict, name: str) -> str:
    """How to rebuild stage `name` of the world described by `info` (its world.json)."""
    also = [n for n in with_dependents([name]) if n != name]
    trained = f" and {', '.join(also)}, trained on it," if also else ""
    return (f"rebuild stage '{name}' with: grpo-vision world build --out {world} --preset {info.get('preset')} "
            f"--seed {info.get('seed')} (it rebuilds {name}{trained} and keeps the other stages)")


def check_world_dir(path: str | Path) -> dict:
    """world.json of a complete world, or WorldError naming what is missing and how to finish it."""
    world = Path(path)
    fix = f"build it with: grpo-vision world build --out {world}"
    if not world.is_dir():
        raise WorldError(f"world directory not found: {world}; {fix}")
    missing = [n for n in STAGES if not (world / n).is_dir() or not (world / "stages" / f"{n}.json").is_file()]
    if missing or not (world / "world.json").is_file():
        what = f"stage(s) {', '.join(missing)}" if missing else "world.json (the build did not finish)"
        raise WorldError(f"world at {world} is incomplete: missing {what}; {fix} (finished stages are kept)")
    try:
        return json.loads((world / "world.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WorldError(f"world at {world} has an unreadable world.json ({e}); delete it and {fix} "
                         "(finished stages are kept)") from e


def load_world(path: str | Path, device: str | torch.device = "cpu") -> World:
    from grpo_vision.llama_policy import LlamaImagePolicy
    from grpo_vision.tokenizer import VQTokenizer

    info = check_world_dir(path)
    world = Path(path)
    for name in STAGES:  # a broken file is named here, not three tracebacks deep in a loader
        problem = stage_problem(world, name, load=False)
        if problem:
            raise WorldError(f"world file {problem}; {rebuild_command(world, info, name)}")
    tokenizer = VQTokenizer.from_pretrained(world / "vq", device=device)
    policy = LlamaImagePolicy.from_pretrained(world / "policy", device=device).float().eval()
    return World(world, info, tokenizer, policy)
