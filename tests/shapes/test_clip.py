"""ShapesWorld's tiny CLIP: open_clip registration and loading, hard negatives, the loss, training."""

import json
import math

import numpy as np
import pytest
import torch

from grpo_vision.shapes.checker import check
from grpo_vision.shapes.layout import sample_scene
from grpo_vision.shapes.scene import FORMS, parse_caption, render
from grpo_vision.shapes.build.train_clip import (
    CLIP_PRESETS, CONFIG_PATH, MODEL_NAME, OPPOSITE, caption_holds, clip_loss, clip_scores, evaluate_clip,
    hard_negatives, holds_matrix, image_embeddings, image_transform, load_clip, new_clip, register_shapes_clip,
    save_clip,
)


pytestmark = pytest.mark.usefixtures("one_thread")


def _scenes(n_per_form, seed, split="train"):
    rng = np.random.default_rng(seed)
    return [sample_scene(rng, f, split, aesthetic=True) for f in FORMS for _ in range(n_per_form)]


# ---------------------------------------------------------------- open_clip plumbing


def test_registration_is_idempotent_and_open_clip_builds_the_model():
    import open_clip
    from open_clip import factory

    register_shapes_clip()
    register_shapes_clip()
    assert open_clip.list_models().count(MODEL_NAME) == 1
    assert factory._MODEL_CONFIG_PATHS.count(CONFIG_PATH) == 1
    model, _, preprocess = open_clip.create_model_and_transforms(MODEL_NAME, pretrained=None)
    tok = open_clip.get_tokenizer(MODEL_NAME)
    ids = tok(["a red circle left of a blue square"])  # SOT + 8 words + EOT fit the context
    assert ids.shape == (1, model.context_length) and ids[0, 0] == 49406 and 49407 in ids[0]
    img = model.encode_image(torch.rand(2, 3, 64, 64))
    assert img.shape == (2, open_clip.get_model_config(MODEL_NAME)["embed_dim"])


def test_preprocess_at_64px_only_normalises():
    model, _ = new_clip()
    x = torch.rand(3, 3, 64, 64)
    mean = torch.tensor(model.visual.image_mean)[:, None, None]
    std = torch.tensor(model.visual.image_std)[:, None, None]
    assert torch.allclose(image_transform(model)(x), (x - mean) / std, atol=1e-6)


def test_scores_are_per_sample_cosines():
    torch.manual_seed(0)
    model, tok = new_clip()
    model.eval()
    x, caps = torch.rand(3, 3, 64, 64), ["a red circle", "a small blue square", "a green triangle"]
    with torch.no_grad():
        emb = image_embeddings(model, x)
        txt = model.encode_text(tok(caps))
        ref = torch.nn.functional.cosine_similarity(emb, txt, dim=-1)
        assert torch.allclose(emb.norm(dim=-1), torch.ones(3), atol=1e-5)
        assert torch.allclose(clip_scores(model, tok, x, caps), ref, atol=1e-5)


def test_save_and_load_clip_round_trip(tmp_path):
    torch.manual_seed(0)
    model, tok = new_clip()
    model.eval()
    x = torch.rand(8, 3, 64, 64)
    caps = [c for _, c in _scenes(2, seed=1)]
    with torch.no_grad():
        ref = clip_scores(model, tok, x, caps)
        full, _, _ = load_clip(MODEL_NAME, save_clip(model, tmp_path / "fp32", half=False))
        assert torch.equal(clip_scores(full, tok, x, caps), ref)
        # fp16 on disk, cast back to fp32 by load_state_dict: cosines move by < 2e-3
        path = save_clip(model, tmp_path / "fp16")
        half, preprocess, tok2 = load_clip(MODEL_NAME, path)
        assert next(half.parameters()).dtype == torch.float32 and not half.training
        assert (clip_scores(half, tok2, x, caps) - ref).abs().max() < 2e-3


def test_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_clip.safetensors"):
        load_clip(MODEL_NAME, tmp_path / "no_such_clip.safetensors")


# ---------------------------------------------------------------- captions: truth and negatives


def _differences(a, b) -> set[str]:
    """Attributes in which two parsed captions differ."""
    out = set()
    if a.form != b.form:
        out.add("form")
    if a.size != b.size:
        out.add("size")
    if a.background != b.background:
        out.add("background")
    if a.relation != b.relation:
        out.add("relation")
    if a.objects != b.objects:
        if a.form == "relation" and a.objects == b.objects[::-1]:
            out.add("relation")  # the swap
        else:
            for (c1, s1), (c2, s2) in zip(a.objects, b.objects):
                if c1 != c2:
                    out.add("color")
                if s1 != s2:
                    out.add("shape")
    return out


def test_hard_negatives_change_one_attribute_and_are_false():
    for scene, caption in _scenes(25, seed=2):
        img = render(scene)
        assert check(img, caption).correct
        spec = parse_caption(caption)
        negs = hard_negatives(caption)
        named = {"color", "shape"} | {a for a in ("size", "background", "relation") if getattr(spec, a)}
        assert {a for a, ts in negs.items() if ts} == named
        for attr, texts in negs.items():
            for t in texts:
                neg = parse_caption(t)  # in the grammar
                assert _differences(spec, neg) == {attr}, (caption, t)
                assert not caption_holds(scene, t), (caption, t)
                assert check(img, t).correct is False, (caption, t)
        if spec.relation:  # "A left of B" -> never "B right of A", which says the same
            (a, b), r = spec.objects, spec.relation
            assert len(negs["relation"]) == 2
            assert all(parse_caption(t).objects != (b, a) or parse_caption(t).relation == r
                       for t in negs["relation"])


def test_relation_negatives_worked_example():
    negs = hard_negatives("a red circle left of a blue square", perpendicular=True)["relation"]
    assert negs == ["a red circle right of a blue square", "a blue square left of a red circle",
                    "a red circle above a blue square", "a red circle below a blue square"]
    # two identical objects are not a caption: "a blue circle left of a blue circle" and "a red
    # circle left of a red circle" are skipped, leaving 4 + 4 recolourings
    colors = hard_negatives("a red circle left of a blue circle")["color"]
    assert len(colors) == 8 and "a blue circle left of a blue circle" not in colors


def test_holds_matrix_matches_the_scalar_reference():
    pairs = _scenes(20, seed=3) + _scenes(5, seed=4, split="heldout")
    scenes = [s for s, _ in pairs]
    negs = {t for _, c in pairs for ts in hard_negatives(c).values() for t in ts}
    extra = {"a red circle", "a small red circle", "a red circle on a gray background"}
    texts = sorted({c for _, c in pairs} | negs | extra)
    fast = holds_matrix(scenes, texts)
    slow = np.array([[caption_holds(s, t) for t in texts] for s in scenes])
    assert fast.shape == (len(scenes), len(texts)) and (fast == slow).all()
    for i, (s, c) in enumerate(pairs):  # own caption true; "B <opposite> A" says the same: true too
        assert fast[i, texts.index(c)]
        if s.relation:
            a, b = c.split(f" {s.relation} ")
            assert caption_holds(s, f"{b} {OPPOSITE[s.relation]} {a}")


# ---------------------------------------------------------------- the loss, by hand


def test_clip_loss_hand_values():
    img = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    txt = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    pos = torch.tensor([0, 1])
    holds = torch.tensor([[True, False, False], [False, True, False]])
    hard = torch.tensor([[0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])  # text 2 is image 0's hard negative, weight 2
    loss, log = clip_loss(img, txt, pos, holds, hard, torch.tensor(1.0), hn_weight=0.5)
    e = math.e
    # image->text rows: logits (1, 0, .6) target 0; (0, 1, .8) target 1
    i2t = (-math.log(e / (e + 1 + e**0.6)) - math.log(e / (1 + e + e**0.8))) / 2
    t2i = -math.log(e / (e + 1))  # caption of image b vs the two images: logits (1, 0) and (0, 1)
    hn = 2 * math.log1p(math.exp(0.6 - 1.0)) / 1  # weight * softplus(s_neg - s_pos) / #pairs
    assert loss.item() == pytest.approx((i2t + t2i) / 2 + 0.5 * hn, rel=1e-6)
    assert log["hard_acc"] == 1.0
    # if text 2 were true of image 0 too, it leaves image 0's softmax: row 0 becomes (1, 0)
    holds2 = holds.clone()
    holds2[0, 2] = True
    loss2, _ = clip_loss(img, txt, pos, holds2, torch.zeros(2, 3), torch.tensor(1.0), hn_weight=0.0)
    i2t2 = (-math.log(e / (e + 1)) - math.log(e / (1 + e + e**0.8))) / 2
    assert loss2.item() == pytest.approx((i2t2 + t2i) / 2, rel=1e-6)


def test_duplicate_captions_do_not_compete():
    # images 0 and 1 share a caption: in caption->image, each row masks the other image
    img = torch.nn.functional.normalize(torch.tensor([[1.0, 0.1], [1.0, -0.1], [0.0, 1.0]]), dim=-1)
    txt = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    pos = torch.tensor([0, 0, 1])
    holds = torch.tensor([[True, False], [True, False], [False, True]])
    loss, log = clip_loss(img, txt, pos, holds, torch.zeros(3, 2), torch.tensor(10.0), hn_weight=0.0)
    s = 10 * img @ txt.T  # [3, 2]
    i2t = torch.nn.functional.cross_entropy(s, pos)
    t2i = torch.stack([  # row b: caption of b against the images it is false for, plus b
        -torch.log_softmax(s[[0, 2], 0], 0)[0], -torch.log_softmax(s[[1, 2], 0], 0)[0],
        -torch.log_softmax(s[:, 1], 0)[2]]).mean()
    assert loss.item() == pytest.approx(((i2t + t2i) / 2).item(), rel=1e-6)


# ---------------------------------------------------------------- training


def test_micro_training_beats_chance_on_colour(micro_world):
    # the micro world's CLIP stage is train_clip("micro", seed=0), saved and loaded back; scored on scenes
    # other than the build's own evaluation draws
    info = json.loads((micro_world / "stages" / "clip.json").read_text())
    model, _, tok = load_clip(MODEL_NAME, micro_world / "clip" / "clip.safetensors")
    acc = evaluate_clip(model, tok, n=64, seed=11)
    assert info["clip_steps"] == CLIP_PRESETS["micro"].steps
    assert acc["clip_acc_color"] > 0.75, (acc, info)  # chance is 0.5; measured 0.89
