# Pilot of docs/experiments/text_plans.md (2026-11-28), not part of the library: which way of reading a plan lets the
# plan world's image stage draw what its plan says where it says it? Policies of the plan preset's architecture,
# trained from scratch for STEPS steps on caption -> ground-truth plan -> image (every image conditioned on its
# plan), with one of:
#   tied    a learned row and column embedding added at the input that predicts each image token, and the same
#           column (row) embedding added to the plan words x{c} (y{r}): a cell word and its image positions share
#           a vector, so "draw here what the plan put here" is one attention match;
#   canvas  the plan drawn onto the image grid: the input that predicts image token i gets, for every planned
#           object whose planned box (shapes.rewards.planned_box) covers token i's centre, the sum of learned
#           embeddings of the object's colour, shape and size (a layout map, as layout-to-image models condition).
# Each is sampled (CFG 3, T 1, KV-cached through the policy's own forward) from ground-truth plans of N_CAPTIONS
# relation captions x 2 images and judged. Usage: python THIS STEPS [N_CAPTIONS [ARMS]]   (ARMS: canvas,tied)
import argparse, dataclasses, json, sys, time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from grpo_vision.models.llama import LlamaImagePolicy, LlamaPolicyConfig
from grpo_vision.rollouts import decode_images
from grpo_vision.shapes.build import train_policy as tp
from grpo_vision.shapes.checker import check, find_regions
from grpo_vision.shapes.layout import scene_for_caption
from grpo_vision.shapes.plan import COLUMNS, MAX_PLAN_TOKENS, ROWS, parse_plan, plan_words, scene_plan
from grpo_vision.shapes.rewards import layout_agreement, planned_box
from grpo_vision.shapes.scene import COLORS, SHAPES, SIZES, all_words

from pilot_args import count, plan_world, relation_captions

ATTRS = [*COLORS, *SHAPES, *SIZES]


def canvas_of(plan: list[str], grid: int = 16, px: int = 4) -> torch.Tensor:
    """[N, len(ATTRS)] multi-hot: token i holds the attributes of every planned object whose box covers its centre."""
    out = torch.zeros(grid * grid, len(ATTRS))
    spec = parse_plan(" ".join(plan))
    centres = (torch.arange(grid) + 0.5) * px
    for o in spec.objects:
        x0, y0, w, h = planned_box(o)
        inside = (((centres[None, :] >= x0) & (centres[None, :] <= x0 + w))
                  & ((centres[:, None] >= y0) & (centres[:, None] <= y0 + h))).flatten()  # [N] row-major
        for a in (o.color, o.shape, o.size):
            out[inside, ATTRS.index(a)] += 1
    return out


class Canvas(LlamaImagePolicy):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.attrs = nn.Linear(len(ATTRS), cfg.dim, bias=False)
        nn.init.normal_(self.attrs.weight, std=0.02)

    def extra(self, i, aux):  # aux: [B, N, A] canvas; i: image positions
        return self.attrs(aux[:, i])


class Tied(LlamaImagePolicy):
    def __init__(self, cfg):
        super().__init__(cfg)
        h, w = cfg.image_grid
        self.rows, self.cols = nn.Embedding(h, cfg.dim), nn.Embedding(w, cfg.dim)
        nn.init.normal_(self.rows.weight, std=0.02), nn.init.normal_(self.cols.weight, std=0.02)
        off = cfg.plan_offset + 2  # plan word j has vocabulary id plan_offset + 2 + j
        self.col_ids = torch.tensor([off + cfg.plan_words.index(c) for c in COLUMNS])
        self.row_ids = torch.tensor([off + cfg.plan_words.index(r) for r in ROWS])

    def embed(self, ids):
        x = self.model.embed_tokens(ids)
        table = torch.zeros(self.cfg.vocab_size, self.cfg.dim, dtype=x.dtype)
        table = table.index_add(0, self.col_ids, self.cols.weight.to(x.dtype))
        table = table.index_add(0, self.row_ids, self.rows.weight.to(x.dtype))
        return x + F.embedding(ids, table)

    def extra(self, i, aux):
        w = self.cfg.image_grid[1]
        return (self.rows(i // w) + self.cols(i % w))[None]


def image_logits(policy, cond, tokens, aux):
    ids = torch.cat([cond, tokens[:, :-1] + policy.cfg.image_offset], dim=1)
    x = policy.embed(ids) if isinstance(policy, Tied) else policy.model.embed_tokens(ids)
    n, L = tokens.shape[1], cond.shape[1]
    extra = policy.extra(torch.arange(n), aux).to(x.dtype)
    x = torch.cat([x[:, :L - 1], x[:, L - 1:] + extra], dim=1)
    return policy._image_head(policy._forward(x)[:, L - 1:])


def train(cls, tok, codes, captions, plans, canvases, p):
    torch.manual_seed(0)
    cfg = LlamaPolicyConfig(words=all_words(), max_caption_words=max(len(c.split()) for c in captions) + 2,
                            codebook_size=tok.codebook_size, image_grid=tuple(tok.grid), dim=p.dim,
                            n_layers=p.n_layers, n_heads=p.n_heads, n_kv_heads=p.n_kv_heads, ffn_dim=p.ffn_dim,
                            plan_words=plan_words(), max_plan_tokens=MAX_PLAN_TOKENS)
    policy = cls(cfg)
    data = tp.plan_data(policy, captions, plans)
    opt = torch.optim.AdamW(policy.parameters(), lr=p.lr, betas=(0.9, 0.95), weight_decay=0.05)
    gen, t0, ema = torch.Generator().manual_seed(0), time.monotonic(), None
    policy.train()
    for step in range(p.steps):
        idx = torch.randint(0, len(captions), (p.batch_size,), generator=gen)
        drop = torch.rand(p.batch_size, generator=gen) < p.cond_dropout
        cond = torch.where(drop[:, None], data.null, data.cond[idx])
        aux = canvases[idx] * (~drop)[:, None, None]  # the null row sees no plan, so no canvas
        for g in opt.param_groups:
            g["lr"] = tp.lr_at(step, p)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = image_logits(policy, cond, codes[idx], aux)
            plan_logits = policy.plan_logits(data.ids[idx], data.tokens[idx])
        loss = F.cross_entropy(logits.float().flatten(0, 1), codes[idx].flatten())
        plan_loss = F.cross_entropy(plan_logits.float().flatten(0, 1), data.targets[idx].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        (loss + plan_loss).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 200 == 0:
            print(f"{cls.__name__} step {step} loss {ema:.3f} {time.monotonic() - t0:.0f}s", flush=True)
    return policy.eval(), round(ema, 4), round(time.monotonic() - t0)


@torch.no_grad()
def judge(policy, tok, captions, rng_seed=777):
    rng = np.random.default_rng(rng_seed)
    plans = [scene_plan(scene_for_caption(c, rng)) for c in captions]
    aux = torch.stack([canvas_of(p) for p in plans])
    aux = torch.cat([aux, torch.zeros_like(aux)])  # the null rows
    index = {w: i + 1 for i, w in enumerate(policy.cfg.plan_words)}
    cond = policy.plan_condition(captions, [[index[w] for w in plan] for plan in plans])
    both = torch.cat([cond, policy.null_condition(cond)])
    gen, n = torch.Generator().manual_seed(rng_seed), policy.num_image_tokens
    embed = policy.embed if isinstance(policy, Tied) else policy.model.embed_tokens
    cache = policy.new_cache(len(both))
    x = embed(both)
    x = torch.cat([x[:, :-1], x[:, -1:] + policy.extra(torch.tensor([0]), aux)], dim=1)
    h = policy._forward(x, cache)[:, -1]
    tokens = torch.zeros(len(captions), n, dtype=torch.long)
    for i in range(n):
        c, u = policy._image_head(h).float().chunk(2)
        tokens[:, i] = torch.multinomial(F.softmax(u + 3.0 * (c - u), -1), 1, generator=gen)[:, 0]
        if i + 1 < n:
            x = embed(torch.cat([tokens[:, i], tokens[:, i]]) + policy.cfg.image_offset)[:, None]
            x = x + policy.extra(torch.tensor([i + 1]), aux)
            h = policy._forward(x, cache)[:, -1]
    images = decode_images(tok, tokens, 64)
    verdicts = [check(img, c) for img, c in zip(images, captions)]
    layout = [layout_agreement(" ".join(p), find_regions(img)) for img, p in zip(images, plans)]
    names = ("relation", "count", "color", "shape", "correct")
    rates = {a: float(np.mean([getattr(v, a) for v in verdicts])) for a in names}
    return rates | {"layout": float(np.mean(layout))}


def arms(text: str) -> list[str]:
    names = text.split(",")
    if not names or any(n not in ("canvas", "tied") for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: give canvas, tied or canvas,tied")
    return names


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="plan_canvas_pilot.py", description="plan-world policies from scratch that "
                                 "read their plan as a canvas or through tied positions, judged on relation captions")
    ap.add_argument("steps", type=count)
    ap.add_argument("n_captions", type=count, nargs="?", default=48)
    ap.add_argument("arms", type=arms, nargs="?", default=["canvas", "tied"], help="canvas,tied (the default)")
    args = ap.parse_args(argv)
    args.relation = relation_captions(ap, args.n_captions)
    args.world = plan_world(ap)
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    STEPS, N_CAPTIONS, ARMS, world, rel = args.steps, args.n_captions, args.arms, args.world, args.relation
    tok = world.tokenizer
    p = dataclasses.replace(tp.POLICY_PRESETS["plan"], steps=STEPS)
    codes, captions, plans = tp.tokenize_dataset(tok, p.examples, 1, False)
    canvases = torch.stack([canvas_of(pl) for pl in plans])  # [n, N, A]
    captions_eval = [rel[i] for i in np.random.default_rng(0).choice(len(rel), N_CAPTIONS, replace=False)] * 2
    out = {"steps": STEPS, "captions": N_CAPTIONS, "images": len(captions_eval)}
    for name in ARMS:
        policy, loss, seconds = train({"canvas": Canvas, "tied": Tied}[name], tok, codes, captions, plans, canvases, p)
        out[name] = {"loss": loss, "train_s": seconds} | judge(policy, tok, captions_eval)
        print(json.dumps({name: out[name]}), flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
