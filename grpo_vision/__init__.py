"""grpo_vision: GRPO fine-tuning for discrete-token autoregressive text-to-image models.

The public API, for a user's script; each name loads its module on first use, so `import grpo_vision`
(and `grpo-vision --help`) imports no torch, and `grpo_vision.load_config` only the config (YAML):

    import grpo_vision
    from grpo_vision.train import train

    cfg = grpo_vision.load_config("configs/shapes.yaml", ["train.lr=1e-5"])
    run_dir = train(cfg)                      # the same function as grpo_vision.train.train

    @grpo_vision.register_reward("brightness")
    def brightness(ctx: grpo_vision.RewardContext) -> grpo_vision.RewardFn:
        return lambda images, prompts, metadata: images.mean(dim=(1, 2, 3))

`grpo_vision.train` is the training *module* (train.py) and the function is `grpo_vision.train.train`:
Python sets a package's attribute to its submodule whenever the submodule is imported, so a lazily
exported function of the same name would be the function or the module depending on what was imported
first, and forcing it would break `import grpo_vision.train as m` and monkeypatching by dotted path
(tests/test_structure.py checks both import orders).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first access, then cached in this module)
_EXPORTS = {
    "Config": "grpo_vision.config",
    "load_config": "grpo_vision.config",
    "Bundle": "grpo_vision.policy",
    "ImagePolicy": "grpo_vision.policy",
    "Judge": "grpo_vision.policy",
    "register_policy_kind": "grpo_vision.policy",
    "ImageTokenizer": "grpo_vision.models.tokenizer",
    "SamplingParams": "grpo_vision.sampling",
    "RewardContext": "grpo_vision.rewards",  # the package: importing it registers the built-in rewards
    "RewardFn": "grpo_vision.rewards",  # (images[B,3,H,W] in [0,1], prompts, metadata) -> Tensor[B]
    "register_reward": "grpo_vision.rewards",
    "GRPOTrainer": "grpo_vision.trainer",  # train / evaluate / export from a script, with objects in memory
}
_SUBMODULES = ("train",)  # a submodule, not a function: see the docstring

__all__ = [  # a literal, so that linters and type checkers read it; tests/test_structure.py checks it
    "Bundle", "Config", "GRPOTrainer", "ImagePolicy", "ImageTokenizer", "Judge", "RewardContext", "RewardFn",
    "SamplingParams",
    "__version__", "load_config", "register_policy_kind", "register_reward", "train",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports these on first use
    from grpo_vision import train
    from grpo_vision.config import Config, load_config
    from grpo_vision.models.tokenizer import ImageTokenizer
    from grpo_vision.policy import Bundle, ImagePolicy, Judge, register_policy_kind
    from grpo_vision.rewards import RewardContext, RewardFn, register_reward
    from grpo_vision.sampling import SamplingParams
    from grpo_vision.trainer import GRPOTrainer


def __getattr__(name: str):
    """PEP 562: a public name's value, imported from its module the first time it is read."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later reads skip this function
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")  # the import sets the attribute itself
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
