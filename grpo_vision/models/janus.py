"""Janus-Pro as an `ImagePolicy`: transformers' `JanusForConditionalGeneration` on its image path.

Janus (arXiv 2410.13848, Janus-Pro arXiv 2501.17811) generates images with the same Llama backbone
it reads text with, but through separate image modules (`transformers/models/janus/modeling_janus.py`):

    caption ids --embed_tokens--> [text embeddings] --+
    code ids --generation_embeddings--generation_aligner--> [image embeddings] --+--> language_model
    last hidden state --generation_head--> logits over the VQ codebook (K = 16384 for Janus-Pro)
    codes --vqmodel.decode--> image in [-1, 1]

A condition is the chat-formatted caption followed by `<begin_of_image>` (Janus's generation prompt:
`<|User|>: {caption}\\n\\n<|Assistant|>:<begin_of_image>`, empty system prompt), tokenized by the
model's own processor. Rows are left-padded; padding positions hold `NO_TOKEN` (-1), so the
condition tensor alone carries its attention mask. The unconditional rows for CFG follow
`JanusForConditionalGeneration.generate(generation_mode="image")`: every token that is not BOS or
`<begin_of_image>` becomes the pad token, attended as a token, under the same padding mask.

Sampling prefills the condition with transformers' language model, then decodes with a step of its
own over the same modules (`decode`): the keys and values in a cache preallocated at condition + image
tokens, attention computed directly (in float32 on a CPU, where transformers' bf16 attention kernel took a
quarter of a Janus-Pro-1B-sized decode step, docs/benchmarks.md) and, with `new_cache(static=True)`, a
step of fixed shapes a CUDA graph can record (models/kv_cache.py). Its logits equal `generate`'s (a test
compares them step by step in float32). Only the generation path trains: the understanding-only modules (SigLIP `vision_model`,
`aligner`), the VQ model and the text embedding table (tied to the text `lm_head`) are frozen, which
also keeps them out of checkpoints and the optimizer. `lora_scope` confines LoRA adapters to the
language model (its projections share names with the SigLIP tower's).

A text plan before the image (`policy.PlanningPolicy`, T2I-R1's two-stage rollout, arXiv 2505.00703,
CaraJ7/T2I-R1 `grpo_trainer.py`): the text stage reads T2I-R1's system prompt and the templated prompt in
Janus's chat format and writes the plan with the text `lm_head`, through the same prefill and decode step as
the image (`_prefill`, `_step`); the image stage reads a fresh conversation `"{prompt}. {plan}"`, encoded as any
caption is. T2I-R1 trains the backbone and the text `lm_head` and freezes `gen_*`; here the text head stays frozen
(tied to the frozen embedding table) and `generation_*` train, as without a plan: a plan token's gradient
reaches the backbone through the frozen head.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from grpo_vision.config import ConfigError
from grpo_vision.models.kv_cache import future_keys, new_kv, write_step

from grpo_vision.models.janus_understanding import JUDGE_TEXT_TOKENS, answer_logits
from grpo_vision.run.load_checks import dtype_argument

if TYPE_CHECKING:  # the window's shape: the sampler's, read here (sampling/speculative.py)
    from grpo_vision.sampling.speculative import Tree

NO_TOKEN = -1  # condition positions that are left padding: not attended, embedded as the pad token
SFT_FORMAT = "<|User|>: {}\n\n<|Assistant|>:"  # Janus's "deepseek" SFT template, empty system prompt
# The text stage's system prompt (T2I-R1 `grpo_trainer.py` L428-433), written before the user turn as Janus's
# "deepseek" conversation writes one: system prompt, "\n\n", then the turns (janus/utils/conversation.py)
PLAN_SYSTEM_PROMPT = ("You are a helpful assistant that receives an image prompt and generate a visualization of the "
                      "prompt.")


@dataclass
class JanusCache:
    static: bool = False  # a decode step of fixed shapes (models/kv_cache.py)
    k: torch.Tensor | None = None  # [layers, B, kv_heads, L + N, head_dim], allocated by `prefill` (it needs L)
    v: torch.Tensor | None = None
    valid: torch.Tensor | None = None  # [B, L + N] True where a key may be attended (False at left padding)
    pos: int = 0  # positions written (a Python int: reading a device counter would sync the GPU)
    position: torch.Tensor | None = None  # a static cache's next position, on the device
    room: int = 0  # N: the tokens decoded after the input, num_image_tokens or a plan's max_tokens


class JanusImagePolicy(nn.Module):
    """Caption-conditioned image-token sampling and scoring with a Janus-Pro model; implements
    `policy.ImagePolicy`."""

    lora_scope = "model.model.language_model"  # module prefix that LoRA adapters are confined to
    static_decode = True  # new_cache(rows, static=True): a decode step of fixed shapes (models/kv_cache.py)
    adapter_root = "model"  # where the JanusForConditionalGeneration a peft adapter export targets sits (export.py)

    def __init__(self, model, processor):
        super().__init__()
        self.model = model  # JanusForConditionalGeneration
        self.processor = processor  # JanusProcessor: chat template and text tokenizer
        gen, tok = model.generation_config, processor.tokenizer
        self.bos_id = gen.bos_token_id if gen.bos_token_id is not None else tok.bos_token_id
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else tok.pad_token_id
        self.boi_id = tok.convert_tokens_to_ids(processor.image_start_token)
        stored_boi = (getattr(gen, "generation_kwargs", None) or {}).get("boi_token_id")  # from_pretrained requires it
        if None in (self.bos_id, self.pad_id) or self.boi_id == tok.unk_token_id:
            raise ValueError(f"Janus model needs BOS, pad and {processor.image_start_token} token ids; got bos "
                             f"{self.bos_id}, pad {self.pad_id}, boi {self.boi_id}")
        if stored_boi is not None and stored_boi != self.boi_id:
            raise ValueError(f"generation_config boi_token_id {stored_boi} differs from the tokenizer's "
                             f"{processor.image_start_token} id {self.boi_id}")
        h, w = model.model.vqmodel.quantize.quant_state_dims
        if model.config.vision_config.num_image_tokens != h * w:
            raise ValueError(f"Janus config: num_image_tokens {model.config.vision_config.num_image_tokens} != "
                             f"VQ grid {h}x{w}")
        m = model.model
        for frozen in (m.vision_model, m.aligner, m.vqmodel, m.language_model.embed_tokens, model.lm_head):
            frozen.requires_grad_(False)

    # ------------------------------------------------------------------ ImagePolicy
    @property
    def num_image_tokens(self) -> int:
        return self.model.config.vision_config.num_image_tokens

    @property
    def codebook_size(self) -> int:
        return self.model.config.vq_config.num_embeddings

    @property
    def image_grid(self) -> tuple[int, int]:
        return tuple(self.model.model.vqmodel.quantize.quant_state_dims)

    def architecture(self) -> dict:
        """The sizes run/memory.py estimates a step's peak from. The condition length depends on the captions;
        64 tokens covers the chat template and a caption of about 50 words. On a CPU the decode cache is float32
        and so is the VQ model (counted in the parameters already, at its own dtype)."""
        t = self.model.config.text_config
        kv_bytes = 4 if self.model.device.type == "cpu" else None
        judge_len = JUDGE_TEXT_TOKENS + self.processor.num_image_tokens + 2  # the image between its two markers
        return dict(layers=t.num_hidden_layers, dim=t.hidden_size, heads=t.num_attention_heads,
                    kv_heads=t.num_key_value_heads, ffn_dim=t.intermediate_size, cond_len=64,
                    codebook=self.codebook_size, kv_bytes=kv_bytes, judge_len=judge_len, vocab=t.vocab_size)

    # ------------------------------------------------------------------ understanding (the self_judge reward)
    @property
    def answer_tokenizer(self):
        """The text tokenizer whose ids `answer_logits` scores."""
        return self.processor.tokenizer

    def answer_logits(self, images: torch.Tensor, questions: Sequence[str]) -> torch.Tensor:
        """Next-token logits `[B, V]` after image b `[B, 3, H, W]` in [0, 1] and question b, through the model's
        understanding branch (SigLIP, aligner, language model, text head: models/janus_understanding.py)."""
        return answer_logits(self.model, self.processor, images, questions)

    def encode_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        texts = [self._user_turn(prompt) for prompt in prompts]
        # generation_mode="image" appends <begin_of_image>; the processor pads on the left.
        enc = self.processor(text=texts, generation_mode="image", padding=True, return_tensors="pt")
        return self._condition(enc)  # [B, L]

    def null_condition(self, cond: torch.Tensor) -> torch.Tensor:
        keep = (cond == self.bos_id) | (cond == self.boi_id) | (cond == NO_TOKEN)  # [B, L]
        return cond.masked_fill(~keep, self.pad_id)  # [B, L]

    def new_cache(self, batch_size: int, static: bool = False, extra: int = 0) -> JanusCache:
        """`extra` positions past the image: a speculative window's (sampling/speculative.py)."""
        return JanusCache(static, room=self.num_image_tokens + extra)  # `prefill` allocates the keys: they need L

    def prefill(self, cond: torch.Tensor, cache: JanusCache) -> torch.Tensor:
        return self.model.model.generation_head(self._prefill(cond, cache))  # [B, K]

    def decode(self, tokens: torch.Tensor, cache: JanusCache) -> torch.Tensor:
        x = self.model.prepare_embeddings_for_image_generation(tokens.unsqueeze(1))  # [B, 1, D]
        return self.model.model.generation_head(self._step(x, cache))  # [B, K]

    def _prefill(self, cond: torch.Tensor, cache: JanusCache) -> torch.Tensor:
        """Run `cond` `[B, L]` (NO_TOKEN at padding) through transformers' language model into `cache`, with room
        for `cache.room` more tokens; return the last position's hidden state `[B, D]` (after the final norm)."""
        ids, mask = self._ids_and_mask(cond)  # [B, L] each
        (B, L), N = cond.shape, cache.room
        out = self.model.model.language_model(inputs_embeds=self._embed_text(ids), attention_mask=mask,
                                              use_cache=True)
        layers = _cached_layers(out)  # [(k, v)] each [B, Hkv, L, hd]
        k0 = layers[0][0]
        # float32 on a CPU: the decode step's attention runs there in float32 (module docstring)
        dtype = torch.float32 if k0.device.type == "cpu" else k0.dtype
        cache.k, cache.v, cache.position = new_kv((len(layers), B, k0.shape[1], L + N, k0.shape[3]), dtype,
                                                  k0.device, cache.static)
        for i, (k, v) in enumerate(layers):
            cache.k[i, :, :, :L], cache.v[i, :, :, :L] = k, v
        cache.valid = torch.cat([mask.bool(), mask.new_ones(B, N, dtype=torch.bool)], dim=1)  # [B, L+N]
        cache.pos = L
        if cache.position is not None:
            cache.position.fill_(L)
        return out.last_hidden_state[:, -1]  # [B, D]

    def _step(self, x: torch.Tensor, cache: JanusCache) -> torch.Tensor:
        """One input embedding per row `x` `[B, 1, D]` through transformers' Llama layers, the same math as their
        forward (residual, RMSNorm, RoPE, attention, SwiGLU) with the keys and values in `cache`; returns the
        hidden state `[B, D]` after the final norm."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        lm, B = self.model.model.language_model, x.shape[0]
        pos, position = cache.pos, cache.position  # position: a static cache's, else None
        at = torch.full((B, 1), pos, device=x.device) if position is None else position.view(1, 1).expand(B, 1)
        cos, sin = lm.rotary_emb(x, at)  # [B, 1, hd] each
        if position is None:
            mask = cache.valid[:, None, None, :pos + 1]  # [B, 1, 1, pos+1]
        else:
            mask = cache.valid[:, None, None, :] & ~future_keys(position, cache.k.shape[3])  # [B, 1, 1, L+N]
        for i, layer in enumerate(lm.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)  # [B, 1, D]
            q = a.q_proj(h).view(B, 1, -1, a.head_dim).transpose(1, 2)  # [B, H, 1, hd]
            k = a.k_proj(h).view(B, 1, -1, a.head_dim).transpose(1, 2)  # [B, Hkv, 1, hd]
            v = a.v_proj(h).view(B, 1, -1, a.head_dim).transpose(1, 2)  # [B, Hkv, 1, hd]
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys, values = write_step(cache.k[i], cache.v[i], k[:, :, 0], v[:, :, 0], pos, position)
            y = attend(q, keys, values, mask, a.scaling)  # [B, H, 1, hd]
            x = x + a.o_proj(y.transpose(1, 2).reshape(B, 1, -1))  # [B, 1, D]
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if position is None:
            cache.pos += 1
        else:
            position.add_(1)
        return lm.norm(x)[:, -1]  # [B, D]

    def decode_block(self, tokens: torch.Tensor, cache: JanusCache, start: torch.Tensor, tree: Tree) -> torch.Tensor:
        """A window of W image tokens a row `[B, W]` shaped as `tree` (`speculative.Tree`), row b's written at cache
        slots `start[b] .. start[b] + W - 1` (`start` `[B]`), through `_step`'s math: each node read at its own
        position, attending over the cache before the window (left padding masked) and the nodes on its path; the
        next token's logits at each node `[B, W, K]`. Speculative decoding's verify pass (sampling/speculative.py)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        lm, (B, W), T = self.model.model.language_model, tokens.shape, cache.k.shape[3]
        x = self.model.prepare_embeddings_for_image_generation(tokens)  # [B, W, D]
        pos, slots = tree.positions(start)  # [B, W] each
        cos, sin = lm.rotary_emb(x, pos)  # [B, W, hd] each
        mask = cache.valid[:, None, None, :] & tree.mask(start, T)  # [B, 1, W, T]
        for i, layer in enumerate(lm.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)  # [B, W, D]
            q = a.q_proj(h).view(B, W, -1, a.head_dim).transpose(1, 2)  # [B, H, W, hd]
            k = a.k_proj(h).view(B, W, -1, a.head_dim).transpose(1, 2)  # [B, Hkv, W, hd]
            v = a.v_proj(h).view(B, W, -1, a.head_dim).transpose(1, 2)  # [B, Hkv, W, hd]
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            at = slots[:, None, :, None].expand_as(k)  # [B, Hkv, W, hd]
            cache.k[i].scatter_(2, at, k.to(cache.k.dtype))
            cache.v[i].scatter_(2, at, v.to(cache.v.dtype))
            y = attend(q, cache.k[i], cache.v[i], mask, a.scaling)  # [B, H, W, hd]
            x = x + a.o_proj(y.transpose(1, 2).reshape(B, W, -1))  # [B, W, D]
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.model.generation_head(lm.norm(x))  # [B, W, K]

    def forward(self, cond: torch.Tensor, tokens: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor]:
        """Training's one call of the module for both segments of a sequence (DDP's and FSDP's hooks run once):
        (image logits `[B, N, K]`, plan logits `[B, T, V]`) for the rows' plan segment (a `sampling.Plan`: `.ids`
        `[B, L]`, `.tokens` `[B, T]`; T = 0 without a text stage). `image_logits` is the image alone."""
        return self.image_logits(cond, tokens), self.plan_logits(plan.ids, plan.tokens)

    def gradient_checkpointing_enable(self) -> None:
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers 5's name for it
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @torch.no_grad()
    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """The language model's input embeddings `[B, N, D]` of image tokens `[B, N]` (generation_embeddings then
        generation_aligner; the original's prepare_gen_img_embeds, which GCPO compares): policy.py's hook."""
        return self.model.prepare_embeddings_for_image_generation(tokens)

    def image_logits(self, cond: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        # Positions L-1 (<begin_of_image>) .. L+N-2 predict image tokens 0 .. N-1; the last is never input.
        ids, mask = self._ids_and_mask(cond)  # [B, L] each
        images = self.model.prepare_embeddings_for_image_generation(tokens[:, :-1])  # [B, N-1, D]
        text = self._embed_text(ids)  # [B, L, D]
        x = torch.cat([text, images.to(text.dtype)], dim=1)  # [B, L+N-1, D] (autocast may differ the dtypes)
        mask = torch.cat([mask, mask.new_ones(tokens[:, :-1].shape)], dim=1)  # [B, L+N-1]
        h = self._language_model(x, mask)  # [B, L+N-1, D]
        return self.model.model.generation_head(h[:, cond.shape[1] - 1:])  # [B, N, K]

    # ------------------------------------------------------------------ PlanningPolicy
    @property
    def plan_vocab_size(self) -> int:  # V: the text lm_head's rows, the whole text vocabulary
        return self.model.lm_head.out_features

    @property
    def plan_end_id(self) -> int:  # <｜end▁of▁sentence｜> for Janus-Pro: where T2I-R1's generate stops
        return self.processor.tokenizer.eos_token_id

    def encode_plan_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        r"""`<bos>{system}\n\n<|User|>: {prompt}\n\n<|Assistant|>:` `[B, L]`, left padded (NO_TOKEN), T2I-R1's text
        stage in the model's chat format. The tokenizer encodes it, not the processor: the processor in text mode
        prepends its own default system prompt where `use_default_system_prompt` is set (transformers' conversion
        script sets it), and the template renders a system turn as `System: ...` and an end of sentence."""
        texts = [f"{PLAN_SYSTEM_PROMPT}\n\n{self._user_turn(prompt)}" for prompt in prompts]
        enc = self.processor.tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
        return self._condition(enc)  # [B, L]

    def new_plan_cache(self, batch_size: int, max_tokens: int) -> JanusCache:
        return JanusCache(room=max_tokens)

    def plan_prefill(self, ids: torch.Tensor, cache: JanusCache) -> torch.Tensor:
        return self.model.lm_head(self._prefill(ids, cache)).float()  # [B, V]

    def plan_decode(self, tokens: torch.Tensor, cache: JanusCache) -> torch.Tensor:
        return self.model.lm_head(self._step(self._embed_text(tokens.unsqueeze(1)), cache)).float()  # [B, V]

    def plan_logits(self, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced `[B, T, V]` float32, with grad: positions L-1 .. L+T-2 of `ids + tokens[:, :-1]` predict
        plan tokens 0 .. T-1 (T2I-R1's text log-probs, one forward through the language model and lm_head)."""
        if tokens.shape[1] == 0:  # an empty plan segment (no text stage): nothing to run
            return self.model.lm_head.weight.new_zeros(tokens.shape[0], 0, self.plan_vocab_size).float()
        ids, mask = self._ids_and_mask(ids)  # [B, L] each
        x = self._embed_text(torch.cat([ids, tokens[:, :-1]], dim=1))  # [B, L+T-1, D]
        mask = torch.cat([mask, mask.new_ones(tokens[:, :-1].shape)], dim=1)  # [B, L+T-1]
        h = self._language_model(x, mask)  # [B, L+T-1, D]
        return self.model.lm_head(h[:, ids.shape[1] - 1:]).float()  # [B, T, V]

    def plan_text(self, tokens: Sequence[int]) -> str:
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
        return self.processor.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def plan_condition(self, prompts: Sequence[str], plans: Sequence[Sequence[int]]) -> torch.Tensor:
        """`encode_prompts` of `"{prompt}. {plan}"`: T2I-R1's fresh image conversation (`grpo_trainer.py` L541-560),
        here left padded, so that `<begin_of_image>` follows the plan's last token with no pad between (T2I-R1 pads
        on the right and appends `<begin_of_image>` after the pads). Its CFG row is `null_condition`'s, which
        blanks every token but BOS and `<begin_of_image>`: the prompt and the plan alike, as T2I-R1's uncond row
        (`inputs_embeds[:, 1:-1] = pad`) does."""
        return self.encode_prompts([f"{prompt}. {self.plan_text(plan)}" for prompt, plan in zip(prompts, plans,
                                                                                                 strict=True)])

    def plan_prompting(self, template: str) -> dict:
        """How `encode_plan_prompts` and `plan_condition` prompt the two stages, as strings that str.format fills
        (`prompt`, the caption; `plan`, the plan's text): what an export records (export.json's `text_stage`), so
        that the exported folder alone rebuilds a rollout with transformers' own Janus."""
        return {"system_prompt": PLAN_SYSTEM_PROMPT,
                "text_stage_input": f"{PLAN_SYSTEM_PROMPT}\n\n{self._user_turn(template)}",
                "text_stage_encoding": "processor.tokenizer(text_stage_input.format(prompt=...)): it adds <bos>; "
                                       "the plan is sampled until the end-of-sentence token",
                "image_prompt": "{prompt}. {plan}",
                "image_stage_input": self._user_turn("{prompt}. {plan}"),
                "image_stage_encoding": "processor(text=image_stage_input.format(prompt=..., plan=...), "
                                        "generation_mode='image'): it adds <bos> and <begin_of_image>"}

    # ------------------------------------------------------------------ internals
    def _user_turn(self, prompt: str) -> str:
        r"""One user turn and the assistant's opening in the model's chat template (Janus-Pro's:
        `<|User|>: {prompt}\n\n<|Assistant|>:`)."""
        if not prompt.strip():
            raise ValueError("empty prompt")
        if self.processor.chat_template is None:  # a processor saved without a template
            return SFT_FORMAT.format(prompt.strip())
        chat = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        return self.processor.apply_chat_template(chat, add_generation_prompt=True)

    def _condition(self, enc) -> torch.Tensor:
        """Input ids `[B, L]` with NO_TOKEN at the padding, on the model's device, from a tokenizer's output."""
        return enc["input_ids"].masked_fill(enc["attention_mask"] == 0, NO_TOKEN).to(self.model.device)

    def _ids_and_mask(self, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = (cond != NO_TOKEN).long()  # [B, L]
        return cond.masked_fill(mask == 0, self.pad_id), mask

    def _embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)  # [B, L, D]

    def _language_model(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states `[B, T, D]`; positions are 0, 1, ... including padding, as in `generate`
        (RoPE is relative, so left padding does not change the logits)."""
        return self.model.model.language_model(inputs_embeds=x, attention_mask=mask, use_cache=False).last_hidden_state

    # ------------------------------------------------------------------ tokenizer, save / load
    def image_tokenizer(self) -> "JanusVQTokenizer":
        return JanusVQTokenizer(self.model.model.vqmodel)

    def save_pretrained(self, directory: str | Path) -> None:
        """A transformers-format Janus directory (model, generation config, processor)."""
        self.model.save_pretrained(str(directory))
        self.processor.save_pretrained(str(directory))

    def export(self, directory: str | Path) -> list[Path]:
        """The whole model as transformers' own Janus folder (export.py): `save_pretrained`'s files."""
        self.save_pretrained(directory)
        return sorted(Path(directory).iterdir())

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu",
                        dtype: str = "float32") -> "JanusImagePolicy":
        from transformers import JanusForConditionalGeneration, JanusProcessor

        directory = Path(directory)
        missing = [n for n in ("config.json", "processor_config.json") if not (directory / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"Janus model directory {directory} has no {', '.join(missing)}; expected a transformers-format "
                "Janus-Pro checkpoint with its processor, e.g. deepseek-community/Janus-Pro-1B downloaded there "
                "(the deepseek-ai/Janus-Pro-* repos use the original format and need converting first)")
        model = JanusForConditionalGeneration.from_pretrained(str(directory), **dtype_argument(getattr(torch, dtype)),
                                                              local_files_only=True)
        processor = JanusProcessor.from_pretrained(str(directory), local_files_only=True)
        _check_generation_config(model.generation_config, processor, directory / "generation_config.json")
        return cls(model.to(device).eval(), processor)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Q queries per row `[B, H, Q, hd]` (1 in a decode step) over keys and values `[B, Hkv, T, hd]` where `mask`
    `[B, 1, Q, T]` is True. On a CPU in float32 with the query heads grouped per key head (no repeated keys);
    elsewhere SDPA."""
    B, H, Q, hd = q.shape
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                              enable_gqa=H != k.shape[1])
    g = H // k.shape[1]
    scores = q.float().reshape(B, -1, g * Q, hd) @ k.float().transpose(-1, -2) * scale  # [B, Hkv, g*Q, T]
    scores = scores.view(B, -1, g, Q, scores.shape[-1]).masked_fill(~mask[:, :, None], float("-inf"))  # [B,Hkv,g,Q,T]
    weights = scores.softmax(-1).view(B, -1, g * Q, scores.shape[-1])  # mask [B, 1, Q, T] on every head
    return (weights @ v.float()).view(B, H, Q, hd).to(q.dtype)


def _check_generation_config(gen, processor, path: Path) -> None:
    """transformers' `generate(generation_mode="image")` reads `generation_kwargs["boi_token_id"]` (the CFG rows keep
    that token), and its Janus conversion script (`convert_janus_weights_to_hf.py`) writes it there. Our sampler takes
    the id from the tokenizer instead, but a checkpoint without it fails in transformers' own generate, and so would
    what we export from it; the fix is one line of JSON, with the id the tokenizer gives."""
    if "boi_token_id" in (getattr(gen, "generation_kwargs", None) or {}):
        return
    boi = processor.tokenizer.convert_tokens_to_ids(processor.image_start_token)
    problem = "has no generation_kwargs.boi_token_id" if path.is_file() else "is missing"
    raise ConfigError(f"Janus generation config {path} {problem}; it needs "
                      f"\"generation_kwargs\": {{\"boi_token_id\": {boi}}} ({processor.image_start_token}'s id), "
                      "as transformers' Janus conversion script writes it")


# transformers versions (pyproject.toml's range): the output's cache name changed inside it; from_pretrained's dtype
# argument did too (run/load_checks.py, dtype_argument). The newer releases still take the old names, warning
# (`deprecate_kwarg` and `ModelOutput` in transformers/utils: `past_key_values` goes in 5.40).
def _cached_layers(out) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) `[B, Hkv, T, hd]` per layer of the cache a forward with `use_cache=True` returned. transformers
    5.24 returns it as `cache` (reading `past_key_values` warns), earlier ones as `past_key_values`; its layers are
    `.layers[i].keys` since 4.55 or so, `.key_cache[i]` in 4.52."""
    kv = out["cache"] if "cache" in out else out["past_key_values"]  # `in` does not warn; the old key alone would
    if hasattr(kv, "layers"):
        return [(layer.keys, layer.values) for layer in kv.layers]
    return list(zip(kv.key_cache, kv.value_cache))


class JanusVQTokenizer(nn.Module):
    """`tokenizer.ImageTokenizer` over Janus's VQ model (LlamaGen VQ-16: 16x downsample, 8-d codes).

    `encode` compares L2-normalised latents with L2-normalised codes, as the original Janus / LlamaGen
    quantizer does (`codebook_l2_norm=True`) and as `decode` (`get_codebook_entry`) assumes;
    transformers' `JanusVQVAEVectorQuantizer.forward` uses raw distances instead.
    """

    def __init__(self, vq):
        super().__init__()
        if vq.quantize.embedding.weight.device.type == "cpu":
            # A CPU without native bf16 convolutions decoded one 384 px image in minutes in bf16 (a Janus-Pro-1B-
            # sized model saved in bf16, as released; docs/benchmarks.md) and in seconds in float32. The VQ model
            # is frozen and only the tokenizer uses it, so it runs in float32 there (+0.2 GB for Janus-Pro).
            vq.float()
        self.vq = vq  # transformers JanusVQVAE
        self.grid = tuple(vq.quantize.quant_state_dims)

    @property
    def codebook_size(self) -> int:
        return self.vq.config.num_embeddings

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        w = self.vq.quantize.embedding.weight  # [K, D]
        z = self.vq.quant_conv(self.vq.encoder(images.to(w.dtype) * 2 - 1))  # [B, D, h, w]
        z = F.normalize(z.permute(0, 2, 3, 1).reshape(-1, z.shape[1]).float(), dim=-1)  # [B*h*w, D]
        return (z @ F.normalize(w.float(), dim=-1).t()).argmax(-1).view(images.shape[0], -1)  # [B, h*w]

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return ((self.vq.decode(codes).float() + 1) / 2).clamp(0, 1)  # [B, 3, H, W]

    @torch.no_grad()
    def code_vectors(self, codes: torch.Tensor) -> torch.Tensor:
        """The L2-normalised code vectors `[B, N, 8]` of codes `[B, N]`: the original's `quant_b` (get_codebook_entry
        with codebook_l2_norm), which STAGE compares (tokenizer hook)."""
        return F.normalize(self.vq.quantize.embedding.weight[codes].float(), dim=-1)
