"""The stages of a ShapesWorld build (see world.py): each trains one model and saves it into `tmp`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from grpo_vision.shapes.scene import HELD_OUT, IMAGE_SIZE, all_words

EVAL_SEED_OFFSET = 10_000  # evaluation renders never share a seed with training renders
# A world preset names each stage's preset: (the tokenizer's, CLIP's and aesthetic head's, the base policy's). The
# plan worlds share their other stages' recipes with the default and micro worlds, so that a build started from
# one (`world build --from`) copies those stages and trains only a base policy that plans.
WORLD_PRESETS = {"micro": ("micro", "micro"), "default": ("default", "default"),
                 "plan_micro": ("micro", "plan_micro"), "plan": ("default", "plan"),
                 "canvas_micro": ("micro", "canvas_micro"), "canvas": ("default", "canvas")}


def stage_preset(preset: str, name: str) -> str:
    """The preset stage `name` is trained with in a world of preset `preset`."""
    others, policy = WORLD_PRESETS[preset]
    return policy if name == "policy" else others


def recipe(name: str, preset: str) -> dict:
    """The hyper-parameters stage `name` trains with under `preset` (what its marker's hash covers)."""
    from grpo_vision.shapes.build.train_aesthetic import AESTHETIC_PRESETS
    from grpo_vision.shapes.build.train_clip import CLIP_PRESETS
    from grpo_vision.shapes.build.train_policy import POLICY_PRESETS, CanvasPolicyPreset, PlanPolicyPreset
    from grpo_vision.shapes.build.train_vq import DECODER_SEED_OFFSET, VQ_PRESETS
    from grpo_vision.shapes.plan import MAX_PLAN_TOKENS, canvas_config, plan_words

    presets = {"vq": VQ_PRESETS, "clip": CLIP_PRESETS, "aesthetic": AESTHETIC_PRESETS, "policy": POLICY_PRESETS}
    chosen = presets[name][preset]
    out = dataclasses.asdict(chosen)
    if isinstance(chosen, PlanPolicyPreset):  # the plan grammar is part of what the policy learns
        out |= {"plan_words": plan_words(), "max_plan_tokens": MAX_PLAN_TOKENS}
    if isinstance(chosen, CanvasPolicyPreset):
        out |= canvas_config()
    return out | {"decoder_seed_offset": DECODER_SEED_OFFSET} if name == "vq" else out


def build_vq(world: Path, tmp: Path, preset: str, seed: int, progress: bool) -> dict:
    from grpo_vision.shapes.build.train_vq import evaluate_vq, train_vq

    tok, info = train_vq(preset, seed=seed, progress=progress)
    tok.save_pretrained(tmp)
    return info | evaluate_vq(tok, n=64 if preset == "micro" else 512, seed=seed + EVAL_SEED_OFFSET)


def build_clip(world: Path, tmp: Path, preset: str, seed: int, progress: bool) -> dict:
    import open_clip

    from grpo_vision.shapes.build.train_clip import MODEL_NAME, evaluate_clip, save_clip, train_clip

    model, info = train_clip(preset, seed=seed, progress=progress)
    save_clip(model, tmp)
    tokenizer = open_clip.get_tokenizer(MODEL_NAME)
    return info | evaluate_clip(model, tokenizer, n=64 if preset == "micro" else 1000, seed=seed + EVAL_SEED_OFFSET)


def build_aesthetic(world: Path, tmp: Path, preset: str, seed: int, progress: bool) -> dict:
    from grpo_vision.rewards.aesthetic import save_aesthetic
    from grpo_vision.shapes.build.train_aesthetic import evaluate_aesthetic, train_aesthetic
    from grpo_vision.shapes.build.train_clip import MODEL_NAME, load_clip

    clip, _, _ = load_clip(MODEL_NAME, world / "clip" / "clip.safetensors")
    head, info = train_aesthetic(clip, preset, seed=seed)
    save_aesthetic(head, tmp)
    return info | evaluate_aesthetic(clip, head, n=64 if preset == "micro" else 1000, seed=seed + EVAL_SEED_OFFSET)


def build_policy(world: Path, tmp: Path, preset: str, seed: int, progress: bool) -> dict:
    from grpo_vision.shapes.build.train_policy import train_policy
    from grpo_vision.models.tokenizer import VQTokenizer

    tok = VQTokenizer.from_pretrained(world / "vq")
    policy, info = train_policy(tok, preset, seed=seed, progress=progress)
    policy.save_pretrained(tmp)
    return info


def load_stage(folder: Path, name: str):
    """The model stage `name` saved in `folder`, loaded as the later stages and training load it."""
    from grpo_vision.rewards.aesthetic import load_aesthetic
    from grpo_vision.models.llama import LlamaImagePolicy
    from grpo_vision.shapes.build.train_clip import CHECKPOINT_NAME, MODEL_NAME, load_clip
    from grpo_vision.models.tokenizer import VQTokenizer

    loaders = {"vq": lambda: VQTokenizer.from_pretrained(folder),
               "clip": lambda: load_clip(MODEL_NAME, folder / CHECKPOINT_NAME),
               "aesthetic": lambda: load_aesthetic(folder),
               "policy": lambda: LlamaImagePolicy.from_pretrained(folder)}
    return loaders[name]()


def evaluate_world(world: Path, preset: str, seed: int, progress: bool) -> dict:
    """Every quality figure of world.json, from the saved stages (so they describe what loads)."""
    from grpo_vision.models.llama import LlamaImagePolicy
    from grpo_vision.shapes.build.train_policy import DEFAULT_SAMPLING, evaluate_policy
    from grpo_vision.models.tokenizer import VQTokenizer

    micro = stage_preset(preset, "vq") == "micro"
    figures = checker_figures(n=50 if micro else 500, seed=seed + EVAL_SEED_OFFSET)
    for name in ("vq", "clip", "aesthetic", "policy"):
        stage = json.loads((world / "stages" / f"{name}.json").read_text())
        figures |= {k: v for k, v in stage.items() if k not in ("preset", "seed", "seconds", "curve", "copied_from")}
    tok = VQTokenizer.from_pretrained(world / "vq")
    policy = LlamaImagePolicy.from_pretrained(world / "policy").float().eval()
    figures |= evaluate_policy(policy, tok, n_prompts=8 if micro else 96, per_prompt=2 if micro else 4,
                               seed=seed + EVAL_SEED_OFFSET, sampling=DEFAULT_SAMPLING)
    return figures


def checker_figures(n: int, seed: int) -> dict:
    """The checker on clean renders of every caption form, and on captions with one attribute changed."""
    from grpo_vision.shapes.checker import check
    from grpo_vision.shapes.layout import sample_scene
    from grpo_vision.shapes.scene import FORMS, render
    from grpo_vision.shapes.build.train_clip import hard_negatives

    rng = np.random.default_rng(seed)
    correct, rejected, negatives = [], 0, 0
    for form in FORMS:
        for _ in range(n):
            scene, caption = sample_scene(rng, form=form, split="all", aesthetic=False)
            image = render(scene)
            correct.append(check(image, caption).correct)
            for negative in (n for group in hard_negatives(caption).values() for n in group):
                negatives += 1
                rejected += not check(image, negative).correct
    return {"checker_acc_clean": round(float(np.mean(correct)), 4),
            "checker_reject_altered": round(rejected / max(1, negatives), 4)}


def world_constants(world: Path) -> dict:
    """The world's vocabulary and settings; `plan`: the plan grammar's, or None when the base policy does not plan
    (read from the saved policy's config, so they describe what loads)."""
    from grpo_vision.shapes.build.train_clip import MODEL_NAME
    from grpo_vision.shapes.build.train_policy import DEFAULT_SAMPLING
    from grpo_vision.shapes.plan import CELL, MAX_PLAN_TOKENS, PLAN_GRID

    policy = json.loads((world / "policy" / "policy_config.json").read_text())
    plan = {"words": policy.get("plan_words"), "max_tokens": MAX_PLAN_TOKENS, "grid": PLAN_GRID, "cell_px": CELL,
            "canvas": bool(policy.get("canvas_attributes"))}
    return {"image_size": IMAGE_SIZE, "words": all_words(), "held_out": sorted(map(list, HELD_OUT)),
            "sampling": DEFAULT_SAMPLING, "clip_model_name": MODEL_NAME,
            "plan": plan if policy.get("plan_words") else None}


@torch.no_grad()
def contact_sheet(world: Path, out: Path, seed: int, n: int = 8) -> None:
    """Rows: renders, their VQ reconstructions, base-policy samples for the same captions (and, for a policy that
    plans, its samples drawn from its own plans, on the same seeds)."""
    from grpo_vision.images import Cell, paint_grid
    from grpo_vision.models.llama import LlamaImagePolicy
    from grpo_vision.prompts import PromptEntry
    from grpo_vision.rollouts import draw
    from grpo_vision.sampling import SamplingParams
    from grpo_vision.shapes.data import render_batch, to_tensor, to_uint8
    from grpo_vision.shapes.build.train_policy import DEFAULT_SAMPLING
    from grpo_vision.models.tokenizer import VQTokenizer

    tok = VQTokenizer.from_pretrained(world / "vq")
    policy = LlamaImagePolicy.from_pretrained(world / "policy").float().eval()
    batch = render_batch(np.random.default_rng(seed + 2 * EVAL_SEED_OFFSET), n, split="all")
    x = to_tensor(batch.images)
    recon = to_uint8(tok.decode(tok.encode(x)))
    entries, params = [PromptEntry(c) for c in batch.captions], SamplingParams(**DEFAULT_SAMPLING)
    drawn = [to_uint8(draw(policy, tok, entries, range(n), params, n).images)]
    labels = ["render", "VQ recon.", "base policy"]
    if policy.plan_vocab_size:
        from grpo_vision.sampling import PlanParams
        from grpo_vision.shapes.plan import MAX_PLAN_TOKENS

        with_plans = dataclasses.replace(params, plan=PlanParams(MAX_PLAN_TOKENS))
        drawn.append(to_uint8(draw(policy, tok, entries, range(n), with_plans, n).images))
        labels.append("with its plan")
    rows = [[Cell(img) for img in images] for images in (batch.images, recon, *drawn)]
    headings = [(i, " ".join(c.split()[:4]) + "\n" + " ".join(c.split()[4:])) for i, c in enumerate(batch.captions)]
    sheet = paint_grid(rows, headings=headings, row_labels=labels, label_width=70,
                       scale=2, pad=4)
    sheet.save(out)
