"""The first half of a step, one copy for training and every measurement: prompt entries x n images drawn on
given seeds, decoded, scored by every reward and judged; and the paired comparison of two models on the same
seeds that `eval`, the report, its sample grids, GenEval's benchmark, the demo and the matrix summarise.

    samples = draw(policy, tokenizer, repeat(entries, n), seeds, params, batch_size)   # Samples, [E*n] rows
    scored = score(rewards, samples.images, samples.entries, judge)                    # Scored, the same rows
    paired = compare(policy, reference, tokenizer, entries, n, params, seed, rewards, judge)

Rows are entry-major: an entry's n images are contiguous (a training step's groups, `[B, G]` when reshaped).
Every eval image's seed comes from `eval_seeds`; a training step's from seeds.py. Rewards and the reference are
duck-typed (a `CompositeReward`, a `Reference`): this module sits in the core, below both.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from grpo_vision.config import EVAL_SEED, MAX_SEED, ConfigError
from grpo_vision.grpo import k3_kl
from grpo_vision.prompts import PromptEntry
from grpo_vision.sampling import Plan, Rollout, SamplingParams, batched_logprobs, sample_batched, sample_plan

if TYPE_CHECKING:
    from grpo_vision.policy import Judge


def eval_seeds(prompts: int, n: int, seed: int = EVAL_SEED) -> list[int]:
    """The seeds of `n` images of each of `prompts` prompts: image j of prompt i uses seed + 1000 i + j, the
    same for every model scored, so a repeated prompt gets fresh images and each pair is comparable."""
    return [seed + 1000 * i + j for i in range(prompts) for j in range(n)]


def check_seeds(seed: int, prompts: int, n: int) -> None:
    """ConfigError naming --seed when the last of `eval_seeds(prompts, n, seed)` is past MAX_SEED (`sample`
    and the benchmark folders draw `eval_seeds(1, n, seed)` for every prompt: image j, seed + j)."""
    span = eval_seeds(max(prompts, 1), n, seed=0)[-1]  # the last image's offset: one seed rule, eval_seeds's
    if seed + span > MAX_SEED:
        raise ConfigError(f"--seed {seed}: the last image would get seed {seed + span}, past the largest seed, "
                          f"{MAX_SEED}; use --seed {max(0, MAX_SEED - span)} or less")


def repeat(entries: Sequence[PromptEntry], n: int) -> list[PromptEntry]:
    """Each entry `n` times in turn: the rows of its n images (a training step's group)."""
    return [e for e in entries for _ in range(n)]


@torch.no_grad()
def decode_images(tokenizer, tokens: torch.Tensor, batch_size: int, device=None) -> torch.Tensor:
    """Images `[n, 3, H, W]` in [0, 1] of image tokens `[n, N]`, `batch_size` rows a tokenizer call, each call on
    `device` (default: the tokens'); the images come back on the tokens' device (a replay buffer's on the CPU)."""
    return torch.cat([tokenizer.decode(tokens[i:i + batch_size].to(device or tokens.device)).to(tokens.device)
                      for i in range(0, len(tokens), batch_size)])


@dataclass
class Samples:  # images drawn for prompt entries, one row each, an entry's images contiguous
    entries: list[PromptEntry]  # [n] each image's prompt entry
    seeds: list[int]  # [n] each image's sampling seed
    cond: torch.Tensor  # [n, L] condition ids
    rollout: Rollout  # tokens, log-probs and entropy [n, N] each
    images: torch.Tensor  # [n, 3, H, W] decoded, in [0, 1]

    def select(self, rows: torch.Tensor) -> "Samples":
        """The rows `rows` (an index tensor), every field kept (a subclass's own fields as they are)."""
        idx = rows.tolist()
        return dataclasses.replace(self, entries=[self.entries[i] for i in idx], seeds=[self.seeds[i] for i in idx],
                                   cond=self.cond[rows.to(self.cond.device)], rollout=self.rollout.select(rows),
                                   images=self.images[rows.to(self.images.device)])

    @staticmethod
    def cat(parts: Sequence["Samples"], policy=None) -> "Samples":
        """The rows of `parts` in order (the first part's other fields). Condition ids of several widths (a kind
        that pads each batch to its longest prompt, as Janus does) are made again by `policy` for every row: the
        same ids, padded to the widest (with plans: the plans' input ids too)."""
        entries = [e for p in parts for e in p.entries]
        rollout = Rollout.cat([p.rollout for p in parts], getattr(policy, "encode_plan_prompts", None))
        if len({p.cond.shape[1] for p in parts}) == 1:
            cond = torch.cat([p.cond for p in parts])
        elif policy is None:
            raise ValueError("the samplings' condition ids differ in width: pass the policy")
        else:
            cond = image_condition(policy, [e.prompt for e in entries], rollout.plan)
        return dataclasses.replace(parts[0], entries=entries, seeds=[s for p in parts for s in p.seeds], cond=cond,
                                   rollout=rollout, images=torch.cat([p.images for p in parts]))


@dataclass
class Scored:  # every reward and the judge on a set of images (training: every process's, gathered)
    total: torch.Tensor  # [n] the weighted total (NaN where no reward applies)
    raw: dict[str, torch.Tensor]  # reward name -> [n] its unweighted values (NaN: does not apply)
    weights: dict[str, torch.Tensor]  # reward name -> [n] its weight for each image
    reasons: dict[str, list] = field(default_factory=dict)  # reward name -> per image [(kind, text)], if it gives any
    verdicts: list = field(default_factory=list)  # [n] the judge's verdicts (None each without a judge)
    notes: dict[str, str] = field(default_factory=dict)  # `score(tolerant=True)`: reward name -> why it has no score
    plan_verdicts: list = field(default_factory=list)  # [n] the judge's verdicts on each image's plan (with plans)

    def select(self, rows: torch.Tensor) -> "Scored":
        """The images `rows` (an index tensor), every field kept (`notes` are about rewards, not rows)."""
        idx = rows.tolist()
        pick = lambda x: x[rows.to(x.device)]  # noqa: E731
        listed = lambda xs: [xs[i] for i in idx] if xs else []  # noqa: E731  (no plans: no plan verdicts)
        return Scored(pick(self.total), {k: pick(v) for k, v in self.raw.items()},
                      {k: pick(v) for k, v in self.weights.items()}, {k: listed(v) for k, v in self.reasons.items()},
                      listed(self.verdicts), dict(self.notes), listed(self.plan_verdicts))

    @staticmethod
    def cat(parts: Sequence["Scored"]) -> "Scored":
        """The images of `parts` in order, every field kept (the notes of all)."""
        first = parts[0]
        return Scored(torch.cat([p.total for p in parts]), {k: torch.cat([p.raw[k] for p in parts]) for k in first.raw},
                      {k: torch.cat([p.weights[k] for p in parts]) for k in first.weights},
                      {k: [x for p in parts for x in p.reasons[k]] for k in first.reasons},
                      [v for p in parts for v in p.verdicts], {k: v for p in parts for k, v in p.notes.items()},
                      [v for p in parts for v in p.plan_verdicts])


def image_condition(policy, prompts: Sequence[str], plan: Plan) -> torch.Tensor:
    """The image stage's condition rows `[n, L]` of `prompts` and their `plan` (T = 0: the prompts alone)."""
    if not plan.width:
        return policy.encode_prompts(list(prompts))
    return policy.plan_condition(list(prompts), plan.token_lists(policy.plan_end_id))


def condition(policy, prompts: Sequence[str], seeds: Sequence[int], params: SamplingParams,
              batch_size: int) -> tuple[torch.Tensor, Plan]:
    """The image stage's condition rows `[n, L]` for `prompts`, and their text plans: with `params.plan` the plan is
    drawn first (row i from `seeds[i]`) and the image is conditioned on the prompt and its plan; else an empty plan
    segment (T = 0). The one place the text stage is drawn or not."""
    if params.plan is None:
        cond = policy.encode_prompts(list(prompts))  # [n, L]
        return cond, Plan.empty(len(prompts), cond.device)
    plan = Plan.cat([sample_plan(policy, prompts[i:i + batch_size], seeds[i:i + batch_size], params.plan)
                     for i in range(0, len(prompts), batch_size)], policy.encode_plan_prompts)
    return image_condition(policy, prompts, plan), plan  # [n, L']


def draw(policy, tokenizer, entries: Sequence[PromptEntry], seeds: Sequence[int], params: SamplingParams,
         batch_size: int, timer=None) -> Samples:
    """`policy`'s images for `entries`, row i from `seeds[i]`, decoded: the one place a rollout is drawn (the
    sampler owns the distribution), under bf16 autocast where `params.mixed_precision` says so (training's
    sample.mixed_precision, so that every measurement draws as training does). `timer`: a run/metrics.PhaseTimer
    that times the VQ decoding as its own phase."""
    prompts, seeds = [e.prompt for e in entries], list(seeds)
    device = next(iter(policy.parameters())).device if isinstance(policy, torch.nn.Module) else None
    with torch.autocast(getattr(device, "type", "cpu"), torch.bfloat16, enabled=params.mixed_precision == "bf16",
                        cache_enabled=False):  # no cast cache: a CUDA graph must record the casts
        cond, plan = condition(policy, prompts, seeds, params, batch_size)
        rollout = sample_batched(policy, cond, seeds, params, batch_size)
        rollout.plan = plan
    with timer("decode") if timer is not None else nullcontext():
        images = decode_images(tokenizer, rollout.tokens, batch_size)  # [n, 3, H, W]
    return Samples(list(entries), list(seeds), cond, rollout, images)


def score(rewards, images: torch.Tensor, entries: Sequence[PromptEntry], judge: Judge | None = None,
          tolerant: bool = False, plans: Sequence[str] | None = None) -> Scored:
    """Every reward of `rewards` (a CompositeReward; None: no reward) on `images` of `entries` (their own
    reward weights included), and `judge`'s verdicts when given; with the images' `plans`, a judge that checks
    plans (`plan_verdicts`, ShapesWorld's) judges them against their prompts too, and each reward finds its image's
    plan as `metadata["plan"]` (GoT-R1's plan-image reward reads it: `shapes_plan_layout`). `tolerant` (the demo):
    a reward that fails scores NaN, with a note saying why, instead of stopping everything."""
    prompts = [e.prompt for e in entries]
    verdicts = judge.verdicts(images, prompts) if judge is not None else [None] * len(prompts)
    check_plans = getattr(judge, "plan_verdicts", None) if plans is not None else None
    plan_verdicts = check_plans(list(plans), prompts) if check_plans is not None else []
    if rewards is None:
        return Scored(torch.full((len(prompts),), float("nan")), {}, {}, {}, verdicts, plan_verdicts=plan_verdicts)
    metadata = [e.metadata for e in entries]
    if plans is not None:  # a copy per image: the entries' own metadata stays as it is
        metadata = [{**m, "plan": plan} for m, plan in zip(metadata, plans, strict=True)]
    out = rewards(images, prompts, metadata, [e.rewards for e in entries], tolerant=tolerant)
    return Scored(out.total, out.raw, out.weights, out.reasons, verdicts, out.notes, plan_verdicts)


def plan_texts(samples: Samples) -> list[str] | None:
    """Each image's plan as text, or None for rollouts without a text stage."""
    return samples.rollout.plan.texts if samples.rollout.plan.width else None


def group_diversity(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """`[E]`: for each run of `n` rows (an entry's images, a step's group), the mean over its pairs of images of the
    fraction of token positions where they differ (0: n copies of one image; NaN for n < 2). Image-only GRPO
    narrows a group (T2I-R1's Table 4: Vendi 6.98 -> 6.26); the text stage is credited with widening it."""
    E = tokens.shape[0] // n
    if n < 2:
        return torch.full((E,), float("nan"))
    t = tokens.reshape(E, n, -1)  # [E, n, N]
    differ = (t[:, :, None, :] != t[:, None, :, :]).float().mean(-1)  # [E, n, n]
    off = ~torch.eye(n, dtype=torch.bool, device=tokens.device)
    return differ[:, off].mean(1).cpu()  # [E]


def verdict_rates(verdicts: Sequence[dict | None], keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Per key ("correct" and each attribute): [n] 1 / 0 per image, NaN where the attribute does not
    apply or the judge cannot read the prompt; the judge's rates on the training rollouts
    (`judge/<key>` in the metrics) and the matrix's are their means."""
    return {k: torch.tensor([float("nan") if v is None or v.get(k) is None else float(v[k]) for v in verdicts])
            for k in keys}


def kl_to(reference, samples: Samples, params: SamplingParams, batch_size: int) -> torch.Tensor:
    """The mean per-token k3 KL `[n]` of each image's sampling distribution to `reference` (a policy), on the
    image's own tokens: grpo.k3_kl, the estimator training logs."""
    image = samples.rollout.image_only()
    return k3_kl(image.logprobs, batched_logprobs(reference, samples.cond, image, params, batch_size)).mean(1)


@dataclass
class Paired:  # two models on the same entries and seeds (row i of both: the same prompt and seed)
    n: int  # images per entry (its rows are contiguous)
    entries: list[PromptEntry]  # [E*n] each row's entry
    seeds: list[int]  # [E*n]
    policy: Scored
    reference: Scored
    images: dict[str, torch.Tensor]  # "policy" / "reference" -> [E*n, 3, H, W]
    entropy: dict[str, torch.Tensor]  # the same keys -> [E*n] mean per-token sampling entropy
    plans: dict[str, list[str] | None] = field(default_factory=dict)  # the same keys -> [E*n] each image's plan

    @property
    def prompts(self) -> list[str]:
        return [e.prompt for e in self.entries]


def compare(policy, reference, tokenizer, entries: Sequence[PromptEntry], n: int, params: SamplingParams,
            seed: int, rewards, judge: Judge | None = None, batch_size: int = 64) -> Paired:
    """`policy` and its `reference` (a Reference: its sampler is the reference model, or the base) each draw
    `n` images of every entry on the same seeds (`eval_seeds`), scored and judged alike."""
    rows, seeds = repeat(entries, n), eval_seeds(len(entries), n, seed)
    ref_model, ref_ctx = reference.sampler(policy)
    scored, images, entropy, plans = {}, {}, {}, {}
    for name, model, ctx in (("policy", policy, nullcontext()), ("reference", ref_model, ref_ctx)):
        with ctx, torch.no_grad():
            samples = draw(model, tokenizer, rows, seeds, params, batch_size)
        plans[name] = plan_texts(samples)
        scored[name] = score(rewards, samples.images, rows, judge, plans=plans[name])
        images[name], entropy[name] = samples.images, samples.rollout.entropy.mean(1)
    return Paired(n, rows, seeds, scored["policy"], scored["reference"], images, entropy, plans)
