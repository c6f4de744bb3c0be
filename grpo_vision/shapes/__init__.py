"""ShapesWorld v1: the embedded, exactly checkable text-to-image world (docs/shapes_world.md).

`scene` samples captions and scenes and renders them; `checker` judges any image against a
caption, attribute by attribute.
"""

from grpo_vision.shapes.checker import ATTRIBUTES, CheckResult, check, find_regions
from grpo_vision.shapes.scene import (
    BACKGROUNDS,
    COLORS,
    FORMS,
    HELD_OUT,
    IMAGE_SIZE,
    RELATIONS,
    SHAPES,
    SIZES,
    CaptionError,
    CaptionSpec,
    Obj,
    Scene,
    aesthetic_label,
    all_words,
    format_caption,
    is_held_out,
    parse_caption,
    prompt_list,
    render,
    sample_scene,
    scene_for_caption,
)

__all__ = [name for name in dir() if not name.startswith("_")]
