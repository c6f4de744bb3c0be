"""peft adapters on a policy (LoRA, and LoHa / LoKr of the LyCORIS family): adding one, finding its
layers, telling its weights apart, and merging them into the base weights while a rollout samples
(`merged_adapter`). The reference (grpo_vision/step/reference.py) folds them into the base weights."""

from __future__ import annotations

import re
from contextlib import contextmanager
from functools import lru_cache

import torch

from grpo_vision.config import ConfigError, brief

ADAPTERS = ("lora", "dora", "loha", "lokr")
# The factor of each adapter that peft initialises to zero (LoRA's B, LoHa's second Hadamard factor,
# LoKr's first Kronecker factor): zero, it makes the adapter's update zero whatever the others hold
ZERO_FACTORS = ("lora_B", "hada_w2_b", "lokr_w1", "lokr_w1_a")
TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "wqkv", "wo", "w1", "w2", "w3"}  # the last five: LlamaGen's names (models/llamagen.py)


def add_adapter(policy, kind: str, rank: int, alpha: float, targets: list[str]):
    """`policy` wrapped by peft with a fresh adapter of `kind` on `targets`: its update starts at zero."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig, get_peft_model

    if kind not in ADAPTERS:
        raise ValueError(f"train.adapter must be one of {ADAPTERS}, got {kind!r}")
    scope = getattr(policy, "lora_scope", None)  # module prefix a policy confines adapters to (Janus: its LM)
    check_targets(policy, targets, scope)
    targets = target_pattern(scope, targets)
    config = {"lora": lambda: LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0),
              # DoRA (Liu et al. 2024, arXiv 2402.09353): LoRA's direction plus a learned magnitude per output row,
              # peft's `use_dora`; the magnitude starts at the base weight's row norms, so the update starts at zero
              "dora": lambda: LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                         use_dora=True),
              "loha": lambda: LoHaConfig(r=rank, alpha=alpha, target_modules=targets),
              "lokr": lambda: LoKrConfig(r=rank, alpha=alpha, target_modules=targets)}[kind]()
    return get_peft_model(policy, config)


def target_pattern(scope: str | None, targets: list[str]) -> str | list[str]:
    """peft's `target_modules` for `targets` inside module path `scope`: the names themselves without one, else
    a regex (a string target is one that peft full-matches against each module name)."""
    return rf"{re.escape(scope)}\..*\.({'|'.join(targets)})" if scope else list(targets)


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


# ---------------------------------------------------------------------------- merged sampling


def merge_problem(policy, lora_only: bool) -> str | None:
    """Why the adapter of `policy` cannot be merged into its base weights for sampling (None: it can). Exact
    means the merged layer computes what the adapter layer computes, up to the rounding of one add: a plain
    linear base layer with a floating weight and an adapter that is a weight delta (LoRA, LoHa, LoKr; not
    DoRA, whose magnitude vector rescales the sum). `lora_only`: LoHa and LoKr count as a problem too
    (sample.merge_adapter=auto merges LoRA only, as TRL 1.16 and verl do)."""
    from peft.tuners.lora import LoraLayer

    layers = adapter_layers(policy)
    if not layers:
        return "the policy has no peft adapter"
    for module, name in layers:
        base = module.base_layer
        where = type(module).__name__
        if type(base) is not torch.nn.Linear or not base.weight.is_floating_point():
            return f"an adapter sits on a {type(base).__name__} ({where}), not a floating-point nn.Linear"
        if lora_only and not isinstance(module, LoraLayer):
            # peft names every kind's layer Linear: its package (peft.tuners.loha.layer) names the kind
            kind = type(module).__module__.split(".")[-2] if "." in type(module).__module__ else where
            return f"the adapter is {kind} (LyCORIS), which auto leaves unmerged"
        if isinstance(module, LoraLayer) and name in getattr(module, "lora_variant", {}):
            return f"the LoRA layer {where} has a variant (DoRA) whose output is not a weight delta"
    return None


def merged_bytes(policy) -> int:
    """Bytes of the merged copies `merged_adapter` makes: every adapted base weight, once."""
    modules = {id(m): m for m, _ in adapter_layers(policy)}.values()
    return sum(m.base_layer.weight.numel() * m.base_layer.weight.element_size() for m in modules)


def merge_setting(cfg, policy, acc) -> tuple[bool, str]:
    """sample.merge_adapter resolved for this run: whether rollouts sample with the adapter merged, and why not
    where they do not. `on` where it cannot merge exactly, or under FSDP (each process holds a shard of the weights
    it would fold into), is a ConfigError naming why; `auto` is then off."""
    setting = cfg.sample.merge_adapter
    if setting == "off" or cfg.train.adapter == "none":
        return False, "sample.merge_adapter=off" if setting == "off" else "no adapter"
    if str(acc.distributed_type).endswith("FSDP"):
        if setting == "on":
            raise ConfigError("sample.merge_adapter=on folds the adapter into whole weights, and FSDP shards them "
                              "across processes: set sample.merge_adapter to auto or off under FSDP")
        return False, "FSDP shards the weights it would fold into"
    problem = merge_problem(policy, lora_only=setting == "auto")
    if problem and setting == "on":
        raise ConfigError(f"sample.merge_adapter=on cannot merge exactly: {problem}; set sample.merge_adapter=off")
    return problem is None, problem or ""



@contextmanager
def merged_adapter(policy):
    """Sample with each adapter folded into its base weight, and the adapter layers bypassed: a rollout then runs
    the base model's kernels only (TRL 1.16 merges before every generation, trl/generation/vllm_generation.py
    L440-469; verl PR #5115; vllm #3316 measured 780 ms unmerged against 400 ms merged). The merged weight is a
    new tensor, round(W + delta) in W's dtype, made one layer at a time; the original tensor object is kept and
    put back on exit, so the update, the reference (adapter disabled) and checkpoints see the weights bit for
    bit as before. Never `W - delta` afterwards: in bf16 that does not give W back. Costs one copy of the
    adapted weights while it lasts (`merged_bytes`). Inside a disabled adapter (the reference) it merges nothing."""
    by_module: dict[int, tuple] = {}
    for module, name in adapter_layers(policy):
        by_module.setdefault(id(module), (module, []))[1].append(name)
    if any(module.disable_adapters or module.merged for module, _ in by_module.values()):
        yield  # the base model is sampled (reference), or someone else merged: nothing to add
        return
    done = []
    try:
        with torch.no_grad():
            for module, names in by_module.values():
                weight = module.base_layer.weight
                original = weight.data
                delta = sum(module.get_delta_weight(n).float() for n in names)
                weight.data = (original.float() + delta).to(original.dtype)
                module.merged_adapters.extend(names)  # peft's forward now calls the base layer alone
                done.append((module, weight, original, names))
        yield
    finally:
        for module, weight, original, names in done:
            weight.data = original
            for n in names:
                module.merged_adapters.remove(n)
