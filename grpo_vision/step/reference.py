"""The reference policy for the KL term: a frozen copy, the base model under a disabled adapter, or none.

* ``frozen``:  a deep copy of the initial policy with gradients off (doubles the weights in memory).
* ``adapter``: the policy trains a peft adapter only (`train.adapter`: LoRA, or LoHa / LoKr of the
               LyCORIS family); reference log-probs are the same network with the adapter disabled
               (`disable_adapter()`, LyCORIS's multiplier 0), so no second copy is kept.
* ``none``:    no reference; only valid with beta = 0. Sample grids and evaluation still compare
               with the base model, loaded once, on the policy's device, when first asked for.

`ref_sync_every = N` replaces the reference with the current policy every N steps (a moving anchor,
like TRL's `sync_ref_model` with mixup alpha 1). Under an adapter that means folding its update into
the base weights and zeroing the factor peft zeroes at initialisation, so the reference (adapter off)
equals the policy and the adapter starts again from no change, its tensors (and their optimizer
state) kept.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Callable

import torch

from grpo_vision.grpo import mixup_state_dict
from grpo_vision.models.adapters import ZERO_FACTORS, adapter_layers, is_adapter_weight
from grpo_vision.rewards.base import RunModels
from grpo_vision.sampling import Rollout, SamplingParams, batched_logprobs, batched_logprobs_and_entropy


class Reference:
    def __init__(self, policy, mode: str, load_base: Callable[[], torch.nn.Module] | None = None):
        """`load_base()` loads the base policy from disk: what `sampler` gives without a reference."""
        if mode not in ("frozen", "adapter", "none"):
            raise ValueError(f"reference must be frozen, adapter or none, got {mode!r}")
        self.mode = mode
        self.model = None
        self._load_base = load_base
        self._base = None  # the base policy, loaded at the first `sampler` call of a run without a reference
        self.synced = False  # True once the reference differs from the base weights on disk
        if mode == "frozen":
            self.model = copy.deepcopy(policy).eval().requires_grad_(False)

    def logprobs(self, policy, cond: torch.Tensor, rollout: Rollout, params: SamplingParams,
                 micro_batch: int) -> torch.Tensor | None:
        """Reference log-probs `[B, T + N]` of the rollouts' sequences (the KL covers both segments), in micro-batches;
        None without a reference."""
        return self._scored(batched_logprobs, policy, cond, rollout, params, micro_batch)

    def logprobs_and_entropy(self, policy, cond: torch.Tensor, rollout: Rollout, params: SamplingParams,
                             micro_batch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`logprobs` and the reference's entropy at each position `[B, T + N]` (STAGE's)."""
        return self._scored(batched_logprobs_and_entropy, policy, cond, rollout, params, micro_batch)

    def _scored(self, score, policy, *args):
        if self.mode == "none":
            return None
        if self.mode == "adapter":
            with policy.disable_adapter():
                return score(policy, *args)
        return score(self.model, *args)

    def sampler(self, policy):
        """(model, context): sampling `model` inside `context` draws from the reference (grids,
        evaluation, the demo). Without a reference: the base policy, loaded once, on `policy`'s device."""
        if self.mode == "frozen":
            return self.model, nullcontext()
        if self.mode == "adapter":
            return policy, policy.disable_adapter()
        if self._base is None:
            if self._load_base is None:
                raise ValueError("this run has no reference (train.reference: none) and no way to load its base "
                                 "policy: pass load_base to Reference")
            device = next(policy.parameters()).device
            self._base = self._load_base().to(device).eval().requires_grad_(False)
        return self._base, nullcontext()

    def models(self, policy) -> RunModels:
        """The run's networks as a reward that scores with them sees them (rewards/base.py RunModels): this
        reference, as `sampler` gives it, and the policy itself."""
        return RunModels(reference=lambda: self.sampler(policy), policy=lambda: (policy, nullcontext()))

    @torch.no_grad()
    def sync(self, policy, weights: dict | None = None, alpha: float = 1.0) -> None:
        """Make the reference equal to the current policy (whose whole `weights` a sharded run passes), or with
        `alpha` < 1 (a frozen copy only) move it that far toward the policy (TR-DPO, grpo.mixup_state_dict)."""
        if self.mode == "frozen":
            weights = policy.state_dict() if weights is None else weights
            if alpha != 1.0:
                weights = mixup_state_dict(weights, self.model.state_dict(), alpha)
            self.model.load_state_dict(weights)
        elif self.mode == "adapter":
            for module, name in adapter_layers(policy):  # fold each adapter into its base weight, then zero it
                merged = module.base_layer.weight + module.get_delta_weight(name)  # [out, in]
                magnitude = getattr(module, "lora_magnitude_vector", {})
                if name in magnitude:  # DoRA: W' = m (W + sBA) / ||W + sBA|| per output row (peft's merge), whose
                    m = magnitude[name].weight  # rows have norm m: with B zeroed, m W' / ||W'|| is W' itself
                    merged = merged * (m / torch.linalg.norm(merged, dim=1))[:, None]
                module.base_layer.weight.copy_(merged)
                for factor in ZERO_FACTORS:
                    if name in getattr(module, factor, {}):
                        weight = getattr(module, factor)[name]
                        torch.nn.init.zeros_(weight if isinstance(weight, torch.Tensor) else weight.weight)
        self.synced = self.mode != "none"

    def state_dict(self, policy) -> dict | None:
        """Weights to checkpoint so that a resumed run has the same reference (None when unchanged)."""
        if not self.synced:
            return None
        if self.mode == "frozen":
            return self.model.state_dict()
        return {n: p for n, p in policy.state_dict().items() if not is_adapter_weight(n)}  # merged base weights

    @torch.no_grad()
    def load_state_dict(self, policy, state: dict) -> None:
        target = self.model if self.mode == "frozen" else policy
        missing = target.load_state_dict(state, strict=False)
        if missing.unexpected_keys:
            raise ValueError(f"reference weights do not fit the policy: {missing.unexpected_keys[:3]}")
        self.synced = True
