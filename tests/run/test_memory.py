"""The memory estimate: its arithmetic by hand, a real policy's shape, and the refusal that names the knob."""

import io
import os
from dataclasses import replace

import pytest
import torch

from grpo_vision.config import ConfigError
from grpo_vision.run import memory
from grpo_vision.run.memory import (
    PolicyShape, adapter_copies, available_memory, check_memory, estimate_memory, peak, policy_shape, resident_bytes,
)

SHAPE = PolicyShape(params=1000, trainable=1000, param_bytes=4, image_tokens=4, image_values=12, cond_len=2,
                    layers=1, dim=8, heads=2, kv_heads=1, ffn_dim=16, codebook=10, fused_copy=True)


def test_the_estimate_by_hand():
    parts = estimate_memory(SHAPE, images=10, sample_batch=3, micro_batch=2, guided=True, frozen_reference=True)
    # weights 1000 x 4 B x 2 (frozen reference) = 8000; optimizer 1000 x 4 x 3 = 12000
    # step: 10 images x (3 x 4 B x 12 values + 4 tokens x (8 + 12)) = 10 x (144 + 80) = 2240
    # sampling, 3 x 2 = 6 rows, seq 2 + 4 = 6, head_dim 8 / 2 = 4: KV 2 x 1 x 6 x 1 x 6 x 4 x 4 B = 1152;
    #   fused 1 x 8 x ((2 + 2) x 4 + 2 x 16) x 4 B = 1536; logits 6 x 10 x 4 B x 4 = 960; 3648 in all
    # training, 2 x 2 = 4 rows, kv_dim 1 x 4 = 4: a fully trained block keeps 2 x 8 + 2 x 4 + 3 x 16 = 72 values a
    #   token, + 2 x 8 + 16 for the weights' gradients, + 2 x 8 = 120 values x 4 B = 480 B, + the norms' float32
    #   inputs 2 x 8 x 4 B = 64: 544 B; 4 rows x 6 tokens x 1 layer x 544 = 13056, logits 3 x 4 x 4 x 10 x 4 B = 1920
    assert parts == {"weights": 8000, "optimizer": 12000, "step": 2240, "sampling": 3648, "training": 14976}
    assert peak(parts) == 8000 + 12000 + 2240 + 14976  # sampling and training do not overlap
    # speculative decoding, a window of 5: the cache 5 positions longer (KV 2 x 1 x 6 x 1 x 11 x 4 x 4 B = 2112) and
    # 8 float32 [6 rows, 5, 10] of logits and verification (6 x 10 x 4 B x 8 x 5 = 9600): 2112 + 1536 + 9600
    spec = estimate_memory(SHAPE, images=10, sample_batch=3, micro_batch=2, guided=True, frozen_reference=True,
                           window=5)
    assert spec["sampling"] == 13248 and {k: v for k, v in spec.items() if k != "sampling"} == {
        k: v for k, v in parts.items() if k != "sampling"}
    # No CFG halves the rows; LoRA's reference is no second copy: sampling 576 + 1536 + 480, training 6528 + 960
    plain = estimate_memory(SHAPE, images=10, sample_batch=3, micro_batch=2, guided=False, frozen_reference=False)
    assert plain == {"weights": 4000, "optimizer": 12000, "step": 2240, "sampling": 2592, "training": 7488}
    # adapters on frozen layers: no o_proj input or extra copy (72 + 32 values x 4 + 64 = 480 B); of another dtype
    # (adapter_bytes, their own copies of the inputs) not the norms' outputs or down_proj's input either: 72 x 4 + 64
    lora = estimate_memory(replace(SHAPE, adapter=True), 10, 3, 2, False, False)
    copies = estimate_memory(replace(SHAPE, adapter=True, adapter_bytes=40), 10, 3, 2, False, False)
    assert (lora["training"], copies["training"]) == (2 * 6 * 480 + 960, 2 * 6 * (352 + 40) + 960)


def test_a_text_plan_lengthens_the_condition_and_adds_the_text_rows_and_their_logits():
    planned = estimate_memory(SHAPE, images=10, sample_batch=3, micro_batch=2, guided=True, frozen_reference=True,
                              plan_tokens=3, plan_vocab=7)
    # seq 2 + 3 + 4 = 9: KV 2 x 1 x 6 x 4 x 9 x 4 B = 1728 (+ fused 1536 + logits 960 as before) = 4224;
    # training: 4 rows x 9 tokens x 544 B = 19584 + image logits 1920, and the 2 text rows: 2 x ((2 + 3) x 544
    #   + 3 x 3 tokens x 7 x 4 B) = 2 x (2720 + 252) = 5944
    assert planned["sampling"] == 4224 and planned["training"] == 19584 + 1920 + 5944


def test_a_self_judge_adds_its_understanding_forward_as_a_phase_of_its_own():
    judged = replace(SHAPE, judge_len=5, vocab=7)
    parts = estimate_memory(judged, images=10, sample_batch=3, micro_batch=2, guided=True, frozen_reference=True,
                            judge_rows=3)
    # T = 5 tokens, kv_dim 4: one block's working set 5 x (5 x 8 + 2 x 4 + 3 x 16) = 480 values, the attention's
    #   2 heads x 5 x 5 = 50: 530 x 4 B = 2120 a row, + the last position's logits twice, 2 x 7 x 4 B = 56: 2176 a row
    assert parts["judging"] == 3 * 2176 and parts["training"] == 14976
    assert peak(parts) == 8000 + 12000 + 2240 + 14976  # judging comes between sampling and training
    more = estimate_memory(judged, 10, 3, 2, True, True, judge_rows=10)  # 21760 B: now the largest phase
    assert peak(more) == 8000 + 12000 + 2240 + 10 * 2176
    assert "judging" not in estimate_memory(SHAPE, 10, 3, 2, True, True, judge_rows=10)  # a policy that reads none
    assert "judging" not in estimate_memory(judged, 10, 3, 2, True, True)  # no self_judge


def test_checkpointing_bf16_activations_and_what_lies_beside_the_weights():
    deep = replace(SHAPE, layers=3, trainable_bytes=100, weight_bytes=3000, extra_bytes=500, runtime_bytes=7,
                   kv_bytes=2)
    parts = estimate_memory(deep, images=10, sample_batch=3, micro_batch=2, guided=True, frozen_reference=False)
    # weights 3000 (their own dtypes) + 500 (a caption encoder); optimizer 3 x 100 B; the runtime as given;
    # KV in 2-byte values: 2 x 3 x 6 x 4 x 6 x 2 = 1728; 3 blocks x 544 B a token: 4 x 6 x 1632 = 39168
    assert (parts["weights"], parts["optimizer"], parts["runtime"]) == (3500, 300, 7)
    assert parts["sampling"] == 1728 + 3 * 1536 + 960 and parts["training"] == 39168 + 1920
    remat = estimate_memory(deep, 10, 3, 2, True, False, checkpointing=True)  # inputs 3 x 8 x 4 B + one block
    assert remat["training"] == 4 * 6 * (3 * 32 + 544) + 1920
    half = estimate_memory(deep, 10, 3, 2, True, False, activation_bytes=2)  # bf16 autocast: 120 x 2 + 64 B a block
    assert half["training"] == 4 * 6 * 3 * 304 + 1920
    assert peak(parts) == 3500 + 300 + 2240 + 7 + 39168 + 1920


def test_without_the_architecture_only_weights_optimizer_and_step_are_counted():
    shape = PolicyShape(params=1000, trainable=10, param_bytes=2, image_tokens=4, image_values=12)
    parts = estimate_memory(shape, images=10, sample_batch=3, micro_batch=2, guided=True, frozen_reference=False)
    assert parts == {"weights": 2000, "optimizer": 60, "step": 2240} and peak(parts) == 4300
    line, warning = check_memory(parts, available=None, lower_bound=True)
    assert line.startswith("memory: at least 0.00 GiB") and "architecture unknown" in line and warning is None


def test_a_run_that_cannot_fit_is_refused_naming_the_largest_part():
    parts = estimate_memory(SHAPE, images=10, sample_batch=3, micro_batch=2, guided=True, frozen_reference=True)
    line, warning = check_memory(parts, available=100_000, lower_bound=False)  # 37216 of 100000: fine
    assert warning is None and "of 0.0 GiB available" in line
    line, warning = check_memory(parts, available=44_000, lower_bound=False)  # 85%: a warning
    assert warning.startswith("the estimated peak is 85% of the available memory; the largest part is training")
    with pytest.raises(ConfigError, match=r"needs about 0.0 GiB .* lower train.micro_batch_size"):
        check_memory(parts, available=35_000, lower_bound=False)
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
    assert shape.fused_copy and shape.runtime_bytes == 0


def test_a_plan_cap_that_takes_the_run_over_is_named_with_the_longest_plan_that_fits(monkeypatch):
    """A huge sample.plan.max_tokens was refused with advice to lower the micro-batch or turn on checkpointing
    (already on); the cap that took the estimate over is named, with its value and the longest plan that fits."""
    from grpo_vision.config import load_config
    from grpo_vision.models.llama import LlamaImagePolicy, LlamaPolicyConfig
    from tests.helpers import MICRO

    policy = LlamaImagePolicy(LlamaPolicyConfig(words=["a", "red", "circle"], max_caption_words=4, codebook_size=16,
                                                image_grid=(2, 3), dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                                ffn_dim=64, plan_words=["red", "circle"], max_plan_tokens=4))
    cfg = load_config(MICRO, ["sample.plan.enabled=true", "sample.plan.max_tokens=5000",
                              "train.gradient_checkpointing=true"])
    trainable = list(policy.parameters())
    shape = policy_shape(policy, Decoder(), trainable)

    def need(plan: int) -> int:  # the peak report_memory estimates for this config at a plan of `plan` tokens
        return peak(estimate_memory(shape, 8, cfg.sample.batch_size, cfg.train.micro_batch_size, True,
                                    frozen_reference=cfg.train.reference == "frozen", checkpointing=True,
                                    plan_tokens=plan, plan_vocab=policy.plan_vocab_size))
    available = (need(300) + need(301)) // 2  # a plan of 300 tokens fits, one of 301 does not
    monkeypatch.setattr(memory, "available_memory", lambda device: available)
    with pytest.raises(ConfigError) as e:
        memory.report_memory(policy, Decoder(), trainable, cfg, 8, True, "cpu", loud=False)
    assert str(e.value).endswith("available; sample.plan.max_tokens=5000 lengthens every row's condition and adds "
                                 "the plan's rows and logits: at most 300 fits, so lower sample.plan.max_tokens to "
                                 "300 or less")
    monkeypatch.setattr(memory, "available_memory", lambda device: need(1) - 1)  # no plan fits: the usual knob
    with pytest.raises(ConfigError, match=r"available; the largest part is sampling \(.* GiB\): lower sample\.batch_"):
        memory.report_memory(policy, Decoder(), trainable, cfg, 8, True, "cpu", loud=False)


@pytest.mark.parametrize("name", ["janus-pro-1b-tiny", "llamagen-t2i-xl-tiny"])
def test_janus_and_llamagen_expose_their_architecture(name, tmp_path):
    from grpo_vision.config import load_config
    from grpo_vision.models.adapters import add_adapter
    from grpo_vision.policy import load_bundle
    from grpo_vision.tools.presets import preset, preset_overrides

    bundle = load_bundle(load_config(None, preset_overrides(name, tmp_path, "float32")).policy, "cpu")
    target = "q_proj" if preset(name).kind == "janus" else "wqkv"
    policy = add_adapter(bundle.policy, "lora", 4, 8.0, [target])  # the estimate reads through peft
    shape = policy_shape(policy, bundle.tokenizer, [p for p in policy.parameters() if p.requires_grad], 123)
    s = preset(name).size
    if preset(name).kind == "janus":
        assert (shape.layers, shape.dim, shape.heads, shape.kv_heads, shape.ffn_dim) == (2, 32, 4, 2, 64)
        assert (shape.cond_len, shape.codebook, shape.kv_bytes, shape.extra_bytes) == (64, 64, 4, 0)
    else:
        assert (shape.layers, shape.dim, shape.heads, shape.ffn_dim, shape.cond_len) == (2, 32, 4, 64, 120)
        t5 = sum(p.numel() for p in bundle.policy.captions.model.parameters()) * 4
        assert shape.extra_bytes == t5 > 0 and not shape.fused_copy and s.mode == "t2i"
    assert shape.runtime_bytes == 123 and shape.trainable_bytes < shape.weight_bytes
    assert shape.adapter_bytes == 0  # float32 adapters on float32 layers copy nothing


def test_lora_on_bf16_layers_counts_the_inputs_it_copies(tiny_policy):
    from grpo_vision.models.adapters import add_adapter

    policy = add_adapter(tiny_policy.to(torch.bfloat16), "lora", 4, 8.0, ["q_proj", "down_proj"])
    for name, p in policy.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()  # peft keeps adapters in float32 beside bf16 layers
    # 2 layers x (q_proj's input 64 + down_proj's input 96) x 4 B of a float32 copy
    assert adapter_copies(policy) == 2 * (64 + 96) * 4


def test_available_memory_on_the_cpu_is_memavailable_plus_this_process_resident_set(monkeypatch):
    # /proc/meminfo counts in KiB, /proc/PID/statm in pages (its second field is the resident set)
    files = {"/proc/meminfo": "MemTotal:   16000 kB\nMemFree:      100 kB\nMemAvailable:   2000 kB\n",
             f"/proc/{os.getpid()}/statm": "5000 30 10 1 0 200 0\n"}
    monkeypatch.setattr(memory, "open", lambda path: io.StringIO(files[path]), raising=False)
    assert available_memory(torch.device("cpu")) == 2000 * 1024 + 30 * os.sysconf("SC_PAGE_SIZE")
    files["/proc/meminfo"] = "MemTotal:   16000 kB\n"  # a kernel without MemAvailable: the check is skipped
    assert available_memory(torch.device("cpu")) is None


def test_the_resident_set_grows_by_the_pages_an_allocation_touches():
    if resident_bytes() is None:
        pytest.skip("no /proc/PID/statm (not Linux)")
    size = 64 * 2**20  # above glibc's largest mmap threshold (32 MiB): fresh pages, never the heap's reused ones
    before = resident_bytes()
    block = torch.empty(size // 4)  # reserved, not yet touched: the virtual size grows, the resident set does not
    assert resident_bytes() - before < 4 * 2**20
    block.fill_(1.0)
    assert resident_bytes() - before == pytest.approx(size, abs=4 * 2**20)
