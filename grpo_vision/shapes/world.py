"""Check and load a ShapesWorld directory: tokenizer, tiny CLIP, aesthetic head, base policy.

    worlds/shapes/
      vq/          diffusers VQModel (config.json + safetensors)
      clip/        open_clip checkpoint (clip.safetensors) + its model config
      aesthetic/   LAION-style aesthetic head (safetensors + config)
      policy/      base policy (policy_config.json + policy.safetensors)
      stages/      one JSON per finished stage: preset, seed, figures
      world.json   every quality figure, and the size and sha256 of each stage file; written last, so its
                   presence means the world is complete (version 2 records the plan grammar of a base policy
                   that plans, worlds/shapes_plan; version 3 whether it draws its plan onto a layout canvas,
                   worlds/shapes_canvas; load_world reads versions 1 to 3)
      contact_sheet.png

The builder (`grpo_vision.shapes.build`) writes it; this module only checks and loads it, which is
all training needs. `load_world` refuses an incomplete directory, a file that does not parse or one
that is not the file the build wrote (the sha256 of every file: under 50 ms for the default world's
18 MB on a 2-core CPU), and says which part is missing or broken and the command that fixes it (the
stage files are marked -text in .gitattributes, so no checkout changes a line ending).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo_vision.config import ConfigError, brief

# what a build writes: 2 adds `plan` to world.json (None: the base policy does not plan), 3 its `canvas` (whether
# the policy draws its plan onto a layout canvas, worlds/shapes_canvas)
WORLD_VERSION = 3
VERSIONS = (1, 2, 3)  # what load_world reads: 1 is worlds/shapes, built before plans; 2 worlds/shapes_plan
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
    tokenizer: Any  # grpo_vision.models.tokenizer.VQTokenizer
    policy: Any  # grpo_vision.models.llama.LlamaImagePolicy


def stage_problem(world: Path, name: str) -> str | None:
    """What is wrong with stage `name`'s files, naming the file, or None. Every file must parse (JSON;
    safetensors, whose header is checked against the file's length); the weights are read once, by
    the loader. (The builder also loads each stage's model: build/__init__.py.)"""
    from safetensors import SafetensorError, safe_open

    for path in (world / name / f for f in FILES[name]):
        try:
            if path.suffix == ".json":
                json.loads(path.read_text())
            else:  # the header only: it must cover the file exactly
                with safe_open(str(path), framework="pt"):
                    pass
        # absent or unreadable (OSError), not UTF-8 or not JSON (ValueError), nested past Python's limit
        # (RecursionError), a bad header (SafetensorError); anything else, such as a failed mmap when the
        # memory ran out, is the machine's and not the file's
        except (OSError, ValueError, RecursionError, SafetensorError) as e:
            return f"{path} does not load ({type(e).__name__}: {e})"
    return None


def file_checksums(world: Path) -> dict[str, dict]:
    """{"vq/config.json": {"bytes": ..., "sha256": ...}, ...}: every stage file, as world.json records them."""
    return {f"{n}/{f}": _checksum(world / n / f) for n in STAGES for f in FILES[n]}


def _checksum(path: Path) -> dict:
    from grpo_vision.run.checkpoint import file_sha256

    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def checksum_problem(world: Path, recorded: dict, name: str) -> str | None:
    """Which file of stage `name` is not the one the build wrote, by its size and sha256 in world.json's
    `recorded` files (a file damaged under an intact header still parses), or None."""
    for key in (f"{name}/{f}" for f in FILES[name]):
        want, path = recorded.get(key), world / key
        want = want if isinstance(want, dict) else {}  # an edited world.json: the file is then named as changed
        if path.stat().st_size != want.get("bytes") or _checksum(path)["sha256"] != want.get("sha256"):
            return (f"{path} is not the file the build wrote (its size or sha256 differs from world.json's): "
                    "it was changed or damaged since")
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


def load_world(path: str | Path, device: str | torch.device = "cpu", defer_tokenizer: bool = False) -> World:
    """A world directory's tokenizer and base policy, every file checked against world.json first.
    `defer_tokenizer`: the tokenizer is a policy.Deferred, made when a bundle first reads it."""
    from grpo_vision.models.llama import LlamaImagePolicy
    from grpo_vision.models.tokenizer import VQTokenizer
    from grpo_vision.policy import Deferred
    from grpo_vision.shapes.plan import plan_words

    info = check_world_dir(path)
    world = Path(path)
    if info.get("version") not in VERSIONS:
        raise WorldError(f"{world / 'world.json'} is of version {brief(info.get('version'))}; this grpo-vision reads "
                         f"world versions {', '.join(map(str, VERSIONS))}: rebuild it with: grpo-vision world build "
                         f"--out {world} --preset {info.get('preset')} --seed {info.get('seed')}")
    recorded = info.get("files")
    if not isinstance(recorded, dict):  # the build always records them: without them no file could be checked
        raise WorldError(f"{world / 'world.json'} records no checksums of the world's files (was it edited?); check "
                         f"and record them with: grpo-vision world build --out {world} --preset {info.get('preset')} "
                         f"--seed {info.get('seed')}")
    for name in STAGES:  # a broken file is named here, not three tracebacks deep in a loader
        problem = stage_problem(world, name) or checksum_problem(world, recorded, name)
        if problem:
            raise WorldError(f"world file {problem}; {rebuild_command(world, info, name)}")
    def make_tokenizer():
        return VQTokenizer.from_pretrained(world / "vq", device=device)
    tokenizer = Deferred(make_tokenizer) if defer_tokenizer else make_tokenizer()
    policy = LlamaImagePolicy.from_pretrained(world / "policy", device=device).float().eval()
    if policy.cfg.plan_words and policy.cfg.plan_words != plan_words():  # its plans would be judged in another grammar
        raise WorldError(f"{world / 'policy'} plans in words other than this grpo-vision's plan grammar "
                         f"(shapes/plan.py); {rebuild_command(world, info, 'policy')}")
    return World(world, tokenizer, policy)
