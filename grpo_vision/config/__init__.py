"""A run's configuration: typed dataclasses with a one-line doc per knob (schema.py), read from YAML and
dotted overrides with strict checking (load.py), TRL's option names taken as aliases (trl_names.py). Importers
use `grpo_vision.config`."""

from grpo_vision.config.load import ConfigError, GrpoVisionWarning, apply_override, brief, coerce, from_dict, read_yaml
from grpo_vision.config.schema import (
    DEVICE_HINT, DEVICE_NAME, EVAL_SEED, MAX_SEED, Config, DataConfig, LogConfig, PolicyConfig, RewardConfig, RunConfig,
    PlanConfig, SampleConfig, TrainConfig, derived_sizes, format_sizes, load_config, save_config, to_dict, validate,
)

__all__ = [
    "DEVICE_HINT", "DEVICE_NAME", "EVAL_SEED", "MAX_SEED", "Config", "ConfigError", "DataConfig", "LogConfig", "PolicyConfig",
    "PlanConfig", "RewardConfig", "RunConfig", "SampleConfig", "TrainConfig", "apply_override", "brief", "coerce", "derived_sizes",
    "format_sizes", "from_dict", "GrpoVisionWarning", "load_config", "read_yaml", "save_config", "to_dict", "validate",
]
