"""Plugins: packages that add policy kinds, rewards and commands through entry points.

A plugin is a module named under the `grpo_vision.plugins` entry point of an installed package;
importing it registers what it brings with `register_policy_kind` and `register_reward`. Commands
come from a second group, `grpo_vision.commands`: each entry is a function `add(subparsers)`, kept
apart so that `grpo-vision --help` never imports a plugin's models. ShapesWorld is one such plugin:

    [project.entry-points."grpo_vision.plugins"]
    shapes = "grpo_vision.shapes.plugin"
    [project.entry-points."grpo_vision.commands"]
    world = "grpo_vision.shapes.commands:add_commands"

Plugins load on demand: only when a name is looked up that no registry holds yet, so a run that
uses built-in kinds and rewards imports no plugin at all. The built-in policy kinds (models/kinds.py)
register the same way, from `BUILT_IN`, before any installed plugin: the core names no model.
"""

from __future__ import annotations

import warnings
import importlib
from importlib.metadata import entry_points

PLUGINS = "grpo_vision.plugins"
COMMANDS = "grpo_vision.commands"
BUILT_IN = ("grpo_vision.models.kinds",)  # registered first, on the first lookup: llama, janus
_loaded = False
_built_in = False


def load_built_in() -> None:
    """Register the built-in policy kinds (their modules import torch, so not before a kind is asked for)."""
    global _built_in
    if not _built_in:
        _built_in = True
        for module in BUILT_IN:
            importlib.import_module(module)


def load_plugins() -> None:
    """Import every installed plugin once; a plugin that fails to import is skipped with a warning."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for entry in entry_points(group=PLUGINS):
        try:
            entry.load()
        except Exception as e:  # a broken third-party plugin must not take the built-in kinds down with it
            warnings.warn(f"plugin {entry.name!r} ({entry.value}) did not load: {type(e).__name__}: {e}",
                          _category(), stacklevel=2)


def command_adders() -> list:
    """The `add(subparsers)` functions of installed plugins, in name order."""
    adders = []
    for entry in sorted(entry_points(group=COMMANDS), key=lambda e: e.name):
        try:
            adders.append(entry.load())
        except Exception as e:
            warnings.warn(f"command plugin {entry.name!r} ({entry.value}) did not load: {type(e).__name__}: {e}",
                          _category(), stacklevel=2)
    return adders


def not_found_hint() -> str:
    """What to tell a user whose name was not found in any registry."""
    return (f"plugins register more through the '{PLUGINS}' entry point of an installed package "
            "(pip install -e . registers ShapesWorld's)")


def _category():
    from grpo_vision.config.load import GrpoVisionWarning  # the library's one-line warnings, loaded when one is said

    return GrpoVisionWarning
