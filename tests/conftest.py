import pytest
import torch

from grpo_vision.llama_policy import LlamaImagePolicy, LlamaPolicyConfig

WORDS = "a red blue circle square left of".split()


@pytest.fixture
def one_thread():
    """Tiny ops: one thread avoids waiting on a descheduled second thread on a busy 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_policy() -> LlamaImagePolicy:
    """A tiny random policy with grouped-query attention and non-trivial (not near-uniform) logits."""
    torch.manual_seed(0)
    cfg = LlamaPolicyConfig(words=WORDS, max_caption_words=8, codebook_size=32, image_grid=(3, 4),
                            dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96)
    policy = LlamaImagePolicy(cfg).eval()
    with torch.no_grad():
        for p in policy.parameters():
            if p.ndim > 1:
                p.mul_(4.0)  # std 0.08: peaked enough that top-k/top-p cut real mass
    return policy


@pytest.fixture(scope="session")
def micro_world(tmp_path_factory):
    """A micro ShapesWorld, built once per test session."""
    from grpo_vision.shapes.build import build_world

    path = tmp_path_factory.mktemp("worlds") / "shapes_micro"
    build_world(path, preset="micro", seed=0, progress=False, log=lambda _: None)
    return path


@pytest.fixture
def checkpointing_gradients():
    """f(policy, prompts): the gradients of a log-likelihood without and with gradient checkpointing."""
    return _checkpointing_gradients


def _checkpointing_gradients(policy, prompts: list[str]) -> list[dict]:
    import copy

    cond = policy.encode_prompts(prompts)
    tokens = torch.randint(0, policy.codebook_size, (len(prompts), policy.num_image_tokens),
                           generator=torch.Generator().manual_seed(0))
    grads = []
    for remat in (False, True):
        model = copy.deepcopy(policy).train()
        if remat:
            model.gradient_checkpointing_enable()
        model(cond, tokens).log_softmax(-1).gather(-1, tokens[..., None]).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    return grads
