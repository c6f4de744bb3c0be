"""Model-backed rewards, from local files only: clip, aesthetic, pickscore, hpsv2.

    reward     model                                    score per image           options (reward.options.<reward>)
    clip       any open_clip CLIP                       cosine                    model, checkpoint
    aesthetic  LAION v2 head on a CLIP image embedding  ~1..10 rating             checkpoint, clip_model, clip_checkpoint
    pickscore  PickScore_v1, a transformers CLIPModel   logit_scale.exp() * cos   path, processor
    hpsv2      HPS v2 / v2.1 on open_clip ViT-H-14      cosine                    checkpoint, model

An open_clip checkpoint that is a TorchScript archive (OpenAI's ViT-L-14.pt) loads only with the
reward's `trust_torchscript: true`, since loading one runs the code inside it (docs/security.md).

A policy kind may supply default options (ShapesWorld: its tiny CLIP and aesthetic head); the
user's options override them key by key. A factory checks its keys and paths at once (ConfigError naming the key,
which the CLI prints as a one-line error) and builds its model at the reward's first call, or when
CompositeReward.load() asks (train, eval and the demo do, before sampling anything); models
are cached per (path, device), so clip and aesthetic share one CLIP. Scoring runs in chunks of
reward.batch_size on the policy's device, each model's own preprocessing applied to the tensors.

Formulas: PickScore's README (yuvalkirstain/PickScore) and HPSv2's `img_score.py` (tgxs002/HPSv2,
which normalises both embeddings and takes the diagonal, no logit scale). HPS's own transform pads
non-square images to a square after resizing the longest side; open_clip's (used here) resizes the
shortest side and centre-crops, the same thing for the square images a policy samples.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from grpo_vision.rewards.clip import (
    ClipLoadError, clip_scores, hf_clip_scores, image_embeddings, load_clip, load_hf_clip, resolve_model_name,
)
from grpo_vision.config import ConfigError, brief
from grpo_vision.rewards.base import RewardContext, RewardFn, batched, register_reward

DEFAULT_CLIP = "ViT-L-14-quickgelu"  # OpenAI's ViT-L/14: the aesthetic head's CLIP, torchmetrics' default


@dataclass
class ClipOptions:
    model: str = ""  # open_clip architecture, or the path of a JSON model config; "" = ViT-L-14-quickgelu
    checkpoint: str = ""  # local open_clip checkpoint file (e.g. OpenAI's ViT-L/14 weights)
    trust_torchscript: bool = False  # load checkpoint even if it is a TorchScript archive, which runs code


@dataclass
class AestheticOptions:
    checkpoint: str = ""  # LAION-style head: .pth, .safetensors, or a directory from save_aesthetic
    clip_model: str = ""  # the CLIP the head reads embeddings from; "" = ViT-L-14-quickgelu (LAION's heads)
    clip_checkpoint: str = ""  # that CLIP's local checkpoint file
    trust_torchscript: bool = False  # load clip_checkpoint even if it is a TorchScript archive, which runs code


@dataclass
class PickScoreOptions:
    path: str = ""  # a transformers CLIPModel directory (save_pretrained of yuvalkirstain/PickScore_v1)
    processor: str = ""  # its CLIPProcessor directory; "" = path


@dataclass
class HPSv2Options:
    checkpoint: str = ""  # HPS v2 / v2.1 checkpoint file ({"state_dict": ...}, e.g. HPS_v2.1_compressed.pt)
    model: str = "ViT-H-14"  # open_clip architecture (or JSON config path) of the checkpoint
    trust_torchscript: bool = False  # load checkpoint even if it is a TorchScript archive, which runs code


def _local_path(value: str, key: str, reward: str, what: str, directory: bool = False) -> Path:
    """`value` as an existing local path, else a ConfigError naming the reward, the key and the path."""
    if not value:
        raise ConfigError(f"reward '{reward}' needs {key}: {what}")
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(f"reward '{reward}': {key}={value} does not exist (expected {what})")
    if directory and not path.is_dir():
        raise ConfigError(f"reward '{reward}': {key}={value} is not a directory (expected {what})")
    return path


def _architecture(name: str, key: str, reward: str) -> str:
    """The open_clip name for `name` (a JSON config path is registered), checked against open_clip's list."""
    import open_clip

    try:
        resolved = resolve_model_name(name)
    except (FileNotFoundError, ClipLoadError) as e:
        raise ConfigError(f"reward '{reward}': {key}: {e}") from None
    if resolved not in open_clip.list_models():
        close = difflib.get_close_matches(name, open_clip.list_models(), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"reward '{reward}': {key}={brief(name)} is not an open_clip architecture{hint}; "
                          "give a name from open_clip.list_models() or the path of a JSON model config")
    return resolved


@lru_cache(maxsize=None)
def _open_clip(name: str, checkpoint: str, device: str, trust_torchscript: bool = False):
    return load_clip(name, checkpoint, device=device, trust_torchscript=trust_torchscript)


@lru_cache(maxsize=None)
def _aesthetic_head(path: str, device: str):
    from grpo_vision.rewards.aesthetic import load_aesthetic

    return load_aesthetic(path).to(device)


def _clip_spec(model: str, checkpoint: str, keys: tuple[str, str], reward: str) -> tuple[str, str]:
    """(architecture, checkpoint file) of a CLIP, checked; `keys` name the two options in messages."""
    if not checkpoint:
        raise ConfigError(f"reward '{reward}' needs {keys[1]} (a local open_clip checkpoint file, e.g. OpenAI's "
                          f"ViT-L/14 weights) and {keys[0]} (its architecture; default {DEFAULT_CLIP}), or a "
                          "policy kind that ships its own CLIP (ShapesWorld does)")
    path = _local_path(checkpoint, keys[1], reward, "a local open_clip checkpoint file")
    return _architecture(model or DEFAULT_CLIP, keys[0], reward), str(path)


def clip_image_encoder(options: dict, device) -> Callable[[torch.Tensor], torch.Tensor]:
    """`images -> [B, D]` L2-normalised image embeddings from the `clip` reward's CLIP (`options` as in
    reward.options.clip), the same cached model the reward scores with."""
    name, checkpoint = _clip_spec(options.get("model", ""), options.get("checkpoint", ""),
                                  ("reward.options.clip.model", "reward.options.clip.checkpoint"), "clip")

    trust = bool(options.get("trust_torchscript", False))

    @torch.no_grad()
    def embed(images: torch.Tensor) -> torch.Tensor:
        model = _open_clip(name, checkpoint, str(device), trust)[0]
        return image_embeddings(model, images.float()).float()
    return embed


@register_reward("clip", options=ClipOptions)
def clip_reward(ctx: RewardContext, opts: ClipOptions) -> RewardFn:
    """Cosine similarity of open_clip's normalised image and text embeddings, per sample."""
    name, checkpoint = _clip_spec(opts.model, opts.checkpoint, ("reward.options.clip.model",
                                                                "reward.options.clip.checkpoint"), "clip")
    device, trust = str(ctx.device), opts.trust_torchscript

    @torch.no_grad()
    def score(images, prompts):
        model, _, tokenizer = _open_clip(name, checkpoint, device, trust)
        return clip_scores(model, tokenizer, images.float(), prompts)

    return batched(score, ctx.batch_size, ctx.device, load=lambda: _open_clip(name, checkpoint, device, trust))


@register_reward("aesthetic", options=AestheticOptions)
def aesthetic_reward(ctx: RewardContext, opts: AestheticOptions) -> RewardFn:
    """LAION improved-aesthetic-predictor: an MLP on the L2-normalised CLIP image embedding.

    The released heads (e.g. sac+logos+ava1-l14-linearMSE.pth, 768-d input) read OpenAI's ViT-L/14
    (ViT-L-14-quickgelu) embeddings: set clip_model and clip_checkpoint to it.
    """
    if not opts.checkpoint:
        raise ConfigError("reward 'aesthetic' needs reward.options.aesthetic.checkpoint (a local head "
                          ".pth/.safetensors) and a CLIP (reward.options.aesthetic.clip_checkpoint, clip_model), "
                          "or a policy kind that ships its own head (ShapesWorld does)")
    head_path = _local_path(opts.checkpoint, "reward.options.aesthetic.checkpoint", "aesthetic",
                            "a LAION aesthetic head .pth, a .safetensors file or a directory from save_aesthetic")
    name, checkpoint = _clip_spec(opts.clip_model, opts.clip_checkpoint, ("reward.options.aesthetic.clip_model",
                                                                          "reward.options.aesthetic.clip_checkpoint"),
                                  "aesthetic")
    device, trust = str(ctx.device), opts.trust_torchscript

    @torch.no_grad()
    def score(images, prompts):
        model, _, _ = _open_clip(name, checkpoint, device, trust)
        head = _aesthetic_head(str(head_path), device)
        emb = image_embeddings(model, images.float()).float()  # [B, D]
        if emb.shape[-1] != head.config["input_dim"]:
            raise ConfigError(f"the aesthetic head {head_path} takes {head.config['input_dim']}-d CLIP "
                              f"embeddings, but CLIP {name!r} ({checkpoint}) gives {emb.shape[-1]}-d: set "
                              "reward.options.aesthetic.clip_model and clip_checkpoint to the CLIP the head was "
                              "trained on "
                              f"({DEFAULT_CLIP} for LAION's)")
        return head(emb)

    def load():
        _open_clip(name, checkpoint, device, trust)
        _aesthetic_head(str(head_path), device)

    return batched(score, ctx.batch_size, ctx.device, load=load)


@register_reward("pickscore", options=PickScoreOptions)
def pickscore_reward(ctx: RewardContext, opts: PickScoreOptions) -> RewardFn:
    """PickScore (Kirstain et al. 2023, arXiv 2305.01569): logit_scale.exp() * cos(image, prompt) of a
    CLIP-H fine-tuned on Pick-a-Pic preferences. The processor is laion/CLIP-ViT-H-14-laion2B-s32B-b79K's
    in the README; save it into the model directory or point reward.options.pickscore.processor at it."""
    what = "a transformers CLIPModel directory (save_pretrained of yuvalkirstain/PickScore_v1)"
    model_dir = _local_path(opts.path, "reward.options.pickscore.path", "pickscore", what, directory=True)
    processor_dir = model_dir
    if opts.processor:
        processor_dir = _local_path(opts.processor, "reward.options.pickscore.processor", "pickscore",
                                    "a CLIPProcessor directory (save_pretrained)", directory=True)
    device = str(ctx.device)

    @torch.no_grad()
    def score(images, prompts):
        model, processor = load_hf_clip(str(model_dir), str(processor_dir), device)
        return hf_clip_scores(model, processor, images.float(), prompts)

    return batched(score, ctx.batch_size, ctx.device,
                   load=lambda: load_hf_clip(str(model_dir), str(processor_dir), device))


@register_reward("hpsv2", options=HPSv2Options)
def hpsv2_reward(ctx: RewardContext, opts: HPSv2Options) -> RewardFn:
    """Human Preference Score v2 / v2.1 (Wu et al. 2023, arXiv 2306.09341): the cosine of open_clip
    ViT-H-14 image and text embeddings, with HPS's fine-tuned weights (v2.0 and v2.1 scores are not
    comparable). The released file is `{"state_dict": ...}`, which open_clip unwraps; loading is
    strict, so a key mismatch between HPS's vendored open_clip and ours would fail loudly."""
    checkpoint = _local_path(opts.checkpoint, "reward.options.hpsv2.checkpoint", "hpsv2",
                             "the HPS v2 or v2.1 checkpoint file (HPS_v2.1_compressed.pt from xswu/HPSv2)")
    name = _architecture(opts.model, "reward.options.hpsv2.model", "hpsv2")
    device, trust = str(ctx.device), opts.trust_torchscript

    @torch.no_grad()
    def score(images, prompts):
        model, _, tokenizer = _open_clip(name, str(checkpoint), device, trust)
        return clip_scores(model, tokenizer, images.float(), prompts)

    return batched(score, ctx.batch_size, ctx.device, load=lambda: _open_clip(name, str(checkpoint), device, trust))
