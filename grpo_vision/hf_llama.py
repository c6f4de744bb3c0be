"""The built-in policy as transformers objects: the same weights as a `LlamaForCausalLM`, and a
tokenizer that reads captions into the policy's condition ids.

Module names match one-to-one (llama_policy.py), so the export is a state-dict copy. The sampler
benchmark compares `generate()` on the export with the KV-cache sampler; the TRL benchmark trains the
export with TRL's `GRPOTrainer`, which needs a tokenizer whose `prompt` text gives the ids
`encode_prompts` gives (left padding to `max_caption_words`, `<bos>` before, `<boi>` after).
"""

from __future__ import annotations

from grpo_vision.llama_policy import BOI, BOS, NULL, PAD, SPECIALS, UNK, LlamaImagePolicy, LlamaPolicyConfig


def to_hf_llama(policy: LlamaImagePolicy):
    """The same weights as a transformers `LlamaForCausalLM` (full vocabulary head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = policy.cfg
    hf_cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
        max_position_embeddings=c.cond_len + c.num_image_tokens, rms_norm_eps=c.norm_eps,
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


def hf_tokenizer(cfg: LlamaPolicyConfig):
    """A `PreTrainedTokenizerFast` over the caption words: `tok([caption])` gives `encode_prompts`'s
    row (left-padded to `max_caption_words`, then `<boi>`); image codes are ids from `image_offset` on,
    named `<code_k>`, so that decoding a completion never fails."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    names = [*SPECIALS, *cfg.words, *(f"<code_{k}>" for k in range(cfg.codebook_size))]
    vocab = {name: i for i, name in enumerate(names)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[UNK]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIALS[BOS]} $A {SPECIALS[BOI]}",
                                                       special_tokens=[(SPECIALS[BOS], BOS), (SPECIALS[BOI], BOI)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[PAD], bos_token=SPECIALS[BOS],
                                  unk_token=SPECIALS[UNK], padding_side="left",
                                  model_max_length=cfg.cond_len)
    out.null_token_id = NULL
    return out
