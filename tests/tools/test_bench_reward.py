"""`bench reward NAME`: one reward built as training builds it, timed on rendered words whose prompts quote them.
How fast is not checked here; that the rate is the images over the median call, and that the OCR reward reads the
bench's own words (so the figure is of real reading, not of empty detections), are."""

import json
import sys

import pytest

from grpo_vision.cli import main


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="rapidocr-onnxruntime 1.4.4 supports Python < 3.13 only")
def test_bench_reward_ocr_prints_images_per_second_of_the_median_call(capsys, one_thread):
    main(["bench", "reward", "ocr", "reward.options.ocr.threads=1", "--images", "2", "--size", "96", "--repeats",
          "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert (out["reward"], out["images"], out["size"], out["repeats"]) == ("ocr", 2, 96, 1)
    assert out["images_per_s"] == pytest.approx(2 / out["median_s"], rel=0.01)  # 3 significant digits each
    assert out["mean_score"] == 1.0 and out["load_s"] > 0


def test_bench_reward_refuses_an_unknown_reward_or_option_in_one_line(capsys):
    for args, message in ((["nosuch"], "unknown reward 'nosuch'; registered rewards: "),
                          (["placebo", "reward.options.placebo.x=1"], "reward 'placebo' takes no options")):
        with pytest.raises(SystemExit) as stopped:
            main(["bench", "reward", *args, "--images", "1", "--repeats", "1"])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.startswith("grpo-vision: error: ") and message in err
        assert err.count("\n") == 1
