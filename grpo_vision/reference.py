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
import re
from contextlib import nullcontext
from functools import lru_cache
from typing import Callable

import torch

from grpo_vision.config_load import ConfigError, brief
from grpo_vision.sampling import SamplingParams, sequence_logprobs

ADAPTERS = ("lora", "loha", "lokr")
# The factor of each adapter that peft initialises to zero (LoRA's B, LoHa's second Hadamard factor,
# LoKr's first Kronecker factor): zero, it makes the adapter's update zero whatever the others hold
ZERO_FACTORS = ("lora_B", "hada_w2_b", "lokr_w1", "lokr_w1_a")
TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def add_adapter(policy, kind: str, rank: int, alpha: float, targets: list[str]):
    """`policy` wrapped by peft with a fresh adapter of `kind` on `targets`: its update starts at zero."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig, get_peft_model

    if kind not in ADAPTERS:
        raise ValueError(f"train.adapter must be one of {ADAPTERS}, got {kind!r}")
    scope = getattr(policy, "lora_scope", None)  # module prefix a policy confines adapters to (Janus: its LM)
    check_targets(policy, targets, scope)
    if scope:  # a string target is a regex that peft full-matches against each module name
        targets = rf"{re.escape(scope)}\..*\.({'|'.join(targets)})"
    config = {"lora": lambda: LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0),
              "loha": lambda: LoHaConfig(r=rank, alpha=alpha, target_modules=targets),
              "lokr": lambda: LoKrConfig(r=rank, alpha=alpha, target_modules=targets)}[kind]()
    return get_peft_model(policy, config)


def check_targets(policy, targets: list[str], scope: str | None) -> None:
    """ConfigError unless every target is one of TARGETS that `policy` has (inside `scope`), naming them:
    peft would otherwise fail with a traceback, or skip a name silently when another one matches."""
    present = sorted(TARGETS & {name.rsplit(".", 1)[-1] for name, _ in policy.named_modules()
                                if not scope or name.startswith(scope + ".")})
    choose = f"choose among {', '.join(present)}"
    if not targets:
        raise ConfigError(f"train.adapter_targets is empty, so the adapter would train nothing: {choose}")
    unknown = [t for t in targets if t not in present]
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise ConfigError(f"train.adapter_targets names {', '.join(brief(t) for t in unknown[:3])}{more}, which "
                          f"{'is' if len(unknown) == 1 else 'are'} not an adapter target of this policy: {choose}")


def adapter_layers(policy):
    """The peft layers of `policy` with their adapter names: [(module, name), ...]."""
    return [(m, name) for m in policy.modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")
            for name in getattr(m, "active_adapters", [])]


@lru_cache(maxsize=1)
def _adapter_parts() -> frozenset[str]:
    from peft.tuners.loha import LoHaLayer
    from peft.tuners.lokr import LoKrLayer
    from peft.tuners.lora import LoraLayer

    return frozenset(n for layer in (LoraLayer, LoHaLayer, LoKrLayer) for n in layer.adapter_layer_names)


def is_adapter_weight(name: str) -> bool:
    """True for a parameter of a peft adapter (a dotted part such as `lora_A` or `hada_w1_a`)."""
    return not _adapter_parts().isdisjoint(name.split("."))


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

    @torch.no_grad()
    def logprobs(self, policy, cond: torch.Tensor, tokens: torch.Tensor, params: SamplingParams,
                 micro_batch: int) -> torch.Tensor | None:
        """Reference log-probs `[B, N]`, computed in micro-batches; None without a reference."""
        if self.mode == "none":
            return None
        chunks = []
        for i in range(0, cond.shape[0], micro_batch):
            if self.mode == "adapter":
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
        if self.mode == "adapter":
            return policy, policy.disable_adapter()
        if self._base is None:
            if self._load_base is None:
                raise ValueError("this run has no reference (train.reference: none) and no way to load its base "
                                 "policy: pass load_base to Reference")
            device = next(policy.parameters()).device
            self._base = self._load_base().to(device).eval().requires_grad_(False)
        return self._base, nullcontext()

    @torch.no_grad()
    def sync(self, policy, weights: dict | None = None) -> None:
        """Make the reference equal to the current policy (whose whole `weights` a sharded run passes)."""
        if self.mode == "frozen":
            self.model.load_state_dict(policy.state_dict() if weights is None else weights)
        elif self.mode == "adapter":
            for module, name in adapter_layers(policy):  # fold each adapter into its base weight, then zero it
                module.base_layer.weight += module.get_delta_weight(name)
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
