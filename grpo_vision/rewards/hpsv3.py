"""HPSv3 (Ma, Wu, Sun and Li, ICCV 2025; MizzenAI/HPSv3): a human-preference score from Qwen2-VL-7B-Instruct with a
small head that reads one hidden state and gives a mean and an uncertainty per image.

    reward.options.hpsv3: {checkpoint: models/HPSv3.safetensors, base_model: models/Qwen2-VL-7B-Instruct}
    score = mu                           the head's first output (HPSv3's inference: "we select miu")
    sigma = exp(second output)           the uncertainty its training loss reads (hpsv3_scores returns it)

The released file (MizzenAI/HPSv3 on the hub, `HPSv3.safetensors`) holds every weight of HPSv3's reward
model; the base model directory gives the config and the processor (tokenizer, image processor, chat
template), its weights are not read. The `hpsv3` package pins transformers 4.45.2, so this module
rebuilds its inference on transformers' own Qwen2-VL classes, following hpsv3 1.0.0 (PyPI):

* input (inference.py `prepare_batch`): one user turn, the image then INSTRUCTION with the prompt and
  REWARD_TAIL, through the processor's chat template with the generation prompt; the tokenizer gains
  the special token <|Reward|> (train.py `create_model_and_processor`), which also sizes the embeddings;
* image: resized with PIL bicubic so that height and width are multiples of 28 with 256 * 28 * 28 pixels
  (min_pixels = max_pixels there; dataset/utils.py `fetch_image`, from qwen-vl-utils);
* positions: HPSv3's forward calls the language model without position ids, so Qwen2-VL's M-RoPE gets
  0..L-1 on all three axes, not the image-aware rope index (model/qwen2vl_trainer.py `forward`);
* head ("ranknet", rm_head_kwargs unset): Linear(D, 1024), ReLU, Dropout, Linear(1024, 16), ReLU,
  Linear(16, 2), in float32, on the final-norm hidden state at the <|Reward|> position.

tests/data/hpsv3/SOURCE.md says how the golden outputs that pin this down were made with HPSv3's own code.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal, Sequence

import torch
from torch import nn

from grpo_vision.config import ConfigError
from grpo_vision.rewards.base import RewardContext, RewardFn, batched, register_reward
from grpo_vision.rewards.models import _local_path
from grpo_vision.rewards.vlm_judge import _line, config_model_type

KEY = "reward.options.hpsv3"
REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28  # inference.py prepare_batch: min_pixels = max_pixels
FACTOR = 28  # Qwen2-VL's patch 14 times its 2x2 merge
BASE_WHAT = "a Qwen2-VL-7B-Instruct directory (config.json and processor files)"
HEAD_WIDTHS = (1024, 16)  # qwen2vl_trainer.py, the "ranknet" head without rm_head_kwargs

# The instruction HPSv3 was trained and is run with (hpsv3/dataset/data_collator_qwen.py, INSTRUCTION and
# prompt_with_special_token), byte for byte with its trailing spaces: the score is only defined for this text
# (tests/rewards/test_hpsv3.py compares the token ids with HPSv3's).
INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""
REWARD_TAIL = f"""
Please provide the overall ratings of this image: {REWARD_TOKEN}

END
"""


@dataclass
class HPSv3Options:
    checkpoint: str = ""  # HPSv3.safetensors from the MizzenAI/HPSv3 hub repo (or a .pth of the same state dict)
    base_model: str = ""  # a Qwen2-VL-7B-Instruct directory: its config.json and processor files (weights unused)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # the VLM's; auto: float32 on a CPU, else bf16
    device: str = ""  # where the model runs, e.g. cuda:1; "" = the policy's device
    batch_size: int = 0  # images per forward; 0 = reward.batch_size


def head(hidden_size: int) -> nn.Sequential:
    """HPSv3's "ranknet" head; its indices (0, 3, 5) are the checkpoint's rm_head.* keys."""
    return nn.Sequential(nn.Linear(hidden_size, HEAD_WIDTHS[0]), nn.ReLU(), nn.Dropout(0.05),
                         nn.Linear(HEAD_WIDTHS[0], HEAD_WIDTHS[1]), nn.ReLU(), nn.Linear(HEAD_WIDTHS[1], 2))


def smart_resize(height: int, width: int, pixels: int = PIXELS, factor: int = FACTOR) -> tuple[int, int]:
    """(height, width), multiples of `factor` near the aspect ratio, with about `pixels` pixels: qwen-vl-utils'
    smart_resize with min_pixels = max_pixels = `pixels` (HPSv3's dataset/utils.py)."""
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > pixels:
        beta = math.sqrt(height * width / pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < pixels:
        beta = math.sqrt(pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def to_pil(image: torch.Tensor):
    """A float [0, 1] image `[3, H, W]` as the RGB picture HPSv3 reads: uint8, PIL bicubic to smart_resize."""
    from PIL import Image

    pixels = (image.detach().float().clamp(0, 1) * 255).round().byte().permute(1, 2, 0).cpu().numpy()
    h, w = smart_resize(*pixels.shape[:2])
    return Image.fromarray(pixels).resize((w, h), Image.BICUBIC)


def prompt_text(processor, prompt: str) -> str:
    message = [{"role": "user", "content": [{"type": "image"},
                                            {"type": "text", "text": INSTRUCTION.format(text_prompt=prompt)
                                             + REWARD_TAIL}]}]
    return processor.apply_chat_template(message, tokenize=False, add_generation_prompt=True)


class HPSv3:
    """The loaded model: a Qwen2-VL backbone (no lm_head), the float32 head and the processor."""

    def __init__(self, backbone, score_head: nn.Sequential, processor, reward_id: int):
        self.backbone, self.head, self.processor, self.reward_id = backbone, score_head, processor, reward_id

    @torch.no_grad()
    def scores(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """`[B, 2]` float32: (mu, log sigma) for float [0, 1] images `[B, 3, H, W]` and their prompts."""
        if any(REWARD_TOKEN in p for p in prompts):
            raise ValueError(f"a prompt contains {REWARD_TOKEN}, the token HPSv3 reads its score at; remove it")
        batch = self.processor(text=[prompt_text(self.processor, p) for p in prompts],
                               images=[to_pil(x) for x in images], padding=True, return_tensors="pt")
        device, dtype = self.backbone.device, self.backbone.dtype
        ids = batch["input_ids"].to(device)  # [B, L]
        embeds = self.backbone.get_input_embeddings()(ids)  # [B, L, D]
        feats = self.backbone.get_image_features(batch["pixel_values"].to(device, dtype),
                                                 batch["image_grid_thw"].to(device))
        feats = getattr(feats, "pooler_output", feats)  # a ModelOutput from transformers 5, a tensor before
        feats = torch.cat(list(feats) if isinstance(feats, (list, tuple)) else [feats]).to(dtype)  # [B * T, D]
        embeds = embeds.masked_scatter((ids == self.backbone.config.image_token_id)[..., None], feats)
        positions = torch.arange(ids.shape[1], device=device).expand(3, *ids.shape)  # [3, B, L] plain, as HPSv3's
        hidden = self.backbone.language_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"].to(device),
                                              position_ids=positions).last_hidden_state  # [B, L, D]
        at = ids == self.reward_id  # [B, L], one True per row (the template places one <|Reward|>)
        return self.head(hidden[at].float())  # [B, 2]


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's state dict; a .pth may wrap it as {"model": ...} (HPSv3's inference.py unwraps that)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # damaged or not a checkpoint at all
        raise ConfigError(f"{KEY}.checkpoint={path}: cannot read it as a state dict ({type(e).__name__}: "
                          f"{_line(e)}); download HPSv3.safetensors again") from None
    state = state.get("model", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise ConfigError(f"{KEY}.checkpoint={path} holds a {type(state).__name__}, not a state dict")
    return state


def _renamed(key: str) -> str:
    """A key of HPSv3's checkpoint (transformers 4.45 names) as this transformers' Qwen2VLModel names it."""
    if key.startswith("visual."):
        return "model." + key
    return re.sub(r"^model\.(?!language_model\.|visual\.)", "model.language_model.", key)


@lru_cache(maxsize=None)
def load_hpsv3(checkpoint: str, base_model: str, device: str, dtype: str) -> HPSv3:
    """HPSv3 from its checkpoint and the base model's config and processor, loaded strictly: every key of the
    checkpoint must be a weight of the model with the same shape, and every weight must be in the checkpoint."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoProcessor, Qwen2VLForConditionalGeneration

    base = Path(base_model)
    try:
        config = AutoConfig.from_pretrained(base, local_files_only=True)
        processor = AutoProcessor.from_pretrained(base, local_files_only=True, padding_side="right")
    except Exception as e:  # no config or processor files, or files transformers cannot read
        raise ConfigError(f"{KEY}.base_model={base}: cannot load its config and processor ({type(e).__name__}: "
                          f"{_line(e)}); give a Qwen2-VL-7B-Instruct download") from None
    if config.model_type != "qwen2_vl":
        raise ConfigError(f"{KEY}.base_model={base} holds a {config.model_type!r} model; HPSv3 is built on "
                          "Qwen2-VL-7B-Instruct (model_type 'qwen2_vl')")
    processor.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    reward_id = processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
    text = getattr(config, "text_config", config)
    text.vocab_size = len(processor.tokenizer)  # HPSv3 resizes the embeddings to this
    with init_empty_weights():  # parameters on the meta device (no 7B random init), buffers made as usual
        model = Qwen2VLForConditionalGeneration(config)
        score_head = head(text.hidden_size)
    want = {**{k: v.shape for k, v in model.state_dict().items()},
            **{f"rm_head.{k}": v.shape for k, v in score_head.state_dict().items()}}
    path = Path(checkpoint)
    state = {_renamed(k): v for k, v in _read_state(path).items()}
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    wrong = [f"{k} {tuple(state[k].shape)} (expected {tuple(want[k])})" for k in sorted(set(want) & set(state))
             if state[k].shape != want[k]]
    if missing or unexpected or wrong:
        found = "; ".join(f"{what}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''} ({len(keys)})"
                          for what, keys in (("missing", missing), ("unexpected", unexpected), ("shape", wrong))
                          if keys)
        raise ConfigError(f"{KEY}.checkpoint={path} does not match HPSv3 on {base} ({found}); give HPSv3.safetensors "
                          f"and the Qwen2-VL-7B-Instruct it was trained from")
    backbone = model.model
    backbone.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")},
                             strict=True, assign=True)
    score_head.load_state_dict({k[len("rm_head."):]: v for k, v in state.items() if k.startswith("rm_head.")},
                               strict=True, assign=True)
    # lm_head is in the file (checked above) but the score never reads it: it is not kept.
    backbone = backbone.to(device=device, dtype=getattr(torch, dtype)).eval()
    return HPSv3(backbone, score_head.to(device=device, dtype=torch.float32).eval(), processor, reward_id)


def _check_base(base: Path) -> None:
    kind = config_model_type(base, f"{KEY}.base_model", BASE_WHAT)
    if kind != "qwen2_vl":
        raise ConfigError(f"{KEY}.base_model={base} holds a {kind!r} model; HPSv3 is built on Qwen2-VL-7B-Instruct "
                          "(model_type 'qwen2_vl')")


@register_reward("hpsv3", options=HPSv3Options)
def hpsv3_reward(ctx: RewardContext, opts: HPSv3Options) -> RewardFn:
    """HPSv3's mu per image: Qwen2-VL-7B reads the image and its prompt, a head on the <|Reward|> token scores it."""
    checkpoint = _local_path(opts.checkpoint, f"{KEY}.checkpoint", "hpsv3",
                             "HPSv3.safetensors from the MizzenAI/HPSv3 hub repo")
    base = _local_path(opts.base_model, f"{KEY}.base_model", "hpsv3", BASE_WHAT, directory=True)
    _check_base(base)
    if opts.batch_size < 0:
        raise ConfigError(f"{KEY}.batch_size={opts.batch_size}: give a positive number, or 0 for reward.batch_size")
    try:
        device = torch.device(opts.device) if opts.device else ctx.device
    except RuntimeError:
        raise ConfigError(f"{KEY}.device={opts.device!r} is not a torch device: give e.g. cuda, cuda:1 or cpu, "
                          "or leave it empty for the policy's device") from None
    dtype = opts.dtype if opts.dtype != "auto" else ("float32" if device.type == "cpu" else "bfloat16")
    key = (str(checkpoint), str(base), str(device), dtype)

    def score(images, prompts):
        return load_hpsv3(*key).scores(images, prompts)[:, 0]  # [B] mu

    return batched(score, opts.batch_size or ctx.batch_size, device, load=lambda: load_hpsv3(*key))


def hpsv3_scores(model: HPSv3, images: torch.Tensor, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mu `[B]`, sigma `[B]`): the mean and the uncertainty HPSv3's loss reads (sigma = exp of the 2nd output)."""
    out = model.scores(images, prompts)
    return out[:, 0], out[:, 1].exp()
