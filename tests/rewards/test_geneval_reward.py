"""The `geneval` reward (rewards/geneval_reward.py) and its models (rewards/detectors.py) on tiny random
models of the real architectures, saved with save_pretrained / safetensors and loaded by path.

Random weights cannot detect a known object, so the rules are checked on hand-built detections
(a stub detector: the reward must equal `judge` on them, values worked out by hand), the real detectors
on their types, shapes and invariants, and the colour classifier against GenEval's PIL computation
and on a CLIP whose text embeddings are set by hand."""

import gzip
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grpo_vision.config import ConfigError
from grpo_vision.rewards import CompositeReward, RewardContext, RewardError, make_reward
from grpo_vision.rewards import geneval_reward as gr
from grpo_vision.rewards.detectors import (
    COLOUR_TEMPLATES, GREY, ColourClassifier, Mask2FormerDetector, Owlv2Detector, mask_box,
)
from grpo_vision.rewards.geneval import COLORS, Detection, judge, kept

pytestmark = pytest.mark.usefixtures("one_thread")

M2F_CLASSES = ["person", "dog", "teddy bear", "remote", "hair drier"]  # COCO names, as id2label gives them
CLIP_IMAGE = 32  # the colour CLIP's input size


# ---------------------------------------------------------------- tiny models, saved in the real formats


def save_tiny_mask2former(path):
    """A random Mask2Former (Swin backbone, 6 queries, 5 classes) and its image processor (64 px)."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor, SwinConfig

    torch.manual_seed(0)
    swin = SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2],
                      window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"])
    cfg = Mask2FormerConfig(backbone_config=swin, num_queries=6, feature_size=32, mask_feature_size=32, hidden_dim=32,
                            encoder_feedforward_dim=32, dim_feedforward=32, encoder_layers=1, decoder_layers=2,
                            num_attention_heads=2, id2label=dict(enumerate(M2F_CLASSES)),
                            label2id={name: i for i, name in enumerate(M2F_CLASSES)})
    Mask2FormerForUniversalSegmentation(cfg).save_pretrained(path)
    Mask2FormerImageProcessor(size={"shortest_edge": 64, "longest_edge": 64}).save_pretrained(path)
    return path


def _clip_tokenizer(max_length):
    """A CLIPTokenizer on the first 300 merges of open_clip's bundled BPE (offline)."""
    from open_clip.tokenizer import bytes_to_unicode, default_bpe
    from transformers import CLIPTokenizer

    merges = [tuple(m.split()) for m in gzip.open(default_bpe()).read().decode().split("\n")[1:301]]
    vocab = list(bytes_to_unicode().values())
    vocab += [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges, model_max_length=max_length)


def save_tiny_owlv2(path):
    """A random OWLv2 (32 px, 8 px patches: 16 boxes an image) and its processor (tokenizer + image processor)."""
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    tok = _clip_tokenizer(16)  # OWL's text context is 16 tokens
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=16, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    torch.manual_seed(0)
    Owlv2ForObjectDetection(Owlv2Config(text_config=text, vision_config=vision, projection_dim=32)).save_pretrained(path)
    Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok
                   ).save_pretrained(path)
    return path


def save_tiny_clip(directory):
    """(config path, checkpoint path, model): a random open_clip ViT as a JSON config and safetensors."""
    import open_clip
    from safetensors.torch import save_file

    config = directory / "grpo_test_geneval_clip.json"
    config.write_text(json.dumps({
        "embed_dim": 16, "quick_gelu": True,
        "vision_cfg": {"image_size": CLIP_IMAGE, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}))
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = open_clip.create_model("grpo_test_geneval_clip", pretrained=None).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "clip.safetensors"))
    return str(config), str(directory / "clip.safetensors"), model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("geneval_models")
    config, checkpoint, clip = save_tiny_clip(d)
    return {"mask2former": save_tiny_mask2former(d / "mask2former"), "owlv2": save_tiny_owlv2(d / "owlv2"),
            "clip_model": config, "clip_checkpoint": checkpoint, "clip": clip}


def _images(n, size=48, seed=0):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- the detectors


def test_mask_box_is_mmdets_mask2bbox():
    mask = torch.zeros(10, 12, dtype=torch.bool)
    mask[2:5, 3:8] = True  # rows 2..4, columns 3..7
    mask[9, 3] = True
    # first pixel, and one past the last: x 3..8, y 2..10
    assert mask_box(mask) == (3.0, 2.0, 8.0, 10.0)


def test_mask2former_gives_masks_and_their_boxes_for_the_asked_names(models):
    from transformers import Mask2FormerForUniversalSegmentation

    det = Mask2FormerDetector(str(models["mask2former"]))
    images = _images(2)
    # GenEval's names: "tv remote" is COCO's "remote"; case, '_' and '-' are ignored
    found = det.detect(images, [["dog", "tv remote"], ["Teddy_Bear", "hair-drier"]])
    assert [list(f) for f in found] == [["dog", "tv remote"], ["Teddy_Bear", "hair-drier"]]
    n = 0
    for per_class in found:
        for name, dets in per_class.items():
            for d in dets:
                assert isinstance(d, Detection) and isinstance(d.score, float) and 0 <= d.score <= 1
                assert d.mask.dtype == torch.bool and d.mask.shape == (48, 48) and d.mask.any()
                assert d.box == mask_box(d.mask) and all(isinstance(v, float) for v in d.box)
                assert 0 <= d.box[0] < d.box[2] <= 48 and 0 <= d.box[1] < d.box[3] <= 48
                n += 1
    # every asked class's instances, at threshold 0: the processor's own segments of those labels
    model = Mask2FormerForUniversalSegmentation.from_pretrained(models["mask2former"]).eval()
    inputs = det.processor(images=images, do_rescale=False, return_tensors="pt")
    with torch.no_grad():
        ref = det.processor.post_process_instance_segmentation(model(**inputs), threshold=0.0,
                                                               target_sizes=[(48, 48)] * 2, return_binary_maps=True)
    labels = [{1, 3}, {2, 4}]  # dog, remote; teddy bear, hair drier
    assert n == sum(s["label_id"] in want for r, want in zip(ref, labels) for s in r["segments_info"])


# COCO's 80 thing classes as detectron2 and mmdet name them, in order: the id2label of transformers'
# COCO Mask2Former conversions (facebook/mask2former-swin-small-coco-instance)
COCO = [n.replace("_", " ") for n in (
        "person bicycle car motorcycle airplane bus train truck boat traffic_light fire_hydrant stop_sign "
        "parking_meter bench bird cat dog horse sheep cow elephant bear zebra giraffe backpack umbrella handbag tie "
        "suitcase frisbee skis snowboard sports_ball kite baseball_bat baseball_glove skateboard surfboard "
        "tennis_racket bottle wine_glass cup fork knife spoon bowl banana apple sandwich orange broccoli carrot "
        "hot_dog pizza donut cake chair couch potted_plant bed dining_table toilet tv laptop mouse remote keyboard "
        "cell_phone microwave oven toaster sink refrigerator book clock vase scissors teddy_bear hair_drier "
        "toothbrush").split()]


def test_every_geneval_class_name_is_its_coco_label():
    """Line i of GenEval's object_names.txt is COCO label i, its three renames included."""
    from grpo_vision.rewards.detectors import class_key

    names = (Path(gr.__file__).parent / "geneval_data" / "object_names.txt").read_text().split("\n")
    names = [n.strip() for n in names if n.strip()]
    detector = Mask2FormerDetector.__new__(Mask2FormerDetector)  # label_id() reads only the label map
    detector.path, detector.labels = "coco", {class_key(n): i for i, n in enumerate(COCO)}
    assert [detector.label_id(n) for n in names] == list(range(80))
    assert [n for n in names if n not in COCO] == ["computer mouse", "tv remote", "computer keyboard"]


def test_owlv2_scores_each_image_on_exactly_its_own_classes(models):
    det = Owlv2Detector(str(models["owlv2"]))
    images = _images(2, seed=1)
    classes = [["dog", "cat", "teddy bear"], ["dog"]]
    together = det.detect(images, classes)  # the second image's list is padded to three queries
    alone = [det.detect(images[i:i + 1], [c])[0] for i, c in enumerate(classes)]
    for a, b, names in zip(together, alone, classes):
        assert list(a) == names
        # each of the 16 boxes goes to its best query; all are kept at threshold 0
        assert sum(len(v) for v in a.values()) == 16
        for name in names:
            assert len(a[name]) == len(b[name])
            for x, y in zip(a[name], b[name]):
                assert x.mask is None and 0 <= x.score <= 1
                assert x.score == pytest.approx(y.score, abs=1e-6)
                assert x.box == pytest.approx(y.box, abs=1e-4)
                assert 0 <= x.box[0] <= x.box[2] <= 48 and 0 <= x.box[1] <= x.box[3] <= 48  # clamped


# ---------------------------------------------------------------- the colour classifier


def test_colour_crops_composite_over_grey_through_the_mask_and_round_the_box():
    image = torch.rand(3, 20, 30, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(20, 30, dtype=torch.bool)
    mask[5:10, 4:12] = True
    classifier = ColourClassifier.__new__(ColourClassifier)  # crops() needs no model
    # (3.6, 4.4, 12.5, 10.5) rounds as PIL's crop rounds: (4, 4, 12, 10), round-half-to-even
    masked, plain = classifier.crops(image, [Detection((3.6, 4.4, 12.5, 10.5), 0.9, mask),
                                             Detection((-5, 2, 40, 3), 0.9)])  # clipped to the image
    assert masked.shape == (3, 6, 8)
    torch.testing.assert_close(masked[:, 1:, :], image[:, 5:10, 4:12])  # inside the mask: the image
    assert (masked[:, 0, :] == GREY).all()  # row 4 lies outside the mask: grey #999
    torch.testing.assert_close(plain, image[:, 2:3, 0:30])


class RGBClip(nn.Module):
    """A CLIP whose embeddings are set by hand: an image embeds as its mean RGB, a text as the RGB of the
    colour it names (through RGBTokenizer), so the zero-shot classifier picks the nearest colour direction."""
    RGB = {"red": (1, 0, 0), "orange": (1, .5, 0), "yellow": (1, 1, 0), "green": (0, 1, 0), "blue": (0, 0, 1),
           "purple": (.5, 0, .5), "pink": (1, .75, .8), "brown": (.6, .3, .1), "black": (0, 0, 0), "white": (1, 1, 1)}

    def __init__(self):
        super().__init__()
        self.visual = nn.Module()
        self.visual.image_size, self.visual.image_mean, self.visual.image_std = 8, (0, 0, 0), (1, 1, 1)
        self.unused = nn.Parameter(torch.zeros(1))

    def encode_image(self, x):
        return x.mean((2, 3))  # [N, 3]

    def encode_text(self, tokens):
        return tokens  # [N, 3]


def rgb_tokenizer(texts):
    return torch.tensor([RGBClip.RGB[t.split()[4].split("-")[0]] for t in texts], dtype=torch.float)


def test_colour_classifier_names_solid_colours_with_embeddings_set_by_hand():
    image = torch.full((3, 40, 40), 0.5)
    squares = {"red": (0, 0), "blue": (20, 20), "yellow": (0, 25)}  # 10-pixel squares at (y, x)
    for name, (y, x) in squares.items():
        image[:, y:y + 10, x:x + 10] = torch.tensor(RGBClip.RGB[name], dtype=torch.float)[:, None, None]
    classifier = ColourClassifier(RGBClip(), rgb_tokenizer)
    # per colour: the three templates' unit embeddings, averaged and renormalised: here the colour's direction
    torch.testing.assert_close(classifier.text_classifier("car")[COLORS.index("pink")],
                               F.normalize(torch.tensor([1, .75, .8]), dim=0))
    boxes = [Detection((x, y, x + 10, y + 10), 0.9) for y, x in squares.values()]
    assert classifier(image, "car", boxes) == ["red", "blue", "yellow"]
    assert set(classifier._text) == {"car"}  # cached per class


def test_colour_classifier_matches_genevals_pil_computation(models):
    """GenEval: PIL composite over #999 through the mask, PIL crop, the CLIP's own (PIL) preprocessing, and
    clip_benchmark's zero_shot_classifier written out. Crops of the CLIP's own size need no resize, so the
    tensor path must agree up to float rounding."""
    import numpy as np
    import open_clip
    from PIL import Image

    model = models["clip"]
    classifier = gr.load_colour_classifier("grpo_test_geneval_clip", models["clip_checkpoint"], "cpu", False)
    pixels = torch.randint(0, 256, (3, 64, 64), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    image = pixels.float() / 255
    mask = torch.rand(64, 64, generator=torch.Generator().manual_seed(3)) > 0.5
    dets = [Detection((8, 8, 40, 40), 0.9, mask), Detection((20.4, 10.6, 52.4, 42.6), 0.8),
            Detection((2.5, 3.5, 34.5, 35.5), 0.7)]  # each 32 x 32 once rounded (PIL rounds half to even)

    pil = Image.fromarray(pixels.permute(1, 2, 0).numpy())
    blank = Image.new("RGB", pil.size, color="#999")
    preprocess = open_clip.create_model_and_transforms("grpo_test_geneval_clip", pretrained=None)[2]
    crops = [(Image.composite(pil, blank, Image.fromarray(d.mask.numpy())) if d.mask is not None else pil).crop(d.box)
             for d in dets]
    for ours, theirs in zip(classifier.crops(image, dets), crops):
        torch.testing.assert_close(ours, torch.from_numpy(np.array(theirs)).permute(2, 0, 1).float() / 255)
    tokenizer = open_clip.get_tokenizer("grpo_test_geneval_clip")
    with torch.no_grad():
        weights = []
        for c in COLORS:  # zero_shot_classifier(model, tokenizer, COLORS, templates)
            emb = F.normalize(model.encode_text(tokenizer([t.format(c=c, classname="teddy bear")
                                                           for t in COLOUR_TEMPLATES])), dim=-1).mean(dim=0)
            weights.append(emb / emb.norm())
        weights = torch.stack(weights, dim=1)  # [D, C]
        logits = 100.0 * F.normalize(model.encode_image(torch.stack([preprocess(c) for c in crops])), dim=-1) @ weights
    torch.testing.assert_close(classifier.text_classifier("teddy bear"), weights.T, atol=1e-6, rtol=0)
    assert classifier(image, "teddy bear", dets) == [COLORS[i] for i in logits.argmax(1).tolist()]


# ---------------------------------------------------------------- the reward: GenEval's rules on detections


def det(x0, y0, x1, y1, score=0.95):
    return Detection((x0, y0, x1, y1), score)


# five prompts and what a detector "found" in each image; the verdicts worked out by hand
CASES = [
    ({"tag": "single_object", "include": [{"class": "dog", "count": 1}]},
     {"dog": [det(0, 0, 9, 9)]}),  # a dog above 0.3: correct, 1 of 1 clause
    ({"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}]},
     {"clock": [det(0, 0, 9, 9), det(20, 0, 29, 9, 0.85)]}),  # 0.85 < 0.9: one clock; exclude met: 1 of 2
    ({"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                     {"class": "dog", "count": 1, "position": ["right of", 0]}]},
     {"teddy bear": [det(0, 0, 10, 10)], "dog": [det(30, 0, 40, 10)]}),  # dog right of the bear: 2 of 2
    ({"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}]},
     {"cat": [det(0, 0, 9, 9)], "dog": [det(20, 0, 29, 9, 0.2)]}),  # the dog is below 0.3: 1 of 2
    ({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]},
     {"car": [det(0, 0, 9, 9)]}),  # the colour classifier says blue: 0 of 1
]


class StubDetector:
    """Returns CASES' detections for the images it is shown (image b's first pixel holds its case number)."""

    def __init__(self):
        self.calls = []

    def detect(self, images, classes):
        self.calls.append([list(c) for c in classes])
        return [CASES[int(round(float(x[0, 0, 0])))][1] for x in images]


@pytest.fixture
def stubbed(models, monkeypatch):
    """make_reward('geneval', batch_size=2) over a real OWLv2 directory and CLIP file, their models stubbed."""
    stub, asked = StubDetector(), []

    def colours(image, name, boxes):
        asked.append((name, len(boxes)))
        return ["blue"] * len(boxes)

    monkeypatch.setattr(gr, "load_detector", lambda kind, path, device: stub)
    monkeypatch.setattr(gr, "load_colour_classifier", lambda *args: colours)

    def make(**options):
        opts = {"detector": "owlv2", "detector_path": str(models["owlv2"]), "clip_model": models["clip_model"],
                "clip_checkpoint": models["clip_checkpoint"], **options}
        return make_reward("geneval", RewardContext(batch_size=2), opts)
    images = torch.zeros(len(CASES), 3, 8, 8)
    for i in range(len(CASES)):
        images[i, :, 0, 0] = i
    return make, stub, asked, images, [c[0] for c in CASES]


def test_the_reward_is_genevals_verdict_on_the_detections(stubbed):
    make, stub, asked, images, metadata = stubbed
    reward = make()
    prompts = [f"prompt {i}" for i in range(len(CASES))]
    got = reward(images, prompts, metadata)
    assert got.dtype == torch.float32 and got.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    # in chunks of 2, each image asked for exactly the classes its metadata names, in order
    assert stub.calls == [[["dog"], ["clock"]], [["teddy bear", "dog"], ["cat", "dog"]], [["car"]]]
    assert asked == [("car", 1)]
    assert [v.reasons for v in reward.last_verdicts] == [
        [], ["expected clock>=2, found 1"], [], ["expected dog>=1, found 0"], ["expected red car>=1, found 0 (1 blue)"]]
    # the same as judge() on the same detections
    ref = [judge(kept(found, meta["tag"]), meta, lambda n, b: ["blue"] * len(b)) for meta, found in CASES]
    assert [v.correct for v in ref] == [bool(x) for x in got.tolist()]
    # partial: the fraction of clauses met: 1/1, 1/2 (the exclude holds), 2/2, 1/2, 0/1
    assert make(partial=True)(images, prompts, metadata).tolist() == [1.0, 0.5, 1.0, 0.5, 0.0]
    assert [v.partial for v in reward.verdicts(images, prompts, metadata)] == [1.0, 0.5, 1.0, 0.5, 0.0]


def test_genevals_thresholds_are_options(stubbed):
    make, _, _, images, metadata = stubbed
    prompts = [f"prompt {i}" for i in range(len(CASES))]
    # threshold 0.1 lets the 0.2 dog count (case 3); counting_threshold 0.8 the 0.85 clock (case 1)
    assert make(threshold=0.1, counting_threshold=0.8)(images, prompts, metadata).tolist() == [1, 1, 1, 1, 0]
    # a margin of 1.5 box extents swallows the dog's 30-pixel offset from the bear (case 2): no relation
    assert make(position_threshold=1.5)(images, prompts, metadata).tolist() == [1, 0, 0, 0, 0]
    with pytest.raises(ConfigError, match=r"^reward.options.geneval.max_overlap must be in \(0, 1\]"):
        make(max_overlap=0)


def write_layout(folder, cases_per_prompt, n=2, size=8):
    """GenEval's layout: prompt k's metadata is CASES[k]'s, its images' first pixel the number of the case
    whose detections the stub returns for them (0-255 in a PNG)."""
    from PIL import Image

    for k, case in enumerate(cases_per_prompt):
        samples = folder / f"{k:05d}" / "samples"
        samples.mkdir(parents=True)
        (samples.parent / "metadata.jsonl").write_text(json.dumps({**CASES[k][0], "prompt": f"prompt {k}"}))
        for j in range(n):
            pixels = torch.zeros(size, size, 3, dtype=torch.uint8)
            pixels[0, 0] = case
            Image.fromarray(pixels.numpy()).save(samples / f"{j:05d}.png")
    return folder


def test_a_folder_in_genevals_layout_is_scored_with_the_same_rules_and_against_another(stubbed, tmp_path):
    from grpo_vision.evaluation.geneval_bench import LayoutError, compare_folders, summary

    make, stub, _, _, _ = stubbed
    stub.detect = lambda images, classes: [CASES[int(round(float(x[0, 0, 0]) * 255))][1] for x in images]
    ours = write_layout(tmp_path / "ours", [0, 1, 2, 3, 4])
    # the baseline's prompt 0 images show case 3's detections (a dog at 0.2): its dog prompt fails
    theirs = write_layout(tmp_path / "theirs", [3, 1, 2, 3, 4])
    result, rows = compare_folders(make(), ours, theirs)
    # ours: prompts 0 and 2 right (both images), 1, 3 and 4 wrong; theirs: only prompt 2 right
    assert [r["correct"] for r in rows] == [True] * 2 + [False] * 2 + [True] * 2 + [False] * 4 + \
        [False] * 4 + [True] * 2 + [False] * 4
    assert rows[2]["reasons"] == ["expected clock>=2, found 1"] and rows[2]["failures"] == ["count"]
    assert rows[0]["file"].endswith("ours/00000/samples/00000.png") and rows[10]["model"] == "against"
    # five tasks, one prompt each: ours 2 of 5 tasks right = 0.4, theirs 0.2; the change +0.2
    assert result["summary"] == summary(rows[:10]) and result["summary"]["overall"] == pytest.approx(0.4)
    assert result["against_summary"]["overall"] == pytest.approx(0.2)
    assert result["change"]["overall"]["change"] == pytest.approx(0.2)
    assert result["summary"]["failing"] == {"object": 0.2, "count": 0.2, "colour": 0.2}
    assert (result["prompts"], result["images"]) == (5, 10)
    # a baseline of other prompts, or other counts, is refused naming both folders
    fewer = write_layout(tmp_path / "fewer", [0, 1, 2, 3, 4], n=1)
    with pytest.raises(LayoutError, match=r"differ at image 2 .* same prompts, in the same order"):
        compare_folders(make(), ours, fewer)


@pytest.mark.parametrize("kind", ["mask2former", "owlv2"])
def test_the_reward_on_a_real_detector_follows_genevals_rules_on_its_finds(models, kind):
    """GenEval's rules (djghosh13/geneval, evaluation/evaluate_images.py: evaluate_image and evaluate) written
    out for three prompts, on what the real detector finds in each image alone: a find counts when it scores
    strictly above the threshold (counting_threshold for a counting prompt); an include clause needs that many
    counted finds, an exclude fails at its count, a colour clause reads the colour classifier's name of the most
    confident find. The reasons are GenEval's words; a colour's tail, "(1 blue)", is this reward's."""
    metadata = [{"tag": "two_object",
                 "include": [{"class": "person", "count": 1}, {"class": "teddy bear", "count": 1}]},
                {"tag": "counting", "include": [{"class": "person", "count": 2}],
                 "exclude": [{"class": "person", "count": 3}]},
                {"tag": "color_attr", "include": [{"class": "teddy bear", "count": 1, "color": "red"}]}]
    opts = {"detector": kind, "detector_path": str(models[kind]), "clip_model": models["clip_model"],
            "clip_checkpoint": models["clip_checkpoint"], "partial": True, "threshold": 0.01,
            "counting_threshold": 0.05}
    reward = make_reward("geneval", RewardContext(batch_size=2), opts)  # chunks of 2 images and 1
    images = _images(3, 64, seed=4)
    got = reward(images, ["a", "b", "c"], metadata).tolist()
    detector, colours = reward.detector(), reward.colours()

    def finds(i, name, above):  # image i's finds of `name` scoring above `above`, most confident first
        asked = list(dict.fromkeys(c["class"] for c in [*metadata[i]["include"], *metadata[i].get("exclude", [])]))
        found = detector.detect(images[i:i + 1], [asked])[0][name]
        return sorted((d for d in found if d.score > above), key=lambda d: -d.score)[:16]  # max_objects

    def at_least(name, count, found):  # an include clause without colour or position: (met, GenEval's reason)
        return (True, None) if len(found) >= count else (False, f"expected {name}>={count}, found {len(found)}")

    # image 0, two_object: a person and a teddy bear above 0.01
    person, bear = finds(0, "person", 0.01), finds(0, "teddy bear", 0.01)
    two = [at_least("person", 1, person), at_least("teddy bear", 1, bear)]
    # image 1, counting: persons above 0.05; at least 2 (include), fewer than 3 (exclude)
    people = finds(1, "person", 0.05)
    counting = [at_least("person", 2, people),
                (True, None) if len(people) < 3 else (False, f"expected person<3, found {len(people)}")]
    # image 2, color_attr: the most confident teddy bear above 0.01 named red
    bears = finds(2, "teddy bear", 0.01)
    colour = at_least("teddy bear", 1, bears)
    if bears:
        named = colours(images[2], "teddy bear", bears[:1])[0]
        colour = (True, None) if named == "red" else (False, f"expected red teddy bear>=1, found 0 (1 {named})")
    expected = [two, counting, [colour]]
    assert got == [sum(met for met, _ in clauses) / len(clauses) for clauses in expected]
    assert [v.reasons for v in reward.last_verdicts] == [[r for _, r in clauses if r] for clauses in expected]

    # a counting threshold equal to the second person's score leaves one person: GenEval keeps scores strictly above
    assert len(people) >= 2 and people[0].score > people[1].score
    strict = make_reward("geneval", RewardContext(batch_size=2), {**opts, "counting_threshold": people[1].score})
    assert strict(images[1:2], ["b"], metadata[1:2]).tolist() == [0.5]  # the include fails, the exclude holds
    assert strict.last_verdicts[0].reasons == ["expected person>=2, found 1"]


# ---------------------------------------------------------------- bad input: one line each


@pytest.mark.parametrize("case, needle", [
    ("absent", r"reward.options.geneval.detector_path=.*absent does not exist \(expected a transformers Mask2Former"),
    ("clip", r"detector_path=.*clip holds a 'clip' model, not what reward.options.geneval.detector=mask2former reads: "
             r"point reward.options.geneval.detector_path at a transformers Mask2Former instance-segmentation "
             r"directory \(save_pretrained of facebook/mask2former-swin-small-coco-instance"),
    ("owlv2", r"detector_path=.*owlv2 holds a 'owlv2' model, not what reward.options.geneval.detector=mask2former "
              r"reads: set reward.options.geneval.detector=owlv2"),
    ("empty", r"detector_path=.*empty holds no readable config.json"),
    ("file", r"detector_path=.*clip.safetensors is not a directory"),
    ("", r"reward 'geneval' needs reward.options.geneval.detector_path: a transformers Mask2Former"),
])
def test_a_missing_or_wrong_kind_detector_directory_is_named(models, tmp_path, case, needle):
    from transformers import CLIPConfig

    CLIPConfig().save_pretrained(tmp_path / "clip")  # a CLIP directory given as a detector
    (tmp_path / "empty").mkdir()
    paths = {"absent": tmp_path / "absent", "clip": tmp_path / "clip", "owlv2": models["owlv2"], "empty": tmp_path / "empty",
             "file": models["clip_checkpoint"], "": ""}
    with pytest.raises(ConfigError, match=needle) as err:
        make_reward("geneval", RewardContext(), {"detector_path": str(paths[case])})
    assert "\n" not in str(err.value)


def test_an_unknown_detector_kind_names_the_choices(models):
    with pytest.raises(ConfigError, match=r"detector='yolo' is not a detector; choose mask2former .* or owlv2"):
        make_reward("geneval", RewardContext(), {"detector": "yolo", "detector_path": str(models["owlv2"])})


def _composite(models, kind="owlv2", **options):
    opts = {"detector": kind, "detector_path": str(models[kind]), **options}
    return CompositeReward({"geneval": 1.0}, [], RewardContext(), {"geneval": opts})


def test_a_prompt_without_geneval_metadata_is_named_with_the_fix_where_the_reward_counts(models):
    from grpo_vision.prompts import PromptEntry

    reward = _composite(models)
    good = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}
    entries = [PromptEntry("a dog", metadata=good), PromptEntry("a red circle")]
    with pytest.raises(ConfigError, match=r"^reward 'geneval' cannot score the training prompts: prompt 'a red circle': "
                                          r"GenEval metadata needs a 'tag' .* and an 'include' list, as in GenEval's "
                                          r"evaluation_metadata.jsonl: the geneval reward reads each prompt's clauses "
                                          r"from its metadata; train on a JSONL prompts file") as err:
        reward.check({"training": entries})
    assert "\n" not in str(err.value)
    # routed to another reward by its own weights (prompts.py): not this reward's to score, and NaN
    # ("does not apply") where a batch holds it
    reward.check({"training": [entries[0], PromptEntry("a red circle", rewards={"clip": 1.0})]})
    values = reward(_images(2), ["a dog", "a red circle"], [good, {}]).raw["geneval"]
    assert not values[0].isnan() and values[1].isnan()
    # GenEval fields the rules cannot read are an error at the call, naming the prompt
    with pytest.raises(RewardError, match=r"^reward 'geneval' failed: ValueError: prompt 'a dog': GenEval metadata "
                                          r"needs a 'tag'"):
        reward(_images(1), ["a dog"], [{"include": [{"class": "dog", "count": 1}]}])
    red = {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}]}
    with pytest.raises(RewardError, match=r"prompt 'a red dog' asks for a red dog, and the geneval reward has no colour "
                                          r"classifier: set reward.options.geneval.clip_checkpoint"):
        reward(_images(1), ["a red dog"], [red])


def test_a_class_the_closed_set_detector_does_not_know_is_named_with_its_path(models):
    reward = _composite(models, "mask2former")
    meta = {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "zebra", "count": 1}]}
    with pytest.raises(RewardError, match=rf"^reward 'geneval' failed: ValueError: class 'zebra' is not one of the 5 "
                                          rf"classes of the Mask2Former detector {models['mask2former']} \(its config's "
                                          r"id2label\): .*reward.options.geneval.detector=owlv2, which reads any class$"):
        reward(_images(1), ["a dog and a zebra"], [meta])
    meta["include"][1]["class"] = "teddy bears"  # a near miss gets a suggestion
    with pytest.raises(RewardError, match=r"class 'teddy bears' .* \(did you mean teddy bear\?\)"):
        reward(_images(1), ["a dog and teddy bears"], [meta])


def test_a_detector_directory_without_weights_fails_at_load_naming_it(tmp_path):
    from transformers import Mask2FormerConfig

    Mask2FormerConfig().save_pretrained(tmp_path / "m2f")  # config.json only
    reward = CompositeReward({"geneval": 1.0}, [], RewardContext(), {"geneval": {"detector_path": str(tmp_path / "m2f")}})
    with pytest.raises(RewardError, match=r"^reward 'geneval' failed: its model did not load: DetectorLoadError: cannot "
                                          rf"load a Mask2Former and its image processor from {tmp_path / 'm2f'}: ") as err:
        reward.load()
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- training with it


def line(prompt, tag, include):
    return json.dumps({"prompt": prompt, "metadata": {"tag": tag, "include": include}}) + "\n"


def geneval_prompts(folder):
    """(training, test) prompts files of micro-world captions with GenEval clauses over its shapes."""
    prompts, evals = folder / "geneval_train.jsonl", folder / "geneval_eval.jsonl"
    prompts.write_text(line("a red circle", "colors", [{"class": "circle", "count": 1, "color": "red"}]) +
                       line("a blue square left of a green circle", "position",
                            [{"class": "circle", "count": 1}, {"class": "square", "count": 1, "position": ["left of", 0]}]))
    evals.write_text(line("a green triangle", "single_object", [{"class": "triangle", "count": 1}]) +
                     line("a small green square", "single_object", [{"class": "square", "count": 1}]))
    return prompts, evals


def geneval_options(models):
    g = "reward.options.geneval."
    return [f"{g}detector=owlv2", f"{g}detector_path={models['owlv2']}", f"{g}clip_model={models['clip_model']}",
            f"{g}clip_checkpoint={models['clip_checkpoint']}"]


def test_a_set_the_reward_cannot_score_stops_the_run_before_it_trains(micro_world, models, tmp_path):
    """Held-out captions without GenEval clauses: refused at the start, not at the report after training."""
    from grpo_vision.train import train
    from tests.helpers import micro_cfg

    prompts, evals = geneval_prompts(tmp_path)
    (tmp_path / "heldout.txt").write_text("a blue triangle\n")
    cfg = micro_cfg(micro_world, tmp_path, f"data.train_prompts={prompts}", f"data.eval_prompts={evals}",
                    f"data.heldout_prompts={tmp_path / 'heldout.txt'}",
                    "reward.weights={geneval: 1.0}", *geneval_options(models))
    with pytest.raises(ConfigError, match=r"^reward 'geneval' cannot score the heldout prompts: prompt 'a blue triangle': GenEval "
                                          r"metadata needs a 'tag'"):
        train(cfg, progress=False)
    assert not (tmp_path / cfg.run.name).exists()


@pytest.fixture(scope="module")
def geneval_run(micro_world, models, tmp_path_factory):
    """(run folder, training prompts file): two steps on the geneval reward with a report, trained once for the
    tests below, which read it and never change it. ShapesWorld captions the micro policy reads, GenEval clauses
    over shapes the tiny OWLv2 is asked for, partial credit."""
    from grpo_vision.train import train
    from tests.helpers import micro_cfg

    folder = tmp_path_factory.mktemp("geneval_run")
    prompts, evals = geneval_prompts(folder)
    run = train(micro_cfg(micro_world, folder, "log.eval_images=2", f"data.train_prompts={prompts}",
                          f"data.eval_prompts={evals}", f"data.heldout_prompts={evals}", "reward.weights={geneval: 1.0}",
                          "reward.monitor=[clip]", *geneval_options(models), "reward.options.geneval.partial=true"),
                progress=False)
    return run, prompts


@pytest.fixture(scope="module")
def geneval_folders(geneval_run):
    """`sample --layout geneval` of the run's policy (pol/) and its reference (ref/): 2 images of each training
    prompt, from a metadata file in GenEval's own format (the clauses beside the prompt)."""
    from grpo_vision.cli import main

    run, prompts = geneval_run
    folder = run.parent
    flat = folder / "geneval_metadata.jsonl"
    flat.write_text("".join(json.dumps({**json.loads(x)["metadata"], "prompt": json.loads(x)["prompt"]}) + "\n"
                            for x in prompts.read_text().splitlines()))
    for name, extra in (("pol", []), ("ref", ["--reference"])):
        main(["sample", str(run), "--prompts", str(flat), "--layout", "geneval", "--n", "2", "--out",
              str(folder / name), *extra])
    return run, folder / "pol", folder / "ref"


@pytest.mark.e2e
def test_a_run_on_the_geneval_reward_logs_its_mean_each_step(geneval_run):
    from grpo_vision.run.metrics import load_metrics

    rows = load_metrics(geneval_run[0])
    assert [m["step"] for m in rows] == [1, 2]
    assert all(math.isfinite(m["reward/geneval/mean"]) and 0 <= m["reward/geneval/mean"] <= 1 for m in rows)


@pytest.mark.e2e
def test_the_report_says_why_images_failed_by_kind_of_clause_from_eval_jsons_counts(geneval_run):
    run = geneval_run[0]
    failing = json.loads((run / "eval.json").read_text())["sets"]["test"]["reasons"]["geneval"]
    assert failing["images"] == 4 and set(failing["kinds"]) <= {"object", "count", "colour", "position"}  # 2 x 2
    report = (run / "report.md").read_text()
    if not failing["kinds"]:
        assert "No image failed a clause of geneval's" in report
    for kind in failing["kinds"]:  # each kind's share of failing images, reference -> policy, as eval.json counts it
        ref, pol = failing["reference"]["failing"][kind], failing["policy"]["failing"][kind]
        assert f"{kind} {100 * ref:.1f}% -> {100 * pol:.1f}%" in report, kind


@pytest.mark.e2e
def test_eval_benchmark_geneval_scores_both_models_on_the_eval_seeds(geneval_run, tmp_path, capsys):
    """GenEval's protocol on the run: the same prompts, 2 images each, for policy and reference."""
    from grpo_vision.cli import main
    from grpo_vision.evaluation.geneval_bench import paired_change, summary

    run, prompts = geneval_run
    verdicts = tmp_path / "verdicts.jsonl"
    capsys.readouterr()
    main(["eval", str(run), "--benchmark", "geneval", "--prompts", str(prompts), "--n", "2", "--verdicts",
          str(verdicts)])
    out = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in verdicts.read_text().splitlines()]
    assert [(r["model"], r["prompt"], r["seed"]) for r in rows] == [
        (m, p, s) for m in ("policy", "reference")
        for p, s in (("a red circle", 99), ("a red circle", 100), ("a blue square left of a green circle", 1099),
                     ("a blue square left of a green circle", 1100))]  # EVAL_SEED + 1000 i + j
    assert all(r["correct"] == (r["clauses_met"] == r["clauses"]) and (r["correct"] or r["reasons"]) for r in rows)
    assert all(len(r["failures"]) == len(r["reasons"]) for r in rows)
    policy, reference = rows[:4], rows[4:]
    assert (out["prompts"], out["images_per_prompt"], out["benchmark"]) == (2, 2, "geneval")
    assert out["policy"] == summary(policy) and out["reference"] == summary(reference)
    assert out["change"] == paired_change(policy, reference)


@pytest.mark.e2e
def test_score_geneval_scores_a_folder_in_genevals_layout_against_another(geneval_folders, tmp_path, capsys):
    from grpo_vision.cli import main
    from grpo_vision.evaluation.geneval_bench import paired_change, summary

    run, pol, ref = geneval_folders
    scored = tmp_path / "scored.jsonl"
    capsys.readouterr()
    main(["score", "geneval", str(pol), "--against", str(ref), "--config", str(run / "config.yaml"), "--device", "cpu",
          "--verdicts", str(scored)])
    out = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in scored.read_text().splitlines()]
    assert [r["file"].split("/")[-3:] for r in rows[:2]] == [["00000", "samples", "00000.png"],
                                                             ["00000", "samples", "00001.png"]]
    assert [r["model"] for r in rows] == ["folder"] * 4 + ["against"] * 4
    assert out["summary"] == summary(rows[:4]) and out["against_summary"] == summary(rows[4:])
    assert out["change"] == paired_change(rows[:4], rows[4:]) and (out["prompts"], out["images"]) == (2, 4)


@pytest.mark.e2e
def test_score_geneval_refuses_a_folder_of_other_prompts_in_one_line(geneval_folders, capsys):
    from grpo_vision.cli import main

    run, pol, _ = geneval_folders
    with pytest.raises(SystemExit) as err:  # the run folder holds no GenEval prompt folders
        main(["score", "geneval", str(pol), "--against", str(run.parent), "--config", str(run / "config.yaml")])
    assert err.value.code == 2 and "holds no prompt folders" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_demo_gives_geneval_reasons_under_each_image_and_why_a_prompt_it_cannot_score_is_na(geneval_run):
    from grpo_vision.sampling import SamplingParams
    from grpo_vision.tools.demo import DemoRun, caption

    demo = DemoRun(geneval_run[0], "cpu")
    side = demo.side("step 2", "a blue square left of a green circle", [0, 1, 2], SamplingParams())
    assert list(side.reasons) == ["geneval"] and not side.notes
    for i, image in enumerate(side.reasons["geneval"]):
        assert all(f"geneval ✗ {kind}: {text}" in caption(side, i) for kind, text in image)
        assert (side.rewards["geneval"][i] == 1) == (not image)  # partial credit: 1 only with no failing clause
    other = demo.side("step 2", "a blue square", [0], SamplingParams())  # no GenEval clauses in the run's prompts
    assert other.rewards["geneval"].isnan().all() and "does not apply to this prompt" in other.notes["geneval"]
    assert math.isfinite(other.rewards["clip"][0])


@pytest.mark.e2e
def test_the_matrix_trains_on_geneval_and_watches_clip_the_vlm_judge_and_the_judge(micro_world, models, tmp_path):
    """The reward-swap use: train on GenEval's rules, score with CLIP, a VLM judge and the world's exact judge."""
    from grpo_vision.tools.matrix import run_matrix
    from tests.rewards.test_vlm_judge import build_tiny_qwen2_vl

    prompts, evals = geneval_prompts(tmp_path)
    judge = build_tiny_qwen2_vl(tmp_path / "tiny-qwen2-vl")
    overrides = [f"policy.path={micro_world}", "log.eval_images=2", f"data.train_prompts={prompts}",
                 f"data.eval_prompts={evals}", "reward.monitor=[clip, vlm_judge]",
                 f"reward.options.vlm_judge.path={judge}", *geneval_options(models)]
    result = run_matrix("configs/shapes_micro.yaml", overrides, ["geneval"], [0.0], [0], tmp_path / "matrix")
    (run,) = result["runs"]
    assert run["status"] == "trained" and run["summary"]["step"] == 2
    for set_name in ("test", "train_sample"):
        table = run["summary"]["sets"][set_name]
        assert {"geneval", "clip", "vlm_judge", "judge/correct"} <= set(table)
        for name in ("geneval", "clip", "vlm_judge", "judge/correct"):
            assert math.isfinite(table[name]["mean"]), (set_name, name)
            ref = result["reference"][set_name][name]["mean"]
            assert table[name]["change"]["mean"] == pytest.approx(table[name]["mean"] - ref, abs=2e-5)
    assert "| geneval" in (tmp_path / "matrix" / "matrix.md").read_text()
