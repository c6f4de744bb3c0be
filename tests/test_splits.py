"""A run's prompt sets (grpo_vision/splits.py): where each comes from and what training keeps."""

import pytest

from grpo_vision.config import load_config
from grpo_vision.prompts import PromptsError
from grpo_vision.splits import prompt_lists
from tests.helpers import MICRO


def test_each_prompt_source_reads_its_own_column(tmp_path):
    # a CSV of training captions under 'caption', eval prompts from a CSV under 'text' and held-out ones from a
    # TSV under 'prompt': data.prompt_column names the first, each other source its own (else the first's)
    (tmp_path / "train.csv").write_text("id,caption\n1,a red circle\n2,a blue square\n3,a green triangle\n")
    (tmp_path / "eval.csv").write_text("text,caption\na red square,not this\n")
    (tmp_path / "heldout.tsv").write_text("prompt\tcaption\na blue circle\tnot this either\n")
    data = [f"data.train_prompts={tmp_path / 'train.csv'}", f"data.eval_prompts={tmp_path / 'eval.csv'}",
            f"data.heldout_prompts={tmp_path / 'heldout.tsv'}", "sample.prompts_per_step=2"]
    cfg = load_config(MICRO, [*data, "data.prompt_column=caption", "data.eval_prompt_column=text",
                              "data.heldout_prompt_column=prompt"])
    sets = prompt_lists(cfg)
    assert [e.prompt for e in sets.train] == ["a red circle", "a blue square", "a green triangle"]
    assert [e.prompt for e in sets.test] == ["a red square"] and [e.prompt for e in sets.heldout] == ["a blue circle"]
    assert cfg.data.column("train") == "caption" and cfg.data.column("heldout") == "prompt"
    # without their own, the other sources read data.prompt_column: the eval file's 'caption' column this time
    cfg = load_config(MICRO, [*data, "data.prompt_column=caption"])
    assert [e.prompt for e in prompt_lists(cfg).test] == ["not this"]
    cfg = load_config(MICRO, [*data, "data.prompt_column=caption", "data.eval_prompt_column=nope"])
    with pytest.raises(PromptsError, match="has no column 'nope'.*data.eval_prompt_column"):
        prompt_lists(cfg)
