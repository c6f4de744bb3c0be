"""Train ShapesWorld's base policy: the built-in Llama policy, by teacher forcing on caption -> codes.

The data are rendered train-split scenes (aesthetic factors included, so the base model reproduces
noise, clipping and corners and an aesthetic reward has something to remove), tokenized once by the
world's VQ tokenizer. Captions are dropped to the null condition with probability `cond_dropout`
so that classifier-free guidance works at sampling time (as LlamaGen trains, p = 0.1).

A planning preset (`PlanPolicyPreset`) trains caption -> plan -> image (T2I-R1's two stages, arXiv 2505.00703):
every example also gives its text sequence, the caption then its scene's ground-truth plan (shapes/plan.py) and
the end token, and its image is conditioned on caption and plan with probability `plan_prob`, on the caption
alone otherwise, so that one policy draws both ways (RL with and without the text stage starts from it). A canvas
preset (`CanvasPolicyPreset`) trains the same way a policy whose image stage also reads its plan drawn onto the
token grid (models/llama.py's layout canvas, shapes.plan.canvas_config).
"""

from __future__ import annotations

import dataclasses
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
from grpo_vision.shapes.plan import MAX_PLAN_TOKENS, canvas_config, check_plan, plan_words, scene_plan
from grpo_vision.shapes.scene import all_words, parse_caption, prompt_list
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


@dataclass
class PlanPolicyPreset(PolicyPreset):  # a subclass, so that the other presets' recipe hashes keep their fields
    plan_prob: float = 0.5  # an image is conditioned on caption + ground-truth plan with this probability, else caption
    plan_weight: float = 1.0  # the plan tokens' cross-entropy against the image tokens' in the loss


@dataclass
class CanvasPolicyPreset(PlanPolicyPreset):  # a subclass again: the plan presets' recipe hashes keep their fields
    pass  # what differs is the policy's canvas (shapes.plan.canvas_config), which the recipe hash covers


POLICY_PRESETS = {
    "micro": PolicyPreset(64, 2, 4, 2, 128, 256, 16, 3e-3, 20, amp=False),  # float32: see VQ_PRESETS["micro"]
    # 3.0M params: 2,400 steps take about 22 minutes on 2 CPU cores; against the 1.39M preset
    # (192, 3, 6, 2, 512) GRPO's main job gains +14.6 points on test captions instead of +10.3 (six seeds)
    # (docs/experiments/recipe_ablations.md)
    "default": PolicyPreset(256, 4, 8, 2, 672, 30000, 32, 1e-3, 2400),
    # the default's architecture and budget, trained on caption -> plan -> image (worlds/shapes_plan)
    "plan_micro": PlanPolicyPreset(64, 2, 4, 2, 128, 256, 16, 3e-3, 20, amp=False),
    "plan": PlanPolicyPreset(256, 4, 8, 2, 672, 30000, 32, 1e-3, 2400),
    # the plan preset with a layout canvas (worlds/shapes_canvas): its image stage follows its plan's cells
    # (docs/experiments/text_plans.md, the pilot of the canvas)
    "canvas_micro": CanvasPolicyPreset(64, 2, 4, 2, 128, 256, 16, 3e-3, 20, amp=False),
    "canvas": CanvasPolicyPreset(256, 4, 8, 2, 672, 30000, 32, 1e-3, 2400),
}

# Sampling settings the world's base policy is evaluated and RL-trained with.
DEFAULT_SAMPLING = {"cfg_scale": 3.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def tokenize_dataset(tok: VQTokenizer, n: int, seed: int,
                     progress: bool) -> tuple[torch.Tensor, list[str], list[list[str]]]:
    """Render n train-split scenes and encode them: codes `[n, h*w]`, their captions and their plans."""
    rng = np.random.default_rng(seed)
    codes, captions, plans = [], [], []
    for _ in tqdm(range(0, n, 256), desc="tokenize", disable=not progress, leave=False):
        batch = render_batch(rng, min(256, n - len(captions)), split="train")
        # bf16 latents, float32 nearest-code search: a few codes differ from encode()'s float32 ones,
        # the reconstructions pass the checker as often, and it is faster (docs/benchmarks.md)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            z = tok.latents(to_tensor(batch.images)).float()
        codes.append(tok.nearest(z))
        captions += batch.captions
        plans += [scene_plan(scene) for scene in batch.scenes]
    return torch.cat(codes), captions, plans


def lr_at(step: int, p: PolicyPreset) -> float:
    """Linear warmup, then cosine decay to 10% over the step budget."""
    warmup = min(200, p.steps // 10)
    if step < warmup:
        return p.lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, p.steps - warmup))
    return p.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass
class PlanData:  # a planning preset's teacher-forcing data, one row per example
    cond: torch.Tensor  # [n, L'] image condition of the caption and its ground-truth plan (plan_condition)
    null: torch.Tensor  # [1, L'] the null condition at that width
    ids: torch.Tensor  # [n, L] the text stage's input (encode_plan_prompts)
    tokens: torch.Tensor  # [n, T] local plan ids, the end token, then end tokens (T = MAX_PLAN_TOKENS + 1)
    targets: torch.Tensor  # [n, T] the same with -100 after the end token: those positions are not trained


PLAN_IDS = {w: j + 1 for j, w in enumerate(plan_words())}  # a plan word's local id: 0 is the end token


def plan_ids(plan: list[str]) -> list[int]:
    """A plan's words as the policy's local plan ids (PLAN_IDS; made once, not for each of the 30,000 plans)."""
    return [PLAN_IDS[w] for w in plan]


def plan_data(policy: LlamaImagePolicy, captions: list[str], plans: list[list[str]]) -> PlanData:
    ids = [plan_ids(plan) for plan in plans]
    cond = policy.plan_condition(captions, ids)  # [n, L']
    end, width = policy.plan_end_id, MAX_PLAN_TOKENS + 1
    tokens = torch.tensor([row + [end] * (width - len(row)) for row in ids])  # [n, T]
    targets = torch.tensor([row + [end] + [-100] * (width - len(row) - 1) for row in ids])  # [n, T]
    return PlanData(cond, policy.null_condition(cond[:1]), policy.encode_plan_prompts(captions), tokens, targets)


def planned_logits(policy: LlamaImagePolicy, data: PlanData, idx: torch.Tensor, cond: torch.Tensor,
                   target: torch.Tensor, drop: torch.Tensor, with_plan: torch.Tensor):
    """One planning step's logits: the images of the rows drawn without a plan (`cond`, already dropped) then of
    those with their plan (dropped alike), as two passes, since the conditions differ in width; their targets in
    that order; and every row's plan logits `[B, T, V]`."""
    planned = torch.where(drop[:, None], data.null, data.cond[idx])  # [B, L']
    parts = [(c[rows], target[rows]) for c, rows in ((cond, ~with_plan), (planned, with_plan)) if rows.any()]
    logits = torch.cat([policy.image_logits(c, t) for c, t in parts])  # [B, N, K]
    return logits, torch.cat([t for _, t in parts]), policy.plan_logits(data.ids[idx], data.tokens[idx])


def train_policy(tok: VQTokenizer, preset: str | PolicyPreset, seed: int = 0,
                 progress: bool = True) -> tuple[LlamaImagePolicy, dict]:
    p = POLICY_PRESETS[preset] if isinstance(preset, str) else preset
    planning = isinstance(p, PlanPolicyPreset)
    torch.manual_seed(seed)
    codes, captions, plans = tokenize_dataset(tok, p.examples, seed + 1, progress)
    words = all_words()
    plan = dict(plan_words=plan_words(), max_plan_tokens=MAX_PLAN_TOKENS) if planning else {}
    plan |= canvas_config() if isinstance(p, CanvasPolicyPreset) else {}
    cfg = LlamaPolicyConfig(words=words, max_caption_words=max(len(c.split()) for c in captions) + 2,
                            codebook_size=tok.codebook_size, image_grid=tuple(tok.grid), dim=p.dim,
                            n_layers=p.n_layers, n_heads=p.n_heads, n_kv_heads=p.n_kv_heads, ffn_dim=p.ffn_dim,
                            **plan)
    policy = LlamaImagePolicy(cfg)
    cond_all = policy.encode_prompts(captions)  # [n, L]
    null = policy.null_condition(cond_all[:1])  # [1, L]
    data = plan_data(policy, captions, plans) if planning else None
    opt = torch.optim.AdamW(policy.parameters(), lr=p.lr, betas=(0.9, 0.95), weight_decay=0.05)
    gen = torch.Generator().manual_seed(seed)
    start, step, ema_loss, ema_plan = time.monotonic(), 0, None, None
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
            if data is None:
                logits = policy.image_logits(cond, target)  # [B, N, K]
            else:
                with_plan = torch.rand(p.batch_size, generator=gen) < p.plan_prob  # [B]
                logits, target, plan_logits = planned_logits(policy, data, idx, cond, target, drop, with_plan)
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        if data is not None:  # the plan tokens and the end token, over the plan vocabulary's rows of lm_head only
            plan_loss = F.cross_entropy(plan_logits.float().flatten(0, 1), data.targets[idx].flatten(),
                                        ignore_index=-100)
            ema_plan = plan_loss.item() if ema_plan is None else 0.98 * ema_plan + 0.02 * plan_loss.item()
        opt.zero_grad(set_to_none=True)
        (loss if data is None else loss + p.plan_weight * plan_loss).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        ema_loss = loss.item() if ema_loss is None else 0.98 * ema_loss + 0.02 * loss.item()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{ema_loss:.3f}")
    bar.close()
    policy.eval()
    info = {"policy_steps": step, "policy_seconds": round(time.monotonic() - start, 1),
            "policy_train_loss": round(ema_loss or float("nan"), 4),
            "policy_params": sum(q.numel() for q in policy.parameters())}
    return policy, info | ({"policy_plan_loss": round(ema_plan, 4)} if planning else {})


def verdict_figures(name: str, verdicts: list[dict], prompts: list[str]) -> dict:
    """`name`: the rate of all-right verdicts; `name_{attribute}`: each attribute's, over the prompts that name it;
    `name_form_{form}`: the all-right rate per caption form."""
    from grpo_vision.shapes.checker import ATTRIBUTES
    from grpo_vision.shapes.scene import FORMS

    def rate(values):
        return round(float(np.mean(values)), 4) if values else None

    out = {name: rate([v["correct"] for v in verdicts])}
    out |= {f"{name}_{a}": rate([v[a] for v in verdicts if v[a] is not None]) for a in ATTRIBUTES}
    forms = [parse_caption(p).form for p in prompts]
    return out | {f"{name}_form_{f}": rate([v["correct"] for v, g in zip(verdicts, forms) if g == f]) for f in FORMS}


@torch.no_grad()
def evaluate_policy(policy: LlamaImagePolicy, tok: VQTokenizer, n_prompts: int = 64, per_prompt: int = 2,
                    seed: int = 777, sampling: dict | None = None) -> dict:
    """Exact-checker accuracy of base-policy samples, per attribute and caption form, on seen and held-out prompts
    (`policy_acc_*`). For a policy that plans, on the same prompts and image seeds: its own plans, sampled at
    temperature 1, checked against the caption (`plan_acc_*`), the images drawn from them (`policy_plan_acc_*`),
    and the images drawn from a ground-truth plan of a scene for the caption (`policy_truthplan_acc_*`)."""
    from grpo_vision.rollouts import decode_images
    from grpo_vision.sampling import PlanParams, sample_batched
    from grpo_vision.shapes.checker import check
    from grpo_vision.shapes.layout import scene_for_caption

    params = SamplingParams(**(sampling or DEFAULT_SAMPLING))
    out = {}
    for split, tag in (("train", "seen"), ("heldout", "heldout")):
        prompts = [pr for pr in prompt_list(split, n_prompts, seed) for _ in range(per_prompt)]
        entries, seeds = [PromptEntry(p) for p in prompts], range(len(prompts))

        def judged(images):
            return [check(img, pr).as_dict() for img, pr in zip(images, prompts)]

        out |= verdict_figures(f"policy_acc_{tag}", judged(draw(policy, tok, entries, seeds, params, 64).images),
                               prompts)
        if not getattr(policy, "plan_vocab_size", 0):
            continue
        planned = draw(policy, tok, entries, seeds, dataclasses.replace(params, plan=PlanParams(MAX_PLAN_TOKENS)), 64)
        plans = [check_plan(text, pr) for text, pr in zip(planned.rollout.plan.texts, prompts)]
        out |= verdict_figures(f"plan_acc_{tag}", plans, prompts)
        out |= verdict_figures(f"policy_plan_acc_{tag}", judged(planned.images), prompts)
        rng = np.random.default_rng([seed, split == "heldout"])
        truth = [plan_ids(scene_plan(scene_for_caption(pr, rng))) for pr in prompts]
        tokens = sample_batched(policy, policy.plan_condition(prompts, truth), list(seeds), params, 64).tokens
        out |= verdict_figures(f"policy_truthplan_acc_{tag}", judged(decode_images(tok, tokens, 64)), prompts)
    return out
