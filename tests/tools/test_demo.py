"""The Gradio demo: pure functions by hand, the app through gradio_client (in this process), and the e2e
tier: the command in a subprocess and a real headless browser."""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from grpo_vision.tools.demo import (MAX_IMAGES, DemoInputError, Side, check_run_dir, clean_prompt, grid_png,
                              sampling_request, summary_rows)
from grpo_vision.tools.demo_app import build_app, launch
from grpo_vision.tools.reward_server import free_port
from grpo_vision.evaluation.plots import curves_figure
from grpo_vision.shapes.judge import ShapesJudge
from grpo_vision.sampling import SamplingParams
from tests.helpers import ROOT, cli_cmd

PROMPT = "a red circle left of a blue square"
# the run the app serves: conftest.py's micro_run, two GRPO steps with a checkpoint after each


@pytest.fixture(scope="module")
def served(micro_run, tmp_path_factory):
    """The app in this process on a free port: (url, port)."""
    app = build_app(micro_run, out_dir=tmp_path_factory.mktemp("grids"))
    port = free_port()
    launch(app, port=port)  # the demo command's settings
    yield f"http://127.0.0.1:{port}/", port
    app.close()


@pytest.fixture(scope="module")
def client(served):
    from gradio_client import Client

    return Client(served[0], verbose=False)


def generate(client, prompt=PROMPT, seed=0, n=4, left="step 2", right="reference", cfg_scale=2.0, top_k=0,
             temperature=1.0):
    return client.predict(prompt, seed, n, cfg_scale, temperature, top_k, left, right, api_name="/generate")


def pixels(gallery) -> list[np.ndarray]:
    return [np.asarray(Image.open(item["image"]).convert("RGB")) for item in gallery]


# ---------------------------------------------------------------------------- pure functions


def side(rewards: dict, checks: list, label="x") -> Side:
    n = len(checks)
    return Side(label, torch.rand(n, 3, 8, 8), {k: torch.tensor(v) for k, v in rewards.items()}, checks)


def test_summary_means_skip_nan_and_subtract():
    ok = {"count": True, "size": None, "correct": True}
    bad = {"count": False, "size": None, "correct": False}
    left = side({"clip": [0.2, math.nan, 0.4], "exact": [math.nan] * 3}, [ok, bad, ok])
    right = side({"clip": [0.1, 0.1, 0.4], "exact": [math.nan] * 3}, [bad, bad, ok])
    rows = summary_rows(left, right)
    # clip: left (0.2 + 0.4) / 2 = 0.3 (NaN skipped), right 0.6 / 3 = 0.2, difference 0.1.
    # exact applies nowhere: no means. count: 2/3 vs 1/3; size never applies, so it has no row.
    assert rows == [["clip", 0.3, 0.2, 0.1], ["exact", None, None, None],
                    ["judge: count", "66.7%", "33.3%", "+33.3 pts"], ["judge: correct", "66.7%", "33.3%", "+33.3 pts"]]


def test_captions_and_json_carry_each_failing_clause_and_why_a_reward_said_n_a():
    from grpo_vision.tools.demo import caption, side_json

    s = side({"geneval": [0.0, 1.0]}, [None, None])
    s.reasons = {"geneval": [[("position", "expected dog right of target, found left of")], []]}
    assert caption(s, 0) == "geneval 0\ngeneval ✗ position: expected dog right of target, found left of"
    assert caption(s, 1) == "geneval 1"
    s.notes = {"vlm": "no question"}
    assert side_json(s, [0, 1])["reasons"] == {"geneval": [[["position", "expected dog right of target, found left "
                                                             "of"]], []]}
    assert side_json(s, [0, 1])["not_scored"] == {"vlm": "no question"}


def test_the_demo_scores_through_rollouts_score_and_a_failing_reward_is_a_note():
    # rollouts.score(tolerant=True): a reward that fails scores NaN with its message, the others score; a reward
    # that applies to none of the images is said so; training's score (not tolerant) stops on the failure
    from grpo_vision.prompts import PromptEntry
    from grpo_vision.rewards import CompositeReward, RewardContext, RewardError
    from grpo_vision.rollouts import score
    from grpo_vision.tools.demo import not_applying

    explains, broken = "python:tests.rewards.test_rewards:EXPLAINS", "python:tests.rewards.test_rewards:broken"
    rewards = CompositeReward({explains: 1.0, broken: 1.0, "placebo": 0.0}, [], RewardContext())
    images, entries = torch.zeros(2, 3, 8, 8), [PromptEntry("a"), PromptEntry("b")]
    scored = score(rewards, images, entries, tolerant=True)
    assert scored.raw[explains].tolist() == [1.0, 0.0] and scored.raw[broken].isnan().all()
    assert scored.notes == {broken: "RuntimeError: model exploded"}
    assert scored.reasons == {explains: [[], [("count", "too few in b")]]}
    assert scored.total.tolist() == [1.0, 0.0]  # the failed reward leaves the total, as one that does not apply
    scored.raw["placebo"] = torch.full((2,), float("nan"))
    assert list(not_applying(scored)) == ["placebo"]
    with pytest.raises(RewardError, match="model exploded"):
        score(rewards, images, entries)


def test_grid_png_places_each_image_upscaled_under_its_side(tmp_path):
    left = side({"clip": [0.1] * 6}, [None] * 6, "step 2")
    right = side({"clip": [0.2] * 6}, [None] * 6, "reference")
    path = grid_png(left, right, "a red circle", list(range(10, 16)), tmp_path / "g.png")
    sheet = np.asarray(Image.open(path).convert("RGB"))
    # GRID_SCALE 2: 16 px images, 2 px apart, 2 caption lines of 11 px (seed, clip) + 2 px under each;
    # a title line (11 + 6 px) and a heading line (11 + 4 px) on top; 24 px between the sides
    size, cell_w, cell_h, top = 16, 18, 16 + 2 + 2 * 11 + 2, 17 + 15
    assert sheet.shape[1] == 2 * 4 * cell_w + 24 + 4 and sheet.shape[0] == top + 2 * cell_h
    img = (right.images[5].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    x, y = (4 + 1) * cell_w + 24, top + 1 * cell_h  # right side, row 1, column 1
    assert np.array_equal(sheet[y:y + size, x:x + size], img.repeat(2, 0).repeat(2, 1))


def test_curves_figure_plots_each_reward_and_kl_per_step():
    metrics = [{"step": 1, "reward/clip/mean": 0.1, "reward/total/mean": 1.0, "loss/kl": 0.0},
               {"step": 2, "reward/clip/mean": 0.3, "reward/total/mean": 2.0, "loss/kl": 0.01}]
    metrics += [{"step": 3, "reward/clip/mean": None, "reward/total/mean": 3.0, "loss/kl": 0.02}]  # clip not logged
    fig = curves_figure(metrics)
    assert [ax.get_title() for ax in fig.axes] == ["clip (mean over the step's images)",
                                                   "total reward (what advantages come from)",
                                                   "KL to the reference (k3, per token)"]
    assert all(ax.get_xlabel() == "training step" for ax in fig.axes)
    raw, line = fig.axes[0].lines  # each step's point, then the moving average (a tenth of 3 steps: 1)
    assert list(raw.get_ydata())[:2] == [0.1, 0.3] and math.isnan(raw.get_ydata()[2])
    assert list(line.get_ydata()) == [0.1, 0.3, 0.3]  # a missing value carries the last average
    assert list(fig.axes[2].lines[0].get_xdata()) == [1, 2, 3]
    assert not curves_figure([]).axes  # no metrics yet: a note, no empty panels


def test_sampling_request_seeds_and_bounds():
    base = SamplingParams(3.0, 1.0, 0, 0.9, "conditional")
    seeds, params = sampling_request(7, 3, 2.5, 0.8, 10, base)
    assert seeds == [7, 8, 9]
    assert params == SamplingParams(2.5, 0.8, 10, 0.9, "conditional")  # top-p and mode come from the run
    for args, needle in [((0, 0, 2.0, 1.0, 0), "number of images must be a whole number from 1 to 16, got 0"),
                         ((0, MAX_IMAGES + 1, 2.0, 1.0, 0), "from 1 to 16, got 17"),
                         ((0, 2.5, 2.0, 1.0, 0), "got 2.5"),
                         ((-1, 4, 2.0, 1.0, 0), "seed must be a whole number"),
                         ((0, 4, math.nan, 1.0, 0), r"CFG scale \(1 = off\) must be a number from 0 to 100, got nan"),
                         ((0, 4, 2.0, 0.0, 0), "temperature must be a number from 0.01 to 100, got 0.0"),
                         # what the API may send besides numbers, and numbers past what the sampler takes
                         (("abc", 4, 2.0, 1.0, 0), "The seed must be a whole number from 0 to 4294967291, got 'abc'"),
                         ((10**400, 4, 2.0, 1.0, 0), "The seed must be a whole number"),
                         ((0, True, 2.0, 1.0, 0), "number of images must be a whole number from 1 to 16, got True"),
                         ((0, [4], 2.0, 1.0, 0), r"got \[4\]"),
                         ((0, 4, "2", 1.0, 0), "CFG scale .* got '2'"),
                         ((0, 4, 1e300, 1.0, 0), "CFG scale .* got 1e\\+300"),
                         ((0, 4, 2.0, 1e-40, 0), "temperature must be a number from 0.01 to 100, got 1e-40"),
                         ((0, 4, 2.0, None, 0), "temperature must be a number from 0.01 to 100, got None"),
                         ((0, 4, 2.0, 1.0, "x"), "Top-k must be a whole number from 0 to 1048576, got 'x'")]:
        with pytest.raises(DemoInputError, match=needle):
            sampling_request(*args, base)


def test_clean_prompt_normalises_and_names_the_problem(tiny_policy):
    judge = ShapesJudge()
    assert clean_prompt("  A  Red   circle ", tiny_policy, judge) == "A Red circle"  # the judge reads it lower case
    for prompt, needle in [("   ", "Enter a prompt"), ("a red circle " * 30, "389 characters; at most 200"),
                           ("a pink circle", "Words the policy does not know: 'pink'"),
                           ("a red circle a", "outside the ShapesWorld grammar")]:
        with pytest.raises(DemoInputError, match=needle):
            clean_prompt(prompt, tiny_policy, judge)
    assert clean_prompt("a red circle a", tiny_policy) == "a red circle a"  # no judge: only the policy must read it
    with pytest.raises(DemoInputError, match="at most 8"):  # the policy's own limit
        clean_prompt("a red circle left of a blue square a", tiny_policy)


def test_run_directory_errors_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"run directory not found: {tmp_path / 'nope'}; .*grpo-vision train"):
        check_run_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="not a run directory \\(no config.yaml\\)"):
        check_run_dir(tmp_path)
    (tmp_path / "config.yaml").write_text("{}")
    with pytest.raises(FileNotFoundError, match="has no checkpoint yet"):
        check_run_dir(tmp_path)


@pytest.mark.e2e
def test_cli_and_script_exit_2_with_a_message_for_a_missing_run(tmp_path):
    for cmd in (cli_cmd("demo", tmp_path / "missing"),
                [sys.executable, "demo/app.py", str(tmp_path / "missing"), "--port", "7999"]):
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert f"grpo-vision: error: run directory not found: {tmp_path / 'missing'}" in out.stderr
        assert "Traceback" not in out.stderr


# ---------------------------------------------------------------------------- the app through its API


def test_api_same_seed_same_images_new_seed_new_images(client):
    left, right, summary, grid, status, details = generate(client, seed=5, n=3)
    assert len(left) == len(right) == 3
    a = pixels(left)
    assert all(x.shape == (64, 64, 3) for x in a)
    for s in ("left", "right"):
        assert all(math.isfinite(v) for vals in details[s]["rewards"].values() for v in vals), details[s]
        assert details[s]["seeds"] == [5, 6, 7] and len(details[s]["judge"]) == 3
    assert details["right"]["label"] == "reference (a frozen copy of the base policy)"
    for row in summary["data"]:  # each mean is the mean of the per-image scores
        if not row[0].startswith("judge"):  # rounded to 4 decimals
            assert row[1] == pytest.approx(np.mean(details["left"]["rewards"][row[0]]), abs=6e-5)
            assert row[3] == pytest.approx(row[1] - row[2], abs=2e-4)
        else:  # accuracies in percent, changes in points
            assert row[1].endswith("%") and row[3].endswith(" pts")
    assert "clip" in left[0]["caption"] and "count" in left[0]["caption"]
    assert Image.open(grid).size[0] > 2 * 3 * 128
    assert "seeds 5..7" in status

    again = pixels(generate(client, seed=5, n=3)[0])
    assert all(np.array_equal(x, y) for x, y in zip(a, again))
    shifted = pixels(generate(client, seed=6, n=2)[0])  # image i has seed + i, whatever the batch
    assert all(np.array_equal(x, y) for x, y in zip(a[1:], shifted))
    other = pixels(generate(client, seed=500, n=3)[0])
    assert all(not np.array_equal(x, y) for x, y in zip(a, other))


def test_api_compares_any_two_checkpoints(client, micro_world):
    from grpo_vision.prompts import PromptEntry
    from grpo_vision.rollouts import draw
    from grpo_vision.images import to_uint8
    from grpo_vision.shapes.world import load_world

    left, right, _, _, _, details = generate(client, n=2, left="step 1", right="step 1")
    assert details["left"]["label"] == details["right"]["label"] == "step 1"
    assert all(np.array_equal(x, y) for x, y in zip(pixels(left), pixels(right)))  # same weights, same seeds
    # The run's reference is a frozen copy of the base policy: the world's policy, on the same seeds.
    reference = pixels(generate(client, n=2, right="reference")[1])
    world = load_world(micro_world, "cpu")
    base = to_uint8(draw(world.policy.eval(), world.tokenizer, [PromptEntry(PROMPT)] * 2, [0, 1],
                         SamplingParams(2.0, 1.0, 0), 64).images)
    assert all(np.array_equal(x, y) for x, y in zip(reference, base))
    left_pick, right_pick, _ = client.predict("step 1", "step 7", api_name="/refresh")
    assert [c[0] for c in left_pick["choices"]] == ["step 2", "step 1", "reference"]
    assert (left_pick["value"], right_pick["value"]) == ("step 1", "reference")  # a pick that is gone resets


def test_api_bad_input_gives_a_message(client):
    from gradio_client.exceptions import AppError

    for kwargs, needle in [({"prompt": ""}, "Enter a prompt"),
                           ({"prompt": "a red circle " * 30}, "at most 200 are accepted"),
                           ({"prompt": "a pink unicorn"}, "Words the policy does not know: 'pink', 'unicorn'"),
                           ({"prompt": "circle red a"}, "outside the ShapesWorld grammar"),
                           ({"n": 0}, "number of images must be a whole number from 1 to 16"),
                           ({"n": 40}, "got 40"),
                           ({"left": "step 9"}, "no checkpoint for step 9; available steps: 1, 2")]:
        with pytest.raises(AppError, match=needle):
            generate(client, **kwargs)


def test_api_input_of_any_type_is_a_message_and_no_traceback(client, capfd):
    """A one-line message for the caller. Before, a seed of "abc" was a bare "Error" for the caller and a traceback
    on the server's console (Gradio's own conversion of the value failed before compare could check it)."""
    from gradio_client.exceptions import AppError

    capfd.readouterr()
    for kwargs, needle in [({"seed": "abc"}, "The seed must be a whole number from 0 to 4294967291, got 'abc'."),
                           ({"seed": 2.5}, "The seed must be a whole number from 0 to 4294967291, got 2.5."),
                           ({"n": "four"}, "The number of images must be a whole number from 1 to 16, got 'four'."),
                           ({"cfg_scale": "abc"}, "The CFG scale (1 = off) must be a number from 0 to 100, got 'abc'."),
                           ({"temperature": 1e300}, "The temperature must be a number from 0.01 to 100, got 1e+300."),
                           ({"top_k": -1}, "Top-k must be a whole number from 0 to 1048576, got -1."),
                           ({"left": 5}, "unknown checkpoint 5; choose one of: step 2, step 1, reference"),
                           ({"prompt": None}, "Enter a prompt, e.g. one of the examples.")]:
        with pytest.raises(AppError) as err:
            generate(client, **kwargs)
        assert str(err.value) == needle
    assert "Traceback" not in capfd.readouterr().err


def test_a_large_request_body_is_refused_before_the_queue(served):
    import httpx

    # before: a 50 MB body to the queue route was read and queued; a click is a few hundred bytes
    url = served[0] + "gradio_api/queue/join"
    big = {"data": ["a red circle " * 100_000, 0, 1, 2.0, 1.0, 0, "step 2", "reference"], "session_hash": "big"}
    refused = httpx.post(url, json=big, timeout=60)  # 1.3 MB
    assert refused.status_code == 413
    assert refused.text == ("request body over 65536 bytes, refused: the demo takes a prompt of at most 200 characters "
                            "and a few numbers")
    chunked = httpx.post(url, content=(b"x" * 8192 for _ in range(64)), timeout=60)  # no Content-Length: counted
    assert chunked.status_code == 413
    under = httpx.post(url, json={"data": ["x" * 60_000]}, timeout=60)  # under the limit: read (Gradio refuses it)
    assert under.status_code != 413 and "request body over" not in under.text


def test_the_upload_route_refuses_a_large_file(served):
    import httpx

    # the app takes no file, yet Gradio serves an upload route: before, any size was written to its cache
    url = served[0] + "gradio_api/upload"
    refused = httpx.post(url, files={"files": ("big.bin", b"x" * (2 << 20))}, timeout=60)
    assert refused.status_code == 413 and "maximum allowed size of 1048576 bytes" in refused.text
    assert httpx.post(url, files={"files": ("small.txt", b"x" * 1000)}, timeout=60).status_code == 200


def test_bench_demo_reports_seconds_per_click(micro_run, capsys):
    """The 5-second target is checked by `grpo-vision bench demo RUN --json`, not here; this checks the
    benchmark itself runs the real handler and reports what it timed."""
    from grpo_vision.cli import main

    main(["bench", "demo", str(micro_run), "--json", "--n", "2", "--repeats", "2", "--prompt", "a red circle"])
    result = json.loads(capsys.readouterr().out)
    assert result["images_per_side"] == 2 and len(result["seconds"]) == 2 and result["prompt"] == "a red circle"
    assert all(t > 0 for t in result["seconds"]) and result["median_s"] > 0
    with pytest.raises(SystemExit) as exit_info:  # bad input is a command-line error, not a traceback
        main(["bench", "demo", str(micro_run), "--prompt", "a pink unicorn"])
    assert exit_info.value.code == 2
    assert "bench demo: Words the policy does not know: 'pink', 'unicorn'" in capsys.readouterr().err


def test_busy_port_exits_2(micro_run, served, capsys):
    from grpo_vision.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", str(micro_run), "--port", str(served[1])])
    assert exit_info.value.code == 2
    assert f"cannot listen on 127.0.0.1:{served[1]}" in capsys.readouterr().err


# ---------------------------------------------------------------------------- a real browser


@pytest.mark.e2e
def test_browser_types_a_prompt_and_sees_both_galleries(request, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is missing: pip install -e '.[dev]'")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH: install Debian's package (apt-get install chromium); .ci/run does")
    url = request.getfixturevalue("served")[0]  # only now: a skip does not build the run
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            page.goto(url)
            page.get_by_text("Nothing compared yet").first.wait_for(timeout=30_000)  # the empty state explains
            page.screenshot(path=str(tmp_path / "demo_empty.png"), full_page=True)
            page.locator("#prompt textarea").fill(PROMPT)
            page.locator("#generate").click()
            page.wait_for_function("""() => ['left', 'right'].every(s => {
                const imgs = [...document.querySelectorAll(`#gallery-${s} img`)];
                return imgs.length >= 4 && imgs.every(i => i.complete && i.naturalWidth > 0); })""", timeout=60_000)
            assert "4 images each" in page.locator("#status").inner_text()
            page.screenshot(path=str(tmp_path / "demo.png"), full_page=True)
            page.locator("#prompt textarea").fill("a pink circle")
            page.locator("#generate").click()
            page.get_by_text("Words the policy does not know: 'pink'").first.wait_for(timeout=30_000)
        finally:
            browser.close()
    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    for name in ("demo_empty.png", "demo.png"):  # looked at by a person, not by this test
        shutil.copy(tmp_path / name, artifacts / name)
    assert Image.open(artifacts / "demo.png").size[0] >= 1000


@pytest.mark.e2e
def test_the_demo_command_prints_its_address_and_how_to_reach_it_safely(micro_run, tmp_path):
    from gradio_client import Client

    port = free_port()
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where the demo's and Gradio's temporary files go
    proc = subprocess.Popen(cli_cmd("demo", micro_run, "--port", port), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:  # the start-up lines, until the address
            lines.append(line)
            if line.startswith("[demo] open"):
                break
        text = "".join(lines)
        assert f"[demo] open http://127.0.0.1:{port}" in text and f"ssh -L {port}:127.0.0.1:{port}" in text
        assert "share=True" not in text  # Gradio's suggestion of a public link is not printed
        generate(Client(f"http://127.0.0.1:{port}/", verbose=False), n=1)  # a grid and gallery images to clean up
        assert list(tmp_path.glob("grpo_demo_*/compare_*.png")) and list(tmp_path.glob("gradio/*/*.png"))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # before: every demo left its grpo_demo_* folder and Gradio's copies of what it served behind
    assert proc.returncode == 143 and list(tmp_path.glob("grpo_demo_*")) == []
    assert [p for p in tmp_path.rglob("*") if p.is_file() and "gradio" in p.parts] == []
