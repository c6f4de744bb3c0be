"""CLIP models from local files: open_clip checkpoints and transformers `CLIPModel` directories.

Used by the rewards (clip, aesthetic, pickscore, hpsv2) and by any world's own CLIP. Images are
float `[B, 3, H, W]` tensors in [0, 1] on the model's device; each model's own eval preprocessing
(resize, centre crop, normalise) runs on them as tensors, with no PIL round trip.

open_clip architectures are named as open_clip names them (`open_clip.list_models()`: `ViT-L-14`,
`ViT-L-14-quickgelu`, `ViT-H-14`, ...), by the path of a JSON config file (`{"embed_dim", "vision_cfg",
"text_cfg"}`, registered under its file stem, as open_clip's `add_model_config` does). Checkpoints are local files in any format open_clip reads:
a state dict (`.safetensors`, `.bin`, `.pt`), one wrapped as `{"state_dict": ...}` (HPS v2), or,
with `trust_torchscript`, OpenAI's TorchScript archives (`ViT-L-14.pt` from `clip.load`). Loading an
archive runs the TorchScript code inside it, so without that option it is refused;
`grpo-vision convert-clip` turns a trusted one into safetensors once (docs/security.md).

OpenAI's CLIP weights were trained with QuickGELU, and nothing in a checkpoint says so: loaded into
`ViT-L-14` (GELU) they run without error and give wrong embeddings. Use `ViT-L-14-quickgelu`;
load_clip warns when a checkpoint looks like OpenAI's and the architecture is not QuickGELU.
"""

from __future__ import annotations

import pickle
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from grpo_vision.config import GrpoVisionWarning
from grpo_vision.run.load_checks import non_finite
from grpo_vision.run.safe_state import UnsafeFileError, is_torchscript, quiet_protocol_note, refusal, torch_reason

class ClipLoadError(RuntimeError):
    """A checkpoint that does not fit its architecture, or an architecture open_clip does not know."""


# ---------------------------------------------------------------- open_clip


def register_config(path: str | Path) -> str:
    """Add a JSON model config to open_clip's registry (idempotent); return its name, the file stem."""
    import open_clip
    from open_clip import factory

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"open_clip model config not found: {path}")
    if path.stem not in open_clip.list_models():
        open_clip.add_model_config(path)
    elif path not in factory._MODEL_CONFIG_PATHS:
        raise ClipLoadError(f"an open_clip config named {path.stem!r} exists that is not {path}; rename the file")
    return path.stem


def resolve_model_name(model_name: str) -> str:
    """The open_clip name for `model_name`: a JSON config path is registered under its file stem."""
    if model_name.endswith(".json"):
        return register_config(model_name)
    return model_name


def _uses_quick_gelu(model_name: str) -> bool:
    import open_clip

    return bool((open_clip.get_model_config(model_name) or {}).get("quick_gelu", False))


def load_clip(model_name: str, checkpoint: str | Path, device: str = "cpu", trust_torchscript: bool = False):
    """(model, preprocess, tokenizer) for an open_clip architecture and a local checkpoint file,
    through `open_clip.create_model_and_transforms(name, pretrained=checkpoint)` (strict loading), in
    eval mode. With a file path open_clip applies no pretrained tag, so preprocessing is the config's
    (default: OpenAI mean/std, bicubic resize of the shortest side, centre crop). A TorchScript archive
    is loaded only with `trust_torchscript` (it runs the archive's code); weights that are NaN or
    infinite are refused, naming the file."""
    import open_clip

    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"CLIP checkpoint not found: {path}")
    name = resolve_model_name(model_name)
    if name not in open_clip.list_models():
        raise ClipLoadError(f"unknown open_clip architecture {model_name!r}: give a name from "
                            "open_clip.list_models() (e.g. ViT-L-14-quickgelu, ViT-H-14) or a JSON config file")
    torchscript = is_torchscript(path)
    if torchscript and not trust_torchscript:
        raise ClipLoadError(torchscript_refusal(path))
    if (torchscript or "openai" in str(path).lower()) and not _uses_quick_gelu(name):
        warnings.warn(f"{path} looks like OpenAI CLIP weights, which need QuickGELU, but open_clip architecture "
                      f"{name!r} uses GELU: the embeddings will be wrong. Use the '-quickgelu' variant "
                      f"(e.g. ViT-L-14-quickgelu).", GrpoVisionWarning, stacklevel=2)
    try:
        # Pickled checkpoints are read with weights_only=True (tensors and numbers, nothing that runs);
        # a (trusted) TorchScript archive is read by torch.jit.load alone, below.
        with quiet_protocol_note():
            model, _, preprocess = open_clip.create_model_and_transforms(
                name, pretrained=None if torchscript else str(path), device=device, weights_only=True)
        if torchscript:
            _load_torchscript(model, path)
    except ClipLoadError:
        raise
    except pickle.UnpicklingError as e:
        why = refusal(path, e)
        if not isinstance(why, UnsafeFileError):
            raise ClipLoadError(_damaged(path, torch_reason(e))) from None
        raise ClipLoadError(f"{why}. Use a safetensors copy of the weights; to make one from a file you trust, "
                            "see docs/security.md") from None
    except Exception as e:  # a file that cannot be read, or weights that do not fit the architecture
        if _unreadable(e):
            raise ClipLoadError(_damaged(path, f"{type(e).__name__}: {_first_line(e)}")) from None
        raise ClipLoadError(f"cannot load {path} into open_clip architecture {name!r}: its weights do not fit "
                            f"(is it the checkpoint's architecture?): {type(e).__name__}: "
                            f"{' '.join(str(e).split())[:400]}") from e  # one line, however many keys
    bad = non_finite(model.state_dict())
    if bad:
        raise ClipLoadError(f"the CLIP checkpoint {path} holds {bad}: the file is damaged; copy or download it again")
    return model.eval(), preprocess, open_clip.get_tokenizer(name)


def torchscript_refusal(path: Path) -> str:
    return (f"{path} is a TorchScript archive, and loading one runs the TorchScript code inside it, so it is refused: "
            f"convert it once where you trust it (grpo-vision convert-clip {path} OUT.safetensors) and use "
            "OUT.safetensors, or load it as it is with trust_torchscript: true in the reward's options "
            "(docs/security.md)")


def convert_torchscript(archive: str | Path, out: str | Path) -> int:
    """Write the weights of a TorchScript CLIP archive (OpenAI's release format) to `out`, a safetensors file
    that load_clip reads without trust; the number of tensors. This runs the archive's TorchScript code
    (torch.jit.load): only for an archive you trust."""
    from safetensors.torch import save

    from grpo_vision.files import write_file

    archive, out = Path(archive), Path(out)
    if not archive.is_file():
        raise FileNotFoundError(f"TorchScript archive not found: {archive}")
    if not is_torchscript(archive):
        raise ClipLoadError(f"{archive} is not a TorchScript archive (no constants.pkl inside); load_clip reads it "
                            "as it is")
    if out.suffix != ".safetensors":
        raise ClipLoadError(f"{out}: the output must end in .safetensors (open_clip picks the format by suffix)")
    state = _torchscript_state(archive)
    if missing := not_openai_clip(state):
        raise ClipLoadError(f"{archive} is a TorchScript archive but not a CLIP: it has no {missing} (OpenAI's CLIP "
                            f"archives hold {', '.join(CLIP_PARTS)}); nothing was written: convert only a CLIP "
                            "archive (clip.load's ViT-L-14.pt, RN50.pt, ...)")
    write_file(out, save({k: v.contiguous() for k, v in state.items()}))  # whole, never through a link
    return len(state)


# The top-level parts of OpenAI's CLIP (clip/model.py's CLIP, ViT and ResNet alike), as its archives' state dicts
# name them: `visual.*` and `transformer.*` are modules, the rest tensors of their own.
CLIP_PARTS = ("visual", "transformer", "token_embedding", "positional_embedding", "ln_final", "text_projection",
              "logit_scale")


def not_openai_clip(state: dict) -> str:
    """The first of CLIP_PARTS that `state` lacks ('' when it has them all). Without it any TorchScript
    archive would be converted, and the file only fail later, as weights that do not fit the reward's CLIP."""
    tops = {key.split(".")[0] for key in state}
    return next((part for part in CLIP_PARTS if part not in tops), "")


def _torchscript_state(path: Path) -> dict:
    """The state dict of a TorchScript archive through torch.jit.load, which unpickles no Python objects but
    runs the archive's TorchScript code (its __setstate__ methods): the caller trusts the file."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`torch.jit.load` is deprecated")
            state = torch.jit.load(str(path), map_location="cpu").state_dict()
    except Exception as e:
        raise ClipLoadError(f"{path} looks like a TorchScript archive (it holds a constants.pkl) but "
                            f"torch.jit.load cannot read it ({type(e).__name__}: {str(e).splitlines()[0]}); "
                            "it is not read any other way: use the original file or a safetensors copy") from None
    for key in ("input_resolution", "context_length", "vocab_size"):  # archive attributes, not weights
        state.pop(key, None)
    return state


def _load_torchscript(model, path: Path) -> None:
    """OpenAI's archive (trusted); its state dict gets the conversions open_clip's own loader applies to it."""
    from open_clip.model import convert_to_custom_text_state_dict, resize_pos_embed, resize_text_pos_embed

    state = _torchscript_state(path)
    if "positional_embedding" in state and not hasattr(model, "positional_embedding"):
        state = convert_to_custom_text_state_dict(state)
    resize_pos_embed(state, model)
    resize_text_pos_embed(state, model)
    model.load_state_dict(state, strict=True)


def _unreadable(e: Exception) -> bool:
    """A read failure (cut short, not a zip, a bad safetensors header), as opposed to weights that do not fit."""
    from safetensors import SafetensorError

    text = str(e)
    return isinstance(e, (SafetensorError, EOFError)) or any(
        s in text for s in ("PytorchStreamReader", "zip archive", "invalid load key", "truncated"))


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def _damaged(path: Path, reason: str) -> str:
    return (f"cannot read the CLIP checkpoint {path}: the file is damaged, cut short or not a checkpoint "
            f"({reason}); copy or download it again")


def image_transform(model):
    """open_clip's eval preprocess for `model` (Resize, CenterCrop, Normalize), applied to float
    `[B, 3, H, W]` tensors in [0, 1]; at the model's own image size the resize and crop are no-ops."""
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2

    return image_transform_v2(PreprocessCfg(**open_clip.get_model_preprocess_cfg(model)), is_train=False)


def image_embeddings(model, images: torch.Tensor) -> torch.Tensor:
    """L2-normalised image embeddings `[B, embed_dim]` of float images `[B, 3, H, W]` in [0, 1]."""
    return model.encode_image(image_transform(model)(images), normalize=True)


def clip_scores(model, tokenizer, images: torch.Tensor, captions: Sequence[str]) -> torch.Tensor:
    """Per-sample cosine similarity `[B]` between image b and caption b (model in eval mode: the
    ResNet tower has BatchNorm)."""
    img = image_embeddings(model, images)  # [B, D]
    txt = model.encode_text(tokenizer(list(captions)).to(images.device), normalize=True)  # [B, D]
    return (img * txt).sum(-1)


# ---------------------------------------------------------------- transformers CLIPModel


@lru_cache(maxsize=None)
def load_hf_clip(model_dir: str, processor_dir: str, device: str = "cpu"):
    """(CLIPModel in eval mode, CLIPProcessor) from local `save_pretrained` directories; cached, so
    rewards that share a model share one copy."""
    from transformers import CLIPModel, CLIPProcessor

    for d in (model_dir, processor_dir):
        if not Path(d).is_dir():
            raise FileNotFoundError(f"transformers CLIP directory not found: {d}")
    try:
        model = CLIPModel.from_pretrained(model_dir).to(device).eval()
        processor = CLIPProcessor.from_pretrained(processor_dir)
    except (OSError, ValueError) as e:  # no config.json / weights / tokenizer files in the directory
        raise ClipLoadError(f"cannot load a CLIPModel from {model_dir} and a CLIPProcessor from "
                            f"{processor_dir}: {e}") from e
    return model, processor


def _pooled(features) -> torch.Tensor:
    """transformers 5 returns a BaseModelOutputWithPooling from get_*_features, 4.x a tensor."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output


def hf_clip_scores(model, processor, images: torch.Tensor, captions: Sequence[str]) -> torch.Tensor:
    """PickScore's formula `[B]`: logit_scale.exp() * cosine(image b, caption b).

    The processor's own resize / crop / normalise run on the tensors where they are (`do_rescale`
    off: the images are already in [0, 1], not 0..255); text is padded and truncated to the model's
    context, as in PickScore's README (`padding=True, truncation=True, max_length=77`).
    """
    pixels = processor.image_processor(images=images, do_rescale=False, return_tensors="pt").pixel_values
    context = model.config.text_config.max_position_embeddings
    text = processor.tokenizer(list(captions), padding=True, truncation=True, max_length=context,
                               return_tensors="pt").to(images.device)
    img = F.normalize(_pooled(model.get_image_features(pixel_values=pixels.to(images.device))), dim=-1)  # [B, D]
    txt = F.normalize(_pooled(model.get_text_features(**text)), dim=-1)  # [B, D]
    return model.logit_scale.exp() * (img * txt).sum(-1)
