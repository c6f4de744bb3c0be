"""The vlm_judge reward on a tiny random Qwen2-VL built offline: a word-level tokenizer made here, Qwen2-VL's
image processor and chat template, saved with save_pretrained and loaded back by path, as a download is.

The reference takes another path on purpose: the prompt written out by hand (not the chat template),
PIL images through the processor's default uint8 rescaling (not float tensors), the model's full
forward (every position's logits), and the score as a sigmoid of a logit difference (not a softmax).
"""

import math
import re

import pytest
import torch
from PIL import Image

from grpo_vision.config import ConfigError
from grpo_vision.rewards import CompositeReward, RewardContext, RewardError, make_reward

pytestmark = pytest.mark.usefixtures("one_thread")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
WORDS = ("[UNK] system user assistant You are a helpful . Does this image show ? Answer yes or no Yes No "
         "Is there the red blue green circle square triangle left of two").split()
SIDE = 56  # the processor's one image size (min_pixels = max_pixels = 56 * 56): no resize, 4 image tokens
PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a red square", "circle", "a blue circle"]
# Qwen2-VL's chat template (Qwen/Qwen2-VL-7B-Instruct's chat_template.json, without its video and
# add_vision_id branches), and the text it renders for one image and question, written out by hand.
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def by_hand(question):
    return ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
            f"<|image_pad|><|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n")


def build_tiny_qwen2_vl(path, seed=0):
    """A random Qwen2-VL (2 text layers of width 32, 1 vision block) and its processor, saved in `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                              Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor)

    vocab = {w: i for i, w in enumerate(WORDS + SPECIAL)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # words and punctuation; "\n" is dropped
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>", additional_special_tokens=SPECIAL)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE),
                                 tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(), chat_template=TEMPLATE)
    ids = {t: vocab[t] for t in SPECIAL}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # logits of a few units, not ~0.1: scores of 0.7-0.8 that move with image and prompt
        model.lm_head.weight.mul_(30.0)
        for p in model.model.visual.parameters():
            p.mul_(3.0)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return str(build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl"))


def _images(n, seed=0):
    """[n, 3, SIDE, SIDE] in [0, 1] on the uint8 grid (k / 255), so the PIL reference sees the same pixels."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, SIDE, SIDE), generator=g).float() / 255


@torch.no_grad()
def reference(path, image, question, pool_case=True):
    """The score by hand: one image, the prompt written out, the model's own forward on every position."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval()
    pil = Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy())
    inputs = processor(text=[by_hand(question)], images=[pil], return_tensors="pt")
    logits = model(**inputs).logits[0, -1]  # [V] at the position after "assistant\n"
    tok = processor.tokenizer.convert_tokens_to_ids
    yes, no = ([tok("yes"), tok("Yes")], [tok("no"), tok("No")]) if pool_case else ([tok("yes")], [tok("no")])
    # P(yes) / (P(yes) + P(no)) = sigmoid(logsumexp(yes logits) - logsumexp(no logits))
    return torch.sigmoid(logits[yes].logsumexp(0) - logits[no].logsumexp(0)).item()


def _judge(path, batch_size=64, **options):
    return make_reward("vlm_judge", RewardContext(batch_size=batch_size), {"path": path, **options})


def _one_line_error(exc_type, fn, match):
    with pytest.raises(exc_type, match=match) as e:
        fn()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_the_score_is_p_yes_at_the_first_answer_token(judge_dir):
    images = _images(3)
    got = _judge(judge_dir)(images, PROMPTS[:3], [{}] * 3)
    assert got.shape == (3,) and got.dtype == torch.float32
    want = [reference(judge_dir, images[i], f"Does this image show {PROMPTS[i]}? Answer yes or no.") for i in range(3)]
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=0)
    assert got.std() > 1e-2  # the prompts matter: a constant score would pass the batching tests
    same_prompt = _judge(judge_dir)(images, PROMPTS[:1] * 3, [{}] * 3)
    assert same_prompt.std() > 1e-2  # and so do the images (the question is the same for all three)


def test_without_case_variants_only_the_two_words_count(judge_dir):
    images = _images(2, seed=1)
    got = _judge(judge_dir, case_variants=False, yes_word="yes", no_word="no")(images, PROMPTS[:2], [{}] * 2)
    want = [reference(judge_dir, images[i], f"Does this image show {PROMPTS[i]}? Answer yes or no.", pool_case=False)
            for i in range(2)]
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=0)
    pooled = _judge(judge_dir)(images, PROMPTS[:2], [{}] * 2)
    assert (got - pooled).abs().max() > 1e-3  # "Yes" and "No" carry mass of their own


def test_a_batch_scores_as_one_image_at_a_time(judge_dir):
    images = _images(5, seed=2)  # prompts of different lengths: the batch is left-padded
    together = _judge(judge_dir, batch_size=3)(images, PROMPTS, [{}] * 5)
    alone = torch.cat([_judge(judge_dir, batch_size=1)(images[i:i + 1], PROMPTS[i:i + 1], [{}]) for i in range(5)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


def test_several_questions_give_the_mean_of_their_scores(judge_dir):
    images = _images(3, seed=3)
    questions = ["Is there {prompt}? Answer yes or no.", "Is this image red?", "Does this image show two circles?"]
    meta = [{"questions": questions}, {}, {"questions": questions[1:2]}]  # the middle entry asks the default
    got = _judge(judge_dir, batch_size=2)(images, PROMPTS[:3], meta)
    each = torch.stack([_judge(judge_dir, question=q)(images, PROMPTS[:3], [{}] * 3) for q in questions])  # [3, B]
    default = _judge(judge_dir)(images, PROMPTS[:3], [{}] * 3)
    torch.testing.assert_close(got, torch.stack([each[:, 0].mean(), default[1], each[1, 2]]), atol=1e-5, rtol=0)
    assert len({round(v, 4) for v in each[:, 0].tolist()}) == 3  # the questions do differ


def test_a_template_gives_the_prompt_text_itself(judge_dir):
    images = _images(2, seed=4)
    template = by_hand("{question}").replace("<|image_pad|>", "{image}")
    torch.testing.assert_close(_judge(judge_dir, template=template)(images, PROMPTS[:2], [{}] * 2),
                               _judge(judge_dir)(images, PROMPTS[:2], [{}] * 2), atol=1e-6, rtol=0)


def test_a_template_must_place_the_image_and_the_question(judge_dir):
    _one_line_error(ConfigError, lambda: _judge(judge_dir, template="USER: {question} ASSISTANT:"),
                    r"^reward\.options\.vlm_judge\.template='USER: \{question\} ASSISTANT:' has no \{image\}: write "
                    r"where the image and the question go$")


def test_a_missing_path_is_a_one_line_error_naming_the_key(tmp_path):
    _one_line_error(ConfigError, lambda: _judge(str(tmp_path / "nowhere")),
                    r"^reward 'vlm_judge': reward\.options\.vlm_judge\.path=.*nowhere does not exist \(expected a "
                    r"local transformers image-text-to-text model directory")
    _one_line_error(ConfigError, lambda: make_reward("vlm_judge", RewardContext(), {}),
                    r"^reward 'vlm_judge' needs reward\.options\.vlm_judge\.path: a local transformers")


def test_a_clip_directory_is_not_a_judge(tmp_path):
    from transformers import CLIPConfig

    CLIPConfig().save_pretrained(tmp_path / "clip")
    _one_line_error(ConfigError, lambda: _judge(str(tmp_path / "clip")),
                    r"^reward\.options\.vlm_judge\.path=.*clip holds a 'clip' model, which is not an "
                    r"image-text-to-text model \(AutoModelForImageTextToText loads qwen2_vl, qwen2_5_vl, llava, "
                    r"internvl and \d+ more\): give a local transformers")
    _one_line_error(ConfigError, lambda: _judge(str(tmp_path)),
                    r"^reward\.options\.vlm_judge\.path=.* is not a transformers model directory \(no config\.json\)")


@pytest.mark.parametrize("key, word, what", [
    ("yes_word", "yes?", r"2 tokens \(\['yes', '\?'\]\) of"),
    ("no_word", "nope", "unknown to"),
])
def test_an_answer_word_that_is_not_one_token_is_refused(judge_dir, key, word, what):
    _one_line_error(ConfigError, lambda: _judge(judge_dir, **{key: word}),
                    rf"^reward\.options\.vlm_judge\.{key}='{re.escape(word)}' is {what} the judge's tokenizer; the "
                    r"score reads a single answer token: give a word that is one token")


def test_the_two_answers_must_differ(judge_dir):
    _one_line_error(ConfigError, lambda: _judge(judge_dir, yes_word="Yes", no_word="yes"),
                    r"^reward\.options\.vlm_judge\.yes_word='Yes' and no_word='yes' share a token")


@pytest.mark.parametrize("questions", ["Is it red?", [], ["Is it red?", 3]], ids=["a string", "empty", "a number"])
def test_metadata_questions_must_be_a_list_of_strings(judge_dir, questions):
    fn = _judge(judge_dir)
    _one_line_error(ConfigError, lambda: fn(_images(1), ["a red circle"], [{"questions": questions}]),
                    r"^prompt 'a red circle': metadata 'questions' must be a non-empty list of strings \(each may use "
                    r"\{prompt\}\), got .*; fix that entry of the prompts file$")
    composite = CompositeReward({"vlm_judge": 1.0}, [], RewardContext(), {"vlm_judge": {"path": judge_dir}})
    _one_line_error(RewardError, lambda: composite(_images(1), ["a red circle"], [{"questions": questions}]),
                    r"^reward 'vlm_judge' failed: ConfigError: prompt 'a red circle': metadata 'questions'")


def test_weights_that_do_not_load_stop_the_run_at_load(judge_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(judge_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    composite = CompositeReward({"vlm_judge": 1.0}, [], RewardContext(), {"vlm_judge": {"path": str(broken)}})
    _one_line_error(RewardError, composite.load,
                    r"^reward 'vlm_judge' failed: its model did not load: VlmJudgeLoadError: cannot load .*broken "
                    r"with AutoModelForImageTextToText \(.*\); is reward\.options\.vlm_judge\.path a complete model "
                    r"download\?$")


def test_two_training_steps_on_the_micro_world_log_the_judge(micro_world, judge_dir, tmp_path):
    from grpo_vision.run.metrics import load_metrics
    from grpo_vision.train import train
    from tests.helpers import micro_cfg

    cfg = micro_cfg(micro_world, tmp_path, "reward.weights={vlm_judge: 1.0}",
                    f"reward.options.vlm_judge.path={judge_dir}", "log.report=false")
    rows = load_metrics(train(cfg, progress=False))
    values = [r["reward/vlm_judge/mean"] for r in rows if "reward/vlm_judge/mean" in r]
    assert len(values) == 2 and all(math.isfinite(v) and 0 < v < 1 for v in values)
    assert [r["reward/total/mean"] for r in rows] == pytest.approx(values)  # the one weighted reward
