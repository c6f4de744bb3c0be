"""ShapesWorld as a plugin of the core: what it registers, through the same extension points any
user's world or model would use (grpo_vision/plugins.py).

* the policy kind `shapes`: a world directory's base policy and VQ tokenizer, with its judge (the
  exact checker), the default model files of the `clip` and `aesthetic` rewards (its tiny CLIP and
  aesthetic head), and its caption sets as the default prompts (train, test, held-out);
* the reward `shapes_exact` (grpo_vision/shapes/rewards.py).

The world builder (`grpo_vision.shapes.build`) is not imported here: training never needs it.
"""

from __future__ import annotations

from pathlib import Path

import grpo_vision.shapes.rewards  # noqa: F401  (registers shapes_exact)
from grpo_vision.policies import Bundle, PromptSets, register_policy_kind
from grpo_vision.prompts import PromptEntry

TRAIN_PROMPTS = 512  # captions of data.world_train_split a run trains on (minus both eval sets)
EVAL_PROMPTS = 32  # captions in each eval set: test captions and held-out compositions
EVAL_SEED = 1  # the eval sets are drawn with a fixed seed: every run.seed is scored on the same prompts
CLIP_CONFIG = Path(__file__).parent / "shapes_clip.json"  # the tiny CLIP's open_clip architecture


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
    """The world's captions: training prompts of `data.world_train_split` drawn with the run's seed;
    test captions of the base policy's training split (compositions it saw, captions RL never trains
    on: the headline); captions naming a held-out pair, which no model trained on (the transfer row)."""
    from grpo_vision.shapes.scene import prompt_list

    train = [PromptEntry(p) for p in prompt_list(cfg.data.world_train_split, TRAIN_PROMPTS, cfg.run.seed)]
    return PromptSets(train, [PromptEntry(p) for p in prompt_list("train", EVAL_PROMPTS, EVAL_SEED)],
                      [PromptEntry(p) for p in prompt_list("heldout", EVAL_PROMPTS, EVAL_SEED)])


@register_policy_kind("shapes", prompts=world_prompts)
def load_shapes(pcfg, device) -> Bundle:
    """A ShapesWorld directory (`policy.path`): its base policy in `policy.dtype` (saved in float32, cast as
    the llama kind casts), its tokenizer, judge and reward models."""
    import torch

    from grpo_vision.shapes.judge import ShapesJudge
    from grpo_vision.shapes.world import load_world

    world = load_world(pcfg.path, device)
    return Bundle(world.policy.to(getattr(torch, pcfg.dtype)), world.tokenizer, judge=ShapesJudge(),
                  reward_defaults=world_reward_defaults(world.path), source=world.path)
