"""Train ShapesWorld's aesthetic head: the LAION v2 MLP on frozen tiny-CLIP image embeddings.

Same recipe as LAION's `train_predictor.py` (christophschuhmann/improved-aesthetic-predictor):
embed images once with the frozen CLIP, L2-normalise, regress the rating with MSE and Adam at
lr 1e-3, batch 256, keep the epoch with the lowest validation MSE. Here the rating is
`scene.aesthetic_label` (0..10 from background noise, clipping and cornering) of fresh renders of
both splits, so the head only has what the CLIP image embedding keeps of those factors.

Captions never mention those factors, so a purely contrastive tiny CLIP drops them: on such an
embedding the head reached Spearman 0.11. train_clip's default preset therefore adds an auxiliary
probe for the factors to the image embedding (train_clip.py, point 5); with it the head passes
the 0.8 bar (numbers in the report / clip_metrics.json). A web-scale CLIP keeps image quality for
free, because web captions correlate with it; this is the stand-in for that.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from grpo_vision.rewards.aesthetic import AestheticMLP
from grpo_vision.shapes.data import render_batch, to_tensor
from grpo_vision.shapes.scene import aesthetic_label
from grpo_vision.shapes.build.train_clip import image_embeddings

SHAPES_HIDDEN = (96, 48, 32, 16)  # LAION's widths scaled for the 64-d world CLIP (768 / 64 = 12x narrower)


@dataclass
class AestheticPreset:
    n_images: int  # renders embedded for training (10% of them validate)
    epochs: int  # passes over the embeddings
    batch_size: int  # LAION: 256
    lr: float  # LAION: Adam 1e-3


AESTHETIC_PRESETS = {
    "micro": AestheticPreset(1024, 20, 128, 1e-3),
    "default": AestheticPreset(8192, 30, 256, 1e-3),
}


@torch.no_grad()
def embed_renders(clip_model, n: int, seed: int, batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(L2-normalised embeddings `[n, D]`, aesthetic labels `[n]`) of n fresh renders of both splits
    with aesthetic factors."""
    rng = np.random.default_rng(seed)
    embs, labels = [], []
    for i in range(0, n, batch_size):
        batch = render_batch(rng, min(batch_size, n - i), split="all", aesthetic=True)
        embs.append(image_embeddings(clip_model, to_tensor(batch.images)).float())
        labels.append(torch.tensor([aesthetic_label(s) for s in batch.scenes]))
    return torch.cat(embs), torch.cat(labels).float()


def fit_aesthetic(emb: torch.Tensor, labels: torch.Tensor, epochs: int = 30, batch_size: int = 256,
                  lr: float = 1e-3, seed: int = 0, hidden: tuple[int, ...] = SHAPES_HIDDEN,
                  val_frac: float = 0.1) -> tuple[AestheticMLP, dict]:
    """Fit an AestheticMLP on precomputed embeddings `[N, D]` -> labels `[N]` with MSE and Adam;
    returns the head (eval mode) from the epoch with the lowest validation MSE, and its MSE."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n_val = max(1, int(val_frac * len(emb)))
    perm = torch.randperm(len(emb), generator=gen)
    val, train = perm[:n_val], perm[n_val:]
    head = AestheticMLP(emb.shape[1], hidden)
    with torch.no_grad():  # start at the label mean: the first epochs then learn the factors, not the offset
        head.layers[-1].bias.fill_(labels[train].mean().item())
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    best, best_mse = None, float("inf")
    for _ in range(epochs):
        head.train()
        for idx in train[torch.randperm(len(train), generator=gen)].split(batch_size):
            loss = F.mse_loss(head(emb[idx]), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        head.eval()
        with torch.no_grad():
            mse = F.mse_loss(head(emb[val]), labels[val]).item()
        if mse < best_mse:
            best, best_mse = copy.deepcopy(head.state_dict()), mse
    head.load_state_dict(best)
    return head.eval(), {"aesthetic_val_mse": round(best_mse, 4)}


def train_aesthetic(clip_model, preset: str | AestheticPreset = "default",
                    seed: int = 0) -> tuple[AestheticMLP, dict]:
    """Embed fresh renders with the frozen `clip_model` and fit the head; returns (head, info)."""
    p = AESTHETIC_PRESETS[preset] if isinstance(preset, str) else preset
    start = time.monotonic()
    clip_model.eval()
    emb, labels = embed_renders(clip_model, p.n_images, seed)
    head, info = fit_aesthetic(emb, labels, p.epochs, p.batch_size, p.lr, seed)
    info["aesthetic_seconds"] = round(time.monotonic() - start, 1)
    return head, info


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation (ties get their mean rank; scipy.stats.spearmanr)."""
    from scipy.stats import spearmanr

    return float(spearmanr(a.numpy(), b.numpy()).statistic)


@torch.no_grad()
def evaluate_aesthetic(clip_model, head: AestheticMLP, n: int = 2048, seed: int = 999) -> dict:
    """Spearman correlation of the head's score with aesthetic_label on n fresh renders (seed
    distinct from training's)."""
    emb, labels = embed_renders(clip_model, n, seed)
    return {"aesthetic_spearman": round(spearman(head.eval()(emb), labels), 4)}


def main(argv: list[str] | None = None) -> None:
    """python -m grpo_vision.shapes.build.train_aesthetic --clip DIR/clip.safetensors --out DIR"""
    import argparse
    import json

    from grpo_vision.rewards.aesthetic import save_aesthetic
    from grpo_vision.shapes.build.train_clip import MODEL_NAME, load_clip

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--clip", required=True, help="shapes_clip checkpoint (clip.safetensors)")
    ap.add_argument("--preset", default="default", choices=sorted(AESTHETIC_PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="directory for the weights and aesthetic_config.json")
    args = ap.parse_args(argv)
    clip_model, _, _ = load_clip(MODEL_NAME, args.clip)
    head, info = train_aesthetic(clip_model, args.preset, args.seed)
    info.update(evaluate_aesthetic(clip_model, head))
    save_aesthetic(head, args.out)
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
