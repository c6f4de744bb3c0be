"""The built-in policy: a Llama-architecture transformer over caption words and image codes.

One vocabulary holds special tokens, caption words and the VQ codebook, in that order, and for a policy that
plans (`plan_words`, policy.PlanningPolicy) a plan block after the codebook, so that image ids do not move:

    [<pad> <bos> <null> <boi> <unk>] [word_0 ... word_W-1] [code_0 ... code_K-1] [<bop> <eop> plan_0 ... plan_P-1]

A sequence is a left-padded caption, the image-start token `<boi>`, then the image's N codes in
raster order (LlamaGen-style, arXiv 2406.06525, with 1D RoPE and a plain token vocabulary so that
the weights map one-to-one onto transformers' `LlamaForCausalLM`: module names match, see
`models/llama_hf.py`). Image-token logits use only the codebook rows of `lm_head`, which both restricts
sampling to the codebook and skips the word rows. Classifier-free guidance uses `<null>` in place of
the caption; training drops captions to it at random (ShapesWorld's base-policy training).

With a plan (T2I-R1's two stages, as separate sequences): the text stage reads `<pad>* <bos> words <bop>` and
writes plan tokens until `<eop>`; the image stage reads `<pad>* <bos> words <bop> plan <eop> <boi>`, left padded to
`max_caption_words + max_plan_tokens + 4`, then draws the codes. The null row blanks caption and plan alike.
Plan ids in the protocol are local to `[<eop> plan_0 ... plan_P-1]` (0 ends a plan).

A layout canvas (`canvas_attributes`, with the plan words that name the image grid's columns and rows and the
size of each box): the plan of the image condition drawn onto the token grid, and added at the input that predicts
each image token, which then carries the learned vectors of the colour, shape, ... of every planned object whose box
covers it (a layout map, as layout-to-image models condition: GLIGEN arXiv 2301.07093, LayoutGPT arXiv 2305.15393).
Relative positions (RoPE) give an image token no way to match a plan word `x5` with "my column is 5"; the canvas
makes the match part of the input (docs/experiments/text_plans.md: without it the image stage placed objects at
chance, with it it follows its plan). Such a policy has no `LlamaForCausalLM` equivalent, so it does not export
to transformers.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

from grpo_vision.run.checkpoint import CheckpointError
from grpo_vision.config.load import brief
from grpo_vision.models.kv_cache import future_keys, new_kv, write_step
from grpo_vision.run.load_checks import integer_weights, non_finite, shape_mismatch

SPECIALS = ["<pad>", "<bos>", "<null>", "<boi>", "<unk>"]
PAD, BOS, NULL, BOI, UNK = range(len(SPECIALS))


@dataclass
class LlamaPolicyConfig:
    words: list[str] = field(default_factory=list)  # caption vocabulary (lower-case words)
    max_caption_words: int = 12  # longest caption in words; shorter ones are left-padded
    codebook_size: int = 256  # K, size of the VQ codebook
    image_grid: tuple[int, int] = (8, 8)  # (h, w) token grid of one image
    dim: int = 256  # residual width
    n_layers: int = 4  # transformer blocks
    n_heads: int = 8  # attention heads
    n_kv_heads: int = 2  # key/value heads; grouped-query attention shrinks the KV cache decode reads
    ffn_dim: int = 688  # SwiGLU hidden width (~8/3 * dim, as in Llama)
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    plan_words: list[str] = field(default_factory=list)  # a layout plan's vocabulary; empty: the policy cannot plan
    max_plan_tokens: int = 0  # the longest plan the image condition holds (its width grows by this plus 2)
    # a layout canvas (module docstring); empty canvas_attributes: none. The plan's cells split the image evenly
    # (any number of them, not the token grid's). An object of a plan is a run of words that closes once it has
    # named both a column and a row; it paints its attribute words over the tokens whose centres lie within half
    # its extent (the extent word's, in cells; 1 without one) of its cell's centre
    canvas_attributes: list[str] = field(default_factory=list)  # plan words painted onto the canvas
    canvas_columns: list[str] = field(default_factory=list)  # plan words naming the plan's columns, left to right
    canvas_rows: list[str] = field(default_factory=list)  # plan words naming its rows, top to bottom
    canvas_extents: dict[str, float] = field(default_factory=dict)  # plan word -> side of the object's box, in cells

    @property
    def cond_len(self) -> int:  # <pad>* <bos> words <boi>
        return self.max_caption_words + 2

    @property
    def plan_cond_len(self) -> int:  # <pad>* <bos> words <bop> plan <eop> <boi>
        return self.cond_len + self.max_plan_tokens + 2 if self.plan_words else self.cond_len

    @property
    def num_image_tokens(self) -> int:
        return self.image_grid[0] * self.image_grid[1]

    @property
    def plan_offset(self) -> int:  # vocabulary id of <bop>; <eop> (local plan id 0) follows it
        return self.image_offset + self.codebook_size

    @property
    def image_offset(self) -> int:  # vocabulary id of code 0
        return len(SPECIALS) + len(self.words)

    @property
    def vocab_size(self) -> int:
        return self.plan_offset + (len(self.plan_words) + 2 if self.plan_words else 0)


@dataclass
class KVCache:
    k: torch.Tensor  # [layers, B, kv_heads, max_len, head_dim]
    v: torch.Tensor  # [layers, B, kv_heads, max_len, head_dim]
    fused: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: W_qkv [(H+2Hkv)*hd, dim], W_gate_up [2F, dim]
    pos: int = 0  # number of positions already written
    position: torch.Tensor | None = None  # a static cache's next position, on the device (models/kv_cache.py)
    canvas: torch.Tensor | None = None  # [B, N, dim] a canvas policy's layout map of the prefilled condition
    canvas_at: int = 0  # the cache position of the input that predicts image token 0 (<boi>)


def canvas_words(cfg: LlamaPolicyConfig) -> dict[int, tuple[int | None, int | None, int | None, float | None]]:
    """The vocabulary id of each plan word the canvas reads -> (its attribute index, column, row, extent; None where
    the word is not one). ValueError naming the field when the canvas does not fit the plan vocabulary or grid."""
    known = set(cfg.plan_words)
    for name, words in (("canvas_attributes", cfg.canvas_attributes), ("canvas_columns", cfg.canvas_columns),
                        ("canvas_rows", cfg.canvas_rows), ("canvas_extents", list(cfg.canvas_extents))):
        if unknown := [x for x in words if x not in known]:
            raise ValueError(f"{name} names {unknown[:4]}, which are not plan words (plan_words)")
    if not (cfg.canvas_columns and cfg.canvas_rows):
        raise ValueError("a canvas needs the plan words of its columns and rows (canvas_columns, canvas_rows)")
    out = {}
    for j, word in enumerate(cfg.plan_words):
        entry = (cfg.canvas_attributes.index(word) if word in cfg.canvas_attributes else None,
                 cfg.canvas_columns.index(word) if word in cfg.canvas_columns else None,
                 cfg.canvas_rows.index(word) if word in cfg.canvas_rows else None, cfg.canvas_extents.get(word))
        if entry != (None,) * 4:
            out[cfg.plan_offset + 2 + j] = entry  # plan word j's vocabulary id (<bop> <eop> come first)
    return out


def covered(cell: int, extent: float, cells: int, tokens: int) -> tuple[int, int]:
    """The first and last of `tokens` tokens along one axis whose centre lies within extent / 2 cells of cell
    `cell`'s centre, the axis split into `cells` cells (boundaries included, as a box's pixels are)."""
    scale = tokens / cells  # token j's centre is at (j + 0.5) / scale cells
    lo, hi = scale * (cell + 0.5 - extent / 2) - 0.5, scale * (cell + 0.5 + extent / 2) - 0.5
    return max(0, math.ceil(lo - 1e-9)), min(tokens - 1, math.floor(hi + 1e-9))


def rope_tables(cfg: LlamaPolicyConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[max_len, head_dim]` in transformers' Llama layout (halves, `rotate_half`)."""
    head_dim = cfg.dim // cfg.n_heads
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    freqs = torch.outer(torch.arange(max_len).float(), inv_freq)  # [T, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, head_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin  # [B, H, T, head_dim]


def effective_weight(layer: nn.Module) -> torch.Tensor:
    """The `[out, in]` matrix a bias-free linear layer applies, also when it is wrapped (a peft LoRA
    layer computes W x + scale * B A x; applying it to the identity reads off W + scale * B A, with
    the adapter's current enabled/disabled state)."""
    if type(layer) is nn.Linear:
        return layer.weight
    w = layer.base_layer.weight if hasattr(layer, "base_layer") else layer.weight
    return layer(torch.eye(w.shape[1], dtype=w.dtype, device=w.device)).t()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, gqa: bool,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention `[B, H, T, hd]` (`mask`: bool, True where a query may see a key). On CPU it
    stays in float32 under autocast: CPU autocast would cast it to bf16, whose flash-attention backward is slower
    than float32's there (docs/benchmarks.md), while the products around it gain from bf16."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal,
                                                  enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaPolicyConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, cache: KVCache | None = None, layer: int = 0):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # write this step's keys/values, attend over everything so far
            end = cache.pos + T
            cache.k[layer, :, :, cache.pos:end] = k
            cache.v[layer, :, :, cache.pos:end] = v
            k, v = cache.k[layer, :, :, :end], cache.v[layer, :, :, :end]  # [B, Hkv, end, hd]
        # With a cache and T == 1 every key is in the past, so no mask is needed.
        y = attention(q, k, v, causal=T > 1, gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # [B, T, dim]


class MLP(nn.Module):  # SwiGLU: down(silu(gate(x)) * up(x))
    def __init__(self, cfg: LlamaPolicyConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, cfg: LlamaPolicyConfig):
        super().__init__()
        self.self_attn, self.mlp = Attention(cfg), MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin, cache=None, layer=0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):  # named like transformers' LlamaModel so state-dict keys match
    def __init__(self, cfg: LlamaPolicyConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class LlamaImagePolicy(nn.Module):
    """Caption-conditioned image-token transformer; implements `policy.ImagePolicy`."""

    static_decode = True  # new_cache(rows, static=True): a decode step of fixed shapes (models/kv_cache.py)

    @property
    def adapter_root(self) -> str | None:
        """A peft adapter export targets the policy's own module names, LlamaForCausalLM's (export.py); a canvas
        policy has none (its export is refused: llama_hf.to_hf_llama)."""
        return None if self.cfg.canvas_attributes else ""

    def __init__(self, cfg: LlamaPolicyConfig):
        super().__init__()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"dim ({cfg.dim}) must divide by n_heads ({cfg.n_heads}), "
                             f"and n_heads by n_kv_heads ({cfg.n_kv_heads})")
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.word_ids = {w: i + len(SPECIALS) for i, w in enumerate(cfg.words)}
        self._rope: dict = {}  # (device, dtype) -> cos/sin tables computed in float32
        self.gradient_checkpointing = False  # train.gradient_checkpointing (transformers' name for it)
        if cfg.canvas_attributes:
            self._canvas_words = canvas_words(cfg)  # vocabulary id -> (attribute, column, row, extent)
            self.canvas = nn.Linear(len(cfg.canvas_attributes), cfg.dim, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    # ------------------------------------------------------------------ ImagePolicy
    @property
    def num_image_tokens(self) -> int:
        return self.cfg.num_image_tokens

    @property
    def codebook_size(self) -> int:
        return self.cfg.codebook_size

    @property
    def image_grid(self) -> tuple[int, int]:
        return tuple(self.cfg.image_grid)

    def architecture(self) -> dict:
        """The sizes run/memory.py estimates a step's peak from (`memory.PolicyShape`'s fields)."""
        c = self.cfg
        return dict(layers=c.n_layers, dim=c.dim, heads=c.n_heads, kv_heads=c.n_kv_heads, ffn_dim=c.ffn_dim,
                    cond_len=c.plan_cond_len, codebook=c.codebook_size, fused_copy=True)

    def encode_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        rows = []
        for prompt in prompts:
            ids = self._caption_ids(prompt)
            rows.append([PAD] * (self.cfg.max_caption_words - len(ids)) + [BOS] + ids + [BOI])
        return self._ids(rows)  # [B, L]

    def _caption_ids(self, prompt: str) -> list[int]:
        words = prompt.lower().split()
        if len(words) > self.cfg.max_caption_words:
            raise ValueError(f"caption {brief(prompt)} has {len(words)} words; this policy takes at most "
                             f"{self.cfg.max_caption_words} (max_caption_words)")
        return [self.word_ids.get(w, UNK) for w in words]

    def _ids(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.lm_head.weight.device)  # [B, L]

    def unknown_words(self, prompt: str) -> list[str]:
        """The words of `prompt` outside the caption vocabulary, each once: encode_prompts reads them as <unk>."""
        return [w for w in dict.fromkeys(prompt.lower().split()) if w not in self.word_ids]

    @property
    def caption_words(self) -> list[str]:
        return list(self.cfg.words)

    def null_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """`<null>` in place of the caption (and of the plan, with one), at the condition's width."""
        null = [PAD] * (cond.shape[1] - 3) + [BOS, NULL, BOI]
        return torch.tensor(null, dtype=cond.dtype, device=cond.device).expand_as(cond)  # [B, L]

    def new_cache(self, batch_size: int, static: bool = False, extra: int = 0) -> KVCache:
        """Preallocated keys/values, plus fused projection weights for `decode`; `static`: zeros, and the
        position a tensor (models/kv_cache.py); `extra` positions past the image (a speculative window's).

        Weights do not change during a rollout, so q/k/v and gate/up are concatenated once here and
        each decode step runs 4 matmuls per layer instead of 7.
        """
        c, w = self.cfg, self.lm_head.weight
        length = c.plan_cond_len + c.num_image_tokens + extra
        shape = (c.n_layers, batch_size, c.n_kv_heads, length, c.dim // c.n_heads)
        with torch.no_grad():
            a, m = [b.self_attn for b in self.model.layers], [b.mlp for b in self.model.layers]
            fused = [(torch.cat([effective_weight(x.q_proj), effective_weight(x.k_proj), effective_weight(x.v_proj)]),
                      torch.cat([effective_weight(y.gate_proj), effective_weight(y.up_proj)])) for x, y in zip(a, m)]
        k, v, position = new_kv(shape, w.dtype, w.device, static)
        return KVCache(k, v, fused, position=position)

    def prefill(self, cond: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cache.pos = 0
        x = self.model.embed_tokens(cond)  # [B, L, dim]
        cache.canvas, cache.canvas_at = self.layout_canvas(cond), cond.shape[1] - 1
        if cache.canvas is not None:
            x = torch.cat([x[:, :-1], x[:, -1:] + cache.canvas[:, :1].to(x.dtype)], dim=1)
        h = self._forward(x, cache)  # [B, L, dim]
        if cache.position is not None:
            cache.position.fill_(cache.pos)
        return self._image_head(h[:, -1])  # [B, K]

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per row: the same math as `_forward`, written for T = 1 (a test checks equality)."""
        c, pos, position = self.cfg, cache.pos, cache.position  # position: a static cache's, else None
        H, Hkv, hd = c.n_heads, c.n_kv_heads, c.dim // c.n_heads
        B, g = tokens.shape[0], H // Hkv
        x = self.model.embed_tokens(tokens + c.image_offset)  # [B, dim]
        if cache.canvas is not None:  # the input at cache position p predicts image token p - canvas_at
            x = x + (cache.canvas[:, pos - cache.canvas_at] if position is None else
                     cache.canvas.index_select(1, (position - cache.canvas_at).view(1))[:, 0]).to(x.dtype)
        cos, sin = (t[pos] if position is None else t.index_select(0, position.view(1))[0]  # no host sync
                    for t in self._rope_tables(x))  # [hd] each
        future = None if position is None else future_keys(position, cache.k.shape[3])  # [T] keys to hide
        for i, layer in enumerate(self.model.layers):
            w_qkv, w_gate_up = cache.fused[i]
            qkv = F.linear(layer.input_layernorm(x), w_qkv)  # [B, (H+2Hkv)*hd]
            qk = apply_rope(qkv[:, :(H + Hkv) * hd].view(B, H + Hkv, hd), cos, sin)  # [B, H+Hkv, hd]
            k, v = write_step(cache.k[i], cache.v[i], qk[:, H:], qkv[:, (H + Hkv) * hd:].view(B, Hkv, hd), pos,
                              position)  # [B, Hkv, pos+1 or T, hd]
            q = qk[:, :H].reshape(B, Hkv, g, hd) * hd ** -0.5  # [B, Hkv, g, hd]: heads grouped per kv head
            scores = q @ k.transpose(-1, -2)  # [B, Hkv, g, pos+1 or T]
            if future is not None:
                scores = scores.masked_fill(future, float("-inf"))
            att = scores.softmax(-1) @ v  # [B, Hkv, g, hd]
            x = x + layer.self_attn.o_proj(att.reshape(B, H * hd))  # [B, dim]
            gate, up = F.linear(layer.post_attention_layernorm(x), w_gate_up).chunk(2, dim=-1)  # [B, F] each
            x = x + layer.mlp.down_proj(F.silu(gate) * up)  # [B, dim]
        if position is None:
            cache.pos += 1
        else:
            position.add_(1)
        return self._image_head(self.model.norm(x))  # [B, K]

    def decode_block(self, tokens: torch.Tensor, cache: KVCache, start: torch.Tensor) -> torch.Tensor:
        """W image tokens a row `[B, W]`, row b's at cache positions `start[b] .. start[b] + W - 1` (`start` `[B]`):
        their keys and values written there, each attending over the cache up to its own position (keys after it,
        stale or unwritten, masked), the next token's logits at each `[B, W, K]`. Rows at their own positions in one
        fixed-size cache: speculative decoding's verify pass (speculative.py). `decode`'s math over W tokens."""
        c = self.cfg
        H, Hkv, hd = c.n_heads, c.n_kv_heads, c.dim // c.n_heads
        (B, W), T = tokens.shape, cache.k.shape[3]
        x = self.model.embed_tokens(tokens + c.image_offset)  # [B, W, dim]
        pos = start[:, None] + torch.arange(W, device=x.device)  # [B, W]
        if cache.canvas is not None:  # a window past the image's last token reads no canvas there
            i = pos - cache.canvas_at  # [B, W] the image token each input predicts
            at = i.clamp(max=c.num_image_tokens - 1)[..., None].expand(B, W, c.dim)
            x = x + (cache.canvas.gather(1, at) * (i < c.num_image_tokens)[..., None]).to(x.dtype)
        cos, sin = (t[pos].unsqueeze(1) for t in self._rope_tables(x, T))  # [B, 1, W, hd] each
        mask = (torch.arange(T, device=x.device) <= pos[..., None]).unsqueeze(1)  # [B, 1, W, T] keys up to each query
        at = pos[:, None, :, None].expand(B, Hkv, W, hd)  # [B, Hkv, W, hd] where the window's keys go
        for i, layer in enumerate(self.model.layers):
            w_qkv, w_gate_up = cache.fused[i]
            qkv = F.linear(layer.input_layernorm(x), w_qkv).view(B, W, H + 2 * Hkv, hd)  # [B, W, H+2Hkv, hd]
            qkv = qkv.transpose(1, 2)  # [B, H+2Hkv, W, hd]
            qk = apply_rope(qkv[:, :H + Hkv], cos, sin)  # [B, H+Hkv, W, hd]
            cache.k[i].scatter_(2, at, qk[:, H:].to(cache.k.dtype))
            cache.v[i].scatter_(2, at, qkv[:, H + Hkv:].to(cache.v.dtype))
            att = attention(qk[:, :H], cache.k[i], cache.v[i], False, Hkv != H, mask)  # [B, H, W, hd]
            x = x + layer.self_attn.o_proj(att.transpose(1, 2).reshape(B, W, H * hd))  # [B, W, dim]
            gate, up = F.linear(layer.post_attention_layernorm(x), w_gate_up).chunk(2, dim=-1)  # [B, W, F] each
            x = x + layer.mlp.down_proj(F.silu(gate) * up)  # [B, W, dim]
        return self._image_head(self.model.norm(x))  # [B, W, K]

    def forward(self, cond: torch.Tensor, tokens: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor]:
        """Training's one call of the module for both segments (DDP's and FSDP's hooks run once): (image logits
        `[B, N, K]`, plan logits `[B, T, V]`) for the rows' plan segment (a `sampling.Plan`, T = 0 without a text
        stage). `image_logits` is the image alone."""
        return self.image_logits(cond, tokens), self.plan_logits(plan.ids, plan.tokens)

    def gradient_checkpointing_enable(self) -> None:
        self.gradient_checkpointing = True

    @torch.no_grad()
    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embeddings `[B, N, dim]` of image tokens `[B, N]` (codebook ids): policy.py's optional hook."""
        return self.model.embed_tokens(tokens + self.cfg.image_offset)

    def image_logits(self, cond: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        # Positions L-1 (<boi>) .. L+N-2 predict image tokens 0 .. N-1; the last token is never input.
        ids = torch.cat([cond, tokens[:, :-1] + self.cfg.image_offset], dim=1)  # [B, L+N-1]
        x = self.model.embed_tokens(ids)  # [B, L+N-1, dim]
        if (canvas := self.layout_canvas(cond)) is not None:
            L = cond.shape[1]
            x = torch.cat([x[:, :L - 1], x[:, L - 1:] + canvas[:, :tokens.shape[1]].to(x.dtype)], dim=1)
        h = self._forward(x)  # [B, L+N-1, dim]
        return self._image_head(h[:, cond.shape[1] - 1:])  # [B, N, K]

    def layout_canvas(self, cond: torch.Tensor) -> torch.Tensor | None:
        """Each condition row's plan drawn onto the token grid, `[B, N, dim]` (module docstring), or None for a
        policy without a canvas. A row without plan words (a caption alone, the null row) gets zeros."""
        c = self.cfg
        if not c.canvas_attributes:
            return None
        h, w = c.image_grid
        hot = torch.zeros(cond.shape[0], h, w, len(c.canvas_attributes))  # [B, h, w, A] how many objects paint each
        for b, ids in enumerate(cond.tolist()):
            attributes, col, line, extent = [], None, None, 1.0
            for attribute, column, row, size in filter(None, map(self._canvas_words.get, ids)):
                attributes += [] if attribute is None else [attribute]
                col, line = column if column is not None else col, row if row is not None else line
                extent = size if size is not None else extent
                if col is not None and line is not None:  # the object is complete: paint its box
                    r0, r1 = covered(line, extent, len(c.canvas_rows), h)
                    c0, c1 = covered(col, extent, len(c.canvas_columns), w)
                    if attributes:
                        hot[b, r0:r1 + 1, c0:c1 + 1, attributes] += 1
                    attributes, col, line, extent = [], None, None, 1.0
        return self.canvas(hot.flatten(1, 2).to(self.canvas.weight))  # [B, N, dim]

    # ------------------------------------------------------------------ PlanningPolicy (with plan_words)
    plan_end_id = 0  # <eop>, local plan id 0

    @property
    def plan_vocab_size(self) -> int:  # 0: this policy cannot plan (policy.check_planning refuses sample.plan)
        return len(self.cfg.plan_words) + 1 if self.cfg.plan_words else 0

    def encode_plan_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        """`<pad>* <bos> words <bop>` `[B, max_caption_words + 2]`: the plan's first token follows `<bop>`."""
        self._can_plan()
        rows = [[PAD] * (self.cfg.max_caption_words - len(ids)) + [BOS] + ids + [self.cfg.plan_offset]
                for ids in map(self._caption_ids, prompts)]
        return self._ids(rows)  # [B, L]

    def plan_condition(self, prompts: Sequence[str], plans: Sequence[Sequence[int]]) -> torch.Tensor:
        """`<pad>* <bos> words <bop> plan <eop> <boi>` `[B, plan_cond_len]`, left padded: the image stage's condition."""
        c, rows = self.cfg, []
        for prompt, plan in zip(prompts, plans, strict=True):
            plan = [int(j) for j in plan]
            if len(plan) > c.max_plan_tokens or not all(0 < j < self.plan_vocab_size for j in plan):
                raise ValueError(f"a plan of {len(plan)} tokens ({plan[:8]}): this policy's plans hold 1 to "
                                 f"{self.plan_vocab_size - 1} ids, at most {c.max_plan_tokens} (max_plan_tokens)")
            ids = self._caption_ids(prompt)
            pad = c.max_caption_words - len(ids) + c.max_plan_tokens - len(plan)
            rows.append([PAD] * pad + [BOS] + ids + [c.plan_offset] + [c.plan_offset + 1 + j for j in plan]
                        + [c.plan_offset + 1, BOI])
        return self._ids(rows)  # [B, plan_cond_len]

    def plan_text(self, tokens: Sequence[int]) -> str:
        return " ".join(self.cfg.plan_words[int(j) - 1] for j in tokens if 0 < int(j) <= len(self.cfg.plan_words))

    def new_plan_cache(self, batch_size: int, max_tokens: int) -> KVCache:
        self._can_plan()
        c, w = self.cfg, self.lm_head.weight
        # a plan cut at max_tokens has that many tokens, all in the image condition (which adds <eop> itself)
        if max_tokens > c.max_plan_tokens:
            raise ValueError(f"sample.plan.max_tokens={max_tokens}: this policy's plans hold at most "
                             f"{c.max_plan_tokens} tokens (max_plan_tokens); set sample.plan.max_tokens to "
                             f"{c.max_plan_tokens} or less")
        shape = (c.n_layers, batch_size, c.n_kv_heads, c.cond_len + max_tokens, c.dim // c.n_heads)
        k, v, _ = new_kv(shape, w.dtype, w.device, False)
        return KVCache(k, v, [])

    def plan_prefill(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cache.pos = 0
        return self._plan_head(self._forward(self.model.embed_tokens(ids), cache)[:, -1])  # [B, V]

    def plan_decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        x = self.model.embed_tokens(tokens[:, None] + self.cfg.plan_offset + 1)  # [B, 1, dim]
        return self._plan_head(self._forward(x, cache)[:, -1])  # [B, V]

    def plan_logits(self, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Positions L-1 (<bop>) .. L+T-2 predict plan tokens 0 .. T-1, as `image_logits` does for codes."""
        if tokens.shape[1] == 0:  # an empty plan segment (no text stage): nothing to run
            return self.lm_head.weight.new_zeros(tokens.shape[0], 0, self.plan_vocab_size)
        seq = torch.cat([ids, tokens[:, :-1] + self.cfg.plan_offset + 1], dim=1)  # [B, L+T-1]
        h = self._forward(self.model.embed_tokens(seq))  # [B, L+T-1, dim]
        return self._plan_head(h[:, ids.shape[1] - 1:])  # [B, T, V]

    def _plan_head(self, h: torch.Tensor) -> torch.Tensor:
        start = self.cfg.plan_offset + 1  # <eop>, then the plan words: <bop> is never drawn
        return F.linear(h, self.lm_head.weight[start:start + self.plan_vocab_size])  # [..., V]

    def _can_plan(self) -> None:
        if not self.cfg.plan_words:
            raise ValueError("this policy has no plan vocabulary (plan_words): it was trained without plans")

    # ------------------------------------------------------------------ internals
    def _forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        start = cache.pos if cache is not None else 0
        T = x.shape[1]
        cos, sin = (t[start:start + T] for t in self._rope_tables(x))  # [T, hd] each
        remat = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):  # non-reentrant recompute: works under DDP / FSDP hooks
            x = checkpoint(layer, x, cos, sin, cache, i, use_reentrant=False) if remat else layer(x, cos, sin, cache, i)
        if cache is not None:
            cache.pos += T
        return self.model.norm(x)

    def _rope_tables(self, x: torch.Tensor, length: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[T_max, hd]` in x's dtype and device, built once (kept out of the state dict); at least
        `length` long (a speculative window runs past the image)."""
        key = (x.device, x.dtype)
        if key not in self._rope or len(self._rope[key][0]) < length:
            with torch.inference_mode(False):  # usable by autograd even if first built while sampling
                tables = rope_tables(self.cfg, max(self.cfg.plan_cond_len + self.cfg.num_image_tokens, length))
                self._rope[key] = tuple(t.to(device=x.device, dtype=x.dtype) for t in tables)
        return self._rope[key]

    def _image_head(self, h: torch.Tensor) -> torch.Tensor:
        off = self.cfg.image_offset
        return F.linear(h, self.lm_head.weight[off:off + self.cfg.codebook_size])  # [..., K]

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "policy_config.json").write_text(json.dumps(asdict(self.cfg), indent=2))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, directory / "policy.safetensors")

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> "LlamaImagePolicy":
        directory = Path(directory)
        # policy.safetensors from save_pretrained; model.safetensors from export, whose LlamaForCausalLM has the
        # same module names (models/llama_hf.py)
        weights = next((directory / n for n in ("policy.safetensors", "model.safetensors") if (directory / n).is_file()),
                       directory / "policy.safetensors")
        for file in (directory / "policy_config.json", weights):
            if not file.is_file():
                raise FileNotFoundError(f"policy checkpoint {directory} has no {file.name}; expected a directory "
                                        "written by LlamaImagePolicy.save_pretrained or export")
        try:
            raw = json.loads((directory / "policy_config.json").read_text())
            raw["image_grid"] = tuple(raw["image_grid"])
            policy = cls(LlamaPolicyConfig(**raw))
            device = torch.device(device)  # safetensors reads "cpu", not the "cpu:0" of a process under accelerate
            state = load_file(weights, device="cpu" if device.type == "cpu" else str(device))
        except Exception as e:  # JSON, a config field or safetensors: each raises its own kind
            raise CheckpointError(f"policy checkpoint {directory} is unreadable ({type(e).__name__}: {e}); "
                                  "rewrite it with save_pretrained (or rebuild the world)") from None
        config = directory / "policy_config.json"
        if mismatch := shape_mismatch(policy, state):  # a config edited after the weights were saved
            raise CheckpointError(f"policy checkpoint {weights} does not fit {config} ({mismatch}); use the "
                                  "policy_config.json saved with these weights")
        if wrong := integer_weights(policy, state):  # dtypes checked on load: a float model refuses integer tensors
            raise CheckpointError(f"policy checkpoint {weights} has integer weights where the policy's are floats: "
                                  f"{wrong}; rewrite it with save_pretrained (or rebuild the world)")
        if bad := non_finite(state):  # damaged under an intact header: it loads, and no update could fix it
            raise CheckpointError(f"policy checkpoint {weights} holds {bad}: the file is damaged; copy it again, "
                                  "or rewrite it with save_pretrained (or rebuild the world)")
        policy.to(device=device, dtype=next(iter(state.values())).dtype)
        policy.load_state_dict(state)
        return policy
