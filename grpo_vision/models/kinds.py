"""The built-in policy kinds: `llama` (LlamaImagePolicy with a diffusers VQ tokenizer) and `janus`
(Janus-Pro through transformers). They register like any plugin's kinds (plugins.py, policy.py)."""

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

    if not pcfg.tokenizer:
        raise ConfigError("policy.kind 'llama' needs policy.tokenizer: the directory of its VQ tokenizer")
    policy = LlamaImagePolicy.from_pretrained(pcfg.path, device).to(getattr(torch, pcfg.dtype))
    return Bundle(policy, VQTokenizer.from_pretrained(pcfg.tokenizer, device), source=Path(pcfg.path))


@register_policy_kind("janus")
def load_janus(pcfg: PolicyConfig, device) -> Bundle:
    """Janus-Pro through transformers; its VQ model, inside the checkpoint, is the tokenizer."""
    from grpo_vision.models.janus import JanusImagePolicy

    if pcfg.tokenizer:
        raise ConfigError("policy.tokenizer is not used with policy.kind 'janus': its VQ model is part of the "
                          "Janus checkpoint in policy.path; leave policy.tokenizer empty")
    policy = JanusImagePolicy.from_pretrained(pcfg.path, device, pcfg.dtype)
    return Bundle(policy, policy.image_tokenizer(), source=Path(pcfg.path))  # the tokenizer shares the VQ model
