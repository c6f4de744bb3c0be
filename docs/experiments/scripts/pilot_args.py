"""What the pilots of docs/experiments/text_plans.md share on their command lines: argparse types that refuse
a bad number in argparse's own two lines (usage, then the error; exit status 2), and the plan world they start
from, refused the same way when it is missing (they read it relative to the repository root)."""
import argparse
import math

PLAN_WORLD = "worlds/shapes_plan"


def count(text: str) -> int:
    """A whole number >= 1 (steps, captions, examples)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be 1 or more")
    return value


def number(low: float, high: float, low_open: bool):
    """A type: a finite number in (low, high] (`low_open`) or [low, high]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"{text} must be a finite number in {'(' if low_open else '['}{low:g}, "
                                             f"{high:g}]")
        return value
    return parse


def relation_captions(ap: argparse.ArgumentParser, n: int) -> list[str]:
    """The training split's relation captions, of which the pilots judge `n` drawn without replacement."""
    from grpo_vision.shapes.scene import all_captions

    captions = all_captions("train", "relation")
    if n > len(captions):
        ap.error(f"argument n_captions: {n} is more than the {len(captions)} relation captions of the training split")
    return captions


def plan_world(ap: argparse.ArgumentParser):
    """worlds/shapes_plan, loaded; a missing or incomplete world is argparse's one-line error, with its fix."""
    from grpo_vision.config import ConfigError
    from grpo_vision.shapes.world import load_world

    try:
        return load_world(PLAN_WORLD)
    except ConfigError as err:  # shapes.world.WorldError: the message says how to build it
        ap.error(f"{err} (the pilots read {PLAN_WORLD} from the repository root: run them from there)")
