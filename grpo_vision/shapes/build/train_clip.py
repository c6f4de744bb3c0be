"""Train ShapesWorld's tiny CLIP: a stock open_clip model at a custom size, contrastive with hard negatives.

The model is an open_clip `CLIP` built from `shapes_clip.json` (registered with open_clip's own
`add_model_config`), tokenised with open_clip's bundled BPE, saved as a plain state dict and loaded
back through `create_model_and_transforms(name, pretrained=<file>)`: the CLIP reward runs the same
code for this model as for a real checkpoint such as ViT-L-14.

The recipe, each part for a reason (the runs that showed each, with their figures, are in
docs/experiments/world_recipes.md):

1. Image tower: open_clip's ModifiedResNet (the CLIP RN50 family, `layers` [1,1,1,1], width 16), not
   a ViT: at 64 px a patch-8 ViT learns shape far more slowly.
2. Symmetric InfoNCE (Radford et al. 2021, arXiv 2103.00020) with hard negatives, captions that
   change exactly one attribute of the true one, in each image's softmax (NegCLIP, Yuksekgonul et
   al. 2023, arXiv 2210.01936), plus a pairwise logistic term on (positive, hard negative), which
   is the comparison evaluate_clip counts.
3. Captions repeat and overlap ("a red circle" is also true of the image captioned "a small red
   circle"), so every text that is true of an image, other than its own caption, is masked out of
   its softmax, by exact truth from the scene (`holds_matrix`), in both directions.
4. Relations are a binding problem on both towers, and InfoNCE sits at a symmetric saddle while
   neither tower binds. A curriculum breaks it: for the first `canonical_frac` of the run, relation
   captions are rewritten to the same fact with "left of"/"above", so the first-named object is
   always left or top; then the natural captions. Each relation image comes with a "twin" of its
   swapped caption. Not guaranteed: check clip_acc_relation after training.
5. An auxiliary linear probe on the normalised image embedding regresses the aesthetic factors
   (noise level, clipped, cornered), which no caption mentions, so the aesthetic head on the frozen
   embedding has them to read. The probe is dropped after training: the checkpoint is a stock
   open_clip state dict.
6. All compositions. The split (scene.HELD_OUT) is kept out of the *base policy's* captions only
   (docs/shapes_world.md): CLIP is the judge, like a web-scale CLIP that has seen blue triangles; a
   judge that cannot see the compositions RL is asked to learn cannot reward them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

# the open_clip helpers live in grpo_vision.rewards.clip (the rewards use them too); re-exported here
from grpo_vision.rewards.clip import clip_scores, image_embeddings, image_transform, load_clip, register_config  # noqa: F401
from grpo_vision.shapes.build.clip_captions import (  # noqa: F401  (re-exported)
    ATTRIBUTES, OPPOSITE, caption_holds, hard_negatives, holds_matrix,
)
from grpo_vision.shapes.data import Batch, to_tensor
from grpo_vision.shapes.layout import sample_scene, scene_for_caption
from grpo_vision.shapes.scene import FORMS, NOISE_LEVELS, CaptionSpec, Scene, format_caption, parse_caption, render

CONFIG_PATH = Path(__file__).parents[1] / "shapes_clip.json"  # the world's architecture, beside the plugin
MODEL_NAME = register_config(CONFIG_PATH)  # "shapes_clip", the file stem: registered once the builder is imported
CHECKPOINT_NAME = "clip.safetensors"


# ---------------------------------------------------------------- model: register, load, save


def register_shapes_clip() -> None:
    """Add shapes_clip.json to open_clip's model registry (idempotent: adds the path once)."""
    register_config(CONFIG_PATH)


def save_clip(model: torch.nn.Module, directory: str | Path, half: bool = True) -> Path:
    """Write `directory/clip.safetensors`: the state dict (fp16 when `half`; load_state_dict casts
    it back into the fp32 model, see tests/shapes/test_clip.py for the tolerance)."""
    from safetensors.torch import save_file

    path = Path(directory) / CHECKPOINT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.half() if half and v.is_floating_point() else v).contiguous()
          for k, v in model.state_dict().items()}
    save_file(sd, str(path))
    return path


def new_clip():
    """A randomly initialised shapes_clip (model, tokenizer)."""
    import open_clip

    register_shapes_clip()
    model = open_clip.create_model(MODEL_NAME, pretrained=None)
    return model, open_clip.get_tokenizer(MODEL_NAME)


# ---------------------------------------------------------------- the loss


def clip_loss(img: torch.Tensor, txt: torch.Tensor, pos: torch.Tensor, holds: torch.Tensor,
              hard: torch.Tensor, scale: torch.Tensor, hn_weight: float) -> tuple[torch.Tensor, dict]:
    """Symmetric InfoNCE with caption-truth masking and hard negatives.

    img `[B, D]`, txt `[T, D]` L2-normalised; pos `[B]` index of image b's caption in txt;
    holds `[B, T]` bool, text t is true of image b; hard `[B, T]` float, > 0 where text t is one of
    image b's hard negatives (its weight in the pairwise term); scale = logit_scale.exp().
    image->text: softmax over every text false for the image (batch captions and all hard
    negatives in the batch) plus its own caption. text->image: image b's caption against every
    image it is false for, plus image b. Hard-negative term: sum of hard * softplus(s_neg - s_pos)
    over the hard pairs / their number, a logistic loss on the comparison evaluate_clip counts.
    """
    B = img.shape[0]
    arange = torch.arange(B)
    logits = scale * img @ txt.T  # [B, T]
    own = F.one_hot(pos, txt.shape[0]).bool()  # [B, T]
    i2t = F.cross_entropy(logits.masked_fill(holds & ~own, float("-inf")), pos)
    t2i_logits = logits[:, pos].T  # [B captions, B images]: row b = caption of image b vs images
    t2i_mask = holds[:, pos].T & ~torch.eye(B, dtype=torch.bool)  # caption b true of image k != b
    t2i = F.cross_entropy(t2i_logits.masked_fill(t2i_mask, float("-inf")), arange)
    margin = logits - logits[arange, pos][:, None]  # [B, T] s_t - s_pos, scaled
    is_hard = hard > 0
    hn = (hard * F.softplus(margin)).sum() / is_hard.sum().clamp_min(1)
    loss = (i2t + t2i) / 2 + hn_weight * hn
    acc = (margin[is_hard] < 0).float().mean().item() if is_hard.any() else float("nan")
    return loss, {"loss/i2t": i2t.item(), "loss/t2i": t2i.item(), "loss/hard": hn.item(), "hard_acc": acc}


# ---------------------------------------------------------------- training


@dataclass
class ClipPreset:
    batch_size: int  # images per step
    lr: float  # peak AdamW learning rate
    weight_decay: float  # AdamW decoupled weight decay on matrices (open_clip excludes gains/biases)
    warmup_steps: int  # linear warmup, then cosine to 0 over the run
    steps: int  # optimiser steps (the schedule and the data depend on steps only: deterministic)
    hn_weight: float  # weight of the pairwise hard-negative loss
    attr_weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)  # per ATTRIBUTES, inside the pairwise loss
    form_weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)  # per FORMS (plain, size, background, relation)
    canonical_frac: float = 0.0  # first part of the run with relation captions as "left of"/"above" only
    aux_weight: float = 0.0  # weight of the auxiliary aesthetic-factor probe on image embeddings
    relation_twins: bool = False  # pair each relation image with a twin of its swapped caption
    amp: bool = True  # bf16 autocast, image tower only (convs gain from it; the small text matmuls do not)


CLIP_PRESETS = {
    # smoke run, plain recipe: seconds, for tests (float32: see VQ_PRESETS["micro"])
    "micro": ClipPreset(32, 3e-3, 0.1, 5, 60, 1.0, amp=False),
    # the full recipe; fewer steps left shape and size weaker, and GRPO against such a CLIP lost them
    # (docs/experiments/world_recipes.md)
    "default": ClipPreset(64, 2e-3, 0.1, 50, 1500, 2.0, attr_weights=(1, 1, 1, 1, 4),
                          form_weights=(1, 1, 1.5, 2), canonical_frac=0.5, aux_weight=1.5,
                          relation_twins=True),
}

def _batch_texts(captions: list[str]) -> tuple[list[str], list[int], list[dict[str, list[str]]]]:
    """Unique texts of a step (captions, then their hard negatives), each image's caption index,
    and each image's hard negatives."""
    index: dict[str, int] = {}
    pos = [index.setdefault(c, len(index)) for c in captions]
    negs = []
    for c in captions:
        n = hard_negatives(c, perpendicular=True)
        for ts in n.values():
            for t in ts:
                index.setdefault(t, len(index))
        negs.append(n)
    return list(index), pos, negs


def aesthetic_factors(scene: Scene) -> list[float]:
    """[noise level 0 / 0.5 / 1, clipped, cornered] of a scene, the targets of the auxiliary probe."""
    noise = NOISE_LEVELS.index(scene.noise) / (len(NOISE_LEVELS) - 1)
    return [noise, float(scene.clipped), float(scene.cornered)]


def canonical_relation(caption: str) -> str:
    """The same fact with the relation "left of" or "above": "B right of A" -> "A left of B"."""
    spec = parse_caption(caption)
    if spec.relation not in ("right of", "below"):
        return caption
    a, b = spec.objects
    return format_caption(CaptionSpec("relation", (b, a), relation=OPPOSITE[spec.relation]))


def _train_batch(rng: np.random.Generator, n: int, form_weights, twins: bool, canonical: bool) -> Batch:
    """Like data.render_batch(rng, n, "all", aesthetic=True), with caption forms drawn by weight.
    `twins`: each relation scene "A r B" comes with a twin scene of "B r A" (same objects, sides
    swapped), so the batch holds image pairs that differ only in the arrangement."""
    w = np.asarray(form_weights, float)
    forms = rng.choice(len(FORMS), size=n, p=w / w.sum())
    pairs = []
    for f in forms:
        if len(pairs) == n:
            break
        scene, caption = sample_scene(rng, FORMS[f], "all", aesthetic=True)
        pairs.append((scene, caption))
        if twins and FORMS[f] == "relation" and len(pairs) < n:
            swapped = hard_negatives(caption)["relation"][1]  # "B r A"
            pairs.append((scene_for_caption(swapped, rng, aesthetic=True), swapped))
    captions = [canonical_relation(c) if canonical else c for _, c in pairs]
    return Batch(np.stack([render(s) for s, _ in pairs]), captions, [s for s, _ in pairs])


def _targets(scenes: list[Scene], texts: list[str], negs: list[dict[str, list[str]]],
             attr_weights: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """holds `[B, T]` bool (text true of the scene) and hard `[B, T]` (weight of each of image
    b's hard negatives, by attribute; 0 elsewhere)."""
    holds = torch.from_numpy(holds_matrix(scenes, texts))
    hard = torch.zeros(holds.shape)
    col = {t: j for j, t in enumerate(texts)}
    for b, n in enumerate(negs):
        for attr, w in zip(ATTRIBUTES, attr_weights):
            hard[b, [col[t] for t in n[attr]]] = w
    return holds, hard


def train_clip(preset: str | ClipPreset = "default", seed: int = 0, progress: bool = True,
               eval_every: int = 0):
    """Train shapes_clip from scratch on fresh renders of all compositions; returns (model in eval
    mode, info). Deterministic in (preset, seed). `eval_every` > 0 adds evaluate_clip(n=200) every
    that many steps to info["curve"]."""
    p = CLIP_PRESETS[preset] if isinstance(preset, str) else preset
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model, tokenizer = new_clip()
    model.train()
    normalize = image_transform(model)
    ids: dict[str, torch.Tensor] = {}  # caption -> [L] token ids (the caption set is finite)
    # open_clip's recipe (training/main.py): no weight decay on gains, biases and logit_scale
    nodecay = [q for n, q in model.named_parameters() if q.ndim < 2 or "logit_scale" in n]
    decay = [q for n, q in model.named_parameters() if not (q.ndim < 2 or "logit_scale" in n)]
    # Auxiliary probe: the aesthetic factors, linearly from the normalised image embedding, so the
    # embedding keeps them (the captions never mention them); dropped after training.
    aux = torch.nn.Linear(model.text_projection.shape[1], 3)
    decay.append(aux.weight)
    nodecay.append(aux.bias)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": p.weight_decay},
                             {"params": nodecay, "weight_decay": 0.0}], lr=p.lr, betas=(0.9, 0.98), eps=1e-6)
    start, step, log, curve = time.monotonic(), 0, {}, []
    bar = tqdm(total=p.steps, desc="clip", disable=not progress, leave=False)
    while step < p.steps:
        frac = step / p.steps  # progress through the run, 0..1
        lr = p.lr * min(1.0, (step + 1) / p.warmup_steps) * 0.5 * (1 + math.cos(math.pi * frac))
        for g in opt.param_groups:
            g["lr"] = lr
        # SAMPLE: fresh train-split renders; relation captions canonical early in the run
        batch = _train_batch(rng, p.batch_size, p.form_weights, p.relation_twins, frac < p.canonical_frac)
        texts, pos, negs = _batch_texts(batch.captions)
        holds, hard = _targets(batch.scenes, texts, negs, p.attr_weights)  # [B, T] each
        for t in texts:
            if t not in ids:
                ids[t] = tokenizer([t])[0]
        # FORWARD
        x = normalize(to_tensor(batch.images))  # [B, 3, 64, 64]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=p.amp):
            img = model.encode_image(x)  # [B, D]
        txt = model.encode_text(torch.stack([ids[t] for t in texts]))  # [T, D]
        img, txt = F.normalize(img.float(), dim=-1), F.normalize(txt.float(), dim=-1)
        # LOSS
        loss, log = clip_loss(img, txt, torch.tensor(pos), holds, hard, model.logit_scale.exp(), p.hn_weight)
        if p.aux_weight:
            factors = torch.tensor([aesthetic_factors(s) for s in batch.scenes])  # [B, 3]
            aux_loss = F.mse_loss(aux(img), factors)
            loss = loss + p.aux_weight * aux_loss
            log["loss/aux"] = aux_loss.item()
        # UPDATE
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))  # CLIP's cap on the temperature
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", hard=f"{log['hard_acc']:.2f}", texts=len(texts))
        if eval_every and step % eval_every == 0:
            curve.append({"step": step, **evaluate_clip(model.eval(), tokenizer, n=200)})
            model.train()
            if progress:
                tqdm.write(str(curve[-1]))
    bar.close()
    info = {"clip_steps": step, "clip_seconds": round(time.monotonic() - start, 1),
            "clip_final_loss": round(loss.item(), 4), "clip_final_hard_acc": round(log["hard_acc"], 4),
            "clip_final_aux_mse": round(log.get("loss/aux", float("nan")), 4)}
    if curve:
        info["curve"] = curve
    return model.eval(), info


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_clip(model, tokenizer, n: int = 400, seed: int = 4321) -> dict:
    """How often an image's true caption outscores the same caption with one attribute changed,
    per attribute (all of hard_negatives), on fresh renders of TRAIN-split captions (`clip_acc_*`)
    and of held-out compositions (`clip_acc_*_heldout`); n images per split, n/4 per form. For
    relations these are the opposite relation and the swapped objects. Model in eval mode."""
    out = {}
    for split, suffix in (("train", ""), ("heldout", "_heldout")):
        rng = np.random.default_rng(seed)
        pairs = [sample_scene(rng, form, split, aesthetic=True) for form in FORMS for _ in range(n // 4)]
        x = to_tensor(np.stack([render(s) for s, _ in pairs]))
        img = torch.cat([image_embeddings(model, x[i:i + 256]) for i in range(0, len(x), 256)])  # [n, D]
        negs = [hard_negatives(c) for _, c in pairs]
        texts = sorted({c for _, c in pairs} | {t for d in negs for ts in d.values() for t in ts})
        col = {t: j for j, t in enumerate(texts)}
        tok = tokenizer(texts)
        txt = torch.cat([model.encode_text(tok[i:i + 512], normalize=True) for i in range(0, len(tok), 512)])
        sims = img @ txt.T  # [n, T]
        for attr in ATTRIBUTES:
            wins = [(sims[b, col[c]] > sims[b, col[t]]).item()
                    for b, (_, c) in enumerate(pairs) for t in negs[b][attr]]
            out[f"clip_acc_{attr}{suffix}"] = round(float(np.mean(wins)), 4)
    return out


def main(argv: list[str] | None = None) -> None:
    """python -m grpo_vision.shapes.build.train_clip --preset default --out DIR: train, evaluate, save."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--preset", default="default", choices=sorted(CLIP_PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="directory for clip.safetensors and clip_metrics.json")
    args = ap.parse_args(argv)
    model, info = train_clip(args.preset, args.seed)
    info.update(evaluate_clip(model, new_clip()[1]))
    path = save_clip(model, args.out)
    (path.parent / "clip_metrics.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
