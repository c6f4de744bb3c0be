"""GRPO training: one loop, read top to bottom. SAMPLING -> REWARD -> ADVANTAGE -> UPDATE -> LOG, and
with train.iterations > 1 an ITERATION boundary before some steps (step/iterative.py).

Each phase is a function of step/phases.py, and each hands the next one a typed container: `Samples`
(this process's images of the step) -> `Scored` (every reward, gathered; both from rollouts.py, which every
measurement shares) -> `Measured` -> `UpdateBatch` (step/update.py). Set-up (step/setup.py) loads everything
first, into one `RunState`. docs/architecture.md draws the data flow and lists the invariants.

All randomness of a step is derived from (run.seed, step) and a salt (seeds.py): which prompts, each
image's sampling seed and the update order. A resumed run therefore continues exactly: it only needs
the weights, the optimizer and scheduler state and the step, which every checkpoint holds.

Processes (accelerate) each take whole groups; rewards are gathered so that every process computes
the same advantages as a one-process run. The policy and its optimizer are prepared by accelerate:
DDP averages gradients before each optimizer update, or FSDP shards them (run/distributed.py).
"""

from __future__ import annotations

import gc
import signal
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from grpo_vision.config import Config
from grpo_vision.grpo import frac_zero_std, group_advantages
from grpo_vision.policy import Bundle
from grpo_vision.prompts import PromptEntry, save_prompts
from grpo_vision.rewards import RewardError, save_reward_origins
from grpo_vision.rollouts import EVAL_SEED, Scored, compare, plan_texts
from grpo_vision.run.alerts import RunAlerts, watcher_for
from grpo_vision.run.checkpoint import latest_checkpoint, save_checkpoint
from grpo_vision.run.distributed import full_weights, is_fsdp, optimizer_state, trainable_weights
from grpo_vision.run.folder import resume_command, save_origin, save_run_config
from grpo_vision.run.health import NonFiniteWeightsError, warn
from grpo_vision.run.lock import RunLock
from grpo_vision.run.metrics import MetricsLogger, PhaseTimer, load_metrics
from grpo_vision.run.signals import GracefulStop, Interrupted
from grpo_vision.run.trackers import Trackers, grid_text
from grpo_vision.step.phases import (
    StepSamples, StoppedByAlert, StoppedBySignal, after_update, make_update_batch, measure, new_iteration,
    refill_flat_groups, sample_step, score_step, step_metrics, step_rewards, stop_reason, update_step,
)
from grpo_vision.step.setup import RunState, set_up


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
    st = set_up(cfg, resume, bundle, prompts, allow_other_base)  # every model, reward and prompt; a bad input stops
    s, t, main = cfg.sample, cfg.train, st.acc.is_main_process
    # one run per directory, until train returns: a resume took it before reading its checkpoint (set_up)
    lock = st.lock or (RunLock(st.run_dir, fresh=True) if main and not resume else None)
    # only once everything has loaded, so a bad override never reaches the run's config; and not by a resume of a
    # finished run, which trains no step: its overrides would be recorded as settings no step used
    if main and not (resume and st.start >= t.steps):
        save_run_files(st, cfg, resume)
    logger = MetricsLogger(st.run_dir, st.start, Trackers(st.acc, st.run_dir, cfg, st.start)) if main else None
    alerts = RunAlerts(st.run_dir, st.start, watcher_for(cfg), load_metrics(st.run_dir), cfg.log.stop_on) \
        if main else None  # after the logger, which drops the rows past the resumed step
    signals, step, stopped = GracefulStop(), st.start, None
    sync = torch.cuda.synchronize if st.acc.device.type == "cuda" else None  # each phase charged its own kernels
    try:
        for step in (bar := tqdm(range(st.start, t.steps), initial=st.start, total=t.steps, desc="grpo",
                                 disable=not (progress and main))):
            timer = PhaseTimer(sync)
            iteration = new_iteration(st, cfg, step, timer)  # ---- ITERATION: at a boundary (iterative RL)
            # ---- SAMPLING: B / P prompts x G images here, decoded; the weights gathered (Janus's VQ decoder is
            # in the sharded policy)
            with timer("sample"), full_weights(st.learner.model):
                samples = sample_step(st, cfg, step, timer)
            with timer("reward"):  # ---- REWARD: every process's scores, in group order
                scored = score_step(st, cfg, samples)
            # ---- REFILL (train.zero_std_groups=resample): new groups in the flat groups' places
            samples, scored, refill = refill_flat_groups(st, cfg, step, samples, scored, timer)
            with timer("reward"):  # the health checks count the step's rewards
                st.learner.health.after_rewards(step, scored.total, scored.raw, scored.weights,
                                                frac_zero_std(scored.total, s.group_size))
            with timer("logprobs"):  # ---- the ratio's old log-probs, the reference's for the KL
                measured = measure(st, samples)
            # ---- ADVANTAGE: each image against its group, from every process's rewards; this process's rows
            totals = step_rewards(st, scored, measured)  # [B*G] (STAGE: with its entropy reward)
            advantages = group_advantages(totals, s.group_size, t.adv_scale)[samples.rows]  # [n]
            # the tokens that carry the credit (the weightings read the tokenizer's codebook and the policy's
            # embeddings: gathered, as for sampling), the groups that stay
            with timer("logprobs"), full_weights(st.learner.model):
                batch, dropped = make_update_batch(st, samples, measured, advantages, totals)
            with timer("update"):  # ---- UPDATE: the clipped GRPO loss, num_iterations passes
                losses = update_step(st, cfg, step, batch)
            after_update(st, cfg, step, samples)  # ---- the moving reference's sync, the replay buffer
            # ---- LOG / CHECKPOINT
            metrics = step_metrics(st, cfg, samples, scored, losses, timer, dropped, refill) | iteration
            alert = log_step(st, step, logger, alerts, bar, metrics)  # ALERTS: one line each as it fires
            if due(cfg.log.sample_every, step) or (cfg.log.sample_every and step == st.start):
                log_samples(st, step, logger, samples, scored, advantages)
            stop = stop_reason(st, cfg, step, alert, signals)  # log.stop_on's alert, a signal, stuck updates
            if stop is not None or due(cfg.log.checkpoint_every, step):
                checkpoint(st, step + 1)
            if isinstance(stop, StoppedByAlert):
                stopped = stop
                break  # the report is still written; the run then ends with the stop, not "done"
            if stop is not None:
                raise stop
        else:
            step = t.steps
            if step > st.start:  # a finished run resumed writes its report only: its checkpoint is kept as it is
                checkpoint(st, step)
    except StoppedBySignal as e:
        print(e.line, file=sys.stderr)
        raise
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
        signals.at_once()  # no step is left to finish: a signal now stops at once
        if cfg.log.report:
            write_report(st, cfg, signals, step + 1 if stopped else step)
    finally:
        signals.restore()
        if logger:
            logger.close()
        if alerts:
            alerts.close()
        if lock:
            lock.release()
    if stopped is not None:
        raise stopped
    return st.run_dir


def due(every: int, step: int) -> bool:
    """Whether a thing done every `every` steps (0: never) falls after `step` (0-based)."""
    return bool(every) and (step + 1) % every == 0


# ---------------------------------------------------------------------------- around the steps


def log_step(st: RunState, step: int, logger: MetricsLogger | None, alerts: RunAlerts | None, bar,
             metrics: dict):
    """The step's metrics to metrics.jsonl and the trackers, the progress bar, and the alert they fire (the main
    process; None elsewhere)."""
    if logger is None:
        return None
    alert = alerts.observe(logger.log(step + 1, metrics), warn)
    bar.set_postfix(reward=f"{metrics['reward/total/mean']:.3f}", kl=f"{metrics['loss/kl']:.4f}")
    return alert


def log_samples(st: RunState, step: int, logger: MetricsLogger | None, samples: StepSamples, scored: Scored,
                advantages: torch.Tensor) -> None:
    """Policy and reference on the eval seeds (rollouts.compare: the images `eval` scores), four test prompts and
    four of the report's training prompts: samples/step_N.png, and to the trackers with each image's rewards,
    verdict and text plan (sample.plan); and the step's rollouts to the trackers (the main process's)."""
    from grpo_vision.evaluation.grid import save_sample_grid

    with full_weights(st.learner.model):  # every process: FSDP gathers the shards together
        if logger is None:
            return
        wants = logger.trackers.wants_grid()  # the PNG shows verdicts only: rewards are scored for the trackers
        sets = [st.prompts.test[:4], (st.prompts.train_sample or st.prompts.train)[:4]]
        parts = [compare(st.policy, st.reference, st.bundle.tokenizer, entries, 2, st.params, EVAL_SEED,
                         st.rewards if wants else None, st.bundle.judge) for entries in sets if entries]
        png = st.run_dir / "samples" / f"step_{step + 1:06d}.png"
        grid = save_sample_grid(parts, png, st.bundle.judge, root=st.run_dir)
    if wants:
        logger.trackers.log_grid(step + 1, grid["sheet"], grid_text(step + 1, grid["prompts"], grid["seeds"],
                                                                     grid["rewards"], grid["verdicts"],
                                                                     grid.get("plans")), png)
    logger.trackers.log_rollouts(step + 1, [e.prompt for e in samples.entries], samples.images,
                                 {k: v[samples.rows] for k, v in scored.raw.items()}, advantages, scored.verdicts,
                                 plan_texts(samples))


def save_run_files(st: RunState, cfg: Config, resume) -> None:
    """The run's config (a resume's changes recorded in resumes.jsonl), where its relative paths are relative to,
    and its prompts (fixed in the run)."""
    save_run_config(st.run_dir, cfg, st.start if resume else None)
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


def write_report(st: RunState, cfg: Config, stop: GracefulStop, step: int) -> None:
    """The final report of the checkpoint at `step`, with the result `eval RUN` gives for it (evaluate_loaded); a
    signal while it is written (or since the last step) stops it, saying that the training itself finished and how
    to write the report again."""
    from grpo_vision.evaluation.report import final_report
    from grpo_vision.step.load import LoadedRun

    try:
        if signum := stop.agreed(st.acc):  # every process, or one would wait in full_weights for the others
            raise Interrupted(signum)
        with full_weights(st.learner.model):  # every process: FSDP gathers the shards together
            if st.acc.is_main_process:
                run = LoadedRun(cfg, st.bundle, st.policy, st.reference, step)
                final_report(st.run_dir, run, st.rewards, st.prompts.scored())
    except Interrupted as e:
        print(f"\n[train] stopped by {signal.Signals(e.signum).name} while writing the report; the training finished "
              f"(checkpoint at step {cfg.train.steps}): {resume_command(st.run_dir, cfg, st.prompts.all())} writes the "
              "report", file=sys.stderr, flush=True)
        raise
