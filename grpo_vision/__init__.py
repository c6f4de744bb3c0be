"""grpo_vision: GRPO fine-tuning for discrete-token autoregressive text-to-image models."""

__version__ = "0.1.0"
