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
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

from grpo_vision.run.checkpoint import CheckpointError
from grpo_vision.config.load import brief
from grpo_vision.models.kv_cache import future_keys, new_kv, write_step
from grpo_vision.run.load_checks import integer_weights, non_finite, shape_mismatch

if TYPE_CHECKING:  # the window's shape: the sampler's, read here (sampling/speculative.py)
    from grpo_vision.sampling.speculative import Tree

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

    def forward(self, x, cos, sin, attend, w_qkv=None):
        """x `[B, T, dim]`, or `[B, dim]` (decode: one row a sequence, each linear one mm); `attend(q, k, v)`, one of
        the `*_attention` functions below, answers in x's shape. q/k/v from the modules (training: LoRA layers wrap
        them), or from new_cache's concatenated weights."""
        H, Hkv = self.n_heads, self.n_kv_heads
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1) if w_qkv is None else F.linear(x, w_qkv)
        qkv = qkv.view(x.shape[0], -1, H + 2 * Hkv, self.head_dim).transpose(1, 2)  # [B, H+2Hkv, T, hd]
        qk = apply_rope(qkv[:, :H + Hkv], cos, sin)  # [B, H+Hkv, T, hd]
        return self.o_proj(attend(qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]))  # like x


def prefix_attention(cache: KVCache | None, start: int):
    """Causal: teacher forcing, or the prefill and the plan stage, which write the cache from `start` on first (with
    a cache T is all of it or 1, so is_causal's top-left alignment holds)."""
    def attend(i, q, k, v):
        if cache is not None:
            end = start + k.shape[2]
            cache.k[i, :, :, start:end], cache.v[i, :, :, start:end] = k, v
            k, v = cache.k[i, :, :, :end], cache.v[i, :, :, :end]  # [B, Hkv, end, hd]
        return attention(q, k, v, q.shape[2] > 1, k.shape[1] != q.shape[1]).transpose(1, 2).flatten(2)
    return attend


def step_attention(cache: KVCache):
    """decode's: one query a row, its key written at the cache position (models/kv_cache.py), two plain products
    with the heads grouped per kv head (GQA without repeating the keys)."""
    future = None if cache.position is None else future_keys(cache.position, cache.k.shape[3])  # [T] keys to hide
    def attend(i, q, k, v):  # q [B, H, 1, hd], k and v [B, Hkv, 1, hd] -> [B, H*hd]
        (B, H, _, hd), Hkv = q.shape, k.shape[1]
        k, v = write_step(cache.k[i], cache.v[i], k[:, :, 0], v[:, :, 0], cache.pos, cache.position)
        scores = (q.reshape(B, Hkv, H // Hkv, hd) * hd ** -0.5) @ k.transpose(-1, -2)  # [B, Hkv, H/Hkv, pos+1|T]
        if future is not None:
            scores = scores.masked_fill(future, float("-inf"))
        return (scores.softmax(-1) @ v).view(B, H * hd)
    return attend


def window_attention(cache: KVCache, slots: torch.Tensor, mask: torch.Tensor):
    """decode_block's: W queries a row, their keys and values written at cache slots `slots` `[B, W]`, each query
    over the whole cache with `mask` `[B, 1, W, T]` (a window's `Tree.mask`)."""
    def attend(i, q, k, v):
        at = slots[:, None, :, None].expand_as(k)  # [B, Hkv, W, hd] where the window's keys go
        cache.k[i].scatter_(2, at, k.to(cache.k.dtype))
        cache.v[i].scatter_(2, at, v.to(cache.v.dtype))
        return attention(q, cache.k[i], cache.v[i], False, k.shape[1] != q.shape[1], mask).transpose(1, 2).flatten(2)
    return attend


class MLP(nn.Module):  # SwiGLU: down(silu(gate(x)) * up(x))
    def __init__(self, cfg: LlamaPolicyConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x, w_gate_up=None):  # w_gate_up: gate's and up's weights concatenated (new_cache)
        gate, up = (self.gate_proj(x), self.up_proj(x)) if w_gate_up is None else F.linear(x, w_gate_up).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


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

    def forward(self, x, cos, sin, attend, w_qkv=None, w_gate_up=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, w_qkv)
        return x + self.mlp(self.post_attention_layernorm(x), w_gate_up)


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
        self._rope_tables: dict = {}  # (device, dtype) -> cos/sin tables computed in float32
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
        cache.pos, cache.canvas, cache.canvas_at = 0, self.layout_canvas(cond), cond.shape[1] - 1
        h = self._forward(self._embed(cond, 0, cache.canvas, cache.canvas_at), cache)  # [B, L, dim]
        if cache.position is not None:
            cache.position.fill_(cache.pos)
        return self._image_head(h[:, -1])  # [B, K]

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per row `[B]`: `_layers` at T = 1 with the fused weights (a test checks it against teacher
        forcing). A static cache's position stays on the device: no host sync, a CUDA graph can record the step."""
        pos = cache.pos if cache.position is None else cache.position.view(1, 1)
        x = self._embed(tokens[:, None] + self.cfg.image_offset, pos, cache.canvas, cache.canvas_at)  # [B, 1, dim]
        h = self._layers(x[:, 0], *self._rope(x, pos, cache.k.shape[3]), step_attention(cache), cache.fused)
        if cache.position is None:
            cache.pos += 1
        else:
            cache.position.add_(1)
        return self._image_head(h)  # [B, K]

    def decode_block(self, tokens: torch.Tensor, cache: KVCache, start: torch.Tensor, tree: Tree) -> torch.Tensor:
        """A window of W image tokens a row `[B, W]` shaped as `tree` (a chain or a tree of drafts, `speculative.Tree`),
        row b's written at cache slots `start[b] .. start[b] + W - 1` (`start` `[B]`), each node read at its own
        position and attending over the cache before the window and the nodes on its path: the next token's logits
        at each node `[B, W, K]`. Rows at their own positions in one fixed-size cache: speculative decoding's verify
        pass (sampling/speculative.py); `decode`'s math over W tokens."""
        pos, slots = tree.positions(start)  # [B, W] each
        x = self._embed(tokens + self.cfg.image_offset, pos, cache.canvas, cache.canvas_at)  # [B, W, dim]
        attend = window_attention(cache, slots, tree.mask(start, cache.k.shape[3]))
        h = self._layers(x, *self._rope(x, pos, cache.k.shape[3]), attend, cache.fused)
        return self._image_head(h)  # [B, W, K]

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
        h = self._forward(self._embed(ids, 0, self.layout_canvas(cond), cond.shape[1] - 1))  # [B, L+N-1, dim]
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
        """Teacher forcing (no cache), or the prefill and the plan stage writing the cache from `cache.pos` on."""
        start = cache.pos if cache is not None else 0
        h = self._layers(x, *self._rope(x, start), prefix_attention(cache, start))  # [B, T, dim]
        if cache is not None:
            cache.pos += x.shape[1]
        return h

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend, fused=None) -> torch.Tensor:
        """The blocks over `x` (Attention.forward's shapes), then the final norm: every path's one loop; `attend(layer,
        q, k, v)` is one of the `*_attention` functions. Without `fused` the blocks run as modules (training: LoRA
        layers, gradient checkpointing, DDP's / FSDP's hooks); with new_cache's weights (4 matmuls a layer, not 7)
        their forward alone, as sampling reads the weights directly (run/distributed.full_weights)."""
        remat = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):  # non-reentrant recompute: works under DDP / FSDP hooks
            args = (x, cos, sin, partial(attend, i), *(fused[i] if fused else ()))
            run = layer.forward if fused else partial(checkpoint, layer, use_reentrant=False) if remat else layer
            x = run(*args)
        return self.model.norm(x)

    def _embed(self, ids: torch.Tensor, pos: int | torch.Tensor, canvas: torch.Tensor | None = None,
               canvas_at: int = 0) -> torch.Tensor:
        """The inputs `[B, T, dim]` of `ids` `[B, T]` at cache positions `pos` (the first's, or `[B or 1, T]`), plus
        the layout canvas `[B, N, dim]` where one predicts an image token: the input at canvas_at + j predicts j."""
        x = self.model.embed_tokens(ids)  # [B, T, dim]
        if canvas is None:
            return x
        j = (torch.arange(pos, pos + ids.shape[1], device=x.device) if isinstance(pos, int) else pos) - canvas_at
        N = canvas.shape[1]  # no canvas before <boi>, nor past the image (a speculative window runs past it)
        at = j.clamp(0, N - 1).expand(ids.shape)[..., None].expand(x.shape)  # [B, T, dim]
        return x + (canvas.gather(1, at) * ((j >= 0) & (j < N))[..., None]).to(x.dtype)

    def _rope(self, x: torch.Tensor, pos: int | torch.Tensor, length: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at cache positions `pos` (as `_embed` takes them), `[T, hd]` or `[B or 1, 1, T, hd]`, without a host
        sync; tables built once a dtype and device, at least `length` long, kept out of the state dict."""
        key, tables = (x.device, x.dtype), self._rope_tables
        if key not in tables or len(tables[key][0]) < length:
            with torch.inference_mode(False):  # usable by autograd even if first built while sampling
                cos_sin = rope_tables(self.cfg, max(self.cfg.plan_cond_len + self.cfg.num_image_tokens, length))
                tables[key] = tuple(t.to(device=x.device, dtype=x.dtype) for t in cos_sin)
        if isinstance(pos, int):
            return tuple(t[pos:pos + x.shape[1]] for t in tables[key])
        return tuple(t.index_select(0, pos.flatten()).view(*pos.shape, -1).unsqueeze(1) for t in tables[key])

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
