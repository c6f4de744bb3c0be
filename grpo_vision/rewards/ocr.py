"""Text rendering: the text a prompt quotes against the text an OCR model reads in the image (Flow-GRPO's reward).

    reward.weights: {ocr: 1.0}                     pip install -e ".[ocr]"
    prompt 'a neon sign that says "Open Late"'     target "openlate"
    score = 1 - min(d, len(target)) / len(target)  in [0, 1]; NaN where the prompt quotes no text

Flow-GRPO's definition (yifan123/flow_grpo at ac4c86e, `flow_grpo/ocr.py`), step by step:
- the target is the text between the prompt's first two `"` (line 31, `prompt.split('"')[1]`);
- what was read is the text of every line the OCR returns, joined with nothing, in its reading order (line 44);
  PaddleOCR has already dropped the lines recognised with a confidence under 0.5 (its `drop_score` default,
  PaddleOCR doc/doc_en/inference_args_en.md): `min_score` here;
- both lose every space ' ' and are lower-cased (lines 46-47);
- d = 0 when the target occurs inside what was read (lines 48-49: other text around the right words costs
  nothing), else the Levenshtein distance between the two (line 51: insert, delete, substitute, 1 each);
- d is clipped at len(target) (lines 53-54), so a long wrong reading scores 0, never below;
- score = 1 - d / len(target) (line 60).

Where this reward differs, and why: a prompt without a closed pair of quote marks, or with nothing but spaces
between them, scores NaN, "does not apply" (rewards/base.py); there `split('"')[1]` raises, or takes the rest of
the prompt after a lone quote, and an empty target divides by zero. A failure raises, naming the reward (their
lines 56-59 score it 0 and print). The model is PP-OCRv4 detection and recognition as the ONNX files inside the
rapidocr-onnxruntime 1.4.4 wheel (the Chinese-and-English `ch_PP-OCRv4_rec`; Flow-GRPO runs PaddleOCR 2.9.1 with
`lang="en"`: `det_model`, `rec_model` take other PP-OCR ONNX files), without the angle classifier
(`use_angle_cls=False` there too), detecting at the image's own size up to 960 px a side (PaddleOCR's
`det_limit_side_len=960, det_limit_type='max'`; RapidOCR's own default enlarges the short side to 736, about five
times slower on a 256-px image). Images go to it as BGR uint8, OpenCV's order, which both libraries read
(Flow-GRPO hands PaddleOCR RGB arrays).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from grpo_vision.config import ConfigError
from grpo_vision.images import to_uint8
from grpo_vision.rewards.base import RewardContext, RewardFn, register_reward
from grpo_vision.rewards.models import _local_path

KEY = "reward.options.ocr"
INSTALL = 'pip install -e ".[ocr]"'
DETECT_SIDE = 960  # PaddleOCR's det_limit_side_len: a longer side is scaled down to it, a shorter one kept


@dataclass
class OcrOptions:
    quote: str = '"'  # the mark that opens the text to render (Flow-GRPO: a straight double quote)
    close_quote: str = ""  # the mark that closes it; "" = the same as quote (e.g. quote '“', close_quote '”')
    case_sensitive: bool = False  # compare letter case too (Flow-GRPO lower-cases both texts)
    keep_spaces: bool = False  # compare spaces too (Flow-GRPO removes them from both texts)
    min_score: float = 0.5  # drop lines recognised with a lower confidence (PaddleOCR's drop_score)
    det_model: str = ""  # a local PP-OCR text-detection ONNX file; "" = the one inside rapidocr-onnxruntime
    rec_model: str = ""  # a local PP-OCR recognition ONNX file; "" = the one inside rapidocr-onnxruntime
    rec_keys: str = ""  # its character list, one per line; "" = the list stored in rec_model's metadata
    threads: int = 0  # ONNX Runtime threads per model; 0 = its default (every core)

    def __post_init__(self):  # checked as the config loads (`grpo-vision config`), before any model
        if not self.quote:
            raise ConfigError(f"{KEY}.quote is empty: give the mark that opens the text to render, e.g. '\"'")
        if not 0.0 <= self.min_score <= 1.0:
            raise ConfigError(f"{KEY}.min_score={self.min_score} is not a confidence in [0, 1] (PaddleOCR's is 0.5)")
        if self.threads < 0:
            raise ConfigError(f"{KEY}.threads={self.threads}: give a thread count, or 0 for ONNX Runtime's default")
        if self.rec_keys and not self.rec_model:
            raise ConfigError(f"{KEY}.rec_keys is given without rec_model: the packaged model has its own list")


def quoted_text(prompt: str, quote: str = '"', close_quote: str = "") -> str | None:
    """The text between the first `quote` of `prompt` and the next `close_quote` (default `quote`); None where
    the prompt has no such pair."""
    start = prompt.find(quote)
    if start < 0:
        return None
    end = prompt.find(close_quote or quote, start + len(quote))
    return None if end < 0 else prompt[start + len(quote):end]


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions from a to b."""
    row = list(range(len(b) + 1))  # distances from a[:0] to every prefix of b
    for i, x in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (x != y))
    return row[-1]


def normalise(text: str, case_sensitive: bool = False, keep_spaces: bool = False) -> str:
    """Flow-GRPO's comparison form: spaces removed and lower case (ocr.py lines 46-47), unless kept."""
    text = text if keep_spaces else text.replace(" ", "")
    return text if case_sensitive else text.lower()


def text_score(read: str, target: str) -> float:
    """1 - min(d, len(target)) / len(target) of two normalised texts, d = 0 when target occurs in read (module
    docstring); NaN for an empty target (nothing to render)."""
    if not target:
        return float("nan")
    d = 0 if target in read else min(edit_distance(read, target), len(target))
    return 1.0 - d / len(target)


def to_bgr(images: torch.Tensor) -> list:
    """`[B, 3, H, W]` floats in [0, 1] as B uint8 `[H, W, 3]` arrays in BGR order (OpenCV's), rounded as a PNG
    stores them (`to_uint8`), which is how Flow-GRPO rounds."""
    return [np.ascontiguousarray(a[..., ::-1]) for a in to_uint8(images.detach().float())]  # B x [H, W, 3], BGR


@lru_cache(maxsize=None)
def _engine(det_model: str, rec_model: str, rec_keys: str, threads: int):
    """A RapidOCR pipeline (detection, recognition; no angle classifier), cached per files and threads. It keeps
    every line (text_score 0) and the reward filters by its own min_score, so one engine serves every setting."""
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as e:  # its opencv-python wheel links the system's libGL and libglib, absent on a bare server
        raise RuntimeError(f"rapidocr-onnxruntime did not import ({type(e).__name__}: {e}); if OpenCV lacks a system "
                           "library, install it (Debian: apt-get install libgl1 libglib2.0-0) or swap in OpenCV's "
                           "headless build: pip uninstall -y opencv-python && pip install opencv-python-headless") \
            from None
    files = {"det_model_path": det_model, "rec_model_path": rec_model, "rec_keys_path": rec_keys}
    try:
        return RapidOCR(use_cls=False, text_score=0.0, det_limit_type="max", det_limit_side_len=DETECT_SIDE,
                        **({"intra_op_num_threads": threads, "inter_op_num_threads": 1} if threads else {}),
                        **{k: v for k, v in files.items() if v})
    except Exception as e:  # a damaged ONNX file, or a recognition model without a character list
        given = ", ".join(f"{k}={v}" for k, v in files.items() if v) or "the files inside rapidocr-onnxruntime"
        raise RuntimeError(f"the OCR model ({given}) did not load ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:300]})") from None


def read_text(engine, image, min_score: float) -> str:
    """The lines the OCR reads in one BGR uint8 `[H, W, 3]` image with a confidence of at least `min_score`,
    joined with nothing in its reading order (top to bottom, left to right)."""
    lines, _ = engine(image)
    return "".join(text for _, text, score in lines or () if float(score) >= min_score)


def _check(opts: OcrOptions) -> dict[str, str]:
    """The model files given, as existing paths (ConfigError naming a missing one), once the package is found."""
    files = {}
    for key, what in (("det_model", "a PP-OCR text-detection ONNX file"),
                      ("rec_model", "a PP-OCR text-recognition ONNX file"),
                      ("rec_keys", "the recognition model's character list, one per line")):
        if value := getattr(opts, key):
            files[key] = str(_local_path(value, f"{KEY}.{key}", "ocr", what))
    if importlib.util.find_spec("rapidocr_onnxruntime") is None:
        raise ConfigError(f"reward 'ocr' needs the rapidocr-onnxruntime package (PP-OCRv4 on ONNX Runtime), which is "
                          f"not installed: {INSTALL}")
    return files


@register_reward("ocr", options=OcrOptions)
def ocr_reward(ctx: RewardContext, opts: OcrOptions) -> RewardFn:
    """Flow-GRPO's OCR reward: 1 - normalised edit distance between the prompt's quoted text and the text read in
    the image (module docstring); NaN for a prompt that quotes none. It runs on the CPU whatever ctx.device is."""
    files = _check(opts)
    load = lambda: _engine(files.get("det_model", ""), files.get("rec_model", ""),  # noqa: E731
                           files.get("rec_keys", ""), opts.threads)

    def reward(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        if images.dim() != 4 or images.shape[1] != 3:  # checked whether or not a prompt quotes text
            raise ValueError(f"images must be [B, 3, H, W] RGB in [0, 1], got shape {list(images.shape)}")
        if len(prompts) != len(images):
            raise ValueError(f"{len(images)} images for {len(prompts)} prompts")
        targets = [quoted_text(p, opts.quote, opts.close_quote) for p in prompts]
        targets = [None if t is None else normalise(t, opts.case_sensitive, opts.keep_spaces) for t in targets]
        scores = torch.full((len(prompts),), float("nan"))  # [B]; NaN: the prompt quotes no text
        pending = [i for i, t in enumerate(targets) if t]
        if pending:
            engine, arrays = load(), to_bgr(images[pending])
            for i, image in zip(pending, arrays):
                read = normalise(read_text(engine, image, opts.min_score), opts.case_sensitive, opts.keep_spaces)
                scores[i] = text_score(read, targets[i])
        return scores

    reward.load = load
    return reward

