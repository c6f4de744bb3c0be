"""The sampler owns the distribution: a slow reference, log-prob consistency, seeds and filters."""

import math
from dataclasses import replace

import pytest
import torch

from grpo_vision.sampling import SamplingParams, filter_logits, sample, sample_batched, sequence_logprobs
from grpo_vision.sampling.distribution import guided_logits, seeded_uniforms

PROMPTS = ["a red circle", "a blue square left of a red circle", "a blue circle"]
MODES = [
    SamplingParams(),
    SamplingParams(cfg_scale=3.0),
    SamplingParams(cfg_scale=3.0, temperature=0.7, top_k=5),
    SamplingParams(cfg_scale=2.0, top_p=0.6),
    SamplingParams(cfg_scale=2.0, temperature=1.3, top_k=8, top_p=0.8),
    SamplingParams(cfg_scale=3.0, top_k=5, logprob_mode="conditional"),
    SamplingParams(cfg_scale=1.0, temperature=0.8, top_k=4, logprob_mode="conditional"),
]


# Every decode path (sampling.py) must draw the eager path's tokens; the CUDA graph needs a GPU.
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-graph decode needs a CUDA device")
DECODES = ["eager", "static", pytest.param("graph", marks=CUDA)]


def device_for(decode: str) -> str:
    return "cuda" if decode == "graph" else "cpu"


def test_a_decode_step_the_compiler_fails_on_is_one_line_naming_the_fix(tiny_policy, monkeypatch):
    """torch 2.11's inductor failed in its Triton code generation on Janus-Pro-1B's step (docs/benchmarks.md)."""
    from torch._inductor.exc import InductorError

    from grpo_vision import sampling
    from grpo_vision.sampling import decode

    def fails(*args, **kwargs):
        raise InductorError(TypeError("list indices must be integers or slices, not NoneType"), "a traceback")

    monkeypatch.setattr(decode, "compiled_decode_step", lambda: fails)
    cond = tiny_policy.encode_prompts(PROMPTS)
    with pytest.raises(sampling.CompileError) as err:
        sample(tiny_policy, cond, [1, 2, 3], replace(MODES[1], decode="compiled"))
    message = str(err.value)
    assert "\n" not in message and message.startswith("sample.decode=compiled: torch ") and \
        "(InductorError: TypeError: list indices" in message and message.endswith("use sample.decode=graph (a GPU) or eager")
    monkeypatch.setattr(decode, "compiled_decode_step", lambda: lambda *a: 1 / 0)  # not the compiler's: as it is
    with pytest.raises(ZeroDivisionError):
        sample(tiny_policy, cond, [1, 2, 3], replace(MODES[1], decode="compiled"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("params", [MODES[1], MODES[4], MODES[5]], ids=str)
@torch.no_grad()
def test_the_compiled_step_draws_the_eager_tokens_and_compiles_once(tiny_policy, params, device):
    """sample.decode: compiled (inductor runs on a CPU too; inside the CUDA graph on a GPU): the eager path's
    tokens for the same seeds, and a second rollout of the same shapes compiles nothing more."""
    from torch._dynamo.utils import counters

    policy = tiny_policy.to(device)
    cond = policy.encode_prompts(PROMPTS * 2)
    eager = sample(policy, cond, list(range(6)), params)
    compiled = sample(policy, cond, list(range(6)), replace(params, decode="compiled"))
    assert torch.equal(compiled.tokens, eager.tokens)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(compiled.entropy, eager.entropy, atol=1e-5, rtol=0)
    graphs = counters["stats"]["unique_graphs"]
    again = sample(policy, cond, list(range(10, 16)), replace(params, decode="compiled"))  # other seeds, same shapes
    assert counters["stats"]["unique_graphs"] == graphs  # paid once per process, never per rollout
    assert torch.equal(again.tokens, sample(policy, cond, list(range(10, 16)), params).tokens)
    assert not torch.equal(again.tokens, eager.tokens)


def reference_sample(policy, cond, seeds, params, force_guidance=False):
    """Slow and obvious: full forward passes (no cache) at every step, same uniforms, same filters."""
    B, N, device = cond.shape[0], policy.num_image_tokens, cond.device
    u = seeded_uniforms(seeds, N, device)
    tokens = torch.zeros(B, 0, dtype=torch.long, device=device)
    logps = []
    for i in range(N):
        padded = torch.cat([tokens, torch.zeros(B, 1, dtype=torch.long, device=device)], dim=1)  # last never read
        c = policy.image_logits(cond, padded)[:, i]
        un = policy.image_logits(policy.null_condition(cond), padded)[:, i]
        guided = params.guided or force_guidance
        logits = guided_logits(c, un if guided else None, params.cfg_scale) / params.temperature
        probs = filter_logits(logits, params.top_k, params.top_p).softmax(-1)
        cdf = probs.cumsum(-1)
        tok = torch.tensor([int((cdf[b] < (1 - u[b, i]) * cdf[b, -1]).sum()) for b in range(B)], device=device)
        if params.logprob_mode == "conditional":
            probs = (c / params.temperature).softmax(-1)
        logps.append(probs.gather(-1, tok[:, None]).log().squeeze(-1))
        tokens = torch.cat([tokens, tok[:, None]], dim=1)
    return tokens, torch.stack(logps, dim=1)


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("params", MODES[:5] + MODES[5:6], ids=str)
@torch.no_grad()
def test_fast_sampler_equals_slow_reference(tiny_policy, params, decode):
    policy = tiny_policy.to(device_for(decode))
    cond = policy.encode_prompts(PROMPTS)
    fast = sample(policy, cond, [1, 2, 3], replace(params, decode=decode))
    tokens, logps = reference_sample(policy, cond, [1, 2, 3], params)
    assert torch.equal(fast.tokens, tokens)
    torch.testing.assert_close(fast.logprobs, logps, atol=1e-4, rtol=0)


@torch.no_grad()
def test_cfg_scale_one_equals_the_conditional_branch(tiny_policy):
    cond = tiny_policy.encode_prompts(PROMPTS)
    c, un = torch.randn(4, 32), torch.randn(4, 32)
    torch.testing.assert_close(guided_logits(c, un, 1.0), c)
    params = SamplingParams(cfg_scale=1.0, top_k=6)
    fast = sample(tiny_policy, cond, [5, 6, 7], params)  # no null rows at all
    tokens, logps = reference_sample(tiny_policy, cond, [5, 6, 7], params, force_guidance=True)
    assert torch.equal(fast.tokens, tokens)
    torch.testing.assert_close(fast.logprobs, logps, atol=1e-4, rtol=0)


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("params", MODES, ids=str)
def test_recomputed_logprobs_equal_rollout_logprobs(tiny_policy, params, decode):
    policy = tiny_policy.to(device_for(decode))
    cond = policy.encode_prompts(PROMPTS * 4)
    rollout = sample(policy, cond, list(range(12)), replace(params, decode=decode))
    recomputed = sequence_logprobs(policy, cond, rollout, params)  # with grad, one pass
    assert recomputed.requires_grad
    ratio = (recomputed - rollout.logprobs).exp()
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)
    assert torch.isfinite(rollout.logprobs).all() and (rollout.logprobs <= 0).all()


def test_conditional_mode_scores_the_conditional_branch_alone(tiny_policy):
    params = SamplingParams(cfg_scale=3.0, temperature=0.5, top_k=3, logprob_mode="conditional")
    cond = tiny_policy.encode_prompts(PROMPTS)
    rollout = sample(tiny_policy, cond, [0, 1, 2], params)
    with torch.no_grad():
        by_hand = (tiny_policy.image_logits(cond, rollout.tokens) / 0.5).log_softmax(-1)
    torch.testing.assert_close(rollout.logprobs, by_hand.gather(-1, rollout.tokens[..., None])[..., 0],
                               atol=1e-5, rtol=0)


def test_same_seed_same_tokens_and_group_members_differ(tiny_policy):
    params = SamplingParams(cfg_scale=2.0, top_k=10)
    cond = tiny_policy.encode_prompts(["a red circle"] * 8)  # one group of 8
    a = sample(tiny_policy, cond, list(range(8)), params)
    b = sample(tiny_policy, cond, list(range(8)), params)
    assert torch.equal(a.tokens, b.tokens)
    assert len({tuple(t) for t in a.tokens.tolist()}) == 8


def test_an_image_depends_on_its_seed_not_on_its_batch(tiny_policy):
    params = SamplingParams(cfg_scale=2.0, top_p=0.9)
    cond = tiny_policy.encode_prompts(PROMPTS * 2)
    seeds = [11, 12, 13, 14, 15, 16]
    whole = sample(tiny_policy, cond, seeds, params)
    chunked = sample_batched(tiny_policy, cond, seeds, params, batch_size=4)
    alone = sample(tiny_policy, cond[4:5], [15], params)
    assert torch.equal(whole.tokens, chunked.tokens)
    assert torch.equal(whole.tokens[4:5], alone.tokens)


@pytest.mark.parametrize("top_k", [1, 3])
def test_a_token_outside_the_top_k_is_never_drawn(tiny_policy, top_k):
    params = SamplingParams(cfg_scale=3.0, top_k=top_k)
    cond = tiny_policy.encode_prompts(PROMPTS * 20)
    rollout = sample(tiny_policy, cond, list(range(60)), params)
    with torch.no_grad():
        c = tiny_policy.image_logits(cond, rollout.tokens)
        un = tiny_policy.image_logits(tiny_policy.null_condition(cond), rollout.tokens)
    g = guided_logits(c, un, 3.0)  # [B, N, K]
    rank = (g > g.gather(-1, rollout.tokens[..., None])).sum(-1)  # tokens strictly more likely
    assert rank.max().item() < top_k
    if top_k == 1:  # greedy: a point mass has zero entropy and log-prob 0
        assert rollout.entropy.abs().max() < 1e-6 and rollout.logprobs.abs().max() < 1e-6


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    # Mass before each sorted token: 0, 0.5, 0.8, 0.95 -> with top_p = 0.75 keep the first two only.
    kept = filter_logits(logits, top_k=0, top_p=0.75).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = filter_logits(logits, top_k=0, top_p=0.75, keep=torch.tensor([3])).isfinite()
    assert kept.tolist() == [[True, True, False, True]]  # a scored token always stays in the support
    assert filter_logits(logits, top_k=0, top_p=1.0).isfinite().all()


def test_first_token_frequencies_match_the_distribution(tiny_policy):
    params = SamplingParams(cfg_scale=2.0, temperature=1.5)
    cond = tiny_policy.encode_prompts(["a red circle"] * 3000)
    rollout = sample(tiny_policy, cond, list(range(3000)), params)
    with torch.no_grad():
        c, un = tiny_policy.prefill(cond[:1], tiny_policy.new_cache(1)), None
        un = tiny_policy.prefill(tiny_policy.null_condition(cond[:1]), tiny_policy.new_cache(1))
    probs = (guided_logits(c, un, 2.0) / 1.5).softmax(-1)[0]
    freq = torch.bincount(rollout.tokens[:, 0], minlength=32).float() / 3000
    assert 0.5 * (freq - probs).abs().sum() < 0.06  # total variation; sampling noise is ~0.03 here
    entropy = -(probs * probs.log()).sum()
    torch.testing.assert_close(rollout.entropy[:, 0], entropy.expand(3000), atol=1e-4, rtol=0)


def test_seed_count_must_match_rows(tiny_policy):
    with pytest.raises(ValueError, match="got 2 seeds for 3 condition rows"):
        sample(tiny_policy, tiny_policy.encode_prompts(PROMPTS), [1, 2], SamplingParams())


def test_bad_params_are_refused(tiny_policy):
    with pytest.raises(ValueError, match="decode must be one of"):
        SamplingParams(decode="fused")
    cond = tiny_policy.encode_prompts(PROMPTS)
    with pytest.raises(ValueError, match="'graph' needs a CUDA device"):
        sample(tiny_policy, cond, [1, 2, 3], SamplingParams(decode="graph"))
    with pytest.raises(ValueError, match="has no static decode"):
        sample(_NoStatic(tiny_policy), cond, [1, 2, 3], SamplingParams(decode="static"))
    with pytest.raises(ValueError, match="logprob_mode must be one of"):
        SamplingParams(logprob_mode="cfg")
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        SamplingParams(temperature=0.0)


class _NoStatic:
    """A policy without `static_decode` (a plugin's that predates it): eager only."""

    def __init__(self, policy):
        self.policy = policy

    def __getattr__(self, name):
        if name == "static_decode":
            raise AttributeError(name)
        return getattr(self.policy, name)


def test_the_decode_table_holds_every_path_sampling_params_accepts():
    from grpo_vision.sampling.decode import DECODERS, NEEDS
    from grpo_vision.sampling.distribution import DECODE_MODES

    assert set(DECODERS) | {"auto"} == set(DECODE_MODES)
    assert {n for path in DECODERS.values() for n in path.needs} <= set(NEEDS)
