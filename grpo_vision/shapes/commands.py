"""`grpo-vision world ...`: build the world, render captions, write prompts files, time the checker.

Added to the command line through the `grpo_vision.commands` entry point (see grpo_vision/plugins.py);
this module imports only argparse at start-up, so `grpo-vision --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path


def cmd_world_build(args) -> None:
    from grpo_vision.shapes.build import build_world

    out = args.out or "worlds/" + {"default": "shapes", "plan": "shapes_plan"}.get(args.preset, f"shapes_{args.preset}")
    info = build_world(out, args.preset, args.seed, start_from=args.start_from or None)
    q = info["quality"]
    if args.json:
        print(json.dumps(q, indent=2))
    else:  # the headline figures; world.json holds them all
        print(f"[world] checker on clean renders {q.get('checker_acc_clean', float('nan')):.3f}, VQ PSNR "
              f"{q.get('vq_psnr_all', float('nan')):.1f} dB, CLIP hard-negative accuracy "
              f"{q.get('clip_final_hard_acc', float('nan')):.3f} (all figures: world.json, or --json)")


def cmd_world_render(args) -> None:
    from grpo_vision.shapes.render_prompts import render_prompts

    index = render_prompts(args.prompts, args.out, n=args.n, seed=args.seed)
    print(f"wrote {len(index)} images and index.jsonl to {args.out}")


def cmd_world_prompts(args) -> None:
    import numpy as np

    from grpo_vision.splits import prompt_lists
    from grpo_vision.run.folder import read_run_config
    from grpo_vision.shapes.scene import all_captions

    captions = all_captions(args.split, None if args.form == "all" else args.form)
    if args.not_trained_in:
        # its data paths resolved from here, its saved device (perhaps not this machine's) unused
        trained = {e.prompt for e in prompt_lists(read_run_config(args.not_trained_in, device="auto")).train}
        captions = [c for c in captions if c not in trained]
    if args.n and args.n < len(captions):
        captions = [captions[i] for i in sorted(np.random.default_rng(args.seed).permutation(len(captions))[:args.n])]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(c + "\n" for c in captions))
    print(f"wrote {len(captions)} captions to {args.out}")


def cmd_world_bench(args) -> None:
    from grpo_vision.shapes.bench import bench_checker

    result = bench_checker(n_per_form=args.n, repeats=args.repeats, seed=args.seed)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


def add_commands(sub) -> None:
    """Add `world build | render | prompts | bench` to the `grpo-vision` subparsers `sub`."""
    from grpo_vision.cli.args import positive_int, seed

    world = sub.add_parser("world", help="ShapesWorld, the embedded default world").add_subparsers(
        dest="what", required=True)
    p = world.add_parser("build", help="train the world's tokenizer, CLIP, aesthetic head and base policy: about an "
                                       "hour on a 2-core CPU; a complete world is kept, not rebuilt")
    p.add_argument("--preset", default="default",
                   choices=["micro", "default", "plan", "plan_micro", "canvas", "canvas_micro"],
                   help="micro: seconds, for tests; plan: the default world with a base policy that writes a layout "
                        "plan before it draws; canvas: the plan world's policy with its plan also drawn onto the "
                        "image grid (a layout canvas); *_micro: their micro versions")
    p.add_argument("--out", default="", help="world directory (default: worlds/shapes, worlds/shapes_plan, or "
                                             "worlds/shapes_<preset>)")
    p.add_argument("--from", dest="start_from", default="", metavar="WORLD",
                   help="copy the finished stages of this world that share the preset's recipe instead of training "
                        "them (--preset plan --from worlds/shapes trains the base policy only)")
    p.add_argument("--seed", type=seed, default=0, help="seeds every stage; the build is deterministic")
    p.add_argument("--json", action="store_true", help="print every quality figure as JSON")
    p.set_defaults(func=cmd_world_build)
    p = world.add_parser("render", help="ground-truth renders for the captions of a prompts file")
    p.add_argument("--prompts", required=True, help="plain text (one caption per line) or JSONL with 'prompt'")
    p.add_argument("--out", required=True, help="output directory for PNGs and index.jsonl")
    p.add_argument("--n", type=positive_int, default=1, help="images per prompt")
    p.add_argument("--seed", type=seed, default=0, help="base seed; image j of a prompt uses seed + j")
    p.set_defaults(func=cmd_world_render)
    p = world.add_parser("prompts", help="a prompts file of the world's captions (e.g. held-out ones for eval)")
    p.add_argument("--split", default="heldout", choices=["train", "heldout", "all"],
                   help="the base policy's training compositions, the held-out ones, or both")
    p.add_argument("--form", default="all", choices=["all", "plain", "size", "background", "relation"],
                   help="one caption form, or all four")
    p.add_argument("--not-trained-in", default="", metavar="RUN",
                   help="leave out every prompt this run trained on (from its config.yaml)")
    p.add_argument("--n", type=positive_int, default=None, help="at most N captions, drawn with --seed")
    p.add_argument("--seed", type=seed, default=0, help="seed of the draw")
    p.add_argument("--out", required=True, help="the text file to write (one caption per line)")
    p.set_defaults(func=cmd_world_prompts)
    # here, not under `grpo-vision bench`: the core never imports the world (tests/test_structure.py)
    p = world.add_parser("bench", help="seconds per image of the exact checker on renders of every caption form "
                                       "(target 5 ms; speed is checked here, never in timed tests)")
    p.add_argument("--n", type=positive_int, default=50, help="renders per caption form")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed passes over the renders (median reported)")
    p.add_argument("--seed", type=seed, default=30, help="seed of the scenes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_world_bench)
