"""Images in the layouts of published benchmarks' scorers: GenEval's folders and flat prompt-named files."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from grpo_vision.evaluation.image_layouts import flat_name, write_flat, write_geneval, write_index
from grpo_vision.images import to_uint8
from grpo_vision.prompts import PromptEntry
from grpo_vision.rollouts import draw
from grpo_vision.rewards.geneval_prompts import read
from grpo_vision.sampling import SamplingParams

PARAMS = SamplingParams(2.0, 1.0, 0)
# two lines in the form of GenEval's evaluation_metadata.jsonl (tags, include lists, ...)
ROWS = [{"tag": "single_object", "include": [{"class": "circle", "count": 1}], "prompt": "a red circle"},
        {"tag": "position", "include": [{"class": "square", "count": 1}], "prompt": "a blue square left of a red circle"}]


def generate(model, tokenizer, prompts, seeds, params):
    """The images `[n, 3, H, W]` rollouts.draw gives for prompts, image i from seeds[i]: what a layout must hold."""
    return draw(model, tokenizer, [PromptEntry(p) for p in prompts], seeds, params, 64).images


class CodesAsPixels:
    """A stand-in tokenizer: codes [n, 12] become 3 x 3 x 4 images, so images differ when codes do."""

    def decode(self, codes):
        return (codes.float() / 31).view(-1, 1, 3, 4).expand(-1, 3, -1, -1)


def pngs(paths):
    return [np.asarray(Image.open(p).convert("RGB")) for p in paths]


@pytest.mark.parametrize("shape", ["geneval", "nested"])
def test_geneval_layout_is_the_one_its_scorer_reads(tiny_policy, tmp_path, shape):
    # GenEval's own lines, or the same prompts as this tool's prompts file holds them (`prompts geneval --out`)
    lines = ROWS if shape == "geneval" else [{"prompt": r["prompt"], "metadata": {k: v for k, v in r.items()
                                                                                  if k != "prompt"}} for r in ROWS]
    meta = tmp_path / "evaluation_metadata.jsonl"
    meta.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert write_geneval(tiny_policy, CodesAsPixels(), read(meta), tmp_path / "out", 3, 7, PARAMS) == 6
    for index, row in enumerate(ROWS):
        folder = tmp_path / "out" / f"{index:05d}"
        # GenEval's flat line whichever the input's shape: its evaluate_images.py reads metadata["tag"]
        assert (folder / "metadata.jsonl").read_text() == json.dumps(row)
        files = sorted((folder / "samples").iterdir())
        assert [f.name for f in files] == ["00000.png", "00001.png", "00002.png"]
        expected = to_uint8(generate(tiny_policy, CodesAsPixels(), [row["prompt"]] * 3, [7, 8, 9], PARAMS))
        assert all(np.array_equal(a, b) for a, b in zip(pngs(files), expected))  # image j: seed + j


def test_flat_layout_names_files_by_prompt_and_keeps_an_index(tiny_policy, tmp_path):
    prompts = [r["prompt"] for r in ROWS]
    assert write_flat(tiny_policy, CodesAsPixels(), prompts, tmp_path / "flat", 2, 0, PARAMS) == 4
    index = [json.loads(ln) for ln in (tmp_path / "flat" / "index.jsonl").read_text().splitlines()]
    assert [r["file"] for r in index] == ["a red circle_000000.png", "a red circle_000001.png",
                                          "a blue square left of a red circle_000002.png",
                                          "a blue square left of a red circle_000003.png"]
    assert [r["seed"] for r in index] == [0, 1, 0, 1]
    expected = to_uint8(generate(tiny_policy, CodesAsPixels(), [prompts[1]] * 2, [0, 1], PARAMS))
    got = pngs([tmp_path / "flat" / r["file"] for r in index[2:]])
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))
    assert flat_name("a/b", 3) == "a_b_000003.png"


def test_index_layout_numbers_files_and_records_model_and_step(tiny_policy, tmp_path):
    prompts = [r["prompt"] for r in ROWS]
    assert write_index(tiny_policy, CodesAsPixels(), prompts, tmp_path / "idx", 2, 5, PARAMS, "reference", 3) == 4
    index = [json.loads(ln) for ln in (tmp_path / "idx" / "index.jsonl").read_text().splitlines()]
    assert index[3] == {"prompt": prompts[1], "file": "00001_01_reference.png", "seed": 6, "model": "reference",
                        "step": 3}
    assert [r["file"] for r in index[:3]] == ["00000_00_reference.png", "00000_01_reference.png",
                                              "00001_00_reference.png"]
    expected = to_uint8(generate(tiny_policy, CodesAsPixels(), [prompts[1]] * 2, [5, 6], PARAMS))
    got = pngs([tmp_path / "idx" / r["file"] for r in index[2:]])
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))


def test_flat_names_of_long_prompts_fit_a_file_name_and_stay_apart(tiny_policy, tmp_path):
    # before: OSError "File name too long" (a policy that reads any text, e.g. Janus, takes such prompts)
    prompts = ["a " + "é" * 300 + " red", "a " + "é" * 300 + " blue"]  # alike for far longer than a name holds
    assert write_flat(tiny_policy, CodesAsPixels(), prompts, tmp_path / "flat", 1, 0, PARAMS) == 2
    index = [json.loads(ln) for ln in (tmp_path / "flat" / "index.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in index] == prompts  # the whole prompt, for a scorer that matches by it
    names = [r["file"] for r in index]
    assert len(set(names)) == 2 and all((tmp_path / "flat" / n).is_file() for n in names)
    assert all(len(n.encode()) <= 255 and n.startswith("a éé") for n in names)  # no half character
    assert names[0].endswith("_000000.png") and names[1].endswith("_000001.png")
    assert flat_name(prompts[0], 0).rsplit("-", 1)[0] == flat_name(prompts[1], 0).rsplit("-", 1)[0]
    assert flat_name(prompts[0], 0) != flat_name(prompts[1], 0)  # the hash of the whole prompt tells them apart


def test_sample_cli_writes_the_geneval_layout_from_a_run(micro_run, tmp_path, monkeypatch, capsys):
    from grpo_vision.cli import main

    run = micro_run  # read, never written: the images go to --out
    meta = tmp_path / "evaluation_metadata.jsonl"
    meta.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    main(["sample", str(run), "--prompts", str(meta), "--out", str(tmp_path / "gen"), "--n", "2", "--layout", "geneval"])
    assert sorted(p.name for p in (tmp_path / "gen" / "00001" / "samples").iterdir()) == ["00000.png", "00001.png"]
    assert Image.open(tmp_path / "gen" / "00001" / "samples" / "00001.png").size == (64, 64)
    # A folder it cannot write (before: an OSError traceback after loading the run): one line, exit 2
    shut = tmp_path / "shut"
    shut.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != shut and access(path, mode, **kw))
    capsys.readouterr()
    with pytest.raises(SystemExit) as status:
        main(["sample", str(run), "--prompts", str(meta), "--out", str(shut / "gen"), "--layout", "geneval"])
    assert status.value.code == 2 and not (shut / "gen").exists()
    assert capsys.readouterr().err == (f"grpo-vision: error: cannot write in {shut} (no permission to write): make it "
                                       "writable, or choose another --out\n")
