"""The `geneval` reward: GenEval's verdict on each image (Ghosh et al. 2023), from local models.

    reward.weights: {geneval: 1.0}
    reward.options.geneval:
      detector: mask2former              # GenEval's (closed-set COCO) | owlv2 (open vocabulary)
      detector_path: /models/mask2former-swin-small-coco-instance
      clip_checkpoint: /models/clip/ViT-L-14.safetensors   # the colour classifier (GenEval: OpenAI ViT-L/14)

Each prompt's requirements are its JSONL metadata in GenEval's format (`tag`, `include`, `exclude`,
as in evaluation_metadata.jsonl; rewards/geneval.py). Per chunk of reward.batch_size images on the
reward's device: the detector finds the classes the metadata names (rewards/detectors.py), `kept`
applies GenEval's thresholds, `judge` its clauses, asking the colour classifier only for a colour
clause whose objects were found. The value is GenEval's 1 / 0, or with `partial: true` the fraction
of clauses met (so that a group whose images all fail still has a spread); NaN ("does not apply") for
a prompt whose metadata has no GenEval fields, an entry routed to other rewards: the run's set-up
refuses such a prompt where this reward counts for it (CompositeReward.check). Each call's verdicts,
with the reasons of every failing clause, stay on the reward as `last_verdicts` (and as `last_reasons`,
the (kind, reason) pairs the report and the demo read); `verdicts(images, prompts, metadata)` returns
them without the scores.

Models load at the first call (or CompositeReward.load), cached per (path, device); the colour CLIP
is the aesthetic and clip rewards' open_clip cache (rewards/models.py), so one ViT-L/14 is loaded once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch

from grpo_vision.config import ConfigError, brief
from grpo_vision.rewards.base import RewardContext, RewardFn, register_reward
from grpo_vision.rewards.detectors import DETECTORS, MODEL_TYPES, ColourClassifier, Detector, model_type
from grpo_vision.rewards.geneval import GenEvalRules, Verdict, check_metadata, judge, kept
from grpo_vision.rewards.models import _clip_spec, _local_path, _open_clip

KEY = "reward.options.geneval."
WHAT = {"mask2former": "a transformers Mask2Former instance-segmentation directory (save_pretrained of "
                       "facebook/mask2former-swin-small-coco-instance and its image processor)",
        "owlv2": "a transformers OWLv2 directory (save_pretrained of google/owlv2-base-patch16-ensemble and its "
                 "processor)"}


@dataclass
class GenEvalOptions:
    detector: str = "mask2former"  # mask2former (GenEval's, COCO's 80 classes) or owlv2 (any class, as a text query)
    detector_path: str = ""  # the detector's local transformers directory: model and (image) processor
    clip_model: str = ""  # the colour classifier's open_clip architecture; "" = ViT-L-14-quickgelu (GenEval's)
    clip_checkpoint: str = ""  # its local checkpoint file; "" = none, and a colour clause is an error
    trust_torchscript: bool = False  # load clip_checkpoint even if it is a TorchScript archive, which runs code
    threshold: float = 0.3  # a detection counts above this confidence (GenEval's --options, its values)
    counting_threshold: float = 0.9  # ... and above this one for a `counting` prompt
    max_objects: int = 16  # the most confident boxes a class keeps
    max_overlap: float = 1.0  # NMS IoU within a class; 1.0 = off (GenEval's default)
    position_threshold: float = 0.1  # the margin of a relation, in units of the two boxes' extents
    partial: bool = False  # false: 1 / 0 per image (GenEval's score); true: the fraction of clauses met


def _detector_dir(opts: GenEvalOptions) -> Path:
    """The detector directory, checked now: it exists and holds the kind of model `detector` names."""
    if opts.detector not in DETECTORS:
        raise ConfigError(f"{KEY}detector={brief(opts.detector)} is not a detector; choose mask2former (GenEval's, "
                          "closed-set COCO) or owlv2 (open vocabulary)")
    path = _local_path(opts.detector_path, KEY + "detector_path", "geneval", WHAT[opts.detector], directory=True)
    found = model_type(path)
    if found != MODEL_TYPES[opts.detector]:
        other = next((name for name, t in MODEL_TYPES.items() if t == found), None)
        held = f"a {found!r} model" if found else "no readable config.json"
        fix = (f"set {KEY}detector={other}" if other else
               f"point {KEY}detector_path at {WHAT[opts.detector]}")
        raise ConfigError(f"reward 'geneval': {KEY}detector_path={path} holds {held}, not what {KEY}detector="
                          f"{opts.detector} reads: {fix}")
    return path


@lru_cache(maxsize=None)
def load_detector(kind: str, path: str, device: str) -> Detector:
    return DETECTORS[kind](path, device)


@lru_cache(maxsize=None)
def load_colour_classifier(name: str, checkpoint: str, device: str, trust_torchscript: bool) -> ColourClassifier:
    model, _, tokenizer = _open_clip(name, checkpoint, device, trust_torchscript)
    return ColourClassifier(model, tokenizer)


class GenEvalReward:
    """`(images [B, 3, H, W] in [0, 1], prompts, metadata) -> Tensor[B]`: GenEval's score of each image."""

    def __init__(self, ctx: RewardContext, opts: GenEvalOptions):
        self.kind, self.path = opts.detector, str(_detector_dir(opts))
        self.clip = None  # (architecture, checkpoint) of the colour CLIP, when one is given
        if opts.clip_checkpoint:
            self.clip = _clip_spec(opts.clip_model, opts.clip_checkpoint, (KEY + "clip_model", KEY + "clip_checkpoint"),
                                   "geneval")
        rule_fields = {f.name for f in fields(GenEvalRules)}
        self.rules = GenEvalRules(**{k: getattr(opts, k) for k in rule_fields})
        problems = [(0 <= self.rules.threshold < 1, "threshold must be in [0, 1)"),
                    (0 <= self.rules.counting_threshold < 1, "counting_threshold must be in [0, 1)"),
                    (self.rules.max_objects >= 1, "max_objects must be >= 1"),
                    (0 < self.rules.max_overlap <= 1, "max_overlap must be in (0, 1] (1 = no suppression)"),
                    (self.rules.position_threshold >= 0, "position_threshold must be >= 0")]
        for ok, message in problems:
            if not ok:
                raise ConfigError(f"{KEY}{message}")
        self.partial, self.trust = opts.partial, opts.trust_torchscript
        self.device, self.batch_size = str(ctx.device), ctx.batch_size
        self.last_verdicts: list[Verdict | None] = []  # the last call's verdict per image (None: n/a)
        self.last_reasons: list[list[tuple[str, str]]] = []  # per image, (kind, reason) of each failing clause

    def detector(self) -> Detector:
        return load_detector(self.kind, self.path, self.device)

    def colours(self) -> ColourClassifier | None:
        return None if self.clip is None else load_colour_classifier(*self.clip, self.device, self.trust)

    def load(self) -> None:
        """Build the detector and the colour classifier now (CompositeReward.load calls this before a run)."""
        self.detector()
        self.colours()

    def check(self, prompts: Sequence[str], metadata: Sequence[dict]) -> None:
        """Every prompt carries GenEval metadata, and a colour clause has a classifier to read it."""
        for prompt, meta in zip(prompts, metadata):
            try:
                check_metadata(meta, f"prompt {brief(prompt)}")
            except ValueError as e:
                raise ValueError(f"{e}: the geneval reward reads each prompt's clauses from its metadata; train on "
                                 'a JSONL prompts file whose lines carry them ({"prompt": "a photo of a dog", '
                                 '"metadata": {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}})'
                                 ) from None
            colour = next((c for c in meta["include"] if "color" in c), None)
            if colour is not None and self.clip is None:
                raise ValueError(f"prompt {brief(prompt)} asks for a {colour['color']} {colour['class']}, and the "
                                 f"geneval reward has no colour classifier: set {KEY}clip_checkpoint (a local open_clip "
                                 f"checkpoint; GenEval uses OpenAI's ViT-L/14) and {KEY}clip_model")

    @torch.no_grad()
    def verdicts(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> list[Verdict]:
        """GenEval's verdict on each image, in chunks of reward.batch_size on the reward's device."""
        self.check(prompts, metadata)
        detector, classifier = self.detector(), self.colours()
        out: list[Verdict] = []
        for i in range(0, len(prompts), self.batch_size):
            chunk = images[i:i + self.batch_size].to(self.device).float()  # [b, 3, H, W]
            metas = metadata[i:i + self.batch_size]
            classes = [list(dict.fromkeys(c["class"] for c in [*m["include"], *m.get("exclude", [])])) for m in metas]
            for image, found, meta in zip(chunk, detector.detect(chunk, classes), metas):
                colours = None if classifier is None else (
                    lambda name, boxes, image=image: classifier(image, name, boxes))
                out.append(judge(kept(found, meta["tag"], self.rules), meta, colours, self.rules))
        return out

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        """GenEval's score per image; NaN ("does not apply") for a prompt whose metadata has no GenEval
        fields at all, an entry routed to other rewards (CompositeReward.check refuses such a prompt
        where this reward counts); metadata with GenEval fields that the rules cannot read is an error."""
        rows = [i for i, m in enumerate(metadata) if isinstance(m, dict) and ("tag" in m or "include" in m)]
        found = self.verdicts(images[rows], [prompts[i] for i in rows], [metadata[i] for i in rows]) if rows else []
        self.last_verdicts = [None] * len(prompts)  # Verdict per image; None where the reward does not apply
        for i, v in zip(rows, found):
            self.last_verdicts[i] = v
        self.last_reasons = [list(zip(v.failures, v.reasons)) if v else [] for v in self.last_verdicts]  # base.py
        return torch.tensor([math.nan if v is None else v.partial if self.partial else float(v.correct)
                             for v in self.last_verdicts], dtype=torch.float32)  # [B]


@register_reward("geneval", options=GenEvalOptions)
def geneval_reward(ctx: RewardContext, opts: GenEvalOptions) -> RewardFn:
    """GenEval's 1 / 0 (or its fraction of clauses met) per image; see the module docstring."""
    return GenEvalReward(ctx, opts)
