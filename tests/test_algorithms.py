"""The algorithm menu through the real trainer: each option smoke-trained on the micro world, its config
checks, and the on-policy gauge. The formulas themselves are checked by hand in test_grpo.py."""

import math

import pytest
import torch
from safetensors.torch import load_file

from grpo_vision.config import ConfigError, load_config
from grpo_vision.run.metrics import load_metrics
from grpo_vision.train import train
from tests.helpers import micro_cfg


@pytest.mark.parametrize("options, metric", [
    (["train.loss_type=dapo"], None),
    (["train.loss_type=cispo", "train.epsilon_high=5.0"], None),
    (["train.importance_sampling_level=sequence"], None),
    (["train.delta=1.5"], "loss/delta_frac"),
    (["train.top_entropy_quantile=0.2"], "loss/policy_token_frac"),
    (["train.gradient_checkpointing=true"], None),
    # the token weightings and TRL 1.16's options through the real step (their math: test_credit.py)
    (["train.token_weighting=stage"], None),
    (["train.token_weighting=stage", "train.loss_type=dapo"], None),  # one weighted mean over the micro-batches
    (["train.token_weighting=critical"], None),
    (["train.token_weighting=guidance_contrastive"], None),
    (["train.zero_std_groups=drop"], "train/groups_dropped"),
    (["train.use_bias_correction_kl=true", "train.beta=0.04"], None),
    (["train.entropy_coef=0.01"], "loss/entropy"),
    (["train.use_adaptive_entropy=true", "train.entropy_coef=0.01", "train.entropy_target=10.0"], "loss/entropy_coef"),
    (["train.off_policy_mask_threshold=0.5", "train.num_iterations=2"], "loss/off_policy_frac"),
    (["train.ref_sync_every=1", "train.ref_model_mixup_alpha=0.5"], None),
])
def test_each_option_trains_two_steps(micro_world, tmp_path, options, metric):
    run = train(micro_cfg(micro_world, tmp_path, "log.report=false", *options), progress=False)
    before = load_file(micro_world / "policy" / "policy.safetensors")
    after = load_file(run / "checkpoints" / "step_000002" / "policy.safetensors")
    assert max((after[k] - before[k]).abs().max().item() for k in after) > 0
    rows = load_metrics(run)
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert all(v is not None and math.isfinite(v) for v in m.values()), m
        # float32: the sampler's and the update's log-probs agree up to the rounding of a KV-cache decode
        # against a full forward pass (0 with two threads here, 1.8e-7 with one: another summation order)
        assert m["rollout/logp_drift"] < 1e-5
        if metric:
            assert metric in m
    if "train.top_entropy_quantile=0.2" in options:  # the top fifth of the step's 8 x 64 tokens
        assert all(0.2 <= m["loss/policy_token_frac"] < 0.25 for m in rows)
    config = (run / "config.yaml").read_text()
    assert all(f"{o.split('=')[0].split('.')[1]}: {o.split('=')[1]}" in config for o in options)


@pytest.mark.parametrize("override, needle", [
    ("train.loss_type=cispo", r"cispo caps the importance weight at train.epsilon_high .* set train.epsilon_high=5.0"),
    ("train.delta=1.1", r"train.delta caps the ratio above the clip, so it must exceed 1 \+ train.epsilon_high = "
                        r"1.28; got 1.1: set it higher, or 0 for off"),
    ("train.top_entropy_quantile=0", r"train.top_entropy_quantile must be a finite number in \(0, 1\]"),
    ("train.importance_sampling_level=batch", r"importance_sampling_level"),
])
def test_option_errors_name_the_key_and_the_fix(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])
    with pytest.raises(ConfigError, match="cispo clips its weight at train.epsilon_high instead: set train.delta=0"):
        load_config(None, ["train.loss_type=cispo", "train.epsilon_high=5", "train.delta=7"])


def test_drop_leaves_flat_groups_out_of_the_update(micro_world, tmp_path):
    # one reward of one value: every group is flat, so every group is dropped and no update runs (with
    # keep, the KL term alone would still move the weights: beta 0.04 here)
    run = train(micro_cfg(micro_world, tmp_path, "log.report=false", "train.steps=1", "train.beta=0.04",
                          "train.zero_std_groups=drop",
                          "reward.weights={python:tests.rewards.test_rewards:constant: 1.0}"),
                progress=False)
    row = load_metrics(run)[0]
    assert row["train/groups_dropped"] == 2 and row["loss/total"] is None  # NaN, written as null
    before = load_file(micro_world / "policy" / "policy.safetensors")
    after = load_file(run / "checkpoints" / "step_000001" / "policy.safetensors")
    assert all((after[k] == before[k]).all() for k in after)


def flat_for_squares(images, prompts, metadata):  # python:tests.test_algorithms:flat_for_squares
    # a group of a prompt with a square gets one reward for every image (flat); any other prompt's images differ
    return torch.tensor([0.5 if "square" in p else images[i].mean().item() for i, p in enumerate(prompts)])


def test_resample_puts_groups_of_new_prompts_in_the_flat_groups_places(micro_world, tmp_path):
    # DAPO's refill: every flat group (a prompt with a square) is replaced by a group of a prompt the step had not
    # drawn, sampled and scored, until the step's groups all vary; nothing is left to drop
    options = ["log.report=false", "log.sample_every=0", "train.steps=3", "train.zero_std_groups=resample",
               "reward.weights={python:tests.test_algorithms:flat_for_squares: 1.0}", "reward.monitor=[]"]
    run = train(micro_cfg(micro_world, tmp_path, *options), progress=False)
    rows = load_metrics(run)
    assert sum(m["train/groups_resampled"] for m in rows) >= 1, rows  # some step drew a square
    assert all(m["adv/frac_zero_std"] == 0 and m["train/groups_dropped"] == 0 for m in rows)
    for m in rows:  # each flat one of the step's 2 groups drew a new group at least once
        assert m["train/groups_resampled"] >= m["train/frac_flat_sampled"] * 2
    # the same first step with keep (the same weights, the same prompts): its flat groups are what resample saw
    kept = load_metrics(train(micro_cfg(micro_world, tmp_path, *options[:-3], "run.name=kept", "train.steps=1",
                                        options[-2], options[-1]), progress=False))
    assert kept[0]["adv/frac_zero_std"] == rows[0]["train/frac_flat_sampled"]


def flat_for_cats(images, prompts, metadata):  # python:tests.test_algorithms:flat_for_cats
    return torch.tensor([0.5 if " cat" in p else images[i].mean().item() for i, p in enumerate(prompts)])


def test_resample_joins_janus_prompts_of_other_widths(tmp_path, monkeypatch):
    # Janus pads each batch of prompts to its longest: a refill's condition ids are another width than the
    # step's, and the joined batch is encoded again (step/phases.take_groups), not concatenated (a crash)
    import grpo_vision.step.phases as phases
    from grpo_vision.tools.presets import preset_overrides
    from tests.helpers import ROOT

    widths = []

    def spy(parts, picks, group_size, encode=None):
        widths.append(sorted({p[0].cond.shape[1] for p in parts}))
        return take_groups(parts, picks, group_size, encode)

    take_groups = phases.take_groups
    monkeypatch.setattr(phases, "take_groups", spy)
    overrides = [*preset_overrides("janus-pro-1b-tiny", tmp_path / "preset", "float32"), "sample.prompts_per_step=2",
                 "sample.group_size=2", "sample.batch_size=4", "train.micro_batch_size=2", "train.minibatches_per_pass=1",
                 "train.steps=2", "train.zero_std_groups=resample", "reward.options={}", "reward.monitor=[]",
                 "reward.weights={python:tests.test_algorithms:flat_for_cats: 1.0}", "log.sample_every=0",
                 "log.report=false", f"run.out_dir={tmp_path}", "run.name=janus"]
    run = train(load_config(ROOT / "configs" / "janus_pro_1b.yaml", overrides), progress=False)
    rows = load_metrics(run)
    assert sum(m["train/groups_resampled"] for m in rows) >= 1 and any(len(w) > 1 for w in widths), widths
    assert all(m["adv/frac_zero_std"] == 0 for m in rows)


def test_resample_needs_prompts_beyond_a_steps_own(micro_world, tmp_path):
    prompts = tmp_path / "two.txt"
    prompts.write_text("a red circle\na blue square\n")
    (tmp_path / "eval.txt").write_text("a green triangle\n")
    with pytest.raises(ConfigError, match=r"train.zero_std_groups=resample replaces flat groups by prompts the step "
                                          r"has not drawn, and the 2 training prompts leave none beside "
                                          r"sample.prompts_per_step=2: give more training prompts"):
        train(micro_cfg(micro_world, tmp_path, "train.zero_std_groups=resample", f"data.train_prompts={prompts}",
                        f"data.eval_prompts={tmp_path / 'eval.txt'}",
                        "reward.weights={python:tests.test_algorithms:flat_for_squares: 1.0}", "reward.monitor=[]"),
              progress=False)


def test_the_token_weights_reach_the_update(micro_world, tmp_path, monkeypatch):
    # every token's policy weight 0 (a weighting that credits nothing) and no KL: no gradient, no change

    seen = []

    def nothing(plan, policy, tokenizer, batch, entropy, contrast=None):
        seen.append(plan.token_weighting)
        return torch.zeros_like(batch.old_logprobs), torch.ones_like(batch.old_logprobs)

    monkeypatch.setattr("grpo_vision.step.phases.token_weights", nothing)
    run = train(micro_cfg(micro_world, tmp_path, "log.report=false", "train.steps=1", "train.beta=0",
                          "train.token_weighting=stage", "train.stage_entropy_reward_scale=0", "train.weight_decay=0"),
                progress=False)
    assert seen == ["stage"]  # the plan said which weighting
    before = load_file(micro_world / "policy" / "policy.safetensors")
    after = load_file(run / "checkpoints" / "step_000001" / "policy.safetensors")
    assert all((after[k] == before[k]).all() for k in after)
    assert load_metrics(run)[0]["train/grad_norm"] == 0.0
