"""LlamaGen (FoundationVision/LlamaGen, arXiv 2406.06525) as an `ImagePolicy`, loading its released GPT
checkpoints as they are (`autoregressive/models/gpt.py` at ce98ec4 is the reference; our own code, with its
module names, so that a released state dict loads key for key).

A sequence is `cls_token_num` condition positions, then the image's N codes in raster order:

    c2i: [class embedding]                  + codes    (cls_token_num 1; the extra class index is CFG's null)
    t2i: [caption embedder(T5 features) x L] + codes   (L = cls_token_num, 120 in every released model; the
                                                        null caption: the first L rows of `uncond_embedding`)

Conditions as tensors (what `encode_prompts` returns): c2i `[B, 1]` class ids; t2i `[B, L, C]` flan-t5-xl
features, left-padded with zero vectors, as `sample_t2i.py` builds its `c_indices` (the real tokens rotated to
the end, the rest multiplied by a zero mask). Padding positions are not attended, except each by itself
(`generate.py`'s mask: the eye keeps a padding row's softmax finite; nothing reads that row).

LlamaGen specifics kept exactly, since the released weights were trained with them:
* 2D RoPE over the image grid: half of each head's pairs turn with the row, half with the column; the
  condition positions get cos = sin = 0 (`precompute_freqs_cis_2d`), i.e. their queries and keys are zero.
* RMSNorm in float32, the rotation in float32, logits in float32.
Left out: dropout and the random condition drop of LlamaGen's pre-training (RL recipes such as GCPO run
without them, and the ratio test needs training and sampling to compute the same function).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from grpo_vision.config.load import ConfigError, brief
from grpo_vision.models.kv_cache import future_keys, new_kv, write_step

if TYPE_CHECKING:  # the window's shape: the sampler's, read here (sampling/speculative.py)
    from grpo_vision.sampling.speculative import Tree


# gpt.py's CaptionEmbedder holds `uncond_embedding` of token_num=120 rows (gpt.py:93, 96), and Transformer never
# passes its cls_token_num there (gpt.py:273): the buffer has 120 rows whatever caption length the model was
# trained with. 120 is also train_t2i.py's --cls-token-num default (train_t2i.py:241).
CAPTION_ROWS = 120


@dataclass
class LlamaGenConfig:
    mode: str  # "c2i" (class-conditional) or "t2i" (text-to-image)
    dim: int  # residual width
    n_layer: int  # transformer blocks
    n_head: int  # attention heads
    n_kv_head: int  # key/value heads (= n_head in every released model)
    ffn_dim: int  # SwiGLU hidden width
    codebook_size: int  # K: the GPT's vocabulary is the VQ codebook
    grid: int  # image tokens per side: image size / the VQ's downsampling (16)
    cls_token_num: int  # condition positions: 1 (c2i); t2i: the checkpoint's --cls-token-num, 120 when released
    num_classes: int = 0  # c2i: classes; index num_classes is CFG's null class
    caption_dim: int = 0  # t2i: width of the text features (2048 for flan-t5-xl)
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    uncond_rows: int = CAPTION_ROWS  # t2i: rows of the null caption buffer `uncond_embedding` (>= cls_token_num)
    image_size: int = 0  # pixels per side (grid x the VQ's downsampling); 0 = not known (written into exports)

    @property
    def num_image_tokens(self) -> int:
        return self.grid * self.grid

    @classmethod
    def from_weights(cls, state: dict, n_head: int, grid: int, cls_token_num: int = CAPTION_ROWS,
                     image_size: int = 0) -> "LlamaGenConfig":
        """Every size but the head count, the grid and (t2i) the caption length is in the weights' shapes."""
        vocab, dim = state["tok_embeddings.weight"].shape
        n_layer = len({k.split(".")[1] for k in state if k.startswith("layers.")})
        qkv = state["layers.0.attention.wqkv.weight"].shape[0]
        head_dim = dim // n_head
        common = dict(dim=dim, n_layer=n_layer, n_head=n_head, n_kv_head=(qkv // head_dim - n_head) // 2,
                      ffn_dim=state["layers.0.feed_forward.w1.weight"].shape[0], codebook_size=vocab, grid=grid,
                      image_size=image_size)
        if "cls_embedding.embedding_table.weight" in state:
            return cls("c2i", cls_token_num=1, num_classes=state["cls_embedding.embedding_table.weight"].shape[0] - 1,
                       **common)
        rows, caption_dim = state["cls_embedding.uncond_embedding"].shape
        return cls("t2i", cls_token_num=cls_token_num, caption_dim=caption_dim, uncond_rows=rows, **common)


@dataclass
class LlamaGenCache:
    k: torch.Tensor  # [layers, B, kv_heads, L + N, head_dim]
    v: torch.Tensor  # [layers, B, kv_heads, L + N, head_dim]
    valid: torch.Tensor | None = None  # [B, L + N] False at caption padding; None: nothing padded
    pos: int = 0  # positions written
    position: torch.Tensor | None = None  # a static cache's next position, on the device (models/kv_cache.py)


def rope_table(cfg: LlamaGenConfig) -> torch.Tensor:
    """cos/sin `[cls_token_num + N, head_dim/2, 2]` as gpt.py's `precompute_freqs_cis_2d`: pairs 0..hd/4-1
    turn with the row, the rest with the column; the condition positions get zeros."""
    half = cfg.dim // cfg.n_head // 2
    freqs = 1.0 / cfg.rope_base ** (torch.arange(0, half, 2)[: half // 2].float() / half)  # [hd/4]
    angles = torch.outer(torch.arange(cfg.grid).float(), freqs)  # [grid, hd/4]
    grid = torch.cat([angles[:, None].expand(-1, cfg.grid, -1), angles[None].expand(cfg.grid, -1, -1)], -1)
    table = torch.stack([grid.cos(), grid.sin()], -1).flatten(0, 1)  # [N, hd/2, 2]
    return torch.cat([torch.zeros(cfg.cls_token_num, half, 2), table])


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x `[B, T, H, hd]` rotated pairwise (interleaved pairs) by table `[T, hd/2, 2]` (or `[B, T, hd/2, 2]`: each
    row at its own positions), in float32."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)  # [B, T, H, hd/2, 2]
    table = table[None] if table.ndim == 3 else table  # [1 or B, T, hd/2, 2]
    cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]  # [1 or B, T, 1, hd/2]
    out = torch.stack([xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin], -1)
    return out.flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):  # normalised in float32, as gpt.py
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: LlamaGenConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.dim // cfg.n_head
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_head + 2 * cfg.n_kv_head) * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, table, mask, cache: LlamaGenCache | None, layer: int):
        B, T, _ = x.shape
        H, Hkv, hd = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.wqkv(x).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q = rotate(q.view(B, T, H, hd), table).transpose(1, 2)  # [B, H, T, hd]
        k = rotate(k.view(B, T, Hkv, hd), table).transpose(1, 2)  # [B, Hkv, T, hd]
        v = v.view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
        if cache is not None and cache.position is not None and T == 1:  # a static decode step
            k, v = write_step(cache.k[layer], cache.v[layer], k[:, :, 0], v[:, :, 0], 0, cache.position)
        elif cache is not None:
            end = cache.pos + T
            cache.k[layer, :, :, cache.pos:end], cache.v[layer, :, :, cache.pos:end] = k, v
            k, v = cache.k[layer, :, :, :end], cache.v[layer, :, :, :end]  # [B, Hkv, end, hd]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                           enable_gqa=H != Hkv)  # [B, H, T, hd]
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # [B, T, dim]


class FeedForward(nn.Module):  # SwiGLU: w2(silu(w1 x) * w3 x)
    def __init__(self, cfg: LlamaGenConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaGenConfig):
        super().__init__()
        self.attention, self.feed_forward = Attention(cfg), FeedForward(cfg)
        self.attention_norm, self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, table, mask, cache=None, layer=0):
        h = x + self.attention(self.attention_norm(x), table, mask, cache, layer)
        return h + self.feed_forward(self.ffn_norm(h))


class LabelEmbedder(nn.Module):
    def __init__(self, cfg: LlamaGenConfig):
        super().__init__()
        self.embedding_table = nn.Embedding(cfg.num_classes + 1, cfg.dim)  # + the null class

    def forward(self, labels):  # [B, 1] -> [B, 1, dim]
        return self.embedding_table(labels)


class CaptionEmbedder(nn.Module):
    def __init__(self, cfg: LlamaGenConfig):
        super().__init__()
        self.cap_proj = nn.Sequential()  # gpt.py's MLP: fc1, tanh-GELU, fc2, no biases
        self.cap_proj.add_module("fc1", nn.Linear(cfg.caption_dim, cfg.dim, bias=False))
        self.cap_proj.add_module("act", nn.GELU(approximate="tanh"))
        self.cap_proj.add_module("fc2", nn.Linear(cfg.dim, cfg.dim, bias=False))
        # a persistent buffer in LlamaGen (register_buffer of a Parameter, gpt.py:96), so never trained there and
        # not here, but saved: its 120 rows whatever cls_token_num is (CAPTION_ROWS)
        self.register_buffer("uncond_embedding", torch.zeros(cfg.uncond_rows, cfg.caption_dim), persistent=True)

    def forward(self, features):  # [B, L, C] -> [B, L, dim]
        return self.cap_proj(features.to(self.cap_proj.fc1.weight.dtype))


class LlamaGenPolicy(nn.Module):
    """LlamaGen's GPT (c2i or t2i); implements `policy.ImagePolicy`. `captions` (t2i) encodes prompts."""

    static_decode = True  # new_cache(rows, static=True): a decode step of fixed shapes (models/kv_cache.py)

    def __init__(self, cfg: LlamaGenConfig, captions=None):
        super().__init__()
        if cfg.dim % cfg.n_head or (cfg.dim // cfg.n_head) % 4 or cfg.n_kv_head < 1 or cfg.n_head % cfg.n_kv_head:
            raise ValueError(f"LlamaGen GPT: dim {cfg.dim} must split into {cfg.n_head} heads of a width divisible by "
                             f"4 (2D RoPE), with n_head a multiple of n_kv_head ({cfg.n_kv_head})")
        if cfg.mode == "t2i" and not 1 <= cfg.cls_token_num <= cfg.uncond_rows:
            raise ValueError(f"LlamaGen GPT: cls_token_num {cfg.cls_token_num} must be 1..{cfg.uncond_rows}, the rows "
                             "of its null caption uncond_embedding")
        self.cfg = cfg
        self.cls_embedding = LabelEmbedder(cfg) if cfg.mode == "c2i" else CaptionEmbedder(cfg)
        self.tok_embeddings = nn.Embedding(cfg.codebook_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.codebook_size, bias=False)
        self.captions = captions  # llamagen_text.CaptionEncoder, not a module: not trained, saved or copied
        self.gradient_checkpointing = False  # train.gradient_checkpointing
        self._tables: dict = {}  # device -> rope_table, kept out of the state dict as in gpt.py

    # ------------------------------------------------------------------ ImagePolicy
    @property
    def num_image_tokens(self) -> int:
        return self.cfg.num_image_tokens

    @property
    def codebook_size(self) -> int:
        return self.cfg.codebook_size

    @property
    def image_grid(self) -> tuple[int, int]:
        return (self.cfg.grid, self.cfg.grid)

    def architecture(self) -> dict:
        """The sizes run/memory.py estimates a step's peak from; the T5 caption encoder (t2i) is not a
        parameter of the policy but stays in memory beside it."""
        c = self.cfg
        encoder = 0 if self.captions is None else sum(p.numel() * p.element_size()
                                                        for p in self.captions.model.parameters())
        return dict(layers=c.n_layer, dim=c.dim, heads=c.n_head, kv_heads=c.n_kv_head, ffn_dim=c.ffn_dim,
                    cond_len=c.cls_token_num, codebook=c.codebook_size, extra_bytes=encoder)

    def encode_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        device = self.output.weight.device
        if self.cfg.mode == "c2i":
            return torch.tensor([[class_index(p, self.cfg.num_classes)] for p in prompts], device=device)  # [B, 1]
        if self.captions is None:
            raise ConfigError("a text-to-image LlamaGen needs policy.options.text_encoder: the local flan-t5-xl "
                              "directory its captions are encoded with")
        return left_pad(self.captions.features(prompts), self.cfg.cls_token_num).to(device)  # [B, L, C]

    def null_condition(self, cond: torch.Tensor) -> torch.Tensor:
        self._check_condition(cond)
        if self.cfg.mode == "c2i":
            return torch.full_like(cond, self.cfg.num_classes)  # [B, 1]: generate.py's cond_null
        # LlamaGen's null caption is the whole 120-row uncond_embedding in place of the 120-row caption (token_drop,
        # gpt.py:107; generate.py:137), and the model keeps the first cls_token_num rows of what it embeds
        # (gpt.py:342, 349): rows 0..L-1. Here under the caption's own padding mask, as generate.py's emb_masks.
        valid = caption_mask(cond)[..., None]  # [B, L, 1]
        rows = self.cls_embedding.uncond_embedding[: self.cfg.cls_token_num]  # [L, C]
        return rows.to(cond.dtype) * valid  # [B, L, C]

    def new_cache(self, batch_size: int, static: bool = False, extra: int = 0) -> LlamaGenCache:
        """`extra` positions past the image: a speculative window's (sampling/speculative.py)."""
        c, w = self.cfg, self.output.weight
        shape = (c.n_layer, batch_size, c.n_kv_head, c.cls_token_num + c.num_image_tokens + extra, c.dim // c.n_head)
        k, v, position = new_kv(shape, w.dtype, w.device, static)
        return LlamaGenCache(k, v, position=position)

    def prefill(self, cond: torch.Tensor, cache: LlamaGenCache) -> torch.Tensor:
        self._check_condition(cond)
        cache.pos, valid = 0, self._valid(cond)  # [B, L] or None
        if valid is not None:
            cache.valid = torch.cat([valid, valid.new_ones(valid.shape[0], cache.k.shape[3] - valid.shape[1])], 1)
        position, cache.position = cache.position, None  # the prefill writes as an eager cache does
        h = self._forward(self.cls_embedding(cond), cache.valid, cache)  # [B, L, dim]
        if position is not None:
            cache.position = position.fill_(cache.pos)
        return self._logits(h[:, -1])  # [B, K]

    def decode(self, tokens: torch.Tensor, cache: LlamaGenCache) -> torch.Tensor:
        h = self._forward(self.tok_embeddings(tokens)[:, None], cache.valid, cache)  # [B, 1, dim]
        return self._logits(h[:, -1])  # [B, K]

    def decode_block(self, tokens: torch.Tensor, cache: LlamaGenCache, start: torch.Tensor, tree: Tree) -> torch.Tensor:
        """A window of W image tokens a row `[B, W]` shaped as `tree` (`speculative.Tree`), row b's written at cache
        slots `start[b] .. start[b] + W - 1` (`start` `[B]`), through the blocks' math: each node read at its own
        position, attending over the cache before the window (caption padding masked) and the nodes on its path;
        the next token's logits at each node `[B, W, K]`. Speculative decoding's verify pass
        (sampling/speculative.py)."""
        (B, W), T = tokens.shape, cache.k.shape[3]
        x = self.tok_embeddings(tokens)  # [B, W, dim]
        pos, slots = tree.positions(start)  # [B, W] each
        table = self._table(x.device)
        # positions past the image have no 2D angle: their tokens are cut off, so any (the last) serves
        rows = table[pos.clamp_max(len(table) - 1)]  # [B, W, hd/2, 2]
        mask = tree.mask(start, T)  # [B, 1, W, T]
        if cache.valid is not None:
            mask = mask & cache.valid[:, None, None, :]
        for i, layer in enumerate(self.layers):
            a = layer.attention
            H, Hkv, hd = a.n_head, a.n_kv_head, a.head_dim
            q, k, v = a.wqkv(layer.attention_norm(x)).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
            q = rotate(q.view(B, W, H, hd), rows).transpose(1, 2)  # [B, H, W, hd]
            k = rotate(k.view(B, W, Hkv, hd), rows).transpose(1, 2)  # [B, Hkv, W, hd]
            at = slots[:, None, :, None].expand_as(k)  # [B, Hkv, W, hd]
            cache.k[i].scatter_(2, at, k.to(cache.k.dtype))
            cache.v[i].scatter_(2, at, v.view(B, W, Hkv, hd).transpose(1, 2).to(cache.v.dtype))
            y = F.scaled_dot_product_attention(q, cache.k[i], cache.v[i], attn_mask=mask, enable_gqa=H != Hkv)
            h = x + a.wo(y.transpose(1, 2).reshape(B, W, -1))  # [B, W, dim]
            x = h + layer.feed_forward(layer.ffn_norm(h))
        return self._logits(self.norm(x))  # [B, W, K]

    def forward(self, cond: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.image_logits(cond, tokens)

    def gradient_checkpointing_enable(self) -> None:
        self.gradient_checkpointing = True

    @torch.no_grad()
    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embeddings `[B, N, dim]` of image tokens `[B, N]` (tok_embeddings): policy.py's optional hook."""
        return self.tok_embeddings(tokens)

    def image_logits(self, cond: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        # Positions L-1 .. L+N-2 predict image tokens 0 .. N-1 (gpt.py: logits[:, cls_token_num - 1:]).
        self._check_condition(cond)
        x = torch.cat([self.cls_embedding(cond), self.tok_embeddings(tokens[:, :-1])], dim=1)  # [B, L+N-1, dim]
        valid = self._valid(cond)
        if valid is not None:
            valid = torch.cat([valid, valid.new_ones(tokens[:, :-1].shape)], 1)  # [B, L+N-1]
        h = self._forward(x, valid)  # [B, L+N-1, dim]
        return self._logits(h[:, self.cfg.cls_token_num - 1:])  # [B, N, K]

    # ------------------------------------------------------------------ internals
    def _check_condition(self, cond: torch.Tensor) -> None:
        """A one-line ValueError unless `cond` is `[B, 1]` (c2i) or `[B, L, C]` (t2i) with L = cls_token_num:
        of another length, image_logits' slice from L - 1 would give other positions' logits, or none."""
        c = self.cfg
        want = [c.cls_token_num] if c.mode == "c2i" else [c.cls_token_num, c.caption_dim]
        if list(cond.shape[1:]) != want:
            got, shape = cond.shape[1] if cond.ndim > 1 else 0, ", ".join(map(str, want))
            raise ValueError(f"a LlamaGen condition of {got} positions (shape {list(cond.shape)}), but this {c.mode} "
                             f"model reads {c.cls_token_num} (its cls_token_num; shape [B, {shape}]): make conditions "
                             "with its encode_prompts")

    def _valid(self, cond: torch.Tensor) -> torch.Tensor | None:
        """Condition positions that are attended `[B, L]`, or None when nothing is padded (c2i)."""
        return caption_mask(cond) if self.cfg.mode == "t2i" else None

    def _forward(self, x: torch.Tensor, valid: torch.Tensor | None, cache: LlamaGenCache | None = None):
        """Final-norm hidden states `[B, T, dim]` of positions start .. start+T-1 (start = cache.pos or 0)."""
        start, T = (cache.pos if cache is not None else 0), x.shape[1]
        static = cache is not None and cache.position is not None and T == 1  # a decode step of fixed shapes
        if static:
            table = self._table(x.device).index_select(0, cache.position.view(1))  # [1, hd/2, 2]
            mask = ~future_keys(cache.position, cache.k.shape[3])[None, None, None]  # [1, 1, 1, L+N]
            if valid is not None:
                mask = mask & valid[:, None, None, :]  # [B, 1, 1, L+N]
        else:
            table = self._table(x.device)[start:start + T]  # [T, hd/2, 2]
            mask = attention_mask(valid, start, T, x.device)
        remat = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):  # non-reentrant recompute: works under DDP / FSDP hooks
            x = checkpoint(layer, x, table, mask, cache, i, use_reentrant=False) if remat else \
                layer(x, table, mask, cache, i)
        if static:
            cache.position.add_(1)
        elif cache is not None:
            cache.pos += T
        return self.norm(x)

    def _table(self, device) -> torch.Tensor:
        if device not in self._tables:
            with torch.inference_mode(False):  # usable by autograd even if first built while sampling
                self._tables[device] = rope_table(self.cfg).to(device)
        return self._tables[device]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(h).float()  # [..., K]: the vocabulary is the codebook


def attention_mask(valid: torch.Tensor | None, start: int, T: int, device) -> torch.Tensor | None:
    """Boolean `[B, 1, T, start+T]` for queries start..start+T-1: causal, padding keys hidden except from
    themselves (generate.py's causal_mask * emb_masks, then the eye). None where SDPA's own is the same."""
    if valid is None and (T == 1 or start == 0):
        return None  # one query sees every key so far; or plain causal from position 0
    end = start + T
    q = torch.arange(start, end, device=device)[:, None]  # [T, 1]
    k = torch.arange(end, device=device)[None]  # [1, end]
    mask = (k <= q)[None, None]  # [1, 1, T, end]
    if valid is not None:
        mask = mask & (valid[:, None, None, :end] | (k == q)[None, None])  # [B, 1, T, end]
    return mask


def caption_mask(cond: torch.Tensor) -> torch.Tensor:
    """`[B, L]` True at a caption's real tokens: padding positions are all-zero feature vectors."""
    return (cond != 0).any(-1)


def left_pad(features: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """`[B, length, C]`: each caption's features `[n, C]` at the end, zeros before (sample_t2i.py's left padding)."""
    out = features[0].new_zeros(len(features), length, features[0].shape[-1])
    for i, f in enumerate(features):
        out[i, length - len(f):] = f[-length:]
    return out


CLASS_PROMPT = re.compile(r"\s*(?:class\s+)?(\d+)(?![\w.])")


def class_index(prompt: str, num_classes: int) -> int:
    """The class a c2i prompt names: it starts with the index ("207", "class 207", "207 golden retriever");
    the words after it are for the rewards (CLIP reads the whole prompt), not for the policy."""
    m = CLASS_PROMPT.match(prompt)
    if m is None or int(m.group(1)) >= num_classes:
        raise ValueError(f"prompt {brief(prompt)} does not start with a class index in 0..{num_classes - 1}: a "
                         "class-conditional LlamaGen reads prompts like '207' or '207 golden retriever'")
    return int(m.group(1))
