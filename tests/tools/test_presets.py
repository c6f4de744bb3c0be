"""Released sizes with random weights (tools/presets.py): each preset's tiny twin is written in its model's
release format, loaded through the policy kind a user's files take, and sampled on every decode path."""

import json
from dataclasses import replace

import pytest
import torch

from grpo_vision.config import ConfigError, load_config
from grpo_vision.policy import load_bundle
from grpo_vision.sampling import SamplingParams, sample, sequence_logprobs
from grpo_vision.tools.presets import PRESETS, preset, preset_overrides, prompts_for
from tests.test_sampling import DECODES, device_for

TINY = [n for n in PRESETS if n.endswith("-tiny")]
PARAMS = [SamplingParams(cfg_scale=4.0), SamplingParams(cfg_scale=2.0, temperature=0.8, top_k=8, top_p=0.9),
          SamplingParams(temperature=1.2)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("presets")
    return {name: preset_overrides(name, root / name, "float32") for name in TINY}


def loaded(overrides, device="cpu"):
    bundle = load_bundle(load_config("configs/janus_pro_1b.yaml", overrides).policy, device)
    with torch.no_grad():  # peaked logits (random N(0, 0.02) weights give near-uniform ones): CFG and top-k bite
        for name, p in bundle.policy.named_parameters():
            if p.ndim > 1 and "vqmodel" not in name:
                p.mul_(8.0)
    return bundle


def test_every_released_size_has_a_tiny_twin_of_the_same_kind():
    assert {n for n in PRESETS if not n.endswith("-tiny")} == {"janus-pro-1b", "janus-pro-7b", "llamagen-t2i-xl",
                                                                 "llamagen-c2i-xl"}
    for name in TINY:
        assert preset(name).kind == preset(name.removesuffix("-tiny")).kind
    s = preset("llamagen-t2i-xl").size
    assert (s.layers, s.heads, s.dim, s.ffn, s.image_size // 16, s.cls_token_num) == (36, 20, 1280, 3584, 16, 120)
    assert preset("llamagen-c2i-xl").size.image_size // 16 == 24  # 576 tokens, LlamaGen's published sampler figure
    with pytest.raises(ConfigError, match="unknown --preset 'janus-pro-3b'; presets: janus-pro-1b"):
        preset("janus-pro-3b")


@pytest.mark.parametrize("name", TINY)
def test_a_tiny_preset_is_written_in_its_release_format_and_loads_through_its_kind(name, folders, tmp_path):
    overrides = dict(o.split("=", 1) for o in folders[name])
    if preset(name).kind == "janus":  # a transformers folder: its own loader reads it
        from transformers import JanusForConditionalGeneration

        model = JanusForConditionalGeneration.from_pretrained(overrides["policy.path"])
        assert model.config.vision_config.num_image_tokens == 16
    else:  # LlamaGen's .pt layout: the state dict under "model", read without running pickled code
        state = torch.load(overrides["policy.path"], weights_only=True)["model"]
        assert "tok_embeddings.weight" in state and "layers.1.attention.wqkv.weight" in state
        assert json.loads(overrides["policy.options"])["image_size"] > 0
    bundle = loaded(folders[name])
    cond = bundle.policy.encode_prompts(prompts_for(name, 2))
    images = bundle.tokenizer.decode(sample(bundle.policy, cond, [0, 1], PARAMS[0]).tokens)
    assert images.shape[:2] == (2, 3) and 0 <= images.min() and images.max() <= 1
    again = preset_overrides(name, tmp_path / "again", "float32")  # a fresh folder: the same weights (seed 0)
    assert torch.equal(next(loaded(again).policy.parameters()), next(bundle.policy.parameters()))


@pytest.mark.parametrize("decode", DECODES[1:])  # static and graph, each against eager
@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("name", ["janus-pro-1b-tiny", "llamagen-t2i-xl-tiny", "llamagen-c2i-xl-tiny"])
@torch.no_grad()
def test_every_decode_path_draws_the_eager_tokens(name, params, decode, folders):
    policy = loaded(folders[name], device_for(decode)).policy
    cond = policy.encode_prompts(prompts_for(name, 3) * 2)  # Janus rows of different lengths: left padding
    eager = sample(policy, cond, list(range(6)), params)
    other = sample(policy, cond, list(range(6)), replace(params, decode=decode))
    assert torch.equal(other.tokens, eager.tokens)
    torch.testing.assert_close(other.logprobs, eager.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(other.entropy, eager.entropy, atol=1e-5, rtol=0)
    assert eager.logprobs.mean() < -0.1  # not a degenerate, deterministic sampler


@pytest.mark.parametrize("name", ["janus-pro-1b-tiny", "llamagen-t2i-xl-tiny", "llamagen-c2i-xl-tiny"])
@torch.no_grad()
def test_the_compiled_decode_step_draws_the_eager_tokens_for_every_kind(name, folders):
    """sample.decode: compiled on a CPU (inductor's C++ code): each kind's static step compiled whole."""
    policy = loaded(folders[name]).policy
    cond = policy.encode_prompts(prompts_for(name, 3) * 2)
    eager = sample(policy, cond, list(range(6)), PARAMS[1])
    compiled = sample(policy, cond, list(range(6)), replace(PARAMS[1], decode="compiled"))
    assert torch.equal(compiled.tokens, eager.tokens)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, atol=1e-5, rtol=0)
    assert eager.logprobs.mean() < -0.1


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("name", ["janus-pro-1b-tiny", "llamagen-t2i-xl-tiny", "llamagen-c2i-xl-tiny"])
def test_static_rollout_logprobs_equal_teacher_forced_logprobs(name, decode, folders):
    policy = loaded(folders[name], device_for(decode)).policy
    params = replace(PARAMS[1], decode=decode)
    cond = policy.encode_prompts(prompts_for(name, 4))
    rollout = sample(policy, cond, list(range(4)), params)
    diff = (sequence_logprobs(policy, cond, rollout, params) - rollout.logprobs).abs().max().item()
    assert diff < 1e-5  # the ratio is 1 before the first update
