"""The text stage before the image (sample.plan, T2I-R1's two-stage rollout) on a tiny plan-capable Llama policy:
the sampler and the teacher-forced scorer agree, the image condition holds the plan, the loss counts both segments
as one token mean, and a run trains both."""

import dataclasses
import math

import pytest
import torch

from grpo_vision.config import ConfigError, load_config
from grpo_vision.grpo import LossParams, TokenWeights, grpo_loss, k3_kl
from grpo_vision.models.llama import BOI, BOS, NULL, PAD, LlamaImagePolicy
from grpo_vision.policy import check_plan_template, check_planning
from grpo_vision.sampling import (
    PlanParams, Rollout, SamplingParams, batched_logprobs, sample, sample_plan, sequence_logprobs, token_logprobs,
)
from tests.helpers import peaked_llama

WORDS = ["a", "red", "blue", "circle", "square", "left", "of"]
PLAN_WORDS = ["red", "blue", "circle", "square", "c0", "c1", "c2"]


@pytest.fixture
def planner() -> LlamaImagePolicy:
    """A tiny random policy with a plan vocabulary, its logits peaked enough that top-k cuts real mass."""
    return peaked_llama(4.0, words=WORDS, max_caption_words=8, codebook_size=16, image_grid=(2, 3), dim=32,
                        n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, plan_words=PLAN_WORDS, max_plan_tokens=6)


PROMPTS = ["a red circle", "a blue square left of a red circle", "a blue circle", "a red square"]
PLAN = PlanParams(max_tokens=6, temperature=0.7, top_k=4, top_p=0.95)


def test_plans_stop_at_their_end_token_and_nothing_after_it_counts(planner, one_thread):
    hot = dataclasses.replace(PLAN, temperature=3.0, top_k=0)  # flat enough that the end token comes up
    plan = sample_plan(planner, PROMPTS * 4, list(range(16)), hot)
    end = planner.plan_end_id
    for tokens, mask, logp, text in zip(plan.tokens, plan.mask, plan.logprobs, plan.texts):
        ended = (tokens == end).nonzero()
        length = int(ended[0]) + 1 if len(ended) else PLAN.max_tokens  # the end token counts; a cut plan has none
        assert mask.tolist() == [True] * length + [False] * (PLAN.max_tokens - length)
        assert (tokens[length:] == end).all() and (logp[length:] == 0).all() and (logp[:length] < 0).all()
        assert text == planner.plan_text(tokens[:length][tokens[:length] != end].tolist())
    assert plan.mask.sum(1).min() < PLAN.max_tokens, "some plan should end before the cap on these weights"


def test_the_teacher_forced_plan_logprobs_are_the_samplers_and_a_plain_softmax_is_not(planner, one_thread):
    """The ratio is 1 before any update on the plan tokens too: scored with the temperature / top-k / top-p they
    were drawn with. The deliberately wrong scorer (T2I-R1's: T = 1, no filter) is measurably off, so the test
    can fail."""
    plan = sample_plan(planner, PROMPTS * 2, list(range(8)), PLAN)
    cond = planner.plan_condition(PROMPTS * 2, plan.token_lists(planner.plan_end_id))
    params = SamplingParams(cfg_scale=2.0, top_k=5, plan=PLAN)
    drawn = sample(planner, cond, list(range(8)), params)
    rollout = Rollout(drawn.tokens, drawn.logprobs, drawn.entropy, plan)
    scored = sequence_logprobs(planner, cond, rollout, params)  # [B, T + N]
    T = PLAN.max_tokens
    assert scored.shape == (8, T + planner.num_image_tokens)
    torch.testing.assert_close(scored[:, :T], plan.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(scored[:, T:], rollout.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(batched_logprobs(planner, cond, rollout, params, 3), scored,
                               atol=1e-6, rtol=0)
    plain = token_logprobs(planner.plan_logits(plan.ids, plan.tokens), None, plan.tokens,
                           dataclasses.replace(PLAN.distribution, temperature=1.0, top_k=0, top_p=1.0))
    assert ((plain - plan.logprobs).abs() * plan.mask).max() > 0.05


def test_the_image_condition_is_the_caption_its_plan_and_the_end_left_padded(planner):
    c = planner.cfg
    bop, eop = c.plan_offset, c.plan_offset + 1
    cond = planner.plan_condition(["a red circle"], [[1, 5]])  # local plan ids: red c0
    words = [planner.word_ids[w] for w in ("a", "red", "circle")]
    pads = c.max_caption_words - 3 + c.max_plan_tokens - 2
    assert cond.tolist() == [[PAD] * pads + [BOS, *words, bop, eop + 1, eop + 5, eop, BOI]]
    assert planner.encode_plan_prompts(["a red circle"]).tolist() == [[PAD] * 5 + [BOS, *words, bop]]
    # the null row blanks caption and plan alike, at the condition's width
    assert planner.null_condition(cond).tolist() == [[PAD] * (cond.shape[1] - 3) + [BOS, NULL, BOI]]
    assert planner.plan_text([1, 5]) == "red c0"
    with pytest.raises(ValueError, match="max_plan_tokens"):
        planner.plan_condition(["a red circle"], [[1] * 7])


def test_image_tokens_depend_on_the_condition_and_seed_only(planner, one_thread):
    """A row's plan uniforms come after its image uniforms: drawing a plan first leaves the image stage's draw
    what `sample` gives on the same condition and seed."""
    from grpo_vision.prompts import PromptEntry
    from grpo_vision.rollouts import draw

    class Identity(torch.nn.Module):
        def decode(self, tokens):
            return torch.zeros(len(tokens), 3, 2, 2)

    params = SamplingParams(cfg_scale=2.0, plan=PLAN)
    drawn = draw(planner, Identity(), [PromptEntry(p) for p in PROMPTS], [5, 6, 7, 8], params, batch_size=3)
    cond = planner.plan_condition(PROMPTS, drawn.rollout.plan.token_lists(planner.plan_end_id))
    assert torch.equal(drawn.cond, cond)
    assert torch.equal(sample(planner, cond, [5, 6, 7, 8], params).tokens, drawn.rollout.tokens)
    alone = sample_plan(planner, PROMPTS[1:2], [6], PLAN)  # a row's plan does not depend on its batch
    assert torch.equal(alone.tokens[0], drawn.rollout.plan.tokens[1])


def test_a_token_count_makes_one_token_mean_over_a_plan_and_an_image():
    """Row 0: a plan of 1 token (its second slot is padding) and 2 image tokens; row 1: 2 plan tokens, 2 image.
    logp = old (ratio 1), beta 0: the per-token term is A, and bnpo's mean divides by the count that counts.
    With plan weight w: sum(c * A) / sum(c), c = [w, 0, 1, 1] and [w, w, 1, 1]."""
    logp = torch.zeros(2, 4)
    adv = torch.tensor([1.0, -2.0])
    for w in (1.0, 0.5, 0.0):
        count = torch.tensor([[w, 0.0, 1.0, 1.0], [w, w, 1.0, 1.0]])
        loss, _ = grpo_loss(logp, logp, None, adv, LossParams(loss_type="bnpo"), TokenWeights(count=count))
        expected = -((w + 2) * 1.0 + (2 * w + 2) * -2.0) / (3 * w + 4)
        assert loss.item() == pytest.approx(expected)
        # grpo: each row's weighted mean, then the rows' mean: A itself per row
        loss, _ = grpo_loss(logp, logp, None, adv, LossParams(loss_type="grpo"), TokenWeights(count=count))
        assert loss.item() == pytest.approx(-(1.0 - 2.0) / 2)
    # a padded token's value never leaks, whatever it holds (NaN included)
    nan_logp = torch.tensor([[0.0, float("nan"), 0.0, 0.0]])
    count = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    loss, m = grpo_loss(nan_logp, nan_logp.nan_to_num(), None, torch.tensor([1.0]), LossParams(loss_type="bnpo"),
                        TokenWeights(count=count))
    assert loss.item() == pytest.approx(-1.0) and m["ratio_mean"].item() == pytest.approx(1.0)


def test_the_kl_covers_the_plan_tokens(planner, one_thread):
    """k3 on both segments: a reference that differs only in the plan head gives a KL on plan tokens only."""
    import copy

    plan = sample_plan(planner, PROMPTS, [1, 2, 3, 4], PLAN)
    cond = planner.plan_condition(PROMPTS, plan.token_lists(planner.plan_end_id))
    params = SamplingParams(plan=PLAN)
    drawn = sample(planner, cond, [1, 2, 3, 4], params)
    rollout = Rollout(drawn.tokens, drawn.logprobs, drawn.entropy, plan)
    ref_model = copy.deepcopy(planner)
    with torch.no_grad():
        start = planner.cfg.plan_offset + 1
        ref_model.lm_head.weight[start:] += 0.3 * torch.randn_like(ref_model.lm_head.weight[start:])
    logp = sequence_logprobs(planner, cond, rollout, params)
    ref = sequence_logprobs(ref_model, cond, rollout, params)
    kl = k3_kl(logp, ref)  # [B, T + N]
    T = PLAN.max_tokens
    assert (kl[:, T:] == 0).all() and (kl[:, :T][plan.mask] > 0).any() and (kl[:, :T][~plan.mask] == 0).all()


def _update_grads(planner, plan_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of one GRPO loss on both segments with respect to the plan rows and codebook rows of lm_head."""
    from grpo_vision.step.update import UpdateBatch

    seeds = list(range(8))
    plan = sample_plan(planner, PROMPTS * 2, seeds, PLAN)
    cond = planner.plan_condition(PROMPTS * 2, plan.token_lists(planner.plan_end_id))
    params = SamplingParams(cfg_scale=2.0, plan=PLAN)
    rollout = sample(planner, cond, seeds, params)
    rollout = Rollout(rollout.tokens, rollout.logprobs, rollout.entropy, plan)
    old = torch.cat([plan.logprobs, rollout.logprobs], 1)
    batch = UpdateBatch.of(cond, rollout, old, None, torch.linspace(-1, 1, 8), plan_weight)
    planner.zero_grad()
    logp = sequence_logprobs(planner, batch.cond, batch.rollout, params)
    loss, _ = grpo_loss(logp, batch.old_logprobs, None, batch.advantages, LossParams(loss_type="bnpo"),
                        TokenWeights(batch.policy_mask, count=batch.count))
    loss.backward()
    c, grad = planner.cfg, planner.lm_head.weight.grad
    return grad[c.plan_offset + 1:].abs().sum(), grad[c.image_offset:c.plan_offset].abs().sum()


def test_gradients_reach_both_segments_and_plan_weight_0_trains_the_image_only(planner):
    plan_grad, image_grad = _update_grads(planner, 1.0)
    assert plan_grad > 0 and image_grad > 0
    plan_grad, image_grad = _update_grads(planner, 0.0)
    assert plan_grad == 0 and image_grad > 0


def test_a_kind_without_a_text_stage_is_refused_in_one_line_naming_it(tiny_policy, planner):
    with pytest.raises(ConfigError, match=r"policy.kind 'llama' \(LlamaImagePolicy\) cannot write a text plan") as e:
        check_planning(tiny_policy, "llama", 8)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"sample.plan.max_tokens=9: .* at most 6 tokens"):
        check_planning(planner, "llama", 9)
    check_planning(planner, "llama", 6)


@pytest.mark.parametrize("override, key", [
    ("sample.plan.template=draw it", "sample.plan.template"),
    ("sample.plan.template='{prompt!r}'", "sample.plan.template"),  # the caption in quotes
    ("sample.plan.template='draw {prompt:>40}'", "sample.plan.template"),  # padded with spaces
    ("sample.plan.max_tokens=0", "sample.plan.max_tokens"),
    ("train.token_weighting=stage", "train.token_weighting"),
    ("train.plan_weight=-1", "train.plan_weight"),
])
def test_bad_plan_settings_are_refused_in_one_line_naming_the_key(override, key):
    from tests.helpers import MICRO

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config(MICRO, ["sample.plan.enabled=true", override])
    assert "\n" not in str(e.value)


def test_a_plan_template_is_read_as_captions_are_before_the_first_rollout(planner):
    """Words outside the caption vocabulary would be <unk> in every plan prompt; a template that does not fit the
    caption slots (8 here) with the longest prompt would stop the first rollout."""
    with pytest.raises(ConfigError) as e:
        check_plan_template(planner, "please draw {prompt}", PROMPTS)
    assert str(e.value) == ("sample.plan.template 'please draw {prompt}' has words the policy does not know: "
                            "'please', 'draw' (every plan prompt would read them as <unk>): write it in the policy's "
                            "caption words, or set it to {prompt}")
    with pytest.raises(ConfigError) as e:  # the longest prompt has 8 words
        check_plan_template(planner, "a {prompt} a", PROMPTS)
    assert str(e.value) == ("sample.plan.template 'a {prompt} a' adds 2 words to each caption, and with the longest "
                            "prompt 'a blue square left of a red circle': caption 'a a blue square left of a red "
                            "circle a' has 10 words; this policy takes at most 8 (max_caption_words); shorten the "
                            "template (or the prompts), or set it to {prompt}")
    check_plan_template(planner, "a {prompt} a", ["a red circle", "a blue square"])  # 5 words: they fit
    check_plan_template(planner, "{prompt}", PROMPTS)


def test_train_refuses_a_plan_template_of_unknown_words_before_a_step(micro_world, tmp_path):
    from grpo_vision.policy import load_bundle
    from grpo_vision.train import train
    from tests.helpers import micro_cfg

    cfg = micro_cfg(micro_world, tmp_path, "sample.plan.enabled=true", "sample.plan.max_tokens=4",
                    "sample.plan.template='please draw {prompt}'")
    bundle = load_bundle(cfg.policy, "cpu")
    bundle.policy = LlamaImagePolicy(dataclasses.replace(bundle.policy.cfg, plan_words=PLAN_WORDS, max_plan_tokens=4))
    with pytest.raises(ConfigError, match=r"^sample.plan.template 'please draw \{prompt\}' has words the policy "
                                          r"does not know: 'please', 'draw' "):
        train(cfg, progress=False, bundle=bundle)
    assert not (tmp_path / cfg.run.name / "checkpoints").exists()


def test_two_planned_steps_train_the_plan_and_log_the_drift_of_both_segments(micro_world, tmp_path):
    """The real loop on the micro world with a plan-capable policy of the world's vocabulary: the plan head moves,
    the on-policy drift (plan tokens included) is float noise, and the KL is measured."""
    from grpo_vision.policy import load_bundle
    from grpo_vision.run.metrics import load_metrics
    from grpo_vision.train import train
    from tests.helpers import micro_cfg

    cfg = micro_cfg(micro_world, tmp_path, "sample.plan.enabled=true", "sample.plan.max_tokens=4",
                    "log.report=false", "train.beta=0.04")
    bundle = load_bundle(cfg.policy, "cpu")
    base = bundle.policy.cfg
    torch.manual_seed(1)
    bundle.policy = LlamaImagePolicy(dataclasses.replace(base, plan_words=PLAN_WORDS, max_plan_tokens=4))
    start = bundle.policy.lm_head.weight[base.plan_offset + 1:].detach().clone()
    run = train(cfg, progress=False, bundle=bundle)
    rows = load_metrics(run)
    assert len(rows) == cfg.train.steps
    assert all(r["rollout/logp_drift"] < 1e-4 and math.isfinite(r["loss/total"]) for r in rows)
    assert all(0 < r["plan/length"] <= 4 and 0 < r["diversity/plans"] <= 1 and r["loss/kl"] >= 0 for r in rows)
    assert rows[-1]["loss/kl"] > 0  # after the first update the KL sees both segments move
    moved = (bundle.policy.lm_head.weight[base.plan_offset + 1:].detach() - start).abs().max()
    assert moved > 0


def test_a_planning_policy_exports_to_transformers_and_its_plan_logits_survive(planner, tmp_path):
    """The export's LlamaForCausalLM, loaded by transformers, gives the plan rows of its logits that plan_logits
    gives, and its tokenizer names every id (the plan block included); LlamaImagePolicy reads the export back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_vision.models.llama_hf import export

    export(planner, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = planner.encode_plan_prompts(["a red circle"])
    plan = torch.tensor([[1, 5, 0]])
    seq = torch.cat([ids, plan[:, :-1] + planner.cfg.plan_offset + 1], 1)
    with torch.no_grad():
        full = hf(seq).logits[:, ids.shape[1] - 1:]  # [1, T, vocab]
        ours = planner.plan_logits(ids, plan)
    start = planner.cfg.plan_offset + 1
    torch.testing.assert_close(full[..., start:start + planner.plan_vocab_size], ours, atol=1e-5, rtol=0)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == planner.cfg.vocab_size and tok.convert_ids_to_tokens(start + 5) == "<plan_c0>"
    back = LlamaImagePolicy.from_pretrained(tmp_path)
    assert back.cfg.plan_words == PLAN_WORDS and torch.equal(back.plan_logits(ids, plan), ours)


def test_the_options_the_plan_once_ruled_out_are_accepted_and_the_image_grid_ones_name_why():
    from tests.helpers import MICRO

    for option in ("train.importance_sampling_level=sequence", "train.top_entropy_quantile=0.5",
                   "train.zero_std_groups=resample", "train.entropy_coef=0.01", "train.use_adaptive_entropy=true",
                   "train.token_weighting=guidance_contrastive"):
        load_config(MICRO, ["sample.plan.enabled=true", option])
    for kind in ("stage", "critical"):
        with pytest.raises(ConfigError, match=f"train.token_weighting={kind} is defined on the image's token "
                                              "sequence only"):
            load_config(MICRO, ["sample.plan.enabled=true", f"train.token_weighting={kind}"])


def test_the_update_batch_lays_out_a_plan_segment_then_the_image_segment():
    # one constructor for both: T = 2 plan positions (the second padding) before N = 3 image tokens; top-entropy's
    # mask and an image-grid weight cover the image segment, a plan token keeps its policy term and weight 1
    from grpo_vision.sampling import Plan, Rollout
    from grpo_vision.step.update import UpdateBatch

    plan = Plan(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[4, 0]]), torch.tensor([[True, False]]),
                torch.tensor([[-0.5, 0.0]]), torch.zeros(1, 2), ["red"], ["a red circle"])
    rollout = Rollout(torch.tensor([[1, 2, 3]]), torch.tensor([[-1.0, -2.0, -3.0]]), torch.ones(1, 3), plan)
    batch = UpdateBatch.of(torch.zeros(1, 4, dtype=torch.long), rollout, rollout.sequence_logprobs, None,
                           torch.ones(1), 0.25, torch.tensor([[True, False, True]]))
    assert batch.sample_logprobs.tolist() == [[-0.5, 0.0, -1.0, -2.0, -3.0]]
    assert batch.count.tolist() == [[0.25, 0.0, 1.0, 1.0, 1.0]]
    assert batch.image.tolist() == [[False, False, True, True, True]]
    assert batch.policy_mask.tolist() == [[True, True, True, False, True]]
    assert batch.image_part(torch.tensor([[0.25, 0.75, 2.0]])).tolist() == [[1.0, 0.0, 0.25, 0.75, 2.0]]
    plain = UpdateBatch.of(torch.zeros(1, 4, dtype=torch.long), Rollout(rollout.tokens, rollout.logprobs,
                                                                        rollout.entropy), rollout.logprobs, None,
                           torch.ones(1))
    assert plain.count.tolist() == [[1.0, 1.0, 1.0]] and plain.policy_mask.all() and plain.rollout.plan.width == 0


def test_resampled_planned_steps_with_gspo_top_entropy_a_weighting_and_the_entropy_bonus_train(micro_world,
                                                                                               tmp_path):
    """The options the plan once ruled out, on the real loop with a plan-capable policy: every loss finite, the
    bonus's entropy and the policy-token share measured over both segments."""
    from grpo_vision.policy import load_bundle
    from grpo_vision.run.metrics import load_metrics
    from grpo_vision.train import train
    from tests.helpers import micro_cfg

    cfg = micro_cfg(micro_world, tmp_path, "sample.plan.enabled=true", "sample.plan.max_tokens=4",
                    "log.report=false", "train.importance_sampling_level=sequence", "train.top_entropy_quantile=0.5",
                    "train.entropy_coef=0.01", "train.zero_std_groups=resample", "train.steps=1",
                    "train.token_weighting=guidance_contrastive")
    bundle = load_bundle(cfg.policy, "cpu")
    torch.manual_seed(1)
    bundle.policy = LlamaImagePolicy(dataclasses.replace(bundle.policy.cfg, plan_words=PLAN_WORDS, max_plan_tokens=4))
    rows = load_metrics(train(cfg, progress=False, bundle=bundle))
    assert all(math.isfinite(r["loss/total"]) and r["loss/entropy"] > 0 for r in rows)
    assert all(0.5 < r["loss/policy_token_frac"] < 1 and "train/groups_resampled" in r for r in rows)
