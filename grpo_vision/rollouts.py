"""The first half of a step, one copy for training and every measurement: prompt entries x n images drawn on
given seeds, decoded, scored by every reward and judged; and the paired comparison of two models on the same
seeds that `eval`, the report, GenEval's benchmark, the demo and the matrix summarise.

    samples = draw(policy, tokenizer, repeat(entries, n), seeds, params, batch_size)   # Samples, [E*n] rows
    scored = score(rewards, samples, judge)                                            # Scored, the same rows
    paired = compare(policy, reference, tokenizer, entries, n, params, seed, rewards, judge)

Rows are entry-major: an entry's n images are contiguous (a training step's groups, `[B, G]` when reshaped).
Every eval image's seed comes from `eval_seeds`. Rewards and the reference are duck-typed (a
`CompositeReward`, a `Reference`): this module sits in the core, below both.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from grpo_vision.config import EVAL_SEED
from grpo_vision.grpo import k3_kl
from grpo_vision.prompts import PromptEntry
from grpo_vision.sampling import Rollout, SamplingParams, batched_logprobs, sample_batched

if TYPE_CHECKING:
    from grpo_vision.policy import Judge


def eval_seeds(prompts: int, n: int, seed: int = EVAL_SEED) -> list[int]:
    """The seeds of `n` images of each of `prompts` prompts: image j of prompt i uses seed + 1000 i + j, the
    same for every model scored, so a repeated prompt gets fresh images and each pair is comparable."""
    return [seed + 1000 * i + j for i in range(prompts) for j in range(n)]


def repeat(entries: Sequence[PromptEntry], n: int) -> list[PromptEntry]:
    """Each entry `n` times in turn: the rows of its n images (a training step's group)."""
    return [e for e in entries for _ in range(n)]


@torch.no_grad()
def decode_images(tokenizer, tokens: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Images `[n, 3, H, W]` in [0, 1] of image tokens `[n, N]`, `batch_size` rows a tokenizer call."""
    return torch.cat([tokenizer.decode(tokens[i:i + batch_size]) for i in range(0, len(tokens), batch_size)])


@dataclass
class Samples:  # images drawn for prompt entries, one row each, an entry's images contiguous
    entries: list[PromptEntry]  # [n] each image's prompt entry
    seeds: list[int]  # [n] each image's sampling seed
    cond: torch.Tensor  # [n, L] condition ids
    rollout: Rollout  # tokens, log-probs and entropy [n, N] each
    images: torch.Tensor  # [n, 3, H, W] decoded, in [0, 1]
    chosen: np.ndarray | None = None  # training: the step's prompt indices [B] (every process: the same)
    rows: slice | None = None  # training: these rows among the step's B*G, in group order


@dataclass
class Scored:  # every reward and the judge on a set of images (training: every process's, gathered)
    total: torch.Tensor  # [n] the weighted total (NaN where no reward applies)
    raw: dict[str, torch.Tensor]  # reward name -> [n] its unweighted values (NaN: does not apply)
    weights: dict[str, torch.Tensor]  # reward name -> [n] its weight for each image
    reasons: dict[str, list] = field(default_factory=dict)  # reward name -> per image [(kind, text)], if it gives any
    verdicts: list = field(default_factory=list)  # [n] the judge's verdicts (None each without a judge)
    judged: dict[str, torch.Tensor] = field(default_factory=dict)  # judge key -> [n] 1 / 0 (NaN: n/a); training
    spread: float = float("nan")  # training: the fraction of groups whose total has no spread


def sample_rows(policy, entries: Sequence[PromptEntry], seeds: Sequence[int], params: SamplingParams,
                batch_size: int, autocast_bf16: bool = False) -> tuple[torch.Tensor, Rollout]:
    """(condition ids `[n, L]`, rollout `[n, N]`) of `policy` for `entries`, row i from `seeds[i]`: the one place
    a rollout is drawn (the sampler owns the distribution). `autocast_bf16`: under bf16 autocast
    (sample.mixed_precision)."""
    cond = policy.encode_prompts([e.prompt for e in entries])  # [n, L]
    with torch.autocast(cond.device.type, torch.bfloat16, enabled=autocast_bf16,
                        cache_enabled=False):  # no cast cache: a CUDA graph must record the casts
        return cond, sample_batched(policy, cond, list(seeds), params, batch_size)


def draw(policy, tokenizer, entries: list[PromptEntry], seeds: Sequence[int], params: SamplingParams,
         batch_size: int) -> Samples:
    """`policy`'s images for `entries`, row i from `seeds[i]`, decoded."""
    cond, rollout = sample_rows(policy, entries, seeds, params, batch_size)
    return Samples(list(entries), list(seeds), cond, rollout, decode_images(tokenizer, rollout.tokens, batch_size))


def score(rewards, images: torch.Tensor, entries: Sequence[PromptEntry], judge: Judge | None = None) -> Scored:
    """Every reward of `rewards` (a CompositeReward; None: no reward) on `images` of `entries` (their own
    reward weights included), and `judge`'s verdicts when given."""
    prompts = [e.prompt for e in entries]
    verdicts = judge.verdicts(images, prompts) if judge is not None else [None] * len(prompts)
    if rewards is None:
        return Scored(torch.full((len(prompts),), float("nan")), {}, {}, {}, verdicts)
    out = rewards(images, prompts, [e.metadata for e in entries], [e.rewards for e in entries])
    return Scored(out.total, out.raw, out.weights, out.reasons, verdicts)


def take_groups(parts: Sequence[tuple[Samples, Scored]], picks: Sequence[tuple[int, int]], group_size: int,
                encode=None) -> tuple[Samples, Scored]:
    """The groups `picks` ((part, group) each, in order) of several samplings with their scores, as one: the
    step's batch after train.zero_std_groups=resample replaced its flat groups. One process's whole groups.
    Condition ids of several widths (a kind that pads each batch to its longest prompt, as Janus does) are
    made again by `encode` (the policy's `encode_prompts`) for the picked prompts together: the same ids,
    padded to the widest."""
    offsets = np.cumsum([0] + [len(p[0].entries) for p in parts])
    rows = [int(offsets[i]) + g * group_size + j for i, g in picks for j in range(group_size)]
    index = torch.tensor(rows, dtype=torch.long)

    def cat(get):  # every part's tensor, the picked rows
        whole = torch.cat([get(p) for p in parts])
        return whole[index.to(whole.device)]

    def listed(get):
        whole = [x for p in parts for x in get(p)]
        return [whole[r] for r in rows]

    a, b = parts[0]
    rollout = Rollout(*(cat(lambda p, f=f: getattr(p[0].rollout, f)) for f in ("tokens", "logprobs", "entropy")))
    entries = listed(lambda p: p[0].entries)
    if len({p[0].cond.shape[1] for p in parts}) == 1:
        cond = cat(lambda p: p[0].cond)
    elif encode is None:
        raise ValueError("the samplings' condition ids differ in width: pass the policy's encode_prompts")
    else:
        cond = encode([e.prompt for e in entries])
    samples = Samples(entries, listed(lambda p: p[0].seeds), cond, rollout,
                      cat(lambda p: p[0].images),
                      None if a.chosen is None else np.array([parts[i][0].chosen[g] for i, g in picks]),
                      slice(0, len(rows)))
    scored = Scored(cat(lambda p: p[1].total), {k: cat(lambda p, k=k: p[1].raw[k]) for k in b.raw},
                    {k: cat(lambda p, k=k: p[1].weights[k]) for k in b.weights},
                    {k: listed(lambda p, k=k: p[1].reasons[k]) for k in b.reasons}, listed(lambda p: p[1].verdicts),
                    {k: cat(lambda p, k=k: p[1].judged[k]) for k in b.judged}, b.spread)
    return samples, scored


def kl_to(reference, samples: Samples, params: SamplingParams, batch_size: int) -> torch.Tensor:
    """The mean per-token k3 KL `[n]` of each image's sampling distribution to `reference` (a policy), on the
    image's own tokens: grpo.k3_kl, the estimator training logs."""
    ref = batched_logprobs(reference, samples.cond, samples.rollout.tokens, params, batch_size)
    return k3_kl(samples.rollout.logprobs, ref).mean(1)


@dataclass
class Paired:  # two models on the same entries and seeds (row i of both: the same prompt and seed)
    entries: list[PromptEntry]  # [E*n] each row's entry
    seeds: list[int]  # [E*n]
    policy: Scored
    reference: Scored
    images: dict[str, torch.Tensor]  # "policy" / "reference" -> [E*n, 3, H, W]
    entropy: dict[str, torch.Tensor]  # the same keys -> [E*n] mean per-token sampling entropy

    @property
    def prompts(self) -> list[str]:
        return [e.prompt for e in self.entries]


def compare(policy, reference, tokenizer, entries: Sequence[PromptEntry], n: int, params: SamplingParams,
            seed: int, rewards, judge: Judge | None = None, batch_size: int = 64) -> Paired:
    """`policy` and its `reference` (a Reference: its sampler is the reference model, or the base) each draw
    `n` images of every entry on the same seeds (`eval_seeds`), scored and judged alike."""
    rows, seeds = repeat(entries, n), eval_seeds(len(entries), n, seed)
    ref_model, ref_ctx = reference.sampler(policy)
    scored, images, entropy = {}, {}, {}
    for name, model, ctx in (("policy", policy, nullcontext()), ("reference", ref_model, ref_ctx)):
        with ctx, torch.no_grad():
            samples = draw(model, tokenizer, rows, seeds, params, batch_size)
        scored[name] = score(rewards, samples.images, rows, judge)
        images[name], entropy[name] = samples.images, samples.rollout.entropy.mean(1)
    return Paired(rows, seeds, scored["policy"], scored["reference"], images, entropy)
