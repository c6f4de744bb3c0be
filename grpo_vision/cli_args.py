"""argparse types of the command line: each refuses a bad value with a message naming what it expects."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (images per prompt, benchmark repeats)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0 (warm-up steps)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def at_least_two(text: str) -> int:
    """argparse type: a whole number >= 2 (a round's first step is not timed)."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 2 (the first step is a warm-up), got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a sampling temperature)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value
