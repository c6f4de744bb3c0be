"""How a rollout runs: one table of decode paths (`DECODERS`), each drawing every image token from the
distribution (distribution.py). Not part of the distribution: `sample.decode` changes the time a rollout takes.

Rollouts prefill the condition into a preallocated KV cache and decode one image token at a time (LlamaGen's
`generate.py` pattern). ``eager`` attends over the keys written so far, a shape that grows every step; ``static``
uses a cache preallocated at its full length, the position a tensor on the device and the attention masked
(`models/kv_cache.py`), so every tensor keeps its shape and address; ``graph`` records that step, the token draw
included, once as a CUDA graph and replays it for every token (no per-token Python or kernel-launch cost; PyTorch's
CUDA graphs docs, the gpt-fast / LlamaGen `reduce-overhead` decode); ``compiled`` is the same static step compiled
by `torch.compile` (inductor fuses its norms, rotary, residuals and the draw into fewer kernels), recorded as a CUDA
graph on a GPU and run as it is on a CPU. The compiled step is one function of the module (`decode_step`), compiled
once per process and shape, never per rollout. All four draw the same tokens from the same seeds. ``speculative``
(speculative.py, SJD) verifies several drafted tokens a forward pass: the same distribution, exactly, but other
tokens for a seed.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

import torch

from grpo_vision.config import ConfigError
from grpo_vision.policy import ImagePolicy
from grpo_vision.sampling.cuda_graph import record_step
from grpo_vision.sampling.distribution import SamplingParams, branches, sample_token, seeded_uniforms
from grpo_vision.sampling.sequences import Rollout
from grpo_vision.sampling.speculative import sample_speculative


def draw_token(logits: torch.Tensor, u: torch.Tensor, col: torch.Tensor, out: Rollout,
               params: SamplingParams) -> torch.Tensor:
    """Token `col` of every row from `logits` `[B or 2B, K]` (CFG's null rows after the B conditional ones) with
    uniforms `u` `[B, N]`, written into `out`; returns the rows to decode next `[B or 2B]`."""
    token, logp, entropy = sample_token(*branches(logits, u.shape[0], params), u.gather(1, col).squeeze(1), params)
    for buffer, value in zip((out.tokens, out.logprobs, out.entropy), (token, logp, entropy)):
        buffer.scatter_(1, col, value.unsqueeze(1))
    col.add_(1)
    return token.repeat(2) if params.guided else token  # [B or 2B]


def decode_step(policy: ImagePolicy, cache, logits: torch.Tensor, u: torch.Tensor, col: torch.Tensor, out: Rollout,
                params: SamplingParams) -> torch.Tensor:
    """One token of every row: drawn from `logits`, decoded into `cache`, the next logits written over `logits`.
    Every tensor it reads and writes keeps its address (a static cache), so a CUDA graph can record it."""
    return logits.copy_(policy.decode(draw_token(logits, u, col, out, params), cache))


@lru_cache(maxsize=1)  # made at the first compiled rollout of the process
def compiled_decode_step():
    """`decode_step` compiled by inductor, once per process: torch.compile caches the code per dtype and setting
    (guards), so a later rollout runs it without compiling again. Shapes are left to its automatic dynamic mode:
    a Janus cache is as long as the batch's longest prompt, and the second length seen compiles a version for
    any length, not one a step."""
    # a recompile per group size, dtype and setting; the default limit of 8 would fall back to eager silently
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(decode_step)


# ------------------------------------------------------------------ the loops after the first token's logits
# Each runs the first N - 1 tokens of a rollout (a draw, then a decode) and returns the logits of the last.

def stepwise(policy, cache, logits, u, col, out, params, steps: int) -> torch.Tensor:
    for _ in range(steps):
        logits = policy.decode(draw_token(logits, u, col, out, params), cache)
    return logits


def recorded(policy, cache, logits, u, col, out, params, steps: int, compiled: bool = False) -> torch.Tensor:
    """`decode_step` (or its compiled version) recorded as a CUDA graph and replayed; on a CPU, the compiled step
    run as it is (its first run compiles it)."""
    if steps == 0:
        return logits
    step = compiled_decode_step() if compiled else decode_step
    run = lambda: step(policy, cache, logits, u, col, out, params)  # noqa: E731
    with compile_errors(compiled):
        if logits.device.type == "cuda":
            run = record_step(run, [logits, col, cache.position])
        else:  # inductor's CPU code: the first call compiles and runs one step
            run()
            steps -= 1
    for _ in range(steps):
        run()
    return logits


def token_by_token(loop: Callable, static: bool, **options) -> Callable[..., Rollout]:
    """A decode path that draws one token a forward pass: the prefill, `loop` over the first N - 1 tokens, then the
    last token, which nothing decodes after."""
    def run(policy: ImagePolicy, cond: torch.Tensor, seeds, params: SamplingParams) -> Rollout:
        B, N, device = cond.shape[0], policy.num_image_tokens, cond.device
        u = seeded_uniforms(seeds, N, device)  # [B, N]
        rows = torch.cat([cond, policy.null_condition(cond)]) if params.guided else cond  # [B or 2B, L]
        cache = policy.new_cache(rows.shape[0], static=True) if static else policy.new_cache(rows.shape[0])
        out = Rollout(torch.zeros(B, N, dtype=torch.long, device=device), torch.zeros(B, N, device=device),
                      torch.zeros(B, N, device=device))
        col = torch.zeros(B, 1, dtype=torch.long, device=device)  # the token being drawn, a tensor a graph can read
        logits = loop(policy, cache, policy.prefill(rows, cache), u, col, out, params, N - 1, **options)
        draw_token(logits, u, col, out, params)
        return out
    return run


@dataclass(frozen=True)
class DecodePath:
    run: Callable[..., Rollout]  # (policy, cond [B, L], seeds, params) -> Rollout
    needs: tuple[str, ...] = ()  # what the policy and the rows must have: keys of NEEDS


DECODERS = {  # sample.decode -> its path (DECODE_MODES, "auto" aside: decode_mode picks one of these)
    "eager": DecodePath(token_by_token(stepwise, static=False)),
    "static": DecodePath(token_by_token(stepwise, static=True), ("static",)),
    "graph": DecodePath(token_by_token(recorded, static=True), ("static", "cuda")),
    "compiled": DecodePath(token_by_token(recorded, static=True, compiled=True), ("static",)),
    # its Rollout.forwards: the passes each row took
    "speculative": DecodePath(lambda policy, cond, seeds, params: sample_speculative(policy, cond, seeds, params)[0],
                              ("block",)),
}

# need -> (whether the policy and the rows' device have it, what to say after `sample.decode 'X'` when they do not)
NEEDS = {
    "static": (lambda policy, device: getattr(policy, "static_decode", False),  # policies opt in
               ": {policy} has no static decode; use eager"),
    "cuda": (lambda policy, device: device.type == "cuda",
             " needs a CUDA device (the rows are on {device}); use static or auto"),
    "block": (lambda policy, device: hasattr(policy, "decode_block"),
              ": {policy} has no decode_block (several tokens a row from per-row cache positions); use eager"),
}


def decode_mode(policy: ImagePolicy, requested: str, device: torch.device) -> str:
    """The decode path a rollout takes: `auto` is a CUDA graph where the policy has a static decode and the rows are
    on a GPU, else eager. A ValueError when a path is asked for that cannot run."""
    if requested == "auto":
        return "graph" if all(NEEDS[n][0](policy, device) for n in DECODERS["graph"].needs) else "eager"
    for need in DECODERS[requested].needs:
        has, missing = NEEDS[need]
        if not has(policy, device):
            name = type(policy).__name__
            raise ValueError(f"sample.decode {requested!r}" + missing.format(policy=name, device=device))
    return requested


@torch.no_grad()  # not inference_mode: rollout tensors are reused by autograd in training
def sample(policy: ImagePolicy, cond: torch.Tensor, seeds: Sequence[int] | torch.Tensor,
           params: SamplingParams) -> Rollout:
    """Sample N image tokens for each condition row `[B, L]`, row i from seed `seeds[i]`."""
    if len(seeds) != cond.shape[0]:
        raise ValueError(f"got {len(seeds)} seeds for {cond.shape[0]} condition rows; pass one seed per image")
    return DECODERS[decode_mode(policy, params.decode, cond.device)].run(policy, cond, seeds, params)


def sample_batched(policy: ImagePolicy, cond: torch.Tensor, seeds: Sequence[int], params: SamplingParams,
                   batch_size: int) -> Rollout:
    """`sample` in chunks of `batch_size` rows (the results do not depend on the chunking)."""
    return Rollout.cat([sample(policy, cond[i:i + batch_size], seeds[i:i + batch_size], params)
                        for i in range(0, cond.shape[0], batch_size)])


def decode_note(decode: str, device: torch.device | str) -> str | None:
    """The line a command prints before its first rollout where `sample.decode` costs time a user would not guess
    (None: nothing to say). Measured figures: docs/benchmarks.md (the compiled step on a CPU: 0.86-1.1 s a sampler
    call against eager's 0.48-0.52 at the built-in policy's size) and docs/experiments/speculative_rollouts.md (a
    main-job step took 14 s speculative against 9.3 plain on a CPU)."""
    cpu = torch.device(device).type == "cpu"
    if decode == "compiled":
        return ("sample.decode=compiled: compiling the decode step at the first rollout, once per process and shape "
                + ("(about 30 s on a CPU); on a CPU the compiled step has measured slower than eager decoding at the "
                   "built-in policy's size (docs/benchmarks.md)" if cpu else "(inside the CUDA graph)"))
    if decode == "speculative" and cpu:
        return ("sample.decode=speculative on a CPU: exact, but slower than plain decoding here (a pass over W tokens "
                "costs about W single-token steps; a main-job step took 14 s against 9.3); its fewer passes are "
                "meant for a GPU (docs/experiments/speculative_rollouts.md)")
    return None


class CompileError(ConfigError):
    """torch.compile could not compile the decode step (sample.decode: compiled): one line, naming the fix."""


@contextmanager
def compile_errors(compiled: bool):
    """Inductor's failures while compiling the decode step, as one CompileError line: torch 2.11's Triton code
    generation failed on the Janus-Pro-1B step on an H200 (docs/benchmarks.md), where the CUDA graph runs."""
    if not compiled:
        yield
        return
    try:
        yield
    except Exception as e:
        if not type(e).__module__.startswith(("torch._inductor", "torch._dynamo")):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        raise CompileError(f"sample.decode=compiled: torch {torch.__version__} could not compile this policy's decode "
                           f"step ({type(e).__name__}: {first[:200]}); use sample.decode=graph (a GPU) or eager"
                           ) from None
