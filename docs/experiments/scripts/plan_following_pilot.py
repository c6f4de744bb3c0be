# Pilot of docs/experiments/text_plans.md (2026-11-28), not part of the library: does more plan-conditioned
# training make the plan world's image stage follow its plan? Continues worlds/shapes_plan's policy for STEPS steps
# at peak LR with PLAN_PROB of the images conditioned on their ground-truth plan, then evaluates it as the world
# build does (evaluate_policy, 48 captions x 2 images a split). Usage: python THIS STEPS LR PLAN_PROB
import argparse, json, sys, time, dataclasses
import torch, torch.nn.functional as F

from pilot_args import count, number, plan_world


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="plan_following_pilot.py", description="continue the plan world's policy "
                                 "with plan-conditioned images, then evaluate it")
    ap.add_argument("steps", type=count)
    ap.add_argument("lr", type=number(0, 1, low_open=True), help="the peak learning rate, in (0, 1]")
    ap.add_argument("plan_prob", type=number(0, 1, low_open=False), help="the share of plan-conditioned images")
    args = ap.parse_args(argv)
    args.world = plan_world(ap)
    return args


def main(argv: list[str]) -> None:
    from grpo_vision.shapes.build import train_policy as tp

    args = parse_args(argv)
    STEPS, LR, PLAN_PROB, world = args.steps, args.lr, args.plan_prob, args.world
    policy, tok = world.policy, world.tokenizer
    p = dataclasses.replace(tp.POLICY_PRESETS["plan"], steps=STEPS, lr=LR, plan_prob=PLAN_PROB)
    torch.manual_seed(1)
    codes, captions, plans = tp.tokenize_dataset(tok, p.examples, 11, False)
    cond_all = policy.encode_prompts(captions)
    null = policy.null_condition(cond_all[:1])
    data = tp.plan_data(policy, captions, plans)
    opt = torch.optim.AdamW(policy.parameters(), lr=p.lr, betas=(0.9, 0.95), weight_decay=0.05)
    gen = torch.Generator().manual_seed(1)
    policy.train(); t0 = time.monotonic(); ema = None
    for step in range(p.steps):
        idx = torch.randint(0, len(captions), (p.batch_size,), generator=gen)
        cond, target = cond_all[idx], codes[idx]
        drop = torch.rand(p.batch_size, generator=gen) < p.cond_dropout
        cond = torch.where(drop[:, None], null, cond)
        for g in opt.param_groups:
            g["lr"] = tp.lr_at(step, p)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with_plan = torch.rand(p.batch_size, generator=gen) < p.plan_prob
            logits, target, plan_logits = tp.planned_logits(policy, data, idx, cond, target, drop, with_plan)
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        plan_loss = F.cross_entropy(plan_logits.float().flatten(0, 1), data.targets[idx].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True); (loss + plan_loss).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0); opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 100 == 0:
            print(step, round(ema, 4), round(time.monotonic() - t0), flush=True)
    policy.eval()
    train_s = time.monotonic() - t0
    figs = tp.evaluate_policy(policy, tok, n_prompts=48, per_prompt=2)
    keep = {k: v for k, v in figs.items() if any(s in k for s in ("relation", "count", "shape")) or k.endswith(("_seen", "_heldout"))}
    print(json.dumps({"steps": STEPS, "lr": LR, "plan_prob": PLAN_PROB, "train_s": round(train_s), "loss": ema} | keep, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
