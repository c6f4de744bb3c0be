"""The built-in Llama policy (models/llama.py): its optional hooks, and its one block path read by teacher forcing,
decode and decode_block alike; its protocol, KV cache and save/load are in tests/test_policy.py."""

import pytest
import torch

from grpo_vision.sampling.speculative import Tree
from grpo_vision.policy import check_weighting_hooks
from test_llama_canvas import PLANS, PROMPTS, canvas_policy  # noqa: F401 (a fixture)


def test_token_embeddings_are_the_embedding_rows_of_image_tokens(tiny_policy):
    # the policy hook train.token_weighting=critical reads (step/credit.py: GCPO's critical tokens)
    tokens = torch.tensor([[0, 3, 31], [1, 1, 2]])
    emb = tiny_policy.token_embeddings(tokens)  # what image_logits feeds the model for these tokens
    assert emb.shape == (2, 3, tiny_policy.cfg.dim) and not emb.requires_grad
    assert torch.equal(emb, tiny_policy.model.embed_tokens.weight[tokens + tiny_policy.cfg.image_offset])
    check_weighting_hooks("critical", "llama", tiny_policy, None)  # critical reads the policy alone


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_teacher_forcing_decode_and_decode_block_share_one_block_path_with_the_canvas(canvas_policy, static):
    """The three callers of the one block path (`_layers`) on a canvas policy with GQA (4 heads over 2 kv heads)
    against a slow obvious reference: the canvas of image token j added by hand to the input at <boi> + j, the
    blocks run without a cache. Prefill then decode steps, then decode_block windows on the same cache at per-row
    starts (one running past the image, where no canvas applies and only its first tokens have a reference)."""
    policy, W = canvas_policy, 4
    assert policy.cfg.n_kv_heads < policy.cfg.n_heads
    cond = policy.plan_condition(PROMPTS, PLANS)  # [3, L]
    (B, L), N = cond.shape, policy.num_image_tokens
    tokens = torch.randint(0, 16, (B, N), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = policy.model.embed_tokens(torch.cat([cond, tokens[:, :-1] + policy.cfg.image_offset], 1))  # [B, L+N-1, dim]
        x[:, L - 1:] += policy.layout_canvas(cond)  # input L-1+j predicts token j
        want = policy._image_head(policy._forward(x)[:, L - 1:])  # [B, N, K]
        torch.testing.assert_close(policy.image_logits(cond, tokens), want, atol=1e-5, rtol=0)
        cache = policy.new_cache(B, static=static, extra=W)
        cache.k.zero_(), cache.v.zero_()  # an eager cache is torch.empty; decode_block reads its masked keys too
        stepped = [policy.prefill(cond, cache)] + [policy.decode(tokens[:, i], cache) for i in range(N - 1)]
        torch.testing.assert_close(torch.stack(stepped, 1), want, atol=1e-5, rtol=0)
        s = torch.tensor([0, 5, N - 2])  # each row's window starts at its own image token; the last runs past N
        window = torch.cat([tokens, torch.zeros(B, W, dtype=torch.long)], 1).gather(1, s[:, None] + torch.arange(W))
        block = policy.decode_block(window, cache, L + s, Tree.chain(W))  # [B, W, K]: column w predicts token s + w + 1
        for b, start in enumerate(s.tolist()):
            n = min(W, N - 1 - start)
            torch.testing.assert_close(block[b, :n], want[b, start + 1:start + 1 + n], atol=1e-5, rtol=0)
