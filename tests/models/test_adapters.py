"""Adapters (LoRA, LoHa, LoKr through peft): the adapter-disabled reference is the base model, the
adapter moves, a reference sync folds it in, and a run saves, resumes and evaluates with it."""

import copy

import pytest
import torch
from safetensors.torch import load_file

from grpo_vision.config import load_config
from grpo_vision.models.adapters import ADAPTERS, add_adapter, is_adapter_weight
from grpo_vision.reference import Reference
from grpo_vision.run.metrics import load_metrics
from grpo_vision.sampling import SamplingParams, sample, sequence_logprobs
from grpo_vision.train import train
from tests.helpers import micro_cfg

PARAMS = SamplingParams(cfg_scale=2.0)


def moved_adapter(tiny_policy, kind):
    """The tiny policy with a `kind` adapter after three Adam updates on a loss of its log-probs."""
    base = copy.deepcopy(tiny_policy)
    policy = add_adapter(tiny_policy, kind, rank=4, alpha=8.0, targets=["q_proj", "v_proj", "up_proj"])
    cond = policy.encode_prompts(["a red circle", "a blue square"])
    tokens = sample(policy, cond, [1, 2], PARAMS).tokens
    with torch.no_grad():  # a fresh adapter changes nothing: its update starts at zero
        torch.testing.assert_close(sequence_logprobs(policy, cond, tokens, PARAMS),
                                   sequence_logprobs(base, cond, tokens, PARAMS), atol=1e-6, rtol=0)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert trainable and all(is_adapter_weight(n) for n, p in policy.named_parameters() if p.requires_grad)
    opt = torch.optim.Adam(trainable, lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        (-sequence_logprobs(policy, cond, tokens, PARAMS).mean()).backward()
        opt.step()
    return policy, base, cond, tokens


@pytest.mark.parametrize("kind", ADAPTERS)
def test_the_adapter_moves_and_disabled_it_is_the_base_model(tiny_policy, kind):
    policy, base, cond, tokens = moved_adapter(tiny_policy, kind)
    reference = Reference(policy, "adapter")
    with torch.no_grad():
        trained = sequence_logprobs(policy, cond, tokens, PARAMS)
        base_logp = sequence_logprobs(base, cond, tokens, PARAMS)
        assert (trained - base_logp).abs().max() > 1e-3  # the adapter really moved the policy
        assert trained.mean() > base_logp.mean()  # ... the way its loss asked
        ref = reference.logprobs(policy, cond, tokens, PARAMS, micro_batch=1)
    assert torch.equal(ref, base_logp)  # multiplier 0: exactly the base model's log-probs
    model, ctx = reference.sampler(policy)
    with ctx:  # what the demo and the report sample as the reference: the base model, same seeds
        assert torch.equal(sample(model, cond, [5, 6], PARAMS).tokens, sample(base, cond, [5, 6], PARAMS).tokens)


@pytest.mark.parametrize("kind", ADAPTERS)
def test_a_reference_sync_folds_the_adapter_into_the_base_weights(tiny_policy, kind):
    policy, _, cond, tokens = moved_adapter(tiny_policy, kind)
    reference = Reference(policy, "adapter")
    with torch.no_grad():
        before = sequence_logprobs(policy, cond, tokens, PARAMS)
        reference.sync(policy)
        after = sequence_logprobs(policy, cond, tokens, PARAMS)
        ref = reference.logprobs(policy, cond, tokens, PARAMS, micro_batch=2)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)  # the policy is unchanged ...
    torch.testing.assert_close(ref, before, atol=1e-5, rtol=0)  # ... and the reference now equals it
    state = reference.state_dict(policy)
    assert state and not any(is_adapter_weight(n) for n in state)  # the merged base weights, no adapter


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_an_adapter_run_trains_saves_and_loads_back(micro_world, tmp_path, kind):
    run = train(micro_cfg(micro_world, tmp_path, f"train.adapter={kind}", "train.reference=adapter",
                          "train.adapter_rank=4", "train.lr=1e-3", "train.num_iterations=1", "log.report=false"),
                progress=False)
    saved = load_file(run / "checkpoints" / "step_000002" / "policy.safetensors")
    assert saved and all(is_adapter_weight(k) for k in saved)  # only the adapter is trained and saved
    assert max(v.abs().max().item() for v in saved.values()) > 0
    rows = load_metrics(run)
    assert rows[0]["loss/kl"] == pytest.approx(0.0, abs=1e-9) and rows[1]["loss/kl"] > 0  # adapter off = reference

    from grpo_vision.evaluation.evaluate import load_run
    from grpo_vision.policy import load_bundle

    loaded = load_run(run, device="cpu")  # what eval, sample and the demo load
    own = dict(loaded.policy.named_parameters())
    assert all(torch.equal(own[k], v) for k, v in saved.items())
    base = load_bundle(loaded.cfg.policy, "cpu").policy
    cond = base.encode_prompts(["a red circle"] * 2)
    model, ctx = loaded.reference.sampler(loaded.policy)
    with ctx, torch.no_grad():  # the demo's reference side: adapter off is the base policy, image for image
        assert torch.equal(sample(model, cond, [3, 4], PARAMS).tokens, sample(base, cond, [3, 4], PARAMS).tokens)
    with torch.no_grad():
        on = sequence_logprobs(loaded.policy, cond, sample(base, cond, [3, 4], PARAMS).tokens, PARAMS)
        off = sequence_logprobs(base, cond, sample(base, cond, [3, 4], PARAMS).tokens, PARAMS)
    assert (on - off).abs().max() > 0  # and adapter on is the trained policy


def test_the_adapter_settings_are_checked_together():
    with pytest.raises(Exception, match="train.reference: adapter is the policy with its adapter disabled"):
        load_config(None, ["train.reference=adapter"])
    with pytest.warns(UserWarning, match="keeps a second full copy of the policy"):
        load_config(None, ["train.adapter=loha"])  # reference frozen by default
    with pytest.warns(UserWarning, match="folds the adapter into bfloat16 base weights, which rounds it"):
        load_config(None, ["train.adapter=lora", "train.reference=adapter", "train.ref_sync_every=5",
                           "policy.dtype=bfloat16"])


def test_adapter_weights_are_told_by_peft_names_not_substrings():
    assert is_adapter_weight("base_model.model.layers.0.attn.q_proj.lora_A.default.weight")
    assert is_adapter_weight("base_model.model.layers.0.attn.q_proj.hada_w2_b.default")
    assert is_adapter_weight("base_model.model.layers.0.mlp.up_proj.lokr_w1.default")
    assert not is_adapter_weight("base_model.model.flora_proj.weight")  # a plugin's own weight
    assert not is_adapter_weight("base_model.model.layers.0.attn.q_proj.base_layer.weight")


def test_an_unknown_or_empty_target_list_is_a_config_error_naming_the_modules(tiny_policy):
    # both were tracebacks: a bare ValueError of this file, and peft's NoMatchingPeftModuleError (issue 33)
    from grpo_vision.config import ConfigError

    choose = "choose among down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    with pytest.raises(ConfigError) as err:
        add_adapter(tiny_policy, "lora", 4, 8.0, ["q_proj", "nonexistent_proj"])
    assert str(err.value) == ("train.adapter_targets names 'nonexistent_proj', which is not an adapter target of "
                              f"this policy: {choose}")
    with pytest.raises(ConfigError) as err:
        add_adapter(tiny_policy, "lora", 4, 8.0, [])
    assert str(err.value) == f"train.adapter_targets is empty, so the adapter would train nothing: {choose}"
    with pytest.raises(ConfigError, match=r"names 'x{80}'\.\.\. \(100000 characters\), which is not"):
        add_adapter(tiny_policy, "lora", 4, 8.0, ["x" * 100000])  # a long name is quoted briefly
    with pytest.raises(ConfigError, match="names 'a0', 'a1', 'a2' and 9997 more, which are not"):
        add_adapter(tiny_policy, "lora", 4, 8.0, [f"a{i}" for i in range(10000)])  # and many names, the first few
    tiny_policy.lora_scope = "model.layers.0.mlp"  # a scope (Janus: its LM) bounds what the adapter may wrap
    with pytest.raises(ConfigError, match="'q_proj', which is not an adapter target of this policy: choose among "
                                          "down_proj, gate_proj, up_proj$"):
        add_adapter(tiny_policy, "lora", 4, 8.0, ["q_proj"])
