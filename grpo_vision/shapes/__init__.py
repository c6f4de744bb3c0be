"""ShapesWorld v1: the embedded, exactly checkable text-to-image world (docs/shapes_world.md).

scene.py holds captions, scenes and the renderer, and layout.py samples a scene for a caption; checker.py
judges any image against a caption, attribute by attribute, and judge.py is it as the core's judge, rewards.py as
rewards; plan.py writes a scene's layout plan and judges a plan against a caption; world.py checks and loads a
world folder, data.py batches renders for the builder (build/); plugin.py registers the world with the core,
commands.py adds `grpo-vision world`, render_prompts.py its `render`, bench.py its checker benchmark.
"""

import importlib

# names re-exported from the submodules, loaded on first use (PEP 562), so that importing one
# submodule (the CLI's `world` commands) does not import the checker and scipy
_EXPORTS = {
    "checker": ["ATTRIBUTES", "CheckResult", "check", "find_regions"],
    "layout": ["sample_scene", "scene_for_caption"],
    "plan": ["MAX_PLAN_TOKENS", "PLAN_GRID", "check_plan", "parse_plan", "plan_words", "scene_plan"],
    "scene": ["BACKGROUNDS", "COLORS", "FORMS", "HELD_OUT", "IMAGE_SIZE", "RELATIONS", "SHAPES", "SIZES",
              "CaptionError", "CaptionSpec", "Obj", "Scene", "aesthetic_label", "all_words", "format_caption",
              "is_held_out", "parse_caption", "prompt_list", "render"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
