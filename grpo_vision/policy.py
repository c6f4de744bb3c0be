"""The `ImagePolicy` protocol: what the sampler and the trainer need from an image-token model.

A policy turns captions into condition token ids, and gives logits over its image codebook, either
step by step with a KV cache (sampling) or for a whole token sequence at once (teacher forcing, for
training log-probs). Logits are always over the codebook only (`[..., codebook_size]`), so the
sampler never has to know where image tokens sit in a model's vocabulary.

Optional: `unknown_words(prompt) -> list[str]`, the words a policy would read as unknown, and
`caption_words`, its vocabulary. A policy with a closed vocabulary implements them, so that
training refuses prompts it cannot read (`prompt_problem` below); Janus reads any text and does not.

The sampler owns the distribution (CFG, temperature, top-k/top-p): see `sampling.py`. Adapters:
`llama_policy.LlamaImagePolicy` (built in, LlamaGen-style) and `janus_policy.JanusImagePolicy` (Janus-Pro through transformers).
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import torch

from grpo_vision.config_load import brief
from grpo_vision.prompts import PromptsError


@runtime_checkable
class ImagePolicy(Protocol):
    num_image_tokens: int  # tokens per image, h * w of the tokenizer's grid
    codebook_size: int  # K: image-token logits have this last dimension
    image_grid: tuple[int, int]  # (h, w) of the token grid, for the VQ decoder

    def encode_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        """Condition ids `[B, L]` for captions (all rows of one call share L)."""
        ...

    def null_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """The unconditional rows for classifier-free guidance, same shape as `cond`."""
        ...

    def new_cache(self, batch_size: int) -> Any:
        """An empty KV cache for `batch_size` rows, sized for condition + image tokens."""
        ...

    def prefill(self, cond: torch.Tensor, cache: Any) -> torch.Tensor:
        """Run the condition `[B, L]` into `cache`; return logits `[B, K]` of image token 0."""
        ...

    def decode(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        """Append image tokens `[B]` (codebook ids) to `cache`; return logits `[B, K]` of the next."""
        ...

    def image_logits(self, cond: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits `[B, N, K]` for image tokens `[B, N]`, one forward pass, with grad."""
        ...

    def forward(self, cond: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """`image_logits`: training calls the module itself, so that DDP's and FSDP's hooks run."""
        ...


def unknown_words(policy, prompt: str) -> list[str]:
    """The words of `prompt` that `policy` cannot read; none for a policy that reads any text."""
    check = getattr(policy, "unknown_words", None)
    return check(prompt) if check is not None else []


def prompt_problem(policy, prompt: str) -> str | None:
    """Why `policy` cannot read `prompt` (too long, unknown words), or None when it can."""
    try:
        policy.encode_prompts([prompt])
    except ValueError as e:  # e.g. more words than the policy's caption length
        return str(e)
    unknown = unknown_words(policy, prompt)
    if not unknown:
        return None
    vocabulary = getattr(policy, "caption_words", None) or []
    more = " ..." if len(vocabulary) > 60 else ""  # a long vocabulary is cut short in the message
    shown = f" (its vocabulary: {' '.join(vocabulary[:60])}{more})" if vocabulary else ""
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""  # a 10 MB line of unknown words: a few
    return f"words the policy does not know: {', '.join(map(brief, unknown[:5]))}{more}{shown}"


def check_prompts(policy, prompts: Iterable[tuple[str, str]]) -> None:
    """PromptsError for the first of `prompts`, (where it comes from, prompt) pairs, that `policy` cannot
    read: what `train` refuses (words it would read as unknown, more words than it takes) the commands
    that sample a run refuse too, naming the file and line."""
    for where, prompt in prompts:
        problem = prompt_problem(policy, prompt)
        if problem:
            raise PromptsError(f"{where}: {problem}")
