"""A weighted sum of named rewards, with monitors and per-prompt weights."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from grpo_vision.config import ConfigError
from grpo_vision.rewards.base import RewardContext, RewardError, RewardFn, available_rewards, is_registered, make_reward


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

    def __init__(self, weights: dict[str, float], monitor: Sequence[str], ctx: RewardContext,
                 options: dict[str, dict] | None = None):
        self.weights = dict(weights)
        self.ctx, self.options = ctx, dict(options or {})
        self.names: list[str] = []
        self.fns: dict[str, RewardFn] = {}
        self.add(list(dict.fromkeys([*weights, *monitor])))

    @classmethod
    def from_config(cls, reward_cfg, device: torch.device | str = "cpu", defaults: dict[str, dict] | None = None,
                    entries: Sequence = ()) -> CompositeReward:
        """The rewards of a config.RewardConfig, plus any that prompt entries name in their own weights.
        Each reward's options are `defaults[name]` (what the policy kind ships, e.g. ShapesWorld's tiny
        CLIP) overridden key by key by `reward.options[name]`."""
        for name in reward_cfg.options:  # a typo in an options key would otherwise be silently unused
            if not is_registered(name):
                raise ConfigError(f"reward.options names {name!r}, which is not a reward; registered rewards: "
                                  f"{', '.join(available_rewards())}")
        names = {*(defaults or {}), *reward_cfg.options}
        options = {n: {**(defaults or {}).get(n, {}), **reward_cfg.options.get(n, {})} for n in names}
        composite = cls(reward_cfg.weights, reward_cfg.monitor,
                        RewardContext(torch.device(device), reward_cfg.batch_size), options)
        for e in entries:
            try:
                composite.add(sorted(e.rewards or ()))
            except ConfigError as err:
                raise ConfigError(f"prompts file, line {e.line} ({e.prompt!r}): {err}") from None
        return composite

    def add(self, names: Sequence[str]) -> None:
        """Build the rewards `names` not built yet (those named by per-entry weights, too)."""
        for name in names:
            if name not in self.fns:
                self.fns[name] = make_reward(name, self.ctx, self.options.get(name))
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
