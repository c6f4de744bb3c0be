"""GRPOTrainer: `grpo-vision train` from a script, with objects where the command line takes files.

The same run, folder and typed config as the command line; what a script has in memory goes in directly:
reward functions, prompts (a list, a `datasets.Dataset`), a loaded policy bundle. TRL's option names are taken
where this library has the same knob (config/trl_names.py), each mapping printed once.

    import datasets
    from grpo_vision import GRPOTrainer

    def brightness(images, prompts, metadata):           # images [B, 3, H, W] in [0, 1] -> one score each
        return images.mean(dim=(1, 2, 3))

    prompts = datasets.Dataset.from_dict({"prompt": ["a red circle", "a blue square"]})
    trainer = GRPOTrainer("configs/janus_pro_1b.yaml", rewards={"brightness": brightness}, train_prompts=prompts,
                          max_steps=50, learning_rate=1e-5, output_dir="runs/bright")
    run_dir = trainer.train()
    print(trainer.evaluate()["sets"]["test"])            # what `grpo-vision eval RUN` prints
    trainer.export("bright_janus")                        # transformers / peft / LlamaGen format (export)

A reward made in the script exists only while the script runs: the run folder records where it was made
(rewards.json), and `eval`, `demo` and `train --resume` on the folder later name it and take it back with
`--reward brightness=python:my_module:brightness`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_vision.config import (
    EVAL_SEED, Config, ConfigError, GrpoVisionWarning, PolicyConfig, apply_override, brief, from_dict, load_config,
    validate,
)
from grpo_vision.config.trl_names import accumulation, trl_overrides


class GRPOTrainer:
    def __init__(self, config: Config | str | Path | Mapping | None = None, *, policy=None,
                 rewards: Mapping[str, Any] | list | None = None,
                 reward_weights: Mapping[str, float] | list | None = None,
                 train_prompts=None, eval_prompts=None, prompt_column: str = "",
                 overrides: list[str] | tuple = (), **options):
        """`config`: a YAML path, a nested mapping of sections, or a Config (None: the defaults); `overrides`:
        dotted `key=value` strings, as on the command line; `options`: TRL GRPOConfig names (learning_rate,
        num_generations, gradient_accumulation_steps, output_dir, ...).
        `policy`: a loaded `Bundle` (the run folder still records config.policy, which later commands load), a
        model path, a PolicyConfig or its mapping; None: config.policy.
        `rewards`: {name: a function (images, prompts, metadata) -> scores, or a registered reward's name or
        python: spec}, or a list of them (a function named by its __name__); they replace reward.weights, each
        weighted by `reward_weights` (a mapping, or a list in the same order), else by reward.weights' entry
        of that name, else 1.
        `train_prompts` / `eval_prompts`: a prompts file's path, or prompts in memory (a list of strings or
        dicts, a `datasets.Dataset`); `prompt_column`: the column holding the prompts."""
        from grpo_vision.policy import Bundle
        from grpo_vision.rewards import check_options

        self.cfg = _config(config)
        for item in overrides:
            apply_override(self.cfg, item)
        self.bundle = policy if isinstance(policy, Bundle) else None
        if self.bundle is None and policy is not None:
            self.cfg.policy = _policy_config(policy, self.cfg.policy)
        elif self.bundle is not None:
            p = self.cfg.policy
            named = f"({p.kind}: {p.path}), which must name the same model" if p.kind else \
                "(it names none yet: set policy.kind and policy.path to the model given here)"
            warnings.warn(f"a policy given in memory trains now; eval, demo and --resume on the run folder load "
                          f"config.policy {named}", GrpoVisionWarning, stacklevel=2)
        if prompt_column:
            self.cfg.data.prompt_column = prompt_column
        self.prompts = {"train": self._prompts(train_prompts, "train"), "eval": self._prompts(eval_prompts, "eval")}
        for which, given in self.prompts.items():  # prompts in memory take the place of a config's file, said once
            if given is not None and getattr(self.cfg.data, f"{which}_prompts"):
                print(f"[trainer] the {len(given)} {which} prompts given replace data.{which}_prompts "
                      f"({getattr(self.cfg.data, f'{which}_prompts')})", flush=True)
                setattr(self.cfg.data, f"{which}_prompts", "")
        if rewards is not None:
            self._rewards(rewards, reward_weights)
        elif reward_weights is not None:
            raise ConfigError("reward_weights without rewards: give the rewards they weigh")
        self._options(options)
        validate(self.cfg)
        check_options(self.cfg)  # reward.options and policy.options against their registered dataclasses
        self.run_dir: Path | None = None

    # ------------------------------------------------------------------ what the trainer does
    def train(self, resume_from_checkpoint: str | Path | bool | None = None) -> Path:
        """Train, and return the run folder. `resume_from_checkpoint`: True continues this trainer's run folder,
        a path continues that run folder (TRL's argument name)."""
        from grpo_vision.run.health import say_done
        from grpo_vision.train import train

        if resume_from_checkpoint:
            resume = Path(self.cfg.run.out_dir) / self.cfg.run.name if resume_from_checkpoint is True \
                else Path(resume_from_checkpoint)
            self.run_dir = train(self.cfg, resume=resume, bundle=self.bundle)  # a run folder keeps its prompts
        else:
            given = self.prompts if self.prompts["train"] is not None else None
            self.run_dir = train(self.cfg, bundle=self.bundle, prompts=given)
        say_done(self.run_dir, self.cfg)  # the CLI's last line and warnings (a reward NaN everywhere), here too
        return self.run_dir

    def evaluate(self, step: int | None = None, n: int | None = None, seed: int = EVAL_SEED, prompts=None,
                 device: str = "run") -> dict:
        """`grpo-vision eval RUN`'s result for the trained run: each reward's mean and 95% interval, policy and
        reference, on the run's eval sets (or on `prompts`: a path or prompts in memory, as train_prompts), `n`
        images per prompt (default: the run's log.eval_images). The seeds are eval's and the report's (EVAL_SEED),
        so the three score the same images: without `prompts`, the result equals the run's eval.json."""
        from grpo_vision.evaluation.evaluate import evaluate_run

        sets = {"prompts": self._prompts(prompts, "prompts")} if prompts is not None else None
        return evaluate_run(self._run(), step, n, seed, device, sets)

    def export(self, out: str | Path, step: int | None = None, merge: bool = False) -> Path:
        """The trained policy in its model's own format (`grpo-vision export`); returns `out`."""
        from grpo_vision.export import export_run

        return export_run(self._run(), out, step, merge).directory

    # ------------------------------------------------------------------ internals
    def _run(self) -> Path:
        if self.run_dir is None:
            raise ConfigError("the trainer has not trained yet: call train() first")
        return self.run_dir

    def _prompts(self, source, which: str):
        """Entries from prompts in memory; a path goes into the config (None: the config's)."""
        from grpo_vision.prompts import prompt_entries

        if source is None:
            return None
        if isinstance(source, (str, Path)) and which != "prompts":
            setattr(self.cfg.data, f"{which}_prompts", str(source))
            return None
        return prompt_entries(source, column=self.cfg.data.column(which))

    def _rewards(self, rewards, weights) -> None:
        """reward.weights from `rewards`: functions registered under their names, names and specs checked."""
        from grpo_vision.rewards import is_registered, register_callable

        if not isinstance(rewards, Mapping):
            rewards = {r if isinstance(r, str) else getattr(r, "__name__", ""): r for r in rewards}
        if not rewards or "" in rewards or "<lambda>" in rewards:
            raise ConfigError("rewards: give at least one, and name each function: {'name': function}")
        if isinstance(weights, list):
            if len(weights) != len(rewards):
                raise ConfigError(f"reward_weights has {len(weights)} values for {len(rewards)} rewards")
            weights = dict(zip(rewards, weights))
        chosen = {}
        for name, reward in rewards.items():
            if callable(reward):
                register_callable(name, reward)
            elif not isinstance(reward, str) or reward != name and not reward.startswith("python:"):
                raise ConfigError(f"rewards[{name!r}]: give a function (images, prompts, metadata) -> scores, the "
                                  f"name of a registered reward, or python:module:function, not {brief(reward)}")
            elif not is_registered(reward):
                raise ConfigError(f"rewards[{name!r}]: {brief(reward)} is not a registered reward")
            key = reward if isinstance(reward, str) else name  # a python: spec is its own name, as in YAML
            chosen[key] = float((weights or {}).get(name, self.cfg.reward.weights.get(name, 1.0)))
        self.cfg.reward.weights = chosen

    def _options(self, options: dict) -> None:
        """TRL-named options as overrides, the mapping printed; gradient_accumulation_steps last (it needs the
        batch sizes the others may set)."""
        overrides, lines = trl_overrides({k: v for k, v in options.items() if k != "gradient_accumulation_steps"})
        for item in overrides:
            apply_override(self.cfg, item)
        if "gradient_accumulation_steps" in options:
            s = self.cfg.sample
            processes = int(os.environ.get("WORLD_SIZE", "1"))  # accelerate launch sets it for every process
            item, line = accumulation(int(options["gradient_accumulation_steps"]), self.cfg.train.micro_batch_size,
                                      s.prompts_per_step * s.group_size // processes)
            apply_override(self.cfg, item)
            lines.append(line)
        for line in lines:
            print(f"[trainer] {line}", flush=True)


def _config(config) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, Path)):
        return load_config(config)
    if isinstance(config, Mapping):
        return from_dict(Config, dict(config), where="GRPOTrainer config")
    raise ConfigError(f"config must be a YAML path, a mapping of sections or a Config, not {type(config).__name__}")


def _policy_config(policy, current: PolicyConfig) -> PolicyConfig:
    if isinstance(policy, PolicyConfig):
        return policy
    if isinstance(policy, Mapping):
        return from_dict(PolicyConfig, dict(policy), where="GRPOTrainer policy", prefix="policy.")
    if isinstance(policy, (str, Path)):
        current.path = str(policy)
        return current
    raise ConfigError(f"policy must be a Bundle, a path, a PolicyConfig or its mapping, not {type(policy).__name__}")

