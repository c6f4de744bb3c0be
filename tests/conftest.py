"""Fixtures shared by the test files; plain helpers (ROOT, run_cli, micro_cfg) are in tests/helpers.py.

Two tiers (pyproject.toml's markers): `pytest -m "not e2e"` is the fast tier (math, sampler, config,
rewards, in-process loops on the micro world); tests marked `e2e` run the CLI in a subprocess, several
processes, TRL, the browser, matrix runs or world builds. `pytest -q` runs both; `-n auto` (pytest-xdist,
as TRL's Makefile runs its suite) runs them on one worker per core."""

import os
import sys

import pytest
import torch

from grpo_vision.models.llama import LlamaImagePolicy
from grpo_vision.run.machine import available_cores
from tests.helpers import micro_cfg, peaked_llama

WORDS = "a red blue circle square left of".split()

# Under pytest-xdist each worker, and every CLI process its tests start (run.threads=0 reads
# OMP_NUM_THREADS), takes its share of the cores: two workers' OpenMP pools of two threads each on two
# cores would spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, available_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def fresh_process_state():
    """What an in-process train() leaves behind, undone as a CLI process's exit would: torch's thread
    count (run.threads sets it), and accelerate's one state per process (its device, its mixed
    precision: a run with run.device=cpu after one on a GPU was refused, "AcceleratorState has already
    been initialized"; accelerate's own AccelerateTestCase.tearDown resets it the same way)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()


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
    return peaked_llama(4.0, words=WORDS, max_caption_words=8, codebook_size=32, image_grid=(3, 4), dim=64,
                        n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96)  # std 0.08


@pytest.fixture(scope="session")
def micro_world(tmp_path_factory):
    """A micro ShapesWorld, built once per test session."""
    from grpo_vision.shapes.build import build_world

    path = tmp_path_factory.mktemp("worlds") / "shapes_micro"
    build_world(path, preset="micro", seed=0, progress=False, log=lambda _: None)
    return path


@pytest.fixture(scope="session")
def micro_run(micro_world, tmp_path_factory):
    """Two GRPO steps of the micro config, trained once per session in this process: a sample grid each
    step, checkpoints, and the report evaluated at two temperatures (the headline 0.7, and 1.0). Tests
    read it and never change it: a test that writes into a run trains its own."""
    from grpo_vision.train import train

    cfg = micro_cfg(micro_world, tmp_path_factory.mktemp("micro_runs"), "log.sample_every=1",
                    "log.eval_temperatures=[0.7,1.0]")
    return train(cfg, progress=False)


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
        model.image_logits(cond, tokens).log_softmax(-1).gather(-1, tokens[..., None]).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    return grads
