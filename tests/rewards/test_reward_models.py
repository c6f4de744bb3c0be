"""Model-backed rewards from local files: each adapter loads a tiny random model of the real
architecture, saved in the real on-disk format, and must agree with a direct computation.

The references take another code path on purpose: the model's own forward (open_clip's
`model(image, text)`, transformers' `logits_per_image`) on inputs preprocessed by hand with
torchvision, or by the transformers processor on PIL images.
"""

import gzip
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from torchvision.transforms import InterpolationMode

from grpo_vision.rewards.aesthetic import AestheticMLP, save_aesthetic
from grpo_vision.rewards.clip import ClipLoadError
from grpo_vision.config import ConfigError, load_config
from grpo_vision.rewards import CompositeReward, RewardContext, RewardError, make_reward
from grpo_vision.rewards.models import HPSv2Options

OPENAI_MEAN, OPENAI_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
PROMPTS = ["a red circle", "a photo of a cat on a mat", "two dogs", "a blue square left of a green circle", "x"]
IMAGE = 32  # the tiny models' input size; test images are larger, so the resize runs


pytestmark = pytest.mark.usefixtures("one_thread")


def _images(n=5, h=48, w=48, seed=0):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def _by_hand(x, mean=OPENAI_MEAN, std=OPENAI_STD):
    """CLIP's eval preprocessing written out: bicubic resize of the shortest side, centre crop, normalise."""
    x = TF.resize(x, IMAGE, interpolation=InterpolationMode.BICUBIC, antialias=True)
    return TF.normalize(TF.center_crop(x, [IMAGE, IMAGE]), mean, std)


# ---------------------------------------------------------------- open_clip: clip, hpsv2, aesthetic


def _tiny_config(quick_gelu):
    # a ViT-L-14 shape in miniature: embed_dim 768 so the aesthetic head is LAION's exact layout
    return {"embed_dim": 768, "quick_gelu": quick_gelu,
            "vision_cfg": {"image_size": IMAGE, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """(config path, config path of the GELU twin, model): a random open_clip ViT saved nowhere yet."""
    import open_clip

    d = tmp_path_factory.mktemp("clip_configs")
    qg, gelu = d / "grpo_test_vit_qg.json", d / "grpo_test_vit_gelu.json"
    qg.write_text(json.dumps(_tiny_config(True)))
    gelu.write_text(json.dumps(_tiny_config(False)))
    open_clip.add_model_config(qg)
    open_clip.add_model_config(gelu)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = open_clip.create_model("grpo_test_vit_qg", pretrained=None).eval()
    return str(qg), str(gelu), model


@torch.no_grad()
def _open_clip_reference(model, images, prompts):
    """cos(image b, prompt b) from open_clip's forward, which returns normalised features."""
    import open_clip

    tokens = open_clip.get_tokenizer("grpo_test_vit_qg")(prompts)
    img, txt, _ = model(_by_hand(images), tokens)
    return (img * txt).sum(-1)


def test_clip_reward_matches_open_clip_on_a_safetensors_checkpoint(tiny_clip, tmp_path):
    from safetensors.torch import save_file

    config, _, model = tiny_clip
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "clip.safetensors"))
    opts = {"model": config, "checkpoint": str(tmp_path / "clip.safetensors")}
    images = _images()
    got = make_reward("clip", RewardContext(batch_size=2), opts)(images, PROMPTS, [{}] * 5)  # three chunks of <= 2
    assert got.shape == (5,) and got.dtype == torch.float32
    torch.testing.assert_close(got, _open_clip_reference(model, images, PROMPTS), atol=1e-5, rtol=0)


def _openai_style_archive(model, path):
    """A TorchScript archive like OpenAI's ViT-L-14.pt: their attention mask is a plain attribute,
    not a buffer, so it is not in the archive's state dict (open_clip's CLIP registers a buffer)."""
    import copy

    m = copy.deepcopy(model)
    mask = m.attn_mask
    del m._buffers["attn_mask"]
    m.attn_mask = mask
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(m), str(path))


def test_clip_reward_loads_an_openai_torchscript_archive_and_warns_without_quickgelu(tiny_clip, tmp_path):
    config, gelu_config, model = tiny_clip
    path = tmp_path / "ViT-L-14.pt"
    _openai_style_archive(model, path)
    images = _images(3, 40, 56)
    opts = {"model": config, "checkpoint": str(path), "trust_torchscript": True}  # loading it runs its code
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no QuickGELU warning for a QuickGELU architecture
        warnings.filterwarnings("ignore", message=".*(TorchScript|jit|deprecated).*")
        got = make_reward("clip", RewardContext(), opts)(images, PROMPTS[:3], [{}] * 3)
    torch.testing.assert_close(got, _open_clip_reference(model, images, PROMPTS[:3]), atol=1e-5, rtol=0)
    # The same weights in the GELU architecture load without error but embed differently: warned.
    with pytest.warns(UserWarning, match="QuickGELU"):
        wrong = make_reward("clip", RewardContext(), {"model": gelu_config, "checkpoint": str(path),
                                                      "trust_torchscript": True})(images, PROMPTS[:3], [{}] * 3)
    assert not torch.allclose(wrong, got, atol=1e-4)


def test_a_torchscript_archive_needs_trust_or_a_one_time_conversion(tiny_clip, tmp_path, capsys):
    from grpo_vision.cli import main

    config, _, model = tiny_clip
    path = tmp_path / "ViT-L-14.pt"
    _openai_style_archive(model, path)
    images = _images(3, 40, 56)
    with pytest.raises(RewardError, match=rf"reward 'clip' failed: its model did not load: ClipLoadError: {path} is a "
                                          r"TorchScript archive.*grpo-vision convert-clip .*trust_torchscript: true"):
        CompositeReward({"clip": 1.0}, [], RewardContext(), {"clip": {"model": config, "checkpoint": str(path)}}).load()
    capsys.readouterr()
    main(["convert-clip", str(path), str(tmp_path / "c.safetensors")])  # the one-time conversion, run by the user
    assert capsys.readouterr().out.startswith(f"[convert-clip] loading {path} with torch.jit.load, which runs the "
                                              "TorchScript code")
    converted = make_reward("clip", RewardContext(), {"model": config, "checkpoint": str(tmp_path / "c.safetensors")})
    torch.testing.assert_close(converted(images, PROMPTS[:3], [{}] * 3),
                               _open_clip_reference(model, images, PROMPTS[:3]), atol=1e-5, rtol=0)


def test_convert_clip_refuses_an_archive_that_is_not_a_clip(tmp_path, capsys):
    from grpo_vision.cli import main

    class TextOnly(torch.nn.Module):  # CLIP's first two parts, and none of the rest
        def __init__(self):
            super().__init__()
            self.visual, self.transformer = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.transformer(self.visual(x))

    out = tmp_path / "c.safetensors"
    for model, missing in ((torch.nn.Linear(3, 2), "visual"), (TextOnly(), "token_embedding")):
        path = tmp_path / f"{type(model).__name__}.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.jit.save(torch.jit.script(model), str(path))
        with pytest.raises(SystemExit) as exit_info:  # before: converted, 2 or 4 tensors written as a "CLIP"
            main(["convert-clip", str(path), str(out)])
        assert exit_info.value.code == 2 and not out.exists()
        assert capsys.readouterr().err == (
            f"grpo-vision: error: {path} is a TorchScript archive but not a CLIP: it has no {missing} (OpenAI's CLIP "
            "archives hold visual, transformer, token_embedding, positional_embedding, ln_final, text_projection, "
            "logit_scale); nothing was written: convert only a CLIP archive (clip.load's ViT-L-14.pt, RN50.pt, ...)\n")


def test_hpsv2_reward_loads_the_state_dict_wrapper_and_scores_cosines(tiny_clip, tmp_path):
    config, _, model = tiny_clip
    path = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": model.state_dict()}, path)  # the released file's layout
    images = _images(seed=1)
    got = make_reward("hpsv2", RewardContext(batch_size=3), {"checkpoint": str(path), "model": config})(
        images, PROMPTS, [{}] * 5)
    torch.testing.assert_close(got, _open_clip_reference(model, images, PROMPTS), atol=1e-5, rtol=0)
    assert HPSv2Options().model == "ViT-H-14"


def test_aesthetic_reward_runs_a_laion_format_pth_and_our_safetensors(tiny_clip, tmp_path):
    from safetensors.torch import save_file

    config, _, model = tiny_clip
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "clip.safetensors"))
    torch.manual_seed(1)
    head = AestheticMLP(768).eval()  # LAION's layout: layers.{0,2,4,6,7}
    torch.save(head.state_dict(), tmp_path / "sac+logos+ava1-l14-linearMSE.pth")  # as train_predictor.py saves
    save_aesthetic(head, tmp_path / "ours")
    images = _images(4, seed=2)
    with torch.no_grad():
        ref = head(F.normalize(model.encode_image(_by_hand(images)), dim=-1))
    for head_path in (tmp_path / "sac+logos+ava1-l14-linearMSE.pth", tmp_path / "ours"):
        opts = {"clip_model": config, "clip_checkpoint": str(tmp_path / "clip.safetensors"),
                "checkpoint": str(head_path)}
        got = make_reward("aesthetic", RewardContext(batch_size=3), opts)(images, PROMPTS[:4], [{}] * 4)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # a head for another CLIP width: the error names both widths and the keys that fix it
    save_aesthetic(AestheticMLP(64, (32, 16, 16, 8)), tmp_path / "small")
    opts = {"clip_model": config, "clip_checkpoint": str(tmp_path / "clip.safetensors"),
            "checkpoint": str(tmp_path / "small")}
    reward = CompositeReward({"aesthetic": 1.0}, [], RewardContext(), {"aesthetic": opts})
    with pytest.raises(RewardError, match="takes 64-d CLIP embeddings.*gives 768-d.*reward.options.aesthetic.clip_model"):
        reward(images, PROMPTS[:4], [{}] * 4)


def test_clip_and_aesthetic_default_to_the_worlds_models(tmp_path):
    """Without checkpoints a ShapesWorld policy supplies its tiny CLIP (a ResNet, 64 px) and head, as
    default options; the user's options win key by key."""
    from grpo_vision.shapes.plugin import world_reward_defaults
    from grpo_vision.shapes.build.train_clip import new_clip, save_clip

    torch.manual_seed(0)
    model, tokenizer = new_clip()
    model.eval()
    save_clip(model, tmp_path / "clip", half=False)
    head = AestheticMLP(model.text_projection.shape[1], (32, 16, 16, 8)).eval()
    save_aesthetic(head, tmp_path / "aesthetic")
    cfg = load_config(None, ["reward.weights={clip: 1.0, aesthetic: 0.5}", "reward.batch_size=2",
                             "reward.options.aesthetic.checkpoint=" + str(tmp_path / "nowhere")])
    with pytest.raises(ConfigError, match="reward.options.aesthetic.checkpoint=.*nowhere does not exist"):
        CompositeReward.from_config(cfg.reward, "cpu", world_reward_defaults(tmp_path))  # the user's key won
    cfg.reward.options = {}
    images, prompts = _images(3, 64, 64, seed=5), ["a red circle", "a blue square", "a green circle"]
    out = CompositeReward.from_config(cfg.reward, "cpu", world_reward_defaults(tmp_path))(images, prompts, [{}] * 3)
    with torch.no_grad():
        x = TF.normalize(images, OPENAI_MEAN, OPENAI_STD)  # 64 px is the model's size: no resize
        img, txt, _ = model(x, tokenizer(prompts))
        torch.testing.assert_close(out.raw["clip"], (img * txt).sum(-1), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.raw["aesthetic"], head(img), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.total, out.raw["clip"] + 0.5 * out.raw["aesthetic"])


# ---------------------------------------------------------------- transformers: pickscore


def _tiny_clip_tokenizer():
    """A CLIPTokenizer on the first 300 merges of open_clip's bundled BPE (offline, research notes A)."""
    from open_clip.tokenizer import bytes_to_unicode, default_bpe
    from transformers import CLIPTokenizer

    merges = [tuple(m.split()) for m in gzip.open(default_bpe()).read().decode().split("\n")[1:301]]
    vocab = list(bytes_to_unicode().values())
    vocab += [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges)


@pytest.fixture(scope="module")
def tiny_pickscore(tmp_path_factory):
    """(model dir, processor dir): a random CLIPModel and its processor, saved with save_pretrained."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tok = _tiny_clip_tokenizer()
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=77, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)  # CLIP pools the text at the EOS id: it must be the tokenizer's
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE, patch_size=8)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    d = tmp_path_factory.mktemp("pickscore")
    model.save_pretrained(d / "model")
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(
        size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE}), tokenizer=tok)
    processor.save_pretrained(d / "processor")
    return d / "model", d / "processor"


def test_pickscore_matches_the_readme_computation_on_pil_images(tiny_pickscore, tmp_path):
    """At the processor's own size with 8-bit values, the tensor path equals PickScore's README path
    (processor on PIL images, then the model's logits) up to float rounding."""
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    model_dir, processor_dir = tiny_pickscore
    images = torch.randint(0, 256, (5, 3, IMAGE, IMAGE), generator=torch.Generator().manual_seed(3)) / 255.0
    opts = {"path": str(model_dir), "processor": str(processor_dir)}
    got = make_reward("pickscore", RewardContext(batch_size=2), opts)(images, PROMPTS, [{}] * 5)
    model, processor = CLIPModel.from_pretrained(model_dir).eval(), CLIPProcessor.from_pretrained(processor_dir)
    pil = [Image.fromarray(x.mul(255).round().byte().permute(1, 2, 0).numpy()) for x in images]
    inputs = processor(text=PROMPTS, images=pil, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        ref = model(**inputs).logits_per_image.diagonal()  # logit_scale.exp() * cos, [B]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert ref.std() > 0.1  # the scores differ between images, so agreement means something


def test_pickscore_resizes_like_clip_and_reads_the_processor_from_the_model_directory(tiny_pickscore, tmp_path):
    import shutil

    from transformers import CLIPModel, CLIPProcessor

    model_dir, processor_dir = tiny_pickscore
    both = tmp_path / "both"
    shutil.copytree(model_dir, both)
    for f in processor_dir.iterdir():
        shutil.copy(f, both / f.name)
    # 48x64 -> 32x42 -> crop offset 5. With an odd margin the processor's crop offset is floor(m/2),
    # torchvision's round(m/2): a pixel apart. The reward follows the processor, as PickScore does.
    images = _images(3, 48, 64, seed=4)
    got = make_reward("pickscore", RewardContext(), {"path": str(both)})(images, PROMPTS[:3], [{}] * 3)
    model, processor = CLIPModel.from_pretrained(model_dir).eval(), CLIPProcessor.from_pretrained(processor_dir)
    ids = processor.tokenizer(PROMPTS[:3], padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = model(**ids, pixel_values=_by_hand(images)).logits_per_image.diagonal()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- configuration and errors


@pytest.mark.parametrize("name, key", [("clip", "checkpoint"), ("aesthetic", "checkpoint"), ("pickscore", "path"),
                                       ("hpsv2", "checkpoint")])
def test_missing_keys_and_paths_name_the_key_and_the_path(name, key, tmp_path):
    with pytest.raises(ConfigError, match=f"reward '{name}' needs reward.options.{name}.{key}"):
        make_reward(name, RewardContext())
    with pytest.raises(ConfigError, match=f"reward.options.{name}.{key}={tmp_path}/absent does not exist"):
        make_reward(name, RewardContext(), {key: str(tmp_path / "absent")})


def test_architecture_names_are_checked_when_the_reward_is_made(tmp_path):
    (tmp_path / "hps.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="reward.options.hpsv2.model='ViT-H-41' is not an open_clip architecture"
                                          ".*ViT-H-14"):
        make_reward("hpsv2", RewardContext(), {"checkpoint": str(tmp_path / "hps.pt"), "model": "ViT-H-41"})
    with pytest.raises(ConfigError, match="reward.options.clip.model: open_clip model config not found"):
        make_reward("clip", RewardContext(), {"checkpoint": str(tmp_path / "hps.pt"), "model": str(tmp_path / "a.json")})


def test_models_load_at_the_first_call_not_when_the_reward_is_made(tiny_clip, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "hps.pt").write_bytes(b"not a checkpoint")
    pick = make_reward("pickscore", RewardContext(), {"path": str(tmp_path / "empty")})  # nothing read yet
    hps = make_reward("hpsv2", RewardContext(), {"checkpoint": str(tmp_path / "hps.pt"), "model": tiny_clip[0]})
    images = torch.rand(1, 3, 8, 8)
    with pytest.raises(ClipLoadError, match="cannot load a CLIPModel from .*empty"):
        pick(images, ["a"], [{}])
    with pytest.raises(ClipLoadError, match="cannot read the CLIP checkpoint .*hps.pt: .*not a checkpoint"):
        hps(images, ["a"], [{}])


def test_options_reach_each_reward_as_its_typed_dataclass(monkeypatch):
    from grpo_vision.rewards import REGISTRY

    seen = {}
    monkeypatch.setattr(REGISTRY["hpsv2"], "factory", lambda ctx, opts: seen.setdefault("hpsv2", (ctx, opts)))
    cfg = load_config(None, ["reward.weights={hpsv2: 1.0}", "reward.options.hpsv2.checkpoint=/m/hps.pt",
                             "reward.options.hpsv2.model=ViT-B-32", "reward.batch_size=8"])
    CompositeReward.from_config(cfg.reward, "cpu", {"hpsv2": {"model": "ViT-L-14", "checkpoint": "/d.pt"}})
    ctx, opts = seen["hpsv2"]
    assert opts == HPSv2Options(checkpoint="/m/hps.pt", model="ViT-B-32")  # the user's over the kind's
    assert (ctx.device, ctx.batch_size) == (torch.device("cpu"), 8)
    seen.clear()
    cfg = load_config(None, ["reward.weights={hpsv2: 1.0}", "reward.options.hpsv2.model=ViT-B-32"])
    CompositeReward.from_config(cfg.reward, "cpu", {"hpsv2": {"model": "ViT-L-14", "checkpoint": "/d.pt"}})
    assert seen["hpsv2"][1] == HPSv2Options(checkpoint="/d.pt", model="ViT-B-32")  # merged key by key


def test_unknown_options_are_named_with_the_keys_they_could_be():
    with pytest.raises(ConfigError, match=r"unknown key 'reward.options.clip.chekpoint' \(did you mean "
                                          r"'reward.options.clip.checkpoint'\?\); valid keys in reward.options.clip: "
                                          r"model, checkpoint"):
        make_reward("clip", RewardContext(), {"chekpoint": "/x"})
    with pytest.raises(ConfigError, match="reward 'placebo' takes no options"):
        make_reward("placebo", RewardContext(), {"seed": 1})
    with pytest.raises(ConfigError, match="a python: reward takes no options"):
        make_reward("python:tests.rewards.test_rewards:constant", RewardContext(), {"x": 1})
    cfg = load_config(None, ["reward.options.cilp.checkpoint=/x"])
    with pytest.raises(ConfigError, match=r"reward.options names 'cilp', which is not a reward \(did you mean "
                                          r"'reward.options.clip'\?\); registered rewards: "):
        CompositeReward.from_config(cfg.reward)
