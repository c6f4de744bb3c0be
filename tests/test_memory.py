"""The memory estimate: its arithmetic by hand, a real policy's shape, and the refusal that names the knob."""

from pathlib import Path

import pytest
import torch

from grpo_vision.config import ConfigError
from grpo_vision.run.memory import PolicyShape, available_memory, check_memory, estimate_memory, peak, policy_shape

SHAPE = PolicyShape(params=1000, trainable=1000, param_bytes=4, image_tokens=4, image_values=12, cond_len=2,
                    layers=1, dim=8, heads=2, kv_heads=1, ffn_dim=16, codebook=10)


def test_the_estimate_by_hand():
    parts = estimate_memory(SHAPE, images=10, sample_batch=3, micro_batch=2, guided=True, frozen_reference=True)
    # weights 1000 x 4 B x 2 (frozen reference) = 8000; optimizer 1000 x 4 x 3 = 12000
    # step: 10 images x (3 x 4 B x 12 values + 4 tokens x (8 + 12)) = 10 x (144 + 80) = 2240
    # sampling, 3 x 2 = 6 rows, seq 2 + 4 = 6, head_dim 8 / 2 = 4: KV 2 x 1 x 6 x 1 x 6 x 4 x 4 B = 1152;
    #   fused 1 x 8 x ((2 + 2) x 4 + 2 x 16) x 4 B = 1536; logits 6 x 10 x 4 B x 4 = 960; 3648 in all
    # training, 2 x 2 = 4 rows: 4 x 6 tokens x 1 layer x (64 + 48 + 2 x 6) x 4 B = 11904, logits
    #   3 x 4 x 4 x 10 x 4 B = 1920; 13824 in all
    assert parts == {"weights": 8000, "optimizer": 12000, "step": 2240, "sampling": 3648, "training": 13824}
    assert peak(parts) == 8000 + 12000 + 2240 + 13824  # sampling and training do not overlap
    # No CFG halves the rows; LoRA's reference is no second copy: sampling 576 + 1536 + 480, training 5952 + 960
    plain = estimate_memory(SHAPE, images=10, sample_batch=3, micro_batch=2, guided=False, frozen_reference=False)
    assert plain == {"weights": 4000, "optimizer": 12000, "step": 2240, "sampling": 2592, "training": 6912}


def test_without_the_architecture_only_weights_optimizer_and_step_are_counted():
    shape = PolicyShape(params=1000, trainable=10, param_bytes=2, image_tokens=4, image_values=12)
    parts = estimate_memory(shape, images=10, sample_batch=3, micro_batch=2, guided=True, frozen_reference=False)
    assert parts == {"weights": 2000, "optimizer": 60, "step": 2240} and peak(parts) == 4300
    line, warning = check_memory(parts, available=None, lower_bound=True)
    assert line.startswith("memory: at least 0.00 GiB") and "architecture unknown" in line and warning is None


def test_a_run_that_cannot_fit_is_refused_naming_the_largest_part():
    parts = estimate_memory(SHAPE, images=10, sample_batch=3, micro_batch=2, guided=True, frozen_reference=True)
    line, warning = check_memory(parts, available=100_000, lower_bound=False)  # 36064 of 100000: fine
    assert warning is None and "of 0.0 GiB available" in line
    line, warning = check_memory(parts, available=40_000, lower_bound=False)  # 90%: a warning
    assert warning.startswith("the estimated peak is 90% of the available memory; the largest part is training")
    with pytest.raises(ConfigError, match=r"needs about 0.0 GiB .* lower train.micro_batch_size"):
        check_memory(parts, available=30_000, lower_bound=False)
    many = estimate_memory(SHAPE, images=100_000, sample_batch=3, micro_batch=2, guided=True, frozen_reference=True)
    with pytest.raises(ConfigError, match="largest part is step .* lower sample.prompts_per_step"):
        check_memory(many, available=1_000_000, lower_bound=False)


class Decoder:  # an ImageTokenizer that only knows its image size
    def decode(self, codes):
        return torch.zeros(codes.shape[0], 3, 6, 8)


def test_the_shape_of_the_built_in_policy(tiny_policy):
    shape = policy_shape(tiny_policy, Decoder(), [tiny_policy.lm_head.weight])
    assert shape.params == sum(p.numel() for p in tiny_policy.parameters())
    assert shape.trainable == tiny_policy.lm_head.weight.numel() and shape.param_bytes == 4
    assert (shape.image_tokens, shape.image_values, shape.cond_len, shape.codebook) == (12, 3 * 6 * 8, 10, 32)
    assert (shape.layers, shape.dim, shape.heads, shape.kv_heads, shape.ffn_dim) == (2, 64, 4, 2, 96)


def test_available_memory_on_the_cpu_is_a_positive_count():
    free = available_memory(torch.device("cpu"))
    if Path("/proc/meminfo").exists():  # elsewhere the check is skipped (None)
        assert free > 2**20
