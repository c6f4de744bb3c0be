"""The algorithm menu through the real trainer: each option smoke-trained on the micro world, its config
checks, and the on-policy gauge. The formulas themselves are checked by hand in test_grpo.py."""

import math

import pytest
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


def test_dapo_and_bnpo_agree_on_one_process(micro_world, tmp_path):
    # Every image has the same number of tokens, so the token mean over an update's minibatch (dapo)
    # equals the mean of its micro-batches' token means (bnpo): the same losses and gradients up to float
    # rounding, over two updates a pass (a normaliser counting the whole step's tokens would halve dapo's).
    runs = [train(micro_cfg(micro_world, tmp_path, f"run.name={lt}", "train.steps=1", "log.report=false",
                            "train.micro_batch_size=2", "train.minibatches_per_pass=2", f"train.loss_type={lt}"),
                  progress=False) for lt in ("bnpo", "dapo")]
    a, b = (load_metrics(r)[0] for r in runs)
    for key in ("loss/policy", "loss/total", "train/grad_norm", "loss/ratio_mean"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-8), key


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
