"""The self_judge reward on a tiny random Janus-Pro in the released format (tests/models/test_janus.py's builder,
with "yes" / "no" in its vocabulary, the understanding chat template and the default system prompt the released
processors set): its input side against transformers' JanusProcessor, its score against transformers' own
Janus forward on the processor's inputs, and which network judges."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from grpo_vision.config import ConfigError, load_config
from grpo_vision.models.adapters import add_adapter
from grpo_vision.models.janus import JanusImagePolicy
from grpo_vision.models.janus_understanding import understanding_pixels
from grpo_vision.rewards import RewardContext, RunModels, check_options, make_reward
from grpo_vision.step.reference import Reference
from tests.models.test_janus import WORDS, build_tiny_janus

ROOT = Path(__file__).resolve().parents[2]
# the vocabulary of the question and its answers; the system prompt's words are <unk>, which tokenizes all the same
JUDGE_WORDS = [*WORDS, *"Does this image show ? Answer yes or no Yes No".split()]
# transformers' converted Janus-Pro template (convert_janus_weights_to_hf.py) for one user turn of an image, then text
UNDERSTAND = ("{% for m in messages %}{% if m['role'] == 'user' %}<|User|>: {% for c in m['content'] %}"
              "{% if c['type'] == 'image' %}<image_placeholder>{% if not loop.last %}\n{% endif %}"
              "{% else %}{{ c['text'] | trim }}{% endif %}{% endfor %}\n\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|Assistant|>:{% endif %}")
PROMPTS = ["a red circle", "a blue square left of a red circle", "a green square"]


@pytest.fixture(scope="module")
def judge_janus(tmp_path_factory):
    import transformers

    path = build_tiny_janus(tmp_path_factory.mktemp("janus") / "judge", JUDGE_WORDS, UNDERSTAND, system_prompt=True)
    if int(transformers.__version__.split(".")[0]) >= 5:
        # transformers 5 reloads a saved LlamaTokenizer as a BPE over Metaspace pieces, dropping every word of this
        # word-level vocabulary but the first ("a red circle" -> "a"); its generic fast tokenizer reads
        # tokenizer.json as written, so the question and its answers are the words they spell
        file = path / "tokenizer_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


@pytest.fixture(scope="module")
def policy(judge_janus):
    return JanusImagePolicy.from_pretrained(judge_janus)


def levels(*shape, seed=0):
    """Images whose values are whole 8-bit levels (k / 255), as uint8 `[B, 3, H, W]` and as floats in [0, 1]."""
    u8 = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return u8, u8.float() / 255


def judge(models: RunModels, **options):
    return make_reward("self_judge", RewardContext(batch_size=2, models=models), options)


def own(policy) -> RunModels:
    """`policy` as both networks: its own judge."""
    return RunModels.of(policy)


def smooth(*shape):
    """Gradients as whole 8-bit levels, uint8 and float: images a resize changes without overshooting."""
    B, C, H, W = shape
    y, x = torch.meshgrid(torch.linspace(0, 1, H), torch.linspace(0, 1, W), indexing="ij")
    u8 = (torch.stack([y, x, (y + x) / 2]) * 255).round().to(torch.uint8).expand(B, C, H, W).contiguous()
    return u8, u8.float() / 255


# (size, pixels, what the processor is given): at the encoder's size (Janus-Pro samples 384 px images for its 384 px
# encoder) nothing is resized; resized, float input runs the same bicubic-antialias kernel as ours, while uint8 input
# (a PIL image's pixels) runs torchvision's uint8 kernel, which rounds to whole levels after each of its two passes
CASES = [((32, 32), "noise", "uint8"), ((48, 48), "noise", "float"), ((48, 48), "smooth", "uint8"),
         ((40, 24), "smooth", "uint8")]


@pytest.mark.parametrize("size, pixels, given", CASES)
def test_pixels_equal_the_janus_image_processors(policy, size, pixels, given):
    """Float error (1e-5) where both resize alike or neither resizes; against the uint8 kernel, at most one level
    (two half-level roundings), 1 / 255 / std after normalising (0.015 at CLIP's smallest std, 0.26): measured
    0.75 levels on the gradients (on noise the uint8 kernel's clamp between its passes makes it 6.6 levels)."""
    ip = policy.processor.image_processor
    u8, x = levels(2, 3, *size) if pixels == "noise" else smooth(2, 3, *size)
    if given == "uint8":
        theirs = ip(images=list(u8), return_tensors="pt")["pixel_values"]  # what a PIL image of these pixels gives
    else:
        theirs = ip(images=list(x), do_rescale=False, return_tensors="pt")["pixel_values"]
    ours = understanding_pixels(ip, x)
    assert ours.shape == theirs.shape == (2, 3, 32, 32)
    exact = size == (32, 32) or given == "float"
    tolerance = 1e-5 if exact else 1 / 255 / min(ip.image_std) + 1e-5
    assert (ours - theirs).abs().max() <= tolerance
    if size == (40, 24):  # the padding's columns: the processor's background level, normalised, in both
        mean, std = torch.tensor(ip.image_mean), torch.tensor(ip.image_std)
        background = (torch.tensor(ip.background_color) / 255 - mean) / std
        assert torch.allclose(ours[0, :, :, 0], background[:, None].expand(3, 32), atol=1e-6)


def test_the_score_equals_transformers_understanding_path(policy):
    """P(yes) from JanusForConditionalGeneration's forward on JanusProcessor's inputs (chat template, the processor's
    placeholder expansion, system prompt and pixels), restricted by hand to the yes / no tokens, equals the reward."""
    u8, images = levels(3, 3, 32, 32, seed=1)
    processor, vocab = policy.processor, policy.processor.tokenizer.get_vocab()
    question = "Does this image show: {}? Answer yes or no."
    texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {
        "type": "text", "text": question.format(p)}]}], add_generation_prompt=True) for p in PROMPTS]
    inputs = processor(text=texts, images=list(u8), padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = policy.model(**inputs).logits[:, -1].float()  # [B, V]
    answers = [vocab[w] for w in ("yes", "Yes", "no", "No")]
    theirs = torch.softmax(logits[:, answers], -1)[:, :2].sum(-1)  # [B]

    ours = judge(own(policy))(images, PROMPTS, [{}] * 3)
    print(f"self_judge vs transformers' Janus understanding path: max abs diff {(ours - theirs).abs().max():.2e}")
    assert (ours - theirs).abs().max() < 1e-5
    assert ours.std() > 1e-4  # the images are told apart: the comparison is not of two constants
    tokens = processor.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0][inputs["attention_mask"][0] > 0])
    assert tokens[-2:] == ["<|Assistant|>", ":"] and tokens.count("<image_placeholder>") == 16
    one_at_a_time = torch.cat([judge(own(policy))(images[i:i + 1], PROMPTS[i:i + 1], [{}]) for i in range(3)])
    assert torch.allclose(ours, one_at_a_time, atol=1e-5)  # left padding leaves every row's answer unchanged


def perturbed_lora(policy):
    """A LoRA policy whose adapter changes the language model (its zero-initialised factor set to noise)."""
    lora = add_adapter(copy.deepcopy(policy), "lora", 4, 8.0, ["q_proj", "v_proj", "gate_proj"])
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p))
    return lora


def test_the_adapter_reference_judges_as_the_base_model_and_leaves_the_adapter_on(policy):
    lora = perturbed_lora(policy)
    _, images = levels(3, 3, 32, 32, seed=2)
    base = judge(own(policy))(images, PROMPTS, [{}] * 3)
    before = {n: p.clone() for n, p in lora.state_dict().items()}
    with torch.no_grad():
        adapted = lora.answer_logits(images, ["a"] * 3)

    reference = Reference(lora, "adapter").models(lora)
    scores = judge(reference)(images, PROMPTS, [{}] * 3)
    assert torch.allclose(scores, base, atol=1e-5)  # adapter disabled: the base model's judgement
    assert not scores.requires_grad
    on_policy = judge(reference, model="policy")(images, PROMPTS, [{}] * 3)
    assert (on_policy - base).abs().max() > 1e-3  # model=policy reads the adapted network
    with torch.no_grad():
        assert torch.equal(lora.answer_logits(images, ["a"] * 3), adapted)  # the adapter is on again
    assert all(torch.equal(p, before[n]) for n, p in lora.state_dict().items())  # no weight moved


def test_the_frozen_reference_judges_with_its_copy(policy):
    _, images = levels(2, 3, 32, 32, seed=3)
    frozen = Reference(policy, "frozen")  # the copy taken before training; the policy then moves
    with torch.no_grad():
        moved = copy.deepcopy(policy)
        moved.model.model.language_model.layers[0].mlp.up_proj.weight.add_(1.0)
    scores = judge(frozen.models(moved))(images, PROMPTS[:2], [{}] * 2)
    assert torch.allclose(scores, judge(own(policy))(images, PROMPTS[:2], [{}] * 2), atol=1e-6)
    assert not torch.allclose(scores, judge(own(moved))(images, PROMPTS[:2], [{}] * 2), atol=1e-4)


def test_bad_images_and_options_are_refused(policy):
    reward = judge(own(policy))
    with pytest.raises(ValueError, match=r"images \[B, 3, H, W\].*\(2, 32, 32\)"):
        reward(torch.rand(2, 32, 32), PROMPTS[:2], [{}] * 2)
    with pytest.raises(ValueError, match=r"\(2, 1, 32, 32\)"):
        reward(torch.rand(2, 1, 32, 32), PROMPTS[:2], [{}] * 2)
    with pytest.raises(ValueError, match="3 prompts"):
        reward(torch.rand(2, 3, 32, 32), PROMPTS, [{}] * 3)
    with pytest.raises(ConfigError, match=r"question=.*has no \{prompt\}"):
        judge(own(policy), question="Is this good?")
    with pytest.raises(ConfigError, match="yes_word='maybe' is unknown"):
        judge(own(policy), yes_word="maybe")
    with pytest.raises(ConfigError, match="run.s own janus model, and this command loads none: use it in train"):
        make_reward("self_judge", RewardContext(), {})


def write(tmp_path: Path, judge_janus: Path, kind="janus", reference="adapter", options=None) -> Path:
    import yaml

    cfg = {"policy": {"kind": kind, "path": str(judge_janus)},
           "train": {"adapter": "lora" if reference == "adapter" else "none", "reference": reference,
                     **({"beta": 0.0} if reference == "none" else {})},
           "reward": {"weights": {"self_judge": 1.0}, "options": {"self_judge": options or {}}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_config_time_refusals(tmp_path, judge_janus):
    check_options(load_config(write(tmp_path, judge_janus)))  # LoRA, its adapter-disabled reference: accepted
    check_options(load_config(write(tmp_path, judge_janus, reference="none", options={"model": "policy"})))
    with pytest.raises(ConfigError, match="kind 'llama' cannot give it: use it with policy.kind 'janus'"):
        check_options(load_config(write(tmp_path, judge_janus, kind="llama")))
    with pytest.raises(ConfigError, match="judges with the reference model, and train.reference is none"):
        check_options(load_config(write(tmp_path, judge_janus, reference="none")))


def test_the_shipped_config_is_accepted(tmp_path, monkeypatch, capsys):
    from grpo_vision.cli.app import main
    from grpo_vision.config import load_config
    from grpo_vision.rewards.base import named_files

    # `config` also checks that the files the config names exist (relative to where it runs): stand them in
    monkeypatch.chdir(tmp_path)
    for _, path in named_files(load_config(ROOT / "configs/janus_pro_self_judge.yaml")):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    main(["config", str(ROOT / "configs/janus_pro_self_judge.yaml")])
    out = capsys.readouterr().out
    assert "self_judge" in out and "reference: adapter" in out


def test_two_lora_steps_train_on_the_self_judge_and_its_forward_is_estimated(judge_janus, tmp_path, capsys):
    """`train` through its entry point: the reward reaches the run's reference (the adapter disabled), logs finite
    scores in [0, 1], the adapter moves, and the memory estimate prints the judging phase."""
    from safetensors.torch import load_file

    from grpo_vision.run.metrics import load_metrics
    from grpo_vision.train import train
    from tests.models.test_janus import write_config

    path = write_config(tmp_path, judge_janus, "lora")
    cfg = json.loads(path.read_text())
    cfg["reward"] = {"weights": {"self_judge": 1.0}, "monitor": [], "batch_size": 4}
    cfg["train"] |= {"steps": 1, "num_iterations": 1, "micro_batch_size": 2}
    cfg["sample"] |= {"prompts_per_step": 1, "group_size": 2}
    cfg["log"] |= {"sample_every": 0}
    path.write_text(json.dumps(cfg))
    run = train(load_config(path), progress=False)
    scores = [m["reward/self_judge/mean"] for m in load_metrics(run)]
    assert len(scores) == 1 and 0 < scores[0] < 1
    after = load_file(run / "checkpoints" / "step_000001" / "policy.safetensors")
    assert max(after[k].abs().max().item() for k in after if "lora_B" in k) > 0  # B starts at zero
    assert "judging " in capsys.readouterr().out  # the estimate's part, beside sampling and training

    from grpo_vision.evaluation.evaluate import evaluate_run

    result = evaluate_run(run, n=1)  # `eval RUN`: the reward rebuilt on the loaded run's reference
    scored = result["sets"]["test"]["models"]
    assert {"policy", "reference"} <= set(scored)
    assert all(0 < m["rewards"]["self_judge"]["mean"] < 1 for m in scored.values())
