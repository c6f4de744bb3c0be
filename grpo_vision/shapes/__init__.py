"""ShapesWorld v1: the embedded, exactly checkable text-to-image world (docs/shapes_world.md).

`scene` samples captions and scenes and renders them; `checker` judges any image against a
caption, attribute by attribute; `plan` writes a scene's layout plan and judges a plan against a caption.
"""

import importlib

# names re-exported from the submodules, loaded on first use (PEP 562), so that importing one
# submodule (the CLI's `world` commands) does not import the checker and scipy
_EXPORTS = {
    "checker": ["ATTRIBUTES", "CheckResult", "check", "find_regions"],
    "plan": ["MAX_PLAN_TOKENS", "PLAN_GRID", "check_plan", "parse_plan", "plan_words", "scene_plan"],
    "scene": ["BACKGROUNDS", "COLORS", "FORMS", "HELD_OUT", "IMAGE_SIZE", "RELATIONS", "SHAPES", "SIZES",
              "CaptionError", "CaptionSpec", "Obj", "Scene", "aesthetic_label", "all_words", "format_caption",
              "is_held_out", "parse_caption", "prompt_list", "render", "sample_scene", "scene_for_caption"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
