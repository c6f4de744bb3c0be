"""LlamaGen's VQ tokenizer (`tokenizer/tokenizer_image/vq_model.py` at ce98ec4; our code, its module names) as
an `ImageTokenizer`; `vq_ds16_t2i.pt` / `vq_ds16_c2i.pt` load as they are (models/llamagen_load.py, `load_vq`).

    image [-1, 1] --encoder--> [B, z, h, w] --quant_conv--> [B, 8, h, w] --nearest l2-normalised code--> ids
    ids --normalised codebook--> [B, 8, h, w] --post_quant_conv--> decoder --> image [-1, 1]

VQ-16: 128 base channels, multipliers (1, 1, 2, 2, 4) (16x downsampling), 2 residual blocks a level,
attention at the lowest resolution, 256 latent channels, 16384 codes of 8 dims. Every size is read from
the checkpoint's shapes, so VQ-8 and small test models load the same way.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from grpo_vision.models.tokenizer import Float32GroupNorm

# vq_model.py's VectorQuantizer keeps a codebook-usage counter as a buffer (training statistics); sample_t2i.py
# loads it with the weights, we drop it.
IGNORED = re.compile(r"quantize\.codebook_used")


def norm(channels: int) -> nn.GroupNorm:  # vq_model.py's Normalize: 32 groups, eps 1e-6
    return Float32GroupNorm(32, channels, eps=1e-6)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class AttnBlock(nn.Module):  # single-head self-attention over the h*w positions
    def __init__(self, c: int):
        super().__init__()
        self.norm = norm(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x):
        b, c, h, w = x.shape
        n = self.norm(x)
        q, k, v = (f(n).flatten(2).transpose(1, 2) for f in (self.q, self.k, self.v))  # [b, hw, c] each
        y = F.scaled_dot_product_attention(q, k, v)  # [b, hw, c], scale c^-1/2 as vq_model.py
        return x + self.proj_out(y.transpose(1, 2).reshape(b, c, h, w))


class Resample(nn.Module):
    def __init__(self, c: int, down: bool):
        super().__init__()
        self.down = down
        self.conv = nn.Conv2d(c, c, 3, stride=2 if down else 1, padding=0 if down else 1)

    def forward(self, x):
        if self.down:  # asymmetric padding, as vq_model.py's Downsample
            return self.conv(F.pad(x, (0, 1, 0, 1)))
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def level(res: list[nn.Module], attn: list[nn.Module], resample: nn.Module | None, name: str) -> nn.Module:
    block = nn.Module()
    block.res, block.attn = nn.ModuleList(res), nn.ModuleList(attn)
    if resample is not None:
        block.add_module(name, resample)
    return block


class Encoder(nn.Module):
    def __init__(self, ch: int, mult: list[int], blocks: int, z: int):
        super().__init__()
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        self.conv_blocks, cin = nn.ModuleList(), ch
        for i, m in enumerate(mult):
            last = i == len(mult) - 1
            res = [ResnetBlock(cin if j == 0 else ch * m, ch * m) for j in range(blocks)]
            cin = ch * m
            self.conv_blocks.append(level(res, [AttnBlock(cin) for _ in range(blocks)] if last else [],
                                          None if last else Resample(cin, down=True), "downsample"))
        self.mid = nn.ModuleList([ResnetBlock(cin, cin), AttnBlock(cin), ResnetBlock(cin, cin)])
        self.norm_out, self.conv_out = norm(cin), nn.Conv2d(cin, z, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for block in self.conv_blocks:
            for i, res in enumerate(block.res):
                h = block.attn[i](res(h)) if len(block.attn) else res(h)
            if hasattr(block, "downsample"):
                h = block.downsample(h)
        for m in self.mid:
            h = m(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, ch: int, mult: list[int], blocks: int, z: int):
        super().__init__()
        cin = ch * mult[-1]
        self.conv_in = nn.Conv2d(z, cin, 3, padding=1)
        self.mid = nn.ModuleList([ResnetBlock(cin, cin), AttnBlock(cin), ResnetBlock(cin, cin)])
        self.conv_blocks = nn.ModuleList()
        for i in reversed(range(len(mult))):  # lowest resolution first
            res = [ResnetBlock(cin if j == 0 else ch * mult[i], ch * mult[i]) for j in range(blocks + 1)]
            cin = ch * mult[i]
            attn = [AttnBlock(cin) for _ in range(blocks + 1)] if i == len(mult) - 1 else []
            self.conv_blocks.append(level(res, attn, Resample(cin, down=False) if i else None, "upsample"))
        self.norm_out, self.conv_out = norm(cin), nn.Conv2d(cin, 3, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        for m in self.mid:
            h = m(h)
        for block in self.conv_blocks:
            for i, res in enumerate(block.res):
                h = block.attn[i](res(h)) if len(block.attn) else res(h)
            if hasattr(block, "upsample"):
                h = block.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class LlamaGenVQ(nn.Module):
    """LlamaGen's VQ model; implements `tokenizer.ImageTokenizer`. `grid` is set by the policy's loader
    (the image size the GPT was trained at / `downsample`)."""

    def __init__(self, ch: int, mult: list[int], blocks: int, z: int, codebook_size: int, code_dim: int):
        super().__init__()
        self.encoder, self.decoder = Encoder(ch, mult, blocks, z), Decoder(ch, mult, blocks, z)
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Embedding(codebook_size, code_dim)
        self.quant_conv, self.post_quant_conv = nn.Conv2d(z, code_dim, 1), nn.Conv2d(code_dim, z, 1)
        self.downsample = 2 ** (len(mult) - 1)
        self.grid: tuple[int, int] | None = None

    @property
    def codebook_size(self) -> int:
        return self.quantize.embedding.num_embeddings

    def codebook(self) -> torch.Tensor:
        return F.normalize(self.quantize.embedding.weight, dim=-1)  # [K, D]: codebook_l2_norm=True

    @torch.no_grad()
    def code_vectors(self, codes: torch.Tensor) -> torch.Tensor:
        """The L2-normalised code vectors `[B, N, D]` of codes `[B, N]` (vq_model.py's quant, which STAGE compares)."""
        return self.codebook()[codes].float()

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        w = self.quant_conv.weight
        z = self.quant_conv(self.encoder(images.to(w.dtype) * 2 - 1))  # [B, D, h, w]
        flat = F.normalize(z.permute(0, 2, 3, 1).reshape(-1, z.shape[1]), dim=-1)  # [B*h*w, D]
        e = self.codebook()  # [K, D]
        d = flat.pow(2).sum(1, keepdim=True) + e.pow(2).sum(1) - 2 * flat @ e.t()  # [B*h*w, K], as vq_model.py
        return d.argmin(1).view(images.shape[0], -1)  # [B, h*w]

    def decode_raw(self, codes: torch.Tensor) -> torch.Tensor:
        """Decoder output `[B, 3, H, W]` in the model's own range, about [-1, 1] (vq_model.py's decode_code)."""
        h, w = self.grid or (math.isqrt(codes.shape[-1]),) * 2
        if codes.shape[-1] != h * w:
            raise ValueError(f"expected {h * w} codes per image ({h}x{w}), got {codes.shape[-1]}")
        zq = self.codebook()[codes].view(codes.shape[0], h, w, -1).permute(0, 3, 1, 2)  # [B, D, h, w]
        return self.decoder(self.post_quant_conv(zq))

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return ((self.decode_raw(codes).float() + 1) / 2).clamp(0, 1)  # [B, 3, H, W]
