"""Image tokenizers: images in [0, 1] <-> grids of codebook ids.

`VQTokenizer` wraps diffusers' `VQModel` (encoder, `quant_conv`, codebook `quantize.embedding`,
`post_quant_conv`, decoder) and saves/loads with diffusers' own `save_pretrained`/`from_pretrained`
from a local directory (safetensors), so a checkpoint is a plain diffusers VQModel folder.

Codes are looked up directly in `quantize.embedding` rather than through `lookup_from_codebook`,
which in diffusers requires `vq_embed_dim == latent_channels`; ours uses a low-dimensional codebook
(better codebook usage, as in ViT-VQGAN arXiv 2110.04627) behind the 1x1 `quant_conv`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn
import torch.nn.functional as F

from grpo_vision.run.load_checks import non_finite


@runtime_checkable
class ImageTokenizer(Protocol):
    grid: tuple[int, int]  # (h, w) of the code grid
    codebook_size: int

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """`[B, 3, H, W]` floats in [0, 1] -> codes `[B, h*w]` (int64, raster order)."""
        ...

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes `[B, h*w]` -> images `[B, 3, H, W]` in [0, 1]."""
        ...

    # Optional: `code_vectors(codes [B, N]) -> [B, N, D]`, the L2-normalised codebook vectors of codes, which
    # train.token_weighting=stage compares across a group (credit.py); a tokenizer without it cannot run STAGE.


class Float32GroupNorm(nn.GroupNorm):
    """GroupNorm in float32 under autocast (its input and output stay in the autocast dtype).

    CPU autocast runs group_norm in bf16, whose backward is slower there than float32's (CUDA
    autocast already lists it as a float32 op; docs/benchmarks.md has the profile). Without autocast
    it is exactly nn.GroupNorm.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.group_norm(x.float(), self.num_groups, self.weight, self.bias, self.eps).to(x.dtype)


class VQTokenizer(nn.Module):
    def __init__(self, vq):
        super().__init__()
        self.vq = vq  # diffusers.VQModel
        for m in vq.modules():  # same parameters and state dict; only the autocast dtype changes
            if type(m) is nn.GroupNorm:
                m.__class__ = Float32GroupNorm
        factor = 2 ** (len(vq.config.block_out_channels) - 1)
        self.grid = (vq.config.sample_size // factor, vq.config.sample_size // factor)

    @property
    def codebook_size(self) -> int:
        return self.vq.config.num_vq_embeddings

    @property
    def codebook(self) -> torch.Tensor:
        return self.vq.quantize.embedding.weight  # [K, D]

    def latents(self, images: torch.Tensor) -> torch.Tensor:
        """Pre-quantisation latents `[B, D, h, w]` of images in [0, 1]."""
        return self.vq.encode(images * 2 - 1).latents

    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """Nearest codebook ids `[B, h*w]` for latents `[B, D, h, w]` (squared L2, as diffusers)."""
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])  # [B*h*w, D]
        e = self.codebook  # [K, D]
        d = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ e.t() + e.pow(2).sum(1)  # [B*h*w, K]
        return d.argmin(1).view(z.shape[0], -1)

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """Codebook vectors `[B, D, h, w]` for codes `[B, h*w]`."""
        h, w = self.grid
        return self.vq.quantize.embedding(codes).view(codes.shape[0], h, w, -1).permute(0, 3, 1, 2)

    @torch.no_grad()
    def code_vectors(self, codes: torch.Tensor) -> torch.Tensor:
        """The L2-normalised codebook vectors `[B, N, D]` of codes `[B, N]` (tokenizer hook, STAGE's e)."""
        return F.normalize(self.codebook[codes].float(), dim=-1)

    def decode_latents_raw(self, zq: torch.Tensor) -> torch.Tensor:
        """Decoder output `[B, 3, H, W]` in the model's own range (about [-1, 1]), for training losses."""
        return self.vq.decode(zq, force_not_quantize=True).sample

    def decode_latents(self, zq: torch.Tensor) -> torch.Tensor:
        return ((self.decode_latents_raw(zq) + 1) / 2).clamp(0, 1)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.nearest(self.latents(images))

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.shape[-1] != self.grid[0] * self.grid[1]:
            raise ValueError(f"expected {self.grid[0] * self.grid[1]} codes per image, got {codes.shape[-1]}")
        return self.decode_latents(self.lookup(codes))

    def save_pretrained(self, directory: str | Path) -> None:
        self.vq.save_pretrained(str(directory), safe_serialization=True)
        config = Path(directory) / "config.json"  # diffusers records where a loaded model came from:
        raw = json.loads(config.read_text())  # a path on this machine, which a shared world must not carry
        if raw.pop("_name_or_path", None) is not None:
            config.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")

    @staticmethod
    def check_dir(directory: str | Path) -> Path:
        """`directory` when it holds a VQModel's config.json (FileNotFoundError naming it otherwise): the check a
        kind makes at load, before diffusers is imported."""
        directory = Path(directory)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"VQ tokenizer {directory} has no config.json; expected a diffusers VQModel "
                                    "folder written by save_pretrained")
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> "VQTokenizer":
        from diffusers import VQModel

        directory = cls.check_dir(directory)
        vq = VQModel.from_pretrained(str(directory))
        if bad := non_finite(vq.state_dict()):  # damaged under an intact header: it loads, and decodes NaN
            from grpo_vision.run.checkpoint import CheckpointError

            weights = directory / "diffusion_pytorch_model.safetensors"
            raise CheckpointError(f"VQ tokenizer weights {weights if weights.is_file() else directory} hold {bad}: "
                                  "the file is damaged; copy it again, or rewrite it with save_pretrained (or rebuild "
                                  "the world)")
        return cls(vq.to(device).eval())
