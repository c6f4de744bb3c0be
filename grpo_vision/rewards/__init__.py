"""Rewards: the contract and registry (base), the weighted composite, and the built-in rewards.

Import direction: base <- composite, simple, models <- refit, vlm_judge <- self_judge, geneval_reward; nothing imports
back.
Importing this package registers the built-ins: jpeg_compressibility, jpeg_incompressibility, placebo
(simple.py), the model rewards clip, aesthetic, pickscore, hpsv2 (models.py), vlm_judge, a
vision-language model's P(yes) (vlm_judge.py), self_judge, the P(yes) of the policy's own understanding branch
(self_judge.py), and clip_refit, a CLIP that learns between iterations (refit.py); and geneval, GenEval's verdict from a detector and a colour CLIP (geneval_reward.py,
detectors.py). Plugins register more (ShapesWorld: shapes_exact).
"""

from grpo_vision.rewards import geneval_reward, models, refit, self_judge, simple, vlm_judge  # noqa: F401  (registers the built-in rewards)
from grpo_vision.rewards.base import (
    REGISTRY,
    RewardContext,
    RewardError,
    RewardFn,
    RunModels,
    available_rewards,
    batched,
    check_options,
    check_rewards,
    is_registered,
    make_reward,
    policy_readers,
    register_callable,
    register_reward,
    reward_origin,
    save_reward_origins,
    supply_rewards,
)
from grpo_vision.rewards.composite import CompositeReward, RewardOutput

__all__ = ["REGISTRY", "CompositeReward", "RewardContext", "RewardError", "RewardFn", "RewardOutput", "RunModels",
           "available_rewards", "batched", "check_options", "check_rewards", "is_registered", "make_reward",
           "policy_readers", "register_callable", "register_reward", "reward_origin", "save_reward_origins",
           "supply_rewards"]
