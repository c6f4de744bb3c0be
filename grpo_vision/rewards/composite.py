"""A weighted sum of named rewards, with monitors and per-prompt weights."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from grpo_vision.config import ConfigError, brief
from grpo_vision.rewards.base import (
    RewardContext, RewardError, RewardFn, RunModels, check_option_names, make_reward,
)


@dataclass
class RewardOutput:
    total: torch.Tensor  # [B] weighted sum over the rewards that apply (NaN when none applies)
    raw: dict[str, torch.Tensor]  # name -> [B] unweighted values (NaN = does not apply)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B] its weight for each sample
    # name -> per image, the (kind, text) of each point it lost, for the rewards that say (`last_reasons`)
    reasons: dict[str, list[list[tuple[str, str]]]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # tolerant: name -> why it has no score (it failed)


class CompositeReward:
    """A weighted sum of named rewards, with optional per-sample weights from a prompts file.

    `monitor` rewards are computed and logged but carry no weight (train on one reward, watch the
    others for reward hacking). A sample whose prompt entry has its own `rewards` mapping uses those
    weights instead of the defaults: that is how per-entry routing works.

    A reward that can learn (iterative RL, train.iterations) has three more attributes besides the
    call: `update(images, prompts, metadata, labels) -> {metric: float}`, and `state_dict()` /
    `load_state_dict(state)`, which checkpoints hold so that a resumed run scores as a straight one.
    `labels` are the judge's verdicts on the images (policy.Judge), None where there is no judge.
    """

    def __init__(self, weights: dict[str, float], monitor: Sequence[str], ctx: RewardContext,
                 options: dict[str, dict] | None = None):
        self.weights, self.monitor = dict(weights), list(monitor)
        self.ctx, self.options = ctx, dict(options or {})
        self.names: list[str] = []
        self.fns: dict[str, RewardFn] = {}
        self.add(list(dict.fromkeys([*weights, *monitor])))

    @classmethod
    def from_config(cls, reward_cfg, device: torch.device | str = "cpu", defaults: dict[str, dict] | None = None,
                    entries: Sequence = (), models: RunModels | None = None) -> CompositeReward:
        """The rewards of a config.RewardConfig, plus any that prompt entries name in their own weights.
        Each reward's options are `defaults[name]` (what the policy kind ships, e.g. ShapesWorld's tiny
        CLIP) overridden key by key by `reward.options[name]`. `models`: the run's own networks, for a reward
        that scores with them (the self_judge); a command that loads a policy gives them."""
        check_option_names(reward_cfg.options)
        names = {*(defaults or {}), *reward_cfg.options}
        options = {n: {**(defaults or {}).get(n, {}), **reward_cfg.options.get(n, {})} for n in names}
        composite = cls(reward_cfg.weights, reward_cfg.monitor,
                        RewardContext(torch.device(device), reward_cfg.batch_size, models), options)
        for e in entries:
            try:
                composite.add(sorted(e.rewards or ()))
            except ConfigError as err:
                raise ConfigError(f"prompts file, line {e.line} ({brief(e.prompt)}): {err}") from None
        return composite

    def add(self, names: Sequence[str]) -> None:
        """Build the rewards `names` not built yet (those named by per-entry weights, too)."""
        for name in names:
            if name not in self.fns:
                fn = make_reward(name, self.ctx, self.options.get(name))
                if hasattr(fn, "update") and not (hasattr(fn, "state_dict") and hasattr(fn, "load_state_dict")):
                    raise ConfigError(f"reward {name!r} can learn (it has update()) but has no state_dict() and "
                                      "load_state_dict(): a checkpoint could not hold what it learned, and a "
                                      "resumed run would score differently; give it both")
                self.fns[name] = fn
                self.names.append(name)

    @property
    def learners(self) -> list[str]:
        """The rewards that can learn between iterations (those with an `update` method)."""
        return [n for n in self.names if hasattr(self.fns[n], "update")]

    def update(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict],
               labels: Sequence[dict | None]) -> dict[str, float]:
        """Update every reward that learns; their metrics as `reward_update/<name>/<metric>`. If one
        fails, every reward is put back as it was before this call and a RewardError names it."""
        out, before = {}, _copy(self.state_dict())
        for name in self.learners:
            try:
                metrics = self.fns[name].update(images, prompts, metadata, labels) or {}
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                self.load_state_dict(before)
                raise RewardError(name, f"its update failed: {_why(e)}") from e
            out |= {f"reward_update/{name}/{k}": float(v) for k, v in metrics.items()}
        return out

    def state_dict(self) -> dict[str, dict]:
        """What the learning rewards have learned, by name (empty when none learns)."""
        return {n: self.fns[n].state_dict() for n in self.learners}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        unknown = sorted(set(state) - set(self.learners))
        if unknown:
            raise ValueError(f"saved reward state for {unknown}, which this run's rewards {self.learners} do not "
                             "learn: was the checkpoint written with another reward config?")
        for name, s in state.items():
            self.fns[name].load_state_dict(s)

    def load(self) -> CompositeReward:
        """Build every model-backed reward's model now rather than at its first call, so a missing or
        corrupt weights file stops a run before it samples anything, naming the reward."""
        for name, fn in self.fns.items():
            try:
                getattr(fn, "load", lambda: None)()
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                raise RewardError(name, f"its model did not load: {_why(e)}") from e
        return self

    def check(self, sets: dict[str, Sequence]) -> None:
        """Every reward that can check prompts (`check(prompts, metadata)`: the geneval reward, that each
        carries GenEval clauses) checks the entries of every set a run scores that it applies to (the
        config's weights and monitors, or the entry's own `rewards`), so a set it cannot score stops the
        run at its start rather than at the report; ConfigError naming the reward and the set."""
        for name, fn in self.fns.items():
            if not hasattr(fn, "check"):
                continue
            for what, entries in sets.items():
                mine = [e for e in entries if self.applies(name, e)]
                try:
                    fn.check([e.prompt for e in mine], [e.metadata for e in mine])
                except ValueError as e:
                    raise ConfigError(f"reward {name!r} cannot score the {what} prompts: {e}") from None

    def applies(self, name: str, entry) -> bool:
        """Whether reward `name` counts for a prompt entry: a weight in its own `rewards` mapping, else in
        the config's weights or monitors (per-entry routing: prompts.py)."""
        if entry.rewards is not None:
            return bool(entry.rewards.get(name))
        return bool(self.weights.get(name)) or name in self.monitor

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict],
                 entry_weights: Sequence[dict[str, float] | None] | None = None,
                 tolerant: bool = False) -> RewardOutput:
        """Every reward's values and the weighted total. `tolerant` (a demo, not training): a reward that fails
        scores NaN and its RewardError's message goes to `notes`, where training stops on it."""
        raw, notes = {}, {}
        for name in self.fns:
            try:
                raw[name] = self.score(name, images, prompts, metadata)
            except RewardError as e:
                if not tolerant:
                    raise
                raw[name], notes[name] = torch.full((len(prompts),), math.nan), e.message
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
        reasons = {k: v for k, v in self.reasons(len(prompts)).items() if k not in notes}
        return RewardOutput(total, raw, {n: w[:, j] for j, n in enumerate(self.names)}, reasons, notes)

    def score(self, name: str, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        """Reward `name`'s raw values `[B]` (NaN = does not apply); RewardError naming it when it fails or
        returns what a reward may not (the wrong count, an infinity)."""
        try:
            value = torch.as_tensor(self.fns[name](images, prompts, metadata), dtype=torch.float32).flatten().cpu()
        except KeyboardInterrupt:  # Ctrl-C, or a signal (signals.Interrupted): the run's own stop
            raise
        except RewardError as e:  # a reward that words its own failure (remote: the URL and what came back)
            raise RewardError(name, e.message) from e
        except BaseException as e:  # any failure inside a reward stops the run, naming the reward
            raise RewardError(name, _why(e)) from e
        if value.shape[0] != len(prompts):
            raise RewardError(name, f"returned {value.shape[0]} values for {len(prompts)} images")
        infinite = value.isinf()  # [B]; one inf makes its group's advantages NaN, which skips the update
        if infinite.any():
            i = int(infinite.nonzero()[0])
            raise RewardError(name, f"returned {value[i].item()} for {int(infinite.sum())} of {len(prompts)} "
                                    f"images (the first for prompt {brief(prompts[i])}); a reward must be finite, "
                                    "or NaN where it does not apply")
        return value

    def reasons(self, count: int) -> dict[str, list[list[tuple[str, str]]]]:
        """The last call's reasons of the rewards that give them (`last_reasons`, one list per image)."""
        out = {}
        for name, fn in self.fns.items():
            given = getattr(fn, "last_reasons", None)
            if given is not None and len(given) == count:
                out[name] = [[(str(kind), str(text)) for kind, text in image] for image in given]
        return out


def _why(e: BaseException) -> str:
    """A reward's failure in words. exit() inside a reward (SystemExit) is one too: let through, it would
    end the run mid-step with status 0, as if it had finished."""
    if isinstance(e, SystemExit):
        return f"it called exit({e.code!r}), which would end the run; a reward returns scores or raises an error"
    return f"{type(e).__name__}: {e}"


def _copy(tree):
    """A deep copy of a state tree whose tensors may share storage with live weights."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copy(v) for v in tree)
    return copy.deepcopy(tree)  # numbers, strings, arrays: a learner may change them in place
