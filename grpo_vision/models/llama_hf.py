"""The built-in policy as transformers objects: the same weights as a `LlamaForCausalLM`, and a
tokenizer that reads captions into the policy's condition ids; `export` writes both as one folder.

Module names match one-to-one (models/llama.py), so the export is a state-dict copy. The sampler
benchmark compares `generate()` on the export with the KV-cache sampler; the TRL benchmark trains the
export with TRL's `GRPOTrainer`, which tokenizes prompt text itself: `condition_text` writes a caption
as the words whose ids are `encode_prompts`'s row (the padding, `<bos>` and `<boi>` included).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from grpo_vision.config import ConfigError
from grpo_vision.models.llama import BOI, BOS, PAD, SPECIALS, UNK, LlamaImagePolicy, LlamaPolicyConfig


def to_hf_llama(policy: LlamaImagePolicy):
    """The same weights as a transformers `LlamaForCausalLM` (full vocabulary head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = policy.cfg
    if c.canvas_attributes:
        raise ConfigError("this policy draws its plan onto a layout canvas (policy_config.json: canvas_attributes), "
                          "which LlamaForCausalLM has no module for, so it does not export to transformers; load "
                          "the run folder itself as policy.path")
    hf_cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
        max_position_embeddings=c.plan_cond_len + c.num_image_tokens, rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        hidden_act="silu", bos_token_id=BOS, pad_token_id=PAD, eos_token_id=None,
    )
    hf = LlamaForCausalLM(hf_cfg).to(policy.lm_head.weight.dtype)
    hf.load_state_dict(policy.state_dict(), strict=True)
    return hf.eval()


def from_hf_llama(hf_model, cfg: LlamaPolicyConfig) -> LlamaImagePolicy:
    policy = LlamaImagePolicy(cfg).to(next(hf_model.parameters()).dtype)
    state = {k: v for k, v in hf_model.state_dict().items() if "rotary_emb" not in k}
    policy.load_state_dict(state, strict=True)
    return policy


def condition_text(caption: str, cfg: LlamaPolicyConfig) -> str:
    """The caption as the words of its condition row: `<pad>`s, `<bos>`, the words, `<boi>`."""
    words = caption.lower().split()
    return " ".join([SPECIALS[PAD]] * (cfg.max_caption_words - len(words)) + [SPECIALS[BOS], *words, SPECIALS[BOI]])


def hf_tokenizer(cfg: LlamaPolicyConfig):
    """A `PreTrainedTokenizerFast` with one id per word of the policy's vocabulary: the ids of
    `condition_text(caption)` are `encode_prompts`'s row. Image codes are ids from `image_offset` on,
    named `<code_k>`, so that decoding a completion never fails."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    plan = ["<bop>", "<eop>", *(f"<plan_{w}>" for w in cfg.plan_words)] if cfg.plan_words else []
    names = [*SPECIALS, *cfg.words, *(f"<code_{k}>" for k in range(cfg.codebook_size)), *plan]
    tok = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token=SPECIALS[UNK]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[PAD], bos_token=SPECIALS[BOS],
                                   unk_token=SPECIALS[UNK], padding_side="left")


def export(policy: LlamaImagePolicy, directory: str | Path) -> list[Path]:
    """`policy` as a transformers `LlamaForCausalLM` folder with its word-level tokenizer and policy_config.json,
    from which `LlamaImagePolicy.from_pretrained` reads it back (export.py)."""
    directory = Path(directory)
    to_hf_llama(policy).save_pretrained(str(directory))
    hf_tokenizer(policy.cfg).save_pretrained(str(directory))
    (directory / "policy_config.json").write_text(json.dumps(asdict(policy.cfg), indent=2))
    return sorted(directory.iterdir())
