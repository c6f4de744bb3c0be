"""Train ShapesWorld's VQ tokenizer: a diffusers `VQModel`, 64x64 images to a grid of codes (16x16 by default).

A naive VQ-VAE (codebook learned by gradient, random init) reconstructs blurrily and uses a small
part of its codebook (docs/experiments/world_recipes.md). What fixes that, in the order it happens:

1. Warm-up as a plain autoencoder, so the encoder's outputs mean something before codes are fit.
2. k-means initialisation of the codebook on encoder outputs (SoundStream arXiv 2107.03312).
3. EMA codebook updates instead of gradients (VQ-VAE-2 arXiv 1906.00446, appendix), with a
   low-dimensional codebook behind the 1x1 `quant_conv` (ViT-VQGAN arXiv 2110.04627).
4. Dead-code restarts: a code whose EMA usage collapses is moved onto a random encoder output of
   the current batch (Jukebox arXiv 2005.00341).
5. An edge-aware loss: L1 on image gradients on top of MSE and L1, so shape boundaries, which the
   exact checker reads, stay sharp.
6. A last phase that trains the decoder alone on the frozen codes with a decaying learning rate
   (`finetune_decoder`): the codes are settled by then, and what remains is drawing them exactly.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from grpo_vision.shapes.data import psnr, render_batch, to_tensor
from grpo_vision.models.tokenizer import VQTokenizer


@dataclass
class VQPreset:
    block_out_channels: tuple[int, ...]  # n blocks = n-1 downsamples: 4 -> 8x8 codes, 3 -> 16x16
    layers_per_block: int
    latent_channels: int  # encoder output width; equals codebook_dim under spatial norm (diffusers)
    codebook_dim: int  # D, width of a code
    codebook_size: int  # K
    norm_num_groups: int
    batch_size: int
    lr: float
    warmup_steps: int  # plain autoencoder steps before k-means
    steps: int  # optimisation steps (a step count, not a time budget, keeps the build deterministic)
    amp: bool = True  # bf16 autocast for the conv stacks (faster where the CPU has bf16 matrix units)
    norm_type: str = "spatial"  # decoder norm: "spatial" re-injects the codes after each GroupNorm (MoVQ)
    object_weight: float = 4.0  # extra loss weight on pixels far from the background colour
    decoder_steps: int = 0  # then the decoder alone, codes frozen, learning rate decayed to 0 (finetune_decoder)
    decoder_lr: float = 5e-4
    decoder_object_weight: float = 8.0
    # renders of every composition: the tokenizer is a codec, and the held-out split is a test of what
    # the policy and CLIP learnt from captions, not of the codec (docs/experiments/world_recipes.md)
    split: str = "all"


VQ_PRESETS = {
    # micro: for tests, seconds not quality (group norm: spatial norm needs widths that are multiples of 32).
    # float32 in every micro preset: on a CPU without bf16 units the autocast is emulated, and the micro world
    # took 80 s to build with it against 27 s without on a 2-core AMD EPYC (the CLIP stage 58 s against 13 s)
    "micro": VQPreset((8, 8, 16, 16), 1, 8, 8, 256, 8, 8, 2e-3, 5, 20, norm_type="group", decoder_steps=5,
                       amp=False),
    # 16x16 codes; the step counts are the shortest whose world GRPO still gained on (a trimmed
    # 1000 + 300-step recipe was built and rejected: docs/experiments/world_recipes.md)
    "default": VQPreset((32, 32, 64), 1, 16, 16, 512, 32, 16, 1e-3, 250, 1500, decoder_steps=800),
}
DECODER_SEED_OFFSET = 5  # the decoder phase renders its own scenes, from seed + this


def build_vq(p: VQPreset) -> VQTokenizer:
    from diffusers import VQModel

    n = len(p.block_out_channels)
    vq = VQModel(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=p.block_out_channels,
        layers_per_block=p.layers_per_block, latent_channels=p.latent_channels, sample_size=64,
        num_vq_embeddings=p.codebook_size, vq_embed_dim=p.codebook_dim, norm_num_groups=p.norm_num_groups,
        mid_block_add_attention=False, norm_type=p.norm_type,
    )
    return VQTokenizer(vq)


def renders(rng: np.random.Generator, n: int, split: str) -> torch.Tensor:
    """n fresh scene renders `[n, 3, 64, 64]` in [0, 1], with aesthetic factors, from `split`."""
    return to_tensor(render_batch(rng, n, split=split).images)


def image_loss(recon: torch.Tensor, target: torch.Tensor, object_weight: float = 4.0) -> torch.Tensor:
    """Object-weighted MSE + L1, plus L1 on horizontal and vertical image gradients (edges).

    Objects cover a few percent of a ShapesWorld image, so a plain MSE is dominated by background
    and an early codebook collapses object colours to an average; pixels far from the image's
    median colour (the background) get `1 + object_weight` times the weight.
    """
    def grads(x):
        return x[..., :, 1:] - x[..., :, :-1], x[..., 1:, :] - x[..., :-1, :]

    background = target.flatten(2).median(dim=2).values[..., None, None]  # [B, 3, 1, 1]
    weight = 1 + object_weight * ((target - background).abs().amax(1, keepdim=True) > 0.4)  # [B, 1, H, W]
    err = recon - target
    pixel = (weight * (err.pow(2) + 0.5 * err.abs())).mean()
    (rx, ry), (tx, ty) = grads(recon), grads(target)
    return pixel + (rx - tx).abs().mean() + (ry - ty).abs().mean()


def kmeans(x: torch.Tensor, k: int, iters: int, gen: torch.Generator) -> torch.Tensor:
    """Lloyd's k-means on rows of x `[M, D]` with k-means++ seeding (Arthur & Vassilvitskii 2007);
    empty clusters are re-seeded from random rows."""
    centres = x[torch.randint(0, x.shape[0], (1,), generator=gen)]  # [1, D]
    closest = torch.cdist(x, centres).squeeze(1).pow(2)  # [M] squared distance to the nearest centre
    for _ in range(k - 1):  # each next centre drawn with probability proportional to that distance
        pick = torch.multinomial(closest + 1e-12, 1, generator=gen)
        centres = torch.cat([centres, x[pick]])
        closest = torch.minimum(closest, (x - x[pick]).pow(2).sum(1))
    for _ in range(iters):
        assign = torch.cdist(x, centres).argmin(1)  # [M]
        sums = torch.zeros_like(centres).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k).float()
        empty = counts == 0
        centres = torch.where(empty[:, None], x[torch.randint(0, x.shape[0], (k,), generator=gen)],
                              sums / counts.clamp_min(1)[:, None])
    return centres


class EMACodebook:
    """EMA statistics of code usage and code sums; writes the codebook into the VQModel in place."""

    def __init__(self, codebook: torch.Tensor, decay: float = 0.99, eps: float = 1e-5):
        self.weight, self.decay, self.eps = codebook, decay, eps  # [K, D], the VQModel's embedding
        self.size = torch.ones(codebook.shape[0])  # [K] EMA count per code
        self.sum = codebook.detach().clone()  # [K, D] EMA sum of assigned vectors

    @torch.no_grad()
    def update(self, flat: torch.Tensor, codes: torch.Tensor, gen: torch.Generator) -> int:
        """One EMA step from encoder outputs `[M, D]` and their codes `[M]`; returns codes restarted."""
        K = self.weight.shape[0]
        onehot_sum = torch.zeros_like(self.sum).index_add_(0, codes, flat)  # [K, D]
        counts = torch.bincount(codes, minlength=K).float()  # [K]
        self.size.mul_(self.decay).add_(counts, alpha=1 - self.decay)
        self.sum.mul_(self.decay).add_(onehot_sum, alpha=1 - self.decay)
        n = self.size.sum()
        smoothed = (self.size + self.eps) / (n + K * self.eps) * n  # Laplace smoothing
        self.weight.copy_(self.sum / smoothed[:, None])
        dead = self.size < 0.03 * flat.shape[0] / K  # used far less than uniformly
        if dead.any():
            pick = flat[torch.randint(0, flat.shape[0], (int(dead.sum()),), generator=gen)]
            self.weight[dead] = pick
            self.sum[dead] = pick
            self.size[dead] = 1.0
        return int(dead.sum())


def train_vq(preset: str | VQPreset, seed: int = 0, progress: bool = True) -> tuple[VQTokenizer, dict]:
    p = VQ_PRESETS[preset] if isinstance(preset, str) else preset
    torch.manual_seed(seed)
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    tok = build_vq(p)
    tok.train()
    vq = tok.vq
    opt = torch.optim.Adam([q for n, q in vq.named_parameters() if not n.startswith("quantize.")], lr=p.lr)
    ema = None
    start, step, restarts = time.monotonic(), 0, 0
    bar = tqdm(total=p.steps, desc="vq", disable=not progress, leave=False)
    while step < p.steps:
        x = renders(rng, p.batch_size, p.split)  # [B, 3, 64, 64]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=p.amp):
            z = tok.latents(x).float()  # [B, D, 8, 8]
        if step < p.warmup_steps:  # plain autoencoder: no quantisation yet
            zq, commit = z, torch.zeros(())
        else:
            flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])  # [B*64, D]
            if ema is None:  # k-means init on a large sample of current encoder outputs
                with torch.no_grad():
                    sample = torch.cat([flat.detach()] + [
                        tok.latents(renders(rng, p.batch_size, p.split)).permute(0, 2, 3, 1).reshape(-1, z.shape[1])
                        for _ in range(max(1, 4096 // flat.shape[0]))])
                    tok.codebook.data.copy_(kmeans(sample, p.codebook_size, 15, gen))
                ema = EMACodebook(tok.codebook.data)
            codes = tok.nearest(z.detach()).flatten()  # [B*64]
            zq_flat = tok.codebook[codes].detach()  # [B*64, D]
            commit = F.mse_loss(flat, zq_flat)
            h, w = tok.grid
            zq = z + (zq_flat.view(z.shape[0], h, w, -1).permute(0, 3, 1, 2) - z).detach()  # straight-through
            restarts += ema.update(flat.detach(), codes, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=p.amp):
            recon = tok.decode_latents_raw(zq).float()
        loss = image_loss(recon, x * 2 - 1, p.object_weight) + 0.25 * commit
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.4f}", restarts=restarts)
    bar.close()
    tok.eval()
    info = {"vq_steps": step, "vq_seconds": round(time.monotonic() - start, 1), "vq_restarts": restarts}
    if p.decoder_steps:
        info |= finetune_decoder(tok, p.decoder_steps, p.batch_size, p.decoder_lr, seed + DECODER_SEED_OFFSET, p.amp,
                                 p.decoder_object_weight, progress, p.split)
    return tok, info


def finetune_decoder(tok: VQTokenizer, steps: int, batch_size: int, lr: float, seed: int, amp: bool = True,
                     object_weight: float = 4.0, progress: bool = True, split: str = "all") -> dict:
    """Train the decoder alone, encoder and codebook frozen, with cosine decay of the learning rate.

    Codes do not change, so anything trained on them (the base policy) stays valid; the decoder
    learns to draw those codes more exactly (the joint phase runs at a constant rate, and colours
    close together, yellow and orange, were the checker's most common failure on reconstructions).
    """
    rng = np.random.default_rng(seed)
    decoder = [q for n, q in tok.vq.named_parameters() if n.startswith(("post_quant_conv.", "decoder."))]
    opt = torch.optim.Adam(decoder, lr=lr)
    start = time.monotonic()
    tok.eval()  # no dropout or batch statistics in VQModel; eval keeps the frozen half exactly as it was
    for step in tqdm(range(steps), desc="vq decoder", disable=not progress, leave=False):
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        x = renders(rng, batch_size, split)  # [B, 3, 64, 64]
        # the codes exactly as encode() gives them (fp32: a bf16 nearest-code search changed a third of them)
        zq = tok.lookup(tok.encode(x)).detach()  # frozen encoder and codebook
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            recon = tok.decode_latents_raw(zq).float()
        loss = image_loss(recon, x * 2 - 1, object_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {"vq_decoder_steps": steps, "vq_decoder_seconds": round(time.monotonic() - start, 1)}


@torch.no_grad()
def evaluate_vq(tok: VQTokenizer, n: int = 256, seed: int = 12345) -> dict:
    """PSNR and codebook usage on held-out renders: clean ones (the bar) and with aesthetic factors."""
    from grpo_vision.shapes.checker import check

    rng = np.random.default_rng(seed)
    out = {}
    for tag, aesthetic in (("clean", False), ("all", True)):
        batch = render_batch(rng, n, split="all", aesthetic=aesthetic)
        x = to_tensor(batch.images)
        codes = torch.cat([tok.encode(x[i:i + 64]) for i in range(0, n, 64)])
        recon = torch.cat([tok.decode(codes[i:i + 64]) for i in range(0, n, 64)])
        out[f"vq_psnr_{tag}"] = round(psnr(recon, x).mean().item(), 2)
        out[f"vq_checker_acc_{tag}"] = round(float(np.mean([check(r, c).correct for r, c in
                                                            zip(recon, batch.captions)])), 4)
        out[f"vq_codes_used_{tag}"] = int(codes.unique().numel())
    out["vq_codebook_size"] = tok.codebook_size
    out["vq_grid"] = list(tok.grid)
    out["vq_perplexity"] = round(_perplexity(codes, tok.codebook_size), 1)
    return out


def _perplexity(codes: torch.Tensor, k: int) -> float:
    p = torch.bincount(codes.flatten(), minlength=k).float()
    p = p / p.sum()
    return math.exp(-(p[p > 0] * p[p > 0].log()).sum().item())
