"""A world whose base policy plans (worlds/shapes_plan, version 2; worlds/shapes_canvas, version 3, with a layout
canvas): its build from another world's stages, its training data, and loading it beside a world of version 1."""

import json
import math
import shutil

import pytest
import torch

from grpo_vision.config import ConfigError
from grpo_vision.policy import check_planning
from grpo_vision.shapes.build import build_world, recipe_hashes
from grpo_vision.shapes.build.stages import WORLD_PRESETS
from grpo_vision.shapes.build.train_policy import POLICY_PRESETS, PolicyPreset, plan_data, plan_ids, planned_logits
from grpo_vision.shapes.plan import MAX_PLAN_TOKENS, plan_words
from grpo_vision.shapes.world import STAGES, WorldError, load_world


def test_the_plan_world_copies_the_other_stages_and_trains_a_policy_that_plans(plan_micro_build, micro_world):
    world, messages = plan_micro_build
    assert [m for m in messages if "copied" in m] == [
        f"[world] {n}: copied from {micro_world} (same recipe: micro, seed 0)" for n in ("vq", "clip", "aesthetic")]
    assert "[world] policy: building (plan_micro, seed 0)" in messages
    for name in ("vq", "clip", "aesthetic"):  # the same files, byte for byte
        for f in (micro_world / name).iterdir():
            assert (world / name / f.name).read_bytes() == f.read_bytes()
    info = json.loads((world / "world.json").read_text())
    assert (info["version"], info["preset"]) == (3, "plan_micro")
    assert info["plan"] == {"words": plan_words(), "max_tokens": MAX_PLAN_TOKENS, "grid": 16, "cell_px": 4,
                            "canvas": False}
    assert info["stages"]["vq"]["copied_from"] == str(micro_world) and "copied_from" not in info["quality"]
    q = info["quality"]
    for prefix in ("policy_acc", "plan_acc", "policy_plan_acc", "policy_truthplan_acc"):
        for tag in ("seen", "heldout"):
            assert 0 <= q[f"{prefix}_{tag}"] <= 1 and 0 <= q[f"{prefix}_{tag}_form_relation"] <= 1
    assert q["policy_plan_loss"] < math.log(len(plan_words()) + 1)  # below the uniform guess after 20 steps
    assert json.loads((micro_world / "world.json").read_text())["plan"] is None  # the micro world's policy does not plan


@pytest.mark.e2e
def test_a_second_build_from_the_same_world_finds_nothing_to_do(plan_micro_world, micro_world, tmp_path):
    copy = tmp_path / "w"
    shutil.copytree(plan_micro_world, copy)
    messages = []
    build_world(copy, preset="plan_micro", seed=0, progress=False, log=messages.append, start_from=micro_world)
    assert messages == [f"[world] {copy} is complete (plan_micro, seed 0); nothing to build"]
    with pytest.raises(WorldError, match="not a complete world"):
        build_world(tmp_path / "x", preset="plan_micro", progress=False, log=print, start_from=tmp_path / "none")


def test_plan_worlds_share_the_other_stages_recipes_and_the_old_presets_are_unchanged():
    for plan, base in (("plan", "default"), ("plan_micro", "micro"), ("canvas", "default"),
                       ("canvas_micro", "micro")):
        ours, theirs = recipe_hashes(plan), recipe_hashes(base)
        assert {n: ours[n] for n in STAGES if n != "policy"} == {n: theirs[n] for n in STAGES if n != "policy"}
        assert ours["policy"] != theirs["policy"] and WORLD_PRESETS[plan] == (base, plan)
    # the old presets keep their fields, so worlds/shapes keeps its recipe hash (test_world.py checks the hash)
    assert type(POLICY_PRESETS["default"]) is PolicyPreset and type(POLICY_PRESETS["micro"]) is PolicyPreset
    plan, default = POLICY_PRESETS["plan"], POLICY_PRESETS["default"]
    assert (plan.dim, plan.n_layers, plan.n_heads, plan.n_kv_heads, plan.ffn_dim, plan.steps, plan.batch_size) == \
        (default.dim, default.n_layers, default.n_heads, default.n_kv_heads, default.ffn_dim, default.steps,
         default.batch_size)


def test_either_world_version_loads_and_only_a_plan_world_plans(plan_micro_world, micro_world, tmp_path):
    planner = load_world(plan_micro_world).policy
    assert planner.plan_vocab_size == len(plan_words()) + 1 and planner.cfg.max_plan_tokens == MAX_PLAN_TOKENS
    check_planning(planner, "shapes", MAX_PLAN_TOKENS)  # configs/shapes_plan.yaml's sample.plan.max_tokens
    with pytest.raises(ConfigError, match="plans hold at most 11 tokens"):
        check_planning(planner, "shapes", MAX_PLAN_TOKENS + 1)
    old = tmp_path / "old"
    shutil.copytree(micro_world, old)
    info = json.loads((old / "world.json").read_text())
    (old / "world.json").write_text(json.dumps({k: v for k, v in info.items() if k != "plan"} | {"version": 1}))
    policy = load_world(old).policy  # a version 1 world, as worlds/shapes is
    assert policy.plan_vocab_size == 0
    with pytest.raises(ConfigError, match="policy.kind 'shapes' .* cannot write a text plan"):
        check_planning(policy, "shapes", MAX_PLAN_TOKENS)
    (old / "world.json").write_text(json.dumps(info | {"version": 4}))
    with pytest.raises(WorldError, match="is of version 4; this grpo-vision reads world versions 1, 2, 3"):
        load_world(old)


def test_a_canvas_world_trains_a_policy_that_draws_its_plan_onto_the_token_grid(micro_world, plan_micro_world,
                                                                               tmp_path):
    """`world build --preset canvas_micro --from <micro world>`: the plan world's recipe with a layout canvas, whose
    boxes are the plan reward's (a large object at cell (4, 6) of the plan's 16 x 16 covers the tokens whose centres
    lie within 27 / 2 px of its cell's centre (18, 26) px: on the micro world's 8 x 8 tokens of 8 px, the centres
    20, 28, 36 px of rows 2-4 and 12, 20, 28 px of columns 1-3)."""
    messages = []
    build_world(tmp_path / "w", preset="canvas_micro", seed=0, progress=False, log=messages.append,
                start_from=micro_world)
    assert "[world] policy: building (canvas_micro, seed 0)" in messages
    info = json.loads((tmp_path / "w" / "world.json").read_text())
    assert (info["version"], info["plan"]["canvas"]) == (3, True)
    assert recipe_hashes("canvas_micro")["policy"] != recipe_hashes("plan_micro")["policy"]
    policy = load_world(tmp_path / "w").policy
    assert policy.cfg.canvas_extents == {"small": 3.5, "large": 6.75} and policy.image_grid == (8, 8)
    with torch.no_grad():
        policy.canvas.weight.zero_()
        policy.canvas.weight[:len(policy.cfg.canvas_attributes)] = torch.eye(len(policy.cfg.canvas_attributes))
        cond = policy.plan_condition(["a red circle"], [plan_ids(["red", "circle", "large", "x4", "y6", "white"])])
        hot = policy.layout_canvas(cond)[0, :, :11].view(8, 8, 11)
    covered = hot.sum(-1) > 0
    assert covered.nonzero()[:, 0].unique().tolist() == [2, 3, 4] and covered.sum() == 9
    assert covered.nonzero()[:, 1].unique().tolist() == [1, 2, 3]
    assert hot[covered].sum(0).nonzero().flatten().tolist() == [0, 6, 10]  # red, circle, large
    assert load_world(plan_micro_world).policy.layout_canvas(cond) is None  # the plan world's policy has none


def test_a_plan_world_of_another_plan_grammar_is_refused(plan_micro_world, monkeypatch):
    monkeypatch.setattr("grpo_vision.shapes.plan.plan_words", lambda: ["red", "x0"])
    with pytest.raises(WorldError, match="plans in words other than this grpo-vision's plan grammar"):
        load_world(plan_micro_world)


def test_plan_training_data_by_hand(plan_micro_world):
    policy = load_world(plan_micro_world).policy
    # local plan ids: plan_words()[j - 1] is j; red 1, circle 7, small 10, x4 12 + 4, y6 28 + 6, white 44; 0 ends
    data = plan_data(policy, ["a red circle"], [["red", "circle", "small", "x4", "y6", "white"]])
    assert data.tokens.tolist() == [[1, 7, 10, 16, 34, 44] + [0] * 6]  # MAX_PLAN_TOKENS + 1 wide
    assert data.targets.tolist() == [[1, 7, 10, 16, 34, 44, 0] + [-100] * 5]  # nothing trained after the end
    assert policy.plan_text([1, 7, 10, 16, 34, 44]) == "red circle small x4 y6 white"
    assert torch.equal(data.cond, policy.plan_condition(["a red circle"], [[1, 7, 10, 16, 34, 44]]))
    assert torch.equal(data.ids, policy.encode_plan_prompts(["a red circle"]))
    assert data.null.shape == (1, data.cond.shape[1]) and data.cond.shape[1] > policy.encode_prompts(["a"]).shape[1]


def test_planned_logits_are_each_rows_own_condition(plan_micro_world):
    """The two passes of a planning step give each row the logits of its own condition (the caption, or caption and
    plan, or the null row at that width), their targets in the same order."""
    policy = load_world(plan_micro_world).policy
    captions = ["a red circle", "a small blue square", "a green triangle left of a red square", "a red circle"]
    plans = [["red", "circle", "small", "x4", "y6", "white"], ["blue", "square", "small", "x9", "y2", "gray"],
             ["green", "triangle", "large", "x2", "y8", "red", "square", "small", "x12", "y8", "black"],
             ["red", "circle", "large", "x7", "y7", "black"]]
    data = plan_data(policy, captions, plans)
    idx = torch.tensor([2, 0, 3, 1])
    target = torch.randint(0, policy.codebook_size, (4, policy.num_image_tokens), generator=torch.Generator().manual_seed(0))
    drop, with_plan = torch.tensor([False, False, True, True]), torch.tensor([True, False, True, False])
    cond = policy.encode_prompts([captions[i] for i in idx])
    cond = torch.where(drop[:, None], policy.null_condition(cond), cond)
    with torch.no_grad():
        logits, ordered, plan_logits = planned_logits(policy, data, idx, cond, target, drop, with_plan)
        plain_null = policy.null_condition(cond[:1])
        expected = [policy.image_logits(cond[1:2], target[1:2]),  # caption rows first: row 1, row 3 (dropped)
                    policy.image_logits(plain_null, target[3:4]),
                    policy.image_logits(data.cond[2:3], target[0:1]),  # then the planned rows: row 0, row 2 (dropped)
                    policy.image_logits(data.null, target[2:3])]
        assert torch.equal(ordered, target[[1, 3, 0, 2]])
        torch.testing.assert_close(logits, torch.cat(expected), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(plan_logits, policy.plan_logits(data.ids[idx], data.tokens[idx]))


def test_the_plan_config_is_the_main_job_on_the_plan_world():
    from grpo_vision.config import load_config
    from tests.helpers import ROOT

    plan, main = (load_config(ROOT / "configs" / f"{n}.yaml") for n in ("shapes_plan", "shapes"))
    assert plan.policy.path == "worlds/shapes_plan" and plan.sample.plan.enabled
    assert (plan.sample.plan.max_tokens, plan.sample.plan.temperature, plan.sample.plan.top_k) == (MAX_PLAN_TOKENS, 1.0, 0)
    assert plan.train.plan_weight == 1.0
    # without the text stage it is the main job's recipe on the plan world
    off = load_config(ROOT / "configs" / "shapes_plan.yaml", ["sample.plan.enabled=false"])
    for section in ("sample", "train", "reward", "log", "data"):
        ours, theirs = vars(getattr(off, section)).copy(), vars(getattr(main, section)).copy()
        assert {k: v for k, v in ours.items() if k != "plan"} == {k: v for k, v in theirs.items() if k != "plan"}


@pytest.mark.parametrize("preset, folder, version", [("plan", "shapes_plan", 2), ("canvas", "shapes_canvas", 3)])
def test_committed_plan_worlds_match_their_recipes(preset, folder, version):
    """As test_world.py's check of worlds/shapes: `world build --preset plan (canvas) --from worlds/shapes` finds
    nothing to build on the committed plan (canvas) world, every file loads and is the one world.json records, and
    its vq, CLIP and aesthetic head are worlds/shapes's own."""
    from grpo_vision.shapes.build import load_problem, stage_done
    from grpo_vision.shapes.world import checksum_problem
    from tests.helpers import ROOT

    world, base = ROOT / "worlds" / folder, ROOT / "worlds" / "shapes"
    hashes = recipe_hashes(preset)
    presets = {n: WORLD_PRESETS[preset][n == "policy"] for n in STAGES}
    assert [n for n in STAGES if stage_done(world, n, presets[n], 0, hashes[n]) is None] == []
    info = json.loads((world / "world.json").read_text())
    assert (info["version"], info["preset"], info["plan"]["words"]) == (version, preset, plan_words())
    assert info["plan"].get("canvas", False) == (preset == "canvas")
    assert (load_world(world).policy.layout_canvas(torch.zeros(1, 2, dtype=torch.long)) is None) == (preset == "plan")
    assert {n: load_problem(world, n) for n in STAGES} == {n: None for n in STAGES}
    assert {n: checksum_problem(world, info["files"], n) for n in STAGES} == {n: None for n in STAGES}
    shared = json.loads((base / "world.json").read_text())["files"]
    assert {k: v for k, v in info["files"].items() if not k.startswith("policy/")} == \
        {k: v for k, v in shared.items() if not k.startswith("policy/")}


@pytest.mark.e2e  # a GRPO run
def test_grpo_with_the_text_stage_trains_the_plan_worlds_policy(plan_micro_world, tmp_path):
    """The real entry point on the plan micro world with sample.plan on: the plans are judged each step
    (plan/<attribute>, from ShapesJudge.plan_verdicts), the metrics are finite, and the step moves the plan rows of
    lm_head as well as the image rows (plan and image trained under one advantage)."""
    from safetensors.torch import load_file

    from grpo_vision.train import train
    from tests.helpers import micro_cfg

    cfg = micro_cfg(plan_micro_world, tmp_path, "sample.plan.enabled=true", f"sample.plan.max_tokens={MAX_PLAN_TOKENS}",
                    "train.steps=1", "log.eval_images=1")
    run = train(cfg, progress=False)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"plan/length", "plan/correct", "plan/count", "plan/color", "plan/shape"} <= row.keys()
    assert all(math.isfinite(v) for k, v in row.items() if isinstance(v, float) and k.startswith(("loss/", "plan/")))
    assert 1 <= row["plan/length"] <= MAX_PLAN_TOKENS
    before = load_file(plan_micro_world / "policy" / "policy.safetensors")["lm_head.weight"]
    after = load_file(run / "checkpoints" / "step_000001" / "policy.safetensors")["lm_head.weight"]
    policy = load_world(plan_micro_world).policy
    plan_rows = slice(policy.cfg.plan_offset + 1, policy.cfg.vocab_size)
    image_rows = slice(policy.cfg.image_offset, policy.cfg.plan_offset)
    assert not torch.equal(before[plan_rows], after[plan_rows]) and not torch.equal(before[image_rows], after[image_rows])
