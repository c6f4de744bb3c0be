"""Load what a run needs from config: the policy, its image tokenizer, and the prompt sets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_vision.config import Config, ConfigError, PolicyConfig
from grpo_vision.policy import prompt_problem
from grpo_vision.prompts import PromptEntry, PromptsError, load_prompts

WORLD_TRAIN_PROMPTS = 512  # captions of data.world_train_split a ShapesWorld run trains on (minus eval prompts)
WORLD_EVAL_PROMPTS = 32  # held-out-composition captions it is evaluated on


@dataclass
class Bundle:
    policy: torch.nn.Module  # an ImagePolicy
    tokenizer: torch.nn.Module  # an ImageTokenizer
    world: Path | None  # the ShapesWorld directory, when the policy comes from one


def load_bundle(pcfg: PolicyConfig, device) -> Bundle:
    if pcfg.kind == "shapes":
        from grpo_vision.shapes.world import load_world

        world = load_world(pcfg.path, device)
        return Bundle(world.policy, world.tokenizer, world.path)
    if pcfg.kind == "janus":
        from grpo_vision.janus_policy import JanusImagePolicy

        if pcfg.tokenizer:
            raise ConfigError("policy.tokenizer is not used with policy.kind 'janus': its VQ model is part of the "
                              "Janus checkpoint in policy.path; leave policy.tokenizer empty")
        policy = JanusImagePolicy.from_pretrained(pcfg.path, device, pcfg.dtype)
        return Bundle(policy, policy.image_tokenizer(), None)  # the tokenizer shares the policy's VQ model
    from grpo_vision.llama_policy import LlamaImagePolicy
    from grpo_vision.tokenizer import VQTokenizer

    if not pcfg.tokenizer:
        raise ConfigError("policy.kind 'llama' needs policy.tokenizer: the directory of its VQ tokenizer")
    policy = LlamaImagePolicy.from_pretrained(pcfg.path, device).to(getattr(torch, pcfg.dtype))
    return Bundle(policy, VQTokenizer.from_pretrained(pcfg.tokenizer, device), None)


def train_and_eval_prompts(cfg: Config, bundle: Bundle) -> tuple[list[PromptEntry], list[PromptEntry]]:
    """Prompts files from `data.*`, or the world's seen / held-out captions by default."""
    if bundle.world is None and not (cfg.data.train_prompts and cfg.data.eval_prompts):
        which = "train" if not cfg.data.train_prompts else "eval"
        raise ConfigError(f"data.{which}_prompts is required when the policy does not come from a ShapesWorld "
                          "(policy.kind 'shapes')")
    d = cfg.data
    train, evals = prompt_lists(cfg)
    for entries, source in ((train, d.train_prompts or "world"), (evals, d.eval_prompts or "world")):
        for e in entries:  # fail before training starts, naming the prompt and its line: an unknown word
            problem = prompt_problem(bundle.policy, e.prompt)  # would be trained on as <unk>
            if problem:
                raise PromptsError(f"{source}, line {e.line}: {problem}")
    return train, evals


def prompt_lists(cfg: Config) -> tuple[list[PromptEntry], list[PromptEntry]]:
    """A run's training and eval prompts, as train_and_eval_prompts gives them, without loading a
    model (world captions are assumed where no file is given)."""
    from grpo_vision.shapes.scene import prompt_list

    d = cfg.data
    evals = (load_prompts(d.eval_prompts) if d.eval_prompts else
             [PromptEntry(p) for p in prompt_list("heldout", WORLD_EVAL_PROMPTS, cfg.run.seed + 1)])
    if d.train_prompts:
        return load_prompts(d.train_prompts), evals
    unseen = {e.prompt for e in evals}  # eval prompts are never trained on
    train = [PromptEntry(p) for p in prompt_list(d.world_train_split, WORLD_TRAIN_PROMPTS, cfg.run.seed)]
    return [e for e in train if e.prompt not in unseen], evals
