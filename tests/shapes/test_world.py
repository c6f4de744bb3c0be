"""ShapesWorld build: the micro preset end to end, resumable, validated, reloadable. The tests that build
(or rebuild part of) a world, or run the CLI in a subprocess, are the e2e tier."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from grpo_vision.shapes.build import build_world, load_problem
from grpo_vision.shapes.world import (FILES, STAGES, WorldError, check_world_dir, checksum_problem, file_checksums,
                                      load_world, stage_problem, with_dependents)
from tests.helpers import MICRO, ROOT, run_cli


def test_micro_world_has_every_part_and_figure(micro_world):
    info = check_world_dir(micro_world)
    for name in STAGES:
        assert (micro_world / name).is_dir() and (micro_world / "stages" / f"{name}.json").is_file()
    q = info["quality"]
    for key in ("checker_acc_clean", "checker_reject_altered", "vq_psnr_clean", "vq_checker_acc_all",
                "clip_acc_color", "clip_acc_relation", "aesthetic_spearman", "policy_acc_seen", "policy_acc_heldout"):
        assert key in q, key
    assert q["checker_acc_clean"] == 1.0 and q["checker_reject_altered"] == 1.0
    assert (micro_world / "contact_sheet.png").stat().st_size > 1000
    assert not list(micro_world.glob("*.tmp"))  # nothing half-written left behind


@pytest.mark.e2e
def test_the_build_is_deterministic(micro_world, tmp_path):
    """The same preset and seed build the same weights, to the bit, and the same figures (on one
    machine: another CPU's floating point may differ)."""
    from safetensors.torch import load_file

    again = tmp_path / "again"
    build_world(again, preset="micro", seed=0, progress=False, log=lambda _: None)
    files = sorted(p.relative_to(micro_world) for p in micro_world.rglob("*.safetensors"))
    assert {p.parts[0] for p in files} == set(STAGES)
    assert files == sorted(p.relative_to(again) for p in again.rglob("*.safetensors"))
    for rel in files:
        a, b = load_file(micro_world / rel), load_file(again / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel

    def figures(world):  # every quality figure but the timings
        return {k: v for k, v in json.loads((world / "world.json").read_text())["quality"].items() if "seconds" not in k}

    assert figures(micro_world) == figures(again)


@pytest.mark.e2e
def test_rebuild_skips_finished_stages(micro_world, tmp_path):
    copy = tmp_path / "w"
    shutil.copytree(micro_world, copy)
    messages = []
    build_world(copy, preset="micro", seed=0, progress=False, log=messages.append)
    assert messages == [f"[world] {copy} is complete (micro, seed 0); nothing to build"]
    (copy / "world.json").unlink()  # as if the last build stopped during evaluation
    before = {n: (copy / "stages" / f"{n}.json").read_text() for n in STAGES}
    messages = []
    build_world(copy, preset="micro", seed=0, progress=False, log=messages.append)
    assert sum("already built" in m for m in messages) == len(STAGES)  # evaluation only: no stage trained again
    assert {n: (copy / "stages" / f"{n}.json").read_text() for n in STAGES} == before


@pytest.mark.e2e
def test_changed_recipe_rebuilds_that_stage_and_what_is_trained_on_it(micro_world, tmp_path, monkeypatch):
    import dataclasses

    from grpo_vision.shapes.build.train_vq import VQ_PRESETS

    copy = tmp_path / "w"
    shutil.copytree(micro_world, copy)
    before = {n: json.loads((copy / "stages" / f"{n}.json").read_text()) for n in STAGES}
    monkeypatch.setitem(VQ_PRESETS, "micro", dataclasses.replace(VQ_PRESETS["micro"], steps=VQ_PRESETS["micro"].steps + 1))
    messages = []
    build_world(copy, preset="micro", seed=0, progress=False, log=messages.append)
    rebuilt = {n for n in STAGES if any(m.startswith(f"[world] {n}: its recipe") for m in messages)}
    assert rebuilt == {"vq", "policy"}  # the policy is trained on the tokenizer's codes; clip and aesthetic are not
    after = {n: json.loads((copy / "stages" / f"{n}.json").read_text()) for n in STAGES}
    assert after["vq"]["vq_steps"] == before["vq"]["vq_steps"] + 1
    assert after["clip"] == before["clip"] and after["aesthetic"] == before["aesthetic"]
    assert after["policy"]["recipe"] != before["policy"]["recipe"]
    messages = []
    build_world(copy, preset="micro", seed=0, progress=False, log=messages.append)
    assert messages == [f"[world] {copy} is complete (micro, seed 0); nothing to build"]
    (copy / "stages" / "aesthetic.json").write_text('{"preset": "mic')  # damaged by hand: rebuilt, not a crash
    messages = []
    build_world(copy, preset="micro", seed=0, progress=False, log=messages.append)
    assert "[world] aesthetic: building (micro, seed 0)" in messages
    assert sum("already built" in m for m in messages) == len(STAGES) - 1


def test_incomplete_world_is_reported_not_used(micro_world, tmp_path):
    copy = tmp_path / "w"
    shutil.copytree(micro_world, copy)
    (copy / "stages" / "policy.json").unlink()
    with pytest.raises(WorldError, match=r"incomplete: missing stage\(s\) policy; build it with: grpo-vision world build"):
        load_world(copy)
    (copy / "stages" / "policy.json").write_text("{}")
    (copy / "world.json").write_text('{"version": 1, "pres')  # cut off mid-write by hand
    with pytest.raises(WorldError, match="unreadable world.json .*delete it and build it with"):
        load_world(copy)
    (copy / "world.json").unlink()
    with pytest.raises(WorldError, match="missing world.json"):
        load_world(copy)
    with pytest.raises(WorldError, match="world directory not found"):
        load_world(tmp_path / "absent")


def test_saved_models_load_back_with_identical_outputs(micro_world):
    from grpo_vision.rewards.aesthetic import load_aesthetic
    from grpo_vision.shapes.build.train_clip import MODEL_NAME, clip_scores, image_embeddings, load_clip

    w1, w2 = load_world(micro_world), load_world(micro_world)
    images = torch.rand(2, 3, 64, 64)
    assert torch.equal(w1.tokenizer.encode(images), w2.tokenizer.encode(images))
    cond = w1.policy.encode_prompts(["a red circle", "a blue square"])
    tokens = torch.randint(0, w1.policy.codebook_size, (2, w1.policy.num_image_tokens))
    with torch.no_grad():
        assert torch.equal(w1.policy.image_logits(cond, tokens), w2.policy.image_logits(cond, tokens))
    (m1, _, t1), (m2, _, t2) = (load_clip(MODEL_NAME, micro_world / "clip" / "clip.safetensors") for _ in range(2))
    with torch.no_grad():
        assert torch.equal(clip_scores(m1, t1, images, ["a red circle"] * 2), clip_scores(m2, t2, images, ["a red circle"] * 2))
        h1, h2 = load_aesthetic(micro_world / "aesthetic"), load_aesthetic(micro_world / "aesthetic")
        emb = image_embeddings(m1, images)
        assert torch.equal(h1(emb), h2(emb))


def test_a_broken_world_file_is_named_with_the_stage_to_rebuild(micro_world, tmp_path):
    copy = tmp_path / "w"
    shutil.copytree(micro_world, copy)
    fix = f"with: grpo-vision world build --out {copy} --preset micro --seed 0 (it rebuilds"
    errors = {}
    for stage, names in FILES.items():
        for name in names:
            path = copy / stage / name
            original = path.read_bytes()
            path.write_bytes(original[:len(original) // 2])  # cut short, as by a failed copy
            assert stage_problem(copy, stage).startswith(f"{path} does not load (")
            with pytest.raises(WorldError) as err:
                load_world(copy)
            assert str(err.value).startswith(f"world file {path} does not load (")
            assert f"; rebuild stage '{stage}' {fix} {stage}" in str(err.value)
            errors[stage] = str(err.value)
            path.write_bytes(original)
    assert errors["vq"].endswith("(it rebuilds vq and policy, trained on it, and keeps the other stages)")
    assert errors["aesthetic"].endswith("(it rebuilds aesthetic and keeps the other stages)")
    assert with_dependents({"vq"}) == ["vq", "policy"] and with_dependents({"clip"}) == ["clip", "aesthetic"]
    assert all(stage_problem(copy, n) is None for n in STAGES)
    (copy / "policy" / "policy_config.json").write_text("{}")  # parses, but makes no policy: the load says so
    assert stage_problem(copy, "policy") is None  # training's check reads the files, not the model
    assert load_problem(copy, "policy").startswith(f"{copy / 'policy'} does not load (CheckpointError: ")


def test_a_failure_of_the_machine_is_not_blamed_on_a_world_file(tmp_path, monkeypatch):
    # run.threads=100000 exhausted the memory, and the failed mmap of an intact file was reported as
    # "world file ... does not load; rebuild stage 'vq'": only the file's own faults are its
    import safetensors

    (tmp_path / "vq").mkdir()
    (tmp_path / "vq" / "config.json").write_text("{}")
    (tmp_path / "vq" / "diffusion_pytorch_model.safetensors").write_bytes(b"intact")
    out_of_memory = RuntimeError("unable to mmap 287348 bytes from file <x>: Cannot allocate memory (12)")
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: (_ for _ in ()).throw(out_of_memory))
    with pytest.raises(RuntimeError, match="Cannot allocate memory"):
        stage_problem(tmp_path, "vq")


def nan_under_the_header(path: Path, nbytes: int = 4096) -> None:
    """Overwrite `nbytes` of a safetensors file's data with NaN (0xff bytes), its header intact: it still parses."""
    import struct

    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0] + 1000  # past the 8-byte length and the JSON header
    data[start:start + nbytes] = b"\xff" * nbytes
    path.write_bytes(bytes(data))


@pytest.mark.e2e
def test_a_file_damaged_under_an_intact_header_is_named_and_rebuilt(micro_world, tmp_path):
    copy = tmp_path / "w"
    shutil.copytree(micro_world, copy)
    info = json.loads((copy / "world.json").read_text())
    assert info["files"] == file_checksums(copy) and set(info["files"]) == {f"{n}/{f}" for n in STAGES for f in FILES[n]}
    weights = copy / "policy" / "policy.safetensors"
    nan_under_the_header(weights)
    assert stage_problem(copy, "policy") is None  # it parses: only the checksum tells
    with pytest.raises(WorldError) as err:
        load_world(copy)
    assert str(err.value) == (f"world file {weights} is not the file the build wrote (its size or sha256 differs from "
                              f"world.json's): it was changed or damaged since; rebuild stage 'policy' with: grpo-vision "
                              f"world build --out {copy} --preset micro --seed 0 (it rebuilds policy and keeps the other "
                              "stages)")
    messages = []
    build_world(copy, preset="micro", seed=0, progress=False, log=messages.append)
    assert f"[world] policy: {weights} is not the file the build wrote (its size or sha256 differs from world.json's): " \
           "it was changed or damaged since; rebuilding" in messages
    assert sum("already built" in m for m in messages) == len(STAGES) - 1
    assert json.loads((copy / "world.json").read_text())["files"] == file_checksums(copy)
    load_world(copy)


def test_a_world_json_without_checksums_is_refused_until_world_build_records_them(micro_world, tmp_path):
    copy = tmp_path / "w"
    shutil.copytree(micro_world, copy)
    info = json.loads((copy / "world.json").read_text())
    del info["files"]  # edited by hand: not one file could be checked
    (copy / "world.json").write_text(json.dumps(info))
    # the command rebuilds nothing: the world's own preset and seed (the default preset would rebuild it all)
    with pytest.raises(WorldError) as err:
        load_world(copy)
    assert str(err.value) == (f"{copy / 'world.json'} records no checksums of the world's files (was it edited?); "
                              f"check and record them with: grpo-vision world build --out {copy} --preset micro "
                              "--seed 0")
    messages = []
    build_world(copy, preset="micro", seed=0, progress=False, log=messages.append)
    assert messages == [f"[world] {copy}: recorded the size and sha256 of each file in world.json",
                        f"[world] {copy} is complete (micro, seed 0); nothing to build"]
    assert json.loads((copy / "world.json").read_text())["files"] == file_checksums(copy)
    load_world(copy)
    info["files"] = {}  # recording none checks none no more: every file is named as not the build's
    (copy / "world.json").write_text(json.dumps(info))
    with pytest.raises(WorldError, match=rf"^world file {copy / 'vq' / 'config.json'} is not the file the build wrote"):
        load_world(copy)


def test_non_finite_weights_in_any_stage_are_named_by_its_loader(micro_world, tmp_path):
    """Without checksums (a user's own files) each loader names NaN weights."""
    copy = tmp_path / "w"
    shutil.copytree(micro_world, copy)
    for stage in STAGES:
        weights = next(copy / stage / f for f in FILES[stage] if f.endswith(".safetensors"))
        original = weights.read_bytes()
        nan_under_the_header(weights, 512)
        problem = load_problem(copy, stage)
        assert problem.startswith(f"{copy / stage} does not load (") and f"{weights} hold" in problem, problem
        assert "NaN or infinite values in " in problem and "the file is damaged" in problem
        weights.write_bytes(original)
    assert all(load_problem(copy, n) is None for n in STAGES)


def test_a_policy_config_edited_after_the_build_is_named(micro_world, tmp_path):
    copy = tmp_path / "w"
    shutil.copytree(micro_world, copy)
    config = copy / "policy" / "policy_config.json"
    config.write_text(config.read_text().replace('"dim": 64', '"dim": 96'))
    with pytest.raises(WorldError, match=rf"^world file {config} is not the file the build wrote"):
        load_world(copy)


@pytest.mark.e2e
def test_world_build_rebuilds_a_stage_whose_file_does_not_load(micro_world, tmp_path):
    copy = tmp_path / "w"
    shutil.copytree(micro_world, copy)
    weights = copy / "aesthetic" / "aesthetic.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    out = run_cli("world", "build", "--out", copy, "--preset", "micro", "--seed", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    why = next(ln for ln in lines if ln.startswith("[world] aesthetic: "))
    assert why.startswith(f"[world] aesthetic: {weights} does not load (SafetensorError: ") and why.endswith("; rebuilding")
    assert "[world] aesthetic: building (micro, seed 0)" in lines and "nothing to build" not in out.stdout
    assert out.stdout.count("already built") == len(STAGES) - 1  # the others are kept
    assert stage_problem(copy, "aesthetic") is None and check_world_dir(copy)["preset"] == "micro"


@pytest.mark.e2e
def test_train_on_a_broken_world_file_is_one_line_naming_it(micro_world, tmp_path):
    copy = tmp_path / "w"
    shutil.copytree(micro_world, copy)
    weights = copy / "vq" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    out = run_cli("train", MICRO, f"policy.path={copy}", f"run.out_dir={tmp_path}")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    error = [ln for ln in out.stderr.splitlines() if ln.startswith("grpo-vision: error:")]
    assert len(error) == 1 and error[0].startswith(f"grpo-vision: error: world file {weights} does not load (")
    assert error[0].endswith(f"rebuild stage 'vq' with: grpo-vision world build --out {copy} --preset micro --seed 0 "
                             "(it rebuilds vq and policy, trained on it, and keeps the other stages)")
    assert not (tmp_path / "shapes_micro").exists()  # nothing was started


@pytest.mark.e2e
def test_world_render_cli(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\na large blue square left of a green circle\n")
    render = ("world", "render", "--prompts", prompts, "--out", tmp_path / "r", "--n", "2", "--seed", "3")
    out = run_cli(*render)
    assert out.returncode == 2 and "line 2: caption 'a large blue square left of a green circle' is outside" in out.stderr
    prompts.write_text("a red circle\na blue square left of a green circle\n")
    out = run_cli(*render)
    assert out.returncode == 0, out.stderr
    index = [json.loads(ln) for ln in (tmp_path / "r" / "index.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["seed"]) for r in index] == [("a red circle", 3), ("a red circle", 4),
                                                        ("a blue square left of a green circle", 3),
                                                        ("a blue square left of a green circle", 4)]
    from PIL import Image

    from grpo_vision.shapes.checker import check
    for r in index:  # ground truth: the checker accepts every render
        assert check(__import__("numpy").asarray(Image.open(tmp_path / "r" / r["file"])), r["prompt"]).correct


def test_world_prompts_cli_leaves_out_what_a_run_trained_on(tmp_path, capsys):
    from grpo_vision.cli import main
    from grpo_vision.config import load_config, save_config
    from grpo_vision.splits import prompt_lists
    from grpo_vision.shapes.scene import all_captions, parse_caption

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(ROOT / "configs" / "shapes.yaml", ["run.seed=1"])
    cfg.run.device = "banana"  # saved before run.device was checked: the prompts need no device
    save_config(cfg, run / "config.yaml")

    def cli(*args):
        main(["world", "prompts", *args])
        assert capsys.readouterr().out.startswith("wrote ")
        return Path(args[args.index("--out") + 1]).read_text().splitlines()

    assert sorted(cli("--form", "plain", "--out", str(tmp_path / "a.txt"))) == ["a blue triangle", "a purple square",
                                                                                "a yellow circle"]
    trained = {e.prompt for e in prompt_lists(cfg).train}
    kept = cli("--split", "all", "--not-trained-in", str(run), "--out", str(tmp_path / "b.txt"))
    assert kept and not set(kept) & trained and set(kept) | trained == set(all_captions("all"))
    drawn = cli("--form", "relation", "--n", "5", "--seed", "2", "--out", str(tmp_path / "c.txt"))
    assert len(set(drawn)) == 5 and all(parse_caption(c).form == "relation" for c in drawn)


def test_committed_world_matches_the_default_recipe():
    """The README's main command runs `world build` on the committed world and must find nothing to
    build: a default preset changed without rebuilding (and committing) the world would start an
    hour-long rebuild there instead."""
    from grpo_vision.shapes.build import recipe_hashes, stage_done

    world = ROOT / "worlds" / "shapes"
    hashes = recipe_hashes("default")
    stale = [n for n in STAGES if stage_done(world, n, "default", 0, hashes[n]) is None]
    assert not stale, f"worlds/shapes stages {stale} were built with another recipe; rebuild with grpo-vision world build"
    assert {n: load_problem(world, n) for n in STAGES} == {n: None for n in STAGES}  # and every file loads
    recorded = json.loads((world / "world.json").read_text()).get("files")
    assert recorded, "worlds/shapes/world.json records no checksums: add them with grpo-vision world build"
    assert {n: checksum_problem(world, recorded, n) for n in STAGES} == {n: None for n in STAGES}


def test_eval_sets_are_balanced_by_form_never_trained_on_and_drawn_again_by_option():
    from collections import Counter

    from grpo_vision.config import load_config
    from grpo_vision.splits import prompt_lists
    from grpo_vision.shapes.scene import all_captions, parse_caption

    cfg = load_config(ROOT / "configs" / "shapes.yaml")
    sets = prompt_lists(cfg)
    form = lambda p: parse_caption(p).form  # noqa: E731
    for entries in (sets.test, sets.heldout, sets.train_sample):
        assert len(entries) == 128 and set(Counter(form(e.prompt) for e in entries).values()) == {32}
    test, train = {e.prompt for e in sets.test}, {e.prompt for e in sets.train}
    # the test pool is half of each form's training-split captions: 15 plain -> 7, 30 size -> 15, 45 -> 22; 32
    # relation captions of its 420 are drawn; a form with fewer captions than its 32 repeats them
    assert Counter(map(form, test)) == {"plain": 7, "size": 15, "background": 22, "relation": 32}
    assert not test & train and {e.prompt for e in sets.train_sample} <= train
    assert {e.prompt for e in sets.heldout} <= set(all_captions("heldout")) and not set(all_captions("heldout")) & train
    assert len(set(Counter(form(e.prompt) for e in sets.train).values())) == 1  # training balanced by form too
    seeded = prompt_lists(load_config(ROOT / "configs" / "shapes.yaml", ["run.seed=3"]))
    assert seeded.train == sets.train and seeded.train_sample == sets.train_sample  # a data set: seeds share it
    cfg.data.eval_draw = 2
    again = prompt_lists(cfg)
    assert [e.prompt for e in again.train] == [e.prompt for e in sets.train]  # the same run: only the draw differs
    other = {e.prompt for e in again.test}
    assert not other & train and len({p for p in other - test if form(p) == "relation"}) >= 28
    cfg.data.eval_size = 8
    assert [form(e.prompt) for e in prompt_lists(cfg).test] == ["plain", "size", "background", "relation"] * 2
