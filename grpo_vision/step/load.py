"""Loading a run's models: the policy kind's bundle, the policy with its adapter and the reference, built by one
function (`load_policy`) for training's set-up (step/setup.py) and for every command that reads a run folder
(`load_run`: eval, sample, export, report, the demo and the matrix); `load_for_eval` adds the run's rewards and the
sets it is scored on."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from grpo_vision.config import Config, ConfigError, GrpoVisionWarning
from grpo_vision.models.adapters import add_adapter
from grpo_vision.policy import Bundle, check_prompts, load_bundle
from grpo_vision.prompts import PromptEntry
from grpo_vision.rewards import CompositeReward, check_rewards
from grpo_vision.rollouts import EVAL_SEED, check_seeds
from grpo_vision.run.checkpoint import (
    base_identity, check_base, find_checkpoint, load_checkpoint, load_iterative_state, recorded_base,
)
from grpo_vision.run.folder import read_run_config, refuse_code
from grpo_vision.run.machine import resolve_device
from grpo_vision.splits import run_prompt_sets
from grpo_vision.step.reference import Reference


def load_policy(cfg: Config, device, given: Bundle | None = None, recompute: bool = False
                ) -> tuple[Bundle, torch.nn.Module, Reference]:
    """The policy kind's bundle (or a script's, moved to `device`), the policy with train.adapter added (its random
    factors drawn from run.seed: two runs of one script start alike), and its reference; `recompute`: activations
    recomputed in the backward pass (train.gradient_checkpointing). Training's set-up and every command that reads a
    run (load_run) build the policy here."""
    t = cfg.train
    bundle = given or load_bundle(cfg.policy, device)
    if given is not None:  # a script's policy, loaded wherever it was: onto this process's device
        for part in (bundle.policy, bundle.tokenizer):
            if isinstance(part, torch.nn.Module):
                part.to(device)
    policy = bundle.policy
    if recompute:
        if not hasattr(policy, "gradient_checkpointing_enable"):
            raise ConfigError(f"policy kind {cfg.policy.kind!r} cannot recompute activations: set "
                              "train.gradient_checkpointing=false")
        policy.gradient_checkpointing_enable()
    if t.adapter != "none":
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
            torch.manual_seed(cfg.run.seed)
            policy = add_adapter(policy, t.adapter, t.adapter_rank, t.adapter_alpha, t.adapter_targets)
    reference = Reference(policy, t.reference, load_base=lambda: load_bundle(cfg.policy, device).policy)
    return bundle, policy, reference


@dataclass
class LoadedRun:  # a run's checkpoint loaded for reading: eval, sample, export, the demo, the matrix, report
    cfg: Config  # the settings in force at `step` (run/resumes.py)
    bundle: Bundle
    policy: torch.nn.Module  # with the checkpoint's weights (peft-wrapped if the run trained an adapter)
    reference: Reference
    step: int
    learned_rewards: dict | None = None  # iterative RL: what learning rewards had learned by this checkpoint
    other_base: str | None = None  # how policy.path / policy.tokenizer differ from the trained-on files (allowed)


def load_run(run_dir: str | Path, step: int | None = None, device: str = "run",
             allow_other_base: bool = False) -> LoadedRun:
    """A run's checkpoint (the latest, or `step`) on `device` (a --device value; "run": the run's own
    where this machine has it, else the best one here). Loads no reward: no code the run folder names runs.
    Refuses base files other than those the checkpoint was trained from, unless `allow_other_base`."""
    run_dir = Path(run_dir)
    read_run_config(run_dir, device=device)  # not a run folder: said before its checkpoints are looked for
    ckpt = find_checkpoint(run_dir, step)  # named step_NNNNNN
    # the settings that trained this checkpoint: a later resume may have changed its plan (run/resumes.py)
    cfg = read_run_config(run_dir, device=device, step=int(ckpt.name.removeprefix("step_")))
    other = check_base(ckpt / "trainer_state.json", recorded_base(ckpt), base_identity(cfg.policy), allow_other_base)
    if other:
        warnings.warn(f"--allow-other-base: {other}", GrpoVisionWarning, stacklevel=2)
    bundle, policy, reference = load_policy(cfg, resolve_device(cfg.run.device, "--device"))
    state, ref_state = load_checkpoint(ckpt, policy)
    if ref_state is not None:
        reference.load_state_dict(policy, ref_state)
    learned = load_iterative_state(ckpt)
    return LoadedRun(cfg, bundle, policy.eval(), reference, state["step"], learned["rewards"] if learned else None,
                     other)


def load_for_eval(run_dir: str | Path, step: int | None = None, seed: int = EVAL_SEED, n: int | None = None,
                  device: str = "run", sets: dict[str, list[PromptEntry]] | None = None, draw: int = 1,
                  trust: bool = False, rewards: Sequence[str] = (), source: Callable[[str], str] | None = None,
                  allow_other_base: bool = False) -> tuple[LoadedRun, CompositeReward, dict[str, list[PromptEntry]]]:
    """A run loaded to be measured, as evaluation/evaluate.py's `evaluate_run` takes its arguments: the checkpoint
    (load_run), its rewards (with what a learning reward had learned by then) and the sets to score (the run's own by
    default: splits.run_prompt_sets), each checked before any image is drawn."""
    cfg = read_run_config(run_dir, device=device)
    own = sets is None
    if own:
        drawn = run_prompt_sets(cfg, run_dir, draw=draw)
        sets = drawn.scored() if draw == 1 else drawn.named()
    entries = [e for v in sets.values() for e in v]
    # the run's own prompts are the run folder's, and may name rewards too; prompts given here are the user's own
    refuse_code(cfg, entries if own else [], run_dir, trust)
    check_rewards(cfg, run_dir, entries, rewards, trust)
    check_seeds(seed, max(map(len, sets.values()), default=1), n or cfg.log.eval_images)
    run = load_run(run_dir, step, device, allow_other_base)
    where = source or (lambda name: name)
    check_prompts(run.policy, ((f"{where(name)}, line {e.line}", e.prompt) for name, v in sets.items() for e in v))
    used = next(run.policy.parameters()).device
    scorer = CompositeReward.from_config(run.cfg.reward, used, run.bundle.reward_defaults, entries,
                                         run.reference.models(run.policy)).load()  # a self_judge judges as in training
    if run.learned_rewards:  # a reward that learned (clip_refit) scores as it had learned by this step
        scorer.load_state_dict(run.learned_rewards)
    return run, scorer, sets
