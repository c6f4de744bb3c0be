"""`clip_refit`: a CLIP reward that learns between the iterations of iterative RL (train.iterations).

It scores as `clip` does (the cosine of open_clip's image and caption embeddings) but owns its copy
of the CLIP, and at each iteration boundary `update(images, prompts, metadata, labels)` re-fits it
on the policy's own samples, as DeepSeekMath retrains its reward model (Shao et al. 2024, arXiv
2402.03300, section 4.2). The labels are a judge's verdicts: for each prompt, the images the judge
accepts must score above those it rejects, so a caption the judge says is wrong for an image is that
image's hard negative (NegCLIP's idea, Yuksekgonul et al. 2023, with the judge's verdicts in place of
hand-made caption edits). GRPO's advantages only compare images of one prompt, so the loss is a
pairwise logistic loss on exactly those comparisons, at CLIP's own temperature.

    reward.weights: {clip_refit: 1.0}
    reward.options.clip_refit: {model: ..., checkpoint: ..., lr: 1.0e-5, epochs: 2}

The model stays in eval mode while it learns (BatchNorm statistics of the ResNet towers frozen), and
each update is deterministic in (seed, update count): a resumed run re-fits exactly as a straight one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from grpo_vision.rewards.clip import clip_scores, image_embeddings, load_clip
from grpo_vision.config import ConfigError
from grpo_vision.rewards.base import RewardContext, RewardFn, batched, register_reward
from grpo_vision.rewards.models import _clip_spec


@dataclass
class ClipRefitOptions:
    model: str = ""  # open_clip architecture or JSON config path, as reward.options.clip.model
    checkpoint: str = ""  # the starting weights, as reward.options.clip.checkpoint
    trust_torchscript: bool = False  # as reward.options.clip.trust_torchscript
    lr: float = 1.0e-5  # AdamW learning rate of each re-fit (a fresh optimizer per boundary)
    epochs: int = 2  # passes over the update set per boundary
    batch_prompts: int = 8  # prompts per optimizer step, each with all of its images in the update set
    seed: int = 0  # the order of prompts in each pass: seeded by (seed, update count)


def pairwise_loss(scores: torch.Tensor, groups: torch.Tensor, correct: torch.Tensor,
                  scale: float | torch.Tensor) -> tuple[torch.Tensor | None, float, int]:
    """Mean softplus(scale * (s_wrong - s_right)) over the pairs of one group (one prompt) in which the
    judge accepts the first image and rejects the second; (loss or None without pairs, the fraction of
    pairs already ordered right, the number of pairs). scores, groups `[N]`; correct `[N]` bool."""
    same = groups[:, None] == groups[None, :]  # [N, N]
    pairs = same & correct[:, None] & ~correct[None, :]  # [i right, j wrong]
    n = int(pairs.sum())
    if n == 0:
        return None, math.nan, 0
    margin = (scores[None, :] - scores[:, None])[pairs]  # s_wrong - s_right, [n]
    return F.softplus(scale * margin).mean(), (margin < 0).float().mean().item(), n


def _judged(labels: Sequence[dict | None]) -> list[int]:
    """Indices of samples the judge gave a verdict on."""
    return [i for i, v in enumerate(labels) if v is not None and v.get("correct") is not None]


class ClipRefit:
    """The reward `clip_refit` builds: callable as a reward, with the methods of one that learns."""

    needs_judge = True  # update() learns from the judge's verdicts: a run without a judge is refused

    def __init__(self, name: str, checkpoint: str, opts: ClipRefitOptions, ctx: RewardContext):
        self.name, self.checkpoint, self.opts = name, checkpoint, opts
        self.device = str(ctx.device)
        self.updates = 0  # re-fits so far: with opts.seed, what each re-fit's shuffling is seeded by
        self.model = self.tokenizer = None
        self._score = batched(self._scores, ctx.batch_size, ctx.device)  # chunks on the device, CPU results

    def load(self):
        """Its own CLIP, loaded once: not the cached CLIP of `clip` and `aesthetic`, since this one changes."""
        if self.model is None:
            self.model, _, self.tokenizer = load_clip(self.name, self.checkpoint, device=self.device,
                                                      trust_torchscript=self.opts.trust_torchscript)
        return self.model

    def _scores(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        self.load()
        return clip_scores(self.model, self.tokenizer, images.float(), prompts)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        return self._score(images, prompts, metadata)

    def update(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict],
               labels: Sequence[dict | None]) -> dict[str, float]:
        """Re-fit on the judged samples: `opts.epochs` passes over the prompts with both accepted and
        rejected images, `opts.batch_prompts` prompts an AdamW step; pair accuracy before and after."""
        keep = _judged(labels)
        if not keep:
            raise ValueError("no sample has a judge's verdict: clip_refit learns from a judge (the policy kind's "
                             "Bundle.judge), and got none")
        images, prompts = images[keep], [prompts[i] for i in keep]
        correct = torch.tensor([bool(labels[i]["correct"]) for i in keep])
        index = {p: k for k, p in enumerate(dict.fromkeys(prompts))}
        groups = torch.tensor([index[p] for p in prompts])
        # prompts with both kinds of image: the only ones that give pairs
        mixed = [k for k in range(len(index)) if 0 < correct[groups == k].sum() < (groups == k).sum()]
        _, before, pairs = pairwise_loss(self(images, prompts, []), groups, correct, 1.0)
        out = {"samples": float(len(keep)), "judged_right": correct.float().mean().item(), "pairs": float(pairs),
               "pair_acc_before": before}
        losses = self._fit(images, prompts, groups, correct, mixed) if mixed else []
        self.updates += 1
        after = pairwise_loss(self(images, prompts, []), groups, correct, 1.0)[1] if mixed else before
        return out | {"pair_acc_after": after, "loss": sum(losses) / len(losses) if losses else math.nan}

    def _fit(self, images, prompts, groups, correct, mixed: list[int]) -> list[float]:
        model, opts = self.load(), self.opts
        gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + self.updates)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opts.lr, weight_decay=0.0)
        losses = []
        for _ in range(opts.epochs):
            order = torch.tensor(mixed)[torch.randperm(len(mixed), generator=gen)]
            for start in range(0, len(order), opts.batch_prompts):
                rows = torch.isin(groups, order[start:start + opts.batch_prompts]).nonzero().flatten()
                with torch.enable_grad():
                    img = image_embeddings(model, images[rows].to(self.device).float())  # [b, D]
                    text = self.tokenizer([prompts[i] for i in rows.tolist()]).to(self.device)
                    txt = model.encode_text(text, normalize=True)  # [b, D]
                    loss, _, _ = pairwise_loss((img * txt).sum(-1), groups[rows].to(self.device),
                                               correct[rows].to(self.device), model.logit_scale.exp().detach())
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                optimizer.step()
                losses.append(loss.item())
        return losses

    def state_dict(self) -> dict:
        state = {"updates": self.updates}
        if self.updates:  # before the first re-fit the weights are the checkpoint file's
            state["weights"] = {k: v.detach().cpu() for k, v in self.load().state_dict().items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        if "weights" in state:
            self.load().load_state_dict(state["weights"])
        else:  # not re-fitted yet: the checkpoint file's weights, whatever a failed re-fit left in memory
            self.model = None


@register_reward("clip_refit", options=ClipRefitOptions)
def clip_refit_reward(ctx: RewardContext, opts: ClipRefitOptions) -> RewardFn:
    """The `clip` cosine from a CLIP of its own, re-fitted on judged samples between iterations."""
    keys = ("reward.options.clip_refit.model", "reward.options.clip_refit.checkpoint")
    name, checkpoint = _clip_spec(opts.model, opts.checkpoint, keys, "clip_refit")
    for key, ok in (("lr", 0 < opts.lr <= 1), ("epochs", opts.epochs >= 1), ("batch_prompts", opts.batch_prompts >= 1)):
        if not ok:
            raise ConfigError(f"reward.options.clip_refit.{key} must be {'in (0, 1]' if key == 'lr' else '>= 1'}, "
                              f"got {getattr(opts, key)}")
    return ClipRefit(name, checkpoint, opts, ctx)
