"""Train ShapesWorld's base policy: the built-in Llama policy, by teacher forcing on caption -> codes.

The data are rendered train-split scenes (aesthetic factors included, so the base model reproduces
noise, clipping and corners and an aesthetic reward has something to remove), tokenized once by the
world's VQ tokenizer. Captions are dropped to the null condition with probability `cond_dropout`
so that classifier-free guidance works at sampling time (as LlamaGen trains, p = 0.1).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from grpo_vision.models.llama import LlamaImagePolicy, LlamaPolicyConfig
from grpo_vision.prompts import PromptEntry
from grpo_vision.rollouts import draw
from grpo_vision.sampling import SamplingParams
from grpo_vision.shapes.data import render_batch, to_tensor
from grpo_vision.shapes.scene import all_words, prompt_list
from grpo_vision.models.tokenizer import VQTokenizer


@dataclass
class PolicyPreset:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    examples: int  # rendered and tokenized training pairs
    batch_size: int
    lr: float
    steps: int  # optimisation steps (a count, not a time budget: the build is deterministic)
    cond_dropout: float = 0.1  # caption -> null condition, for classifier-free guidance
    amp: bool = True  # bf16 autocast on CPU (AMX); log-probs in RL are computed in float32


POLICY_PRESETS = {
    "micro": PolicyPreset(64, 2, 4, 2, 128, 256, 16, 3e-3, 20, amp=False),  # float32: see VQ_PRESETS["micro"]
    # 3.0M params: 2,400 steps take about 22 minutes on 2 CPU cores; against the 1.39M preset
    # (192, 3, 6, 2, 512) GRPO's main job gains +14.6 points on test captions instead of +10.3 (six seeds)
    # (docs/experiments/recipe_ablations.md)
    "default": PolicyPreset(256, 4, 8, 2, 672, 30000, 32, 1e-3, 2400),
}

# Sampling settings the world's base policy is evaluated and RL-trained with.
DEFAULT_SAMPLING = {"cfg_scale": 3.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def tokenize_dataset(tok: VQTokenizer, n: int, seed: int, progress: bool) -> tuple[torch.Tensor, list[str]]:
    """Render n train-split scenes and encode them: codes `[n, h*w]` and their captions."""
    rng = np.random.default_rng(seed)
    codes, captions = [], []
    for _ in tqdm(range(0, n, 256), desc="tokenize", disable=not progress, leave=False):
        batch = render_batch(rng, min(256, n - len(captions)), split="train")
        # bf16 latents, float32 nearest-code search: a few codes differ from encode()'s float32 ones,
        # the reconstructions pass the checker as often, and it is faster (docs/benchmarks.md)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            z = tok.latents(to_tensor(batch.images)).float()
        codes.append(tok.nearest(z))
        captions += batch.captions
    return torch.cat(codes), captions


def lr_at(step: int, p: PolicyPreset) -> float:
    """Linear warmup, then cosine decay to 10% over the step budget."""
    warmup = min(200, p.steps // 10)
    if step < warmup:
        return p.lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, p.steps - warmup))
    return p.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_policy(tok: VQTokenizer, preset: str | PolicyPreset, seed: int = 0,
                 progress: bool = True) -> tuple[LlamaImagePolicy, dict]:
    p = POLICY_PRESETS[preset] if isinstance(preset, str) else preset
    torch.manual_seed(seed)
    codes, captions = tokenize_dataset(tok, p.examples, seed + 1, progress)
    words = all_words()
    cfg = LlamaPolicyConfig(words=words, max_caption_words=max(len(c.split()) for c in captions) + 2,
                            codebook_size=tok.codebook_size, image_grid=tuple(tok.grid), dim=p.dim,
                            n_layers=p.n_layers, n_heads=p.n_heads, n_kv_heads=p.n_kv_heads, ffn_dim=p.ffn_dim)
    policy = LlamaImagePolicy(cfg)
    cond_all = policy.encode_prompts(captions)  # [n, L]
    null = policy.null_condition(cond_all[:1])  # [1, L]
    opt = torch.optim.AdamW(policy.parameters(), lr=p.lr, betas=(0.9, 0.95), weight_decay=0.05)
    gen = torch.Generator().manual_seed(seed)
    start, step, ema_loss = time.monotonic(), 0, None
    bar = tqdm(total=p.steps, desc="policy", disable=not progress, leave=False)
    policy.train()
    while step < p.steps:
        idx = torch.randint(0, len(captions), (p.batch_size,), generator=gen)
        cond, target = cond_all[idx], codes[idx]  # [B, L], [B, N]
        drop = torch.rand(p.batch_size, generator=gen) < p.cond_dropout
        cond = torch.where(drop[:, None], null, cond)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, p)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=p.amp):
            logits = policy.image_logits(cond, target)  # [B, N, K]
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        ema_loss = loss.item() if ema_loss is None else 0.98 * ema_loss + 0.02 * loss.item()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{ema_loss:.3f}")
    bar.close()
    policy.eval()
    return policy, {"policy_steps": step, "policy_seconds": round(time.monotonic() - start, 1),
                    "policy_train_loss": round(ema_loss or float("nan"), 4),
                    "policy_params": sum(q.numel() for q in policy.parameters())}


@torch.no_grad()
def evaluate_policy(policy: LlamaImagePolicy, tok: VQTokenizer, n_prompts: int = 64, per_prompt: int = 2,
                    seed: int = 777, sampling: dict | None = None) -> dict:
    """Exact-checker accuracy of base-policy samples, per attribute, on seen and held-out prompts."""
    from grpo_vision.shapes.checker import ATTRIBUTES, check

    params = SamplingParams(**(sampling or DEFAULT_SAMPLING))
    out = {}
    for split, tag in (("train", "seen"), ("heldout", "heldout")):
        prompts = [pr for pr in prompt_list(split, n_prompts, seed) for _ in range(per_prompt)]
        images = draw(policy, tok, [PromptEntry(p) for p in prompts], range(len(prompts)), params, 64).images
        results = [check(img, pr) for img, pr in zip(images, prompts)]
        out[f"policy_acc_{tag}"] = round(float(np.mean([r.correct for r in results])), 4)
        for a in ATTRIBUTES:
            vals = [getattr(r, a) for r in results if getattr(r, a) is not None]
            out[f"policy_acc_{tag}_{a}"] = round(float(np.mean(vals)), 4) if vals else None
    return out
