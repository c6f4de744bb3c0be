"""The built-in policy kinds: `llama` (LlamaImagePolicy with a diffusers VQ tokenizer), `janus`
(Janus-Pro through transformers) and `llamagen` (LlamaGen's released GPT and VQ checkpoints). They
register like any plugin's kinds (plugins.py, policy.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_vision.config import ConfigError, PolicyConfig
from grpo_vision.policy import Bundle, register_policy_kind


@register_policy_kind("llama")
def load_llama(pcfg: PolicyConfig, device) -> Bundle:
    """The built-in LlamaGen-style policy (`policy.path`) and a diffusers VQ tokenizer (`policy.tokenizer`)."""
    from grpo_vision.models.llama import LlamaImagePolicy
    from grpo_vision.models.tokenizer import VQTokenizer

    no_options(pcfg)
    if not pcfg.tokenizer:
        raise ConfigError("policy.kind 'llama' needs policy.tokenizer: the directory of its VQ tokenizer")
    policy = LlamaImagePolicy.from_pretrained(pcfg.path, device).to(getattr(torch, pcfg.dtype))
    return Bundle(policy, VQTokenizer.from_pretrained(pcfg.tokenizer, device), source=Path(pcfg.path))


@register_policy_kind("janus")
def load_janus(pcfg: PolicyConfig, device) -> Bundle:
    """Janus-Pro through transformers; its VQ model, inside the checkpoint, is the tokenizer."""
    from grpo_vision.models.janus import JanusImagePolicy

    no_options(pcfg)
    if pcfg.tokenizer:
        raise ConfigError("policy.tokenizer is not used with policy.kind 'janus': its VQ model is part of the "
                          "Janus checkpoint in policy.path; leave policy.tokenizer empty")
    policy = JanusImagePolicy.from_pretrained(pcfg.path, device, pcfg.dtype)
    return Bundle(policy, policy.image_tokenizer(), source=Path(pcfg.path))  # the tokenizer shares the VQ model


def no_options(pcfg: PolicyConfig) -> None:
    """ConfigError for policy.options given to a kind that takes none (an unknown key is an error)."""
    if pcfg.options:
        raise ConfigError(f"policy.options ({', '.join(map(str, pcfg.options))}) is not used with policy.kind "
                          f"{pcfg.kind!r}; remove it")


@register_policy_kind("llamagen")
def load_llamagen(pcfg: PolicyConfig, device) -> Bundle:
    """LlamaGen's released GPT (`policy.path`, c2i or t2i), its VQ (`policy.tokenizer`), `policy.options`."""
    from grpo_vision.models.llamagen_load import load_llamagen as load

    return load(pcfg, device)
