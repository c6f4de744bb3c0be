"""Iterative RL (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300, section 4.2 and Algorithm 1).

`train.iterations = K` splits the run's `train.steps` into K equal iterations. At each boundary:

1. the reference becomes the current policy (a frozen copy is overwritten; an adapter is folded
   into the base weights and starts again from zero: grpo_vision/step/reference.py), so the KL term anchors the
   next iteration to where this one ended;
2. every reward that can learn (`update`, rewards/composite.py) is updated on the policy's own
   samples of the iteration just ended, plus earlier samples replayed as `reward.replay_fraction`
   of the update set (DeepSeekMath: "a replay mechanism that incorporates 10% of historical data").
   The labels are the judge's verdicts on the samples (None without a judge).

Samples are kept as the policy's image tokens (a few hundred integers each, where an image is tens of
kilobytes) with their prompt entries; images and labels are made from them at the boundary. Every
process keeps the whole step's samples (tokens are gathered), so every process updates its rewards
identically, and the buffer is part of every checkpoint: a resumed run updates on the same samples.
The optimizer, the LR schedule and the step count run on across boundaries.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import torch

from grpo_vision.prompts import PromptEntry
from grpo_vision.rollouts import decode_images


def iteration_of(step: int, steps: int, iterations: int) -> int:
    """The 0-based iteration that 0-based `step` belongs to (config checks that iterations divide steps)."""
    return step // (steps // iterations)


def starts_iteration(step: int, steps: int, iterations: int) -> bool:
    """True when 0-based `step` begins an iteration other than the first: the boundary runs before it,
    so a checkpoint taken at the end of the previous step resumes into the boundary."""
    return iterations > 1 and 0 < step < steps and step % (steps // iterations) == 0


def replay_count(fresh: int, fraction: float, available: int) -> int:
    """How many earlier samples to replay beside `fresh` new ones so that they are `fraction` of the
    update set: fraction / (1 - fraction) * fresh, rounded, at most `available`."""
    return min(available, round(fraction / (1 - fraction) * fresh))


class ReplayBuffer:
    """The samples of the iteration under way, and a capped, random subset of earlier iterations'."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.iteration = 0  # boundaries passed: a checkpoint taken after a boundary must not run it again
        self.tokens: list[torch.Tensor] = []  # this iteration's, one [n, N] tensor per step
        self.entries: list[PromptEntry] = []  # their prompt entries, one per row
        self.past_tokens = torch.zeros(0, 0, dtype=torch.long)  # [M, N] earlier iterations'
        self.past_entries: list[PromptEntry] = []

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, tokens: torch.Tensor, entries: list[PromptEntry]) -> None:
        """A step's image tokens `[n, N]` (every process's, in global order) and their prompt entries."""
        if tokens.shape[0] != len(entries):
            raise ValueError(f"{tokens.shape[0]} token rows for {len(entries)} prompt entries")
        self.tokens.append(tokens.detach().cpu())
        self.entries += entries

    def update_set(self, fraction: float, rng: np.random.Generator) -> tuple[torch.Tensor, list[PromptEntry], int]:
        """(tokens, entries, replayed): this iteration's samples, then `replayed` earlier ones drawn by
        `rng` so that they are `fraction` of the set. Changes nothing: `next_iteration` does."""
        fresh = self._fresh()
        k = replay_count(len(self.entries), fraction, len(self.past_entries))
        if not k:
            return fresh, list(self.entries), 0
        pick = np.sort(rng.choice(len(self.past_entries), k, replace=False))
        return (torch.cat([fresh, self.past_tokens[torch.from_numpy(pick)]]),
                self.entries + [self.past_entries[i] for i in pick], k)

    def next_iteration(self, rng: np.random.Generator) -> None:
        """This iteration's samples join the earlier ones, which are cut to `capacity` by a random subset."""
        past_tokens = torch.cat([self.past_tokens, self._fresh()]) if self.past_entries else self._fresh()
        past_entries = self.past_entries + self.entries
        if len(past_entries) > self.capacity:
            keep = np.sort(rng.choice(len(past_entries), self.capacity, replace=False))
            past_tokens, past_entries = past_tokens[torch.from_numpy(keep)], [past_entries[i] for i in keep]
        self.past_tokens, self.past_entries = past_tokens, past_entries
        self.tokens, self.entries = [], []
        self.iteration += 1

    def _fresh(self) -> torch.Tensor:
        return torch.cat(self.tokens) if self.tokens else torch.zeros(0, 0, dtype=torch.long)

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "tokens": self._fresh(), "entries": [asdict(e) for e in self.entries],
                "past_tokens": self.past_tokens, "past_entries": [asdict(e) for e in self.past_entries]}

    def load_state_dict(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
        self.tokens = [state["tokens"]] if len(state["entries"]) else []
        self.entries = [PromptEntry(**e) for e in state["entries"]]
        self.past_tokens, self.past_entries = state["past_tokens"], [PromptEntry(**e) for e in state["past_entries"]]


@torch.no_grad()
def update_rewards(rewards, buffer: ReplayBuffer, tokenizer, judge, fraction: float, rng: np.random.Generator,
                   batch_size: int, device) -> dict[str, float]:
    """Update the learning rewards on the iteration's samples plus replay, then move the buffer on to
    the next iteration; their metrics. A failing update leaves the buffer (and, CompositeReward.update,
    every reward) as it was, so the checkpoint saved on the failure resumes into the same boundary."""
    tokens, entries, replayed = buffer.update_set(fraction, rng)
    images = decode_images(tokenizer, tokens.cpu(), batch_size, device)  # [n, 3, H, W] on the CPU
    prompts = [e.prompt for e in entries]
    labels = judge.verdicts(images, prompts) if judge is not None else [None] * len(entries)
    metrics = rewards.update(images, prompts, [e.metadata for e in entries], labels)
    buffer.next_iteration(rng)
    return metrics | {"iteration/update_samples": float(len(entries)), "iteration/replayed": float(replayed)}
