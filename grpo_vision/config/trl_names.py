"""TRL's `GRPOConfig` option names, taken as aliases of this config's fields (GRPOTrainer(**options)).

A script written against TRL keeps its option names where this library has the same knob; each alias
becomes a dotted override and the mapping is printed once, so the run's config.yaml (which holds only this
library's names) is never a surprise. Names from TRL's GRPOConfig (trl/trainer/grpo_config.py, TRL 1.16).
"""

from __future__ import annotations

from typing import Any

from grpo_vision.config.load import ConfigError, brief

# TRL name -> this config's dotted field, where the meaning is the same
SAME = {
    "learning_rate": "train.lr", "max_steps": "train.steps", "num_generations": "sample.group_size",
    "beta": "train.beta", "epsilon": "train.epsilon_low", "epsilon_high": "train.epsilon_high",
    "num_iterations": "train.num_iterations", "loss_type": "train.loss_type", "delta": "train.delta",
    "importance_sampling_level": "train.importance_sampling_level",
    "top_entropy_quantile": "train.top_entropy_quantile", "temperature": "sample.temperature", "top_k": "sample.top_k",
    "top_p": "sample.top_p", "max_grad_norm": "train.max_grad_norm", "weight_decay": "train.weight_decay",
    "warmup_steps": "train.warmup_steps", "lr_scheduler_type": "train.lr_schedule",
    "gradient_checkpointing": "train.gradient_checkpointing", "seed": "run.seed", "save_steps": "log.checkpoint_every",
    "per_device_train_batch_size": "train.micro_batch_size", "scale_rewards": "train.adv_scale",
    # TRL 1.16; use_bias_correction_kl defaults to True there and False here, off_policy_mask_threshold's None is 0
    "use_bias_correction_kl": "train.use_bias_correction_kl",
    "off_policy_mask_threshold": "train.off_policy_mask_threshold",
    "entropy_coef": "train.entropy_coef", "use_adaptive_entropy": "train.use_adaptive_entropy",
    "entropy_coef_min": "train.entropy_coef_min", "entropy_coef_max": "train.entropy_coef_max",
    "entropy_coef_delta": "train.entropy_coef_delta", "entropy_target": "train.entropy_target",
    "ref_model_mixup_alpha": "train.ref_model_mixup_alpha",
}
# TRL options with no counterpart here, and why: refused by name rather than ignored
NONE = {
    "max_completion_length": "an image is always its tokenizer's grid of tokens",
    "max_prompt_length": "captions are encoded whole by the policy kind",
    "use_vllm": "rollouts run in this library's own sampler (sample.decode)",
    "num_train_epochs": "training counts steps: max_steps (train.steps)",
}


def trl_overrides(options: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(dotted overrides, printed mapping lines) for TRL-named `options` but gradient_accumulation_steps, which
    needs the batch sizes (`accumulation`)."""
    overrides, lines = [], []
    for name, value in options.items():
        if name in NONE:
            raise ConfigError(f"{name} (TRL) has no counterpart here: {NONE[name]}; remove it")
        if name in SAME:
            if name == "scale_rewards" and isinstance(value, bool):  # TRL's older True/False
                value = "group" if value else "none"
            target, shown = SAME[name], value
        elif name in ("bf16", "fp16"):
            target, shown = "train.mixed_precision", name if value else "no"
        elif name in ("adam_beta1", "adam_beta2"):
            raise ConfigError(f"{name} (TRL): give both betas as train.adam_betas=[beta1, beta2]")
        elif name == "output_dir":  # TRL's output_dir is the run folder itself
            from pathlib import Path

            out = Path(value)
            overrides += [f"run.out_dir={out.parent}", f"run.name={out.name}"]
            lines.append(f"output_dir={value} -> run.out_dir={out.parent} run.name={out.name}")
            continue
        else:
            raise ConfigError(f"unknown option {brief(name)}: neither a TRL GRPOConfig name taken here "
                              f"({', '.join(sorted([*SAME, 'bf16', 'fp16', 'output_dir', 'gradient_accumulation_steps']))}) "
                              "nor a section of the config; give this library's names as overrides, e.g. train.lr=1e-5")
        overrides.append(f"{target}={_text(shown)}")
        lines.append(f"{name}={value} -> {target}={_text(shown)}")
    return overrides, lines


def accumulation(steps: int, micro_batch_size: int, images_per_process: int) -> tuple[str, str]:
    """(override, printed line) for TRL's gradient_accumulation_steps: an optimizer update averages `steps`
    micro-batches, so a step's images on a process are split into that many updates' worth."""
    per_update = steps * micro_batch_size
    if steps < 1 or images_per_process % per_update:
        raise ConfigError(f"gradient_accumulation_steps={steps} x micro batch {micro_batch_size} = {per_update} "
                          f"sequences per update does not divide the {images_per_process} images a process samples "
                          "per step: choose values that divide it")
    n = images_per_process // per_update
    return (f"train.minibatches_per_pass={n}",
            f"gradient_accumulation_steps={steps} -> train.minibatches_per_pass={n} ({images_per_process} images per "
            f"process and step / ({micro_batch_size} per micro-batch x {steps}))")


def _text(value) -> str:
    """A value as a dotted override writes it (YAML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:  # TRL's "off" (off_policy_mask_threshold=None): the field's default
        return "null"
    return str(value)
