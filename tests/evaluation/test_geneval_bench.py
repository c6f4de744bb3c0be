"""GenEval's summary and the paired change (grpo_vision/evaluation/geneval_bench.py), worked out by hand; the
round trip `prompts geneval --out` -> `sample --layout geneval` -> `score geneval` (and `eval --benchmark
geneval`) from either shape of GenEval prompts, on a tiny run and a detector whose finds are set by hand."""

import json

import pytest
import torch

from grpo_vision.evaluation.geneval_bench import paired_change, summary


def rows(spec):
    """spec: (prompt, tag, [correct per image])."""
    return [{"prompt": p, "tag": t, "correct": c} for p, t, cs in spec for c in cs]


SPEC = [("a photo of a cat", "single_object", [1, 1, 1, 0]),
        ("a photo of a dog", "single_object", [0, 0, 0, 0]),
        ("a photo of two clocks", "counting", [1, 0, 0, 0])]


def test_summary_is_genevals_mean_over_tasks():
    s = summary(rows(SPEC))
    # single_object: 3 of 8 images = 0.375; counting: 1 of 4 = 0.25; overall (0.375 + 0.25) / 2 = 0.3125
    assert s["tasks"] == {"single_object": {"accuracy": 0.375, "correct": 3, "images": 8},
                          "counting": {"accuracy": 0.25, "correct": 1, "images": 4}}
    assert s["overall"] == 0.3125
    # 4 of 12 images; prompts with at least one correct image: cat and clocks, 2 of 3
    assert s["images_correct"] == pytest.approx(1 / 3) and s["prompts_correct"] == pytest.approx(2 / 3)
    assert (s["images"], s["prompts"]) == (12, 3)
    assert s["failing"] == {}  # these rows say nothing of why


def test_summary_counts_each_image_once_per_kind_of_failure():
    r = rows(SPEC[:1])  # four images of one prompt
    r[0]["failures"], r[1]["failures"] = ["object", "position"], ["position", "position"]
    # position: images 0 and 1 = 2 of 4 (image 1's two position clauses count once); object: 1 of 4
    assert summary(r)["failing"] == {"object": 0.25, "position": 0.5}  # in FAILURES' order


def test_paired_change_by_hand_and_its_interval_over_prompts():
    reference = rows(SPEC)
    policy = rows([("a photo of a cat", "single_object", [1, 1, 1, 1]),  # +1 image
                   ("a photo of a dog", "single_object", [1, 1, 0, 0]),  # +2
                   ("a photo of two clocks", "counting", [1, 0, 0, 0])])  # 0
    out = paired_change(policy, reference, replicates=2000)
    # single_object: +3 of 8 images = +0.375; counting: 0; overall (0.375 + 0) / 2 = 0.1875
    assert out["tasks"]["single_object"]["change"] == 0.375 and out["tasks"]["counting"]["change"] == 0.0
    assert out["overall"]["change"] == 0.1875
    # resampling the two single-object prompts gives +0.25 (cat twice), +0.375 or +0.5 (dog twice): the
    # interval's ends are those extremes; counting has one prompt whose change is 0, so its interval is [0, 0]
    assert out["tasks"]["single_object"]["ci95"] == [0.25, 0.5]
    assert out["tasks"]["counting"]["ci95"] == [0.0, 0.0]
    assert out["overall"]["ci95"] == [0.125, 0.25]  # half of the single-object ends


def test_the_models_must_be_scored_on_the_same_prompts():
    with pytest.raises(ValueError, match="same prompts"):
        paired_change(rows(SPEC), rows(SPEC[:2]))


# ---------------------------------------------------------------- the round trip, from either shape


@pytest.fixture(scope="module")
def coco_run(tmp_path_factory, detector_options):
    """One training step of a tiny built-in policy (a diffusers VQ, 16 x 16 images) whose vocabulary holds
    every word of GenEval's prompts, which the micro world's policy cannot read: a run to `sample` them,
    its config naming the geneval reward's models for `eval --benchmark geneval`."""
    from diffusers import VQModel

    from grpo_vision.config import load_config
    from grpo_vision.models.llama import LlamaImagePolicy, LlamaPolicyConfig
    from grpo_vision.models.tokenizer import VQTokenizer
    from grpo_vision.rewards.geneval_prompts import evaluation_entries, training_entries
    from grpo_vision.train import train

    root = tmp_path_factory.mktemp("coco_run")
    torch.manual_seed(0)
    vq = VQModel(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                 up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                 latent_channels=4, sample_size=16, num_vq_embeddings=16, vq_embed_dim=4, norm_num_groups=4)
    VQTokenizer(vq).save_pretrained(root / "vq")
    words = sorted({w for e in [*evaluation_entries(), *training_entries(5)] for w in e.prompt.split()})
    policy = LlamaPolicyConfig(words=words, max_caption_words=12, codebook_size=16, image_grid=(8, 8), dim=32,
                               n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=48)
    LlamaImagePolicy(policy).save_pretrained(root / "policy")
    (root / "train.txt").write_text("a photo of a cat\na photo of two dogs\n")
    (root / "eval.txt").write_text("a photo of a bench\n")
    cfg = load_config(None, ["policy.kind=llama", f"policy.path={root / 'policy'}", f"policy.tokenizer={root / 'vq'}",
                             f"data.train_prompts={root / 'train.txt'}", f"data.eval_prompts={root / 'eval.txt'}",
                             "reward.weights={jpeg_compressibility: 1.0}", "reward.monitor=[]",
                             "sample.prompts_per_step=2", "sample.group_size=2", "train.micro_batch_size=2",
                             "train.steps=1", "log.sample_every=0", "log.report=false", "log.trackers=[]",
                             f"run.out_dir={root / 'runs'}", "run.device=cpu", *detector_options])
    return train(cfg, progress=False)


@pytest.fixture(scope="module")
def detector_options(tmp_path_factory):
    """`score geneval`'s overrides: a tiny OWLv2 directory and colour CLIP, real files the reward checks."""
    from tests.rewards.test_geneval_reward import save_tiny_clip, save_tiny_owlv2

    d = tmp_path_factory.mktemp("geneval_detector")
    config, checkpoint, _ = save_tiny_clip(d)
    g = "reward.options.geneval."
    return [f"{g}detector=owlv2", f"{g}detector_path={save_tiny_owlv2(d / 'owlv2')}", f"{g}clip_model={config}",
            f"{g}clip_checkpoint={checkpoint}"]


class InARow:
    """A detector that finds one object of each class it is asked for, at 0.95, side by side from the
    left in the order asked (10-pixel boxes 20 pixels apart); it records what it was asked."""

    def __init__(self):
        self.asked = []

    def detect(self, images, classes):
        from grpo_vision.rewards.geneval import Detection

        self.asked += classes
        return [{name: [Detection((20.0 * k, 0.0, 20.0 * k + 9, 9.0), 0.95)] for k, name in enumerate(names)}
                for names in classes]


@pytest.mark.usefixtures("one_thread")
def test_prompts_sample_score_round_trip_from_either_shape(coco_run, detector_options, tmp_path, monkeypatch, capsys):
    """`prompts geneval --out F` -> `sample --layout geneval` -> `score geneval --against`, from the file the
    command writes (clauses under 'metadata') and from the same prompts in GenEval's own shape (clauses
    beside the prompt): the same folders, GenEval's flat metadata.jsonl in each, the same verdicts. Before
    one reader took both shapes, the first failed at `score` ("needs a 'tag'") and the second was refused by
    `eval`."""
    from grpo_vision.cli import main
    from grpo_vision.rewards import geneval_reward as gr

    detector = InARow()
    monkeypatch.setattr(gr, "load_detector", lambda kind, path, device: detector)
    monkeypatch.setattr(gr, "load_colour_classifier", lambda *args: lambda image, name, boxes: ["red"] * len(boxes))
    nested = tmp_path / "nested.jsonl"
    main(["prompts", "geneval", "--out", str(nested), "--train", "5"])
    lines = [json.loads(x) for x in nested.read_text().splitlines()]
    genevals = [{**x["metadata"], "prompt": x["prompt"]} for x in lines]  # GenEval's shape, written by hand
    (tmp_path / "geneval.jsonl").write_text("".join(json.dumps(x) + "\n" for x in genevals))
    assert [x["prompt"] for x in genevals] == [
        "a photo of a cell phone and a broccoli", "a photo of three bicycles", "a photo of a brown teddy bear",
        "a photo of an orange below a knife", "a photo of a blue bicycle and a red sports ball"]
    out = {}
    for shape in ("nested", "geneval"):
        for name, extra in (("policy", []), ("reference", ["--reference"])):
            main(["sample", str(coco_run), "--prompts", str(tmp_path / f"{shape}.jsonl"), "--layout", "geneval",
                  "--n", "2", "--out", str(tmp_path / shape / name), *extra])
        for i, row in enumerate(genevals):  # GenEval's line whichever shape went in, for its evaluate_images.py
            assert (tmp_path / shape / "policy" / f"{i:05d}" / "metadata.jsonl").read_text() == json.dumps(row)
        capsys.readouterr()
        main(["score", "geneval", str(tmp_path / shape / "policy"), "--against", str(tmp_path / shape / "reference"),
              "--device", "cpu", "--verdicts", str(tmp_path / f"{shape}.verdicts.jsonl"), *detector_options])
        out[shape] = json.loads(capsys.readouterr().out)
    # the same prompts, seeds and model: the same images
    pngs = {shape: sorted((tmp_path / shape).rglob("*.png")) for shape in out}
    assert len(pngs["nested"]) == 20  # 5 prompts x 2 images x 2 models
    assert [p.relative_to(tmp_path / "nested") for p in pngs["nested"]] == [
        p.relative_to(tmp_path / "geneval") for p in pngs["geneval"]]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(pngs["nested"], pngs["geneval"]))
    # the detector was asked for each prompt's classes, in the order its clauses name them, for each image
    asked = [["cell phone", "broccoli"], ["bicycle"], ["teddy bear"], ["knife", "orange"], ["bicycle", "sports ball"]]
    assert detector.asked == 4 * [c for c in asked for _ in range(2)]  # 2 shapes x 2 folders, 2 images a prompt
    rows = [json.loads(x) for x in (tmp_path / "nested.verdicts.jsonl").read_text().splitlines()]
    # worked out by hand: every class found once, every colour "red", the objects left to right as asked
    # two_object: both found, 2 of 2; counting: 1 bicycle of 3 (exclude "< 4" met), 1 of 2; colors: the
    # teddy bear is red, not brown, 0 of 1; position: the orange's centre is 20 px right of the knife's, 18.2
    # past the margin (0.1 x 18 px of box widths), 0.91 of the offset > 0.5: "right of", not below, 1 of 2;
    # color_attr: the bicycle is red, not blue, the ball red, 1 of 2
    assert [(r["tag"], r["clauses_met"], r["clauses"], r["failures"]) for r in rows[:10:2]] == [
        ("two_object", 2, 2, []), ("counting", 1, 2, ["count"]), ("colors", 0, 1, ["colour"]),
        ("position", 1, 2, ["position"]), ("color_attr", 1, 2, ["colour"])]
    assert [r["reasons"] for r in rows[:10:2]] == [
        [], ["expected bicycle>=3, found 1"], ["expected brown teddy bear>=1, found 0 (1 red)"],
        ["expected orange below target, found right of"], ["expected blue bicycle>=1, found 0 (1 red)"]]
    # five tasks, one prompt each, only two_object right: overall 1/5; a paired change of 0 (the verdicts
    # do not depend on the pixels), its interval [0, 0]
    result = out["nested"]
    assert result["summary"]["overall"] == pytest.approx(0.2)
    assert result["summary"]["images_correct"] == result["summary"]["prompts_correct"] == pytest.approx(0.2)
    assert result["summary"]["failing"] == {"count": 0.2, "colour": 0.4, "position": 0.2}
    assert result["against_summary"] == result["summary"]
    assert result["change"]["overall"] == {"change": 0.0, "ci95": [0.0, 0.0]}
    assert (result["prompts"], result["images"]) == (5, 10)
    assert {k: v for k, v in out["geneval"].items() if k not in ("folder", "against")} == {
        k: v for k, v in result.items() if k not in ("folder", "against")}
    # a folder that an older `sample` wrote, its metadata.jsonl nested: flattened and scored the same
    for i, x in enumerate(lines):
        (tmp_path / "nested" / "reference" / f"{i:05d}" / "metadata.jsonl").write_text(json.dumps(x))
    main(["score", "geneval", str(tmp_path / "nested" / "reference"), "--device", "cpu", *detector_options])
    assert json.loads(capsys.readouterr().out)["summary"] == result["summary"]


@pytest.mark.usefixtures("one_thread")
def test_eval_benchmark_takes_either_shape(coco_run, tmp_path, monkeypatch, capsys):
    """`eval --benchmark geneval --prompts F` on GenEval's own flat lines (before one reader: "unknown field(s)
    ['include', 'tag']") and on `prompts geneval --out`'s file: the same result."""
    from grpo_vision.cli import main
    from grpo_vision.rewards import geneval_reward as gr

    monkeypatch.setattr(gr, "load_detector", lambda kind, path, device: InARow())
    monkeypatch.setattr(gr, "load_colour_classifier", lambda *args: lambda image, name, boxes: ["red"] * len(boxes))
    main(["prompts", "geneval", "--out", str(tmp_path / "nested.jsonl"), "--train", "5"])
    lines = [json.loads(x) for x in (tmp_path / "nested.jsonl").read_text().splitlines()]
    (tmp_path / "geneval.jsonl").write_text("".join(json.dumps({**x["metadata"], "prompt": x["prompt"]}) + "\n"
                                                    for x in lines))
    out = {}
    for shape in ("nested", "geneval"):
        capsys.readouterr()
        main(["eval", str(coco_run), "--benchmark", "geneval", "--prompts", str(tmp_path / f"{shape}.jsonl"), "--n",
              "1", "--device", "cpu"])
        out[shape] = json.loads(capsys.readouterr().out)
    assert out["nested"] == out["geneval"]
    # the verdicts of the round trip above (they do not depend on the pixels): only two_object right, 1/5
    assert out["geneval"]["policy"]["overall"] == pytest.approx(0.2) and out["geneval"]["prompts"] == 5
    assert out["geneval"]["policy"]["failing"] == {"count": 0.2, "colour": 0.4, "position": 0.2}


@pytest.mark.usefixtures("one_thread")
def test_eval_benchmark_says_the_rewards_refusal_in_one_line_before_sampling(coco_run, tmp_path, monkeypatch, capsys):
    """A colour clause and a run with no colour classifier: `score geneval` said so in one line, `eval --benchmark
    geneval` sampled every image and then showed the same message as a traceback."""
    import shutil

    import yaml

    from grpo_vision.cli import main
    from grpo_vision.evaluation import geneval_bench

    run = shutil.copytree(coco_run, tmp_path / "run")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    del cfg["reward"]["options"]["geneval"]["clip_checkpoint"]  # no colour classifier
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    colour = tmp_path / "colour.jsonl"
    colour.write_text(json.dumps({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}],
                                  "prompt": "a photo of a red car"}) + "\n")
    plain = tmp_path / "plain.txt"
    plain.write_text("a photo of a red car\n")
    monkeypatch.setattr(geneval_bench, "compare", lambda *args, **kwargs: pytest.fail("sampled before refusing"))
    for prompts, message in (
            (colour, f"{colour}: prompt 'a photo of a red car' asks for a red car, and the geneval reward has no "
                     "colour classifier: set reward.options.geneval.clip_checkpoint"),
            (plain, f"{plain}, line 1: not valid JSON (Expecting value at column 1)")):
        with pytest.raises(SystemExit) as exit_:
            main(["eval", str(run), "--benchmark", "geneval", "--prompts", str(prompts), "--n", "1", "--device", "cpu"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(f"grpo-vision: error: {message}") and err.count("\n") == 1


# ---------------------------------------------------------------- a folder from anyone: one line each, never a hang


LINE = {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"}


def layout(root, prompts: int = 1, images: int = 1):
    """GenEval's layout: `prompts` folders of `images` 8 x 8 black PNGs, each prompt the same dog."""
    from PIL import Image

    for k in range(prompts):
        samples = root / f"{k:05d}" / "samples"
        samples.mkdir(parents=True)
        (samples.parent / "metadata.jsonl").write_text(json.dumps(LINE))
        for j in range(images):
            Image.new("RGB", (8, 8)).save(samples / f"{j:05d}.png")
    return root


@pytest.mark.parametrize("case, needle", [
    ("missing", r"missing is not a folder; give one written by `grpo-vision sample --layout geneval`"),
    ("empty", r"empty holds no prompt folders \(00000, 00001, ...\)"),
    ("no_metadata", r"00000/metadata.jsonl: not one JSON line of GenEval metadata"),
    ("no_images", r"00000/samples holds no PNG images"),
    ("not_png", r"00000/samples/00000.png: not a readable image"),
])
def test_a_folder_not_in_genevals_layout_is_named(tmp_path, case, needle):
    # read_folder reads each image's header, so an unreadable PNG is named before any model loads
    from grpo_vision.evaluation.geneval_bench import LayoutError, read_folder

    folder = tmp_path / case
    if case == "empty":
        folder.mkdir()
    elif case != "missing":
        (folder / "00000" / "samples").mkdir(parents=True)
    if case in ("no_images", "not_png"):
        (folder / "00000" / "metadata.jsonl").write_text(json.dumps(LINE))
    if case == "not_png":
        (folder / "00000" / "samples" / "00000.png").write_text("not an image")
    with pytest.raises(LayoutError, match=needle):
        read_folder(folder)


@pytest.mark.parametrize("name", ["00000/metadata.jsonl", "00000/samples/00000.png"])
def test_a_fifo_in_a_geneval_folder_is_refused_unopened(tmp_path, name):
    # before: reading metadata.jsonl waited for a writer for ever; a PNG one, once scoring began
    import os

    from grpo_vision.evaluation.geneval_bench import LayoutError, read_folder
    from tests.helpers import within

    folder = layout(tmp_path / "g")
    (folder / name).unlink()
    os.mkfifo(folder / name)
    with within(20), pytest.raises(LayoutError, match=rf"^{folder / name} is a FIFO \(named pipe\), not a file: "):
        read_folder(folder)


@pytest.mark.parametrize("width, height, needle", [
    (12_000, 12_000, "declares 12000 x 12000 pixels, more than the 16777216 an image may have before it is decoded"),
    (150_000_000, 1, "declares 150000000 x 1 pixels, more than the 16777216"),  # was a MemoryError
    (60_000, 60_000, "declares more than 178956970 pixels, which PIL refuses to decode"),  # was PIL's traceback
])
def test_an_image_that_declares_too_many_pixels_is_refused_before_it_is_decoded(tmp_path, width, height, needle):
    # a 12000 x 12000 PNG of 420 KB, under PIL's own bomb limit, took the process to 18 GB; the header
    # alone says its size, so the folder is refused when read, before any model loads
    from grpo_vision.evaluation.geneval_bench import LayoutError, read_folder, score_folder
    from tests.helpers import png_declaring

    folder = layout(tmp_path / "g")
    png = png_declaring(folder / "00000" / "samples" / "00000.png", width, height)
    assert png.stat().st_size < 1000
    with pytest.raises(LayoutError, match=rf"^{png} {needle}"):
        read_folder(folder)
    with pytest.raises(LayoutError, match=rf"^{png} {needle}"):
        score_folder(None, folder)


def test_the_pixel_limit_is_set_by_the_environment(tmp_path, monkeypatch):
    from grpo_vision.evaluation.geneval_bench import LayoutError, read_folder
    from tests.helpers import png_declaring

    folder = layout(tmp_path / "g")  # 8 x 8 = 64 pixels
    monkeypatch.setenv("GRPO_VISION_MAX_PIXELS", "63")
    with pytest.raises(LayoutError, match=r"00000.png declares 8 x 8 pixels, more than the 63 .*GRPO_VISION_MAX_PIX"):
        read_folder(folder)
    monkeypatch.setenv("GRPO_VISION_MAX_PIXELS", "200000000")
    png_declaring(folder / "00000" / "samples" / "00000.png", 12_000, 12_000)
    assert read_folder(folder)[0][1] == [folder / "00000" / "samples" / "00000.png"]  # its header only was read
    monkeypatch.setenv("GRPO_VISION_MAX_PIXELS", "many")
    with pytest.raises(LayoutError, match=r"^GRPO_VISION_MAX_PIXELS='many': expected a whole number of pixels >= 1"):
        read_folder(folder)


def test_metadata_nested_100000_deep_is_named_by_file_and_line(tmp_path):
    from grpo_vision.evaluation.geneval_bench import LayoutError, read_folder

    folder = layout(tmp_path / "g")
    (folder / "00000" / "metadata.jsonl").write_text("\n" + "[" * 100_000 + "]" * 100_000 + "\n")  # RecursionError
    with pytest.raises(LayoutError, match=r"00000/metadata.jsonl, line 2: lists and objects nested more than 100 "
                                          r"levels deep; write flatter JSON$"):
        read_folder(folder)


def test_score_checks_verdicts_and_against_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """--verdicts under a file failed after all the scoring, naming a hidden temporary file; a baseline of other
    image counts was found after both folders were scored. Both are known from the arguments and the
    folders' metadata."""
    from grpo_vision.cli import main
    from grpo_vision.rewards import CompositeReward

    monkeypatch.setattr(CompositeReward, "from_config", lambda *args, **kwargs: pytest.fail("the reward was built"))
    ours, fewer = layout(tmp_path / "ours", images=2), layout(tmp_path / "fewer", images=1)
    (tmp_path / "notes.txt").write_text("a file")
    for extra, message in (
            (["--verdicts", str(tmp_path / "notes.txt" / "v.jsonl")],
             f"--verdicts {tmp_path / 'notes.txt' / 'v.jsonl'}: {tmp_path / 'notes.txt'} is a file, not a folder; "
             "choose another --verdicts"),
            (["--verdicts", str(tmp_path)], f"--verdicts {tmp_path} is a folder; give the file to write, e.g. "
                                            f"{tmp_path / 'out.jsonl'}"),
            (["--against", str(fewer)], f"{ours} and {fewer} differ at image 2 (its prompt or the number of images per "
                                        "prompt): --against takes a folder of the same prompts")):
        with pytest.raises(SystemExit) as exit_:
            main(["score", "geneval", str(ours), "--device", "cpu", *extra])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(f"grpo-vision: error: {message}") and err.count("\n") == 1
