"""Run health: the checks that stop a run that cannot learn, and the counts that say a run did not.

A run that learns nothing must not look like a success. Each step the loop asks `RunHealth` about
the step's rewards (was there a trained reward at all, did any group have a spread), and after each
optimizer update `weights_finite` checks the weights. The counts live in the run's `counters`, which
every checkpoint saves, so a resumed run counts on exactly where the straight run would be:

    skipped_updates        optimizer updates skipped for a non-finite loss or gradient
    skipped_in_a_row       the current streak of them; `train.max_skipped_updates` in a row stop the run
    steps_no_spread        steps in which every group's rewards were equal (zero advantages everywhere)
    steps_without_signal   steps in which no image had a trained reward (all NaN, or all weights 0)
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

# rollout/logp_drift above which a run warns (docs/usage.md has the measured values): float32 noise
# stays far below the first, bf16 / fp16 rounding (weights or autocast) below the second; a sampler
# and a scorer that disagree on temperature, top-k or CFG give gaps of tenths of a nat
DRIFT_WARN = {"float32": 1e-3, "low_precision": 5e-2}
COUNTERS = ("skipped_updates", "skipped_in_a_row", "steps_no_spread", "steps_without_signal")


class TrainingHealthError(RuntimeError):
    """Training stopped because it could not learn; the message says why and where its weights are."""


class NonFiniteWeightsError(TrainingHealthError):
    """An optimizer update left a weight NaN or infinite; nothing after it may be checkpointed."""


def warn(message: str) -> None:
    tqdm.write(f"[train] WARNING: {message}", file=sys.stderr)  # on a line of its own, under the progress bar


@torch.no_grad()
def weights_finite(params: list[torch.Tensor]) -> bool:
    """True when every weight is finite. One fused norm kernel and one sync per call; only when a
    norm is not finite (it can overflow for huge but finite weights) are the weights read in full."""
    if not params:
        return True
    if bool(torch.isfinite(torch.stack(torch._foreach_norm(params)).float()).all()):
        return True
    return all(bool(torch.isfinite(p).all()) for p in params)


class RunHealth:
    """Counts the steps that cannot teach anything and warns about them once on stderr (`loud` on the
    main process only); stops the run after `max_skipped` skipped updates in a row (0 = never)."""

    def __init__(self, counters: dict | None, max_skipped: int, loud: bool, drift_limit: float = DRIFT_WARN["float32"]):
        """`counters`: a resumed run's, from its checkpoint; None starts them at 0."""
        self.counters = dict.fromkeys(COUNTERS, 0) if counters is None else counters
        self.max_skipped, self.loud = max_skipped, loud
        self.drift_limit = drift_limit
        self.warned: set[str] = set()

    def _warn_once(self, key: str, message: str) -> None:
        if self.loud and key not in self.warned:
            self.warned.add(key)
            warn(message)

    def after_rewards(self, step: int, total: torch.Tensor, raw: dict[str, torch.Tensor],
                      weights: dict[str, torch.Tensor], frac_zero_std: float) -> dict[str, int]:
        """Count this step's (global, gathered) rewards `[B*G]`; returns the counters as metrics."""
        trained = [n for n, w in weights.items() if bool((w != 0).any())]
        silent = [n for n in trained if bool(raw[n][weights[n] != 0].isnan().all())]  # applied to none it weighs
        no_signal = bool(total.isnan().all())
        if silent and not no_signal:  # other rewards still teach; name the silent ones
            self._warn_once(f"nan:{silent}", f"step {step + 1}: reward(s) {', '.join(map(repr, silent))} returned NaN "
                                             "(does not apply) for every image they are trained on; they teach nothing")
        if no_signal:
            self.counters["steps_without_signal"] += 1
            why = ("every prompt entry of the step gives weight 0 to every reward" if not trained else
                   f"the trained rewards ({', '.join(map(repr, trained))}) returned NaN for every image they weigh")
            self._warn_once("no_signal", f"step {step + 1} has nothing to learn from: {why}. Such steps are counted "
                                         "in train/steps_without_signal")
        elif frac_zero_std == 1.0:
            self._warn_once("no_spread", f"step {step + 1}: in every group all images got the same reward, so every "
                                         "advantage is 0. Such steps are counted in train/steps_no_spread")
        if frac_zero_std == 1.0:  # an all-NaN step has no spread either
            self.counters["steps_no_spread"] += 1
        return self.metrics()

    def after_update(self, applied: bool) -> None:
        """Record one optimizer update, applied or skipped for a non-finite loss or gradient."""
        if applied:
            self.counters["skipped_in_a_row"] = 0
        else:
            self.counters["skipped_updates"] += 1
            self.counters["skipped_in_a_row"] += 1

    def after_drift(self, step: int, drift: float) -> None:
        """Warn once when the rollout's log-probs and the teacher-forced ones differ by more than float
        noise (`rollout/logp_drift`, nats per token): the policy is then trained on another
        distribution than the one it sampled from."""
        if drift > self.drift_limit:
            self._warn_once("drift", f"step {step + 1}: rollout/logp_drift is {drift:.3g} nats per token: the "
                                     "sampler's log-probs and the update's teacher-forced ones differ beyond float "
                                     "noise. Usual causes: temperature, top-k / top-p or CFG differ between "
                                     "sampling and scoring, or the precision does (train.mixed_precision, "
                                     "policy.dtype); a policy whose KV-cache decode does not match its full "
                                     "forward pass")

    def too_many_skipped(self) -> bool:
        return bool(self.max_skipped) and self.counters["skipped_in_a_row"] >= self.max_skipped

    def stuck(self, step: int, run_dir) -> TrainingHealthError:
        """The error that stops a run after too many skipped updates, once its checkpoint at `step` is saved."""
        return TrainingHealthError(
            f"{self.counters['skipped_in_a_row']} optimizer updates in a row were skipped (non-finite loss or "
            f"gradient; train.max_skipped_updates={self.max_skipped}): saved a checkpoint at step {step} in "
            f"{run_dir}; lower train.lr or check the rewards before resuming")

    def metrics(self) -> dict[str, int]:
        return {f"train/{k}": self.counters[k] for k in ("skipped_updates", "steps_no_spread", "steps_without_signal")}


def run_summary(metrics: list[dict], updates_per_step: int) -> tuple[int, int, list[str]]:
    """(skipped updates, updates, the learning warnings) of a run's metrics rows, for the final line
    and the report."""
    last = metrics[-1] if metrics else {}
    updates = int(last.get("step", 0)) * updates_per_step
    return int(last.get("train/skipped_updates") or 0), updates, learning_warnings(last, updates_per_step)


def learning_warnings(last: dict, updates_per_step: int) -> list[str]:
    """Why a finished run may not have learned, from its last metrics row; empty when nothing is wrong."""
    steps = int(last.get("step", 0))
    updates = steps * updates_per_step
    skipped = int(last.get("train/skipped_updates") or 0)
    no_spread = int(last.get("train/steps_no_spread") or 0)
    no_signal = int(last.get("train/steps_without_signal") or 0)
    out = []
    if updates and skipped == updates:
        out.append(f"every one of the {updates} optimizer updates was skipped (non-finite loss or gradient): "
                   "the weights never changed")
    elif skipped:
        out.append(f"{skipped} of {updates} optimizer updates were skipped (non-finite loss or gradient)")
    if no_signal:
        out.append(f"{no_signal} of {steps} steps had no trained reward for any image (NaN, or weight 0): "
                   "nothing to learn from")
    if steps and no_spread == steps and no_signal < steps:
        out.append("no step had a reward spread in any group: the rewards taught the policy nothing")
    elif no_spread > no_signal:  # steps without signal have no spread either; they are named above
        out.append(f"{no_spread - no_signal} of {steps} steps had no reward spread in any group: every advantage 0")
    return out


def say_done(run_dir, cfg) -> None:
    """The line a finished `train` ends with, and the warnings of `learning_warnings` after it (exit 0: the run
    finished, but not a silent success): the CLI's and GRPOTrainer.train()'s alike."""
    from pathlib import Path

    from grpo_vision.run.metrics import load_metrics

    skipped, updates, warnings = run_summary(load_metrics(run_dir),
                                             cfg.train.num_iterations * cfg.train.minibatches_per_pass)
    done = Path(run_dir) / "report.md" if cfg.log.report else run_dir
    print(f"[train] done: {done} ({skipped} of {updates} updates skipped)", flush=True)
    for message in warnings:
        warn(message)
