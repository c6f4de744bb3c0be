"""Janus-Pro's understanding branch, read as a judge: next-token logits after an image and a question.

    image [B, 3, H, W] in [0, 1] --resize, pad, normalise (the JanusImageProcessor's steps, in torch)--> pixels
    "<|User|>: <image_placeholder>\\n{question}\\n\\n<|Assistant|>:" (the processor's chat template)
    pixels --SigLIP vision_model--> aligner --> [576 image embeddings] at the placeholder positions
    --language_model--> lm_head at the last position: the logits of the answer's first token [B, V]

The forward is transformers' own (`JanusForConditionalGeneration.forward` with `input_ids`, `pixel_values`,
`attention_mask`): what runs here and not there is the input side, which `JanusProcessor` does on PIL images
or uint8 tensors on the CPU, and this does on the policy's device without leaving torch. A test checks both
against the processor's output (tests/models/test_janus_understanding.py). The text follows the processor:
its default system prompt where `use_default_system_prompt` is set (transformers' conversion script sets
it, as the original `VLChatProcessor` writes one), each `<image_placeholder>` expanded to
`<begin_of_image>` + num_image_tokens placeholders + `<end_of_image>` (`JanusProcessor.replace_image_token`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

# Tokens of an understanding prompt besides the image's placeholders, for the memory estimate (run/memory.py):
# Janus-Pro's default system prompt (~35 tokens of its tokenizer), the chat template and a question about a
# caption of about 40 words
JUDGE_TEXT_TOKENS = 128
SFT_IMAGE_QUESTION = "<|User|>: {image}\n{question}\n\n<|Assistant|>:"  # without a chat template (the release's)


def understanding_pixels(image_processor, images: torch.Tensor) -> torch.Tensor:
    """`images` `[B, 3, H, W]` in [0, 1] as the vision encoder reads them `[B, 3, S, S]` float32, with the
    JanusImageProcessor's steps in its order: the longest side resized to S (bicubic, antialiased, the short side
    at least `min_size`), padded to a square centred on its background colour (the image mean as the processor
    stores it, in whole 8-bit levels), normalised by its mean and std. The resized image is clamped to [0, 1],
    as the processor's 8-bit images are."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be [B, 3, H, W] in [0, 1], got shape {tuple(images.shape)}")
    ip = image_processor
    x = images.float()
    if ip.do_resize:
        size, (H, W) = ip.size["height"], images.shape[-2:]
        if size != ip.size["width"]:
            raise ValueError(f"the image processor's size must be square, got {ip.size}")
        scale = size / max(H, W)
        h, w = max(round(H * scale), ip.min_size), max(round(W * scale), ip.min_size)
        if (h, w) != (H, W):  # torchvision's resize returns an image of the same size as it is
            x = F.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    if getattr(ip, "do_pad", True) and x.shape[-1] != x.shape[-2]:
        h, w, side = x.shape[-2], x.shape[-1], max(x.shape[-2:])
        background = torch.tensor(ip.background_color, dtype=x.dtype, device=x.device) / 255  # [3]
        square = background.view(1, 3, 1, 1).expand(x.shape[0], 3, side, side).clone()  # [B, 3, S, S]
        top, left = (side - h) // 2, (side - w) // 2
        square[:, :, top:top + h, left:left + w] = x
        x = square
    if ip.do_normalize:
        mean = torch.tensor(ip.image_mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(ip.image_std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        x = (x - mean) / std
    return x  # [B, 3, S, S]


def understanding_texts(processor, questions: Sequence[str]) -> list[str]:
    """Each question after one image, in the processor's chat template, ending where the answer begins, the
    placeholder expanded and the default system prompt prepended as `JanusProcessor.__call__` does in text mode."""
    from transformers.models.janus.processing_janus import DEFAULT_SYSTEM_PROMPT

    image = processor.image_start_token + processor.image_token * processor.num_image_tokens + \
        processor.image_end_token
    texts = []
    for question in questions:
        if processor.chat_template is None:
            text = SFT_IMAGE_QUESTION.format(image=processor.image_token, question=question.strip())
        else:
            chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            text = processor.apply_chat_template(chat, add_generation_prompt=True)
        system = DEFAULT_SYSTEM_PROMPT if processor.use_default_system_prompt else ""
        texts.append(system + text.replace(processor.image_token, image))
    return texts


def answer_logits(model, processor, images: torch.Tensor, questions: Sequence[str]) -> torch.Tensor:
    """Next-token logits `[B, V]` float32 after image b and question b, through transformers' Janus forward
    (`model`, a JanusForConditionalGeneration); rows left-padded, so the last position is every row's answer.
    No cache is kept (`use_cache=False`): one forward, the last position's logits only."""
    if len(questions) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images and {len(questions)} questions: give one question per image")
    device = model.device
    enc = processor.tokenizer(understanding_texts(processor, questions), padding=True, padding_side="left",
                              return_tensors="pt")
    pixels = understanding_pixels(processor.image_processor, images.to(device))  # [B, 3, S, S]
    out = model(input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device),
                pixel_values=pixels.to(model.dtype), logits_to_keep=1, use_cache=False)
    return out.logits[:, -1].float()  # [B, V]
