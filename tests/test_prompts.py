"""Prompt sources: text, JSONL, CSV/TSV, Parquet, datasets and rows in memory; per-entry reward routing; errors
that name the file and the line."""

import json

import pytest

from grpo_vision.config import load_config
from grpo_vision.policy import Bundle
from grpo_vision.splits import checked_prompt_sets
from grpo_vision.policy import prompt_problem
from grpo_vision.prompts import PromptsError, load_prompts
from tests.helpers import MICRO


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
    # the run saved its prompts
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
    # str.splitlines() split lines at U+2028 inside a JSON string, and the error blamed the JSON
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
    # a rejected 10 MB prompt line was echoed whole to stderr
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
    """A later version may draw a kind's sets otherwise (the split changed once): a run's saved prompts win."""
    from grpo_vision.splits import prompt_lists, run_prompt_sets
    from grpo_vision.prompts import PromptEntry, save_prompts

    cfg = load_config("configs/shapes.yaml")
    assert run_prompt_sets(cfg, tmp_path).train == prompt_lists(cfg).train  # nothing saved: the config's
    saved = {"train": ["a red circle", "a red circle"], "test": ["a blue square"], "heldout": ["a blue triangle"]}
    for name, prompts in saved.items():
        save_prompts([PromptEntry(p) for p in prompts], tmp_path / "prompts" / f"{name}.jsonl")
    sets = run_prompt_sets(cfg, tmp_path)
    assert [[e.prompt for e in v] for v in (sets.train, sets.test, sets.heldout)] == list(saved.values())
    assert sets.train_sample == []  # no train_sample.jsonl: a run saves only the sets it has


# ---- Prompt sources: tables, datasets, rows in memory, the prompt column

def test_a_csv_header_names_the_columns_and_is_never_a_prompt(tmp_path):
    # Before, a .csv was read as lines: "prompt,rewards,metadata" was trained on as a caption.
    # A quoted cell holds the separator, and a doubled quote is one quote (RFC 4180)
    path = write(tmp_path, "p.csv", 'prompt,rewards,metadata\n'
                                    '"a red circle, ""big"" and round","{""clip"": 2}","{""tag"": ""x""}"\n'
                                    '\n'
                                    'a blue square,,\n')
    a, b = load_prompts(path)
    assert (a.prompt, a.rewards, a.metadata, a.line) == ('a red circle, "big" and round', {"clip": 2.0}, {"tag": "x"},
                                                         2)
    assert (b.prompt, b.rewards, b.metadata, b.line) == ("a blue square", None, {}, 4)  # line 3 is blank


def test_a_tsv_needs_no_quotes_and_its_caption_column_is_found(tmp_path):
    path = write(tmp_path, "p.tsv", "id\tcaption\n7\ta red circle, big\n8\ta blue square\n")
    assert [(e.prompt, e.line) for e in load_prompts(path)] == [("a red circle, big", 2), ("a blue square", 3)]
    assert [e.prompt for e in load_prompts(path, column="id")] == ["7", "8"]  # another column, when named


@pytest.mark.parametrize("text, column, message", [
    ("id,caption,text\n1,a,b\n", "", "has both 'caption' and 'text', and no 'prompt' (its columns: 'id', "
                                     "'caption', 'text'); name the prompt column with data.prompt_column "
                                     "(data.eval_prompt_column, data.heldout_prompt_column for those sources) or "
                                     "--prompt-column"),
    ("id,caption\n1,a\n", "txt", "has no column 'txt' (its columns: 'id', 'caption'); name the prompt column with "
                                 "data.prompt_column (data.eval_prompt_column, data.heldout_prompt_column for those "
                                 "sources) or --prompt-column"),
    ("url,tags\nx,y\n", "", "has no column 'prompt', 'caption' or 'text' (its columns: 'url', 'tags'); name"),
    ("prompt\na red circle, big\n", "", ", line 2: 2 cells, the header has 1: quote a cell that holds a comma in "
                                        "double quotes"),
    ('prompt\n"a red circle\nno closing quote\n', "", ", line 2: not valid CSV (unexpected end of data)"),
    ("prompt,prompt\na,b\n", "", ", line 1: the header names 'prompt' twice; name each column once"),
    ("prompt,rewards\na,{clip: 1}\n", "", ", line 2, 'rewards': not valid JSON (Expecting property name enclosed "
                                          "in double quotes at column 2)"),
    ('prompt,rewards\na,"{""clip"": true}"\n', "", ", line 2: 'rewards' must map reward names to finite numbers"),
    ("prompt,metadata\na,[1]\n", "", ", line 2: 'metadata' must be an object"),
    ("prompt,id\n,1\n", "", ", line 2: 'prompt' must be a non-empty string, got ''"),
    ("prompt\n", "", " holds no prompts"),
])
def test_a_bad_table_is_one_line_naming_the_file_and_its_columns(tmp_path, text, column, message):
    path = write(tmp_path, "p.csv", text)
    with pytest.raises(PromptsError) as err:
        load_prompts(path, column=column)
    assert str(err.value).startswith(f"{path}{'' if message[0] in ',' else ' '}{message.lstrip()}"), str(err.value)
    assert "\n" not in str(err.value)


def test_jsonl_takes_the_prompt_column_as_its_key(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"caption": "a red circle", "metadata": {"k": 1}}\n'
                                      '{"caption": "a blue square"}\n')
    assert [(e.prompt, e.metadata) for e in load_prompts(path)] == [("a red circle", {"k": 1}), ("a blue square", {})]
    assert [e.prompt for e in load_prompts(path, column="caption")] == ["a red circle", "a blue square"]
    with pytest.raises(PromptsError) as err:
        load_prompts(path, column="prompt")
    assert str(err.value) == (f"{path} has no column 'prompt' (its columns: 'caption', 'metadata'); name the prompt "
                              "column with data.prompt_column (data.eval_prompt_column, data.heldout_prompt_column "
                              "for those sources) or --prompt-column")
    mixed = write(tmp_path, "m.jsonl", '{"prompt": "a"}\n{"caption": "b"}\n')  # 'prompt' wins; line 2 lacks it
    with pytest.raises(PromptsError, match="m.jsonl, line 2: each JSONL line must be an object with a non-empty "
                                           "string 'prompt'"):
        load_prompts(mixed)
    extra = write(tmp_path, "e.jsonl", '{"text": "a", "url": "x"}\n')  # JSONL stays strict: a typo is named
    with pytest.raises(PromptsError, match=r"e.jsonl, line 1: unknown field\(s\) \['url'\]; allowed: text, rewards"):
        load_prompts(extra)


def test_parquet_reads_its_prompt_column_and_drops_the_nulls_a_struct_column_adds(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    # a struct column has every row's fields: row 1's rewards come back {"clip": 1.0, "aesthetic": None}
    table = pa.table({"text": ["a red circle", "a blue square"], "image": [b"\x89PNG", b"\x89PNG"],
                      "rewards": [{"clip": 1.0}, {"aesthetic": 0.5}], "metadata": ['{"k": [1, 2]}', None]})
    pq.write_table(table, tmp_path / "p.parquet")
    assert pq.read_table(tmp_path / "p.parquet")["rewards"].to_pylist()[0] == {"clip": 1.0, "aesthetic": None}
    a, b = load_prompts(tmp_path / "p.parquet")
    assert (a.prompt, a.rewards, a.metadata, a.line) == ("a red circle", {"clip": 1.0}, {"k": [1, 2]}, 1)
    assert (b.prompt, b.rewards, b.metadata, b.line) == ("a blue square", {"aesthetic": 0.5}, {}, 2)
    with pytest.raises(PromptsError) as err:
        load_prompts(tmp_path / "p.parquet", column="caption")
    assert str(err.value).startswith(f"{tmp_path / 'p.parquet'} has no column 'caption' (its columns: 'text', "
                                     "'image', 'rewards', 'metadata')")
    write(tmp_path, "bad.parquet", "prompt\na red circle\n")  # a CSV named .parquet
    with pytest.raises(PromptsError, match=r"bad.parquet is not a Parquet file this can read \("):
        load_prompts(tmp_path / "bad.parquet")


def test_a_datasets_folder_and_a_dataset_dict_folder(tmp_path):
    datasets = pytest.importorskip("datasets")

    ds = datasets.Dataset.from_dict({"caption": ["a red circle", "a blue square"], "id": [7, 8],
                                     "rewards": ['{"clip": 0.5}', ""]})
    ds.save_to_disk(str(tmp_path / "ds"))
    entries = load_prompts(tmp_path / "ds")  # before: "prompts file not found" (a dataset folder was not a source)
    assert [(e.prompt, e.rewards, e.line) for e in entries] == [("a red circle", {"clip": 0.5}, 1),
                                                                ("a blue square", None, 2)]
    datasets.DatasetDict({"train": ds.select([1]), "test": ds}).save_to_disk(str(tmp_path / "dd"))
    assert [e.prompt for e in load_prompts(tmp_path / "dd")] == ["a blue square"]  # the 'train' split
    datasets.DatasetDict({"test": ds, "validation": ds}).save_to_disk(str(tmp_path / "nd"))
    with pytest.raises(PromptsError) as err:
        load_prompts(tmp_path / "nd")
    assert str(err.value) == (f"{tmp_path / 'nd'} holds the splits 'test', 'validation', none named 'train': save "
                              "or pass the one split to read (dataset['<split>'])")
    (tmp_path / "plain").mkdir()
    with pytest.raises(PromptsError, match=r"plain is a folder, not a datasets folder \(Dataset.save_to_disk writes "
                                           r"state.json there\): give plain text \(.txt"):
        load_prompts(tmp_path / "plain")


def test_without_datasets_a_folder_is_one_line_naming_the_install(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # as if not installed: import fails
    with pytest.raises(PromptsError) as err:
        load_prompts(tmp_path / "ds")
    assert str(err.value) == (f"reading {tmp_path / 'ds'} needs the datasets library (datasets is not installed): "
                              "pip install datasets")


def test_an_in_memory_dataset_or_list_gives_entries(tmp_path):
    from grpo_vision.prompts import PromptEntry, entries_from_dataset, entries_from_rows, prompt_entries

    assert [(e.prompt, e.line) for e in entries_from_rows([" a red circle ", "a blue square"])] == [
        ("a red circle", 1), ("a blue square", 2)]
    rows = [{"text": "a red circle", "rewards": {"clip": 2}, "metadata": {"k": 1}}, PromptEntry("a dog", line=9)]
    a, b = prompt_entries(rows)
    assert (a.prompt, a.rewards, a.metadata, a.line) == ("a red circle", {"clip": 2.0}, {"k": 1}, 1)
    assert b == PromptEntry("a dog", line=9)  # kept as it is
    with pytest.raises(PromptsError, match=r"^the prompts, row 2: an empty caption$"):
        entries_from_rows(["a", "  "])
    with pytest.raises(PromptsError, match=r"^my rows, row 1: 'prompt' must be a non-empty string, got 3$"):
        entries_from_rows([{"prompt": 3}], where="my rows")
    with pytest.raises(PromptsError, match="^the prompts holds no prompts$"):
        entries_from_rows([])
    with pytest.raises(PromptsError, match="^the prompts: rows are a list of captions or dicts, got one dict$"):
        entries_from_rows({"prompt": "a red circle"})  # iterated, its key 'prompt' would be the caption
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"caption": ["a red circle"], "id": [7]})  # it iterates its column names
    assert [(e.prompt, e.line) for e in prompt_entries(frame)] == [("a red circle", 1)]
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"prompt": ["a red circle"], "caption": ["unused"],
                                     "metadata": [{"when": "x", "n": None}]})
    assert [(e.prompt, e.metadata) for e in prompt_entries(ds)] == [("a red circle", {"when": "x"})]
    assert [e.prompt for e in entries_from_dataset(ds, "caption")] == ["unused"]
    with pytest.raises(PromptsError, match=r"^the dataset \(split 'train'\) has no column 'txt' \(its columns: "
                                           r"'prompt', 'caption', 'metadata'\)"):
        entries_from_dataset(datasets.DatasetDict({"train": ds}), "txt")
    import datetime

    dated = datasets.Dataset.from_dict({"prompt": ["a"], "metadata": [{"when": datetime.date(2020, 1, 1)}]})
    with pytest.raises(PromptsError, match=r"^the dataset, row 1: 'metadata' holds a value JSON cannot write \("):
        entries_from_dataset(dated)  # else the run fails writing prompts/train.jsonl at its start


def test_a_structured_file_of_another_suffix_is_never_read_as_lines(tmp_path):
    for name, data in (("p.xlsx", b"PK\x03\x04 a zipped workbook"), ("p.arrow", b"\xff\xff\xff\xff\x00")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(PromptsError) as err:
            load_prompts(tmp_path / name)
        suffix = name[1:]
        assert str(err.value) == (f"{tmp_path / name}: a {suffix} file is not a prompts file this reads: give plain "
                                  "text (.txt, one caption per line), JSONL (.jsonl), a table (.csv, .tsv, .parquet) "
                                  "or a datasets folder (Dataset.save_to_disk)")
    (tmp_path / "p.dat").write_bytes(b"PAR1\x15\x04")
    with pytest.raises(PromptsError, match=r"p.dat looks like Parquet: rename it to p.parquet$"):
        load_prompts(tmp_path / "p.dat")
    (tmp_path / "p.bin").write_bytes(b"a red\x00circle\n")
    with pytest.raises(PromptsError, match=r"p.bin: a .bin file is not a prompts file this reads"):
        load_prompts(tmp_path / "p.bin")
    # text of another suffix, or none, stays one caption per line
    for name in ("captions", "captions.list"):
        assert [e.prompt for e in load_prompts(write(tmp_path, name, "a red circle\n"))] == ["a red circle"]


def test_a_table_round_trips_through_the_run_folders_jsonl(tmp_path):
    from grpo_vision.prompts import save_prompts

    path = write(tmp_path, "p.csv", 'caption,rewards,metadata\n"a, b",,"{""k"": [1, {""x"": null}]}"\n'
                                    'c,"{""clip"": 1.5}",\n')
    entries = load_prompts(path)
    save_prompts(entries, tmp_path / "run" / "prompts" / "train.jsonl")
    back = load_prompts(tmp_path / "run" / "prompts" / "train.jsonl")
    assert [(e.prompt, e.rewards, e.metadata) for e in back] == [("a, b", None, {"k": [1, {"x": None}]}),
                                                                 ("c", {"clip": 1.5}, {})]


def test_data_prompt_column_reaches_every_prompts_file_of_the_config(tmp_path):
    from grpo_vision.splits import prompt_lists

    train = write(tmp_path, "train.csv", "caption,text\nx,prompt 1\ny,prompt 2\nz,prompt 3\n")
    evals = write(tmp_path, "eval.jsonl", '{"text": "prompt 3"}\n')
    heldout = write(tmp_path, "heldout.txt", "prompt 9\n")  # a text file has no column: read as before
    llama = ["policy.kind=llama", f"data.train_prompts={train}", f"data.eval_prompts={evals}"]
    with pytest.warns(UserWarning, match=r"^1 of the 3 training prompts of .*train.csv is also in data.eval_prompts "
                                         r"\(.*eval.jsonl\) and is not trained on"):
        sets = prompt_lists(load_config(None, [*llama, "data.prompt_column=text", f"data.heldout_prompts={heldout}",
                                               "sample.prompts_per_step=2"]))
    assert [[e.prompt for e in s] for s in (sets.train, sets.test, sets.heldout)] == [
        ["prompt 1", "prompt 2"], ["prompt 3"], ["prompt 9"]]  # prompt 3 is an eval prompt: never trained on
    with pytest.raises(PromptsError, match=r"train.csv has both 'caption' and 'text', and no 'prompt'"):
        prompt_lists(load_config(None, llama))


def test_prompt_column_on_the_command_line_reaches_the_loader(tmp_path, monkeypatch, capsys):
    import grpo_vision.step.load as load
    import grpo_vision.prompts as prompts
    from grpo_vision.cli import main
    from grpo_vision.config import ConfigError

    read = {}
    real = prompts.load_prompts
    monkeypatch.setattr(prompts, "load_prompts",
                        lambda path, column="": read.setdefault(column, real(path, column=column)))

    def stop(*args, **kwargs):  # the prompts are read before the model is loaded: stop there
        raise ConfigError("no model here")

    monkeypatch.setattr(load, "load_run", stop)
    table = write(tmp_path, "p.csv", "caption,text\na red circle,a blue square\n")
    for column, needle in (("", "p.csv has both 'caption' and 'text'"), ("text", "no model here")):
        with pytest.raises(SystemExit) as exit_info:
            main(["sample", str(tmp_path / "run"), "--prompts", str(table), "--out", str(tmp_path / "out"),
                  *(["--prompt-column", column] if column else [])])
        assert exit_info.value.code == 2 and needle in capsys.readouterr().err
    assert [e.prompt for e in read["text"]] == ["a blue square"]


def test_a_geneval_flat_line_trains_with_its_clauses_as_metadata(tmp_path):
    """GenEval's own evaluation_metadata.jsonl line: the tag, include (and any other field) become the entry's
    metadata, as in the nested lines `prompts geneval --out` writes; the same entry either way."""
    flat = {"tag": "counting", "include": [{"class": "dog", "count": 2}], "prompt": "a photo of two dogs"}
    nested = {"prompt": "a photo of two dogs", "metadata": {"tag": "counting", "include": [{"class": "dog", "count": 2}]}}
    (tmp_path / "flat.jsonl").write_text(json.dumps(flat) + "\n")
    (tmp_path / "nested.jsonl").write_text(json.dumps(nested) + "\n")
    (entry,) = load_prompts(tmp_path / "flat.jsonl")
    assert (entry.prompt, entry.metadata, entry.rewards) == ("a photo of two dogs", nested["metadata"], None)
    assert load_prompts(tmp_path / "nested.jsonl")[0].metadata == entry.metadata


def test_a_datasets_folder_with_a_damaged_state_is_one_line_naming_it(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"prompt": ["a red circle"]}).save_to_disk(str(tmp_path / "ds"))
    state = json.loads((tmp_path / "ds" / "state.json").read_text())
    del state["_data_files"]  # was a KeyError traceback from inside datasets
    (tmp_path / "ds" / "state.json").write_text(json.dumps(state))
    with pytest.raises(PromptsError) as err:
        load_prompts(tmp_path / "ds")
    assert str(err.value) == (f"{tmp_path / 'ds'}: datasets cannot load this folder (KeyError: '_data_files'); write "
                              "it again with Dataset.save_to_disk")


def test_training_prompts_that_are_evaluation_prompts_are_counted_and_too_few_refused(tmp_path):
    """2 of 3 training prompts were dropped without a line, and the run trained on 1."""
    from grpo_vision.config import ConfigError
    from grpo_vision.splits import prompt_lists

    (tmp_path / "train.txt").write_text("a red circle\na blue square\na red square\n")
    (tmp_path / "eval.txt").write_text("a red circle\na blue square\n")
    (tmp_path / "one.txt").write_text("a red circle\n")
    base = [f"data.train_prompts={tmp_path / 'train.txt'}", f"data.eval_prompts={tmp_path / 'eval.txt'}"]
    with pytest.warns(UserWarning) as said:
        sets = prompt_lists(load_config(MICRO, [*base, "sample.prompts_per_step=1"]))
    assert [e.prompt for e in sets.train] == ["a red square"]
    assert str(said[0].message) == (f"2 of the 3 training prompts of {tmp_path / 'train.txt'} are also in "
                                    f"data.eval_prompts ({tmp_path / 'eval.txt'}) and are not trained on (evaluation "
                                    "prompts never are); 1 remains")
    with pytest.warns(UserWarning, match=r"^1 of the 3 training prompts .* is also in .* and is not trained on .*; "
                                         r"2 remain$"):  # singular and plural as English has them
        prompt_lists(load_config(MICRO, [f"data.train_prompts={tmp_path / 'train.txt'}", "sample.prompts_per_step=1",
                                         f"data.eval_prompts={tmp_path / 'one.txt'}"]))
    with pytest.raises(ConfigError, match=r"; 1 remains, fewer than sample.prompts_per_step=2: train on other prompts"):
        prompt_lists(load_config(MICRO, [*base, "sample.prompts_per_step=2"]))
