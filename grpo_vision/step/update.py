"""The UPDATE phase of a step: passes over the rollout, minibatches, micro-batches (accelerate syncs gradients).

`UpdateSettings` is made once at set-up from `train.*`: the loss's settings, the passes, minibatches and
micro-batches, the clipping, and the one decision whether a reference is measured (and on how many
sequences) and whether its KL is in the loss. `update` runs `settings.passes` passes over the step's sequences,
each split into `settings.minibatches` optimizer updates of micro-batches; the loss is `grpo.grpo_loss`.
It also measures two things the loss needs no extra pass for:

* the KL to the reference, the token mean of k3 over the sequences whose reference log-probs were
  measured (all of them with beta > 0), whether or not it is in the loss;
* the on-policy gauge `rollout/logp_drift`: the first minibatch's teacher-forced log-probs, taken
  before any optimizer update, against the sampler's own. Both come from one distribution, so the
  gap is float noise; a larger one means sampling and scoring differ (TRL corrects vLLM's such gap
  with importance sampling; here it should not exist, so it is reported).
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from grpo_vision.step import credit
from grpo_vision.grpo import (
    LossParams, TokenWeights, adaptive_entropy_coef, entropy_coef_to_apply, grpo_loss, high_entropy_mask, k3_kl,
)
from grpo_vision.run.distributed import as_float, process_slice
from grpo_vision.run.health import NonFiniteWeightsError, RunHealth, weights_finite
from grpo_vision.sampling import (
    Rollout, SamplingParams, batched_logprobs, micro_batches, sequence_logprobs, sequence_logprobs_and_entropy,
)
from grpo_vision.seeds import PASS_ORDER, step_seed


@dataclass(frozen=True)
class UpdateSettings:
    """How every step's update runs, fixed at set-up (`from_config`); `update` takes nothing else from the config."""
    loss: LossParams  # beta, clipping, loss_type, importance level, delta
    passes: int = 1  # train.num_iterations: passes over the step's sequences
    minibatches: int = 1  # train.minibatches_per_pass: optimizer updates a pass
    micro_batch: int = 8  # train.micro_batch_size: sequences a forward pass (also the reference's)
    max_grad_norm: float = 1.0  # 0: no clipping
    reference: bool = False  # reference log-probs are measured: for the KL term, or only for the logged KL
    kl_sequences: int = 0  # with beta 0, measure the logged KL on this process's first N sequences (0 = all)
    policy_quantile: float = 1.0  # train.top_entropy_quantile: the tokens that carry the policy term
    recompute_old: bool = False  # rollouts in another precision: the ratio's old log-probs teacher-forced again
    token_weighting: str = "none"  # credit.py: none | stage | critical | guidance_contrastive
    group_size: int = 1  # G: the groups the weightings compare images within
    critical_fraction: float = 0.1  # critical: GCPO's share per subset
    guidance_shares: tuple[float, float] = (0.8, 0.4)  # guidance_contrastive: (top_share, top_fraction)
    stage_entropy_scale: float = 0.0  # stage: the entropy reward's scale (0: off)
    drop_flat_groups: bool = False  # train.zero_std_groups drop or resample: groups without spread leave the update
    plan_weight: float = 1.0  # train.plan_weight: what a plan token counts against an image token in the token mean

    @classmethod
    def from_config(cls, cfg) -> "UpdateSettings":
        """The settings of a config (validate() has refused beta > 0 without a reference)."""
        t = cfg.train
        # every row's reference log-probs: for the KL term, GCPO's dynamic weight, STAGE's entropy reward
        all_rows = t.beta > 0 or t.token_weighting == "critical" or (
            t.token_weighting == "stage" and t.stage_entropy_reward_scale > 0)
        return cls(LossParams.from_config(t), t.num_iterations, t.minibatches_per_pass, t.micro_batch_size,
                   t.max_grad_norm, t.reference != "none", 0 if all_rows else t.kl_metric_sequences,
                   t.top_entropy_quantile, cfg.sample.mixed_precision != "no", t.token_weighting,
                   cfg.sample.group_size, t.critical_fraction, (t.guidance_top_share, t.guidance_top_fraction),
                   t.stage_entropy_reward_scale if t.token_weighting == "stage" else 0.0,
                   t.zero_std_groups in ("drop", "resample"), t.plan_weight)

    @property
    def entropies(self) -> bool:
        """The teacher-forced passes also give each token's entropy (STAGE's entropy reward)."""
        return self.stage_entropy_scale > 0

    @property
    def kl_in_loss(self) -> bool:
        return self.reference and self.loss.beta > 0

    def reference_sequences(self, n: int) -> int:
        """How many of `n` sequences get reference log-probs (0 without a reference)."""
        if not self.reference:
            return 0
        return min(n, self.kl_sequences) if self.kl_sequences else n


# the loss metrics `update` logs every step (NaN on a step whose every group train.zero_std_groups dropped)
LOSS_KEYS = ("loss/total", "loss/policy", "loss/kl", "loss/clip_frac_low", "loss/clip_frac_high", "loss/ratio_mean",
             "rollout/logp_drift", "train/grad_norm")


@dataclass
class Measured:  # a step's teacher-forced passes, on this process's rows
    old: torch.Tensor  # [n, N] the log-probs the ratio divides by
    ref: torch.Tensor | None  # [n, N] the reference's (NaN where not measured; None: no reference)
    entropy: torch.Tensor | None = None  # [n, N] the policy's entropy at each token (STAGE's entropy reward)
    ref_entropy: torch.Tensor | None = None  # [n, N] the reference's
    contrast: tuple[torch.Tensor, torch.Tensor] | None = None  # guidance-contrastive: (prompt, null prompt) log-probs


@dataclass
class UpdateBatch:  # what the update trains on, on this process: n sequences of T + N positions (T = 0 without a plan)
    cond: torch.Tensor  # [n, L] condition ids (of the prompt and its plan, with a plan)
    rollout: Rollout  # [n] the sequences: each row's plan segment (T = 0 without a text stage), its image tokens
    sample_logprobs: torch.Tensor  # [n, T + N] the sampler's own log-probs (the on-policy gauge reads them)
    old_logprobs: torch.Tensor  # [n, T + N] log-probs the ratio divides by (cached for every pass)
    ref_logprobs: torch.Tensor | None  # [n, T + N] reference log-probs, NaN where not measured (None: no reference)
    advantages: torch.Tensor  # [n] group-relative advantages, one for both segments
    count: torch.Tensor  # [n, T + N] how much each token counts (grpo.TokenWeights.count): 1 on image tokens
    image: torch.Tensor  # [n, T + N] bool, the image segment (what the image-grid options read)
    policy_mask: torch.Tensor  # [n, T + N] bool, the tokens that carry the policy term (top_entropy_quantile)
    policy_weight: torch.Tensor | None = None  # [n, T + N] credit.py's weight of each token's policy term (None: 1)
    kl_weight: torch.Tensor | None = None  # [n, T + N] its weight of each token's KL (None: 1)
    dynamic_weight: bool = False  # GCPO: each token's surrogate times credit.dynamic_advantage_weight

    @classmethod
    def of(cls, cond: torch.Tensor, rollout, old: torch.Tensor, ref: torch.Tensor | None, advantages: torch.Tensor,
           plan_weight: float = 1.0, keep: torch.Tensor | None = None) -> "UpdateBatch":
        """The batch of drawn rollouts: each row's plan tokens (to its end) then its image tokens, one advantage
        for both, a plan token counting `plan_weight` and its padding nothing; `keep` `[n, N]`: the image tokens
        that carry the policy term (default all; a plan's tokens always carry it)."""
        image = rollout.image_segment  # [n, T + N]
        keep = torch.ones_like(rollout.tokens, dtype=torch.bool) if keep is None else keep
        mask = torch.cat([torch.ones_like(rollout.plan.mask), keep], 1)  # [n, T + N]
        return cls(cond, rollout, rollout.sequence_logprobs, old, ref, advantages, rollout.count(plan_weight), image,
                   mask)

    def select(self, keep: torch.Tensor) -> "UpdateBatch":
        """The batch of the rows `keep` ([n] bool) only."""
        pick = {k: (v[keep] if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return UpdateBatch(**pick | {"rollout": self.rollout.select(keep)})

    def image_part(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """`x` `[n, N]` on the image grid as `[n, T + N]`: a per-token weight that the image grid defines leaves a
        plan's tokens at weight 1 (their count still applies) and its padding at 0."""
        return None if x is None else torch.cat([self.rollout.plan.mask.to(x.dtype), x], 1)


def token_weights(settings: UpdateSettings, policy, tokenizer, batch: UpdateBatch, entropy: torch.Tensor,
                  cond_logprobs=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(policy weight, KL weight) `[n, N]` of `settings.token_weighting` for this process's whole groups (credit.py):
    STAGE from the tokens' VQ code vectors and the advantages, GCPO from the sampling entropy (the guided
    distribution's) and the tokens' input embeddings, guidance-contrastive from `cond_logprobs`, the
    (conditional, null-prompt) log-probs of the sampled tokens. None, None: every token alike."""
    kind, G = settings.token_weighting, settings.group_size
    if kind == "stage":
        return credit.stage_weights(tokenizer.code_vectors(batch.rollout.tokens).float(), batch.advantages, G)
    if kind == "critical":
        embeddings = getattr(policy, "module", policy).token_embeddings(batch.rollout.tokens).float()
        chosen = credit.critical_tokens(entropy.float(), embeddings, tuple(policy.image_grid), G,
                                        settings.critical_fraction)
        return credit.critical_weights(chosen)
    if kind == "guidance_contrastive":
        share, fraction = settings.guidance_shares
        return credit.guidance_contrastive_weights(*cond_logprobs, top_share=share, top_fraction=fraction)
    return None, None


def contrast_logprobs(policy, cond: torch.Tensor, rollout: Rollout, params: SamplingParams,
                      micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs `[n, N]` of the sampled tokens given the prompt and given the null prompt, without guidance,
    temperature or filters (the guidance-contrastive source scores both branches at T = 1): two no-grad passes."""
    plain = dataclasses.replace(params, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0, logprob_mode="conditional")
    null = getattr(policy, "module", policy).null_condition(cond)
    image = rollout.image_only()  # the weighting is defined on the image grid
    return batched_logprobs(policy, cond, image, plain, micro), batched_logprobs(policy, null, image, plain, micro)


@dataclass
class EntropyControl:  # train.use_adaptive_entropy: Skywork-OR1's coefficient as TRL 1.16 steps it (grpo.py)
    coef: float  # the coefficient, stepped after every optimizer update
    target: float
    delta: float
    low: float
    high: float
    last: float = math.inf  # the previous update's mean token entropy (none yet: the bonus waits, as TRL's)

    def applied(self) -> float:
        return entropy_coef_to_apply(self.coef, self.last, self.target)

    def observe(self, entropy: float) -> None:
        self.coef = adaptive_entropy_coef(self.coef, entropy, self.target, self.delta, self.low, self.high)
        self.last = entropy

    def state(self) -> list:  # for trainer_state.json (JSON has no inf)
        return [self.coef, None if math.isinf(self.last) else self.last]

    def load(self, state: list) -> None:
        self.coef, self.last = float(state[0]), math.inf if state[1] is None else float(state[1])


@dataclass
class Learner:  # what an update changes, and what watches it
    model: torch.nn.Module  # the policy as accelerate prepared it (DDP / FSDP): the update's forward passes
    trainable: list[torch.Tensor]  # the parameters the optimizer updates
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    acc: object  # accelerate.Accelerator
    health: RunHealth  # skipped updates, non-finite weights, log-prob drift
    entropy: EntropyControl | None = None  # the adaptive entropy coefficient (None: a fixed one, or none)


def old_logprobs(policy, cond, rollout, params: SamplingParams, acc, micro: int, recompute: bool = False) -> torch.Tensor:
    """The rollout's own log-probs (`[n, T + N]` with a plan: its plan's, then its image's), or, under mixed
    precision (or `recompute`: rollouts in another precision than the update's), a teacher-forced pass with the
    same autocast as the update, so that the first pass's ratio is exactly 1 (as TRL does)."""
    if acc.mixed_precision == "no" and not recompute:
        return rollout.sequence_logprobs
    with acc.autocast():
        return batched_logprobs(policy, cond, rollout, params, micro)


def reference_logprobs(policy, reference, cond, rollout: Rollout, params: SamplingParams,
                       settings: UpdateSettings) -> torch.Tensor | None:
    """Reference log-probs `[n, T + N]` of the rows' sequences, plan and image (None without a reference);
    with beta 0 and `kl_metric_sequences`, only the first rows are computed (the KL is only logged) and the others
    are NaN, meaning "not measured"."""
    n = cond.shape[0]
    measured = settings.reference_sequences(n)
    if not measured:
        return None
    ref = reference.logprobs(policy, cond[:measured], rollout.select(torch.arange(measured)), params,
                             settings.micro_batch)
    if measured == n:
        return ref
    return torch.cat([ref, ref.new_full((n - measured, ref.shape[1]), float("nan"))])


def policy_tokens(entropy: torch.Tensor, quantile: float, acc) -> torch.Tensor:
    """The tokens that carry the policy term `[n, N]`: top_entropy_quantile's high-entropy tokens,
    with one threshold over the whole step (every process's entropies), or every token."""
    if quantile >= 1.0:
        return torch.ones_like(entropy, dtype=torch.bool)
    keep = high_entropy_mask(acc.gather(entropy.contiguous()), quantile)  # [B*G, N] global, in process order
    return keep[process_slice(keep.shape[0], acc)]  # [n, N] this process's rows


def update(learner: Learner, batch: UpdateBatch, params: SamplingParams, settings: UpdateSettings, seed: int,
           step: int) -> dict:
    """`settings.passes` passes over the step's sequences, each in the order drawn from `(seed, step)`
    (seeds.PASS_ORDER), `settings.minibatches` optimizer updates a pass. The backward passes go through
    `learner.model`, so DDP averages gradients (FSDP reduce-scatters them) once per optimizer update, on
    the last micro-batch. Returns the step's loss metrics."""
    stats = UpdateStats(batch.cond.device)
    for k in range(settings.passes):
        order = torch.randperm(batch.cond.shape[0],
                               generator=torch.Generator().manual_seed(step_seed(seed, step, PASS_ORDER + k)))
        # tensor_split: the same minibatches as a view when they divide evenly (dropped groups may leave fewer rows)
        for mb, rows in enumerate(order.tensor_split(settings.minibatches)):
            if not len(rows):
                continue
            entropy = backward(learner, batch, rows, params, settings, stats, gauge=k == mb == 0)
            stats.grad_norm = optimizer_step(learner, settings.max_grad_norm, step)
            if learner.entropy is not None:  # the next update's coefficient, from this one's mean entropy
                learner.entropy.observe(entropy)
    return stats.metrics(learner, settings, step)


def backward(learner: Learner, batch: UpdateBatch, rows: torch.Tensor, params: SamplingParams,
             settings: UpdateSettings, stats: UpdateStats, gauge: bool) -> float:
    """Accumulate the gradient of one minibatch (`rows` of the batch) over its micro-batches. `gauge`:
    the first minibatch of the step, before any optimizer update, where the on-policy drift is read."""
    acc, chunks = learner.acc, micro_batches(rows, settings.micro_batch)
    entropies = []  # each micro-batch's mean token entropy (the entropy bonus's)
    # the adaptive controller's coefficient for this update, in place of the configured one
    p = settings.loss if learner.entropy is None else dataclasses.replace(settings.loss,
                                                                          entropy_coef=learner.entropy.applied())
    # dapo / cispo: each micro-batch's token sum over the global minibatch's tokens (N times its rows over every
    # process), and with token weights its weight sum, so that the summed micro-batch losses make one mean; DDP
    # then averages the processes' gradients, so each divides by its share (TRL: num_items_in_batch / num_processes)
    # (the tokens that count, in sequences of T + N: every row without a plan)
    summed, seqs, total = p.loss_type in ("dapo", "cispo"), None, None
    if summed:
        seqs = acc.reduce(batch.count[rows].sum().float().to(acc.device), "sum") / acc.num_processes / batch.count.shape[1]
    if summed and batch.policy_weight is not None:
        total = acc.reduce(batch.policy_weight[rows].sum().float(), "sum") / acc.num_processes + 1e-6
    for j, idx in enumerate(chunks):
        # DDP averages gradients in the last micro-batch's backward only; its forward must be inside
        # no_sync too, since that is where DDP arms the reduction
        with nullcontext() if j == len(chunks) - 1 else acc.no_sync(learner.model):
            entropy, rollout = None, batch.rollout.select(idx)
            with acc.autocast():
                if settings.loss.entropy_coef > 0 or learner.entropy is not None:  # the bonus: entropies with gradient
                    logp, entropy = sequence_logprobs_and_entropy(learner.model, batch.cond[idx], rollout, params)
                else:  # [m, T + N]
                    logp = sequence_logprobs(learner.model, batch.cond[idx], rollout, params)
            ref = batch.ref_logprobs[idx] if batch.ref_logprobs is not None else None
            dynamic = credit.dynamic_advantage_weight(logp.float(), ref) if batch.dynamic_weight else None  # [m, N]
            count = batch.count[idx]
            weights = TokenWeights(batch.policy_mask[idx], _pick(batch.policy_weight, idx),
                                   _pick(batch.kl_weight, idx), dynamic, total, count)
            loss, m = grpo_loss(logp.float(), batch.old_logprobs[idx], ref if settings.kl_in_loss else None,
                                batch.advantages[idx], p, weights, entropy, seqs)
            if entropy is not None:
                entropies.append(m["entropy"])
            stats.add_tokens(logp.detach().float(), ref, batch.sample_logprobs[idx] if gauge else None,
                             count > 0)
            acc.backward(loss if summed else loss / len(chunks))
        # a dapo / cispo micro-batch holds its share of the minibatch's loss: log the whole
        stats.add_losses({"loss": loss, **m}, share=len(chunks) if summed else 1)
    if not entropies:
        return math.nan
    return acc.reduce(torch.stack(entropies).mean().to(acc.device), "mean").item()  # every process's mean


def _pick(x: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if x is None else x[idx]


def optimizer_step(learner: Learner, max_grad_norm: float, step: int) -> float:
    """Clip, step, check the weights, zero the gradients, advance the schedule; returns the gradient norm.
    A non-finite loss or gradient skips the update; under fp16 the loss scaler's step skips it and
    lowers the scale (it must see every overflow)."""
    acc, optimizer, scheduler = learner.acc, learner.optimizer, learner.scheduler
    grad_norm = as_float(acc.clip_grad_norm_(learner.trainable, max_grad_norm if max_grad_norm > 0 else math.inf))
    if math.isfinite(grad_norm) or acc.scaler is not None:
        optimizer.step()
        if not weights_finite(learner.trainable):  # finite gradients, yet e.g. a huge lr overflowed a weight
            raise NonFiniteWeightsError(
                f"an optimizer update at step {step + 1} made the policy's weights non-finite (gradient "
                f"norm {grad_norm:.3g}, learning rate {scheduler.get_last_lr()[0]:.3g}); lower train.lr")
    # fp16: while the loss scaler calibrates (scale still >= 1) an overflow is its routine, not a failure
    calibrating = acc.scaler is not None and acc.scaler.get_scale() >= 1.0
    learner.health.after_update(applied=math.isfinite(grad_norm) or calibrating)
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return grad_norm


class UpdateStats:
    """What one step's update logs: the micro-batch mean of each loss metric, and the KL and the
    on-policy drift as token sums, all kept on the device (read once, at the end: one sync a step)."""

    def __init__(self, device):
        # each loss metric's sum over the micro-batches, [] on the device: float32 values summed in float64, the
        # mean rounded to float32 once (for the collective), so the step's micro-batch count adds no rounding
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0  # micro-batches
        wide = torch.float32 if torch.device(device).type == "mps" else torch.float64  # MPS has no float64
        self.zero64 = torch.zeros((), dtype=wide, device=device)
        zero = torch.zeros((), device=device)
        self.kl_sum, self.kl_tokens, self.drift_sum, self.drift_tokens = zero.clone(), zero.clone(), zero.clone(), zero
        self.grad_norm = 0.0  # the last optimizer update's
        self.kl_measured = False  # the batch had reference log-probs

    def add_tokens(self, logp: torch.Tensor, ref: torch.Tensor | None, sampled: torch.Tensor | None,
                   present: torch.Tensor) -> None:
        """A micro-batch's detached log-probs `[m, T + N]`: the KL where the reference was measured, and
        the drift from the sampler's log-probs `sampled` when given; `present` `[m, T + N]`: the tokens that exist
        (a plan's padding does not), over which both are token means."""
        if ref is not None:
            self.kl_measured = True
            seen = ~ref.isnan() & present  # [m, N]
            self.kl_sum += (k3_kl(logp, ref.nan_to_num()) * seen).sum()
            self.kl_tokens += seen.sum()
        if sampled is not None:
            self.drift_sum += ((logp - sampled).abs() * present).sum()
            self.drift_tokens += present.sum()

    def add_losses(self, values: dict[str, torch.Tensor], share: int) -> None:
        """A micro-batch's loss metrics (0-d), added on the device without reading them; its loss and policy loss
        count `share` times (a dapo / cispo micro-batch's loss is its share of the minibatch's)."""
        for k, v in values.items():
            v = v.detach().to(self.zero64.device, self.zero64.dtype) * (share if k in ("loss", "policy_loss") else 1)
            self.sums[k] = self.sums.get(k, self.zero64) + v  # []
        self.count += 1

    def metrics(self, learner: Learner, settings: UpdateSettings, step: int) -> dict:
        acc = learner.acc
        keys = list(self.sums)
        means = acc.reduce((torch.stack([self.sums[k] for k in keys]) / self.count).float().to(acc.device),
                           "mean")  # [K] every process's mean of its micro-batch means
        totals = acc.reduce(torch.stack([self.kl_sum, self.kl_tokens, self.drift_sum, self.drift_tokens])
                            .to(acc.device), "sum")  # [4]
        values = torch.cat([means, totals[0::2] / totals[1::2]]).tolist()  # the step's one host sync
        means, (kl, drift) = dict(zip(keys, values)), values[len(keys):]
        kl = kl if self.kl_measured else 0.0
        learner.health.after_drift(step, drift)
        out = dict(zip(LOSS_KEYS, (means["loss"], means["policy_loss"], kl, means["clip_frac_low"],
                                   means["clip_frac_high"], means["ratio_mean"], drift, self.grad_norm)))
        if settings.loss.delta:
            out["loss/delta_frac"] = means["delta_frac"]
        if settings.policy_quantile < 1:
            out["loss/policy_token_frac"] = means["policy_token_frac"]
        for key in ("off_policy_frac", "entropy"):  # only where the option that makes them is on
            if key in means:
                out[f"loss/{key}"] = means[key]
        if learner.entropy is not None:
            out["loss/entropy_coef"] = learner.entropy.coef
        return out
