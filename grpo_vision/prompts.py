"""Prompt sources: plain text, JSONL, CSV/TSV, Parquet, a `datasets` folder, or rows in memory.

A JSONL entry, a table's row, may also carry its own reward weights and metadata, which route rewards
per entry (in a CSV cell, as JSON text):

    {"prompt": "a red circle", "rewards": {"clip": 1.0, "shapes_exact": 0.5}, "metadata": {"tag": "x"}}

The suffix decides: `.csv` / `.tsv` (a header row), `.parquet`, a folder (`Dataset.save_to_disk`),
`.jsonl` / `.json`; a file of another suffix is text, unless it looks like a table or binary (an
error: read as lines, a CSV's header would be trained on). The prompt column (a JSONL key) is
`column`: "" = 'prompt', else the one of 'caption' and 'text' a table has. A table's other columns are
ignored (datasets carry images and ids); a JSONL line's other keys are an error (a misspelt `rewards`
would train with the config's weights). In a text file blank lines and lines starting with `#` are
skipped, and the first other line decides between captions and JSONL (a `{` starts JSONL); a later
line starting with `{` in a plain-text file is an error, not a caption. Lines end at line breaks only: a
caption or JSON string may hold U+2028 and other separators. Errors name the file and line (a table's
row), and quote user text briefly.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from grpo_vision.config.load import brief
from grpo_vision.files import write_file
from grpo_vision.reading import MAX_DEPTH, depth, json_value, read_text, what_is

AUTO_COLUMNS = ("caption", "text")  # what datasets name their captions; taken when 'prompt' is absent
DELIMITERS = {".csv": ",", ".tsv": "\t"}
# Never captions one per line: read as text, a table's header would become a training prompt
STRUCTURED = (".arrow", ".feather", ".ipc", ".orc", ".avro", ".xlsx", ".xls", ".ods", ".pkl", ".pickle", ".npy",
              ".npz", ".h5", ".hdf5", ".zip", ".gz", ".bz2", ".xz", ".zst", ".tar", ".db", ".sqlite", ".yaml", ".yml",
              ".toml", ".xml", ".html")
FORMATS = ("give plain text (.txt, one caption per line), JSONL (.jsonl), a table (.csv, .tsv, .parquet) or a "
           "datasets folder (Dataset.save_to_disk)")


class PromptsError(ValueError):
    """A prompts file problem; the message names the file and the line."""


@dataclass
class PromptEntry:
    prompt: str
    rewards: dict[str, float] | None = None  # per-entry reward weights; None = the config's weights
    metadata: dict = field(default_factory=dict)  # passed to reward functions as-is
    line: int = 0  # line number in its file (a table's row number), for error messages


def load_prompts(path: str | Path, *, column: str = "") -> list[PromptEntry]:
    """The entries of the prompts file or datasets folder `path`; `column`: the prompt column of a table
    or the key of a JSONL file ("" = 'prompt', else 'caption' or 'text'; a text file has none)."""
    path = Path(path)
    if path.is_dir():
        return _load_dataset_folder(path, column)
    if what_is(path) == "missing":
        raise PromptsError(f"prompts file not found: {path}")
    if what_is(path):  # a FIFO would block the read for ever
        raise PromptsError(f"{path} is {what_is(path)}, not a prompts file: {FORMATS}")
    suffix = path.suffix.lower()
    if suffix in DELIMITERS:
        return _load_delimited(path, DELIMITERS[suffix], column)
    if suffix == ".parquet":
        return _load_parquet(path, column)
    if suffix not in ("", ".txt", ".jsonl", ".json"):
        _refuse_structured(path, suffix)
    lines = read_lines(path)
    first = next((ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")), "")
    if suffix in (".jsonl", ".json") or first.startswith("{"):  # decided by the first prompt line
        return _load_jsonl(path, lines, column)
    entries = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("{"):  # else trained on as a literal caption, braces and all
            raise PromptsError(f"{path}, line {number}: looks like JSON, but the file is read as plain text (its "
                               f"first prompt line is not JSON): rename it to {path.stem}.jsonl and write every "
                               "line as JSON, or write this line as a plain caption")
        entries.append(PromptEntry(text, line=number))
    if not entries:
        raise PromptsError(f"{path} holds no prompts: write one caption per line, or JSONL with a 'prompt' field")
    return entries


def prompt_entries(source, column: str = "") -> list[PromptEntry]:
    """Entries from any prompt source: a path (str or Path: `load_prompts`), a `datasets.Dataset` or
    DatasetDict (`entries_from_dataset`), or rows of captions, dicts or PromptEntry (`entries_from_rows`)."""
    if isinstance(source, (str, Path)):
        return load_prompts(source, column=column)
    if hasattr(source, "column_names"):
        return entries_from_dataset(source, column)
    return entries_from_rows(source, column)


def entries_from_dataset(ds, column: str = "", where: str = "the dataset") -> list[PromptEntry]:
    """The entries of a `datasets.Dataset` (a DatasetDict: its 'train' split), one per row: the prompt
    column (see `choose_column`) and optional `rewards` and `metadata` columns; other columns are not read."""
    names = ds.column_names
    if isinstance(names, dict):  # a DatasetDict: column names by split
        if "train" not in names:
            raise PromptsError(f"{where} holds the splits {_names(names)}, none named 'train': save or pass the one "
                               "split to read (dataset['<split>'])")
        ds, names, where = ds["train"], names["train"], f"{where} (split 'train')"
    if names is None:  # an IterableDataset whose columns are known only by reading it
        return entries_from_rows(ds, column, where)
    chosen = choose_column(names, column, where)
    rows = ds.select_columns([c for c in (chosen, "rewards", "metadata") if c in names]).to_list()
    return _entries(rows, chosen, where, "row")


def entries_from_rows(rows: Iterable, column: str = "", where: str = "the prompts") -> list[PromptEntry]:
    """Entries from rows, each a caption (str), a mapping (the prompt column, see `choose_column`, and
    optional `rewards` and `metadata`; other keys are not read) or a PromptEntry, kept as it is; a pandas
    DataFrame gives its records."""
    if isinstance(rows, (str, bytes, Mapping)):  # iterated, its characters or keys would be the captions
        raise PromptsError(f"{where}: rows are a list of captions or dicts, got one {type(rows).__name__}")
    if hasattr(rows, "columns") and hasattr(rows, "to_dict"):  # a DataFrame iterates its column names
        rows = rows.to_dict("records")
    rows = list(rows)
    maps = [r for r in rows if isinstance(r, Mapping)]
    keys = list(dict.fromkeys(k for r in maps for k in r))  # every key, in the order first seen
    chosen = choose_column(keys, column, where) if maps else column or "prompt"
    return _entries(rows, chosen, where, "row")


def choose_column(columns: Iterable[str], column: str, where: str) -> str:
    """The prompt column of a table with `columns`: `column` where given, else 'prompt', else the one
    of 'caption' and 'text' it has; PromptsError naming `where` and its columns otherwise."""
    columns = list(columns)
    if column and column in columns:
        return column
    found = [c for c in ("prompt",) + AUTO_COLUMNS if c in columns]
    if not column and found and (found[0] == "prompt" or len(found) == 1):
        return found[0]
    which = f"no column {column!r}" if column else (
        "both 'caption' and 'text', and no 'prompt'" if found else "no column 'prompt', 'caption' or 'text'")
    raise PromptsError(f"{where} has {which} (its columns: {_names(columns) if columns else 'none'}); name the "
                       "prompt column with data.prompt_column (data.eval_prompt_column, data.heldout_prompt_column for those "
                       "sources) or --prompt-column")


def _names(columns) -> str:
    return ", ".join(brief(str(c), 40) for c in list(columns)[:20]) + (
        f" and {len(columns) - 20} more" if len(columns) > 20 else "")


def _entries(rows: list, column: str, where: str, unit: str, numbers: list[int] | None = None) -> list[PromptEntry]:
    """An entry per row of a table or of rows in memory, named by `numbers` (1, 2, ... by default) in `unit`s."""
    entries = []
    for number, row in zip(numbers or range(1, len(rows) + 1), rows):
        at = f"{where}, {unit} {number}"
        if isinstance(row, PromptEntry):
            entries.append(row)
        elif isinstance(row, str):
            if not row.strip():
                raise PromptsError(f"{at}: an empty caption")
            entries.append(PromptEntry(row.strip(), line=number))
        elif isinstance(row, Mapping):
            prompt = row.get(column)
            if not isinstance(prompt, str) or not prompt.strip():
                raise PromptsError(f"{at}: {column!r} must be a non-empty string, got {brief(prompt)}")
            entries.append(_entry(prompt, _cell(row.get("rewards"), f"{at}, 'rewards'"),
                                  _cell(row.get("metadata"), f"{at}, 'metadata'"), at, number))
        else:
            raise PromptsError(f"{at}: a row is a caption, a dict with {column!r} or a PromptEntry, got {brief(row)}")
    if not entries:
        raise PromptsError(f"{where} holds no prompts")
    return entries


def _cell(value, where: str):
    """A table's rewards or metadata cell: JSON text (a CSV's), an object, or nothing (None, blank). A
    struct column fills the fields another row has with null: those are left out."""
    if isinstance(value, str):
        return parse_json_line(value, where) if value.strip() else None
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if v is not None}
        if depth(value) > MAX_DEPTH:
            raise PromptsError(f"{where}: lists and objects nested more than {MAX_DEPTH} levels deep; write "
                               "flatter JSON")
    return value


def _entry(prompt: str, rewards, metadata, where: str, number: int) -> PromptEntry:
    """A checked entry: `rewards` maps reward names to finite numbers (or is None), `metadata` is an
    object (or None) that the run can save as JSON."""
    if rewards is not None and (not isinstance(rewards, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for k, v in rewards.items())):
        raise PromptsError(f"{where}: 'rewards' must map reward names to finite numbers, e.g. {{\"clip\": 1.0}}")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise PromptsError(f"{where}: 'metadata' must be an object")
    try:  # the run saves its prompts as JSONL (save_prompts): a date or bytes from a table would fail there
        json.dumps(metadata)
    except (TypeError, ValueError) as e:
        raise PromptsError(f"{where}: 'metadata' holds a value JSON cannot write ({e})") from None
    return PromptEntry(prompt.strip(), {k: float(v) for k, v in rewards.items()} if rewards else None, metadata,
                       number)


def read_lines(path: Path, fix: str = FORMATS) -> list[str]:
    """The lines of the UTF-8 text file `path`, split at line breaks only ("\\n", "\\r\\n", "\\r", which
    reading turns into "\\n"): str.splitlines() also splits at U+2028, U+0085 and other separators that a
    JSON string or a caption may hold. A leading byte-order mark is dropped; a FIFO or a folder is refused
    unopened (reading.py), `fix` saying what to give instead."""
    return read_text(path, PromptsError, fix).split("\n")


def parse_json_line(text: str, where: str):
    """The JSON value on one line, or PromptsError naming `where` when it is not JSON or nests more
    than MAX_DEPTH lists and objects."""
    return json_value(text, where, PromptsError)


def _load_jsonl(path: Path, lines: list[str], column: str) -> list[PromptEntry]:
    rows = [(n, parse_json_line(t.strip(), f"{path}, line {n}")) for n, t in enumerate(lines, start=1)
            if t.strip() and not t.strip().startswith("#")]
    keys = list(dict.fromkeys(k for _, row in rows if isinstance(row, dict) for k in row))
    chosen = choose_column(keys, column, str(path)) if keys else column or "prompt"
    entries = []
    for number, row in rows:
        where = f"{path}, line {number}"
        if not isinstance(row, dict) or not isinstance(row.get(chosen), str) or not row[chosen].strip():
            raise PromptsError(f"{where}: each JSONL line must be an object with a non-empty string {chosen!r}")
        if "metadata" not in row and {"tag", "include"} <= set(row):
            # GenEval's own flat evaluation_metadata.jsonl line: its fields are the metadata its reward reads,
            # as in the nested {"prompt", "metadata": {...}} entries `prompts geneval --out` writes
            row = {chosen: row[chosen], **({"rewards": row["rewards"]} if "rewards" in row else {}),
                   "metadata": {k: v for k, v in row.items() if k not in (chosen, "rewards")}}
        unknown = set(row) - {chosen, "rewards", "metadata"}
        if unknown:
            raise PromptsError(f"{where}: unknown field(s) {brief(sorted(unknown))}; allowed: {chosen}, rewards, "
                               "metadata")
        entries.append(_entry(row[chosen], row.get("rewards"), row.get("metadata"), where, number))
    if not entries:
        raise PromptsError(f"{path} holds no prompts: write one caption per line, or JSONL with a 'prompt' field")
    return entries


def _load_delimited(path: Path, delimiter: str, column: str) -> list[PromptEntry]:
    """A CSV or TSV file with a header row; a row's number is the line it starts on (a quoted cell may
    span lines)."""
    rows, start = [], 1
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            # strict: an unclosed quote is an error, not the rest of the file read as one caption
            reader = csv.reader(f, delimiter=delimiter, strict=True)
            for cells in reader:
                if any(c.strip() for c in cells):  # a blank line is no row
                    rows.append((start, cells))
                start = reader.line_num + 1
    except UnicodeDecodeError as e:
        raise PromptsError(f"{path} is not UTF-8 text ({e}); save it as UTF-8") from None
    except csv.Error as e:
        raise PromptsError(f"{path}, line {start}: not valid {path.suffix[1:].upper()} ({e})") from None
    if not rows:
        raise PromptsError(f"{path} holds no prompts: its first row names the columns, e.g. 'prompt'")
    header = [c.strip() for c in rows[0][1]]
    twice = sorted({c for c in header if c and header.count(c) > 1})
    if twice:
        raise PromptsError(f"{path}, line {rows[0][0]}: the header names {_names(twice)} twice; name each column once")
    chosen = choose_column([c for c in header if c], column, str(path))
    table = []
    for number, cells in rows[1:]:
        if len(cells) > len(header):  # an unquoted separator inside a caption
            raise PromptsError(f"{path}, line {number}: {len(cells)} cells, the header has {len(header)}: quote a "
                               f"cell that holds a {'comma' if delimiter == ',' else 'tab'} in double quotes")
        table.append(dict(zip(header, cells)))
    return _entries(table, chosen, str(path), "line", [n for n, _ in rows[1:]])


def _load_parquet(path: Path, column: str) -> list[PromptEntry]:
    """A Parquet file, only its prompt, rewards and metadata columns read (a dataset's images stay on disk)."""
    pa, pq = _need("pyarrow", path), _need("pyarrow.parquet", path)
    try:
        names = pq.read_schema(path).names
        chosen = choose_column(names, column, str(path))
        table = pq.read_table(path, columns=[c for c in (chosen, "rewards", "metadata") if c in names])
    except (OSError, pa.ArrowException) as e:
        raise PromptsError(f"{path} is not a Parquet file this can read ({e})") from None
    return _entries(table.to_pylist(), chosen, str(path), "row")


def _load_dataset_folder(path: Path, column: str) -> list[PromptEntry]:
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    if not any((path / name).is_file() for name in ("state.json", "dataset_dict.json")):
        raise PromptsError(f"{path} is a folder, not a datasets folder (Dataset.save_to_disk writes state.json "
                           f"there): {FORMATS}")
    datasets = _need("datasets", path)
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # a damaged state.json fails inside datasets as a KeyError or a TypeError too
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise PromptsError(f"{path}: datasets cannot load this folder ({type(e).__name__}: {first}); write it again "
                           "with Dataset.save_to_disk") from None
    return entries_from_dataset(ds, column, str(path))


def _need(module: str, path: Path):
    """The module `module` imported, or PromptsError: Parquet and datasets folders need the optional
    `datasets` library (it brings pyarrow)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise PromptsError(f"reading {path} needs the datasets library ({module} is not installed): pip install "
                           "datasets") from None


def _refuse_structured(path: Path, suffix: str) -> None:
    """PromptsError for a file of another suffix that holds a table, an archive or binary data: read as
    lines, its header or bytes would be trained on as captions."""
    with path.open("rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        raise PromptsError(f"{path} looks like Parquet: rename it to {path.stem}.parquet")
    if suffix in STRUCTURED or b"\0" in head:
        raise PromptsError(f"{path}: a {suffix} file is not a prompts file this reads: {FORMATS}")


def save_prompts(entries: list[PromptEntry], path: str | Path, root: str | Path | None = None) -> None:
    """Write entries as a JSONL prompts file that `load_prompts` reads back (prompt, rewards, metadata);
    `root`: the run folder that `path` lies in a sub-folder of (files.write_file)."""
    rows = [{"prompt": e.prompt, **({"rewards": e.rewards} if e.rewards else {}),
             **({"metadata": e.metadata} if e.metadata else {})} for e in entries]
    write_file(path, "".join(json.dumps(row) + "\n" for row in rows), root)
