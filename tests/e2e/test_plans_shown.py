"""Each image's text plan (sample.plan) is shown beside it wherever the image is shown: the sample grids and what
they hand the trackers, TensorBoard's text and W&B's rollouts table, report.md, the demo, and `sample`'s files.
Without a text stage every one of them is what it was (their own tests, unchanged, hold that; here: the few
places a plan could leak into)."""

import dataclasses
import json
import sys
import types
from contextlib import nullcontext

import pytest
import torch

from grpo_vision.evaluation.grid import plan_lines
from grpo_vision.models.llama import LlamaImagePolicy
from tests.helpers import micro_cfg

# plan words of the micro world's vocabulary, so that a plan can name what its prompt names
PLAN_WORDS = ["red", "green", "blue", "circle", "square", "triangle", "left", "right"]
COLORS, SHAPES = {"red", "green", "blue"}, {"circle", "square", "triangle"}


class PlanJudge:
    """The micro world's judge, which also checks plans: a plan is right in color (in shape) when it names every
    color (shape) word of its prompt among its plan words; the other attributes it leaves unjudged."""

    def __init__(self, judge):
        self.judge = judge

    def __getattr__(self, name):
        return getattr(self.judge, name)

    def plan_verdicts(self, plans, prompts):
        out = []
        for plan, prompt in zip(plans, prompts):
            named = set(plan.split())
            color, shape = ({w for w in prompt.split() if w in words} <= named for words in (COLORS, SHAPES))
            out.append({"correct": color and shape, "color": color, "shape": shape})
        return out


@pytest.fixture(scope="module")
def planned(micro_world, tmp_path_factory):
    """Two planned GRPO steps on the micro world, a grid each step, TensorBoard and the report, with a plan-capable
    policy of the world's vocabulary and a judge that checks plans: (run folder, config, bundle, base policy)."""
    from grpo_vision.policy import load_bundle
    from grpo_vision.train import train

    cfg = micro_cfg(micro_world, tmp_path_factory.mktemp("planned"), "sample.plan.enabled=true",
                    "sample.plan.max_tokens=5", "log.sample_every=1", "log.trackers=[tensorboard]")
    bundle = load_bundle(cfg.policy, "cpu")
    torch.manual_seed(1)
    bundle.policy = LlamaImagePolicy(dataclasses.replace(bundle.policy.cfg, plan_words=PLAN_WORDS, max_plan_tokens=5))
    bundle.judge = PlanJudge(bundle.judge)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(cfg, progress=False, bundle=bundle), cfg, bundle
    finally:
        torch.set_num_threads(threads)


def plan_worded(text: str) -> bool:
    return text == "(empty)" or set(text.split()) <= set(PLAN_WORDS)


def test_plan_lines_wrap_to_the_tile_and_cut_a_long_plan():
    assert plan_lines(None) == []  # no text stage: no line
    assert plan_lines("") == ["plan: (empty)"]
    assert plan_lines("red circle left", 19) == ["plan: red circle", "left"]
    # 3 lines at most; the last says that the plan goes on
    assert plan_lines("red circle left blue square right green triangle", 12) == [
        "plan: red", "circle left", "blue …"]


def test_the_grid_shows_and_returns_each_sides_plans(planned, tmp_path, one_thread):
    from PIL import Image

    from grpo_vision.config import EVAL_SEED
    from grpo_vision.evaluation.grid import save_sample_grid
    from grpo_vision.prompts import load_prompts
    from grpo_vision.rollouts import compare
    from grpo_vision.sampling import SamplingParams
    from grpo_vision.step.reference import Reference

    run, cfg, bundle = planned
    entries = load_prompts(run / "prompts" / "test.jsonl")[:3]
    params = SamplingParams.from_config(cfg.sample)
    paired = compare(bundle.policy, Reference(bundle.policy, "frozen"), bundle.tokenizer, entries, 2, params,
                     EVAL_SEED, None, bundle.judge)
    assert all(len(paired.plans[side]) == 6 for side in ("policy", "reference"))
    grid = save_sample_grid([paired], tmp_path / "planned.png", bundle.judge)
    # the grid's rows: each entry's first two images; their plans, side by side, for the trackers
    assert grid["plans"] == {side: paired.plans[side] for side in ("policy", "reference")}
    assert all(plan_worded(p or "(empty)") for side in grid["plans"].values() for p in side)
    # the same draw without its plans: no "plans" for the trackers, and the plan lines leave the captions
    bare = save_sample_grid([dataclasses.replace(paired, plans={})], tmp_path / "bare.png", bundle.judge)
    assert "plans" not in bare and set(bare) == set(grid) - {"plans"}
    planned_png, bare_png = (Image.open(tmp_path / f) for f in ("planned.png", "bare.png"))
    assert planned_png.width == bare_png.width and planned_png.height > bare_png.height
    # the step's grid of the run: its plans written under the images too (taller than the bare one of 3 rows would
    # be for its 8)
    assert Image.open(run / "samples" / "step_000002.png").height > bare_png.height * 8 / 3


def test_tensorboard_text_has_a_plan_column(planned):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = planned[0]
    events = EventAccumulator(str(run / "tensorboard" / "grpo_vision"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("samples/grid/text_summary")[1].tensor_proto.string_val[0].decode()
    head, rule, *rows = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert head.endswith("| judge: policy / reference | plan: policy / reference |")
    assert len(rows) == 16  # 4 test and 4 training prompts x 2 images
    for row in rows:
        policy_plan, reference_plan = row.strip("| ").rsplit(" | ", 1)[1].split(" / ")
        assert plan_worded(policy_plan) and plan_worded(reference_plan)


def test_grid_text_adds_the_plan_column_only_with_plans():
    from grpo_vision.run.trackers import grid_text

    rewards = {side: {"clip": torch.tensor([0.25, 0.5])} for side in ("policy", "reference")}
    verdicts = {side: [None, None] for side in ("policy", "reference")}
    bare = grid_text(3, ["a red circle", "a blue square"], [7, 8], rewards, verdicts)
    assert grid_text(3, ["a red circle", "a blue square"], [7, 8], rewards, verdicts,
                     {"policy": None, "reference": None}) == bare
    text = grid_text(3, ["a red circle", "a blue square"], [7, 8], rewards, verdicts,
                     {"policy": ["red circle", "a|b\nc"], "reference": ["", "blue square"]})
    assert text.splitlines()[2] == bare.splitlines()[2] + " plan: policy / reference |"
    assert text.splitlines()[4] == bare.splitlines()[4] + " red circle / (empty) |"
    assert text.splitlines()[5] == bare.splitlines()[5] + " a/b c / blue square |"  # one cell, one row


def test_the_wandb_rollouts_table_gets_a_plan_column_with_plans(monkeypatch):
    from grpo_vision.run.trackers import Trackers

    logged = []
    tracker = types.SimpleNamespace(log_table=lambda name, columns, data, step: logged.append((columns, data)))
    trackers = object.__new__(Trackers)  # the table's code alone: no run, no W&B account
    trackers.names, trackers.acc = ["wandb"], types.SimpleNamespace(get_tracker=lambda name: tracker)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(Image=lambda pixels: "image"))
    args = (1, ["a red circle", "a blue square"], torch.zeros(2, 3, 4, 4), {"clip": torch.tensor([0.5, 0.25])},
            torch.tensor([1.0, -1.0]), [None, None])
    trackers.log_rollouts(*args)
    trackers.log_rollouts(*args, ["red circle", "blue"])
    (bare, rows), (columns, planned_rows) = logged
    assert bare == ["prompt", "image", "clip", "advantage", "judge"] and columns == bare + ["plan"]
    assert [r[:-1] for r in planned_rows] == rows and [r[-1] for r in planned_rows] == ["red circle", "blue"]


def test_the_report_judges_the_plans_and_quotes_a_few(planned):
    from tests.evaluation.test_report import rate, rate_change, section, table

    run = planned[0]
    result = json.loads((run / "eval.json").read_text())["sets"]["test"]
    report = (run / "report.md").read_text()
    text = section(report, "The plans against their prompts")
    rows = table(text)
    for name, label in (("correct", "all attributes right"), ("color", "color"), ("shape", "shape")):
        ref, pol = (result["models"][m]["plan_judge"][name] for m in ("reference", "policy"))
        assert rows[label][:2] == [rate(ref), rate(pol)]
        assert rows[label][2] == rate_change(result["plan_judge_difference_ci"][name])
    assert "count" not in rows and "relation" not in rows  # attributes the judge left unjudged in every plan
    # the first test prompts' plans, one image each side
    prompts = [json.loads(ln)["prompt"] for ln in (run / "prompts" / "test.jsonl").read_text().splitlines()]
    quoted = [(p, r) for p, r in rows.items() if p in prompts]
    assert [p for p, _ in quoted] == list(dict.fromkeys(prompts[:4]))
    assert all(plan_worded(plan) for _, r in quoted for plan in r)
    assert report.index("## The plans against their prompts") < report.index("## What it cost")


def test_the_plan_section_by_hand_and_none_without_plans():
    from grpo_vision.evaluation.report_text import plan_section

    judged = {"mean": 0.5, "ci95": [0.2, 0.8], "n": 4}
    none = {"mean": None, "ci95": None, "n": 0}
    result = {"captions": 4, "prompts": 4, "models": {
        m: {"plan_judge": {"correct": judged, "color": {"mean": 0.75, "ci95": [0.5, 1.1], "n": 4}, "count": none}}
        for m in ("reference", "policy")},
        "plan_judge_difference_ci": {"correct": {"mean": 0.25, "ci95": [-0.05, 0.55]}, "color": {"mean": 0.0,
                                                                                                  "ci95": [0, 0]}}}
    lines = plan_section(result, [{"prompt": "a red circle", "reference": "", "policy": "red | circle"}])
    assert lines[:2] == ["", "## The plans against their prompts"]
    assert "| all attributes right | 50.0% [20.0, 80.0] | 50.0% [20.0, 80.0] | +25.0 pts [-5.0, +55.0] |" in lines
    assert "| color | 75.0% [50.0, 100.0] | 75.0% [50.0, 100.0] | +0.0 pts [+0.0, +0.0] |" in lines
    assert not any(ln.startswith("| count") for ln in lines)
    assert lines[-1] == "| a red circle | (empty) | red / circle |"
    # plans without a judge that checks them: the examples alone; no plans at all: nothing
    bare = {"models": {m: {"judge": None} for m in ("reference", "policy")}}
    assert plan_section(bare, [{"prompt": "a", "reference": "b", "policy": "c"}])[:2] == ["", "## The plans"]
    assert plan_section(bare, []) == []


def test_the_demo_shows_each_sides_plans(planned, tmp_path, one_thread):
    from grpo_vision.prompts import PromptEntry
    from grpo_vision.sampling import SamplingParams
    from grpo_vision.tools.demo import caption, draw_side, grid_png, sampling_request, side_json

    run, cfg, bundle = planned
    base = SamplingParams.from_config(cfg.sample)
    seeds, params = sampling_request(3, 2, 2.0, 1.0, 0, base)
    assert params.plan == base.plan is not None  # the demo draws as the run does: its text stage too
    entries = [PromptEntry("a red circle")] * 2
    side = draw_side("step 2", bundle.policy, nullcontext(), bundle.tokenizer, None, bundle.judge, entries, seeds,
                     params)
    assert len(side.plans) == 2 and all(plan_worded(p or "(empty)") for p in side.plans)
    for i in range(2):
        assert caption(side, i).splitlines()[-1] == f"plan: {side.plans[i] or '(empty)'}"
    assert side_json(side, seeds)["plans"] == side.plans
    bare = dataclasses.replace(side, plans=None)
    assert "plan:" not in caption(bare, 0) and "plans" not in side_json(bare, seeds)
    from PIL import Image

    with_plans, without = (Image.open(grid_png(s, s, "a red circle", seeds, tmp_path / f"{k}.png"))
                           for k, s in (("p", side), ("b", bare)))
    assert with_plans.width == without.width and with_plans.height > without.height


def test_sample_writes_each_images_plan_beside_it(planned, tmp_path, monkeypatch, capsys, one_thread):
    """`grpo-vision sample` through the command line. Its run is the planned run in memory: loading a planning run
    from its folder needs a world whose base policy plans (worlds/shapes_plan), which the tests do not build."""
    import grpo_vision.step.load as load
    from grpo_vision.cli import main

    run, cfg, bundle = planned
    loaded = load.LoadedRun(cfg, bundle, bundle.policy, types.SimpleNamespace(), 2)
    monkeypatch.setattr(load, "load_run", lambda *args: loaded)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    capsys.readouterr()
    main(["sample", str(run), "--prompts", str(prompts), "--out", str(tmp_path / "idx"), "--n", "2"])
    assert capsys.readouterr().out == f"wrote 4 images to {tmp_path / 'idx'} (index layout), each image's text plan " \
                                      "in index.jsonl\n"
    index = [json.loads(ln) for ln in (tmp_path / "idx" / "index.jsonl").read_text().splitlines()]
    assert [r["file"] for r in index] == ["00000_00_policy.png", "00000_01_policy.png", "00001_00_policy.png",
                                          "00001_01_policy.png"]
    assert all(list(r) == ["prompt", "file", "seed", "model", "step", "plan"] and plan_worded(r["plan"] or "(empty)")
               for r in index)
    # GenEval's layout: the plans beside metadata.jsonl, out of samples/ (whose every file its scorer reads)
    meta = tmp_path / "evaluation_metadata.jsonl"
    meta.write_text(json.dumps({"tag": "single_object", "include": [{"class": "circle", "count": 1}],
                                "prompt": "a red circle"}) + "\n")
    main(["sample", str(run), "--prompts", str(meta), "--out", str(tmp_path / "gen"), "--n", "2", "--layout",
          "geneval"])
    folder = tmp_path / "gen" / "00000"
    assert sorted(p.name for p in (folder / "samples").iterdir()) == ["00000.png", "00001.png"]
    plans = [json.loads(ln) for ln in (folder / "plans.jsonl").read_text().splitlines()]
    assert [(p["file"], p["seed"]) for p in plans] == [("samples/00000.png", 0), ("samples/00001.png", 1)]
    # image j's plan is the one drawn with seed j in the index layout above (the same prompt, the same seeds)
    assert [p["plan"] for p in plans] == [r["plan"] for r in index[:2]]


def test_bench_sampler_on_a_planning_run_draws_its_plans(planned, monkeypatch, capsys, one_thread):
    """`bench sampler --run` on a run with a text plan reported passes per image "at the run's settings" without
    drawing the run's plans: each image's plan is now drawn first, as training draws it, and the JSON says so."""
    import grpo_vision.step.load as load
    from grpo_vision.cli import main
    from grpo_vision.prompts import PromptEntry
    from grpo_vision.rollouts import draw
    from grpo_vision.sampling import SamplingParams
    from grpo_vision.tools.bench import SPECULATIVE_PROMPTS
    from grpo_vision.tools.timing import sig

    run, cfg, bundle = planned
    loaded = load.LoadedRun(cfg, bundle, bundle.policy, types.SimpleNamespace(), 2)
    monkeypatch.setattr(load, "load_run", lambda *args, **kwargs: loaded)
    capsys.readouterr()
    main(["bench", "sampler", "--json", "--run", str(run), "--decode", "static,speculative", "--speculative-window",
          "4", "--speculative-tree", "1,0", "--group-size", "1", "--repeats", "1", "--device", "cpu"])
    result = json.loads(capsys.readouterr().out)
    plan = result["plan"]
    assert (plan["max_tokens"], plan["template"]) == (5, cfg.sample.plan.template) and "image stage" in plan["note"]
    # the plans and condition rows that training's rollouts draw for these prompts and seeds
    entries = [PromptEntry(p) for p in SPECULATIVE_PROMPTS]
    with torch.no_grad():
        samples = draw(bundle.policy, bundle.tokenizer, entries, range(4), SamplingParams.from_config(cfg.sample), 4)
    lengths = samples.rollout.plan.mask.sum(1).double()
    assert plan["condition_tokens"] == samples.cond.shape[1] > bundle.policy.encode_prompts(["a red circle"]).shape[1]
    assert plan["tokens_per_plan"] == sig(lengths.mean().item()) and 1 <= plan["tokens_per_plan"] <= 5
    paths = result["paths"]  # the image stage's passes
    assert paths["speculative"]["forwards_per_image"] <= paths["static"]["forwards_per_image"] == result["image_tokens"]
