"""Janus-Pro's text stage (policy.PlanningPolicy, T2I-R1's two-stage rollout) on the tiny random Janus of
tests/models/test_janus.py: the plan's cached logits equal its teacher-forced ones, the image stage reads the
processor's encoding of `"{prompt}. {plan}"`, both segments' gradients reach the backbone through one call of
the module, and an exported policy's text head gives the same plan logits in transformers' own forward."""

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from grpo_vision.config import load_config
from grpo_vision.models.janus import NO_TOKEN, PLAN_SYSTEM_PROMPT, JanusImagePolicy
from grpo_vision.policy import PlanningPolicy
from grpo_vision.prompts import PromptEntry
from grpo_vision.rollouts import draw
from grpo_vision.run.metrics import load_metrics
from grpo_vision.sampling import SamplingParams, batched_logprobs, sequence_logprobs, token_logprobs
from grpo_vision.train import train
from tests.models.test_janus import BOI, BOS, PAD, PROMPTS, chat, write_config

ROOT = Path(__file__).resolve().parents[2]
EOS = 2  # the tiny tokenizer's <eos>


@pytest.fixture(scope="module")
def policy(janus_dir):
    return JanusImagePolicy.from_pretrained(janus_dir)


def t2i_r1_params(**plan) -> SamplingParams:
    """configs/janus_pro_t2i_r1.yaml's sampling settings, the plan cut at 10 tokens for a CPU, `plan` replacing
    its own settings."""
    params = SamplingParams.from_config(load_config(ROOT / "configs" / "janus_pro_t2i_r1.yaml").sample)
    return dataclasses.replace(params, decode="eager", plan=dataclasses.replace(params.plan, max_tokens=10, **plan))


def test_the_text_stage_is_t2i_r1s_conversation_left_padded(policy):
    assert isinstance(policy, PlanningPolicy)  # every method of the protocol
    assert policy.plan_vocab_size == policy.model.lm_head.out_features == 21 and policy.plan_end_id == EOS
    ids = policy.encode_plan_prompts(PROMPTS)  # [3, L]: three prompt lengths
    # Janus's "deepseek" conversation with a system prompt (janus/utils/conversation.py, SeparatorStyle.DeepSeek):
    # system, "\n\n", the user turn, "\n\n", the assistant's opening; BOS from the tokenizer
    texts = [f"{PLAN_SYSTEM_PROMPT}\n\n<|User|>: {p}\n\n<|Assistant|>:" for p in PROMPTS]
    enc = policy.processor.tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    assert torch.equal(ids, enc["input_ids"].masked_fill(enc["attention_mask"] == 0, NO_TOKEN))
    assert ids[0, 0] == NO_TOKEN and ids[1, 0] == BOS and (ids[:, -1] != NO_TOKEN).all()  # the plan follows at once
    for row in ids:
        said = policy.processor.tokenizer.convert_ids_to_tokens(row[row != NO_TOKEN].tolist())
        user = said.index("<|User|>")
        assert said[0] == "<bos>" and user > 1 and said.count("<|User|>") == 1  # the system prompt, then the turn
        assert said[-2:] == ["<|Assistant|>", ":"]
    # a processor with transformers' default system prompt for text (its conversion script sets the flag) changes
    # nothing: the tokenizer encodes the text stage
    policy.processor.use_default_system_prompt = True
    try:
        assert torch.equal(policy.encode_plan_prompts(PROMPTS), ids)
    finally:
        policy.processor.use_default_system_prompt = False


@torch.no_grad()
def test_cached_plan_logits_equal_the_teacher_forced_ones(policy):
    ids = policy.encode_plan_prompts(PROMPTS)  # left padded to the longest of three
    torch.manual_seed(0)
    T = 7
    tokens = torch.randint(0, policy.plan_vocab_size, (3, T))  # [B, T]
    cache = policy.new_plan_cache(3, T)
    steps = [policy.plan_prefill(ids, cache)]
    for t in range(T - 1):
        steps.append(policy.plan_decode(tokens[:, t], cache))
    cached = torch.stack(steps, dim=1)  # [B, T, V]
    forced = policy.plan_logits(ids, tokens)  # [B, T, V], one forward
    assert cached.dtype == forced.dtype == torch.float32 and forced.shape == (3, T, policy.plan_vocab_size)
    diff = (cached - forced).abs().max().item()
    print(f"max |cached - teacher-forced plan logit| = {diff:.2e}")
    assert diff < 1e-5 and forced.std() > 0.1  # peaked random logits, not a constant
    alone = policy.plan_logits(policy.encode_plan_prompts(PROMPTS[:1]), tokens[:1])  # no padding in the row
    assert (alone - forced[:1]).abs().max() < 1e-5  # left padding changes nothing


def test_the_image_condition_is_the_processors_encoding_of_prompt_and_plan(policy):
    plans = [[9, 10, 11, 12, 13], [], [12, BOI, 13]]  # word ids; an empty plan; a special token inside a plan
    # a special token never reaches the text, so the condition holds one <begin_of_image>, its last token
    assert policy.plan_text(plans[2]) == policy.plan_text([12, 13]) != "" and policy.plan_text([]) == ""
    prompts = [f"{p}. {policy.plan_text(q)}" for p, q in zip(PROMPTS, plans)]
    cond = policy.plan_condition(PROMPTS, plans)
    expected = chat(policy, prompts)  # transformers' docs: chat template, then the processor in image mode
    assert torch.equal(cond, expected["input_ids"].masked_fill(expected["attention_mask"] == 0, NO_TOKEN))
    assert torch.equal(cond, policy.encode_prompts(prompts))
    assert (cond == NO_TOKEN).any()  # rows of several lengths
    for row in cond:
        kept = row[row != NO_TOKEN]
        assert torch.equal(row[-len(kept):], kept)  # every pad on the left: none before <begin_of_image>
        assert (kept == BOI).sum() == 1 and kept[-1] == BOI and (kept != PAD).all() and kept[0] == BOS
    null = policy.null_condition(cond)  # the CFG row: the prompt and the plan blanked alike
    keep = (cond == BOS) | (cond == BOI) | (cond == NO_TOKEN)
    assert torch.equal(null[keep], cond[keep]) and (null[~keep] == PAD).all()


def test_one_forward_gives_both_segments_and_each_reaches_the_backbone(policy):
    ids = policy.encode_plan_prompts(PROMPTS[:2])
    plan = SimpleNamespace(ids=ids, tokens=torch.tensor([[5, 9, 12, EOS], [7, EOS, EOS, EOS]]))  # a sampling.Plan
    cond = policy.plan_condition(PROMPTS[:2], [[5, 9, 12], [7]])
    tokens = torch.randint(0, policy.codebook_size, (2, policy.num_image_tokens))
    image, text = policy(cond, tokens, plan)
    with torch.no_grad():
        assert torch.equal(image, policy.image_logits(cond, tokens))
        assert torch.equal(text, policy.plan_logits(plan.ids, plan.tokens))
    empty = SimpleNamespace(ids=ids[:, :0], tokens=plan.tokens[:, :0])  # a rollout without a text stage: T = 0
    image_alone, no_text = policy(cond, tokens, empty)
    assert torch.equal(image_alone, image) and no_text.shape == (2, 0, policy.plan_vocab_size)
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    backbone = [n for n in trainable if ".language_model.layers." in n]
    assert backbone and not any(n.startswith(("model.lm_head", "model.model.language_model.embed_tokens"))
                                for n in trainable)  # the text head and its tied table stay frozen

    def gradients(segment: torch.Tensor) -> dict[str, float]:
        policy.zero_grad(set_to_none=True)
        segment.log_softmax(-1)[..., 3].sum().backward()
        return {n: 0.0 if p.grad is None else p.grad.abs().sum().item() for n, p in trainable.items()}

    from_plan = gradients(policy(cond, tokens, plan)[1])
    from_image = gradients(policy(cond, tokens, plan)[0])
    policy.zero_grad(set_to_none=True)
    for layer in range(2):  # each segment moves every layer's attention and MLP
        for part in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
            name = f"model.model.language_model.layers.{layer}.{part}.weight"
            assert from_plan[name] > 0 and from_image[name] > 0, name
    assert all(v == 0 for n, v in from_plan.items() if ".generation_" in n)  # the plan never reads them
    assert any(v > 0 for n, v in from_image.items() if ".generation_head." in n)


@torch.no_grad()
def test_an_exported_policy_plans_alike_in_transformers(policy, tmp_path):
    """export writes transformers' own Janus folder; its text head, loaded by transformers and run through its own
    forward, gives the plan logits ours does (tests/test_export.py checks the image path of trained runs)."""
    from transformers import JanusForConditionalGeneration

    policy.export(tmp_path / "out")
    model = JanusForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    ids = policy.encode_plan_prompts(PROMPTS)  # [3, L]
    tokens = torch.randint(0, policy.plan_vocab_size, (3, 5))
    mask = torch.cat([(ids != NO_TOKEN).long(), torch.ones(3, 4, dtype=torch.long)], 1)
    theirs = model(input_ids=torch.cat([ids.clamp(min=PAD), tokens[:, :-1]], 1), attention_mask=mask).logits
    ours = policy.plan_logits(ids, tokens)
    assert (theirs[:, ids.shape[1] - 1:] - ours).abs().max() < 1e-5


def test_the_t2i_r1_config_loads():
    cfg = load_config(ROOT / "configs" / "janus_pro_t2i_r1.yaml")
    p = cfg.sample.plan
    assert p.enabled and (p.temperature, p.top_k, p.top_p) == (1.0, 0, 1.0) and 1 <= p.max_tokens <= 1024
    assert p.template.count("{prompt}") == 1 and "Be concise (50 words or less)" in p.template
    assert (cfg.sample.group_size, cfg.train.lr, cfg.train.beta, cfg.sample.cfg_scale) == (8, 1e-6, 0.01, 5.0)
    assert (cfg.train.steps, cfg.train.max_grad_norm, cfg.train.num_iterations) == (1600, 1.0, 1)
    assert cfg.train.loss_type == "bnpo" and cfg.train.plan_weight == 1.0 and cfg.policy.kind == "janus"


@pytest.mark.parametrize("plan", [{}, {"temperature": 0.7, "top_k": 5}], ids=["config", "t0.7_top5"])
def test_sampled_plan_logprobs_equal_the_teacher_forced_ones(policy, plan):
    """rollout/logp_drift is 0 on plan tokens: the update scores them with the temperature / top-k / top-p they were
    drawn with (the config's T2I-R1 settings, and a filtered one). Drawn by training's `draw`, in chunks whose plan
    prompts pad to other widths; T2I-R1's scorer (T = 1, no filter) is measurably off the filtered draw."""
    params = t2i_r1_params(**plan)
    entries = [PromptEntry(p) for p in PROMPTS + PROMPTS[:1] + PROMPTS[2:] + PROMPTS[:1]]  # chunks of 4 and 2 rows
    drawn = draw(policy, policy.image_tokenizer(), entries, list(range(6)), params, batch_size=4)
    rollout, planned, T = drawn.rollout, drawn.rollout.plan, params.plan.max_tokens
    assert torch.equal(drawn.cond, policy.plan_condition([e.prompt for e in entries],
                                                         planned.token_lists(policy.plan_end_id)))
    assert torch.equal(planned.ids, policy.encode_plan_prompts(planned.prompts))  # the chunks' ids, made again
    assert (planned.logprobs[planned.mask] < 0).all()
    assert plan or planned.mask.sum() < planned.mask.numel()  # at T = 1 some plan ends on <eos> before the cap
    with torch.no_grad():
        scored = sequence_logprobs(policy, drawn.cond, rollout, params)  # [B, T + N]
    drift = (scored[:, :T] - planned.logprobs).abs().max().item()
    print(f"max |plan logprob drift| = {drift:.2e}")
    assert drift < 1e-5 and (scored[:, T:] - rollout.logprobs).abs().max() < 1e-5
    # chunks of 4 (each plan sliced, its prompts padded as in the chunk) score what the whole batch does, up to float
    # rounding: a [4, L] and a [6, L] matmul may sum in another order, and did with two OpenMP threads on a 2-core
    # CPU (PyTorch's "Reproducibility" notes promise no bitwise equality across batch sizes)
    chunked = batched_logprobs(policy, drawn.cond, rollout, params, 4)
    assert chunked.shape == scored.shape and (chunked - scored).abs().max() < 1e-5
    if plan:
        plain = token_logprobs(policy.plan_logits(planned.ids, planned.tokens).detach(), None, planned.tokens,
                               dataclasses.replace(params.plan.distribution, temperature=1.0, top_k=0))
        assert ((plain - planned.logprobs).abs() * planned.mask).max() > 0.05


def test_two_planned_steps_train_with_no_drift_on_either_segment(janus_dir, tmp_path):
    overrides = ["sample.plan.enabled=true", "sample.plan.max_tokens=6", "train.num_iterations=1", "log.report=false"]
    cfg = load_config(write_config(tmp_path, janus_dir, "frozen"), overrides)
    run = train(cfg, progress=False)
    metrics = load_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rollout/logp_drift"] < 1e-4 and math.isfinite(m["loss/total"]) and 1 <= m["plan/length"] <= 6
               for m in metrics)
    after = load_file(run / "checkpoints" / "step_000002" / "policy.safetensors")
    before = load_file(janus_dir / "model.safetensors")
    moved = {k for k in after if not torch.equal(after[k], before[k.removeprefix("model.")])}
    assert any("language_model.layers" in k for k in moved) and not any("lm_head" in k for k in after)


def test_an_export_records_how_the_text_stage_is_prompted_and_the_folder_alone_rebuilds_it(janus_dir, policy,
                                                                                            tmp_path):
    """export.json's `text_stage`: the template, the plan's settings, the system prompt and both stages' inputs as
    strings; the exported processor encodes them to the ids the run's policy conditioned on."""
    import json

    from transformers import JanusProcessor

    from grpo_vision.export import export_run, text_stage

    overrides = ["sample.plan.enabled=true", "sample.plan.max_tokens=4", "sample.plan.template='Plan: {prompt}'",
                 "sample.plan.top_k=5", "train.steps=1", "train.num_iterations=1", "log.report=false",
                 "log.sample_every=0"]
    cfg = load_config(write_config(tmp_path, janus_dir, "frozen"), overrides)
    out = export_run(train(cfg, progress=False), tmp_path / "out").directory
    stage = json.loads((out / "export.json").read_text())["text_stage"]
    assert {k: stage[k] for k in ("template", "max_tokens", "temperature", "top_k", "top_p", "system_prompt",
                                  "image_prompt")} == {
        "template": "Plan: {prompt}", "max_tokens": 4, "temperature": 1.0, "top_k": 5, "top_p": 1.0,
        "system_prompt": PLAN_SYSTEM_PROMPT, "image_prompt": "{prompt}. {plan}"}
    processor = JanusProcessor.from_pretrained(out)  # the folder only
    prompt, plan = PROMPTS[1], processor.tokenizer.encode("a red circle on the left", add_special_tokens=False)
    text = processor.tokenizer(stage["text_stage_input"].format(prompt=prompt), return_tensors="pt").input_ids
    assert torch.equal(text, policy.encode_plan_prompts([f"Plan: {prompt}"]))  # one row: no padding
    image = processor(text=[stage["image_stage_input"].format(prompt=prompt, plan=policy.plan_text(plan))],
                      generation_mode="image", return_tensors="pt").input_ids
    assert torch.equal(image, policy.plan_condition([prompt], [plan]))
    assert text_stage(dataclasses.replace(cfg, sample=dataclasses.replace(
        cfg.sample, plan=dataclasses.replace(cfg.sample.plan, enabled=False))), policy) is None  # no plan: none
