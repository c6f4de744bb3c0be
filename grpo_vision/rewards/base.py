"""The reward contract and its registry: short names mapped to factories of plain callables.

Every reward has one signature (ddpo-pytorch's contract):

    reward(images: Tensor[B, 3, H, W] in [0, 1], prompts: list[str], metadata: list[dict]) -> Tensor[B]

and NaN means "does not apply to this sample". A reward that can say why an image lost points (the
`geneval` reward: which clause failed) leaves, after each call, `last_reasons`: per image, a list of
`(kind, text)` pairs, e.g. `("position", "expected dog right of target, found left of")`; the
report counts the kinds, the demo shows the texts. A factory takes a `RewardContext` (device, batch
size) and, when it registers an options dataclass, its typed options (`reward.options.<name>` in
config, over the defaults the policy kind supplies); it checks them at once and loads its model
from local paths at the first call, or when `CompositeReward.load` asks.

    @register_reward("my_reward")
    def my_reward(ctx): return lambda images, prompts, metadata: images.mean(dim=(1, 2, 3))

Users pick rewards by name in YAML (`reward.weights: {clip: 1.0, aesthetic: 0.5}`), or point at
their own callable with `python:package.module:function` (the function is the reward itself).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from grpo_vision.config import ConfigError, brief, from_dict
from grpo_vision.plugins import load_plugins, not_found_hint

RewardFn = Callable[[torch.Tensor, Sequence[str], Sequence[dict]], torch.Tensor]


class RewardError(RuntimeError):
    """A reward failed; `name` says which one, `message` what happened (without the name: a handler that
    adds to it builds a new RewardError from `message`, so the prefix is written once)."""

    def __init__(self, name: str, message: str):
        super().__init__(f"reward '{name}' failed: {message}")
        self.name, self.message = name, message


@dataclass
class RewardContext:
    """What every reward factory may read."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    batch_size: int = 64  # images per model call (reward.batch_size)


@dataclass
class Registered:
    factory: Callable[..., RewardFn]  # factory(ctx) or, with options, factory(ctx, options)
    options: type | None = None  # the dataclass of `reward.options.<name>`; None: the reward takes none


REGISTRY: dict[str, Registered] = {}


def register_reward(name: str, options: type | None = None):
    """Register `factory` as reward `name`; with `options` (a dataclass), the factory is called as
    `factory(ctx, options_instance)`, the instance built strictly from `reward.options.<name>`."""
    def wrap(factory):
        REGISTRY[name] = Registered(factory, options)
        return factory
    return wrap


def available_rewards() -> list[str]:
    return sorted(REGISTRY) + ["python:<module>:<function>"]


def is_registered(name: str) -> bool:
    """A registered name or a python: spec; plugins are loaded before a name is called unknown."""
    if name.startswith("python:") or name in REGISTRY:
        return True
    load_plugins()
    return name in REGISTRY


def make_reward(name: str, ctx: RewardContext, options: dict[str, Any] | None = None) -> RewardFn:
    """The reward `name` built with `options` (a mapping, checked against its options dataclass)."""
    if name.startswith("python:"):
        if options:
            raise ConfigError(f"reward.options.{name}: a python: reward takes no options; read your own "
                              "settings inside the function")
        return _import_callable(name)
    if not is_registered(name):
        raise ConfigError(f"unknown reward {brief(name)}; registered rewards: {', '.join(available_rewards())} "
                          f"({not_found_hint()})")
    entry = REGISTRY[name]
    if entry.options is None:
        if options:
            raise ConfigError(f"reward.options.{name}: reward {name!r} takes no options, got "
                              f"{', '.join(map(brief, options))}")
        return entry.factory(ctx)
    return entry.factory(ctx, from_dict(entry.options, dict(options or {}), where="config",
                                        prefix=f"reward.options.{name}."))


def _import_callable(spec: str) -> RewardFn:
    parts = spec.split(":")
    if len(parts) != 3 or not all(parts[1:]):
        raise ConfigError(f"reward {brief(spec)} must look like python:package.module:function")
    try:
        fn = getattr(importlib.import_module(parts[1]), parts[2])
    except Exception as e:  # ImportError, AttributeError, or whatever the user's module raises on import
        raise ConfigError(f"reward {brief(spec)}: cannot import {parts[2]} from {parts[1]} "
                          f"({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ConfigError(f"reward {brief(spec)}: {parts[2]} is not callable")
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
