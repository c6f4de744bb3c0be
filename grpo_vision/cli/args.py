"""argparse types of the command line: each refuses a bad value with a message naming what it expects."""

from __future__ import annotations

import argparse
import math
import typing

from grpo_vision.config import DEVICE_HINT, DEVICE_NAME, MAX_SEED, SampleConfig
from grpo_vision.config.load import brief

# sample.decode's paths (sampling/decode.py DECODERS), read from the config's own list: the parser imports no torch
DECODE_PATHS = [d for d in typing.get_args(typing.get_type_hints(SampleConfig)["decode"]) if d != "auto"]


def _whole(text: str, low: int, why: str = "", high: int | None = None) -> int:
    """`text` as a whole number in [low, high], or the error argparse prints under the option's name."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"from {low} to {high}"
        raise argparse.ArgumentTypeError(f"expected a whole number {span}{why}, got {brief(text)}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (images per prompt, benchmark repeats)."""
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0 (warm-up steps)."""
    return _whole(text, 0)


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers: 8,16."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers like 8,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected whole numbers of at least 1, got {text!r}")
    return values


def draft_tree(text: str) -> tuple[int, int]:
    """argparse type of a speculative draft tree, C,D: C drafts at each of the first D positions (1,0: a chain)."""
    parts = text.split(",")
    try:
        candidates, branching = (int(x) for x in parts)
    except ValueError:
        candidates = branching = -1
    if candidates < 1 or branching < 0:
        raise argparse.ArgumentTypeError(f"expected C,D (C >= 1 drafts at each of the first D >= 0 positions; 1,0 "
                                         f"is a chain) like 4,1, got {brief(text)}")
    return candidates, branching


def name_list(names, what: str):
    """argparse type of comma-separated names out of `names` (decode paths: eager,static), each once, in order."""
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",")]
        if not text.strip() or any(v not in names for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated {what} from {', '.join(names)}, "
                                             f"got {brief(text)}")
        return list(dict.fromkeys(values))
    return parse


MAX_GPU_GIB = 4096  # no one GPU holds more; a larger budget is a typo (10**400 was an OverflowError in `plan`)


def gib_list(text: str) -> list[float]:
    """Comma-separated GPU memory budgets in GiB, each finite, > 0 and at most MAX_GPU_GIB: 24,48,79.6."""
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and 0 < value <= MAX_GPU_GIB):
            raise argparse.ArgumentTypeError(f"expected comma-separated GiB from above 0 to {MAX_GPU_GIB}, like "
                                             f"24,48,79.6 (nvidia-smi's memory.total in MiB / 1024), got {brief(text)}")
        values.append(value)
    return values


def at_least_two(text: str) -> int:
    """argparse type: a whole number >= 2 (a round's first step is not timed)."""
    return _whole(text, 2, " (the first step is a warm-up)")


def seed(text: str) -> int:
    """argparse type: an image seed, 0 to MAX_SEED (a larger one was an OverflowError deep in torch)."""
    return _whole(text, 0, high=MAX_SEED)


def device(text: str) -> str:
    """argparse type: a device name, or `run` (whether this machine has it is checked when the model loads)."""
    if text != "run" and not DEVICE_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected run (the run's own device where this machine has it), "
                                         f"{DEVICE_HINT}, got {brief(text)}")
    return text


def port(text: str) -> int:
    """argparse type: a TCP port, 1 to 65535 (a larger one was an OverflowError inside the server)."""
    return _whole(text, 1, high=65535)


def _finite(text: str, ok, span: str) -> float:
    """`text` as a finite number for which `ok` holds (NaN passes no range test and inf passes `> 0`)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"expected a number {span}, got {brief(text)}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a sampling temperature)."""
    return _finite(text, lambda v: v > 0, "> 0")


def cfg_scale(text: str) -> float:
    """argparse type: a classifier-free guidance scale, a finite number >= 0 (1 turns guidance off)."""
    return _finite(text, lambda v: v >= 0, ">= 0 (1 turns guidance off)")
