"""The models behind the `geneval` reward, from local files: object detectors and the colour classifier.

A detector is anything with

    detect(images: Tensor[B, 3, H, W] in [0, 1], classes: list[list[str]]) -> list[dict[str, list[Detection]]]

per image, per class name it was asked for: boxes in pixels (x0, y0, x1, y1), the detector's confidence,
and a [H, W] bool mask where the model gives one. Unsorted and unthresholded: `geneval.kept` applies
GenEval's thresholds and order. `classes[b]` are the names image b's prompt metadata uses; an
open-vocabulary detector queries exactly those, a closed-set one maps them onto its own classes.

* `Mask2FormerDetector`: GenEval's choice (mmdet's Mask2Former Swin-S on COCO), here a transformers
  `Mask2FormerForUniversalSegmentation` directory; instances from the image processor's
  `post_process_instance_segmentation` (top `num_queries` of query x class, score = class probability
  x mean mask probability, as mmdet), each box read off its mask as mmdet's `mask2bbox` does. (That
  post-processing resizes the masks to 384 x 384 before the image's size: right for square images.)
  Class names are matched to `config.id2label` ignoring case, with '_' and '-' read as spaces, and
  with GenEval's three renames of COCO classes (its object_names.txt says "computer mouse", "tv
  remote", "computer keyboard" where COCO says "mouse", "remote", "keyboard").
* `Owlv2Detector`: an open-vocabulary detector (Minderer et al. 2023), queried with "a photo of a
  {class}"; boxes from `post_process_object_detection` at threshold 0, clamped to the image; no masks.
* `ColourClassifier`: GenEval's colour check (`color_classification` in its evaluate_images.py), a CLIP
  zero-shot classifier over `COLORS` with three templates per colour, on each detection's crop: the
  image over a #999 grey through the mask where there is one, cut to the box (rounded as PIL's crop
  rounds). The crop is resized as open_clip's eval transform does on tensors (antialiased), where
  GenEval resizes a PIL image: a rounding apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from grpo_vision.rewards.clip import image_transform
from grpo_vision.rewards.geneval import COLORS, Box, Detection

# GenEval's object_names.txt (rewards/geneval_data/) is COCO's 80 classes in mmdet's order, three renamed
GENEVAL_RENAMES = {"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}
OWL_QUERY = "a photo of a {}"  # OWL-ViT's and OWLv2's own prompt template for text queries
COLOUR_TEMPLATES = ("a photo of a {c} {classname}", "a photo of a {c}-colored {classname}", "a photo of a {c} object")
GREY = 0x99 / 255  # GenEval's crop background, "#999"


class Detector(Protocol):
    def detect(self, images: torch.Tensor, classes: Sequence[Sequence[str]]) -> list[dict[str, list[Detection]]]:
        ...


class DetectorLoadError(RuntimeError):
    """A detector directory that transformers cannot load (missing weights or processor files)."""


def class_key(name: str) -> str:
    """How class names are compared: lower case, '_' and '-' as spaces, single spaces."""
    return " ".join(name.lower().replace("_", " ").replace("-", " ").split())


def model_type(path: str | Path) -> str:
    """The `model_type` in a transformers directory's config.json; "" when there is none to read."""
    try:
        return str(json.loads((Path(path) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def mask_box(mask: torch.Tensor) -> Box:
    """The box of a [H, W] bool mask as mmdet's `mask2bbox`: first pixel, and one past the last, on each axis."""
    xs, ys = mask.any(0).nonzero().flatten(), mask.any(1).nonzero().flatten()
    if len(xs) == 0:
        return (0.0, 0.0, 0.0, 0.0)
    return (float(xs[0]), float(ys[0]), float(xs[-1] + 1), float(ys[-1] + 1))


def _first_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]


class Mask2FormerDetector:
    """Closed-set instance segmentation; `config.id2label` are its classes (COCO's 80 for GenEval's)."""

    def __init__(self, path: str, device: str = "cpu"):
        from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation

        try:
            self.model = Mask2FormerForUniversalSegmentation.from_pretrained(path, local_files_only=True)
            self.processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise DetectorLoadError(f"cannot load a Mask2Former and its image processor from {path}: "
                                    f"{_first_line(e)}") from None
        self.model = self.model.to(device).eval()
        self.path, self.device = path, device
        self.labels = {class_key(v): int(k) for k, v in self.model.config.id2label.items()}  # name -> label id

    def label_id(self, name: str) -> int:
        key = class_key(name)
        key = key if key in self.labels else GENEVAL_RENAMES.get(key, key)
        if key not in self.labels:
            import difflib

            close = difflib.get_close_matches(key, list(self.labels), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"class {name!r} is not one of the {len(self.labels)} classes of the Mask2Former "
                             f"detector {self.path} (its config's id2label){hint}: use its class names (matched "
                             "ignoring case, '_' and '-'), or reward.options.geneval.detector=owlv2, which reads "
                             "any class")
        return self.labels[key]

    @torch.no_grad()
    def detect(self, images: torch.Tensor, classes: Sequence[Sequence[str]]) -> list[dict[str, list[Detection]]]:
        wanted = [{name: self.label_id(name) for name in names} for names in classes]  # unknown names fail first
        H, W = images.shape[-2:]
        inputs = self.processor(images=images.float(), do_rescale=False, return_tensors="pt")
        out = self.model(pixel_values=inputs["pixel_values"].to(self.device),
                         pixel_mask=inputs["pixel_mask"].to(self.device) if "pixel_mask" in inputs else None)
        # on the CPU: transformers' post-processing writes its segment map into a CPU tensor
        raw = SimpleNamespace(class_queries_logits=out.class_queries_logits.float().cpu(),  # [B, Q, classes + 1]
                              masks_queries_logits=out.masks_queries_logits.float().cpu())  # [B, Q, h, w]
        results = self.processor.post_process_instance_segmentation(
            raw, threshold=0.0, target_sizes=[(H, W)] * len(images), return_binary_maps=True)
        found = []
        for result, names in zip(results, wanted):
            by_label: dict[int, list[Detection]] = {}
            for j, segment in enumerate(result["segments_info"]):
                mask = result["segmentation"][j].bool()  # [H, W]
                by_label.setdefault(segment["label_id"], []).append(
                    Detection(mask_box(mask), float(segment["score"]), mask))
            found.append({name: by_label.get(label, []) for name, label in names.items()})
        return found


class Owlv2Detector:
    """Open-vocabulary detection: every class name is a text query, so any name is read."""

    def __init__(self, path: str, device: str = "cpu"):
        from transformers import Owlv2ForObjectDetection, Owlv2Processor

        try:
            self.model = Owlv2ForObjectDetection.from_pretrained(path, local_files_only=True)
            self.processor = Owlv2Processor.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            raise DetectorLoadError(f"cannot load an OWLv2 detector and its processor from {path}: "
                                    f"{_first_line(e)}") from None
        self.model = self.model.to(device).eval()
        self.path, self.device = path, device

    @torch.no_grad()
    def detect(self, images: torch.Tensor, classes: Sequence[Sequence[str]]) -> list[dict[str, list[Detection]]]:
        H, W = images.shape[-2:]
        side = max(H, W)  # OWLv2 pads each image to a square (bottom and right): boxes are fractions of it
        queries = [[OWL_QUERY.format(name) for name in names] for names in classes]
        inputs = self.processor(text=queries, images=images.float(), do_rescale=False, truncation=True,
                                return_tensors="pt").to(self.device)
        out = self.model(**inputs)  # logits [B, patches, most queries], pred_boxes [B, patches, 4]
        found = []
        for b, names in enumerate(classes):
            # A query's logits depend on that query alone, so the processor's padding queries (" ") of a
            # shorter list are dropped here and image b is scored on exactly its own classes.
            own = SimpleNamespace(logits=out.logits[b:b + 1, :, :len(names)].float(),
                                  pred_boxes=out.pred_boxes[b:b + 1].float())
            r = self.processor.image_processor.post_process_object_detection(own, threshold=0.0,
                                                                             target_sizes=[(side, side)])[0]
            limit = torch.tensor([W, H, W, H], dtype=r["boxes"].dtype, device=r["boxes"].device)
            boxes = torch.minimum(r["boxes"].clamp(min=0), limit)  # [N, 4], inside the image
            per_class: dict[str, list[Detection]] = {name: [] for name in names}
            for box, score, label in zip(boxes.tolist(), r["scores"].tolist(), r["labels"].tolist()):
                per_class[names[label]].append(Detection(tuple(box), score))
            found.append(per_class)
        return found


DETECTORS = {"mask2former": Mask2FormerDetector, "owlv2": Owlv2Detector}  # option value -> class
MODEL_TYPES = {"mask2former": "mask2former", "owlv2": "owlv2"}  # option value -> config.json's model_type


class ColourClassifier:
    """GenEval's colour of each detection: CLIP zero-shot over COLORS on its masked crop.

    The classifier of a class is clip_benchmark's `zero_shot_classifier`, as GenEval calls it: per
    colour, the mean of the three templates' normalised text embeddings, renormalised; cached per class.
    """

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.transform = image_transform(model)
        self.device = next(model.parameters()).device
        self._text: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def text_classifier(self, classname: str) -> torch.Tensor:
        """[len(COLORS), D] unit text embeddings of `classname`'s colours."""
        if classname not in self._text:
            texts = [t.format(c=c, classname=classname) for c in COLORS for t in COLOUR_TEMPLATES]
            emb = self.model.encode_text(self.tokenizer(texts).to(self.device)).float()  # [C * T, D]
            mean = F.normalize(emb, dim=-1).view(len(COLORS), len(COLOUR_TEMPLATES), -1).mean(1)  # [C, D]
            self._text[classname] = F.normalize(mean, dim=-1)
        return self._text[classname]

    def crops(self, image: torch.Tensor, detections: Sequence[Detection]) -> list[torch.Tensor]:
        """Each detection's [3, h, w] crop of `image` [3, H, W]: over grey through its mask, cut to its box."""
        H, W = image.shape[-2:]
        out = []
        for d in detections:
            x = image if d.mask is None else torch.where(torch.as_tensor(d.mask, device=image.device).bool(),
                                                         image, torch.full_like(image, GREY))
            x0, y0, x1, y1 = (int(round(v)) for v in d.box)  # PIL's crop rounds a float box the same way
            x0, y0 = min(max(x0, 0), W - 1), min(max(y0, 0), H - 1)
            x1, y1 = min(max(x1, x0 + 1), W), min(max(y1, y0 + 1), H)  # at least one pixel
            out.append(x[:, y0:y1, x0:x1])
        return out

    @torch.no_grad()
    def __call__(self, image: torch.Tensor, classname: str, detections: Sequence[Detection]) -> list[str]:
        """The colour (one of COLORS) of each detection of `classname` in `image` [3, H, W] in [0, 1]."""
        if not detections:
            return []
        image = image.to(self.device).float()
        x = torch.cat([self.transform(c[None]) for c in self.crops(image, detections)])  # [N, 3, S, S]
        img = F.normalize(self.model.encode_image(x).float(), dim=-1)  # [N, D]
        return [COLORS[i] for i in (img @ self.text_classifier(classname).T).argmax(1).tolist()]
