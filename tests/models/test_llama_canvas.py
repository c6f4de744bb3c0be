"""A layout canvas on the built-in policy (LlamaPolicyConfig.canvas_*): the plan in the image condition drawn onto
the token grid, worked by hand; every decode path reads it as teacher forcing does (and one that skips it fails the
same check); it trains, saves and loads; a canvas that does not fit, and its export to transformers, are refused."""

import dataclasses

import pytest
import torch

from grpo_vision.config import ConfigError
from grpo_vision.models.llama import LlamaImagePolicy, covered
from grpo_vision.models.llama_hf import export
from grpo_vision.sampling import SamplingParams, sample, sequence_logprobs
from test_policy import decode_all
from tests.helpers import peaked_llama
from tests.sampling.test_speculative import check_decode_block, check_speculative_sampler

WORDS = ["a", "red", "blue", "circle", "square", "left", "of"]
ATTRIBUTES = ["red", "blue", "circle", "square", "small", "big"]
COLUMNS, ROWS = [f"c{i}" for i in range(4)], [f"r{i}" for i in range(3)]
PLAN_WORDS = [*ATTRIBUTES, *COLUMNS, *ROWS, "white"]
CANVAS = dict(canvas_attributes=ATTRIBUTES, canvas_columns=COLUMNS, canvas_rows=ROWS,
              canvas_extents={"small": 1.0, "big": 3.0})


@pytest.fixture
def canvas_policy() -> LlamaImagePolicy:
    return peaked_llama(4.0, words=WORDS, max_caption_words=8, codebook_size=16, image_grid=(3, 4), dim=32,
                        n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, plan_words=PLAN_WORDS, max_plan_tokens=11,
                        **CANVAS)  # peaked logits, and a canvas that moves them


def plan(*words: str) -> list[int]:
    return [PLAN_WORDS.index(w) + 1 for w in words]  # local plan ids: 0 ends a plan


PROMPTS = ["a red circle", "a blue square left of a red circle", "a blue circle"]
PLANS = [plan("red", "circle", "small", "c1", "r2", "white"),
         plan("blue", "square", "big", "c0", "r1", "red", "circle", "small", "c3", "r0", "white"),
         plan("blue", "circle", "big", "c3", "r2", "white")]


def test_each_planned_object_paints_its_attributes_over_its_box(canvas_policy):
    """By hand, on a 3 x 4 grid: a small (extent 1) object covers its own cell; a big one (extent 3) the cells
    within 1.5 of its cell, cut at the border. Overlaps add; the null row and a caption alone paint nothing."""
    policy = canvas_policy
    with torch.no_grad():  # the canvas's projection as the identity on the first 6 dimensions: the map itself
        policy.canvas.weight.zero_()
        policy.canvas.weight[:6, :6] = torch.eye(6)
    cond = policy.plan_condition(PROMPTS[1:2], PLANS[1:2])
    caption_only = policy.plan_condition(PROMPTS[:1], [[]])
    rows = torch.cat([cond, policy.null_condition(cond), caption_only])
    hot = policy.layout_canvas(rows)[..., :6].view(3, 3, 4, 6)  # [rows, h, w, attributes]
    red, blue, circle, square, small, big = range(6)
    want = torch.zeros(3, 4, 6)
    want[0:3, 0:2, [blue, square, big]] = 1  # big at (row 1, col 0): rows 0-2, cols 0-1 (col -1 cut)
    want[0, 3, [red, circle, small]] = 1  # small at (row 0, col 3)
    assert torch.equal(hot[0], want)
    assert not hot[1:].any()
    overlap = policy.layout_canvas(policy.plan_condition(["a blue circle"], [
        plan("blue", "circle", "big", "c1", "r1", "red", "square", "big", "c2", "r1", "white")]))[0, :, :6]
    assert overlap.view(3, 4, 6)[1, 1:3].tolist() == [[1, 1, 1, 1, 0, 2]] * 2  # both boxes cover cols 1-2


def test_a_plan_grid_finer_or_coarser_than_the_tokens_scales_onto_them():
    """Token j's centre sits at (j + 0.5) * cells / tokens cells: 8 cells on 4 tokens, 2 cells on 4 tokens."""
    assert covered(3, 1.0, 8, 4) == (1, 1)  # cell 3 of 8 spans 3..4, token 1's centre is at 3.0
    assert covered(5, 3.5, 8, 4) == (2, 3)  # 3.75 .. 7.25 cells: centres 5.0 and 7.0
    assert covered(0, 1.0, 2, 4) == (0, 1)  # the left half: tokens 0 and 1
    assert covered(0, 6.0, 4, 4) == (0, 3) and covered(3, 1.0, 4, 4) == (3, 3)  # cut at both borders


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_decoding_reads_the_canvas_as_teacher_forcing_does_and_a_decode_without_it_fails(canvas_policy, static):
    policy = canvas_policy
    cond = policy.plan_condition(PROMPTS, PLANS)
    tokens = torch.randint(0, 16, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = policy.image_logits(cond, tokens)  # [3, 12, 16]
        cache = policy.new_cache(3, static=static)
        stepped = [policy.prefill(cond, cache)]
        stepped += [policy.decode(tokens[:, i], cache) for i in range(11)]
        torch.testing.assert_close(torch.stack(stepped, 1), full, atol=1e-5, rtol=0)
        cache = policy.new_cache(3, static=static)
        policy.prefill(cond, cache)
        cache.canvas = None  # a decode that forgets the plan's layout after the first token
        blind = torch.stack([policy.decode(tokens[:, i], cache) for i in range(11)], 1)
    assert (blind - full[:, 1:]).abs().max() > 1e-2


def test_decode_block_and_the_speculative_sampler_read_the_canvas(canvas_policy):
    policy = canvas_policy
    cond = policy.plan_condition(PROMPTS, PLANS)
    check_decode_block(policy, cond, W=4)
    params = SamplingParams(cfg_scale=2.0, top_k=8)
    for decode in ("eager", "static"):
        rollout = sample(policy, cond, [0, 1, 2], dataclasses.replace(params, decode=decode))
        with torch.no_grad():
            scored = sequence_logprobs(policy, cond, rollout, params)
        torch.testing.assert_close(rollout.logprobs, scored, atol=1e-5, rtol=0)
    check_speculative_sampler(policy, cond, params)  # a chain and a tree of drafts, over the canvas


def test_the_canvas_trains_saves_and_loads(canvas_policy, tmp_path):
    policy = canvas_policy.train()
    cond = policy.plan_condition(PROMPTS, PLANS)
    tokens = torch.randint(0, 16, (3, 12), generator=torch.Generator().manual_seed(0))
    policy.image_logits(cond, tokens).logsumexp(-1).sum().backward()
    assert policy.canvas.weight.grad.abs().sum() > 0
    policy.save_pretrained(tmp_path)
    loaded = LlamaImagePolicy.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.image_logits(cond, tokens), policy.eval().image_logits(cond, tokens))
    assert decode_all(loaded, cond, tokens).shape == (3, 12, 16)


@pytest.mark.parametrize("change, named", [
    (dict(canvas_attributes=["red", "teal"]), "canvas_attributes names ['teal']"),
    (dict(canvas_rows=[]), "needs the plan words of its columns and rows (canvas_columns, canvas_rows)"),
    (dict(canvas_extents={"huge": 5.0}), "canvas_extents names ['huge']"),
])
def test_a_canvas_that_does_not_fit_the_plan_vocabulary_or_grid_is_named(canvas_policy, change, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        LlamaImagePolicy(dataclasses.replace(canvas_policy.cfg, **change))


def test_a_canvas_policy_refuses_the_transformers_export_in_one_line(canvas_policy, tmp_path):
    with pytest.raises(ConfigError, match="canvas_attributes") as e:
        export(canvas_policy, tmp_path)
    assert "\n" not in str(e.value) and not any(tmp_path.iterdir())
    assert canvas_policy.adapter_root is None  # no peft adapter for LlamaForCausalLM either (export.py merges)
