"""The hpsv3 reward against golden outputs of HPSv3's own inference code (hpsv3 1.0.0, transformers 4.45.2) on a
tiny random model in the released checkpoint layout: tests/data/hpsv3/SOURCE.md says how they were made.

The reward reads the PNGs as float tensors, as a policy hands them over; HPSv3 read the same files by path.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from grpo_vision.config import ConfigError, load_config
from grpo_vision.rewards import CompositeReward, RewardContext, RewardError, make_reward
from grpo_vision.rewards.hpsv3 import hpsv3_scores, load_hpsv3, prompt_text, smart_resize, to_pil

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = Path(__file__).resolve().parents[1] / "data" / "hpsv3"
CHECKPOINT, BASE = DATA / "HPSv3_tiny.safetensors", DATA / "base"
GOLDEN = load_file(str(DATA / "golden.safetensors"))
BATCHES = json.loads((DATA / "prompts.json").read_text())


def batch(tag):
    """(images [B, 3, H, W] in [0, 1], prompts) of golden batch `tag`."""
    entry = BATCHES[tag]
    images = [torch.from_numpy(np.array(Image.open(DATA / "images" / f"{i}.png"))).permute(2, 0, 1).float() / 255
              for i in entry["images"]]
    return torch.stack(images), entry["prompts"]


def options(**more):
    return {"checkpoint": str(CHECKPOINT), "base_model": str(BASE), **more}


def _one_line_error(exc_type, fn, match):
    with pytest.raises(exc_type, match=match) as e:
        fn()
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("tag", ["a", "b"])  # b: 40x72 pictures, resized to 336x616 (not square)
def test_mu_and_sigma_equal_hpsv3s_own_inference(tag):
    images, prompts = batch(tag)
    got = make_reward("hpsv3", RewardContext(batch_size=8), options())(images, prompts, [{}] * len(prompts))
    want = GOLDEN[f"{tag}.scores"]  # [B, 2]: mu, log sigma
    assert got.shape == (len(prompts),) and got.dtype == torch.float32
    torch.testing.assert_close(got, want[:, 0], atol=2e-6, rtol=0)  # measured: 4.2e-7 at most
    mu, sigma = hpsv3_scores(load_hpsv3(str(CHECKPOINT), str(BASE), "cpu", "float32"), images, prompts)
    torch.testing.assert_close(mu, want[:, 0], atol=2e-6, rtol=0)
    torch.testing.assert_close(sigma, want[:, 1].exp(), atol=2e-6, rtol=0)
    assert want[:, 0].std() > 0.05  # the goldens move with image and prompt: a constant would not pass


@pytest.mark.parametrize("tag", ["a", "b"])
def test_the_input_is_hpsv3s_token_for_token(tag):
    """The instruction, the <|Reward|> token, the chat template and the image's token count as HPSv3 built them."""
    model = load_hpsv3(str(CHECKPOINT), str(BASE), "cpu", "float32")
    images, prompts = batch(tag)
    pictures = [to_pil(x) for x in images]
    inputs = model.processor(text=[prompt_text(model.processor, p) for p in prompts], images=pictures, padding=True,
                             return_tensors="pt")
    assert torch.equal(inputs["input_ids"], GOLDEN[f"{tag}.input_ids"])
    assert torch.equal(inputs["image_grid_thw"], GOLDEN[f"{tag}.image_grid_thw"])
    assert all(p.size[0] * p.size[1] in range(200704, 200704 + 28 * 28 * 12) for p in pictures)  # ~256 * 28 * 28


def test_the_head_by_hand_on_hpsv3s_hidden_states_gives_its_scores():
    """HPSv3's head written out on the hidden states HPSv3 fed it, with the checkpoint's rm_head weights; and the
    loaded model's hidden state at <|Reward|> equals that input."""
    w = {k: v.float() for k, v in load_file(str(CHECKPOINT)).items() if k.startswith("rm_head.")}
    assert sorted(w) == [f"rm_head.{i}.{p}" for i in (0, 3, 5) for p in ("bias", "weight")]
    model = load_hpsv3(str(CHECKPOINT), str(BASE), "cpu", "float32")
    seen = []
    hook = model.head.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    try:
        for tag in ("a", "b"):
            h = GOLDEN[f"{tag}.hidden"]  # [B, 32]
            x = torch.relu(h @ w["rm_head.0.weight"].T + w["rm_head.0.bias"])  # [B, 1024]
            x = torch.relu(x @ w["rm_head.3.weight"].T + w["rm_head.3.bias"])  # [B, 16]; dropout is off in eval
            by_hand = x @ w["rm_head.5.weight"].T + w["rm_head.5.bias"]  # [B, 2]
            torch.testing.assert_close(by_hand, GOLDEN[f"{tag}.scores"], atol=1e-5, rtol=0)
            model.scores(*batch(tag))
            torch.testing.assert_close(seen[-1], h, atol=2e-5, rtol=0)
    finally:
        hook.remove()


def test_a_batch_scores_as_one_image_at_a_time():
    images, prompts = batch("a")  # prompts of different lengths: the batch is right-padded
    together = make_reward("hpsv3", RewardContext(batch_size=3), options())(images, prompts, [{}] * 3)
    alone = make_reward("hpsv3", RewardContext(), options(batch_size=1))(images, prompts, [{}] * 3)
    torch.testing.assert_close(together, alone, atol=2e-6, rtol=0)


def test_smart_resize_keeps_about_256_merged_tokens_at_the_aspect_ratio():
    assert smart_resize(64, 64) == (448, 448)  # 16 x 16 merged tokens of 28 pixels
    assert smart_resize(40, 72) == (336, 616)  # the golden batch b's grid, 24 x 44 patches of 14
    assert smart_resize(1024, 1024) == (448, 448)  # large images shrink to the same budget
    h, w = smart_resize(300, 1000)
    assert h % 28 == w % 28 == 0 and abs((w / h) / (1000 / 300) - 1) < 0.1 and h * w <= 200704


def test_the_model_loads_lazily_and_once():
    load_hpsv3.cache_clear()
    reward = make_reward("hpsv3", RewardContext(), options())
    assert load_hpsv3.cache_info().currsize == 0  # building the reward reads no weights
    reward.load()
    reward(*batch("a"), [{}] * 3)
    assert load_hpsv3.cache_info().currsize == 1 and load_hpsv3.cache_info().misses == 1


def test_it_is_chosen_by_name_in_a_config_and_in_a_matrix_spec():
    from grpo_vision.tools.matrix import parse_reward_spec

    assert parse_reward_spec("hpsv3+0.5*clip", {}) == (("hpsv3", 1.0), ("clip", 0.5))
    cfg = load_config(None, ["reward.weights={hpsv3: 1.0}", f"reward.options.hpsv3.checkpoint={CHECKPOINT}",
                             f"reward.options.hpsv3.base_model={BASE}", "reward.options.hpsv3.dtype=float32"])
    composite = CompositeReward.from_config(cfg.reward, "cpu").load()  # as train, eval and the demo build it
    images, prompts = batch("b")
    out = composite(images, prompts, [{}] * 2)
    torch.testing.assert_close(out.raw["hpsv3"], GOLDEN["b.scores"][:, 0], atol=2e-6, rtol=0)
    torch.testing.assert_close(out.total, GOLDEN["b.scores"][:, 0], atol=2e-6, rtol=0)


# ---------------------------------------------------------------- bad input: one line naming the path


def test_missing_or_unusable_paths_are_one_line_errors(tmp_path):
    _one_line_error(ConfigError, lambda: make_reward("hpsv3", RewardContext(), {"base_model": str(BASE)}),
                    r"^reward 'hpsv3' needs reward.options.hpsv3.checkpoint: HPSv3.safetensors")
    gone = tmp_path / "HPSv3.safetensors"
    _one_line_error(ConfigError, lambda: make_reward("hpsv3", RewardContext(), options(checkpoint=str(gone))),
                    rf"reward.options.hpsv3.checkpoint={gone} does not exist")
    _one_line_error(ConfigError, lambda: make_reward("hpsv3", RewardContext(), options(base_model=str(tmp_path))),
                    rf"reward.options.hpsv3.base_model={tmp_path} is not a transformers model directory \(no config")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip"}))
    _one_line_error(ConfigError, lambda: make_reward("hpsv3", RewardContext(), options(base_model=str(tmp_path))),
                    r"holds a 'clip' model; HPSv3 is built on Qwen2-VL-7B-Instruct")
    _one_line_error(ConfigError, lambda: make_reward("hpsv3", RewardContext(), options(chekpoint="x")),
                    r"reward.options.hpsv3.chekpoint")
    _one_line_error(ConfigError, lambda: make_reward("hpsv3", RewardContext(), options(device="gpu:one")),
                    r"reward.options.hpsv3.device='gpu:one'")
    _one_line_error(ConfigError, lambda: make_reward("hpsv3", RewardContext(), options(batch_size=-1)),
                    r"reward.options.hpsv3.batch_size=-1: give a positive number")
    _one_line_error(ConfigError, lambda: make_reward("hpsv3", RewardContext(), options(dtype="int8")),
                    r"reward.options.hpsv3.dtype")


def _broken(tmp_path, change):
    state = load_file(str(CHECKPOINT))
    change(state)
    path = tmp_path / "HPSv3.safetensors"
    save_file(state, str(path))
    return make_reward("hpsv3", RewardContext(), options(checkpoint=str(path))), path


@pytest.mark.parametrize("change, says", [
    (lambda s: s.pop("rm_head.5.weight"), r"missing: rm_head.5.weight \(1\)"),
    (lambda s: s.update({"rm_head.7.weight": torch.zeros(2, 2)}), r"unexpected: rm_head.7.weight \(1\)"),
    (lambda s: s.update({"rm_head.0.weight": s["rm_head.0.weight"].T.contiguous()}),
     r"shape: rm_head.0.weight \(32, 1024\) \(expected \(1024, 32\)\)"),
    # a checkpoint whose embeddings were not resized to the tokenizer with <|Reward|> (another base model)
    (lambda s: s.update({"model.embed_tokens.weight": s["model.embed_tokens.weight"][:-1].contiguous()}),
     r"shape: model.language_model.embed_tokens.weight \(707, 32\) \(expected \(708, 32\)\)"),
])
def test_a_checkpoint_that_does_not_match_the_layout_is_refused_by_name(tmp_path, change, says):
    reward, path = _broken(tmp_path, change)
    msg = _one_line_error(ConfigError, reward.load, rf"reward.options.hpsv3.checkpoint={path} does not match "
                                                    rf"HPSv3 on {BASE} \(.*{says}")
    assert "Qwen2-VL-7B-Instruct it was trained from" in msg
    cfg = load_config(None, ["reward.weights={hpsv3: 1.0}", f"reward.options.hpsv3.checkpoint={path}",
                             f"reward.options.hpsv3.base_model={BASE}"])
    _one_line_error(RewardError, CompositeReward.from_config(cfg.reward, "cpu").load,
                    r"^reward 'hpsv3' failed: its model did not load: ConfigError: reward.options.hpsv3.checkpoint=")


def test_a_pth_checkpoint_wrapped_in_model_loads_like_the_safetensors(tmp_path):
    path = tmp_path / "HPSv3_7B.pth"  # inference.py's other format: torch.save({"model": state_dict})
    torch.save({"model": load_file(str(CHECKPOINT))}, path)
    images, prompts = batch("a")
    got = make_reward("hpsv3", RewardContext(), options(checkpoint=str(path)))(images, prompts, [{}] * 3)
    torch.testing.assert_close(got, GOLDEN["a.scores"][:, 0], atol=2e-6, rtol=0)
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    reward = make_reward("hpsv3", RewardContext(), options(checkpoint=str(tmp_path / "junk.safetensors")))
    _one_line_error(ConfigError, reward.load, r"junk.safetensors: cannot read it as a state dict")


def test_a_prompt_holding_the_reward_token_is_refused():
    images, _ = batch("a")
    reward = make_reward("hpsv3", RewardContext(), options())
    _one_line_error(ValueError, lambda: reward(images[:1], ["a cat <|Reward|>"], [{}]),
                    r"a prompt contains <\|Reward\|>, the token HPSv3 reads its score at")
