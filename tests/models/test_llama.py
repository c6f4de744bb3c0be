"""The built-in Llama policy's optional hooks (models/llama.py); its protocol, KV cache and save/load are in
tests/test_policy.py."""

import torch

from grpo_vision.policy import check_weighting_hooks


def test_token_embeddings_are_the_embedding_rows_of_image_tokens(tiny_policy):
    # the policy hook train.token_weighting=critical reads (step/credit.py: GCPO's critical tokens)
    tokens = torch.tensor([[0, 3, 31], [1, 1, 2]])
    emb = tiny_policy.token_embeddings(tokens)  # what image_logits feeds the model for these tokens
    assert emb.shape == (2, 3, tiny_policy.cfg.dim) and not emb.requires_grad
    assert torch.equal(emb, tiny_policy.model.embed_tokens.weight[tokens + tiny_policy.cfg.image_offset])
    check_weighting_hooks("critical", "llama", tiny_policy, None)  # critical reads the policy alone
