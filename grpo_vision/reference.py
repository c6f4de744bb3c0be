"""The reference policy for the KL term: a frozen copy, the base model under disabled LoRA, or none.

* ``frozen``: a deep copy of the initial policy with gradients off (doubles the weights in memory).
* ``lora``:   the policy trains peft LoRA adapters only; reference log-probs are the same network
              with the adapters disabled (`disable_adapter()`), so no second copy is kept.
* ``none``:   no reference; only valid with beta = 0. Sample grids and evaluation still compare
              with the base model, loaded once, on the policy's device, when first asked for.

`ref_sync_every = N` replaces the reference with the current policy every N steps (a moving anchor,
like TRL's `sync_ref_model` with mixup alpha 1). Under LoRA that means merging the adapters into
the base weights and starting fresh adapters, so the reference (adapters off) equals the policy.
"""

from __future__ import annotations

import copy
import re
from contextlib import nullcontext
from typing import Callable

import torch

from grpo_vision.sampling import SamplingParams, sequence_logprobs


def add_lora(policy, rank: int, alpha: float, targets: list[str]):
    from peft import LoraConfig, get_peft_model

    allowed = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    if not set(targets) <= allowed:
        raise ValueError(f"train.lora_targets {sorted(set(targets) - allowed)} not supported; "
                         f"choose from {sorted(allowed)}")
    scope = getattr(policy, "lora_scope", None)  # module prefix a policy confines adapters to (Janus: its LM)
    if scope:  # a string target is a regex that peft full-matches against each module name
        targets = rf"{re.escape(scope)}\..*\.({'|'.join(targets)})"
    return get_peft_model(policy, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0))


class Reference:
    def __init__(self, policy, mode: str, load_base: Callable[[], torch.nn.Module] | None = None):
        """`load_base()` loads the base policy from disk: what `sampler` gives without a reference."""
        if mode not in ("frozen", "lora", "none"):
            raise ValueError(f"reference must be frozen, lora or none, got {mode!r}")
        self.mode = mode
        self.model = None
        self._load_base = load_base
        self._base = None  # the base policy, loaded at the first `sampler` call of a run without a reference
        self.synced = False  # True once the reference differs from the base weights on disk
        if mode == "frozen":
            self.model = copy.deepcopy(policy).eval().requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, policy, cond: torch.Tensor, tokens: torch.Tensor, params: SamplingParams,
                 micro_batch: int) -> torch.Tensor | None:
        """Reference log-probs `[B, N]`, computed in micro-batches; None without a reference."""
        if self.mode == "none":
            return None
        chunks = []
        for i in range(0, cond.shape[0], micro_batch):
            if self.mode == "lora":
                with policy.disable_adapter():
                    chunks.append(sequence_logprobs(policy, cond[i:i + micro_batch], tokens[i:i + micro_batch], params))
            else:
                chunks.append(sequence_logprobs(self.model, cond[i:i + micro_batch], tokens[i:i + micro_batch], params))
        return torch.cat(chunks)

    def sampler(self, policy):
        """(model, context): sampling `model` inside `context` draws from the reference (grids,
        evaluation, the demo). Without a reference: the base policy, loaded once, on `policy`'s device."""
        if self.mode == "frozen":
            return self.model, nullcontext()
        if self.mode == "lora":
            return policy, policy.disable_adapter()
        if self._base is None:
            if self._load_base is None:
                raise ValueError("this run has no reference (train.reference: none) and no way to load its base "
                                 "policy: pass load_base to Reference")
            device = next(policy.parameters()).device
            self._base = self._load_base().to(device).eval().requires_grad_(False)
        return self._base, nullcontext()

    @torch.no_grad()
    def sync(self, policy) -> None:
        """Make the reference equal to the current policy."""
        if self.mode == "frozen":
            self.model.load_state_dict(policy.state_dict())
        elif self.mode == "lora":
            for module in policy.modules():  # fold each adapter into its base weight, then zero it
                if hasattr(module, "get_delta_weight") and hasattr(module, "lora_B"):
                    for name in module.lora_B:
                        module.base_layer.weight += module.get_delta_weight(name)
                        torch.nn.init.zeros_(module.lora_B[name].weight)
        self.synced = self.mode != "none"

    def state_dict(self, policy) -> dict | None:
        """Weights to checkpoint so that a resumed run has the same reference (None when unchanged)."""
        if not self.synced:
            return None
        if self.mode == "frozen":
            return self.model.state_dict()
        return {n: p for n, p in policy.state_dict().items() if "lora_" not in n}  # merged base weights

    @torch.no_grad()
    def load_state_dict(self, policy, state: dict) -> None:
        target = self.model if self.mode == "frozen" else policy
        missing = target.load_state_dict(state, strict=False)
        if missing.unexpected_keys:
            raise ValueError(f"reference weights do not fit the policy: {missing.unexpected_keys[:3]}")
        self.synced = True
