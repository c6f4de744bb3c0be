"""The UPDATE phase of a step: passes over the rollout, minibatches, micro-batches (accelerate syncs gradients).

`update` runs `num_iterations` passes over the step's sequences, each split into
`minibatches_per_pass` optimizer updates of micro-batches; the loss is `grpo.grpo_loss` with the
config's variant (loss_type, importance_sampling_level, delta, top_entropy_quantile). It also
measures two things the loss needs no extra pass for:

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

from grpo_vision.config import Config
from grpo_vision.distributed import as_float
from grpo_vision.grpo import grpo_loss, high_entropy_mask, k3_kl
from grpo_vision.health import NonFiniteWeightsError, RunHealth, weights_finite
from grpo_vision.sampling import sequence_logprobs


@dataclass
class StepBatch:  # what one step hands from sampling to the update, on this process
    cond: torch.Tensor  # [n, L] condition ids, n = images on this process
    tokens: torch.Tensor  # [n, N] sampled image tokens
    sample_logprobs: torch.Tensor  # [n, N] the sampler's own log-probs (the on-policy gauge reads them)
    old_logprobs: torch.Tensor  # [n, N] log-probs the ratio divides by (cached for every pass)
    ref_logprobs: torch.Tensor | None  # [n, N] reference log-probs (None without a reference)
    advantages: torch.Tensor  # [n] group-relative advantages
    entropy: torch.Tensor  # [n, N] the sampling distribution's entropy at each token


@torch.no_grad()
def old_logprobs(policy, cond, rollout, params, acc, micro: int) -> torch.Tensor:
    """The rollout's own log-probs, or, under mixed precision, a teacher-forced pass with the same
    autocast as the update, so that the first pass's ratio is exactly 1 (as TRL does)."""
    if acc.mixed_precision == "no":
        return rollout.logprobs
    with acc.autocast():
        return torch.cat([sequence_logprobs(policy, cond[i:i + micro], rollout.tokens[i:i + micro], params)
                          for i in range(0, cond.shape[0], micro)])


def reference_logprobs(policy, reference, cond, tokens, params, t) -> torch.Tensor | None:
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


def policy_tokens(batch: StepBatch, mask: torch.Tensor, quantile: float, acc) -> torch.Tensor:
    """The tokens that carry the policy term `[n, N]`: top_entropy_quantile's high-entropy tokens,
    with one threshold over the whole step (every process's entropies), or every token."""
    if quantile >= 1.0:
        return mask
    entropy = acc.gather(batch.entropy.contiguous())  # [B*G, N] global, in process order
    keep = high_entropy_mask(entropy, acc.gather(mask.to(torch.uint8)).bool(), quantile)  # [B*G, N]
    first = acc.process_index * batch.tokens.shape[0]
    return keep[first:first + batch.tokens.shape[0]]  # [n, N] this process's rows


def update(model, trainable, optimizer, scheduler, batch: StepBatch, params, cfg: Config, acc, step: int,
           health: RunHealth, seed_of) -> dict:
    """`num_iterations` passes over the step's rollouts, `minibatches_per_pass` optimizer updates each;
    `seed_of(salt)` gives the seed of each pass's order. `model` is the policy as accelerate prepared
    it: its backward passes average gradients across processes (DDP; FSDP reduce-scatters them), once
    per optimizer update, on the last micro-batch. Returns the step's loss metrics."""
    t, n = cfg.train, batch.tokens.shape[0]
    mask = torch.ones_like(batch.tokens, dtype=torch.bool)  # image sequences have a fixed length
    keep = policy_tokens(batch, mask, t.top_entropy_quantile, acc)  # [n, N]
    sums, count = {}, 0
    zero = torch.zeros((), device=batch.tokens.device)  # the logged KL and drift are summed on the device:
    kl_sum, kl_tokens, drift_sum, drift_tokens = zero.clone(), zero.clone(), zero.clone(), zero.clone()  # one sync
    for it in range(t.num_iterations):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed_of(2**31 + it)))
        for mb, minibatch in enumerate(order.view(t.minibatches_per_pass, -1)):
            micro_batches = minibatch.view(-1, t.micro_batch_size)
            # dapo / cispo: the token sum over the global minibatch's tokens; gradients are then averaged
            # over processes, so each divides by its share (TRL: num_items_in_batch / num_processes)
            num_items = (acc.reduce(mask[minibatch].sum().float(), "sum") / acc.num_processes
                         if t.loss_type in ("dapo", "cispo") else None)
            for j, idx in enumerate(micro_batches):
                # DDP averages gradients in the last micro-batch's backward only; its forward must be
                # inside no_sync too, since that is where DDP arms the reduction
                with nullcontext() if j == len(micro_batches) - 1 else acc.no_sync(model):
                    with acc.autocast():
                        logp = sequence_logprobs(model, batch.cond[idx], batch.tokens[idx], params)  # [m, N]
                    ref = batch.ref_logprobs[idx] if batch.ref_logprobs is not None else None
                    loss, m = grpo_loss(logp.float(), batch.old_logprobs[idx], ref if t.beta > 0 else None,
                                        batch.advantages[idx], mask[idx], beta=t.beta, epsilon_low=t.epsilon_low,
                                        epsilon_high=t.epsilon_high, loss_type=t.loss_type,
                                        max_tokens=batch.tokens.shape[1],
                                        importance_sampling_level=t.importance_sampling_level,
                                        delta=t.delta or None, policy_mask=keep[idx], num_items=num_items)
                    if ref is not None:  # the KL to the reference, where it was measured
                        seen = mask[idx] & ~ref.isnan()
                        kl_sum += (k3_kl(logp.detach().float(), ref.nan_to_num()) * seen).sum()
                        kl_tokens += seen.sum()
                    if it == 0 and mb == 0:  # before the first optimizer update: the on-policy gauge
                        drift_sum += (logp.detach().float() - batch.sample_logprobs[idx]).abs()[mask[idx]].sum()
                        drift_tokens += mask[idx].sum()
                    acc.backward(loss if num_items is not None else loss / len(micro_batches))
                for k, v in {"loss": loss, **m}.items():
                    # a dapo / cispo micro-batch holds its share of the minibatch's loss: log the whole
                    share = len(micro_batches) if num_items is not None and k in ("loss", "policy_loss") else 1
                    sums[k] = sums.get(k, 0.0) + float(v.detach()) * share
                count += 1
            grad_norm = as_float(acc.clip_grad_norm_(trainable, t.max_grad_norm if t.max_grad_norm > 0 else math.inf))
            # a non-finite loss or gradient skips the update; under fp16 the loss scaler's step skips it
            # and lowers the scale (it must see every overflow)
            if math.isfinite(grad_norm) or acc.scaler is not None:
                optimizer.step()
                if not weights_finite(trainable):  # finite gradients, yet e.g. a huge lr overflowed a weight
                    raise NonFiniteWeightsError(
                        f"an optimizer update at step {step + 1} made the policy's weights non-finite (gradient "
                        f"norm {grad_norm:.3g}, learning rate {scheduler.get_last_lr()[0]:.3g}); lower train.lr")
            # fp16: while the loss scaler calibrates (scale still >= 1) an overflow is its routine, not a failure
            calibrating = acc.scaler is not None and acc.scaler.get_scale() >= 1.0
            health.after_update(applied=math.isfinite(grad_norm) or calibrating)
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
    means = {k: acc.reduce(torch.tensor(v / count, device=acc.device), "mean").item() for k, v in sums.items()}
    kl = 0.0
    if batch.ref_logprobs is not None:
        kl = (acc.reduce(kl_sum.to(acc.device), "sum") / acc.reduce(kl_tokens.to(acc.device), "sum")).item()
    drift = (acc.reduce(drift_sum.to(acc.device), "sum") / acc.reduce(drift_tokens.to(acc.device), "sum")).item()
    health.after_drift(step, drift)
    out = {"loss/total": means["loss"], "loss/policy": means["policy_loss"], "loss/kl": kl,
           "loss/clip_frac_low": means["clip_frac_low"], "loss/clip_frac_high": means["clip_frac_high"],
           "loss/ratio_mean": means["ratio_mean"], "rollout/logp_drift": drift, "train/grad_norm": grad_norm}
    if t.delta:
        out["loss/delta_frac"] = means["delta_frac"]
    if t.top_entropy_quantile < 1:
        out["loss/policy_token_frac"] = means["policy_token_frac"]
    return out

