"""Rewards: a registry of short names mapped to factories of plain callables.

Every reward has one signature (ddpo-pytorch's contract):

    reward(images: Tensor[B, 3, H, W] in [0, 1], prompts: list[str], metadata: list[dict]) -> Tensor[B]

and NaN means "does not apply to this sample". A factory takes a `RewardContext` (device, config,
world paths) and returns the callable; it checks its config at once and loads its model from local
paths at the first call (reward_models.py: clip, aesthetic, pickscore, hpsv2).

    @register_reward("my_reward")
    def my_reward(ctx): return lambda images, prompts, metadata: images.mean(dim=(1, 2, 3))

Users pick rewards by name in YAML (`reward.weights: {clip: 1.0, aesthetic: 0.5}`), or point at
their own callable with `python:package.module:function` (the function is the reward itself).
"""

from __future__ import annotations

import importlib
import io
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from grpo_vision.config import ConfigError
from grpo_vision.images import to_uint8

RewardFn = Callable[[torch.Tensor, Sequence[str], Sequence[dict]], torch.Tensor]
REGISTRY: dict[str, Callable[["RewardContext"], RewardFn]] = {}


class RewardError(RuntimeError):
    """A reward failed; `name` says which one."""

    def __init__(self, name: str, message: str):
        super().__init__(f"reward '{name}' failed: {message}")
        self.name = name


@dataclass
class RewardContext:
    """What reward factories may read: the device, the reward section's paths, the world. The path
    fields mirror config.RewardConfig, whose comments document them; from_config copies them."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    batch_size: int = 64  # images per model call
    clip_model: str = ""  # open_clip architecture name ("" = the world's, or ViT-L-14-quickgelu)
    clip_checkpoint: str = ""  # local checkpoint file ("" = the world's)
    aesthetic_checkpoint: str = ""  # aesthetic head file or directory ("" = the world's)
    world: Path | None = None  # a ShapesWorld directory, source of the defaults above
    pickscore_path: str = ""  # transformers CLIPModel directory
    pickscore_processor: str = ""  # CLIPProcessor directory ("" = pickscore_path)
    hpsv2_checkpoint: str = ""  # HPS v2 / v2.1 checkpoint file
    hpsv2_model: str = "ViT-H-14"  # open_clip architecture of hpsv2_checkpoint

    @classmethod
    def from_config(cls, reward_cfg, device: torch.device | str = "cpu", world: Path | None = None) -> RewardContext:
        """The context for a config.RewardConfig: every field the two share, plus device and world."""
        shared = {f.name: getattr(reward_cfg, f.name) for f in fields(cls) if hasattr(reward_cfg, f.name)}
        return cls(**{**shared, "device": torch.device(device), "world": world})


def register_reward(name: str):
    def wrap(factory):
        REGISTRY[name] = factory
        return factory
    return wrap


def available_rewards() -> list[str]:
    return sorted(REGISTRY) + ["python:<module>:<function>"]


def make_reward(name: str, ctx: RewardContext) -> RewardFn:
    if name.startswith("python:"):
        return _import_callable(name)
    if name not in REGISTRY:
        raise ConfigError(f"unknown reward {name!r}; registered rewards: {', '.join(available_rewards())}")
    return REGISTRY[name](ctx)


def _import_callable(spec: str) -> RewardFn:
    parts = spec.split(":")
    if len(parts) != 3 or not all(parts[1:]):
        raise ConfigError(f"reward {spec!r} must look like python:package.module:function")
    try:
        fn = getattr(importlib.import_module(parts[1]), parts[2])
    except Exception as e:  # ImportError, AttributeError, or whatever the user's module raises on import
        raise ConfigError(f"reward {spec!r}: cannot import {parts[2]} from {parts[1]} "
                          f"({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ConfigError(f"reward {spec!r}: {parts[2]} is not callable")
    return fn


def batched(fn: Callable[[torch.Tensor, Sequence[str]], torch.Tensor], batch_size: int, device,
            load: Callable[[], object] | None = None) -> RewardFn:
    """Run `fn(images, prompts)` in chunks of `batch_size` on `device`; results on the CPU, float32.
    `load`, if given, builds the reward's models; CompositeReward.load calls it before a run starts."""
    def reward(images, prompts, metadata):
        out = [fn(images[i:i + batch_size].to(device), list(prompts[i:i + batch_size])).float().cpu()
               for i in range(0, len(prompts), batch_size)]
        return torch.cat(out)
    if load is not None:
        reward.load = load
    return reward


# ---------------------------------------------------------------------------- composite


@dataclass
class RewardOutput:
    total: torch.Tensor  # [B] weighted sum over the rewards that apply (NaN when none applies)
    raw: dict[str, torch.Tensor]  # name -> [B] unweighted values (NaN = does not apply)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B] its weight for each sample


class CompositeReward:
    """A weighted sum of named rewards, with optional per-sample weights from a prompts file.

    `monitor` rewards are computed and logged but carry no weight (train on one reward, watch the
    others for reward hacking). A sample whose prompt entry has its own `rewards` mapping uses those
    weights instead of the defaults: that is how per-entry routing works.
    """

    def __init__(self, weights: dict[str, float], monitor: Sequence[str], ctx: RewardContext):
        self.weights = dict(weights)
        self.names = list(dict.fromkeys([*weights, *monitor]))
        self.fns: dict[str, RewardFn] = {name: make_reward(name, ctx) for name in self.names}

    @classmethod
    def from_config(cls, reward_cfg, device: torch.device | str = "cpu", world: Path | None = None,
                    entries: Sequence = ()) -> CompositeReward:
        """The rewards of a config.RewardConfig, plus any that prompt entries name in their own weights."""
        ctx = RewardContext.from_config(reward_cfg, device, world)
        composite = cls(reward_cfg.weights, reward_cfg.monitor, ctx)
        for e in entries:
            try:
                composite.add(sorted(e.rewards or ()), ctx)
            except ConfigError as err:
                raise ConfigError(f"prompts file, line {e.line} ({e.prompt!r}): {err}") from None
        return composite

    def add(self, names: Sequence[str], ctx: RewardContext) -> None:
        """Make sure rewards named by per-entry weights are loaded too."""
        for name in names:
            if name not in self.fns:
                self.fns[name] = make_reward(name, ctx)
                self.names.append(name)

    def load(self) -> CompositeReward:
        """Build every model-backed reward's model now rather than at its first call, so a missing or
        corrupt weights file stops a run before it samples anything, naming the reward."""
        for name, fn in self.fns.items():
            try:
                getattr(fn, "load", lambda: None)()
            except Exception as e:
                raise RewardError(name, f"its model did not load: {type(e).__name__}: {e}") from e
        return self

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict],
                 entry_weights: Sequence[dict[str, float] | None] | None = None) -> RewardOutput:
        raw = {}
        for name, fn in self.fns.items():
            try:
                value = torch.as_tensor(fn(images, prompts, metadata), dtype=torch.float32).flatten().cpu()
            except Exception as e:  # any failure inside a reward stops the run, naming the reward
                raise RewardError(name, f"{type(e).__name__}: {e}") from e
            if value.shape[0] != len(prompts):
                raise RewardError(name, f"returned {value.shape[0]} values for {len(prompts)} images")
            infinite = value.isinf()  # [B]; one inf makes its group's advantages NaN, which skips the update
            if infinite.any():
                i = int(infinite.nonzero()[0])
                raise RewardError(name, f"returned {value[i].item()} for {int(infinite.sum())} of {len(prompts)} "
                                        f"images (the first for prompt {prompts[i]!r}); a reward must be finite, "
                                        "or NaN where it does not apply")
            raw[name] = value
        B = len(prompts)
        w = torch.zeros(B, len(self.names))  # [B, R]
        for i in range(B):
            weights = (entry_weights[i] if entry_weights and entry_weights[i] is not None else self.weights)
            for j, name in enumerate(self.names):
                w[i, j] = weights.get(name, 0.0)
        values = torch.stack([raw[n] for n in self.names], dim=1)  # [B, R]
        applies = ~values.isnan() & (w != 0)  # [B, R]
        total = torch.where(applies, values * w, torch.zeros_like(values)).sum(1)  # [B]
        total = torch.where(applies.any(1), total, torch.full_like(total, math.nan))
        return RewardOutput(total, raw, {n: w[:, j] for j, n in enumerate(self.names)})


# ---------------------------------------------------------------------------- built-in rewards


def _jpeg_sizes_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    from PIL import Image

    arr = to_uint8(images)
    sizes = []
    for a in arr:
        buffer = io.BytesIO()
        Image.fromarray(a).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes)


@register_reward("jpeg_compressibility")
def jpeg_compressibility(ctx: RewardContext) -> RewardFn:
    """Minus the JPEG size in kB at quality 95 (ddpo-pytorch's compressibility reward)."""
    return lambda images, prompts, metadata: -_jpeg_sizes_kb(images)


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(ctx: RewardContext) -> RewardFn:
    """The JPEG size in kB at quality 95."""
    return lambda images, prompts, metadata: _jpeg_sizes_kb(images)


@register_reward("placebo")
def placebo(ctx: RewardContext) -> RewardFn:
    """A control that carries no information: each image's score is uniform in [0, 1), a hash of
    its 8-bit pixels and its prompt (deterministic, so a resumed run sees the same values). Train
    on it to measure what GRPO's sampling noise alone does to the other rewards and the checker
    (on ShapesWorld it lowers them: README, "What the main job did")."""
    import hashlib

    def reward(images, prompts, metadata):
        arr = to_uint8(images)
        out = []
        for a, prompt in zip(arr, prompts):
            digest = hashlib.sha256(a.tobytes() + prompt.encode()).digest()
            out.append(int.from_bytes(digest[:4], "little") / 2**32)
        return torch.tensor(out)
    return reward


@register_reward("shapes_exact")
def shapes_exact(ctx: RewardContext) -> RewardFn:
    """1 when ShapesWorld's exact checker accepts the image for its caption (read as the policy reads
    it: lower case, single spaces), else 0; NaN for captions outside the ShapesWorld grammar (the
    reward does not apply to them)."""
    from grpo_vision.shapes.checker import check
    from grpo_vision.shapes.scene import CaptionError, as_policy_reads

    def reward(images, prompts, metadata):
        arr = to_uint8(images)
        out = []
        for a, prompt in zip(arr, prompts):
            try:
                out.append(float(check(np.ascontiguousarray(a), as_policy_reads(prompt)).correct))
            except CaptionError:
                out.append(math.nan)
        return torch.tensor(out)
    return reward


# the model-backed rewards (clip, aesthetic, pickscore, hpsv2) register themselves on import
from grpo_vision import reward_models  # noqa: E402,F401
