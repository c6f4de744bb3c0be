# Pilot of docs/experiments/text_plans.md (2026-11-28), not part of the library: does a learned 2D position
# embedding on image tokens let the plan world's image stage follow its plan? Two policies of the plan preset's
# architecture trained from scratch for STEPS steps on caption -> ground-truth plan -> image (every image
# conditioned on its plan), one as the library builds it (1D RoPE only), one with a learned row and column
# embedding added at the input position that predicts each image token. Each is then sampled (CFG 3, T 1, KV-cached
# through the policy's own forward) from ground-truth plans of relation captions and judged. Usage: python THIS STEPS [N_CAPTIONS [EXAMPLES]]
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
from grpo_vision.shapes.plan import MAX_PLAN_TOKENS, plan_words, scene_plan
from grpo_vision.shapes.rewards import layout_agreement
from grpo_vision.shapes.scene import all_words

from pilot_args import count, plan_world, relation_captions



def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="plan_position_pilot.py", description="two plan-world policies from scratch, "
                                 "without and with a learned 2D position embedding, judged on relation captions")
    ap.add_argument("steps", type=count)
    ap.add_argument("n_captions", type=count, nargs="?", default=48)
    ap.add_argument("examples", type=count, nargs="?", default=None, help="default: the preset's 30,000")
    args = ap.parse_args(argv)
    args.relation = relation_captions(ap, args.n_captions)
    args.world = plan_world(ap)
    return args


class Positioned(LlamaImagePolicy):
    """The built-in policy plus a learned (row, column) embedding at the input that predicts each image token."""

    def __init__(self, cfg):
        super().__init__(cfg)
        h, w = cfg.image_grid
        self.rows, self.cols = nn.Embedding(h, cfg.dim), nn.Embedding(w, cfg.dim)
        nn.init.normal_(self.rows.weight, std=0.02), nn.init.normal_(self.cols.weight, std=0.02)

    def image_logits(self, cond, tokens):
        ids = torch.cat([cond, tokens[:, :-1] + self.cfg.image_offset], dim=1)
        x = self.model.embed_tokens(ids)
        i = torch.arange(tokens.shape[1], device=x.device)
        pos = self.rows(i // self.cfg.image_grid[1]) + self.cols(i % self.cfg.image_grid[1])  # [N, dim]
        x = torch.cat([x[:, :cond.shape[1] - 1], x[:, cond.shape[1] - 1:] + pos], dim=1)
        return self._image_head(self._forward(x)[:, cond.shape[1] - 1:])


def train(cls, tok, codes, captions, plans, p):
    torch.manual_seed(0)
    cfg = LlamaPolicyConfig(words=all_words(), max_caption_words=max(len(c.split()) for c in captions) + 2,
                            codebook_size=tok.codebook_size, image_grid=tuple(tok.grid), dim=p.dim,
                            n_layers=p.n_layers, n_heads=p.n_heads, n_kv_heads=p.n_kv_heads, ffn_dim=p.ffn_dim,
                            plan_words=plan_words(), max_plan_tokens=MAX_PLAN_TOKENS)
    policy = cls(cfg)
    data = tp.plan_data(policy, captions, plans)
    cond_all = policy.encode_prompts(captions)
    null = policy.null_condition(cond_all[:1])
    opt = torch.optim.AdamW(policy.parameters(), lr=p.lr, betas=(0.9, 0.95), weight_decay=0.05)
    gen, t0, ema = torch.Generator().manual_seed(0), time.monotonic(), None
    policy.train()
    for step in range(p.steps):
        idx = torch.randint(0, len(captions), (p.batch_size,), generator=gen)
        drop = torch.rand(p.batch_size, generator=gen) < p.cond_dropout
        cond = torch.where(drop[:, None], null, cond_all[idx])
        for g in opt.param_groups:
            g["lr"] = tp.lr_at(step, p)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with_plan = torch.ones(p.batch_size, dtype=torch.bool)
            logits, target, plan_logits = tp.planned_logits(policy, data, idx, cond, codes[idx], drop, with_plan)
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        plan_loss = F.cross_entropy(plan_logits.float().flatten(0, 1), data.targets[idx].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        (loss + plan_loss).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
    return policy.eval(), round(ema, 4), round(time.monotonic() - t0)


@torch.no_grad()
def judge(policy, tok, captions, rng_seed=777):
    rng = np.random.default_rng(rng_seed)
    plans = [scene_plan(scene_for_caption(c, rng)) for c in captions]
    index = {w: i + 1 for i, w in enumerate(policy.cfg.plan_words)}
    cond = policy.plan_condition(captions, [[index[w] for w in plan] for plan in plans])
    both = torch.cat([cond, policy.null_condition(cond)])
    gen, n = torch.Generator().manual_seed(rng_seed), policy.num_image_tokens
    w = policy.cfg.image_grid[1]

    def at(i):  # the input that predicts image token i gets token i's (row, column) embedding
        return policy.rows.weight[i // w] + policy.cols.weight[i % w] if isinstance(policy, Positioned) else 0.0

    cache = policy.new_cache(len(both))  # KV-cached decoding through the policy's own _forward
    x = policy.model.embed_tokens(both)
    x = torch.cat([x[:, :-1], x[:, -1:] + at(0)], dim=1)
    h = policy._forward(x, cache)[:, -1]
    tokens = torch.zeros(len(captions), n, dtype=torch.long)
    for i in range(n):
        c, u = policy._image_head(h).float().chunk(2)
        tokens[:, i] = torch.multinomial(F.softmax(u + 3.0 * (c - u), -1), 1, generator=gen)[:, 0]
        if i + 1 < n:
            x = policy.model.embed_tokens(torch.cat([tokens[:, i], tokens[:, i]]) + policy.cfg.image_offset) + at(i + 1)
            h = policy._forward(x[:, None], cache)[:, -1]
    images = decode_images(tok, tokens, 64)
    verdicts = [check(img, c) for img, c in zip(images, captions)]
    layout = [layout_agreement(" ".join(p), find_regions(img)) for img, p in zip(images, plans)]
    return {"relation": float(np.mean([v.relation for v in verdicts])), "count": float(np.mean([v.count for v in verdicts])),
            "correct": float(np.mean([v.correct for v in verdicts])), "layout": float(np.mean(layout))}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    STEPS, N_CAPTIONS, EXAMPLES, world, rel = args.steps, args.n_captions, args.examples, args.world, args.relation
    tok = world.tokenizer
    p = dataclasses.replace(tp.POLICY_PRESETS["plan"], steps=STEPS, examples=EXAMPLES or tp.POLICY_PRESETS["plan"].examples)
    codes, captions, plans = tp.tokenize_dataset(tok, p.examples, 1, False)
    captions_eval = [rel[i] for i in np.random.default_rng(0).choice(len(rel), N_CAPTIONS, replace=False)] * 2
    out = {"steps": STEPS, "captions": N_CAPTIONS, "images": len(captions_eval)}
    for name, cls in (("rope_only", LlamaImagePolicy), ("rope_plus_2d_embedding", Positioned)):
        policy, loss, seconds = train(cls, tok, codes, captions, plans, p)
        out[name] = {"loss": loss, "train_s": seconds} | judge(policy, tok, captions_eval)
        print(json.dumps(out[name]), flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
