"""The ocr reward (Flow-GRPO's): its target, distance and score worked out by hand, and PP-OCRv4 from the
rapidocr-onnxruntime wheel reading words drawn here in DejaVu Sans (matplotlib's copy: no download, no root).

The hand values follow flow_grpo/ocr.py (yifan123/flow_grpo at ac4c86e, lines 31-60): the text between the
first two double quotes, spaces removed and lower case, 0 distance when the target occurs in what was read, else
the Levenshtein distance clipped at the target's length, score 1 - d / len(target).
"""

import functools
import random
import sys

import pytest
import torch
from PIL import ImageFont

from grpo_vision.config import ConfigError, load_config
from grpo_vision.grpo import group_advantages
from grpo_vision.images import font
from grpo_vision.rewards import CompositeReward, RewardContext, RewardError, check_options, make_reward
from grpo_vision.rewards import ocr as ocr_module
from grpo_vision.rewards.ocr import edit_distance, normalise, quoted_text, text_score
from grpo_vision.tools.bench_reward import render_text
from tests.helpers import MICRO

pytestmark = pytest.mark.usefixtures("one_thread")
# the .[ocr] extra installs rapidocr-onnxruntime only where it has a release; below 3.13 a missing one fails here
needs_ocr = pytest.mark.skipif(sys.version_info >= (3, 13), reason="rapidocr-onnxruntime 1.4.4 supports Python < "
                                                                   "3.13 only (the .[ocr] extra leaves it out)")
OPTIONS = {"threads": 1}  # ONNX Runtime on one thread: the suite runs one worker per core
SIDE = 128  # small images: PP-OCRv4 detects at the image's own size, about 0.1 s an image here


def test_the_target_is_flow_grpos_quoted_span_and_none_without_one():
    for prompt in ['a sign that says "Hello World"', '"GRPO" on a mug', 'a "x" and a "y"', 'an empty quote ""']:
        assert quoted_text(prompt) == prompt.split('"')[1]  # their line 31, where it is defined
    assert quoted_text("a red circle") is None
    assert quoted_text('a sign that says "Hello') is None  # theirs takes the rest of the prompt after a lone quote
    assert quoted_text("a sign saying “Open” twice “Late”", "“", "”") == "Open"
    assert quoted_text("it's 'late'", "'") == "s "  # the first pair, whatever is between: the user picks the marks
    assert normalise(" Hello  World ") == "helloworld"
    assert normalise("Hello World", case_sensitive=True, keep_spaces=True) == "Hello World"


def slow_distance(a: str, b: str) -> int:
    """Levenshtein by its recursive definition (the slow obvious reference)."""
    @functools.lru_cache(maxsize=None)
    def d(i, j):
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
    return d(len(a), len(b))


def test_edit_distance_by_hand_and_against_the_definition():
    assert edit_distance("kitten", "sitting") == 3  # k->s, e->i, +g
    assert edit_distance("flaw", "lawn") == 2  # -f, +n
    assert edit_distance("", "abc") == edit_distance("abc", "") == 3
    assert edit_distance("same", "same") == 0
    rng = random.Random(0)
    for _ in range(200):
        a, b = ("".join(rng.choice("abc") for _ in range(rng.randint(0, 7))) for _ in range(2))
        assert edit_distance(a, b) == edit_distance(b, a) == slow_distance(a, b)


def test_text_score_by_hand():
    assert text_score("helloworld", "helloworld") == 1.0
    assert text_score("bigsalehelloworldtoday", "helloworld") == 1.0  # inside other text: d = 0 (their line 48)
    assert text_score("helo", "hello") == pytest.approx(0.8)  # one deletion of five letters
    assert text_score("hello", "helloworld") == pytest.approx(0.5)  # five missing of ten
    assert text_score("", "hello") == 0.0  # nothing read: d = 5 = len(target)
    assert text_score("qwertyuiopasdfgh", "hello") == 0.0  # d = 15, clipped at 5 (their lines 53-54): not -2
    assert torch.isnan(torch.tensor(text_score("anything", "")))  # nothing to render: does not apply


@needs_ocr
def test_a_prompt_without_quoted_text_is_nan_and_runs_no_ocr(monkeypatch):
    fn = make_reward("ocr", RewardContext(), OPTIONS)
    monkeypatch.setattr(ocr_module, "_engine", lambda *a: pytest.fail("the OCR ran on prompts that quote nothing"))
    out = fn(torch.rand(3, 3, 32, 32), ["a red circle", 'an empty quote ""', 'a lone "quote'], [{}] * 3)
    assert out.shape == (3,) and out.isnan().all()


@needs_ocr
def test_bad_options_are_one_line_errors(tmp_path, monkeypatch):
    ctx = RewardContext()
    cases = [({"min_score": 2.0}, r"^reward.options.ocr.min_score=2.0 is not a confidence in \[0, 1\]"),
             ({"quote": ""}, r"^reward.options.ocr.quote is empty"),
             ({"threads": -1}, r"^reward.options.ocr.threads=-1: give a thread count"),
             ({"det_model": str(tmp_path / "det.onnx")},
              rf"^reward 'ocr': reward.options.ocr.det_model={tmp_path / 'det.onnx'} does not exist \(expected a "
              "PP-OCR text-detection ONNX file\\)$"),
             ({"rec_keys": __file__}, r"^reward.options.ocr.rec_keys is given without rec_model"),
             ({"min_scor": 0.5}, r"reward.options.ocr.min_scor")]
    for options, message in cases:
        with pytest.raises(ConfigError, match=message):
            make_reward("ocr", ctx, options)
    cfg = load_config(MICRO, ["reward.monitor=[ocr]", "reward.options.ocr.min_score=1.5"])
    with pytest.raises(ConfigError, match=r"^reward.options.ocr.min_score=1.5 is not"):  # as the config loads
        check_options(cfg)
    real = ocr_module.importlib.util.find_spec
    monkeypatch.setattr(ocr_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "rapidocr_onnxruntime" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^reward 'ocr' needs the rapidocr-onnxruntime package .* which is not "
                                          r"installed: pip install -e \"\.\[ocr\]\"$"):
        make_reward("ocr", ctx, {})


@pytest.fixture(scope="module")
def ocr():
    """The reward with the wheel's PP-OCRv4 models, loaded once for the module (about a second)."""
    fn = make_reward("ocr", RewardContext(), OPTIONS)
    fn.load()
    return fn


def test_the_words_are_drawn_in_a_real_font():
    face = font(12)  # what render_text draws with: matplotlib's DejaVu Sans, not PIL's fallback
    assert isinstance(face, ImageFont.FreeTypeFont) and face.getname() == ("DejaVu Sans", "Book")


@needs_ocr
def test_right_wrong_missing_and_partial_text(ocr):
    drawn = ["Hello World", "Banana", "", "Hello", "Hel", "GRPO 2026", "Hello World"]
    prompts = ['a sign that says "Hello World"',  # right: 1
               'a sign that says "Hello World"',  # wrong word: nothing in common, d clipped at 10 -> 0
               'a sign that says "Hello World"',  # blank image: nothing read -> 0
               'a sign that says "Hello World"',  # half: "hello" against "helloworld", d = 5 -> 0.5
               'a mug with "Hello" on it',  # "hel" against "hello", d = 2 -> 0.6
               'a poster reading "grpo 2026"',  # case and spaces do not count -> 1
               "a sign with no quoted text"]  # NaN
    out = ocr(render_text(drawn, SIDE), prompts, [{}] * len(prompts))
    expected = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.6, 1.0, float("nan")])
    assert torch.allclose(out, expected, atol=0.1, equal_nan=True), out  # 0.1: one misread letter of ten


@needs_ocr
def test_case_sensitivity_is_an_option(ocr):
    image = render_text(["GRPO"], SIDE)
    sensitive = make_reward("ocr", RewardContext(), {**OPTIONS, "case_sensitive": True})
    assert ocr(image, ['"grpo"'], [{}]).item() == 1.0
    assert sensitive(image, ['"grpo"'], [{}]).item() == 0.0  # four letters, each substituted: d = 4 = len
    assert sensitive(image, ['"GRPO"'], [{}]).item() == 1.0


@needs_ocr
def test_a_wrong_image_shape_is_one_line(ocr):
    scorer = CompositeReward({"ocr": 1.0}, [], RewardContext(), {"ocr": OPTIONS})
    with pytest.raises(RewardError, match=r"^reward 'ocr' failed: ValueError: images must be \[B, 3, H, W\] RGB in "
                                          r"\[0, 1\], got shape \[1, 1, 32, 32\]$"):
        scorer(torch.rand(1, 1, 32, 32), ['"x"'], [{}])
    with pytest.raises(RewardError, match=r"got shape \[2, 32, 32\]$"):  # also where no prompt quotes text
        scorer(torch.rand(2, 32, 32), ["a", "b"], [{}] * 2)
    with pytest.raises(RewardError, match=r"^reward 'ocr' failed: ValueError: 2 images for 1 prompts$"):
        scorer(torch.rand(2, 3, 32, 32), ['"x"'], [{}])


@needs_ocr
def test_a_damaged_model_file_stops_the_load_naming_it(tmp_path):
    bad = tmp_path / "det.onnx"
    bad.write_bytes(b"not an onnx file")
    scorer = CompositeReward({"ocr": 1.0}, [], RewardContext(), {"ocr": {**OPTIONS, "det_model": str(bad)}})
    with pytest.raises(RewardError) as caught:
        scorer.load()
    message = str(caught.value)
    assert message.startswith(f"reward 'ocr' failed: its model did not load: RuntimeError: the OCR model "
                              f"(det_model_path={bad}) did not load (") and "\n" not in message


@needs_ocr
def test_nan_adds_nothing_to_the_weighted_total(ocr):
    images = render_text(["river", "river", "river"], SIDE)
    prompts = ['a "river" sign', "a red circle", 'a "lake" sign']
    mixed = CompositeReward({"ocr": 2.0, "jpeg_compressibility": 0.5}, [], RewardContext(), {"ocr": OPTIONS})
    out = mixed(images, prompts, [{}] * 3)
    jpeg = out.raw["jpeg_compressibility"]
    assert out.raw["ocr"][1].isnan() and out.raw["ocr"][0] == 1.0 and out.raw["ocr"][2] < 0.5
    # where ocr applies: 2 * ocr + 0.5 * jpeg; where it does not, the other reward alone, its weight unchanged
    assert torch.allclose(out.total, torch.stack([2 * out.raw["ocr"][0] + 0.5 * jpeg[0], 0.5 * jpeg[1],
                                                  2 * out.raw["ocr"][2] + 0.5 * jpeg[2]]))
    alone = CompositeReward({"ocr": 1.0}, [], RewardContext(), {"ocr": OPTIONS})(images, prompts, [{}] * 3)
    assert alone.total[1].isnan() and not alone.total[[0, 2]].isnan().any()
    # a group of a prompt that quotes nothing: every total NaN, advantages 0 (no signal, never NaN)
    adv = group_advantages(torch.cat([alone.total[[1, 1]], alone.total[[0, 2]]]), group_size=2)  # [4]
    assert adv[:2].eq(0).all() and adv[2] > 0 > adv[3]


def test_matrix_takes_ocr_in_a_reward_mix():
    from grpo_vision.tools.matrix import parse_reward_spec

    assert parse_reward_spec("ocr+0.5*clip", {}) == (("ocr", 1.0), ("clip", 0.5))
    assert parse_reward_spec("ocr", {"ocr": 3.0}) == (("ocr", 1.0),)
