"""Prompts files: text or JSONL, per-entry reward routing, errors that name the line."""

import pytest

from grpo_vision.config import load_config
from grpo_vision.policy import Bundle
from grpo_vision.splits import checked_prompt_sets
from grpo_vision.policy import prompt_problem
from grpo_vision.prompts import PromptsError, load_prompts


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_plain_text_skips_blanks_and_comments(tmp_path):
    path = write(tmp_path, "p.txt", "# seen prompts\na red circle\n\n  a blue square  \n")
    entries = load_prompts(path)
    assert [e.prompt for e in entries] == ["a red circle", "a blue square"]
    assert [e.line for e in entries] == [2, 4]
    assert entries[0].rewards is None and entries[0].metadata == {}


def test_jsonl_carries_reward_weights_and_metadata(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"prompt": "a red circle", "rewards": {"clip": 1, "shapes_exact": 0.5},'
                                      ' "metadata": {"tag": "x"}}\n{"prompt": "a blue square"}\n')
    a, b = load_prompts(path)
    assert a.rewards == {"clip": 1.0, "shapes_exact": 0.5} and a.metadata == {"tag": "x"}
    assert b.rewards is None and b.line == 2


@pytest.mark.parametrize("text, needle", [
    ('{"prompt": "a"}\n{"prompt": "b"\n', "line 2: not valid JSON"),
    ('{"prompt": ""}\n', "line 1: each JSONL line must be an object with a non-empty string 'prompt'"),
    ('{"prompt": "a", "weights": {}}\n', "line 1: unknown field(s) ['weights']"),
    ('{"prompt": "a", "rewards": {"clip": "high"}}\n', "line 1: 'rewards' must map reward names to finite numbers"),
    ('{"prompt": "a", "metadata": [1]}\n', "line 1: 'metadata' must be an object"),
    ('{"prompt": "a", "rewards": {"clip": NaN}}\n', "line 1: 'rewards' must map reward names to finite numbers"),
    ("", "holds no prompts"),
])
def test_corrupt_files_name_the_line(tmp_path, text, needle):
    with pytest.raises(PromptsError) as err:
        load_prompts(write(tmp_path, "p.jsonl", text))
    assert needle in str(err.value) and "p.jsonl" in str(err.value)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(PromptsError, match="prompts file not found: .*nope.txt"):
        load_prompts(tmp_path / "nope.txt")
    path = tmp_path / "bin.txt"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PromptsError, match="is not UTF-8 text"):
        load_prompts(path)


def test_format_is_decided_by_the_first_prompt_line_and_a_bom_is_dropped(tmp_path):
    text = "# comments first\n#\n#\n#\n#\n#\n" + '{"prompt": "a red circle"}\n'
    assert [e.prompt for e in load_prompts(write(tmp_path, "p.txt", text))] == ["a red circle"]
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffa red circle\na blue square\n".encode("utf-8"))
    assert [e.prompt for e in load_prompts(path)] == ["a red circle", "a blue square"]


def test_a_json_line_in_a_plain_text_file_is_refused(tmp_path):
    # Before, it was trained on as a literal caption, braces and all
    path = write(tmp_path, "p.txt", 'a red circle\n{"prompt": "a blue square"}\n')
    with pytest.raises(PromptsError, match=r"p.txt, line 2: looks like JSON, but the file is read as plain text .*"
                                           r"rename it to p.jsonl"):
        load_prompts(path)


def test_words_the_policy_does_not_know_are_named_with_its_vocabulary(tiny_policy):
    assert prompt_problem(tiny_policy, "A Red  circle") is None  # read as the policy reads it: lower case
    assert prompt_problem(tiny_policy, "a teal hexagon left of a teal circle") == (
        "words the policy does not know: 'teal', 'hexagon' (its vocabulary: a red blue circle square left of)")
    assert "at most 8" in prompt_problem(tiny_policy, "a red circle left of a blue square now")

    class ReadsAnything:  # like Janus: no unknown_words, so nothing is unknown
        def encode_prompts(self, prompts):
            return None

    assert prompt_problem(ReadsAnything(), "a teal hexagon") is None


def test_training_prompts_the_policy_cannot_read_are_refused_at_start(tmp_path, tiny_policy):
    train = write(tmp_path, "train.txt", "# shapes\na red circle\na teal hexagon\n")
    evals = write(tmp_path, "eval.txt", "a blue square\n")
    cfg = load_config(None, [f"data.train_prompts={train}", f"data.eval_prompts={evals}"])
    with pytest.raises(PromptsError, match=r"train.txt, line 3: words the policy does not know: 'teal', 'hexagon'"):
        checked_prompt_sets(cfg, Bundle(tiny_policy, None))
    cfg = load_config(None, [f"data.train_prompts={evals}", f"data.eval_prompts={train}"])
    with pytest.raises(PromptsError, match=r"train.txt, line 3: words the policy does not know"):  # as eval prompts
        checked_prompt_sets(cfg, Bundle(tiny_policy, None))


@pytest.mark.parametrize("depth", [101, 100_000])
def test_metadata_nested_too_deep_is_named_with_its_line(tmp_path, depth):
    # 100,000 levels raised RecursionError (a traceback); a few hundred parsed, then broke json.dumps when
    # the run saved its prompts (issue 33)
    nested = "[" * depth + "]" * depth
    path = write(tmp_path, "p.jsonl", '{"prompt": "a red circle"}\n'
                                      f'{{"prompt": "a blue square", "metadata": {{"x": {nested}}}}}\n')
    with pytest.raises(PromptsError) as err:
        load_prompts(path)
    assert str(err.value) == (f"{path}, line 2: lists and objects nested more than 100 levels deep; "
                              "write flatter JSON")
    shallow = "[" * 98 + "]" * 98  # with the line's own object and 'metadata', 100 levels: the limit
    path.write_text(f'{{"prompt": "a", "metadata": {{"x": {shallow}}}}}\n')
    assert load_prompts(path)[0].metadata == {"x": eval(shallow)}


def test_a_line_or_paragraph_separator_inside_a_caption_is_kept(tmp_path):
    # str.splitlines() split lines at U+2028 inside a JSON string, and the error blamed the JSON (issue 33)
    import json

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a red\u2028circle"}, ensure_ascii=False) + "\r\n"
                    '{"prompt": "a blue\u2029square", "metadata": {"note": "x\u0085y"}}\n', encoding="utf-8")
    assert "\u2028" in path.read_text(encoding="utf-8")  # written raw, as JSON allows
    entries = load_prompts(path)
    assert [(e.prompt, e.line) for e in entries] == [("a red\u2028circle", 1), ("a blue\u2029square", 2)]
    assert entries[1].metadata == {"note": "x\u0085y"}
    path = tmp_path / "p.txt"
    path.write_text("a red\u2028circle\r\na blue\x1csquare\na green triangle\n", encoding="utf-8")
    assert [(e.prompt, e.line) for e in load_prompts(path)] == [
        ("a red\u2028circle", 1), ("a blue\x1csquare", 2), ("a green triangle", 3)]


def test_a_rejected_long_prompt_is_quoted_briefly(tmp_path, tiny_policy):
    # a rejected 10 MB prompt line was echoed whole to stderr (issue 33)
    from grpo_vision.config import brief

    assert brief("a red circle") == "'a red circle'" and brief(["x"]) == "['x']"  # short text: its repr
    assert brief("é" * 81) == repr("é" * 80) + "... (81 characters)"
    assert brief("a\u2028b" * 100, limit=4) == "'a\\u2028ba'... (300 characters)"  # repr shows what is unseen
    assert prompt_problem(tiny_policy, "x" * 10_000_000) == (
        f"words the policy does not know: {repr('x' * 80)}... (10000000 characters)"
        " (its vocabulary: a red blue circle square left of)")
    many = prompt_problem(tiny_policy, " ".join(f"w{i}" for i in range(8)))  # as many words as it reads
    assert many.startswith("words the policy does not know: 'w0', 'w1', 'w2', 'w3', 'w4' and 3 more (its voc")
    assert prompt_problem(tiny_policy, "red " * 2_000_000) == (
        f"caption {repr('red ' * 20)}... (8000000 characters) has 2000000 words; this policy takes at most 8 "
        "(max_caption_words)")
    train = write(tmp_path, "train.txt", "a red circle\na blue square\n" + "red " * 2_500_000 + "\n")
    cfg = load_config(None, [f"data.train_prompts={train}", "data.test_prompts=1"])
    with pytest.raises(PromptsError) as err:
        checked_prompt_sets(cfg, Bundle(tiny_policy, None))
    # line 3 is held back as the test set: named by the train file's line, no more "the policy kind's prompts"
    assert str(err.value).startswith(f"{train}, line 3: caption 'red red ") and len(str(err.value)) < 300


def test_a_resumed_run_keeps_the_prompts_it_saved(tmp_path):
    """A later version may draw a kind's sets otherwise (issue 34 did): a run folder's saved prompts win."""
    from grpo_vision.splits import prompt_lists, run_prompt_sets
    from grpo_vision.prompts import PromptEntry, save_prompts

    cfg = load_config("configs/shapes.yaml")
    assert run_prompt_sets(cfg, tmp_path).train == prompt_lists(cfg).train  # nothing saved: the config's
    saved = {"train": ["a red circle", "a red circle"], "test": ["a blue square"], "heldout": ["a blue triangle"]}
    for name, prompts in saved.items():
        save_prompts([PromptEntry(p) for p in prompts], tmp_path / "prompts" / f"{name}.jsonl")
    sets = run_prompt_sets(cfg, tmp_path)
    assert [[e.prompt for e in v] for v in (sets.train, sets.test, sets.heldout)] == list(saved.values())
    assert sets.train_sample == []  # a run from before the sample was written
