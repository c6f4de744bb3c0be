"""ShapesWorld as a plugin of the core: what it registers, through the same extension points any
user's world or model would use (grpo_vision/plugins.py).

* the policy kind `shapes`: a world directory's base policy and VQ tokenizer, with its judge (the
  exact checker), the default model files of the `clip` and `aesthetic` rewards (its tiny CLIP and
  aesthetic head), and its caption sets as the default prompts (train, test, held-out), chosen by its
  options (`policy.options`, ShapesOptions);
* the rewards `shapes_exact` and `shapes_partial` (grpo_vision/shapes/rewards.py).

The world builder (`grpo_vision.shapes.build`) is not imported here: training never needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

import grpo_vision.shapes.rewards  # noqa: F401  (registers shapes_exact, shapes_partial)
from grpo_vision.policy import Bundle, kind_options, register_policy_kind
from grpo_vision.splits import PromptSets
from grpo_vision.prompts import PromptEntry

TRAIN_PROMPTS = 512  # captions of policy.options.world_train_split a run trains on, an equal share per caption form
EVAL_SEED = 1  # the eval sets are drawn with a fixed seed: every run.seed is scored on the same captions
# The training captions are a fixed data set too, as a data set is in TRL: run.seed draws each step's
# prompts from it and every image's seed, so runs that differ in their seed share their training sample
TRAIN_SEED = 0
CLIP_CONFIG = Path(__file__).parent / "shapes_clip.json"  # the tiny CLIP's open_clip architecture


@dataclass
class ShapesOptions:
    """`policy.options` of the shapes kind."""
    # Without data.train_prompts, what RL trains on: "train" = captions of the base policy's training split
    # (the test captions' distribution); "all" = both splits, so RL also trains on held-out compositions
    # (other captions than the transfer row's); "heldout" = held-out compositions only
    world_train_split: Literal["train", "all", "heldout"] = "train"


def world_reward_defaults(world: Path) -> dict[str, dict]:
    """Default options of the rewards a world brings models for: its tiny CLIP (clip, and clip_refit, which
    re-fits a copy of it on the policy's samples judged by the checker) and aesthetic head."""
    clip = str(world / "clip" / "clip.safetensors")
    return {"clip": {"model": str(CLIP_CONFIG), "checkpoint": clip},
            # starts as the clip reward's CLIP; the tiny CLIP trained at 2e-3 re-fits at 1e-4
            # (docs/experiments/iterative_rl.md: held-out pair accuracy against 1e-5 and 3e-5)
            "clip_refit": {"model": str(CLIP_CONFIG), "checkpoint": clip, "lr": 1e-4},
            "aesthetic": {"checkpoint": str(world / "aesthetic"), "clip_model": str(CLIP_CONFIG),
                          "clip_checkpoint": clip}}


def world_prompts(cfg) -> PromptSets:
    """The world's captions, each set an equal share per caption form (plain, size, background, relation:
    a form the judge finds hard weighs as much as an easy one, whatever its number of captions):

    * test (the headline): half of each form's captions of the base policy's training split, fixed for
      every run (EVAL_SEED), are the test pool; RL never trains on them. A set draws data.eval_size of
      them; a form with fewer captions than its share (15 plain ones: 7 in the pool) repeats them with
      other image seeds. data.eval_draw 2, 3, ... draw again from the same pool (another relation,
      background and size sample), for a check of the draw;
    * held-out (the transfer row): captions naming a held-out colour-shape pair, which no model trained on;
    * train: TRAIN_PROMPTS captions of policy.options.world_train_split outside the test pool, the same for every
      run.seed; train_sample: data.eval_size of them, scored beside the eval sets."""
    from grpo_vision.shapes.scene import FORMS, all_captions

    share = -(-cfg.data.eval_size // len(FORMS))  # per form, rounded up
    test_pool, rest = {}, {}
    for form in FORMS:
        pool = all_captions("train", form)
        order = np.random.default_rng([EVAL_SEED, FORMS.index(form)]).permutation(len(pool))
        test_pool[form] = [pool[i] for i in order[:len(pool) // 2]]
        rest[form] = [pool[i] for i in order[len(pool) // 2:]]
    heldout_pool = {form: all_captions("heldout", form) for form in FORMS}
    split = kind_options(cfg.policy).world_train_split
    train_pool = {f: (rest[f] if split != "heldout" else []) + (heldout_pool[f] if split != "train" else [])
                  for f in FORMS}
    train = draw_per_form(train_pool, TRAIN_PROMPTS // len(FORMS), [TRAIN_SEED])
    drawn = [EVAL_SEED, cfg.data.eval_draw]
    sets = [interleave(train),
            interleave(draw_per_form(test_pool, share, [*drawn, 0]))[:cfg.data.eval_size],
            interleave(draw_per_form(heldout_pool, share, [*drawn, 1]))[:cfg.data.eval_size],
            interleave(draw_per_form({f: sorted(set(v)) for f, v in train.items()}, share, [EVAL_SEED, 2]))
            [:cfg.data.eval_size]]
    return PromptSets(*([PromptEntry(p) for p in captions] for captions in sets))


def draw_per_form(pools: dict[str, list[str]], share: int, seed: list[int]) -> dict[str, list[str]]:
    """`share` captions of each form's pool: a permutation, cycled when the pool is smaller."""
    rng = np.random.default_rng(seed)
    drawn = {}
    for form, pool in pools.items():
        order = rng.permutation(len(pool))
        drawn[form] = [pool[order[i % len(pool)]] for i in range(share)] if pool else []
    return drawn


def interleave(drawn: dict[str, list[str]]) -> list[str]:
    """The forms taking turns (plain, size, background, relation, plain, ...), so that any prefix of a
    set is balanced too."""
    share = max(map(len, drawn.values()), default=0)
    return [v[i] for i in range(share) for v in drawn.values() if v]


def check_world(pcfg) -> None:
    """A missing world is named with the command that builds it, as load_world names it, before any model loads
    (`grpo-vision config`, the start of `train`); what a present world holds is checked when it loads."""
    from grpo_vision.shapes.world import check_world_dir

    if not Path(pcfg.path).exists():
        check_world_dir(pcfg.path)


@register_policy_kind("shapes", prompts=world_prompts, options=ShapesOptions, check=check_world)
def load_shapes(pcfg, device) -> Bundle:
    """A ShapesWorld directory (`policy.path`): its base policy in `policy.dtype` (saved in float32, cast as
    the llama kind casts), its tokenizer, judge and reward models. Its options choose prompts, not weights.
    A world built with plans (worlds/shapes_plan) has a policy that writes a layout plan before it draws
    (sample.plan); any other world's policy has no plan vocabulary, and policy.check_planning refuses sample.plan."""
    import torch

    from grpo_vision.shapes.judge import ShapesJudge
    from grpo_vision.shapes.world import load_world

    world = load_world(pcfg.path, device, defer_tokenizer=True)  # `export` never decodes
    return Bundle(world.policy.to(getattr(torch, pcfg.dtype)), world.tokenizer, judge=ShapesJudge(),
                  reward_defaults=world_reward_defaults(world.path), source=world.path)
