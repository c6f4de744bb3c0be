"""GRPO training: one loop, read top to bottom. SAMPLING -> REWARD -> ADVANTAGE -> UPDATE -> LOG, and
with train.iterations > 1 an ITERATION boundary before some steps (iterative.py).

All randomness of a step is derived from (run.seed, step): which prompts, each image's sampling seed
and the update order. A resumed run therefore continues exactly: it only needs the weights, the
optimizer and scheduler state and the step, which every checkpoint holds.

Processes (accelerate) each take whole groups; rewards are gathered so that every process computes
the same advantages as a one-process run. The policy and its optimizer are prepared by accelerate:
DDP averages gradients before each optimizer update, or FSDP shards them (distributed.py).
"""

from __future__ import annotations

import math
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from grpo_vision.checkpoint import (
    CheckpointError, latest_checkpoint, load_checkpoint, load_iterative_state, load_training_state, save_checkpoint,
)
from grpo_vision.config import Config, ConfigError, derived_sizes, format_sizes, save_config
from grpo_vision.distributed import (
    full_state_dict, full_weights, is_fsdp, load_optimizer_state, optimizer_state, prepare, trainable_weights,
)
from grpo_vision.grpo import frac_zero_std, group_advantages, normalize_then_sum
from grpo_vision.health import DRIFT_WARN, NonFiniteWeightsError, RunHealth
from grpo_vision.iterative import ReplayBuffer, iteration_of, starts_iteration, update_rewards
from grpo_vision.machine import check_load, set_threads
from grpo_vision.memory import report_memory
from grpo_vision.metrics import MetricsLogger, nanmean, nanstd
from grpo_vision.policies import Bundle, PromptSets, checked_prompt_sets, load_bundle, resolve_device
from grpo_vision.prompts import save_prompts
from grpo_vision.reference import Reference, add_adapter
from grpo_vision.rewards import CompositeReward, RewardError
from grpo_vision.run_folder import read_run_config, save_origin
from grpo_vision.run_folder import resume_command
from grpo_vision.runlock import RunLock, check_run_dir
from grpo_vision.sampling import SamplingParams, sample_batched
from grpo_vision.signals import GracefulStop, Interrupted
from grpo_vision.update import StepBatch, old_logprobs, reference_logprobs, update


def step_seed(seed: int, step: int, salt: int) -> int:
    return int(np.random.default_rng([seed, step, salt]).integers(2**62))


@dataclass
class RunState:  # everything set-up builds before the first step, on this process
    acc: object  # accelerate.Accelerator
    run_dir: Path
    params: SamplingParams  # the rollout's sampling settings
    bundle: Bundle  # the policy kind's policy, tokenizer, judge, reward defaults
    policy: torch.nn.Module  # the bundle's policy, peft-wrapped when train.adapter is set
    model: torch.nn.Module  # the policy as accelerate prepared it (DDP / FSDP): the update's forward passes
    trainable: list[torch.Tensor]  # parameters the optimizer updates
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    reference: Reference
    rewards: CompositeReward
    prompts: PromptSets  # train, and the two eval sets
    start: int  # the first step to run (0, or the resumed checkpoint's step)
    counters: dict  # RunHealth's counters, checkpointed
    buffer: ReplayBuffer | None  # iterative RL with a learning reward: the samples it updates on


def set_up(cfg: Config, resume: str | Path | None) -> RunState:
    """Load everything a run needs, or fail naming the problem before the run directory is written."""
    from accelerate import Accelerator

    device = resolve_device(cfg.run.device)
    acc = Accelerator(cpu=device == "cpu", mixed_precision=cfg.train.mixed_precision)
    sizes = derived_sizes(cfg, acc.num_processes)
    run_dir = Path(resume) if resume else Path(cfg.run.out_dir) / cfg.run.name
    check_run_dir(run_dir, fresh=not resume)  # in use, or (fresh start) already a run: refused before loading
    acc.wait_for_everyone()  # every process has looked before the main one writes anything there
    main = acc.is_main_process
    threads = set_threads(cfg.run.threads, acc.num_processes)
    if main:
        print(f"[train] run directory {run_dir}\n[train] sizes: {format_sizes(sizes)}  threads={threads}", flush=True)
        if busy := check_load():
            warnings.warn(busy, stacklevel=2)
    t = cfg.train
    params = SamplingParams.from_config(cfg.sample)
    bundle = load_bundle(cfg.policy, acc.device)
    policy = bundle.policy
    if t.gradient_checkpointing:
        if not hasattr(policy, "gradient_checkpointing_enable"):
            raise ConfigError(f"policy kind {cfg.policy.kind!r} cannot recompute activations: set "
                              "train.gradient_checkpointing=false")
        policy.gradient_checkpointing_enable()
    if t.adapter != "none":
        policy = add_adapter(policy, t.adapter, t.adapter_rank, t.adapter_alpha, t.adapter_targets)
    reference = Reference(policy, t.reference, load_base=lambda: load_bundle(cfg.policy, acc.device).policy)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    # before any sampling: a batch that cannot fit stops here, naming the knob to lower
    report_memory(policy, bundle.tokenizer, trainable, cfg, sizes["images_per_process"], params.guided, acc.device,
                  main)
    optimizer = torch.optim.AdamW(trainable, lr=t.lr, betas=tuple(t.adam_betas), weight_decay=t.weight_decay)
    prompts = checked_prompt_sets(cfg, bundle, run_dir if resume else None)
    rewards = CompositeReward.from_config(cfg.reward, acc.device, bundle.reward_defaults, prompts.all())
    rewards.load()  # a missing or corrupt reward model stops the run here, before its folder is written
    buffer = None
    if t.iterations > 1 and rewards.learners:
        needs = [n for n in rewards.learners if getattr(rewards.fns[n], "needs_judge", False)]
        if needs and bundle.judge is None:
            raise ConfigError(f"reward {needs[0]!r} learns from a judge's verdicts between iterations, and policy "
                              f"kind {cfg.policy.kind!r} has no judge: train on another reward, or set "
                              "train.iterations=1 (it then scores without learning)")
        buffer = ReplayBuffer(cfg.reward.replay_capacity)
    elif t.iterations > 1 and reference.mode == "none":
        warnings.warn(f"train.iterations={t.iterations} does nothing here: there is no reference to reset "
                      "(train.reference: none) and no reward that learns", stacklevel=2)
    start, counters, ckpt = 0, {"skipped_updates": 0}, latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:  # weights before accelerate shards them (FSDP); the optimizer's state after
        state, ref_state = load_checkpoint(ckpt, policy)
    model, optimizer = prepare(acc, policy, optimizer, t.adapter)
    trainable = [p for p in model.parameters() if p.requires_grad]  # FSDP replaces them with sharded ones
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: lr_factor(u, cfg, sizes["total_updates"]))
    if ckpt is not None:
        load_training_state(ckpt, optimizer, scheduler,
                            lambda opt_state: load_optimizer_state(model, optimizer, opt_state))
        if ref_state is not None:
            reference.load_state_dict(policy, ref_state)
        start, counters = state["step"], state["counters"]
        learned = load_iterative_state(ckpt)
        if buffer is not None and learned is None and start:
            raise CheckpointError(f"{ckpt} has no iterative.safetensors, which this run's learning rewards "
                                  f"({', '.join(rewards.learners)}) need to resume exactly: resume with the "
                                  "config that wrote it")
        if learned is not None:
            rewards.load_state_dict(learned["rewards"])
            if buffer is not None:
                buffer.load_state_dict(learned["buffer"])
    if resume and main:
        print(f"[train] resuming from {ckpt}" if ckpt else f"[train] {run_dir} has no checkpoint yet: "
              "starting at step 0", flush=True)
    return RunState(acc, run_dir, params, bundle, policy, model, trainable, optimizer, scheduler, reference,
                    rewards, prompts, start, counters, buffer)


def train(cfg: Config, resume: str | Path | None = None, progress: bool = True) -> Path:
    # ------------------------------------------------------------------ set-up
    st = set_up(cfg, resume)
    acc, run_dir, params, policy, reference, rewards = st.acc, st.run_dir, st.params, st.policy, st.reference, st.rewards
    tokenizer, optimizer, scheduler, counters, start = st.bundle.tokenizer, st.optimizer, st.scheduler, st.counters, st.start
    train_prompts = st.prompts.train
    s, t, main = cfg.sample, cfg.train, acc.is_main_process
    lock = RunLock(run_dir, fresh=not resume) if main else None  # one run per directory, until train returns
    if main:  # only once everything has loaded, so a bad override never reaches the run's config
        save_config(cfg, run_dir / "config.yaml")
        save_origin(run_dir)  # what the config's relative paths are relative to: eval RUN works from anywhere
        for name, entries in (("train", train_prompts), *st.prompts.scored().items()):  # the split, fixed in the run
            save_prompts(entries, run_dir / "prompts" / f"{name}.jsonl", root=run_dir)
    logger = MetricsLogger(run_dir, start, cfg.log.tensorboard) if main else None
    bar = tqdm(range(start, t.steps), initial=start, total=t.steps, desc="grpo", disable=not (progress and main))

    def checkpoint(step: int) -> None:
        weights = opt_state = None
        if main or is_fsdp(st.model):  # FSDP gathers the shards with every process; DDP copies on the main one
            weights, opt_state = trainable_weights(st.model), optimizer_state(st.model, optimizer)
        if main:
            learned = None if st.buffer is None else {"buffer": st.buffer.state_dict(), "rewards": rewards.state_dict()}
            save_checkpoint(run_dir, step, policy, optimizer, scheduler, reference.state_dict(policy),
                            {"counters": counters}, learned, weights=weights, optimizer_state=opt_state)
        acc.wait_for_everyone()

    def sync_reference() -> None:  # a frozen copy takes every weight whole, gathered from FSDP's shards
        reference.sync(policy, full_state_dict(st.model) if reference.mode == "frozen" else None)

    low_precision = t.mixed_precision != "no" or cfg.policy.dtype != "float32"
    health = RunHealth(counters, t.max_skipped_updates, loud=main,
                       drift_limit=DRIFT_WARN["low_precision" if low_precision else "float32"])
    stop = GracefulStop()
    step = start
    try:
        for step in bar:
            t0 = time.perf_counter()
            # ---------------------------------------------------------- ITERATION (iterative RL only)
            # Before the first step of each later iteration: a new anchor, and the rewards that learn update.
            iteration, index = {}, iteration_of(step, t.steps, t.iterations)
            if starts_iteration(step, t.steps, t.iterations):
                if reference.mode != "none":
                    sync_reference()
                # not again after a checkpoint saved past it (a reward that failed later in the step)
                if st.buffer is not None and st.buffer.iteration < index:
                    replay_rng = np.random.default_rng([cfg.run.seed, step, 3])
                    with full_weights(st.model):  # the decoder may be part of the sharded policy (Janus)
                        iteration = update_rewards(rewards, st.buffer, tokenizer, st.bundle.judge,
                                                   cfg.reward.replay_fraction, replay_rng, s.batch_size, acc.device)
            # ---------------------------------------------------------- SAMPLING
            # Every process draws the same global prompt list and keeps its own whole groups.
            rng = np.random.default_rng([cfg.run.seed, step])
            chosen = rng.choice(len(train_prompts), s.prompts_per_step, replace=len(train_prompts) < s.prompts_per_step)
            per_proc = s.prompts_per_step // acc.num_processes
            mine = chosen[acc.process_index * per_proc:(acc.process_index + 1) * per_proc]
            entries = [train_prompts[i] for i in mine for _ in range(s.group_size)]
            prompts = [e.prompt for e in entries]
            first = acc.process_index * per_proc * s.group_size  # global index of this process's first image
            seeds = [step_seed(cfg.run.seed, step, first + j) for j in range(len(prompts))]
            policy.eval()
            cond = policy.encode_prompts(prompts)  # [n, L]
            with full_weights(st.model):  # decoding too: Janus's VQ decoder is part of the sharded policy
                rollout = sample_batched(policy, cond, seeds, params, s.batch_size)
                t_sample = time.perf_counter() - t0
                with torch.no_grad():
                    images = torch.cat([tokenizer.decode(rollout.tokens[i:i + s.batch_size])
                                        for i in range(0, len(prompts), s.batch_size)])  # [n, 3, H, W]
            t_decode = time.perf_counter() - t0 - t_sample
            # ---------------------------------------------------------- REWARD
            t1 = time.perf_counter()
            out = rewards(images, prompts, [e.metadata for e in entries], [e.rewards for e in entries])
            total = acc.gather(out.total.to(acc.device)).cpu()  # [B*G] global, in group order
            raw = {k: acc.gather(v.to(acc.device)).cpu() for k, v in out.raw.items()}
            weights = {k: acc.gather(v.to(acc.device)).cpu() for k, v in out.weights.items()}
            if cfg.reward.combine == "normalize_then_sum":
                total = normalize_then_sum(torch.stack([raw[k] for k in rewards.names], 1),
                                           torch.stack([weights[k] for k in rewards.names], 1), s.group_size)
            t_reward = time.perf_counter() - t1
            # ---------------------------------------------------------- ADVANTAGE
            t1 = time.perf_counter()
            adv_all = group_advantages(total, s.group_size, t.adv_scale)  # [B*G], identical on every process
            n = len(prompts)
            adv = adv_all[first:first + n].to(acc.device)
            old = old_logprobs(policy, cond, rollout, params, acc, t.micro_batch_size)
            with acc.autocast():  # the update's precision, so that the KL at step 0 is exactly 0
                ref = reference_logprobs(policy, reference, cond, rollout.tokens, params, t)
            batch = StepBatch(cond, rollout.tokens, rollout.logprobs, old, ref, adv, rollout.entropy)
            t_logprobs = time.perf_counter() - t1
            # ---------------------------------------------------------- UPDATE
            policy.train()
            t1 = time.perf_counter()
            losses = update(st.model, st.trainable, optimizer, scheduler, batch, params, cfg, acc, step, health,
                            lambda salt: step_seed(cfg.run.seed, step, salt))
            t_update = time.perf_counter() - t1
            if reference.mode != "none" and t.ref_sync_every and (step + 1) % t.ref_sync_every == 0:
                sync_reference()
            # the step's samples join the buffer once it is done (the last iteration's would never be used)
            if st.buffer is not None and index < t.iterations - 1:
                global_entries = [train_prompts[i] for i in chosen for _ in range(s.group_size)]
                st.buffer.add(acc.gather(rollout.tokens.to(acc.device)).cpu(), global_entries)
            # ---------------------------------------------------------- LOG / CHECKPOINT
            metrics = {f"reward/{k}/mean": nanmean(v) for k, v in raw.items()}
            metrics |= {f"reward/{k}/std": nanstd(v) for k, v in raw.items()}
            metrics |= {f"reward/{k}/frac_zero_std": frac_zero_std(v, s.group_size) for k, v in raw.items()}
            spread = frac_zero_std(total, s.group_size)
            metrics |= {"reward/total/mean": nanmean(total), "reward/total/std": nanstd(total),
                        "adv/frac_zero_std": spread, **losses,
                        **health.after_rewards(step, total, raw, weights, spread),
                        "policy/entropy": acc.reduce(rollout.entropy.mean().to(acc.device), "mean").item(),
                        "perf/step_s": time.perf_counter() - t0, "perf/sample_s": t_sample, "perf/decode_s": t_decode,
                        "perf/reward_s": t_reward, "perf/logprobs_s": t_logprobs, "perf/update_s": t_update,
                        "perf/sample_tokens_per_s": n * policy.num_image_tokens / t_sample,
                        "lr": scheduler.get_last_lr()[0], **iteration}
            if t.iterations > 1:
                metrics["iteration"] = index + 1
            if main:
                logger.log(step + 1, metrics)
                bar.set_postfix(reward=f"{metrics['reward/total/mean']:.3f}", kl=f"{metrics['loss/kl']:.4f}")
            if cfg.log.sample_every and ((step + 1) % cfg.log.sample_every == 0 or step == start):
                with full_weights(st.model):  # every process: FSDP gathers the shards together
                    if main:
                        from grpo_vision.evaluate import save_sample_grid
                        save_sample_grid(policy, reference, tokenizer, st.prompts.test[:4] + train_prompts[:4],
                                         params, run_dir / "samples" / f"step_{step + 1:06d}.png",
                                         judge=st.bundle.judge, root=run_dir)
            if signum := stop.agreed(acc):
                checkpoint(step + 1)
                print(f"\n[train] stopped by {signal.Signals(signum).name}: saved a checkpoint at step {step + 1}; "
                      f"continue with: {resume_command(run_dir, cfg, st.prompts.all())}", file=sys.stderr)
                raise Interrupted(signum)
            if health.too_many_skipped():  # skipped updates leave the weights as the last applied one made them
                checkpoint(step + 1)
                raise health.stuck(step + 1, run_dir)
            if cfg.log.checkpoint_every and (step + 1) % cfg.log.checkpoint_every == 0:
                checkpoint(step + 1)
        step = t.steps
        checkpoint(step)
    except RewardError as e:
        saved = "no step had finished, nothing was saved: the same command starts again"
        if step:  # at step 0 a checkpoint would hold the starting weights and make the folder refuse a fresh start
            checkpoint(step)
            saved = f"checkpoint saved at step {step} in {run_dir}"
        raise RewardError(e.name, f"{e.message} ({saved})") from e
    except NonFiniteWeightsError as e:  # no checkpoint: it would hold the broken weights
        last = latest_checkpoint(run_dir)
        raise NonFiniteWeightsError(f"{e}; the last checkpoint, {last}, holds finite weights" if last else
                                    f"{e}; no checkpoint was saved before it") from e
    else:  # still under the lock: the report is part of the run
        stop.at_once()  # no step is left to finish: a signal now stops at once
        if cfg.log.report:
            write_report(st, cfg, stop)
    finally:
        stop.restore()
        if logger:
            logger.close()
        if lock:
            lock.release()
    return run_dir


def write_report(st: RunState, cfg: Config, stop: GracefulStop) -> None:
    """The final report; a signal while it is written (or since the last step) stops it, saying that the
    training itself finished and how to write the report again."""
    from grpo_vision.report import final_report

    try:
        if signum := stop.agreed(st.acc):  # every process, or one would wait in full_weights for the others
            raise Interrupted(signum)
        with full_weights(st.model):  # every process: FSDP gathers the shards together
            if st.acc.is_main_process:
                final_report(st.run_dir, st.policy, st.reference, st.bundle.tokenizer, st.rewards, st.prompts,
                             st.params, cfg, st.bundle.judge)
    except Interrupted as e:
        print(f"\n[train] stopped by {signal.Signals(e.signum).name} while writing the report; the training finished "
              f"(checkpoint at step {cfg.train.steps}): {resume_command(st.run_dir, cfg, st.prompts.all())} writes the "
              "report", file=sys.stderr, flush=True)
        raise


def lr_factor(update: int, cfg: Config, total_updates: int) -> float:
    """Warmup then constant / cosine / linear decay, in optimizer updates."""
    t = cfg.train
    if update < t.warmup_steps:
        return (update + 1) / t.warmup_steps
    frac = (update - t.warmup_steps) / max(1, total_updates - t.warmup_steps)
    return {"constant": 1.0, "cosine": 0.5 * (1 + math.cos(math.pi * frac)), "linear": 1 - frac}[t.lr_schedule]


def resume_config(run_dir: str | Path, overrides: list[str]) -> Config:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"cannot resume: {path} not found (is {run_dir} a run directory?)")
    return read_run_config(run_dir, overrides)  # its relative paths resolved, from any directory
