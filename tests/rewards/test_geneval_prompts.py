"""GenEval's prompt sets (grpo_vision/rewards/geneval_prompts.py) and `grpo-vision prompts geneval`."""

import collections
import json

import numpy as np
import pytest

from grpo_vision.cli import main
from grpo_vision.prompts import PromptsError, load_prompts
from grpo_vision.rewards.geneval import check_metadata
from grpo_vision.rewards.geneval_prompts import (
    EVALUATION, _a, _plural, draw, evaluation_entries, flat, read, training_entries,
)


def test_the_evaluation_set_is_genevals_553_prompts_by_task():
    entries = evaluation_entries()
    assert len(entries) == 553
    # GenEval's counts after its de-duplication: every class once alone, about 100 of each other task
    tags = collections.Counter(e.metadata["tag"] for e in entries)
    assert tags == {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100,
                    "color_attr": 100}
    assert entries[0].prompt == "a photo of a bench"
    assert entries[0].metadata == {"tag": "single_object", "include": [{"class": "bench", "count": 1}]}
    for e in entries:
        check_metadata(e.metadata, e.prompt)


def test_training_prompts_never_repeat_and_never_are_evaluation_prompts():
    train = training_entries(400, seed=0)
    prompts = [e.prompt for e in train]
    assert len(set(prompts)) == 400 and not set(prompts) & {e.prompt for e in evaluation_entries()}
    assert [e.prompt for e in training_entries(400, seed=0)] == prompts  # (n, seed) fixes the list
    assert [e.prompt for e in training_entries(400, seed=1)] != prompts
    # five tasks in turn (every single-object prompt is an evaluation one): 80 each
    assert collections.Counter(e.metadata["tag"] for e in train) == {
        "two_object": 80, "counting": 80, "colors": 80, "position": 80, "color_attr": 80}
    for e in train:
        check_metadata(e.metadata, e.prompt)


def test_the_templates_write_genevals_grammar_and_clauses():
    assert (_a("apple"), _a("umbrella"), _a("bench")) == ("an apple", "an umbrella", "a bench")
    assert (_plural("bus"), _plural("sheep"), _plural("clock")) == ("buses", "sheeps", "clocks")  # GenEval's rule
    names = ["cat", "dog", "person"]
    rng = np.random.default_rng(0)
    for _ in range(50):
        row = draw("counting", rng, names)
        k = row["include"][0]["count"]
        assert 2 <= k <= 4 and row["exclude"] == [{"class": row["include"][0]["class"], "count": k + 1}]
        assert draw("colors", rng, names)["include"][0]["class"] != "person"  # GenEval never colours a person
        pos = draw("position", rng, names)
        first, second = pos["include"]
        relation = second["position"][0]
        assert second["position"][1] == 0  # the clause points at the first object, the one named last
        assert pos["prompt"] == f"a photo of {_a(second['class'])} {relation} {_a(first['class'])}"


def test_the_command_writes_a_prompts_file_and_says_where_the_set_is(tmp_path, capsys):
    main(["prompts", "geneval"])
    assert str(EVALUATION) in capsys.readouterr().out
    main(["prompts", "geneval", "--out", str(tmp_path / "train.jsonl"), "--train", "10", "--seed", "3"])
    back = load_prompts(tmp_path / "train.jsonl")
    assert [(e.prompt, e.metadata) for e in back] == [(e.prompt, e.metadata) for e in training_entries(10, seed=3)]
    main(["prompts", "geneval", "--out", str(tmp_path / "eval.jsonl")])
    assert len(load_prompts(tmp_path / "eval.jsonl")) == 553


def test_the_command_refuses_a_folder_as_out_and_more_prompts_than_the_templates_give_before_drawing(
        tmp_path, capsys, monkeypatch):
    # before: --out FOLDER drew the prompts and failed writing them with a traceback, and --train
    # 10000000 drew for 83 s before saying how many the templates give
    from grpo_vision.rewards import geneval_prompts

    with pytest.raises(SystemExit) as exit_:
        main(["prompts", "geneval", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and capsys.readouterr().err == (
        f"grpo-vision: error: --out {tmp_path} is a folder; give the file to write, e.g. {tmp_path / 'out.jsonl'}\n")
    # by hand, what each template writes: two_object 80 x 79 ordered pairs; counting 80 classes x 3 counts;
    # colors 79 classes (never a person) x 10 colours; position 80 x 79 x 4 relations; color_attr 79 x 78 x 10 x 9;
    # less the 553 - 80 evaluation prompts of those five tasks
    assert geneval_prompts.training_capacity() == 6320 + 240 + 790 + 25280 + 554580 - 473 == 586737
    monkeypatch.setattr(geneval_prompts, "draw", lambda *args: pytest.fail("drew before refusing"))
    with pytest.raises(SystemExit) as exit_:
        main(["prompts", "geneval", "--out", str(tmp_path / "train.jsonl"), "--train", "10000000"])
    assert exit_.value.code == 2 and capsys.readouterr().err == (
        "grpo-vision: error: 10000000 training prompts: GenEval's templates give at most 586737 outside the "
        "evaluation set; ask for at most that many\n")
    assert not (tmp_path / "train.jsonl").exists()


def test_parse_reads_back_every_evaluation_and_training_prompts_metadata():
    from grpo_vision.rewards.geneval_prompts import parse

    for e in [*evaluation_entries(), *training_entries(500)]:
        assert parse(e.prompt) == e.metadata, e.prompt
    # "orange" is a class and a colour: alone it is the fruit, before a class it is the colour
    assert parse("a photo of an orange") == {"tag": "single_object", "include": [{"class": "orange", "count": 1}]}
    assert parse("A photo of  an orange dog")["include"] == [{"class": "dog", "count": 1, "color": "orange"}]
    assert parse("a red circle") is None and parse("a photo of a unicorn") is None
    # other class names (a ShapesWorld's shapes under the geneval reward with an open-vocabulary detector)
    assert parse("a photo of three circles", ["circle", "square"]) == {
        "tag": "counting", "include": [{"class": "circle", "count": 3}], "exclude": [{"class": "circle", "count": 4}]}


# ---------------------------------------------------------------- one reader, both shapes (flat and nested)


def test_genevals_file_and_the_commands_file_read_the_same(tmp_path):
    """GenEval's flat lines and `prompts geneval --out`'s nested ones are the same 553 prompts, and `flat`
    gives GenEval's own line back for either."""
    main(["prompts", "geneval", "--out", str(tmp_path / "eval.jsonl")])
    nested = read(tmp_path / "eval.jsonl")
    assert json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[0]) == {  # the clauses under 'metadata'
        "prompt": "a photo of a bench",
        "metadata": {"tag": "single_object", "include": [{"class": "bench", "count": 1}]}}
    genevals = read(EVALUATION)
    assert [(e.prompt, e.metadata, e.line) for e in nested] == [(e.prompt, e.metadata, e.line) for e in genevals]
    lines = EVALUATION.read_text().splitlines()
    assert [json.dumps(flat(e)) for e in nested] == lines  # GenEval's text, byte for byte, key order too
    # the two shapes may even share a file; a flat line's other fields travel with it
    (tmp_path / "mixed.jsonl").write_text(lines[0] + "\n\n# a comment\n" + json.dumps(
        {"prompt": "a photo of two cats", "metadata": {"tag": "counting", "include": [{"class": "cat", "count": 2}]}})
        + "\n" + json.dumps({"tag": "single_object", "include": [{"class": "cat", "count": 1}], "note": "x",
                             "prompt": " a photo of a cat "}) + "\n")
    mixed = read(tmp_path / "mixed.jsonl")
    assert [(e.prompt, e.line) for e in mixed] == [("a photo of a bench", 1), ("a photo of two cats", 4),
                                                   ("a photo of a cat", 5)]
    assert flat(mixed[1]) == {"tag": "counting", "include": [{"class": "cat", "count": 2}],
                              "prompt": "a photo of two cats"}
    assert flat(mixed[2]) == {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "note": "x",
                              "prompt": "a photo of a cat"}


@pytest.mark.parametrize("line, needle", [
    ("{not json", r"g.jsonl, line 2: not valid JSON"),
    ('{"tag": "single_object", "include": [{"class": "cat", "count": 1}]}',
     r"g.jsonl, line 2: a GenEval prompt is a JSON object with a non-empty 'prompt' and its clauses"),
    ('{"prompt": "a photo of a cat"}', r"g.jsonl, line 2: GenEval metadata needs a 'tag' \(one of single_object"),
    ('{"prompt": "a cat", "metadata": {"tag": "x", "include": [{"class": "cat", "count": 1}]}}',
     r"g.jsonl, line 2: GenEval metadata needs a 'tag'"),
    ('{"prompt": "a cat", "tag": "single_object", "metadata": {"include": [{"class": "cat", "count": 1}]}}',
     r"g.jsonl, line 2: a 'metadata' object and \['tag'\] beside it; write the clauses in one place"),
    ('{"prompt": "a cat", "tag": "colors", "include": [{"class": "cat", "count": 1, "color": "teal"}]}',
     r"g.jsonl, line 2: colour 'teal' is not one of GenEval's"),
])
def test_a_line_that_is_not_a_geneval_prompt_is_named(tmp_path, line, needle):
    path = tmp_path / "g.jsonl"
    path.write_text(EVALUATION.read_text().splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(PromptsError, match=needle):
        read(path)


def test_lines_split_at_newlines_only_nest_at_most_100_deep_and_are_utf8(tmp_path):
    # as in a prompts file (test_prompts.py): U+2028 inside a JSON string, a RecursionError, bytes that are not UTF-8
    path, cat = tmp_path / "g.jsonl", {"tag": "single_object", "include": [{"class": "cat", "count": 1}]}
    path.write_text(json.dumps({**cat, "prompt": "a photo\u2028of a cat"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert [e.prompt for e in read(path)] == ["a photo\u2028of a cat"]
    path.write_text(json.dumps({**cat, "prompt": "a"}) + "\n" + '{"prompt": "a", "include": ' + "[" * 100_000 +
                    "]" * 100_000 + "}\n")
    with pytest.raises(PromptsError, match=r"g.jsonl, line 2: lists and objects nested more than 100 levels deep"):
        read(path)
    path.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(PromptsError, match=r"g.jsonl is not UTF-8 text"):
        read(path)
    path.write_text("\n# nothing\n")
    with pytest.raises(PromptsError, match=r"g.jsonl holds no GenEval prompts"):
        read(path)
    with pytest.raises(PromptsError, match=r"GenEval prompts file not found: .*absent.jsonl"):
        read(tmp_path / "absent.jsonl")
