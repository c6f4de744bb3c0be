"""GRPO training: one loop, read top to bottom. SAMPLING -> REWARD -> ADVANTAGE -> UPDATE -> LOG, and
with train.iterations > 1 an ITERATION boundary before some steps (iterative.py).

Each phase is a function below `train()`, and each hands the next one a typed container: `Samples`
(this process's images of the step) -> `Scored` (every reward, gathered; both from rollouts.py, which every
measurement shares) -> `UpdateBatch` (update.py).
docs/architecture.md draws the data flow and lists the invariants.

All randomness of a step is derived from (run.seed, step) and a salt (seeds.py): which prompts, each
image's sampling seed and the update order. A resumed run therefore continues exactly: it only needs
the weights, the optimizer and scheduler state and the step, which every checkpoint holds.

Processes (accelerate) each take whole groups; rewards are gathered so that every process computes
the same advantages as a one-process run. The policy and its optimizer are prepared by accelerate:
DDP averages gradients before each optimizer update, or FSDP shards them (run/distributed.py).
"""

from __future__ import annotations

import math
import signal
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from grpo_vision.config import Config, ConfigError, brief, derived_sizes, format_sizes, save_config
from grpo_vision.grpo import frac_zero_std, group_advantages, group_std, normalize_then_sum
from grpo_vision.iterative import ReplayBuffer, iteration_of, starts_iteration, update_rewards
from grpo_vision.models.adapters import add_adapter
from grpo_vision.policy import Bundle, load_bundle
from grpo_vision.prompts import PromptEntry, save_prompts
from grpo_vision.reference import Reference
from grpo_vision.rollouts import Samples, Scored, decode_images, repeat, sample_rows, score
from grpo_vision.rewards import CompositeReward, RewardError, save_reward_origins
from grpo_vision.run.alerts import RunAlerts, watcher_for
from grpo_vision.run.checkpoint import (
    CheckpointError, latest_checkpoint, load_checkpoint, load_iterative_state, load_training_state, save_checkpoint,
)
from grpo_vision.run.distributed import (
    full_state_dict, full_weights, gather, is_fsdp, load_optimizer_state, optimizer_state, prepare, process_slice,
    trainable_weights,
)
from grpo_vision.run.folder import read_run_config, resume_command, save_origin
from grpo_vision.run.health import COUNTERS, DRIFT_WARN, NonFiniteWeightsError, RunHealth, warn
from grpo_vision.run.lock import RunLock, check_run_dir
from grpo_vision.run.machine import check_load, resolve_device, set_threads
from grpo_vision.run.memory import report_memory, resident_bytes
from grpo_vision.run.metrics import MetricsLogger, PhaseTimer, load_metrics, nanmean, nanstd
from grpo_vision.run.signals import GracefulStop, Interrupted
from grpo_vision.run.trackers import Trackers, accelerator_options, grid_text
from grpo_vision.sampling import SamplingParams, decode_mode
from grpo_vision.seeds import IMAGE, REPLAY, step_rng, step_seed
from grpo_vision.splits import PromptSets, checked_prompt_sets
from grpo_vision.update import Learner, UpdateBatch, old_logprobs, policy_tokens, reference_logprobs, update


def train(cfg: Config, resume: str | Path | None = None, progress: bool = True, *, bundle: Bundle | None = None,
          prompts: dict[str, list[PromptEntry]] | None = None) -> Path:
    """Train `cfg` (or continue the run folder `resume`) and return the run folder. GRPOTrainer (trainer.py) may
    hand over a loaded policy `bundle` and in-memory `prompts` ("train", "eval") in place of the config's."""
    st = set_up(cfg, resume, bundle, prompts)  # every model, reward and prompt loaded; a bad input stops here
    s, t, main = cfg.sample, cfg.train, st.acc.is_main_process
    lock = RunLock(st.run_dir, fresh=not resume) if main else None  # one run per directory, until train returns
    if main:  # only once everything has loaded, so a bad override never reaches the run's config
        save_run_files(st, cfg)
    logger = MetricsLogger(st.run_dir, st.start, Trackers(st.acc, st.run_dir, cfg, st.start)) if main else None
    alerts = RunAlerts(st.run_dir, st.start, watcher_for(cfg), load_metrics(st.run_dir), cfg.log.stop_on) \
        if main else None  # after the logger, which drops the rows past the resumed step
    stop, step = GracefulStop(), st.start
    try:
        for step in (bar := tqdm(range(st.start, t.steps), initial=st.start, total=t.steps, desc="grpo",
                                 disable=not (progress and main))):
            timer = PhaseTimer()
            iteration = new_iteration(st, cfg, step, timer)  # ---- ITERATION: at a boundary (iterative RL)
            samples = sample_step(st, cfg, step, timer)  # ---- SAMPLING: B / P prompts x G images here, decoded
            with timer("reward"):  # ---- REWARD: every process's scores, in group order; the health checks count them
                scored = score_step(st, cfg, samples)
                st.learner.health.after_rewards(step, scored.total, scored.raw, scored.weights, scored.spread)
            # ---- ADVANTAGE: each image against its group, from every process's rewards; this process's rows
            advantages = group_advantages(scored.total, s.group_size, t.adv_scale)[samples.rows]  # [n]
            with timer("logprobs"):  # ---- the ratio's old log-probs, the reference's for the KL
                batch = update_batch(st, cfg, samples, advantages)
            with timer("update"):  # ---- UPDATE: the clipped GRPO loss, num_iterations passes
                st.policy.train()
                losses = update(st.learner, batch, st.params, t, cfg.run.seed, step)
            after_update(st, cfg, step, samples)  # ---- the moving reference's sync, the replay buffer
            # ---- LOG / CHECKPOINT
            metrics = step_metrics(st, cfg, samples, scored, losses, timer) | iteration
            alert = None
            if main:
                alert = alerts.observe(logger.log(step + 1, metrics), warn)  # ALERTS: one line each as it fires
                bar.set_postfix(reward=f"{metrics['reward/total/mean']:.3f}", kl=f"{metrics['loss/kl']:.4f}")
            if cfg.log.sample_every and ((step + 1) % cfg.log.sample_every == 0 or step == st.start):
                sample_grid(st, step, logger and logger.trackers)
                if main:
                    logger.trackers.log_rollouts(step + 1, [e.prompt for e in samples.entries], samples.images,
                                                 {k: v[samples.rows] for k, v in scored.raw.items()}, advantages,
                                                 scored.verdicts)
            if cfg.log.stop_on and (alert := agreed_alert(st.acc, alert)):  # log.stop_on named it
                checkpoint(st, step + 1)
                print(f"\n[train] stopped by the {alert.name} alert at step {step + 1} (log.stop_on): saved a "
                      f"checkpoint; alerts.jsonl holds the evidence. To go on anyway: "
                      f"{resume_command(st.run_dir, cfg, st.prompts.all())} log.stop_on=[]", file=sys.stderr, flush=True)
                break
            if signum := stop.agreed(st.acc):
                checkpoint(st, step + 1)
                print(f"\n[train] stopped by {signal.Signals(signum).name}: saved a checkpoint at step {step + 1}; "
                      f"continue with: {resume_command(st.run_dir, cfg, st.prompts.all())}", file=sys.stderr)
                raise Interrupted(signum)
            if st.learner.health.too_many_skipped():  # skipped updates leave the weights as the last applied made them
                checkpoint(st, step + 1)
                raise st.learner.health.stuck(step + 1, st.run_dir)
            if cfg.log.checkpoint_every and (step + 1) % cfg.log.checkpoint_every == 0:
                checkpoint(st, step + 1)
        else:
            step = t.steps
            checkpoint(st, step)
    except RewardError as e:
        saved = "no step had finished, nothing was saved: the same command starts again"
        if step:  # at step 0 a checkpoint would hold the starting weights and make the folder refuse a fresh start
            checkpoint(st, step)
            saved = f"checkpoint saved at step {step} in {st.run_dir}"
        raise RewardError(e.name, f"{e.message} ({saved})") from e
    except NonFiniteWeightsError as e:  # no checkpoint: it would hold the broken weights
        last = latest_checkpoint(st.run_dir)
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
        if alerts:
            alerts.close()
        if lock:
            lock.release()
    return st.run_dir


# ---------------------------------------------------------------------------- the phases


def new_iteration(st: RunState, cfg: Config, step: int, timer: PhaseTimer) -> dict:
    """Iterative RL (train.iterations > 1): before the first step of each later iteration, the reference
    becomes the policy and the rewards that learn update on the iteration's samples; their metrics and
    the iteration's number (none with one iteration)."""
    t = cfg.train
    if t.iterations == 1:
        return {}
    index, metrics = iteration_of(step, t.steps, t.iterations), {}
    if starts_iteration(step, t.steps, t.iterations):
        with timer("iteration"):
            if st.reference.mode != "none":
                sync_reference(st)
            # not again after a checkpoint saved past it (a reward that failed later in the step)
            if st.buffer is not None and st.buffer.iteration < index:
                with full_weights(st.learner.model):  # the decoder may be part of the sharded policy (Janus)
                    metrics = update_rewards(st.rewards, st.buffer, st.bundle.tokenizer, st.bundle.judge,
                                             cfg.reward.replay_fraction, step_rng(cfg.run.seed, step, REPLAY),
                                             cfg.sample.batch_size, st.acc.device)
    return metrics | {"iteration": index + 1}


def sample_step(st: RunState, cfg: Config, step: int, timer: PhaseTimer) -> Samples:
    """Every process draws the step's B prompts (the same list) and samples its own whole groups, each
    image from its own seed (seeds.IMAGE + its row among the step's B*G)."""
    s, acc, policy = cfg.sample, st.acc, st.policy
    with timer("sample"), full_weights(st.learner.model):  # gathered: Janus's VQ decoder is in the sharded policy
        chosen = step_rng(cfg.run.seed, step).choice(len(st.prompts.train), s.prompts_per_step,
                                                     replace=len(st.prompts.train) < s.prompts_per_step)
        entries = repeat([st.prompts.train[i] for i in chosen[process_slice(s.prompts_per_step, acc)]], s.group_size)
        rows = process_slice(s.prompts_per_step * s.group_size, acc)
        seeds = [step_seed(cfg.run.seed, step, IMAGE + j) for j in range(rows.start, rows.stop)]
        policy.eval()
        cond, rollout = sample_rows(policy, entries, seeds, st.params, s.batch_size, s.mixed_precision == "bf16")
        with timer("decode"):  # its own phase: the sample clock stops meanwhile
            images = decode_images(st.bundle.tokenizer, rollout.tokens, s.batch_size)  # [n, 3, H, W]
    return Samples(entries, seeds, cond, rollout, images, chosen, rows)


def score_step(st: RunState, cfg: Config, samples: Samples) -> Scored:
    """Every reward on this process's images, gathered from every process (in group order), and the
    policy kind's judge on them (log.judge_rollouts)."""
    judge = st.bundle.judge if cfg.log.judge_rollouts else None
    local = score(st.rewards, samples.images, samples.entries, judge)
    total = gather(st.acc, local.total)  # [B*G]
    raw = {k: gather(st.acc, v) for k, v in local.raw.items()}
    weights = {k: gather(st.acc, v) for k, v in local.weights.items()}
    if cfg.reward.combine == "normalize_then_sum":
        total = normalize_then_sum(torch.stack([raw[k] for k in st.rewards.names], 1),
                                   torch.stack([weights[k] for k in st.rewards.names], 1), cfg.sample.group_size)
    judged = {}
    if judge is not None:
        from grpo_vision.evaluation.judge import verdict_rates

        judged = {k: gather(st.acc, v) for k, v in verdict_rates(local.verdicts,
                                                                 ["correct", *judge.attributes]).items()}
    return Scored(total, raw, weights, local.reasons, local.verdicts, judged,
                  frac_zero_std(total, cfg.sample.group_size))


def update_batch(st: RunState, cfg: Config, samples: Samples, advantages: torch.Tensor) -> UpdateBatch:
    """The update's inputs: the log-probs its ratio divides by, the reference's for the KL, and the
    tokens that carry the policy term."""
    t, acc, cond, tokens = cfg.train, st.acc, samples.cond, samples.rollout.tokens
    old = old_logprobs(st.policy, cond, samples.rollout, st.params, acc, t.micro_batch_size,
                       recompute=cfg.sample.mixed_precision != "no")
    with acc.autocast():  # the update's precision, so that the KL at step 0 is exactly 0
        ref = reference_logprobs(st.policy, st.reference, cond, tokens, st.params, t)
    mask = torch.ones_like(tokens, dtype=torch.bool)  # image sequences have a fixed length
    keep = policy_tokens(samples.rollout.entropy, mask, t.top_entropy_quantile, acc)
    return UpdateBatch(cond, tokens, mask, samples.rollout.logprobs, old, ref, advantages.to(acc.device), keep)


def after_update(st: RunState, cfg: Config, step: int, samples: Samples) -> None:
    """A reference that moves every N steps takes the policy's weights; the step's samples join the
    replay buffer once it is done (the last iteration's would never be used)."""
    t = cfg.train
    if st.reference.mode != "none" and t.ref_sync_every and (step + 1) % t.ref_sync_every == 0:
        sync_reference(st)
    if st.buffer is not None and iteration_of(step, t.steps, t.iterations) < t.iterations - 1:
        step_entries = repeat([st.prompts.train[i] for i in samples.chosen], cfg.sample.group_size)
        st.buffer.add(gather(st.acc, samples.rollout.tokens), step_entries)


def step_metrics(st: RunState, cfg: Config, samples: Samples, scored: Scored, losses: dict,
                 timer: PhaseTimer) -> dict:
    """The step's namespaced scalars (README, Metrics): the rewards, the update's losses, the health
    counters as the update left them (its skipped updates included), timings."""
    G, acc = cfg.sample.group_size, st.acc
    metrics = {f"reward/{k}/mean": nanmean(v) for k, v in scored.raw.items()}
    metrics |= {f"reward/{k}/std": nanstd(v) for k, v in scored.raw.items()}
    metrics |= {f"reward/{k}/frac_zero_std": frac_zero_std(v, G) for k, v in scored.raw.items()}
    metrics |= {f"reward/{k}/group_std": group_std(v, G) for k, v in scored.raw.items()}
    # the judge's rates on the rollouts, for the attributes this step's prompts name (none: no key, as no value)
    metrics |= {f"judge/{k}": nanmean(v) for k, v in scored.judged.items() if not v.isnan().all()}
    return metrics | {
        "reward/total/mean": nanmean(scored.total), "reward/total/std": nanstd(scored.total),
        "reward/total/group_std": group_std(scored.total, G),
        "adv/frac_zero_std": scored.spread, **losses, **st.learner.health.metrics(),
        "policy/entropy": acc.reduce(samples.rollout.entropy.mean().to(acc.device), "mean").item(),
        **timer.metrics(),
        "perf/sample_tokens_per_s": samples.rollout.tokens.numel() / timer.seconds["sample"],
        "perf/memory_estimate_gib": st.memory_estimate / 2**30,
        "lr": st.learner.scheduler.get_last_lr()[0],
    }


# ---------------------------------------------------------------------------- around the steps


def save_run_files(st: RunState, cfg: Config) -> None:
    """The run's config, where its relative paths are relative to, and its prompts (fixed in the run)."""
    save_config(cfg, st.run_dir / "config.yaml")
    save_origin(st.run_dir)  # eval RUN works from anywhere
    save_reward_origins(st.run_dir, cfg, st.prompts.all())  # a reward made in a script is named later, not unknown
    for name, entries in (("train", st.prompts.train), *st.prompts.scored().items()):
        save_prompts(entries, st.run_dir / "prompts" / f"{name}.jsonl", root=st.run_dir)


def checkpoint(st: RunState, step: int) -> None:
    """An atomic checkpoint at `step` (run/checkpoint.py), with every process: FSDP gathers the shards
    together; DDP copies on the main process."""
    model, optimizer, main = st.learner.model, st.learner.optimizer, st.acc.is_main_process
    weights = opt_state = None
    if main or is_fsdp(model):
        weights, opt_state = trainable_weights(model), optimizer_state(model, optimizer)
    if main:
        learned = None if st.buffer is None else {"buffer": st.buffer.state_dict(), "rewards": st.rewards.state_dict()}
        save_checkpoint(st.run_dir, step, st.policy, optimizer, st.learner.scheduler,
                        st.reference.state_dict(st.policy), {"counters": st.learner.health.counters}, learned,
                        weights=weights, optimizer_state=opt_state)
    st.acc.wait_for_everyone()


def sync_reference(st: RunState) -> None:
    """The reference becomes the policy; a frozen copy takes every weight whole, gathered from FSDP's shards."""
    st.reference.sync(st.policy, full_state_dict(st.learner.model) if st.reference.mode == "frozen" else None)


def sample_grid(st: RunState, step: int, trackers: Trackers | None) -> None:
    """Policy and reference on the same seeds, four test and four training prompts: samples/step_N.png,
    and to the trackers (the main process's) as an image with each image's rewards and verdict."""
    from grpo_vision.evaluation.evaluate import save_sample_grid

    with full_weights(st.learner.model):  # every process: FSDP gathers the shards together
        if st.acc.is_main_process:
            entries = st.prompts.test[:4] + st.prompts.train[:4]
            png = st.run_dir / "samples" / f"step_{step + 1:06d}.png"
            grid = save_sample_grid(st.policy, st.reference, st.bundle.tokenizer, entries, st.params, png,
                                    judge=st.bundle.judge, root=st.run_dir)
            if trackers is not None and trackers.wants_grid():
                k = len(grid["prompts"]) // len(entries)  # images per prompt, in prompt order
                meta = [e for e in entries for _ in range(k)]
                rewards = {side: st.rewards(images, grid["prompts"], [e.metadata for e in meta],
                                            [e.rewards for e in meta]).raw for side, images in grid["images"].items()}
                trackers.log_grid(step + 1, grid["sheet"], grid_text(step + 1, grid["prompts"], grid["seeds"], rewards,
                                                                     grid["verdicts"]), png)


def agreed_alert(acc, alert):
    """The main process's stopping alert (or None), on every process: they stop at the same step."""
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([alert])[0] if acc.num_processes > 1 else alert


# ---------------------------------------------------------------------------- set-up


@dataclass
class RunState:  # everything set-up builds before the first step, on this process
    acc: object  # accelerate.Accelerator
    run_dir: Path
    params: SamplingParams  # the rollout's sampling settings
    bundle: Bundle  # the policy kind's policy, tokenizer, judge, reward defaults
    policy: torch.nn.Module  # the bundle's policy, peft-wrapped when train.adapter is set
    learner: Learner  # the prepared model, its optimizer and schedule, the health checks
    reference: Reference
    rewards: CompositeReward
    prompts: PromptSets  # train, and the two eval sets
    start: int  # the first step to run (0, or the resumed checkpoint's step)
    buffer: ReplayBuffer | None  # iterative RL with a learning reward: the samples it updates on
    memory_estimate: int = 0  # bytes: run/memory.py's estimated peak, logged beside the measured one


def set_up(cfg: Config, resume: str | Path | None, given_bundle: Bundle | None = None,
           given_prompts: dict | None = None) -> RunState:
    """Load everything a run needs, or fail naming the problem before the run directory is written."""
    from accelerate import Accelerator

    device = resolve_device(cfg.run.device)
    run_dir = Path(resume) if resume else Path(cfg.run.out_dir) / cfg.run.name
    acc = Accelerator(cpu=device == "cpu", mixed_precision=cfg.train.mixed_precision,
                      **accelerator_options(cfg, run_dir))  # log.trackers: started by train() once the folder is ours
    sizes = derived_sizes(cfg, acc.num_processes)
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
    before_load = (resident_bytes() or 0) if acc.device.type == "cpu" else 0  # the estimate's "runtime" part
    bundle = given_bundle or load_bundle(cfg.policy, acc.device)
    if given_bundle is not None:  # a script's policy, loaded wherever it was: onto this process's device
        for part in (bundle.policy, bundle.tokenizer):
            if isinstance(part, torch.nn.Module):
                part.to(acc.device)
    policy = bundle.policy
    try:  # a decode path this policy or device cannot run: refused here, before the run folder is written
        decode_mode(policy, params.decode, acc.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
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
    memory_estimate = report_memory(policy, bundle.tokenizer, trainable, cfg, sizes["images_per_process"],
                                    params.guided, acc.device, main, before_load)
    optimizer = torch.optim.AdamW(trainable, lr=t.lr, betas=tuple(t.adam_betas), weight_decay=t.weight_decay)
    prompts = checked_prompt_sets(cfg, bundle, run_dir if resume else None, given_prompts)
    rewards = CompositeReward.from_config(cfg.reward, acc.device, bundle.reward_defaults, prompts.all())
    rewards.load()  # a missing or corrupt reward model stops the run here, before its folder is written
    rewards.check({"training": prompts.train, **prompts.named()})  # ... and so does a set a reward cannot score
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
    start, counters, ckpt = 0, None, latest_checkpoint(run_dir) if resume else None
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
        if not isinstance(counters, dict) or set(counters) != set(COUNTERS):
            raise CheckpointError(f"{ckpt / 'trainer_state.json'} holds the counters {brief(counters)}, not "
                                  f"{', '.join(COUNTERS)}: delete {ckpt} and resume from an earlier step")
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
    low_precision = t.mixed_precision != "no" or cfg.policy.dtype != "float32"
    health = RunHealth(counters, t.max_skipped_updates, loud=main,
                       drift_limit=DRIFT_WARN["low_precision" if low_precision else "float32"])
    learner = Learner(model, trainable, optimizer, scheduler, acc, health)
    return RunState(acc, run_dir, params, bundle, policy, learner, reference, rewards, prompts, start, buffer,
                    memory_estimate)


def write_report(st: RunState, cfg: Config, stop: GracefulStop) -> None:
    """The final report; a signal while it is written (or since the last step) stops it, saying that the
    training itself finished and how to write the report again."""
    from grpo_vision.evaluation.report import final_report

    try:
        if signum := stop.agreed(st.acc):  # every process, or one would wait in full_weights for the others
            raise Interrupted(signum)
        with full_weights(st.learner.model):  # every process: FSDP gathers the shards together
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
