"""Adapters (LoRA, LoHa, LoKr through peft): the adapter-disabled reference is the base model, the
adapter moves, a reference sync folds it in, and a run saves, resumes and evaluates with it."""

import contextlib
import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_vision.config import load_config
from grpo_vision.models.adapters import ADAPTERS, add_adapter, is_adapter_weight
from grpo_vision.step.reference import Reference
from grpo_vision.run.metrics import load_metrics
from grpo_vision.sampling import SamplingParams, sample, sequence_logprobs
from grpo_vision.train import train
from tests.helpers import micro_cfg
from tests.tools.test_presets import folders, loaded  # noqa: F401 (a fixture: the tiny presets, written once)

PARAMS = SamplingParams(cfg_scale=2.0)


def moved_adapter(tiny_policy, kind):
    """The tiny policy with a `kind` adapter after three Adam updates on a loss of its log-probs."""
    base = copy.deepcopy(tiny_policy)
    policy = add_adapter(tiny_policy, kind, rank=4, alpha=8.0, targets=["q_proj", "v_proj", "up_proj"])
    cond = policy.encode_prompts(["a red circle", "a blue square"])
    rollout = sample(policy, cond, [1, 2], PARAMS)  # whose sequences are scored
    with torch.no_grad():  # a fresh adapter changes nothing: its update starts at zero
        torch.testing.assert_close(sequence_logprobs(policy, cond, rollout, PARAMS),
                                   sequence_logprobs(base, cond, rollout, PARAMS), atol=1e-6, rtol=0)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert trainable and all(is_adapter_weight(n) for n, p in policy.named_parameters() if p.requires_grad)
    opt = torch.optim.Adam(trainable, lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        (-sequence_logprobs(policy, cond, rollout, PARAMS).mean()).backward()
        opt.step()
    return policy, base, cond, rollout


@pytest.mark.parametrize("kind", ADAPTERS)
def test_the_adapter_moves_and_disabled_it_is_the_base_model(tiny_policy, kind):
    policy, base, cond, rollout = moved_adapter(tiny_policy, kind)
    reference = Reference(policy, "adapter")
    with torch.no_grad():
        trained = sequence_logprobs(policy, cond, rollout, PARAMS)
        base_logp = sequence_logprobs(base, cond, rollout, PARAMS)
        assert (trained - base_logp).abs().max() > 1e-3  # the adapter really moved the policy
        assert trained.mean() > base_logp.mean()  # ... the way its loss asked
        ref = reference.logprobs(policy, cond, rollout, PARAMS, micro_batch=1)
    assert torch.equal(ref, base_logp)  # multiplier 0: exactly the base model's log-probs
    model, ctx = reference.sampler(policy)
    with ctx:  # what the demo and the report sample as the reference: the base model, same seeds
        assert torch.equal(sample(model, cond, [5, 6], PARAMS).tokens, sample(base, cond, [5, 6], PARAMS).tokens)


@pytest.mark.parametrize("kind", ADAPTERS)
def test_a_reference_sync_folds_the_adapter_into_the_base_weights(tiny_policy, kind):
    policy, _, cond, rollout = moved_adapter(tiny_policy, kind)
    reference = Reference(policy, "adapter")
    with torch.no_grad():
        before = sequence_logprobs(policy, cond, rollout, PARAMS)
        reference.sync(policy)
        after = sequence_logprobs(policy, cond, rollout, PARAMS)
        ref = reference.logprobs(policy, cond, rollout, PARAMS, micro_batch=2)
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

    from grpo_vision.step.load import load_run
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
        on = sequence_logprobs(loaded.policy, cond, sample(base, cond, [3, 4], PARAMS), PARAMS)
        off = sequence_logprobs(base, cond, sample(base, cond, [3, 4], PARAMS), PARAMS)
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
    # both were tracebacks: a bare ValueError of this file, and peft's NoMatchingPeftModuleError
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


# ---------------------------------------------------------------------------- sampling with the adapter merged

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_with_delta(policy, targets=ALL_TARGETS, kind="lora"):
    """`policy` under a `kind` adapter whose zero-initialised factors were drawn at random: a real delta to merge."""
    from grpo_vision.models.adapters import ZERO_FACTORS

    policy = add_adapter(policy, kind, rank=4, alpha=8.0, targets=targets)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if any(f".{factor}." in name for factor in ZERO_FACTORS):
                p.normal_(0, 0.05)
    return policy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merged_sampling_puts_every_weight_back_bit_for_bit(tiny_policy, dtype):
    from grpo_vision.models.adapters import merged_adapter, merged_bytes

    policy = lora_with_delta(tiny_policy.to(dtype))
    cond = policy.encode_prompts(["a red circle", "a blue square"])
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    tensors = {k: v.data_ptr() for k, v in policy.state_dict().items()}
    with merged_adapter(policy):
        merged = {k: v.clone() for k, v in policy.state_dict().items()}
        sample(policy, cond, [1, 2], PARAMS)
    after = policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # every tensor, every bit
    assert {k: v.data_ptr() for k, v in after.items()} == tensors  # the original tensors themselves
    changed = [k for k in before if not torch.equal(before[k], merged[k])]
    assert changed and all(k.endswith("base_layer.weight") for k in changed)  # only the base weights were merged
    assert len(changed) == 2 * 7 and merged_bytes(policy) == sum(before[k].numel() * before[k].element_size()
                                                                 for k in changed)
    if dtype != torch.float32:  # what the merge must not do: take the delta away again, which rounds twice
        from grpo_vision.models.adapters import adapter_layers

        module, name = adapter_layers(policy)[0]
        w = module.base_layer.weight
        undone = (w.float() + module.get_delta_weight(name)).to(dtype).float() - module.get_delta_weight(name)
        assert not torch.equal(undone.to(dtype), w)


def test_merged_sampling_is_undone_when_the_rollout_fails_and_merges_nothing_for_the_reference(tiny_policy):
    from grpo_vision.models.adapters import merged_adapter

    policy = lora_with_delta(tiny_policy)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    with pytest.raises(RuntimeError, match="a reward model died"):
        with merged_adapter(policy):
            raise RuntimeError("a reward model died")
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in before.items())
    with policy.disable_adapter(), merged_adapter(policy):  # the reference: the base weights, nothing folded in
        assert all(torch.equal(policy.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("params", [SamplingParams(cfg_scale=2.0),
                                    SamplingParams(cfg_scale=3.0, temperature=0.8, top_k=8, top_p=0.9)], ids=str)
def test_a_merged_rollout_draws_the_unmerged_tokens_in_float32(tiny_policy, params):
    from grpo_vision.models.adapters import merged_adapter

    policy = lora_with_delta(tiny_policy)
    cond = policy.encode_prompts(["a red circle", "a blue square", "a red square left of a blue circle"] * 4)
    plain = sample(policy, cond, list(range(12)), params)
    with merged_adapter(policy):
        merged = sample(policy, cond, list(range(12)), params)
    assert torch.equal(merged.tokens, plain.tokens)
    torch.testing.assert_close(merged.logprobs, plain.logprobs, atol=1e-5, rtol=0)
    with policy.disable_adapter():  # the delta changes what is drawn: sampling the base would fail the lines above
        base = sample(policy, cond, list(range(12)), params)
    assert not torch.equal(base.tokens, plain.tokens)


@pytest.mark.parametrize("name", ["janus-pro-1b-tiny", "llamagen-t2i-xl-tiny", "llamagen-c2i-xl-tiny"])
def test_a_merged_rollout_draws_the_unmerged_tokens_for_every_kind(name, folders):
    from grpo_vision.models.adapters import merged_adapter
    from grpo_vision.tools.presets import prompts_for

    policy = loaded(folders[name]).policy
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"] if "janus" in name else ["wqkv", "wo", "w1", "w2", "w3"]
    policy = lora_with_delta(policy, targets)
    params = SamplingParams(cfg_scale=3.0, top_k=16)
    cond = policy.encode_prompts(prompts_for(name, 3) * 2)
    with torch.no_grad():
        plain = sample(policy, cond, list(range(6)), params)
        with merged_adapter(policy):
            merged = sample(policy, cond, list(range(6)), params)
        with policy.disable_adapter():
            base = sample(policy, cond, list(range(6)), params)
    assert torch.equal(merged.tokens, plain.tokens)
    torch.testing.assert_close(merged.logprobs, plain.logprobs, atol=1e-5, rtol=0)
    assert not torch.equal(base.tokens, plain.tokens)  # the adapter's delta is in what both drew


def test_in_bf16_a_merged_rollout_drifts_from_the_update_as_much_as_an_unmerged_one(tiny_policy):
    """rollout/logp_drift: the sampler's log-probs against the update's teacher-forced ones (adapter unmerged).
    bf16 weights round W + delta once more when merged; the drift it adds stays at the unmerged level (measured:
    0.0074 unmerged, 0.0089 merged, nats a token, on this tiny policy)."""
    from grpo_vision.models.adapters import merged_adapter

    policy = lora_with_delta(tiny_policy.to(torch.bfloat16))
    cond = policy.encode_prompts(["a red circle", "a blue square"] * 16)
    drift = {}
    for merge in (False, True):
        with merged_adapter(policy) if merge else contextlib.nullcontext():
            rollout = sample(policy, cond, list(range(32)), PARAMS)
        with torch.no_grad():
            drift[merge] = (sequence_logprobs(policy, cond, rollout, PARAMS) - rollout.logprobs).abs().mean()
    assert 0 < drift[False] < 0.02 and drift[True] < 1.5 * drift[False]


def test_a_checkpoint_after_a_merged_rollout_is_the_one_without(tiny_policy, tmp_path):
    from grpo_vision.models.adapters import merged_adapter

    policy = lora_with_delta(tiny_policy.to(torch.bfloat16))
    twin = copy.deepcopy(policy)
    cond = policy.encode_prompts(["a red circle"] * 2)
    with merged_adapter(policy):
        sample(policy, cond, [1, 2], PARAMS)
    sample(twin, cond, [1, 2], PARAMS)
    for model, folder in ((policy, "merged"), (twin, "plain")):
        model.save_pretrained(str(tmp_path / folder))  # peft's adapter files
        save_file(model.state_dict(), str(tmp_path / folder / "whole.safetensors"))
    for file in ("adapter_model.safetensors", "whole.safetensors"):
        assert (tmp_path / "merged" / file).read_bytes() == (tmp_path / "plain" / file).read_bytes()


def test_merge_adapter_resolves_per_adapter_and_refuses_what_cannot_merge_in_one_line(tiny_policy):
    from types import SimpleNamespace

    from grpo_vision.config import ConfigError
    from grpo_vision.models.adapters import merge_setting

    def resolve(policy, setting, adapter="lora", distributed="NO", why=None):
        cfg = load_config(None, [f"train.adapter={adapter}", "train.reference=adapter",
                                 f"sample.merge_adapter={setting}"])
        merge, unmerged = merge_setting(cfg, policy, SimpleNamespace(distributed_type=distributed))
        assert why is None or unmerged == why  # what train's start-up line says when auto does not merge
        return merge

    lora = lora_with_delta(copy.deepcopy(tiny_policy))
    assert resolve(lora, "auto") and resolve(lora, "on") and not resolve(lora, "off")
    assert resolve(lora, "auto", distributed="DistributedType.MULTI_GPU")  # DDP: each process holds whole weights
    assert not resolve(lora, "auto", distributed="DistributedType.FSDP",
                       why="FSDP shards the weights it would fold into")
    with pytest.raises(ConfigError) as err:
        resolve(lora, "on", distributed="DistributedType.FSDP")
    assert "\n" not in str(err.value) and "FSDP shards them" in str(err.value)
    loha = lora_with_delta(copy.deepcopy(tiny_policy), kind="loha")
    assert resolve(loha, "on", "loha")  # auto merges LoRA only
    assert not resolve(loha, "auto", "loha", why="the adapter is loha (LyCORIS), which auto leaves unmerged")
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(copy.deepcopy(tiny_policy), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    assert not resolve(dora, "auto")
    with pytest.raises(ConfigError, match=r"^sample.merge_adapter=on cannot merge exactly: .*DoRA.*; set "
                                          r"sample.merge_adapter=off$"):
        resolve(dora, "on")
    with pytest.raises(ConfigError, match="^sample.merge_adapter=on folds a peft adapter .* train.adapter is none"):
        load_config(None, ["sample.merge_adapter=on"])


def test_a_lora_run_samples_merged_and_trains_as_unmerged_in_float32(micro_world, tmp_path):
    """The micro world's LoRA run with merging auto (on) and off: the same rollouts, so the same run up to the last
    bits of the float32 log-probs; the merged one logs the same on-policy drift."""
    runs = {}
    for merge in ("auto", "off"):
        runs[merge] = load_metrics(train(micro_cfg(
            micro_world, tmp_path / merge, "train.adapter=lora", "train.reference=adapter", "train.adapter_rank=4",
            "train.lr=1e-3", "train.adapter_targets=[q_proj, v_proj, o_proj, down_proj]", "log.report=false",
            f"sample.merge_adapter={merge}"), progress=False))
    for merged, plain in zip(runs["auto"], runs["off"]):
        for key in ("reward/total/mean", "policy/entropy", "loss/kl"):
            assert merged[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
        assert merged["rollout/logp_drift"] < 1e-4


def test_a_dora_run_trains_its_magnitudes_and_exports_an_adapter_peft_loads(micro_world, tmp_path):
    """train.adapter=dora is peft's LoRA with use_dora: each adapted layer gains a magnitude per output row,
    trained and checkpointed with the adapter, and the export is a peft adapter that `PeftModel.from_pretrained`
    puts on the user's own LlamaForCausalLM with the run's logits."""
    import dataclasses
    import json

    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from grpo_vision.export import export_run
    from grpo_vision.step.load import load_run
    from grpo_vision.models.llama import LlamaImagePolicy
    from grpo_vision.models.llama_hf import to_hf_llama
    from tests.test_export import LLAMA_PROMPTS, close, hf_image_logits, image_logits, llama_config

    cfg = llama_config(micro_world, tmp_path, adapter=True)
    cfg.train = dataclasses.replace(cfg.train, adapter="dora")
    run = train(cfg, progress=False)
    saved = load_file(run / "checkpoints" / "step_000002" / "policy.safetensors")
    magnitudes = {k: v for k, v in saved.items() if "lora_magnitude_vector" in k}
    assert magnitudes and all(is_adapter_weight(k) for k in saved)  # only the adapter, its magnitudes with it
    fresh = add_adapter(LlamaImagePolicy.from_pretrained(micro_world / "policy"), "dora", 4, 32.0,
                        cfg.train.adapter_targets).state_dict()  # magnitudes start at the base rows' norms
    assert any(not torch.equal(v, fresh[k]) for k, v in magnitudes.items())  # ... and training moved them

    to_hf_llama(LlamaImagePolicy.from_pretrained(micro_world / "policy")).save_pretrained(tmp_path / "base")
    assert export_run(run, tmp_path / "adapter").form == "adapter"
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["use_dora"] is True
    hf = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    loaded = load_run(run, device="cpu")
    ours, cond, tokens = image_logits(loaded.policy, LLAMA_PROMPTS)
    assert close(hf_image_logits(hf, loaded.policy.get_base_model(), cond, tokens), ours)
