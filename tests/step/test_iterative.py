"""Iterative RL: the boundary schedule, the replay buffer, rewards that learn (clip_refit) and the trainer
around them: the reference equals the policy at each boundary, and a run resumed at a boundary
continues exactly."""

import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from grpo_vision.run.checkpoint import load_iterative_state
from grpo_vision.config import ConfigError, load_config
from grpo_vision.step.iterative import ReplayBuffer, replay_count, starts_iteration
from grpo_vision.prompts import PromptEntry
from grpo_vision.rewards import CompositeReward, RewardContext, RewardError, make_reward
from grpo_vision.rewards.refit import pairwise_loss
from grpo_vision.run.metrics import load_metrics
from grpo_vision.run.safe_state import load_state, save_state
from grpo_vision.train import train
from tests.helpers import micro_cfg

NO_REPORT = "log.report=false"  # what is checked here is the training, not its report


# ---------------------------------------------------------------- the pure parts


def test_pairwise_loss_by_hand():
    # groups {0, 1} and {2, 3}; the judge accepts images 0 and 3. Pairs (right, wrong): (0, 1), (3, 2).
    # softplus(10 (0.3 - 0.5)) = ln(1 + e^-2) = 0.126928; softplus(10 (0.4 - 0.1)) = ln(1 + e^3) = 3.048587
    scores = torch.tensor([0.5, 0.3, 0.4, 0.1])
    loss, acc, n = pairwise_loss(scores, torch.tensor([0, 0, 1, 1]), torch.tensor([True, False, False, True]), 10.0)
    assert n == 2 and acc == 0.5  # 0.5 > 0.3 is ordered right, 0.1 < 0.4 is not
    assert loss.item() == pytest.approx((0.126928 + 3.048587) / 2, abs=1e-6)
    # no group with both kinds of image: no pairs, no loss
    assert pairwise_loss(scores, torch.tensor([0, 0, 1, 1]), torch.tensor([True, True, False, False]), 10.0)[2] == 0


def test_iterations_start_at_equal_steps():
    assert [s for s in range(6) if starts_iteration(s, 6, 3)] == [2, 4]
    assert not any(starts_iteration(s, 6, 1) for s in range(6))
    with pytest.raises(ConfigError, match=r"train.steps \(72\) must split into train.iterations \(5\) .* 4, 6, 8"):
        load_config(None, ["train.steps=72", "train.iterations=5"])
    with pytest.raises(ConfigError, match=r"reward.replay_fraction must be a finite number in \[0, 1\)"):
        load_config(None, ["reward.replay_fraction=1.0"])


def test_replay_is_its_fraction_of_the_update_set_and_the_buffer_is_capped(tmp_path):
    assert replay_count(90, 0.1, 100) == 10  # 10 of 100 replayed
    assert replay_count(90, 0.1, 4) == 4  # no more than there are
    assert replay_count(90, 0.0, 100) == 0
    buf = ReplayBuffer(capacity=8)
    rng = np.random.default_rng(0)
    for step in range(2):  # iteration 1: two steps of three samples
        buf.add(torch.full((3, 5), step), [PromptEntry(f"p{step}{j}") for j in range(3)])
    tokens, entries, replayed = buf.update_set(0.1, rng)
    assert tokens.shape == (6, 5) and replayed == 0 and [e.prompt for e in entries][:2] == ["p00", "p01"]
    buf.next_iteration(rng)
    assert len(buf) == 0 and len(buf.past_entries) == 6
    buf.add(torch.full((9, 5), 7), [PromptEntry(f"q{j}", metadata={"j": j}) for j in range(9)])
    tokens, entries, replayed = buf.update_set(0.1, rng)  # 0.1 / 0.9 x 9 = 1 replayed
    assert replayed == 1 and tokens.shape == (10, 5) and entries[-1].prompt.startswith("p")
    assert int(tokens[-1, 0]) == int(entries[-1].prompt[1])  # the replayed row keeps its own tokens
    save_state(buf.state_dict(), tmp_path / "buf.safetensors")  # what a checkpoint holds, mid-iteration
    again = ReplayBuffer(capacity=8)
    again.load_state_dict(load_state(tmp_path / "buf.safetensors"))
    assert [e.metadata for e in again.entries] == [{"j": j} for j in range(9)]
    assert torch.equal(again.update_set(0.1, np.random.default_rng(1))[0], buf.update_set(0.1, np.random.default_rng(1))[0])
    buf.next_iteration(rng)
    assert len(buf.past_entries) == 8 and buf.past_tokens.shape == (8, 5)  # 15 kept as a random 8


# ---------------------------------------------------------------- rewards that learn


class Learner:
    """python:tests.step.test_iterative:learner, a reward that counts its updates and fails on request."""

    def __init__(self):
        self.updates, self.fail, self.seen = 0, False, []

    def __call__(self, images, prompts, metadata):
        return torch.full((len(prompts),), float(self.updates))

    def update(self, images, prompts, metadata, labels):
        self.updates += 1
        self.seen.append((images.shape, list(prompts), list(labels)))
        if self.fail:
            raise RuntimeError("out of patience")
        return {"updates": self.updates}

    def state_dict(self):
        return {"updates": torch.tensor(self.updates)}

    def load_state_dict(self, state):
        self.updates = int(state["updates"])


class Brittle(Learner):
    """python:tests.step.test_iterative:brittle, a reward whose scoring fails once it has learned, on request."""

    def __init__(self):
        super().__init__()
        self.fail_call = True

    def __call__(self, images, prompts, metadata):
        if self.updates and self.fail_call:
            raise RuntimeError("scored after learning")
        return super().__call__(images, prompts, metadata)


learner = Learner()
failing = Learner()
failing.fail = True
brittle = Brittle()


def no_state(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))


no_state.update = lambda *args: {}


def test_a_learning_reward_must_be_able_to_save_what_it_learned_and_a_failed_update_is_undone():
    with pytest.raises(ConfigError, match="has no state_dict\\(\\) and load_state_dict\\(\\)"):
        CompositeReward({"python:tests.step.test_iterative:no_state": 1.0}, [], RewardContext())
    rewards = CompositeReward({"python:tests.step.test_iterative:learner": 1.0, "placebo": 1.0}, [], RewardContext())
    assert rewards.learners == ["python:tests.step.test_iterative:learner"]
    learner = rewards.fns["python:tests.step.test_iterative:learner"]  # the imported module's instance
    learner.__init__()
    images = torch.rand(2, 3, 8, 8)
    assert rewards.update(images, ["a", "b"], [{}, {}], [None, None]) == {
        "reward_update/python:tests.step.test_iterative:learner/updates": 1.0}
    learner.fail = True
    with pytest.raises(RewardError, match="learner' failed: its update failed: RuntimeError: out of patience"):
        rewards.update(images, ["a", "b"], [{}, {}], [None, None])
    assert learner.updates == 1  # put back as it was before the failed call


def renders(captions: list[str], seed: int) -> torch.Tensor:
    from grpo_vision.shapes.data import to_tensor
    from grpo_vision.shapes.layout import scene_for_caption
    from grpo_vision.shapes.scene import render

    rng = np.random.default_rng(seed)
    return to_tensor(np.stack([render(scene_for_caption(c, rng)) for c in captions]))


def test_clip_refit_learns_the_judges_order_deterministically_and_leaves_the_clip_reward_alone(micro_world):
    from grpo_vision.shapes.plugin import world_reward_defaults

    defaults = world_reward_defaults(micro_world)
    options = {**defaults["clip_refit"], "lr": 1e-3, "epochs": 3}
    # Four prompts of four images each: two drawn for the prompt (right) and two for one attribute changed
    # (wrong), labelled as the judge would: the images the policy draws for a prompt, some right, some not.
    pairs = [("a red circle", "a blue circle"), ("a green square", "a green triangle"),
             ("a large blue triangle", "a small blue triangle"), ("a yellow circle", "a yellow square")]
    prompts = [p for p, _ in pairs for _ in range(4)]
    drawn = [c for p, wrong in pairs for c in (p, p, wrong, wrong)]
    images = renders(drawn, seed=0)
    labels = [{"correct": d == p} for d, p in zip(drawn, prompts)]
    clip = make_reward("clip", RewardContext(), defaults["clip"])
    clip_before = clip(images, prompts, [])
    a, b = (make_reward("clip_refit", RewardContext(), options) for _ in range(2))
    assert torch.allclose(a(images, prompts, []), clip_before)  # it starts as the clip reward's CLIP
    ma, mb = (r.update(images, prompts, [{}] * len(prompts), labels) for r in (a, b))
    assert ma == mb and ma["pairs"] == 16 and ma["samples"] == 16  # 2 right x 2 wrong pairs per prompt
    assert ma["pair_acc_after"] >= ma["pair_acc_before"] and ma["pair_acc_after"] > 0.5
    after = a(images, prompts, [])
    assert torch.equal(after, b(images, prompts, []))  # the same data and seed: the same re-fit
    assert not torch.allclose(after, clip_before)
    assert torch.equal(clip(images, prompts, []), clip_before)  # the shared CLIP of clip / aesthetic is untouched
    fresh = make_reward("clip_refit", RewardContext(), options)
    fresh.load_state_dict(a.state_dict())
    assert torch.equal(fresh(images, prompts, []), after)
    with pytest.raises(ValueError, match="no sample has a judge's verdict"):
        a.update(images, prompts, [{}] * len(prompts), [None] * len(prompts))
    with pytest.raises(ConfigError, match=r"reward.options.clip_refit.epochs must be >= 1, got 0"):
        make_reward("clip_refit", RewardContext(), {**options, "epochs": 0})


# ---------------------------------------------------------------- the trainer


def test_the_reference_is_the_policy_at_each_boundary_and_clip_refit_updates_there(micro_world, tmp_path):
    # steps 4, iterations 2: the boundary runs at the start of step 3, after the checkpoint of step 2
    run = train(micro_cfg(micro_world, tmp_path, NO_REPORT, "train.steps=4", "train.iterations=2", "train.beta=0.04",
                          "reward.weights={clip_refit: 1.0}", "reward.options.clip_refit.lr=1e-3"), progress=False)
    ckpt = run / "checkpoints"
    policy_at_2 = load_file(ckpt / "step_000002" / "policy.safetensors")
    for step, reference in ((2, None), (3, policy_at_2), (4, policy_at_2)):
        ref = ckpt / f"step_{step:06d}" / "reference.safetensors"
        if reference is None:
            assert not ref.exists()  # the first iteration's reference is the base policy
        else:
            saved = load_file(ref)
            assert all(torch.equal(saved[k], v) for k, v in reference.items())
    rows = load_metrics(run)
    assert [m.get("iteration") for m in rows] == [1, 1, 2, 2]
    assert "reward_update/clip_refit/samples" not in rows[1]
    assert rows[2]["iteration/update_samples"] == 16 and rows[2]["iteration/replayed"] == 0  # 2 steps x 2 x 4
    assert rows[2]["reward_update/clip_refit/samples"] == 16
    learned = load_iterative_state(ckpt / "step_000003")
    assert int(learned["rewards"]["clip_refit"]["updates"]) == 1 and len(learned["buffer"]["entries"]) == 0
    assert load_iterative_state(ckpt / "step_000002")["buffer"]["tokens"].shape == (16, 64)  # an 8 x 8 token grid each
    from grpo_vision.step.load import load_run

    assert int(load_run(run).learned_rewards["clip_refit"]["updates"]) == 1  # eval scores as the run had learned


def test_a_run_resumed_at_a_boundary_continues_exactly(micro_world, tmp_path):
    common = ["train.steps=6", "train.iterations=3", "reward.weights={clip_refit: 1.0}",
              "reward.options.clip_refit.lr=1e-3", "reward.replay_fraction=0.25"]
    straight = train(micro_cfg(micro_world, tmp_path, NO_REPORT, "run.name=straight", *common), progress=False)
    half = train(micro_cfg(micro_world, tmp_path, NO_REPORT, "run.name=half", *common), progress=False)
    for later in ("step_000005", "step_000006"):  # stopped at the second boundary: resume into it
        shutil.rmtree(half / "checkpoints" / later, ignore_errors=True)
    (half / "checkpoints" / "latest").write_text("step_000004")
    resumed = train(load_config(half / "config.yaml"), resume=half, progress=False)
    for name in ("policy.safetensors", "reference.safetensors"):
        a, b = (load_file(r / "checkpoints" / "step_000006" / name) for r in (straight, resumed))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    la, lb = (load_iterative_state(r / "checkpoints" / "step_000006") for r in (straight, resumed))
    assert all(torch.equal(la["rewards"]["clip_refit"]["weights"][k], v)
               for k, v in lb["rewards"]["clip_refit"]["weights"].items())
    ma, mb = load_metrics(straight), load_metrics(resumed)
    assert ma[4]["iteration/replayed"] == 5  # round(0.25 / 0.75 x 16 fresh), of the first iteration's 16
    for a, b in zip(ma, mb):  # every logged number but the timings
        assert {k: v for k, v in a.items() if not k.startswith("perf/")} == \
               {k: v for k, v in b.items() if not k.startswith("perf/")}


def test_a_failing_reward_update_stops_the_run_with_a_checkpoint_that_resumes_into_the_boundary(micro_world, tmp_path):
    cfg = micro_cfg(micro_world, tmp_path, NO_REPORT, "train.steps=4", "train.iterations=2",
                    "reward.weights={placebo: 1.0}", "reward.monitor=[python:tests.step.test_iterative:failing]")
    with pytest.raises(RewardError, match=r"failing' failed: its update failed: RuntimeError: out of patience "
                                          r"\(checkpoint saved at step 2 in "):
        train(cfg, progress=False)
    run = tmp_path / "shapes_micro"
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"
    learned = load_iterative_state(run / "checkpoints" / "step_000002")
    assert len(learned["buffer"]["entries"]) == 16  # the iteration's samples, still there for the retry
    assert int(learned["rewards"]["python:tests.step.test_iterative:failing"]["updates"]) == 0  # put back


def test_a_reward_failing_after_the_boundary_resumes_without_updating_twice(micro_world, tmp_path):
    import importlib

    name = "python:tests.step.test_iterative:brittle"
    cfg = micro_cfg(micro_world, tmp_path, NO_REPORT, "train.steps=4", "train.iterations=2",
                    "reward.weights={placebo: 1.0}", f"reward.monitor=[{name}]")
    with pytest.raises(RewardError, match="scored after learning"):  # step 3: the boundary ran, then scoring failed
        train(cfg, progress=False)
    run = tmp_path / "shapes_micro"
    saved = load_iterative_state(run / "checkpoints" / "step_000002")
    assert int(saved["rewards"][name]["updates"]) == 1 and int(saved["buffer"]["iteration"]) == 1
    importlib.import_module("tests.step.test_iterative").brittle.fail_call = False  # the instance the run imported
    train(load_config(run / "config.yaml"), resume=run, progress=False)
    final = load_iterative_state(run / "checkpoints" / "step_000004")
    assert int(final["rewards"][name]["updates"]) == 1  # the boundary was not run a second time
    assert [m["step"] for m in load_metrics(run)] == [1, 2, 3, 4]


def test_iterative_rl_trains_two_iterations_of_one_step(micro_world, tmp_path):
    run = train(micro_cfg(micro_world, tmp_path, NO_REPORT, "train.iterations=2", "reward.weights={clip_refit: 1.0}"),
                progress=False)
    rows = load_metrics(run)
    assert [m["iteration"] for m in rows] == [1, 2]
    assert rows[1]["reward_update/clip_refit/samples"] == 8 and math.isfinite(rows[1]["reward/clip_refit/mean"])
