"""Which prompts a ShapesWorld run trains and evaluates on (data.world_train_split)."""

from pathlib import Path

import pytest

from grpo_vision.config import ConfigError, load_config
from grpo_vision.llama_policy import LlamaImagePolicy, LlamaPolicyConfig
from grpo_vision.loading import WORLD_EVAL_PROMPTS, Bundle, train_and_eval_prompts
from grpo_vision.shapes.scene import all_words, is_held_out


@pytest.fixture(scope="module")
def bundle():
    policy = LlamaImagePolicy(LlamaPolicyConfig(words=all_words(), dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                                ffn_dim=64))
    return Bundle(policy, tokenizer=None, world=Path("unused"))  # world prompts come from the grammar


@pytest.mark.parametrize("split, held_out", [("train", {False}), ("heldout", {True}), ("all", {False, True})])
def test_world_split_picks_compositions_and_never_the_eval_prompts(bundle, split, held_out):
    train, evals = train_and_eval_prompts(load_config(None, [f"data.world_train_split={split}"]), bundle)
    assert len(evals) == WORLD_EVAL_PROMPTS and all(is_held_out(e.prompt) for e in evals)
    assert {is_held_out(e.prompt) for e in train} == held_out
    assert not {e.prompt for e in train} & {e.prompt for e in evals}


def test_unknown_split_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="'data.world_train_split' expects one of 'train', 'all', 'heldout'"):
        load_config(None, ["data.world_train_split=seen"])
