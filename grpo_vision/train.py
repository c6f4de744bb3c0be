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

import gc
import math
import signal
import sys
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from grpo_vision.config import Config, ConfigError, derived_sizes, format_sizes, save_config
from grpo_vision.step.credit import stage_entropy_reward
from grpo_vision.grpo import frac_zero_std, group_advantages, group_std, informative_groups, normalize_then_sum
from grpo_vision.step.iterative import ReplayBuffer, iteration_of, starts_iteration, update_rewards
from grpo_vision.models.adapters import add_adapter, merge_setting, merged_adapter, merged_bytes
from grpo_vision.policy import Bundle, check_weighting_hooks, load_bundle
from grpo_vision.prompts import PromptEntry, save_prompts
from grpo_vision.step.reference import Reference
from grpo_vision.rollouts import Samples, Scored, decode_images, repeat, sample_rows, score, take_groups
from grpo_vision.rewards import CompositeReward, RewardError, save_reward_origins
from grpo_vision.run.alerts import RunAlerts, watcher_for
from grpo_vision.run.checkpoint import (
    Resumed, base_identity, latest_checkpoint, load_training_state, resume_weights, save_checkpoint,
)
from grpo_vision.run.distributed import (
    full_state_dict, full_weights, gather, is_fsdp, load_optimizer_state, optimizer_state, prepare, process_slice,
    trainable_weights,
)
from grpo_vision.run.folder import read_run_config, resume_command, save_origin
from grpo_vision.run.health import DRIFT_WARN, NonFiniteWeightsError, RunHealth, TrainingHealthError, warn
from grpo_vision.run.lock import RunLock, check_run_dir
from grpo_vision.run.machine import check_load, resolve_device, set_threads
from grpo_vision.run.memory import report_memory, resident_bytes
from grpo_vision.run.metrics import MetricsLogger, PhaseTimer, load_metrics, nanmean, nanstd
from grpo_vision.run.signals import GracefulStop, Interrupted
from grpo_vision.run.trackers import Trackers, accelerator_options, grid_text
from grpo_vision.sampling import SamplingParams, batched_logprobs, decode_mode
from grpo_vision.seeds import IMAGE, REFILL, REFILL_IMAGE, REPLAY, step_rng, step_seed
from grpo_vision.splits import PromptSets, checked_prompt_sets
from grpo_vision.step.update import (
    LOSS_KEYS, EntropyControl, Learner, Measured, UpdateBatch, UpdatePlan, contrast_logprobs, old_logprobs,
    policy_tokens, reference_logprobs, token_weights, update,
)


def train(cfg: Config, resume: str | Path | None = None, progress: bool = True, *, bundle: Bundle | None = None,
          prompts: dict[str, list[PromptEntry]] | None = None, allow_other_base: bool = False) -> Path:
    """Train `cfg` (or continue the run folder `resume`) and return the run folder. GRPOTrainer (trainer.py) may
    hand over a loaded policy `bundle` and in-memory `prompts` ("train", "eval") in place of the config's.
    `allow_other_base`: resume although policy.path / policy.tokenizer are other files than the checkpoint's."""
    try:
        return _train(cfg, resume, progress, bundle, prompts, allow_other_base)
    finally:
        # a run's models sit in reference cycles (hooks, closures, accelerate's wrappers) that only the cycle
        # collector frees: a script that trains run after run (`bench gpu`) carried the last run's GPU memory
        # into the next run's peak
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _train(cfg: Config, resume: str | Path | None, progress: bool, bundle: Bundle | None,
           prompts: dict[str, list[PromptEntry]] | None, allow_other_base: bool) -> Path:
    # every model, reward and prompt loaded; a bad input stops here
    st = set_up(cfg, resume, bundle, prompts, allow_other_base)
    s, t, main = cfg.sample, cfg.train, st.acc.is_main_process
    lock = RunLock(st.run_dir, fresh=not resume) if main else None  # one run per directory, until train returns
    # only once everything has loaded, so a bad override never reaches the run's config; and not by a resume of a
    # finished run, which trains no step: its overrides would be recorded as settings no step used
    if main and not (resume and st.start >= t.steps):
        save_run_files(st, cfg)
    logger = MetricsLogger(st.run_dir, st.start, Trackers(st.acc, st.run_dir, cfg, st.start)) if main else None
    alerts = RunAlerts(st.run_dir, st.start, watcher_for(cfg), load_metrics(st.run_dir), cfg.log.stop_on) \
        if main else None  # after the logger, which drops the rows past the resumed step
    stop, step, stopped = GracefulStop(), st.start, None
    try:
        for step in (bar := tqdm(range(st.start, t.steps), initial=st.start, total=t.steps, desc="grpo",
                                 disable=not (progress and main))):
            timer = PhaseTimer(torch.cuda.synchronize if st.acc.device.type == "cuda" else None)
            iteration = new_iteration(st, cfg, step, timer)  # ---- ITERATION: at a boundary (iterative RL)
            # ---- SAMPLING: B / P prompts x G images here, decoded; the weights gathered (Janus's VQ decoder is
            # in the sharded policy)
            with timer("sample"), full_weights(st.learner.model):
                samples = sample_step(st.policy, st.bundle.tokenizer, st.prompts.train, st.params, cfg, step, st.acc,
                                      timer, st.merge)
            with timer("reward"):  # ---- REWARD: every process's scores, in group order; the health checks count them
                scored = score_step(st.rewards, st.bundle.judge if cfg.log.judge_rollouts else None, samples, cfg,
                                    st.acc)
            refill = None
            if cfg.train.zero_std_groups == "resample":  # ---- REFILL: new groups in the flat groups' places
                samples, scored, refill = refill_flat_groups(st, cfg, step, samples, scored, timer)
            with timer("reward"):
                st.learner.health.after_rewards(step, scored.total, scored.raw, scored.weights, scored.spread)
            with timer("logprobs"):  # ---- the ratio's old log-probs, the reference's for the KL
                measured = measure(st.policy, st.reference, st.plan, st.params, st.acc, samples)
            # ---- ADVANTAGE: each image against its group, from every process's rewards; this process's rows
            totals = step_rewards(scored, measured, st.plan, st.acc)  # [B*G] (STAGE: with its entropy reward)
            advantages = group_advantages(totals, s.group_size, t.adv_scale)[samples.rows]  # [n]
            # the tokens that carry the credit (the weightings read the tokenizer's codebook and the policy's
            # embeddings: gathered, as for sampling), the groups that stay
            with timer("logprobs"), full_weights(st.learner.model):
                batch, dropped = update_batch(st.policy, st.bundle.tokenizer, st.plan, st.acc, samples, measured,
                                              advantages, totals)
            with timer("update"):  # ---- UPDATE: the clipped GRPO loss, num_iterations passes
                st.policy.train()
                losses = update(st.learner, batch, st.params, st.plan, cfg.run.seed, step) if len(batch.tokens) \
                    else dict.fromkeys(LOSS_KEYS, math.nan)  # every group dropped: no update this step
                if st.plan.drop_flat_groups:
                    losses["train/groups_dropped"] = dropped
                if refill is not None:  # how many of the step's first groups were flat, how many new ones it drew
                    losses["train/frac_flat_sampled"], losses["train/groups_resampled"] = refill
            after_update(st, cfg, step, samples)  # ---- the moving reference's sync, the replay buffer
            # ---- LOG / CHECKPOINT
            metrics = step_metrics(st, cfg, samples, scored, losses, timer, refill[1] if refill else 0) | iteration
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
                stopped = StoppedByAlert(
                    st.run_dir, f"stopped by the {alert.name} alert at step {step + 1} (log.stop_on): a checkpoint is "
                    f"saved and alerts.jsonl holds the evidence; to go on anyway: "
                    f"{resume_command(st.run_dir, cfg, st.prompts.all())} log.stop_on=[]")
                break  # the report is still written; the run then ends with the stop, not "done"
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
            if step > st.start:  # a finished run resumed writes its report only: its checkpoint is kept as it is
                checkpoint(st, step)
    except RewardError as e:
        saved = "no step had finished, nothing was saved: the same command starts again"
        if step > st.start:  # none at the step it started from: at 0 it would make the folder refuse a fresh start
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
    if stopped is not None:
        raise stopped
    return st.run_dir


class StoppedByAlert(TrainingHealthError):
    """log.stop_on stopped the run at an alert it names (after its checkpoint and report): `run_dir` holds both."""

    def __init__(self, run_dir: Path, message: str):
        super().__init__(message)
        self.run_dir = run_dir


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


def sample_step(policy, tokenizer, prompts: list[PromptEntry], params: SamplingParams, cfg: Config, step: int,
                acc, timer: PhaseTimer, merge: bool = False) -> Samples:
    """Every process draws the step's B prompts (the same list) and samples its own whole groups, each
    image from its own seed (seeds.IMAGE + its row among the step's B*G)."""
    s = cfg.sample
    chosen = step_rng(cfg.run.seed, step).choice(len(prompts), s.prompts_per_step,
                                                 replace=len(prompts) < s.prompts_per_step)
    entries = repeat([prompts[i] for i in chosen[process_slice(s.prompts_per_step, acc)]], s.group_size)
    rows = process_slice(s.prompts_per_step * s.group_size, acc)
    seeds = [step_seed(cfg.run.seed, step, IMAGE + j) for j in range(rows.start, rows.stop)]
    return sample_entries(policy, tokenizer, entries, seeds, params, s, timer, chosen, rows, merge)


def sample_entries(policy, tokenizer, entries: list[PromptEntry], seeds: list[int], params: SamplingParams, s,
                   timer: PhaseTimer, chosen=None, rows: slice | None = None, merge: bool = False) -> Samples:
    """`entries`' images, row i from `seeds[i]`, decoded (sample config `s`: batch size, precision); `merge`:
    sampled with the adapter folded into the weights (sample.merge_adapter), which are put back after."""
    policy.eval()
    with merged_adapter(policy) if merge else nullcontext():
        cond, rollout = sample_rows(policy, entries, seeds, params, s.batch_size, s.mixed_precision == "bf16")
    with timer("decode"):  # its own phase: the sample clock stops meanwhile
        images = decode_images(tokenizer, rollout.tokens, s.batch_size)  # [n, 3, H, W]
    return Samples(entries, seeds, cond, rollout, images, chosen, rows)


def refill_flat_groups(st: RunState, cfg: Config, step: int, samples: Samples, scored: Scored,
                       timer: PhaseTimer) -> tuple[Samples, Scored, tuple[float, int]]:
    """train.zero_std_groups=resample, DAPO's dynamic sampling (arXiv 2503.14476, section 3.2; verl's
    `filter_groups`): each group whose reward did not vary gives its place to a group of a prompt the step has
    not drawn, sampled and scored as the step's own, in at most train.resample_rounds rounds; a group still flat
    after them is dropped by the update as with `drop`. One process, and not with STAGE's entropy reward, which
    gives flat groups a spread (set-up and config refuse both). Returns the step's groups, the fraction of its
    first groups that were flat, and how many new groups were sampled."""
    G = cfg.sample.group_size
    flat = [g for g, varies in enumerate(informative_groups(scored.total, G).tolist()) if not varies]
    flat_first = len(flat) / (len(samples.entries) // G)
    unused = np.setdiff1d(np.arange(len(st.prompts.train)), samples.chosen)
    rng, parts, drawn = step_rng(cfg.run.seed, step, REFILL), [(samples, scored)], 0
    picks = [(0, g) for g in range(len(samples.entries) // G)]
    for _ in range(cfg.train.resample_rounds):
        if not flat or not len(unused):
            break
        new = rng.choice(unused, min(len(flat), len(unused)), replace=False)
        unused = np.setdiff1d(unused, new)
        entries = repeat([st.prompts.train[i] for i in new], G)
        seeds = [step_seed(cfg.run.seed, step, REFILL_IMAGE + drawn * G + j) for j in range(len(entries))]
        with timer("sample"), full_weights(st.learner.model):
            more = sample_entries(st.policy, st.bundle.tokenizer, entries, seeds, st.params, cfg.sample, timer, new,
                                  merge=st.merge)
        with timer("reward"):
            more_scored = score_step(st.rewards, st.bundle.judge if cfg.log.judge_rollouts else None, more, cfg,
                                     st.acc)
        parts.append((more, more_scored))
        drawn += len(new)
        for g, varies in enumerate(informative_groups(more_scored.total, G).tolist()):
            if varies:  # fills the first place still flat
                picks[flat.pop(0)] = (len(parts) - 1, g)
    if drawn == 0:
        return samples, scored, (flat_first, 0)
    samples, scored = take_groups(parts, picks, G, st.policy.encode_prompts)
    scored.spread = frac_zero_std(scored.total, G)
    return samples, scored, (flat_first, drawn)


def score_step(rewards: CompositeReward, judge, samples: Samples, cfg: Config, acc) -> Scored:
    """Every reward on this process's images, gathered from every process (in group order), and `judge`
    on them (the policy kind's, with log.judge_rollouts; None: no verdicts)."""
    local = score(rewards, samples.images, samples.entries, judge)
    total = gather(acc, local.total)  # [B*G]
    raw = {k: gather(acc, v) for k, v in local.raw.items()}
    weights = {k: gather(acc, v) for k, v in local.weights.items()}
    if cfg.reward.combine == "normalize_then_sum":
        total = normalize_then_sum(torch.stack([raw[k] for k in rewards.names], 1),
                                   torch.stack([weights[k] for k in rewards.names], 1), cfg.sample.group_size)
    judged = {}
    if judge is not None:
        from grpo_vision.evaluation.judge import verdict_rates

        judged = {k: gather(acc, v) for k, v in verdict_rates(local.verdicts, ["correct", *judge.attributes]).items()}
    return Scored(total, raw, weights, local.reasons, local.verdicts, judged,
                  frac_zero_std(total, cfg.sample.group_size))


def measure(policy, reference: Reference, plan: UpdatePlan, params: SamplingParams, acc, samples: Samples) -> Measured:
    """The teacher-forced passes of a step: the log-probs the ratio divides by, the reference's for the KL,
    and what the token weighting reads (STAGE's entropies, guidance-contrastive's two branches)."""
    cond, tokens = samples.cond, samples.rollout.tokens
    old = old_logprobs(policy, cond, samples.rollout, params, acc, plan.micro_batch, recompute=plan.recompute_old)
    entropy = ref_entropy = contrast = None
    with acc.autocast():  # the update's precision, so that the KL at step 0 is exactly 0
        if plan.entropies:  # STAGE's entropy reward: both models' entropies of the distribution the ratio uses
            _, entropy = batched_logprobs(policy, cond, tokens, params, plan.micro_batch, with_entropy=True)
            ref, ref_entropy = reference.logprobs(policy, cond, tokens, params, plan.micro_batch, with_entropy=True)
        else:
            ref = reference_logprobs(policy, reference, cond, tokens, params, plan)
        if plan.token_weighting == "guidance_contrastive":
            contrast = contrast_logprobs(policy, cond, tokens, params, plan.micro_batch)
    return Measured(old, ref, entropy, ref_entropy, contrast)


def step_rewards(scored: Scored, measured: Measured, plan: UpdatePlan, acc) -> torch.Tensor:
    """The totals `[B*G]` the advantages come from: STAGE's entropy reward added to each group's best images."""
    if not plan.entropies:
        return scored.total
    mean_entropy = gather(acc, measured.entropy.mean(1).float())  # [B*G] every process's images
    ref_entropy = gather(acc, measured.ref_entropy.mean(1).float())
    return stage_entropy_reward(scored.total, mean_entropy, ref_entropy, plan.group_size, plan.stage_entropy_scale)


def update_batch(policy, tokenizer, plan: UpdatePlan, acc, samples: Samples, measured: Measured,
                 advantages: torch.Tensor, total: torch.Tensor) -> tuple[UpdateBatch, int]:
    """The update's inputs: the tokens that carry the policy term and each token's policy and KL weights
    (train.token_weighting), without the groups train.zero_std_groups=drop leaves out; and how many it left out."""
    tokens = samples.rollout.tokens
    mask = torch.ones_like(tokens, dtype=torch.bool)  # image sequences have a fixed length
    keep = policy_tokens(samples.rollout.entropy, mask, plan.policy_quantile, acc)
    batch = UpdateBatch(samples.cond, tokens, mask, samples.rollout.logprobs, measured.old, measured.ref,
                        advantages.to(acc.device), keep, dynamic_weight=plan.token_weighting == "critical")
    with torch.no_grad():
        batch.policy_weight, batch.kl_weight = token_weights(plan, policy, tokenizer, batch, samples.rollout.entropy,
                                                             measured.contrast)
    if not plan.drop_flat_groups:
        return batch, 0
    spread = informative_groups(total[samples.rows], plan.group_size)  # [groups here] (one process: set-up)
    return batch.rows(spread.repeat_interleave(plan.group_size).to(tokens.device)), int((~spread).sum())


def after_update(st: RunState, cfg: Config, step: int, samples: Samples) -> None:
    """A reference that moves every N steps takes the policy's weights; the step's samples join the
    replay buffer once it is done (the last iteration's would never be used)."""
    t = cfg.train
    if st.reference.mode != "none" and t.ref_sync_every and (step + 1) % t.ref_sync_every == 0:
        sync_reference(st, t.ref_model_mixup_alpha)
    if st.buffer is not None and iteration_of(step, t.steps, t.iterations) < t.iterations - 1:
        step_entries = repeat([st.prompts.train[i] for i in samples.chosen], cfg.sample.group_size)
        st.buffer.add(gather(st.acc, samples.rollout.tokens), step_entries)


def step_metrics(st: RunState, cfg: Config, samples: Samples, scored: Scored, losses: dict,
                 timer: PhaseTimer, refilled: int = 0) -> dict:
    """The step's namespaced scalars (README, Metrics): the rewards, the update's losses, the health
    counters as the update left them (its skipped updates included), timings. `refilled`: groups sampled
    beside the step's (train.zero_std_groups=resample), whose tokens the sampler's rate counts too."""
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
        "perf/sample_tokens_per_s": (samples.rollout.tokens.numel() + refilled * G * samples.rollout.tokens.shape[1])
        / timer.seconds["sample"],
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
                        st.reference.state_dict(st.policy), {"counters": st.learner.health.counters, "base": st.base}
                        | ({"entropy": st.learner.entropy.state()} if st.learner.entropy else {}), learned,
                        weights=weights, optimizer_state=opt_state)
    st.acc.wait_for_everyone()


def sync_reference(st: RunState, alpha: float = 1.0) -> None:
    """The reference becomes the policy (`alpha` < 1: moves that far toward it, train.ref_model_mixup_alpha); a
    frozen copy takes every weight whole, gathered from FSDP's shards."""
    st.reference.sync(st.policy, full_state_dict(st.learner.model) if st.reference.mode == "frozen" else None, alpha)


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
    plan: UpdatePlan  # the update's loss, passes, minibatches and reference, fixed for the run
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


def set_up(cfg: Config, resume: str | Path | None, given_bundle: Bundle | None = None,
           given_prompts: dict | None = None, allow_other_base: bool = False) -> RunState:
    """Load everything a run needs, or fail naming the problem before the run directory is written."""
    acc, run_dir, sizes = open_run(cfg, resume)  # the processes; a folder in use (or already a run) refused
    params, plan = SamplingParams.from_config(cfg.sample), UpdatePlan.from_config(cfg)
    before_load = (resident_bytes() or 0) if acc.device.type == "cpu" else 0  # the estimate's "runtime" part
    bundle, policy = load_policy(cfg, acc, params, given_bundle)  # the kind's files, its adapter
    check_weighting_hooks(cfg.train.token_weighting, cfg.policy.kind, bundle.policy, bundle.tokenizer)
    if plan.drop_flat_groups and acc.num_processes > 1:  # each process would make a different number of updates
        raise ConfigError(f"train.zero_std_groups={cfg.train.zero_std_groups} runs on one process, and this run has "
                          f"{acc.num_processes}: use train.zero_std_groups=keep, or one process")
    reference = Reference(policy, cfg.train.reference, load_base=lambda: load_bundle(cfg.policy, acc.device).policy)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    merge = merge_setting(cfg, policy, acc)
    # before any sampling: a batch that cannot fit stops here, naming the knob to lower (auto's merge falls back to
    # unmerged sampling where only its copy of the weights does not fit)
    memory_estimate, merge = report_memory(policy, bundle.tokenizer, trainable, cfg, sizes["images_per_process"],
                                           params.guided, acc.device, acc.is_main_process, before_load,
                                           merged_bytes(policy) if merge else 0, cfg.sample.merge_adapter == "auto")
    prompts = checked_prompt_sets(cfg, bundle, run_dir if resume else None, given_prompts)
    if cfg.train.zero_std_groups == "resample" and len(prompts.train) <= cfg.sample.prompts_per_step:
        raise ConfigError(f"train.zero_std_groups=resample replaces flat groups by prompts the step has not drawn, and "
                          f"the {len(prompts.train)} training prompts leave none beside sample.prompts_per_step="
                          f"{cfg.sample.prompts_per_step}: give more training prompts, or use train.zero_std_groups=drop")
    rewards = load_rewards(cfg, acc, bundle, prompts)  # a missing model or a set it cannot score stops here
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
    return RunState(acc, run_dir, params, plan, bundle, policy, learner, reference, rewards, prompts,
                    resumed.step if resumed else 0, buffer, base, memory_estimate, merge)


def record_other_base(run_dir: Path, step: int, change: str) -> None:
    """A resume onto other base files (--allow-other-base), said and kept in the run's base_changes.jsonl."""
    import json
    import time

    from grpo_vision.files import open_kept

    print(f"[train] --allow-other-base: from step {step}, {change}", file=sys.stderr, flush=True)
    with open_kept(run_dir / "base_changes.jsonl", root=run_dir) as f:
        f.write(json.dumps({"step": step, "time": time.time(), "change": change}) + "\n")


def open_run(cfg: Config, resume: str | Path | None) -> tuple[object, Path, dict]:
    """The accelerator, the run folder (one in use, or on a fresh start already a run, refused before any model
    loads) and the batch sizes per process; the threads set."""
    from accelerate import Accelerator

    device = resolve_device(cfg.run.device)
    run_dir = Path(resume) if resume else Path(cfg.run.out_dir) / cfg.run.name
    acc = Accelerator(cpu=device == "cpu", mixed_precision=cfg.train.mixed_precision,
                      **accelerator_options(cfg, run_dir))  # log.trackers: started by train() once the folder is ours
    sizes = derived_sizes(cfg, acc.num_processes)
    check_run_dir(run_dir, fresh=not resume)
    acc.wait_for_everyone()  # every process has looked before the main one writes anything there
    threads = set_threads(cfg.run.threads, acc.num_processes)
    if acc.is_main_process:
        print(f"[train] run directory {run_dir}\n[train] sizes: {format_sizes(sizes)}  threads={threads}", flush=True)
        if busy := check_load():
            warnings.warn(busy, stacklevel=3)
    return acc, run_dir, sizes


def load_policy(cfg: Config, acc, params: SamplingParams, given: Bundle | None) -> tuple[Bundle, torch.nn.Module]:
    """The policy kind's bundle (or a script's, moved to this process's device) and the policy to train: its
    decode path checked, activations recomputed, an adapter added as train.* says."""
    t = cfg.train
    bundle = given or load_bundle(cfg.policy, acc.device)
    if given is not None:  # a script's policy, loaded wherever it was: onto this process's device
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
    if t.adapter != "none":  # its random factors drawn from run.seed: two runs of one script start alike
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
            torch.manual_seed(cfg.run.seed)
            policy = add_adapter(policy, t.adapter, t.adapter_rank, t.adapter_alpha, t.adapter_targets)
    return bundle, policy


def load_rewards(cfg: Config, acc, bundle: Bundle, prompts: PromptSets) -> CompositeReward:
    """The run's rewards with their models loaded, checked against every prompt set they will score."""
    rewards = CompositeReward.from_config(cfg.reward, acc.device, bundle.reward_defaults, prompts.all())
    rewards.load()
    rewards.check({"training": prompts.train, **prompts.named()})
    return rewards


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
                      "(train.reference: none) and no reward that learns", stacklevel=3)
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
