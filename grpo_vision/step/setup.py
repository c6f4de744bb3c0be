"""Set-up: everything a run loads before its first step, on this process, in `RunState`. A bad input stops here,
named in one line, before the run folder is written (the config, the policy kind's files, the prompts, the
rewards, a resume's checkpoint); the memory estimate refuses a batch that cannot fit."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_vision.config import Config, ConfigError, GrpoVisionWarning, derived_sizes, format_sizes
from grpo_vision.models.adapters import merge_setting, merged_bytes
from grpo_vision.policy import Bundle, check_plan_template, check_planning, check_weighting_hooks
from grpo_vision.rewards import CompositeReward, RunModels, policy_readers
from grpo_vision.run.checkpoint import Resumed, base_identity, latest_checkpoint, load_training_state, resume_weights
from grpo_vision.run.distributed import load_optimizer_state, prepare
from grpo_vision.run.folder import record_other_base, refused_resume
from grpo_vision.run.health import DRIFT_WARN, RunHealth
from grpo_vision.run.lock import RunLock, RunLockedError, check_run_dir
from grpo_vision.run.machine import check_load, resolve_device, set_threads
from grpo_vision.run.memory import report_memory, resident_bytes
from grpo_vision.run.trackers import accelerator_options
from grpo_vision.sampling import SamplingParams, decode_mode, decode_note
from grpo_vision.splits import PromptSets, checked_prompt_sets
from grpo_vision.step.iterative import ReplayBuffer
from grpo_vision.step.load import load_policy
from grpo_vision.step.reference import Reference
from grpo_vision.step.update import EntropyControl, Learner, UpdateSettings


@dataclass
class RunState:  # everything set-up builds before the first step, on this process
    acc: object  # accelerate.Accelerator
    run_dir: Path
    params: SamplingParams  # the rollout's sampling settings
    update: UpdateSettings  # the update's loss, passes, minibatches and reference, fixed for the run
    bundle: Bundle  # the policy kind's policy, tokenizer, judge, reward defaults
    policy: torch.nn.Module  # the bundle's policy, peft-wrapped when train.adapter is set
    learner: Learner  # the prepared model, its optimizer and schedule, the health checks
    reference: Reference
    rewards: CompositeReward
    prompts: PromptSets  # train, and the two eval sets
    start: int  # the first step to run (0, or the resumed checkpoint's step)
    buffer: ReplayBuffer | None  # iterative RL with a learning reward: the samples it updates on
    base: dict  # the identity of the base files (run/checkpoint.py base_identity), kept in every checkpoint
    memory_estimate: int = 0  # bytes: run/memory.py's estimated peak, logged beside the measured one
    merge: bool = False  # sample.merge_adapter resolved: rollouts sample with the adapter folded into the weights
    lock: RunLock | None = None  # a resume's run lock, held from before its checkpoint was read (the main process)


def set_up(cfg: Config, resume: str | Path | None, given_bundle: Bundle | None = None,
           given_prompts: dict | None = None, allow_other_base: bool = False) -> RunState:
    """Load everything a run needs, or fail naming the problem before the run directory is written."""
    acc, run_dir, sizes, lock = open_run(cfg, resume)  # the processes; a folder in use (or already a run) refused
    try:
        return _set_up(cfg, resume, given_bundle, given_prompts, allow_other_base, acc, run_dir, sizes, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _set_up(cfg: Config, resume, given_bundle, given_prompts, allow_other_base: bool, acc, run_dir: Path,
            sizes: dict, lock) -> RunState:
    params, settings = SamplingParams.from_config(cfg.sample), UpdateSettings.from_config(cfg)
    before_load = (resident_bytes() or 0) if acc.device.type == "cpu" else 0  # the estimate's "runtime" part
    # the kind's files, its adapter and reference
    bundle, policy, reference = load_policy(cfg, acc.device, given_bundle, cfg.train.gradient_checkpointing)
    check_decode(acc, bundle.policy, params)
    check_weighting_hooks(cfg.train.token_weighting, cfg.policy.kind, bundle.policy, bundle.tokenizer)
    if cfg.sample.plan.enabled:
        check_planning(bundle.policy, cfg.policy.kind, cfg.sample.plan.max_tokens)
    if settings.drop_flat_groups and acc.num_processes > 1:  # each process would make a different number of updates
        raise ConfigError(f"train.zero_std_groups={cfg.train.zero_std_groups} runs on one process, and this run has "
                          f"{acc.num_processes}: use train.zero_std_groups=keep, or one process")
    trainable = [p for p in policy.parameters() if p.requires_grad]
    merge, unmerged = merge_setting(cfg, policy, acc)
    # before any sampling: a batch that cannot fit stops here, naming the knob to lower (auto's merge falls back to
    # unmerged sampling where only its copy of the weights does not fit, and says so)
    memory_estimate, fits = report_memory(policy, bundle.tokenizer, trainable, cfg, sizes["images_per_process"],
                                          params.guided, acc.device, acc.is_main_process, before_load,
                                          merged_bytes(policy) if merge else 0, cfg.sample.merge_adapter == "auto",
                                          judge_rows(cfg, sizes["images_per_process"]))
    if acc.is_main_process and cfg.sample.merge_adapter == "auto" and cfg.train.adapter != "none" and fits == merge:
        print("[train] sample.merge_adapter=auto: " + (f"merged ({cfg.train.adapter} on {acc.device})" if merge
                                                        else f"not merged ({unmerged})"), flush=True)
    merge = fits
    prompts = checked_prompt_sets(cfg, bundle, run_dir if resume else None, given_prompts)
    if cfg.sample.plan.enabled:  # the template read as the policy reads captions, around the longest prompt
        check_plan_template(bundle.policy, cfg.sample.plan.template,
                            [e.prompt for entries in (prompts.train, prompts.test, prompts.heldout) for e in entries])
    if cfg.train.zero_std_groups == "resample" and len(prompts.train) <= cfg.sample.prompts_per_step:
        raise ConfigError(f"train.zero_std_groups=resample replaces flat groups by prompts the step has not drawn, and "
                          f"the {len(prompts.train)} training prompts leave none beside sample.prompts_per_step="
                          f"{cfg.sample.prompts_per_step}: give more training prompts, or use train.zero_std_groups=drop")
    rewards = load_rewards(cfg, acc, bundle, prompts, reference.models(policy))  # a missing model stops here
    buffer = replay_buffer(cfg, bundle, rewards, reference)
    # a resume's checkpoint, checked against this run (train.steps, its base files, what it must hold), and its
    # weights loaded before accelerate shards them (FSDP); the optimizer's state after
    ckpt, base = latest_checkpoint(run_dir) if resume else None, base_identity(cfg.policy)
    resumed = resume_weights(ckpt, policy, cfg.train.steps, base, rewards.learners, allow_other_base) if ckpt else None
    learner = make_learner(cfg, acc, policy, trainable, sizes, resumed, ckpt)
    if resumed is not None:
        if resumed.reference is not None:
            reference.load_state_dict(policy, resumed.reference)
        if resumed.learned is not None:
            rewards.load_state_dict(resumed.learned["rewards"])
            if buffer is not None:
                buffer.load_state_dict(resumed.learned["buffer"])
    if resume and acc.is_main_process:
        print(f"[train] resuming from {ckpt}" if ckpt else f"[train] {run_dir} has no checkpoint yet: "
              "starting at step 0", flush=True)
        if resumed is not None and resumed.other_base:  # said with --allow-other-base: the run's log keeps it
            record_other_base(run_dir, resumed.step, resumed.other_base)
    return RunState(acc, run_dir, params, settings, bundle, policy, learner, reference, rewards, prompts,
                    resumed.step if resumed else 0, buffer, base, memory_estimate, merge, lock)



def open_run(cfg: Config, resume: str | Path | None) -> tuple[object, Path, dict, RunLock | None]:
    """The accelerator, the run folder (one in use, or on a fresh start already a run, refused before any model
    loads), the batch sizes per process and a resume's run lock; the threads set. A resume holds the lock from
    here: another train that took the run while this one loaded would have moved it past the checkpoint this one
    reads, and the folder is written only by its holder. A fresh start takes it once loaded (train.py), so that a
    bad input leaves no folder behind."""
    from accelerate import Accelerator

    device = resolve_device(cfg.run.device)
    run_dir = Path(resume) if resume else Path(cfg.run.out_dir) / cfg.run.name
    acc = Accelerator(cpu=device == "cpu", mixed_precision=cfg.train.mixed_precision,
                      **accelerator_options(cfg, run_dir))  # log.trackers: started by train() once the folder is ours
    sizes = derived_sizes(cfg, acc.num_processes)
    try:
        check_run_dir(run_dir, fresh=not resume)
        acc.wait_for_everyone()  # every process has looked before the main one writes anything there
        lock = RunLock(run_dir, fresh=False) if resume and acc.is_main_process else None
    except RunLockedError as e:
        if not resume:
            raise
        raise RunLockedError(refused_resume(run_dir, e.holder, cfg), e.holder) from None
    threads = set_threads(cfg.run.threads, acc.num_processes)
    if acc.is_main_process:
        print(f"[train] run directory {run_dir}\n[train] sizes: {format_sizes(sizes)}  threads={threads}", flush=True)
        if busy := check_load():
            warnings.warn(busy, GrpoVisionWarning, stacklevel=3)
    return acc, run_dir, sizes, lock


def check_decode(acc, policy, params: SamplingParams) -> None:
    """A decode path this policy or device cannot run, refused before the run folder is written; a path slower than
    it sounds, or a first step longer than the others, said."""
    try:
        decode_mode(policy, params.decode, acc.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if acc.is_main_process and (note := decode_note(params.decode, acc.device)):
        print(f"[train] {note}", flush=True)


def load_rewards(cfg: Config, acc, bundle: Bundle, prompts: PromptSets, models: RunModels | None = None
                 ) -> CompositeReward:
    """The run's rewards with their models loaded, checked against every prompt set they will score; `models`: the
    run's own networks, for a reward that scores with them (self_judge)."""
    rewards = CompositeReward.from_config(cfg.reward, acc.device, bundle.reward_defaults, prompts.all(), models)
    rewards.load()
    rewards.check({"training": prompts.train, **prompts.named()})
    return rewards


def judge_rows(cfg: Config, images: int) -> int:
    """Images per understanding forward of a reward that judges with the run's own network (self_judge), for the
    memory estimate: reward.batch_size, or a step's `images` where fewer; 0 without such a reward."""
    return min(cfg.reward.batch_size, images) if policy_readers(cfg) else 0


def replay_buffer(cfg: Config, bundle: Bundle, rewards: CompositeReward, reference: Reference) -> ReplayBuffer | None:
    """Iterative RL with a reward that learns: the buffer of samples it learns from between iterations."""
    t = cfg.train
    if t.iterations > 1 and rewards.learners:
        needs = [n for n in rewards.learners if getattr(rewards.fns[n], "needs_judge", False)]
        if needs and bundle.judge is None:
            raise ConfigError(f"reward {needs[0]!r} learns from a judge's verdicts between iterations, and policy "
                              f"kind {cfg.policy.kind!r} has no judge: train on another reward, or set "
                              "train.iterations=1 (it then scores without learning)")
        return ReplayBuffer(cfg.reward.replay_capacity)
    if t.iterations > 1 and reference.mode == "none":
        warnings.warn(f"train.iterations={t.iterations} does nothing here: there is no reference to reset "
                      "(train.reference: none) and no reward that learns", GrpoVisionWarning, stacklevel=3)
    return None


def make_learner(cfg: Config, acc, policy, trainable: list, sizes: dict, resumed: Resumed | None,
                 ckpt: Path | None) -> Learner:
    """The policy prepared by accelerate (DDP / FSDP), its AdamW and schedule (a resume's states loaded into
    them) and the health checks (a resume's counters)."""
    t = cfg.train
    optimizer = torch.optim.AdamW(trainable, lr=t.lr, betas=tuple(t.adam_betas), weight_decay=t.weight_decay)
    model, optimizer = prepare(acc, policy, optimizer, t.adapter)
    trainable = [p for p in model.parameters() if p.requires_grad]  # FSDP replaces them with sharded ones
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: lr_factor(u, cfg, sizes["total_updates"]))
    if resumed is not None:
        load_training_state(ckpt, optimizer, scheduler,
                            lambda opt_state: load_optimizer_state(model, optimizer, opt_state))
        apply_settings(optimizer, scheduler, cfg)
    low_precision = t.mixed_precision != "no" or cfg.policy.dtype != "float32"
    health = RunHealth(resumed.counters if resumed else None, t.max_skipped_updates, loud=acc.is_main_process,
                       drift_limit=DRIFT_WARN["low_precision" if low_precision else "float32"])
    entropy = None
    if t.use_adaptive_entropy:
        entropy = EntropyControl(t.entropy_coef, t.entropy_target, t.entropy_coef_delta, t.entropy_coef_min,
                                 t.entropy_coef_max)
        if resumed is not None and resumed.entropy is not None:
            entropy.load(resumed.entropy)
    return Learner(model, trainable, optimizer, scheduler, acc, health, entropy)


def apply_settings(optimizer, scheduler, cfg: Config) -> None:
    """The config's lr, betas and weight decay over a checkpoint's: torch's Optimizer.load_state_dict restores each
    param group's hyperparameters and LambdaLR's its base_lrs, so a resume's train.lr=... was written to config.yaml
    and never trained with. The lr is LambdaLR's own `base_lr * lambda(last_epoch)`: the same float an unchanged
    resume read back, so such a resume stays exact."""
    t = cfg.train
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(initial_lr=t.lr, lr=t.lr * factor(scheduler.last_epoch), betas=tuple(t.adam_betas),
                     weight_decay=t.weight_decay)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports until a step


def lr_factor(update: int, cfg: Config, total_updates: int) -> float:
    """Warmup then constant / cosine / linear decay, in optimizer updates."""
    t = cfg.train
    if update < t.warmup_steps:
        return (update + 1) / t.warmup_steps
    frac = (update - t.warmup_steps) / max(1, total_updates - t.warmup_steps)
    return {"constant": 1.0, "cosine": 0.5 * (1 + math.cos(math.pi * frac)), "linear": 1 - frac}[t.lr_schedule]
