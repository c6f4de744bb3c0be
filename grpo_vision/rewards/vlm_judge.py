"""A vision-language model as the judge: P(yes) for "Does this image show {prompt}?".

    reward.options.vlm_judge: {path: models/Qwen2.5-VL-7B-Instruct}
    score = P(yes) / (P(yes) + P(no))        in [0, 1], per image

The judge reads the image and a question through its processor's chat template (the image, then the
question, the generation prompt added) and the score comes from the logits of the first answer token
alone: a softmax over just the "yes" and "no" tokens, no text generated. This is the VQAScore recipe
(Lin et al. 2024, arXiv 2404.01291: P("Yes") of an image-question pair), the P(yes) reward of
Janus-Pro-R1 (InternVL) and T2I-R1's VQA reward. With `case_variants` (default) "yes" pools the
capitalisations that are one token each (yes, Yes, YES), since instruction-tuned judges answer "Yes"
far more often than "yes": P(yes) = sum of their probabilities, the same for no.

A prompt entry may ask its own questions, `metadata["questions"]` (a list of strings, each may use
{prompt}; DSG / TIFA-style decomposed checks): the image's score is their mean.

Any transformers image-text-to-text model directory loads (`AutoProcessor`, `AutoModelForImageTextToText`,
local files only): Qwen2-VL / Qwen2.5-VL, LLaVA(-1.5, -NeXT), InternVL in transformers' "-hf" format.
Batches are left-padded, so the last position of every row is its answer position; a test checks that
a batch scores as one image at a time. docs/real_models.md lists the released judges and the cost.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal, Sequence

import torch

from grpo_vision.config import ConfigError, brief
from grpo_vision.rewards.base import RewardContext, RewardFn, register_reward
from grpo_vision.rewards.models import _local_path
from grpo_vision.run.load_checks import dtype_argument

KEY = "reward.options.vlm_judge"
WHAT = "a local transformers image-text-to-text model directory (e.g. a download of Qwen/Qwen2.5-VL-7B-Instruct)"


@dataclass
class VlmJudgeOptions:
    path: str = ""  # a local image-text-to-text model directory (save_pretrained, or a downloaded snapshot)
    question: str = "Does this image show {prompt}? Answer yes or no."  # {prompt}: the image's prompt
    yes_word: str = "yes"  # the answer that scores 1: one token of the judge's tokenizer (quote it in YAML)
    no_word: str = "no"  # the answer that scores 0: one token of the judge's tokenizer (quote it in YAML)
    case_variants: bool = True  # also pool the words' other capitalisations that are one token (Yes, YES)
    template: str = ""  # "" = the processor's chat template; else the prompt text, with {image} and {question}
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: float32 on a CPU, bfloat16 on a GPU


class VlmJudgeLoadError(RuntimeError):
    """A judge directory that transformers cannot load as an image-text-to-text model."""


@lru_cache(maxsize=None)
def _processor(path: str):
    """The judge's processor, left-padding (its own copy, cached per path): the last position of each row
    of a batch is then that row's answer position."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except Exception as e:  # no processor files, or files of a processor class transformers does not know
        raise ConfigError(f"{KEY}.path={path}: cannot load its processor with AutoProcessor "
                          f"({type(e).__name__}: {_line(e)}); save the model's processor into the directory") from None
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None or not hasattr(processor, "image_processor"):
        raise ConfigError(f"{KEY}.path={path}: its processor ({type(processor).__name__}) has no tokenizer and image "
                          f"processor, so it is not {WHAT}")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # batches need one; the pad positions are masked, so any token does
        tokenizer.pad_token = tokenizer.eos_token
    return processor


@lru_cache(maxsize=None)
def _model(path: str, device: str, dtype: str):
    from transformers import AutoModelForImageTextToText

    try:
        model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True,
                                                            **dtype_argument(getattr(torch, dtype)))
    except Exception as e:  # missing or damaged weights
        raise VlmJudgeLoadError(f"cannot load {path} with AutoModelForImageTextToText ({type(e).__name__}: "
                                f"{_line(e)}); is {KEY}.path a complete model download?") from None
    return model.to(device).eval()


def _line(e: BaseException, limit: int = 300) -> str:
    return " ".join(str(e).split())[:limit]


def config_model_type(path: Path, key: str, what: str) -> str | None:
    """The `model_type` of the transformers directory `path`; a ConfigError naming `key` when it has no
    config.json or that is not JSON (`what`: the directory the option wants, for the message)."""
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(f"{key}={path} is not a transformers model directory (no config.json): give {what}")
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise ConfigError(f"{key}={path}: config.json is not a JSON object ({_line(e)}); download it again") \
            from None


def _check_model_type(path: Path) -> None:
    """A ConfigError unless `path` holds a transformers config of an image-text-to-text architecture
    (a CLIP or a plain language model directory is refused here, before anything loads)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as KNOWN

    kind = config_model_type(path, f"{KEY}.path", WHAT)
    if kind not in KNOWN:
        raise ConfigError(f"{KEY}.path={path} holds a {kind!r} model, which is not an image-text-to-text model "
                          f"(AutoModelForImageTextToText loads qwen2_vl, qwen2_5_vl, llava, internvl and "
                          f"{len(KNOWN) - 4} more): give {WHAT}")


def answer_ids(tokenizer, word: str, key: str, case_variants: bool, spaced: bool = False) -> list[int]:
    """The token ids that answer `word`: the word as given (it must be one token of the vocabulary) and,
    with `case_variants`, its lower / Capitalised / UPPER forms that are one token each; with `spaced`, also each
    form after a space (" Yes") where that is one token: a prompt that ends at "Assistant:" is answered " Yes"
    by a byte-level BPE tokenizer (Janus's chat template, the `self_judge` reward)."""
    forms = [word, *((word.lower(), word.capitalize(), word.upper()) if case_variants else ())]
    forms = dict.fromkeys([*forms, *((" " + f for f in forms) if spaced else ())])
    unk = getattr(tokenizer, "unk_token_id", None)
    ids = []
    for form in forms:
        found = tokenizer(form, add_special_tokens=False)["input_ids"]
        if len(found) == 1 and found[0] != unk:
            ids.append(found[0])
        elif form == word:
            pieces = tokenizer.convert_ids_to_tokens(found)
            what = "unknown to" if len(found) == 1 else f"{len(found)} tokens ({pieces}) of"
            raise ConfigError(f"{key}={brief(word)} is {what} the judge's tokenizer; the score reads a single "
                              "answer token: give a word that is one token (e.g. 'yes' or 'Yes')")
    return list(dict.fromkeys(ids))


def questions_for(prompt: str, meta: dict | None, default: str) -> list[str]:
    """The questions asked of one image: its entry's `metadata["questions"]`, else `default`; {prompt} filled."""
    asked = (meta or {}).get("questions", [default])
    if not (isinstance(asked, list) and asked and all(isinstance(q, str) for q in asked)):
        raise ConfigError(f"prompt {brief(prompt)}: metadata 'questions' must be a non-empty list of strings "
                          f"(each may use {{prompt}}), got {brief(asked)}; fix that entry of the prompts file")
    return [q.replace("{prompt}", prompt) for q in asked]


def questions_asked(prompts: Sequence[str], metadata: Sequence[dict], default: str) -> list[tuple[int, str]]:
    """(image index, question) for every question asked of every image (`questions_for`)."""
    return [(i, q) for i, (prompt, meta) in enumerate(zip(prompts, metadata))
            for q in questions_for(prompt, meta, default)]


def mean_per_image(asked: Sequence[tuple[int, object]], scores: torch.Tensor, images: int) -> torch.Tensor:
    """Each image's mean `[images]` of the `scores` `[Q]` of its questions (`asked[q][0]`: question q's image); a
    NaN score (a question left unanswered: openai_judge) is left out, and an image with none answered is NaN."""
    owner = torch.tensor([i for i, _ in asked], dtype=torch.long)  # [Q] the image each question was asked of
    scores = scores.float()
    read = ~scores.isnan()  # [Q]
    total = torch.zeros(images).index_add_(0, owner[read], scores[read])  # [B]
    answered = torch.bincount(owner[read], minlength=images)  # [B]
    return torch.where(answered > 0, total / answered.clamp(min=1), torch.full((images,), math.nan))  # [B]


def prompt_text(processor, question: str, template: str) -> str:
    """The judge's input text for one image and `question`, ending where the answer begins."""
    if template:
        return template.replace("{image}", processor.image_token).replace("{question}", question)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def yes_probability(model, processor, images: torch.Tensor, texts: Sequence[str], yes: Sequence[int],
                    no: Sequence[int]) -> torch.Tensor:
    """P(yes) / (P(yes) + P(no)) `[B]` at the first answer token of image b with text b (float [0, 1]
    images `[B, 3, H, W]`, handed to the processor as they are: no rescaling, no PIL round trip)."""
    inputs = processor(text=list(texts), images=list(images), padding=True, do_rescale=False, return_tensors="pt")
    if not bool(inputs["attention_mask"][:, -1].all()):  # left padding: every row ends at its answer position
        raise RuntimeError("the judge's processor padded on the right; expected left padding")
    inputs = inputs.to(model.device)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    return yes_share(model(**inputs, logits_to_keep=1).logits[:, -1], yes, no)  # logits [B, V] at the answer


def yes_share(logits: torch.Tensor, yes: Sequence[int], no: Sequence[int]) -> torch.Tensor:
    """P(yes) / (P(yes) + P(no)) `[B]` from next-token logits `[B, V]`: the softmax over the answer tokens only,
    the yes variants' probabilities summed (VQAScore's normalisation, module docstring)."""
    p = torch.softmax(logits.float()[:, [*yes, *no]], dim=-1)  # [B, Y+N]
    return p[:, :len(yes)].sum(-1)  # [B]


def _dtype(choice: str, device: torch.device) -> str:
    # RewardContext carries no policy dtype: a GPU judge runs in bfloat16, the precision the released
    # judges ship in; set `dtype` to pin it.
    if choice != "auto":
        return choice
    return "float32" if device.type == "cpu" else "bfloat16"


@register_reward("vlm_judge", options=VlmJudgeOptions)
def vlm_judge_reward(ctx: RewardContext, opts: VlmJudgeOptions) -> RewardFn:
    """P(yes) / (P(yes) + P(no)) of a vision-language judge asked whether the image shows its prompt."""
    path = _local_path(opts.path, f"{KEY}.path", "vlm_judge", WHAT, directory=True)
    _check_model_type(path)
    processor = _processor(str(path))
    if not opts.template and not getattr(processor, "chat_template", None):
        raise ConfigError(f"{KEY}.path={path}: its processor has no chat template: set {KEY}.template to the "
                          "model's prompt, e.g. 'USER: {image}\\n{question} ASSISTANT:' for LLaVA-1.5")
    missing = [m for m in ("{image}", "{question}") if opts.template and m not in opts.template]
    if missing:
        raise ConfigError(f"{KEY}.template={brief(opts.template)} has no {' or '.join(missing)}: write where the "
                          "image and the question go")
    yes = answer_ids(processor.tokenizer, opts.yes_word, f"{KEY}.yes_word", opts.case_variants)
    no = answer_ids(processor.tokenizer, opts.no_word, f"{KEY}.no_word", opts.case_variants)
    if set(yes) & set(no):
        raise ConfigError(f"{KEY}.yes_word={brief(opts.yes_word)} and no_word={brief(opts.no_word)} share a token: "
                          "give two different answers")
    device, dtype = str(ctx.device), _dtype(opts.dtype, ctx.device)

    @torch.no_grad()
    def reward(images, prompts, metadata):
        asked = [(i, prompt_text(processor, q, opts.template))  # (image index, text) for every question
                 for i, q in questions_asked(prompts, metadata, opts.question)]
        if not asked:
            return torch.zeros(0)
        model, n = _model(str(path), device, dtype), ctx.batch_size
        scores = torch.cat([yes_probability(model, processor, images[[i for i, _ in chunk]].float(),
                                            [t for _, t in chunk], yes, no).cpu()
                            for chunk in (asked[k:k + n] for k in range(0, len(asked), n))])  # [Q]
        return mean_per_image(asked, scores, len(prompts))  # [B]

    reward.load = lambda: _model(str(path), device, dtype)
    return reward
