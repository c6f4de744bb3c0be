"""The UPDATE phase of a step: passes over the rollout, minibatches, micro-batches (accelerate syncs gradients).

`update` runs `num_iterations` passes over the step's sequences, each split into
`minibatches_per_pass` optimizer updates of micro-batches; the loss is `grpo.grpo_loss` with the
config's `LossParams`. It also measures two things the loss needs no extra pass for:

* the KL to the reference, the token mean of k3 over the sequences whose reference log-probs were
  measured (all of them with beta > 0), whether or not it is in the loss;
* the on-policy gauge `rollout/logp_drift`: the first minibatch's teacher-forced log-probs, taken
  before any optimizer update, against the sampler's own. Both come from one distribution, so the
  gap is float noise; a larger one means sampling and scoring differ (TRL corrects vLLM's such gap
  with importance sampling; here it should not exist, so it is reported).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from grpo_vision.config import TrainConfig
from grpo_vision.grpo import LossParams, grpo_loss, high_entropy_mask, k3_kl
from grpo_vision.run.distributed import as_float, process_slice
from grpo_vision.run.health import NonFiniteWeightsError, RunHealth, weights_finite
from grpo_vision.sampling import SamplingParams, batched_logprobs, micro_batches, sequence_logprobs
from grpo_vision.seeds import PASS_ORDER, step_seed


@dataclass
class UpdateBatch:  # what the update trains on, on this process: n sequences of N tokens
    cond: torch.Tensor  # [n, L] condition ids
    tokens: torch.Tensor  # [n, N] sampled image tokens
    mask: torch.Tensor  # [n, N] bool, the tokens of each sequence (all of them for fixed-length images)
    sample_logprobs: torch.Tensor  # [n, N] the sampler's own log-probs (the on-policy gauge reads them)
    old_logprobs: torch.Tensor  # [n, N] log-probs the ratio divides by (cached for every pass)
    ref_logprobs: torch.Tensor | None  # [n, N] reference log-probs, NaN where not measured (None: no reference)
    advantages: torch.Tensor  # [n] group-relative advantages
    policy_mask: torch.Tensor  # [n, N] bool, the tokens that carry the policy term (top_entropy_quantile)


@dataclass
class Learner:  # what an update changes, and what watches it
    model: torch.nn.Module  # the policy as accelerate prepared it (DDP / FSDP): the update's forward passes
    trainable: list[torch.Tensor]  # the parameters the optimizer updates
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    acc: object  # accelerate.Accelerator
    health: RunHealth  # skipped updates, non-finite weights, log-prob drift


def old_logprobs(policy, cond, rollout, params: SamplingParams, acc, micro: int, recompute: bool = False) -> torch.Tensor:
    """The rollout's own log-probs, or, under mixed precision (or `recompute`: rollouts in another precision
    than the update's), a teacher-forced pass with the same autocast as the update, so that the first pass's
    ratio is exactly 1 (as TRL does)."""
    if acc.mixed_precision == "no" and not recompute:
        return rollout.logprobs
    with acc.autocast():
        return batched_logprobs(policy, cond, rollout.tokens, params, micro)


def reference_logprobs(policy, reference, cond, tokens, params: SamplingParams, t: TrainConfig) -> torch.Tensor | None:
    """Reference log-probs `[n, N]`; with beta 0 and `kl_metric_sequences`, only the first rows are
    computed (the KL is only logged) and the others are NaN, meaning "not measured"."""
    if t.reference == "none":
        return None
    n = cond.shape[0]
    measured = min(n, t.kl_metric_sequences) if t.beta == 0 and t.kl_metric_sequences else n
    ref = reference.logprobs(policy, cond[:measured], tokens[:measured], params, t.micro_batch_size)
    if measured == n:
        return ref
    return torch.cat([ref, ref.new_full((n - measured, ref.shape[1]), float("nan"))])


def policy_tokens(entropy: torch.Tensor, mask: torch.Tensor, quantile: float, acc) -> torch.Tensor:
    """The tokens that carry the policy term `[n, N]`: top_entropy_quantile's high-entropy tokens,
    with one threshold over the whole step (every process's entropies), or every token."""
    if quantile >= 1.0:
        return mask
    keep = high_entropy_mask(acc.gather(entropy.contiguous()), acc.gather(mask.to(torch.uint8)).bool(),
                             quantile)  # [B*G, N] global, in process order
    return keep[process_slice(keep.shape[0], acc)]  # [n, N] this process's rows


def update(learner: Learner, batch: UpdateBatch, params: SamplingParams, t: TrainConfig, seed: int,
           step: int) -> dict:
    """`num_iterations` passes over the step's sequences, each in the order drawn from `(seed, step)`
    (seeds.PASS_ORDER), `minibatches_per_pass` optimizer updates a pass. The backward passes go through
    `learner.model`, so DDP averages gradients (FSDP reduce-scatters them) once per optimizer update, on
    the last micro-batch. Returns the step's loss metrics."""
    loss_params, stats = LossParams.from_config(t), UpdateStats(batch.tokens.device)
    for k in range(t.num_iterations):
        order = torch.randperm(batch.tokens.shape[0],
                               generator=torch.Generator().manual_seed(step_seed(seed, step, PASS_ORDER + k)))
        for mb, rows in enumerate(order.view(t.minibatches_per_pass, -1)):
            backward(learner, batch, rows, params, loss_params, t.micro_batch_size, stats, gauge=k == mb == 0)
            stats.grad_norm = optimizer_step(learner, t.max_grad_norm, step)
    return stats.metrics(learner, t, step)


def backward(learner: Learner, batch: UpdateBatch, rows: torch.Tensor, params: SamplingParams, p: LossParams,
             micro: int, stats: UpdateStats, gauge: bool) -> None:
    """Accumulate the gradient of one minibatch (`rows` of the batch) over its micro-batches. `gauge`:
    the first minibatch of the step, before any optimizer update, where the on-policy drift is read."""
    acc, chunks = learner.acc, micro_batches(rows, micro)
    # dapo / cispo: the token sum over the global minibatch's tokens; gradients are then averaged
    # over processes, so each divides by its share (TRL: num_items_in_batch / num_processes)
    num_items = (acc.reduce(batch.mask[rows].sum().float(), "sum") / acc.num_processes
                 if p.loss_type in ("dapo", "cispo") else None)
    for j, idx in enumerate(chunks):
        # DDP averages gradients in the last micro-batch's backward only; its forward must be inside
        # no_sync too, since that is where DDP arms the reduction
        with nullcontext() if j == len(chunks) - 1 else acc.no_sync(learner.model):
            with acc.autocast():
                logp = sequence_logprobs(learner.model, batch.cond[idx], batch.tokens[idx], params)  # [m, N]
            ref, mask = (batch.ref_logprobs[idx] if batch.ref_logprobs is not None else None), batch.mask[idx]
            loss, m = grpo_loss(logp.float(), batch.old_logprobs[idx], ref if p.beta > 0 else None,
                                batch.advantages[idx], mask, p, max_tokens=batch.tokens.shape[1],
                                policy_mask=batch.policy_mask[idx], num_items=num_items)
            stats.add_tokens(logp.detach().float(), ref, batch.sample_logprobs[idx] if gauge else None, mask)
            acc.backward(loss if num_items is not None else loss / len(chunks))
        # a dapo / cispo micro-batch holds its share of the minibatch's loss: log the whole
        stats.add_losses({"loss": loss, **m}, share=len(chunks) if num_items is not None else 1)


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
    on-policy drift as token sums kept on the device (read once, at the end: one sync a step)."""

    def __init__(self, device):
        self.sums: dict[str, float] = {}
        self.count = 0  # micro-batches
        zero = torch.zeros((), device=device)
        self.kl_sum, self.kl_tokens, self.drift_sum, self.drift_tokens = zero.clone(), zero.clone(), zero.clone(), zero
        self.grad_norm = 0.0  # the last optimizer update's
        self.kl_measured = False  # the batch had reference log-probs

    def add_tokens(self, logp: torch.Tensor, ref: torch.Tensor | None, sampled: torch.Tensor | None,
                   mask: torch.Tensor) -> None:
        """A micro-batch's detached log-probs `[m, N]`: the KL where the reference was measured, and
        the drift from the sampler's log-probs `sampled` when given."""
        if ref is not None:
            self.kl_measured = True
            seen = mask & ~ref.isnan()  # [m, N]
            self.kl_sum += (k3_kl(logp, ref.nan_to_num()) * seen).sum()
            self.kl_tokens += seen.sum()
        if sampled is not None:
            self.drift_sum += (logp - sampled).abs()[mask].sum()
            self.drift_tokens += mask.sum()

    def add_losses(self, values: dict[str, torch.Tensor], share: int) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v.detach()) * (share if k in ("loss", "policy_loss") else 1)
        self.count += 1

    def metrics(self, learner: Learner, t: TrainConfig, step: int) -> dict:
        acc = learner.acc
        means = {k: acc.reduce(torch.tensor(v / self.count, device=acc.device), "mean").item()
                 for k, v in self.sums.items()}
        kl = 0.0
        if self.kl_measured:
            kl = (acc.reduce(self.kl_sum.to(acc.device), "sum")
                  / acc.reduce(self.kl_tokens.to(acc.device), "sum")).item()
        drift = (acc.reduce(self.drift_sum.to(acc.device), "sum")
                 / acc.reduce(self.drift_tokens.to(acc.device), "sum")).item()
        learner.health.after_drift(step, drift)
        out = {"loss/total": means["loss"], "loss/policy": means["policy_loss"], "loss/kl": kl,
               "loss/clip_frac_low": means["clip_frac_low"], "loss/clip_frac_high": means["clip_frac_high"],
               "loss/ratio_mean": means["ratio_mean"], "rollout/logp_drift": drift, "train/grad_norm": self.grad_norm}
        if t.delta:
            out["loss/delta_frac"] = means["delta_frac"]
        if t.top_entropy_quantile < 1:
            out["loss/policy_token_frac"] = means["policy_token_frac"]
        return out
