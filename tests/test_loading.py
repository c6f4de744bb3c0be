"""Policy kinds and the prompts a run trains and evaluates on."""

import pytest

from grpo_vision.config import ConfigError, load_config
from grpo_vision.llama_policy import LlamaImagePolicy, LlamaPolicyConfig
from grpo_vision.policies import REGISTRY, Bundle, load_bundle, policy_kind, prompt_lists, register_policy_kind
from grpo_vision.policies import train_and_eval_prompts
from grpo_vision.prompts import PromptEntry
from grpo_vision.shapes.plugin import EVAL_PROMPTS
from grpo_vision.shapes.scene import all_words, is_held_out


@pytest.fixture(scope="module")
def bundle():
    policy = LlamaImagePolicy(LlamaPolicyConfig(words=all_words(), dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                                ffn_dim=64))
    return Bundle(policy, tokenizer=None)  # the world's prompts come from its grammar, not its files


@pytest.mark.parametrize("split, held_out", [("train", {False}), ("heldout", {True}), ("all", {False, True})])
def test_world_split_picks_compositions_and_never_the_eval_prompts(bundle, split, held_out):
    train, evals = train_and_eval_prompts(load_config(None, [f"data.world_train_split={split}"]), bundle)
    assert len(evals) == EVAL_PROMPTS and all(is_held_out(e.prompt) for e in evals)
    assert {is_held_out(e.prompt) for e in train} == held_out
    assert not {e.prompt for e in train} & {e.prompt for e in evals}


def test_unknown_split_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="'data.world_train_split' expects one of 'train', 'all', 'heldout'"):
        load_config(None, ["data.world_train_split=seen"])


def test_an_eval_file_is_removed_from_the_kinds_training_prompts(tmp_path):
    evals = tmp_path / "eval.txt"
    cfg = load_config(None, ["data.world_train_split=all"])
    first = prompt_lists(cfg)[0][0].prompt  # a caption the world would train on
    evals.write_text(first + "\n")
    train, ev = prompt_lists(load_config(None, ["data.world_train_split=all", f"data.eval_prompts={evals}"]))
    assert [e.prompt for e in ev] == [first] and first not in {e.prompt for e in train}


def test_a_kind_without_prompts_needs_both_files():
    with pytest.raises(ConfigError, match="data.train_prompts is required: policy.kind 'llama' brings no prompts"):
        prompt_lists(load_config(None, ["policy.kind=llama"]))


def test_unknown_kind_lists_the_registered_ones():
    with pytest.raises(ConfigError, match=r"unknown policy.kind 'gpt5'; registered kinds: .*janus, llama, shapes"):
        policy_kind("gpt5")


def test_a_registered_kind_is_loaded_by_name_with_its_prompts(tiny_policy):
    @register_policy_kind("test_kind", prompts=lambda cfg: ([PromptEntry("a red circle")], [PromptEntry("a dog")]))
    def load(pcfg, device):
        return Bundle(tiny_policy, tokenizer=pcfg.path)

    try:
        cfg = load_config(None, ["policy.kind=test_kind", "policy.path=here"])
        assert load_bundle(cfg.policy, "cpu").tokenizer == "here"
        assert [[e.prompt for e in part] for part in prompt_lists(cfg)] == [["a red circle"], ["a dog"]]
    finally:
        del REGISTRY["test_kind"]
