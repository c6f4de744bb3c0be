"""Reading what anyone hands us (grpo_vision/reading.py): a FIFO, a folder or a device is refused without being
opened, a byte that is not UTF-8 is named by its line, JSON is bounded in depth: one line, never a traceback or
a hang. The folders, logs and configs that use it are tested beside their modules (evaluation/test_geneval_bench,
run/test_alerts, ...)."""

import os
import re

import pytest

from grpo_vision.config import ConfigError, load_config
from grpo_vision.prompts import PromptsError, load_prompts
from grpo_vision.reading import json_lines, read_text, regular_file
from tests.helpers import within


def test_a_fifo_a_folder_or_a_device_is_refused_unopened(tmp_path):
    fifo = tmp_path / "prompts.txt"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO (named pipe)"), (tmp_path, "a folder"), ("/dev/null", "a character device")):
        with within(20), pytest.raises(PromptsError, match=rf"^{path} is {re.escape(kind)}, not a file: give one$"):
            read_text(path, PromptsError, "give one")
    with pytest.raises(PromptsError, match=rf"^{tmp_path / 'absent'} not found: give one$"):
        regular_file(tmp_path / "absent", PromptsError, "give one")
    # a prompts file or a config: before, a FIFO was "not found"
    with within(20), pytest.raises(PromptsError, match=rf"^{fifo} is a FIFO \(named pipe\), not a prompts file: give "
                                                       "plain text"):
        load_prompts(fifo)
    with within(20), pytest.raises(ConfigError, match=rf"^{fifo} is a FIFO \(named pipe\), not a config file: give a "
                                                      "YAML file$"):
        load_config(fifo)


def test_a_byte_that_is_not_utf8_is_named_by_its_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"a red circle\r\na blue square\n\xef\xbb\xbfa \xff green\n")
    with pytest.raises(PromptsError, match=rf"^{path} is not UTF-8 text \(line 3: byte 0xff\); save it as UTF-8$"):
        load_prompts(path)
    path.write_bytes(b"\xef\xbb\xbfa red circle\r\na blue square\ra square\n")  # a byte-order mark and every line break
    assert read_text(path, PromptsError, "") == "a red circle\na blue square\na square\n"


def test_json_lines_reads_what_it_can_and_names_the_rest(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"step": 1}\n\n\xff\n' + b"[" * 5000 + b"]" * 5000 + b'\n[[1]]\n{"step": 2')
    values, skipped = json_lines(path, PromptsError, "")
    assert values == [(1, {"step": 1}), (5, [[1]])]
    assert skipped == [(3, f"{path}, line 3: not UTF-8 text (byte 0xff)"),
                       (4, f"{path}, line 4: lists and objects nested more than 100 levels deep; write flatter JSON"),
                       (6, f"{path}, line 6: not valid JSON (Expecting ',' delimiter at column 11)")]
