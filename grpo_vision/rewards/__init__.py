"""Rewards: the contract and registry (base.py), the weighted composite (composite.py), and the built-in rewards;
CLIP models from local files (clip.py) and the LAION aesthetic head (aesthetic.py) serve the model rewards,
GenEval's rules (geneval.py) and prompt sets (geneval_prompts.py) its reward.

Import direction: base <- composite, simple, models, remote <- refit, vlm_judge, geneval_reward, hpsv3 <-
openai_judge, self_judge; nothing imports back.
Importing this package registers the built-ins: jpeg_compressibility, jpeg_incompressibility, placebo
(simple.py), the model rewards clip, aesthetic, pickscore, hpsv2 (models.py), hpsv3 (hpsv3.py), vlm_judge, a
vision-language model's P(yes) (vlm_judge.py), self_judge, the P(yes) of the policy's own understanding branch
(self_judge.py), and clip_refit, a CLIP that learns between iterations (refit.py); and geneval, GenEval's verdict
from a detector and a colour CLIP (geneval_reward.py, detectors.py); ocr, the prompt's quoted text against the
text PP-OCRv4 reads in the image (ocr.py, Flow-GRPO's; the .[ocr] extra); remote, a reward served over HTTP by
`grpo-vision serve-reward` (remote.py), and openai_judge, a judge's P(yes) from an OpenAI-compatible endpoint
(openai_judge.py). Plugins register more (ShapesWorld: shapes_exact).
"""

from grpo_vision.rewards import geneval_reward, hpsv3, models, refit, self_judge, simple, vlm_judge  # noqa: F401  (registers the built-in rewards)
from grpo_vision.rewards import ocr  # noqa: F401  (registers ocr; rapidocr-onnxruntime loads at its first call)
from grpo_vision.rewards import openai_judge, remote  # noqa: F401  (rewards behind a server)
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
