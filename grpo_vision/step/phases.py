"""The phases of a GRPO step, in the order the loop (train.py) calls them: ITERATION, SAMPLING, REWARD (and the
REFILL of flat groups), the teacher-forced passes, ADVANTAGE's totals, the update's batch and passes, what follows
the update, the step's metrics, and why a run stops after a step. Each takes the run's state (`setup.RunState`)
and hands the next one a typed container: `StepSamples` -> `Scored` -> `Measured` -> `UpdateBatch`."""

from __future__ import annotations

import math
import dataclasses
import signal
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from grpo_vision.config import Config
from grpo_vision.grpo import frac_zero_std, group_std, informative_groups, normalize_then_sum
from grpo_vision.models.adapters import merged_adapter
from grpo_vision.prompts import PromptEntry
from grpo_vision.rollouts import Samples, Scored, draw, group_diversity, plan_texts, repeat, score, verdict_rates
from grpo_vision.run.distributed import full_state_dict, full_weights, gather, process_slice
from grpo_vision.run.folder import resume_command
from grpo_vision.run.health import TrainingHealthError
from grpo_vision.run.metrics import PhaseTimer, nanmean, nanstd
from grpo_vision.run.signals import GracefulStop, Interrupted
from grpo_vision.sampling import Rollout, batched_logprobs_and_entropy
from grpo_vision.seeds import IMAGE, REFILL, REFILL_IMAGE, REPLAY, step_rng, step_seed
from grpo_vision.step.credit import stage_entropy_reward
from grpo_vision.step.iterative import iteration_of, starts_iteration, update_rewards
from grpo_vision.step.setup import RunState
from grpo_vision.step.update import (
    LOSS_KEYS, Measured, UpdateBatch, contrast_logprobs, old_logprobs, policy_tokens, reference_logprobs,
    token_weights, update,
)


@dataclass
class StepSamples(Samples):  # training's draw: rollouts.Samples, and where its rows sit in the step
    chosen: np.ndarray  # [B] the step's prompt indices (every process: the same)
    rows: slice  # these rows among the step's B*G, in group order


@dataclass
class Refill:  # train.zero_std_groups=resample: what the refill found and drew
    frac_flat: float  # the fraction of the step's first groups whose reward did not vary
    groups: int  # how many new groups it sampled (their tokens count in the sampler's rate)


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


def sample_step(st: RunState, cfg: Config, step: int, timer: PhaseTimer) -> StepSamples:
    """Every process draws the step's B prompts (the same list) and samples its own whole groups, each
    image from its own seed (seeds.IMAGE + its row among the step's B*G)."""
    s = cfg.sample
    chosen = step_rng(cfg.run.seed, step).choice(len(st.prompts.train), s.prompts_per_step,
                                                 replace=len(st.prompts.train) < s.prompts_per_step)
    entries = repeat([st.prompts.train[i] for i in chosen[process_slice(s.prompts_per_step, st.acc)]], s.group_size)
    rows = process_slice(s.prompts_per_step * s.group_size, st.acc)
    seeds = [step_seed(cfg.run.seed, step, IMAGE + j) for j in range(rows.start, rows.stop)]
    return draw_step(st, cfg, entries, seeds, timer, chosen, rows)


def draw_step(st: RunState, cfg: Config, entries: list[PromptEntry], seeds: list[int], timer: PhaseTimer,
              chosen: np.ndarray, rows: slice) -> StepSamples:
    """rollouts.draw with the policy in eval mode and, with sample.merge_adapter, the adapter folded into the
    weights (put back after, bit for bit); the VQ decoding timed as its own phase."""
    st.policy.eval()
    with merged_adapter(st.policy) if st.merge else nullcontext():
        samples = draw(st.policy, st.bundle.tokenizer, entries, seeds, st.params, cfg.sample.batch_size, timer)
    return StepSamples(**vars(samples), chosen=chosen, rows=rows)


def score_step(st: RunState, cfg: Config, samples: Samples) -> Scored:
    """Every reward on this process's images, gathered from every process (in group order), and the policy
    kind's judge on them (with log.judge_rollouts; the verdicts stay this process's)."""
    local = score(st.rewards, samples.images, samples.entries, st.bundle.judge if cfg.log.judge_rollouts else None,
                  plans=plan_texts(samples))
    total = gather(st.acc, local.total)  # [B*G]
    raw = {k: gather(st.acc, v) for k, v in local.raw.items()}
    weights = {k: gather(st.acc, v) for k, v in local.weights.items()}
    if cfg.reward.combine == "normalize_then_sum":
        total = normalize_then_sum(torch.stack([raw[k] for k in st.rewards.names], 1),
                                   torch.stack([weights[k] for k in st.rewards.names], 1), cfg.sample.group_size)
    return Scored(total, raw, weights, local.reasons, local.verdicts, plan_verdicts=local.plan_verdicts)


def refill_flat_groups(st: RunState, cfg: Config, step: int, samples: StepSamples, scored: Scored,
                       timer: PhaseTimer) -> tuple[StepSamples, Scored, Refill | None]:
    """train.zero_std_groups=resample, DAPO's dynamic sampling (arXiv 2503.14476, section 3.2; verl's
    `filter_groups`): each group whose reward did not vary gives its place to a group of a prompt the step has
    not drawn, sampled and scored as the step's own, in at most train.resample_rounds rounds; a group still flat
    after them is dropped by the update as with `drop`. One process, and not with STAGE's entropy reward, which
    gives flat groups a spread (set-up and config refuse both). Other settings: the step as it was, no Refill."""
    if cfg.train.zero_std_groups != "resample":
        return samples, scored, None
    G = cfg.sample.group_size
    flat = [g for g, varies in enumerate(informative_groups(scored.total, G).tolist()) if not varies]
    refill = Refill(len(flat) / (len(samples.entries) // G), 0)
    unused = np.setdiff1d(np.arange(len(st.prompts.train)), samples.chosen)
    rng, parts = step_rng(cfg.run.seed, step, REFILL), [(samples, scored)]
    picks = [(0, g) for g in range(len(samples.entries) // G)]
    for _ in range(cfg.train.resample_rounds):
        if not flat or not len(unused):
            break
        new = rng.choice(unused, min(len(flat), len(unused)), replace=False)
        unused = np.setdiff1d(unused, new)
        entries = repeat([st.prompts.train[i] for i in new], G)
        seeds = [step_seed(cfg.run.seed, step, REFILL_IMAGE + refill.groups * G + j) for j in range(len(entries))]
        with timer("sample"), full_weights(st.learner.model):
            more = draw_step(st, cfg, entries, seeds, timer, new, slice(0, len(entries)))
        with timer("reward"):
            more_scored = score_step(st, cfg, more)
        parts.append((more, more_scored))
        refill.groups += len(new)
        for g, varies in enumerate(informative_groups(more_scored.total, G).tolist()):
            if varies:  # fills the first place still flat
                picks[flat.pop(0)] = (len(parts) - 1, g)
    if refill.groups == 0:
        return samples, scored, refill
    samples, scored = take_groups(parts, picks, G, st.policy)
    return samples, scored, refill


def take_groups(parts: list[tuple[StepSamples, Scored]], picks: list[tuple[int, int]], group_size: int,
                policy=None) -> tuple[StepSamples, Scored]:
    """The groups `picks` ((part, group) each, in order) of several samplings with their scores, as one: the
    step's batch after the refill replaced its flat groups. One process's whole groups, every field kept (the
    plans and their verdicts too), through each container's `cat` and `select`. Condition ids of several widths
    (a kind that pads each batch to its longest prompt, as Janus does) are made again by `policy`
    (rollouts.Samples.cat)."""
    offsets = np.cumsum([0] + [len(samples.entries) for samples, _ in parts])
    index = torch.tensor([int(offsets[i]) + g * group_size + j for i, g in picks for j in range(group_size)])
    chosen = np.array([parts[i][0].chosen[g] for i, g in picks])
    samples = StepSamples.cat([p[0] for p in parts], policy).select(index)
    return dataclasses.replace(samples, chosen=chosen, rows=slice(0, len(index))), \
        Scored.cat([p[1] for p in parts]).select(index)


def measure(st: RunState, samples: Samples) -> Measured:
    """The teacher-forced passes of a step: the log-probs the ratio divides by, the reference's for the KL,
    and what the token weighting reads (STAGE's entropies, guidance-contrastive's two branches)."""
    policy, settings, params, acc = st.policy, st.update, st.params, st.acc
    cond, rollout = samples.cond, samples.rollout
    old = old_logprobs(policy, cond, rollout, params, acc, settings.micro_batch,
                       recompute=settings.recompute_old)
    entropy = ref_entropy = contrast = None
    with acc.autocast():  # the update's precision, so that the KL at step 0 is exactly 0
        if settings.entropies:  # STAGE's entropy reward: both models' entropies of the distribution the ratio uses
            _, entropy = batched_logprobs_and_entropy(policy, cond, rollout, params, settings.micro_batch)
            ref, ref_entropy = st.reference.logprobs_and_entropy(policy, cond, rollout, params, settings.micro_batch)
        else:  # with a plan: both segments, the KL's too
            ref = reference_logprobs(policy, st.reference, cond, rollout, params, settings)
        if settings.token_weighting == "guidance_contrastive":
            contrast = contrast_logprobs(policy, cond, rollout, params, settings.micro_batch)
    return Measured(old, ref, entropy, ref_entropy, contrast)


def step_rewards(st: RunState, scored: Scored, measured: Measured) -> torch.Tensor:
    """The totals `[B*G]` the advantages come from: STAGE's entropy reward added to each group's best images."""
    if not st.update.entropies:
        return scored.total
    mean_entropy = gather(st.acc, measured.entropy.mean(1).float())  # [B*G] every process's images
    ref_entropy = gather(st.acc, measured.ref_entropy.mean(1).float())
    return stage_entropy_reward(scored.total, mean_entropy, ref_entropy, st.update.group_size,
                                st.update.stage_entropy_scale)


def make_update_batch(st: RunState, samples: StepSamples, measured: Measured, advantages: torch.Tensor,
                      total: torch.Tensor) -> tuple[UpdateBatch, int]:
    """The update's inputs: the tokens that carry the policy term and each token's policy and KL weights
    (train.token_weighting), without the groups train.zero_std_groups=drop leaves out; and how many it left out."""
    settings, acc = st.update, st.acc
    keep = policy_tokens(samples.rollout.entropy, settings.policy_quantile, acc)  # [n, N] the image segment's
    batch = UpdateBatch.of(samples.cond, samples.rollout, measured.old, measured.ref, advantages.to(acc.device),
                           settings.plan_weight, keep)
    batch.dynamic_weight = settings.token_weighting == "critical"
    with torch.no_grad():  # weights on the image grid; a plan's tokens at weight 1 (docs/usage.md, "Reason, then draw")
        weights = token_weights(settings, st.policy, st.bundle.tokenizer, batch, samples.rollout.entropy,
                                measured.contrast)
    batch.policy_weight, batch.kl_weight = (batch.image_part(w) for w in weights)
    return _drop_flat(batch, settings, total, samples)


def _drop_flat(batch: UpdateBatch, settings, total: torch.Tensor, samples: StepSamples) -> tuple[UpdateBatch, int]:
    """train.zero_std_groups=drop: the batch without the groups whose reward did not vary, and how many."""
    if not settings.drop_flat_groups:
        return batch, 0
    spread = informative_groups(total[samples.rows], settings.group_size)  # [groups here] (one process: set-up)
    return batch.select(spread.repeat_interleave(settings.group_size).to(batch.cond.device)), int((~spread).sum())


def update_step(st: RunState, cfg: Config, step: int, batch: UpdateBatch) -> dict:
    """The clipped GRPO loss, train.num_iterations passes (update.py); every group dropped: no update, NaN losses."""
    st.policy.train()
    if not len(batch.cond):
        return dict.fromkeys(LOSS_KEYS, math.nan)
    return update(st.learner, batch, st.params, st.update, cfg.run.seed, step)


def after_update(st: RunState, cfg: Config, step: int, samples: StepSamples) -> None:
    """A reference that moves every N steps takes the policy's weights; the step's samples join the
    replay buffer once it is done (the last iteration's would never be used)."""
    t = cfg.train
    if st.reference.mode != "none" and t.ref_sync_every and (step + 1) % t.ref_sync_every == 0:
        sync_reference(st, t.ref_model_mixup_alpha)
    if st.buffer is not None and iteration_of(step, t.steps, t.iterations) < t.iterations - 1:
        step_entries = repeat([st.prompts.train[i] for i in samples.chosen], cfg.sample.group_size)
        st.buffer.add(gather(st.acc, samples.rollout.tokens), step_entries)


def sync_reference(st: RunState, alpha: float = 1.0) -> None:
    """The reference becomes the policy (`alpha` < 1: moves that far toward it, train.ref_model_mixup_alpha); a
    frozen copy takes every weight whole, gathered from FSDP's shards."""
    st.reference.sync(st.policy, full_state_dict(st.learner.model) if st.reference.mode == "frozen" else None, alpha)


def step_metrics(st: RunState, cfg: Config, samples: StepSamples, scored: Scored, losses: dict, timer: PhaseTimer,
                 dropped: int, refill: Refill | None) -> dict:
    """The step's namespaced scalars (README, Metrics): the rewards, the judge's rates on the rollouts, the
    update's losses and the groups it dropped, the refill's counts, the health counters as the update left them
    (its skipped updates included), timings."""
    G, acc = cfg.sample.group_size, st.acc
    metrics = {f"reward/{k}/mean": nanmean(v) for k, v in scored.raw.items()}
    metrics |= {f"reward/{k}/std": nanstd(v) for k, v in scored.raw.items()}
    metrics |= {f"reward/{k}/frac_zero_std": frac_zero_std(v, G) for k, v in scored.raw.items()}
    metrics |= {f"reward/{k}/group_std": group_std(v, G) for k, v in scored.raw.items()}
    # the judge's rates on the rollouts, for the attributes this step's prompts name (none: no key, as no value)
    judge = st.bundle.judge if cfg.log.judge_rollouts else None
    judged = verdict_rates(scored.verdicts, ["correct", *judge.attributes]) if judge is not None else {}
    metrics |= {f"judge/{k}": nanmean(v) for k, v in ((k, gather(acc, v)) for k, v in judged.items())
                if not v.isnan().all()}
    metrics |= plan_metrics(st, judge, samples, scored, G)
    tokens = samples.rollout.tokens.numel() + (refill.groups if refill else 0) * G * samples.rollout.tokens.shape[1]
    return metrics | {
        "reward/total/mean": nanmean(scored.total), "reward/total/std": nanstd(scored.total),
        "reward/total/group_std": group_std(scored.total, G),
        "adv/frac_zero_std": frac_zero_std(scored.total, G), **losses,
        **({"train/groups_dropped": dropped} if st.update.drop_flat_groups else {}),
        **({"train/frac_flat_sampled": refill.frac_flat, "train/groups_resampled": refill.groups} if refill else {}),
        **st.learner.health.metrics(),
        "policy/entropy": acc.reduce(samples.rollout.entropy.mean().to(acc.device), "mean").item(),
        **decode_metrics(acc, samples.rollout),
        **timer.metrics(),
        "perf/sample_tokens_per_s": tokens / timer.seconds["sample"],
        "perf/memory_estimate_gib": st.memory_estimate / 2**30,
        "lr": st.learner.scheduler.get_last_lr()[0],
    }


def decode_metrics(acc, rollout: Rollout) -> dict:
    """With speculative decoding (sample.decode: speculative): the forward passes an image needed, the prefill
    included (plain decoding: one per token), their mean over the step's images and the slowest image's (a batch
    runs until its slowest row is done), and the tokens kept per pass; nothing for plain decoding."""
    if rollout.forwards is None:
        return {}
    passes = gather(acc, rollout.forwards.float().to(acc.device))  # [B*G]
    mean = passes.mean().item()
    return {"rollout/forwards_per_image": mean, "rollout/forwards_slowest": passes.max().item(),
            "rollout/tokens_per_forward": rollout.tokens.shape[1] / mean}


def plan_metrics(st: RunState, judge, samples: StepSamples, scored: Scored, G: int) -> dict:
    """Each group's diversity (`diversity/image_tokens`: the mean share of token positions where two of its images
    differ); with a text stage, the plans' length in tokens, the share of distinct plans in a group, and the judge's
    rates on the plans against their prompts (`plan/<attribute>`)."""
    acc = st.acc
    metrics = {"diversity/image_tokens": nanmean(gather(acc, group_diversity(samples.rollout.tokens, G).to(acc.device)))}
    plan = samples.rollout.plan
    if not plan.width:  # no text stage: no plan metrics (the segment is there, empty)
        return metrics
    distinct = torch.tensor([len(set(plan.texts[i:i + G])) / G for i in range(0, len(plan.texts), G)])
    metrics |= {"plan/length": nanmean(gather(acc, plan.mask.sum(1).float())),
                "diversity/plans": nanmean(gather(acc, distinct.to(acc.device)))}
    if judge is not None and scored.plan_verdicts:
        rates = verdict_rates(scored.plan_verdicts, ["correct", *judge.attributes])
        metrics |= {f"plan/{k}": nanmean(v) for k, v in ((k, gather(acc, v)) for k, v in rates.items())
                    if not v.isnan().all()}
    return metrics


# ---------------------------------------------------------------------------- why a run stops after a step


class StoppedByAlert(TrainingHealthError):
    """log.stop_on stopped the run at an alert it names (after its checkpoint and report): `run_dir` holds both."""

    def __init__(self, run_dir, message: str):
        super().__init__(message)
        self.run_dir = run_dir


class StoppedBySignal(Interrupted):
    """SIGINT or SIGTERM stopped the run after a step; `line` says where its checkpoint is and how to go on."""

    def __init__(self, signum: int, line: str):
        super().__init__(signum)
        self.line = line


def stop_reason(st: RunState, cfg: Config, step: int, alert, signals: GracefulStop) -> Exception | None:
    """Why the run stops after `step`, the same on every process (None: it goes on): an alert that log.stop_on
    names, a signal, or too many skipped updates in a row. The loop saves the checkpoint first."""
    go_on = lambda: resume_command(st.run_dir, cfg, st.prompts.all())  # noqa: E731
    if cfg.log.stop_on and (alert := agreed_alert(st.acc, alert)):
        return StoppedByAlert(st.run_dir, f"stopped by the {alert.name} alert at step {step + 1} (log.stop_on): a "
                              f"checkpoint is saved and alerts.jsonl holds the evidence; to go on anyway: {go_on()} "
                              "log.stop_on=[]")
    if signum := signals.agreed(st.acc):
        return StoppedBySignal(signum, f"\n[train] stopped by {signal.Signals(signum).name}: saved a checkpoint at "
                                       f"step {step + 1}; continue with: {go_on()}")
    if st.learner.health.too_many_skipped():  # skipped updates leave the weights as the last applied made them
        return st.learner.health.stuck(step + 1, st.run_dir)
    return None


def agreed_alert(acc, alert):
    """The main process's stopping alert (or None), on every process: they stop at the same step."""
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([alert])[0] if acc.num_processes > 1 else alert
