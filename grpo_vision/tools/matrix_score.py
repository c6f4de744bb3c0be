"""Scoring for `grpo-vision matrix`: the reference once, then every run, on the same prompts and seeds.

For each scored set (test prompts, the headline; held-out compositions, the transfer row; a sample of
the training prompts) and each model, per image: every reward (the rows' train rewards and the
config's monitors), the judge's verdicts, the mean per-token entropy of the sampling distribution and
the mean per-token k3 KL to the reference (Schulman's estimator, as in training); per prompt: the
diversity of its images, the mean pairwise cosine distance of their CLIP image embeddings (pixels
when no CLIP is configured). Changes against the reference are paired (image i of prompt p has the
same seed in both); their 95% intervals resample the captions within each prompt form
(intervals.py), and runs that differ only in their seed pool into a mean whose interval resamples the
seeds too. Per-model scores are cached in `OUT/scores/`, keyed by the checkpoint step and the eval
settings, so a second invocation scores only what changed. Each model's sampled tokens are kept beside
its scores, so a later call that watches another reward decodes and scores them with it instead of
sampling every model again (the sampling and the reference's log-probs are most of a model's scoring).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from grpo_vision.evaluation.evaluate import eval_params
from grpo_vision.files import write_file
from grpo_vision.images import to_uint8
from grpo_vision.evaluation.intervals import caption_interval
from grpo_vision.run.metrics import interval
from grpo_vision.policy import load_bundle
from grpo_vision.splits import prompt_lists
from grpo_vision.step.load import load_run
from grpo_vision.run.machine import resolve_device
from grpo_vision.rewards import CompositeReward, RunModels
from grpo_vision.rollouts import (
    EVAL_SEED, decode_images, draw, eval_seeds, kl_to, plan_texts, repeat, score, verdict_rates,
)
STRIP_PROMPTS = 8  # prompts in a run's sample strip: image 0 of each of the first test prompts


class Scorer:
    """Everything shared by every model's scoring: prompts, seeds, rewards, judge, the reference."""

    def __init__(self, cfg, n: int, batch_size: int = 64):
        self.cfg, self.n, self.batch_size = cfg, n, batch_size
        self.device = resolve_device(cfg.run.device)
        self.bundle = load_bundle(cfg.policy, self.device)  # its policy is the base: the reference row
        self.base = self.bundle.policy.eval()
        self.sets = prompt_lists(cfg).scored()
        # per prompt: its caption, and its form (the stratum of the bootstrap over captions)
        self.captions = {k: [e.prompt for e in v] for k, v in self.sets.items()}
        form = self.bundle.judge.form if self.bundle.judge is not None else (lambda p: None)
        self.strata = {k: [form(p) for p in v] for k, v in self.captions.items()}
        self.params = eval_params(cfg)
        self.names = list(dict.fromkeys([*cfg.reward.weights, *cfg.reward.monitor]))
        self.rewards = None
        self.embed = None
        self._composites: dict[tuple[str, ...], CompositeReward] = {}

    def use_rewards(self, names: list[str]) -> None:
        """Score with `names` (the rows' train rewards) besides the config's rewards and monitors."""
        self.names = list(dict.fromkeys([*self.names, *names]))
        self.rewards = self.composite(self.names)
        self.embed, self.embedding = image_embedder({**self.bundle.reward_defaults.get("clip", {}),
                                                     **self.cfg.reward.options.get("clip", {})}, self.device)

    def composite(self, names: list[str]) -> CompositeReward:
        """The rewards `names`, loaded once a call (every model a cache lacks them for shares them), each
        reporting its raw score (weights play no part in scoring)."""
        if tuple(names) not in self._composites:
            reward_cfg = replace(self.cfg.reward, weights={n: 1.0 for n in names}, monitor=[])
            self._composites[tuple(names)] = CompositeReward.from_config(  # a self_judge: the base judges all runs
                reward_cfg, self.device, self.bundle.reward_defaults, models=RunModels.of(self.base)).load()
        return self._composites[tuple(names)]

    def key(self, step: int) -> str:
        """What a cached model's samples depend on besides the weights: settings and prompts (not the
        rewards: a reward missing from a cache is added from its tokens, `add_rewards`)."""
        what = {"step": step, "n": self.n, "seed": EVAL_SEED, "params": repr(self.params),
                "sets": {k: [e.prompt for e in v] for k, v in self.sets.items()}}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    @torch.no_grad()
    def score(self, model) -> tuple[dict, list, dict]:
        """Per-image and per-prompt scores of `model` on every eval set, its strip images and, per set,
        its sampled tokens `[prompts x n, sequence]`."""
        out, strip, sampled = {}, [], {}
        for set_name, entries in self.sets.items():
            samples = draw(model, self.bundle.tokenizer, repeat(entries, self.n), eval_seeds(len(entries), self.n),
                           self.params, self.batch_size)
            scored = score(self.rewards, samples.images, samples.entries, self.bundle.judge, plans=plan_texts(samples))
            kl = kl_to(self.base, samples, self.params, self.batch_size)  # grpo.k3_kl, as training logs it
            sampled[set_name] = samples.rollout.tokens.cpu()
            emb = self.embed(samples.images).reshape(len(entries), self.n, -1)
            verdicts = scored.verdicts if self.bundle.judge else []
            keys = ["correct", *self.bundle.judge.attributes] if verdicts else []
            judge = {} if not verdicts or any(v is None for v in verdicts) else {
                a: _floats(rates) for a, rates in verdict_rates(verdicts, keys).items()}
            if judge:  # all right per prompt form (judge/correct_<form>: NaN on the other forms' images)
                forms = [self.bundle.judge.form(e.prompt) for e in samples.entries]
                judge |= {f"correct_{f}": [c if g == f else None for c, g in zip(judge["correct"], forms)]
                          for f in self.bundle.judge.forms}
            if judge and scored.plan_verdicts:  # the plans against their prompts, as judge/plan_<attribute>
                judge |= {f"plan_{a}": _floats(rates) for a, rates in verdict_rates(scored.plan_verdicts, keys).items()}
            out[set_name] = {"rewards": {k: _floats(v) for k, v in scored.raw.items()}, "judge": judge,
                             "entropy": _floats(samples.rollout.entropy.mean(1)), "kl": _floats(kl),
                             "diversity": _floats(pairwise_distance(emb))}
            if set_name == "test":
                strip = [samples.images[p * self.n] for p in range(min(STRIP_PROMPTS, len(entries)))]
        return out, strip, sampled

    @torch.no_grad()
    def add_rewards(self, scores: dict, tokens: dict, names: list[str]) -> None:
        """Score the images of a model's cached `tokens` with the rewards `names`, into `scores`; the same
        images as sampling gives, so the same values as scoring them with the rest."""
        rewards = self.composite(names)
        for set_name, entries in self.sets.items():
            rows = repeat(entries, self.n)  # the rows' order of score()'s: its images decode alike
            images = decode_images(self.bundle.tokenizer, tokens[set_name].to(self.device), self.batch_size)
            raw = rewards(images, [e.prompt for e in rows], [e.metadata for e in rows]).raw
            scores["sets"][set_name]["rewards"].update({n: _floats(v) for n, v in raw.items()})


def pairwise_distance(emb: torch.Tensor) -> torch.Tensor:
    """Mean cosine distance over the pairs of a prompt's images: `[P, n, D]` -> `[P]` (NaN for n < 2)."""
    P, n, _ = emb.shape
    if n < 2:
        return torch.full((P,), float("nan"))
    e = torch.nn.functional.normalize(emb.float(), dim=-1)
    sim = e @ e.transpose(1, 2)  # [P, n, n]
    off = ~torch.eye(n, dtype=torch.bool)
    return (1 - sim[:, off]).mean(1)


def image_embedder(clip_options: dict, device):
    """(embed(images) -> [B, D], its name): the `clip` reward's CLIP when its files are configured, else
    8x8 average-pooled pixels (a cruder diversity, named so in the tables)."""
    if clip_options.get("checkpoint"):
        from grpo_vision.rewards.models import clip_image_encoder

        encode = clip_image_encoder(clip_options, device)
        return (lambda images: encode(images).cpu()), "CLIP image embeddings"
    pool = torch.nn.functional.adaptive_avg_pool2d
    return (lambda images: pool(images.float(), 8).flatten(1).cpu()), "8x8 pooled pixels"


def _floats(t: torch.Tensor) -> list:
    return [None if math.isnan(x) else round(x, 6) for x in t.double().cpu().tolist()]


def _tensor(values: list) -> torch.Tensor:
    return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64)


def cached_scores(scorer: Scorer, path: Path, step: int, load_model) -> dict:
    """A model's scores from `path` when they were made with the same settings (a reward they lack added
    from the cached tokens), else scored now; with the rewards of this call only."""
    key, tokens_path = scorer.key(step), path.with_suffix(".tokens.pt")
    try:
        cached = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:  # a cache torn or edited by hand is scored again, as unreadable tokens are sampled again
        cached = {}
    if isinstance(cached, dict) and cached.get("key") == key:
        have = set.intersection(*(set(s["rewards"]) for s in cached["sets"].values()))
        missing = [n for n in scorer.names if n not in have]
        if not missing:
            return _with_rewards(cached, scorer.names)
        if (tokens := _load_tokens(tokens_path, key, scorer)) is not None:
            print(f"[matrix] adding {', '.join(missing)} to {path.stem} (from its cached tokens)", flush=True)
            scorer.add_rewards(cached, tokens, missing)
            write_file(path, json.dumps(cached))
            return _with_rewards(cached, scorer.names)
    print(f"[matrix] scoring {path.stem}", flush=True)
    scores, strip, tokens = scorer.score(load_model())
    result = {"key": key, "step": step, "sets": scores}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(tokens_path, lambda f: torch.save({"key": key, "tokens": tokens}, f))
    write_file(path, json.dumps(result))  # atomic, and last: an interrupted scoring leaves no cache
    if strip:
        from PIL import Image

        Image.fromarray(_row(torch.stack(strip))).save(path.with_suffix(".png"))
    return result


def _load_tokens(path: Path, key: str, scorer: Scorer) -> dict | None:
    """A model's cached tokens when they are there, whole and sampled with this call's settings, else None
    (the model is then sampled again)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # absent, torn or foreign: torch's unpickler raises anything from OSError to IndexError
        return None
    tokens = saved.get("tokens") if isinstance(saved, dict) and saved.get("key") == key else None
    whole = isinstance(tokens, dict) and all(
        isinstance(tokens.get(k), torch.Tensor) and len(tokens[k]) == len(v) * scorer.n for k, v in scorer.sets.items())
    return tokens if whole else None


def _with_rewards(scores: dict, names: list[str]) -> dict:
    """`scores` with only the rewards `names` (a cache may hold more, from an earlier call's rows)."""
    return {**scores, "sets": {k: {**s, "rewards": {n: s["rewards"][n] for n in names}}
                               for k, s in scores["sets"].items()}}


def _row(images: torch.Tensor):
    import numpy as np

    return np.concatenate(list(to_uint8(images)), axis=1)  # [H, k*W, 3]


def summarize(scores: dict, reference: dict, captions: dict, strata: dict | None = None) -> dict:
    """Per eval set: each measure's mean [95% interval over images], and its paired change against the
    reference, whose interval resamples captions (intervals.caption_interval). `captions`, `strata`:
    per set, each prompt's caption and form (Scorer.captions, Scorer.strata)."""
    out = {}
    for set_name, s in scores["sets"].items():
        table = {}
        for name, (values, ref_values) in _measures(s, reference["sets"][set_name]).items():
            x = _tensor(values)
            table[name] = interval(x)
            if ref_values is not None:
                table[name]["change"] = caption_interval(x - _tensor(ref_values),
                                                         *_clusters(captions, strata, set_name, len(x)))
        out[set_name] = table
    return out


def _measures(s: dict, r: dict) -> dict:
    """{measure: (a model's per-image values, the reference's or None)} of one eval set's scores."""
    return {**{k: (v, r["rewards"].get(k)) for k, v in s["rewards"].items()},
            **{f"judge/{k}": (v, r["judge"].get(k)) for k, v in s["judge"].items()},
            "diversity": (s["diversity"], r["diversity"]), "entropy": (s["entropy"], r["entropy"]),
            "kl": (s["kl"], None)}


def _clusters(captions: dict, strata: dict | None, set_name: str, count: int) -> tuple[list, list | None]:
    """Each value's caption and form, for `count` values of a set: one per image (its prompt's images in
    turn), or one per prompt (diversity)."""
    per_prompt = captions[set_name]
    k = count // len(per_prompt)
    spread = lambda v: [x for x in v for _ in range(k)]  # noqa: E731
    return spread(per_prompt), spread(strata[set_name]) if strata else None


def pool_seeds(scorer: Scorer, reference: dict, scores: list[dict]) -> dict:
    """The mean change over runs that differ only in their training seed, per eval set and measure, with
    a 95% interval that resamples both the seeds and the captions (all runs share the captions)."""
    out = {}
    for set_name in reference["sets"]:
        r = reference["sets"][set_name]
        measured = [_measures(s["sets"][set_name], r) for s in scores]
        table = {}
        for name, (_, ref_values) in measured[0].items():
            if ref_values is None:
                continue
            per_run = torch.stack([_tensor(m[name][0]) for m in measured])
            table[name] = {"change": caption_interval(per_run - _tensor(ref_values), *_clusters(
                scorer.captions, scorer.strata, set_name, per_run.shape[1]))}
        out[set_name] = table
    return out


def against_baseline(scorer: Scorer, baseline: list[dict], scores: list[dict]) -> dict:
    """Each measure of runs (one per training seed) minus the baseline's runs of the same seeds, per eval set:
    the mean difference, paired per image and per seed, with a 95% interval that resamples the captions and
    the seeds (intervals.caption_interval). What decides whether a training option beats the recipe it
    changes (`matrix --variant`: the first variant is the baseline)."""
    out = {}
    for set_name in baseline[0]["sets"]:
        # each run's per-image values and the baseline's own (measured against itself: KL has no reference pair)
        ours = [_measures(s["sets"][set_name], b["sets"][set_name]) for s, b in zip(scores, baseline)]
        theirs = [_measures(b["sets"][set_name], b["sets"][set_name]) for b in baseline]
        table = {}
        for name in (n for n in ours[0] if n in theirs[0]):  # a measure one side lacks (a plan's) has no difference
            diff = torch.stack([_tensor(o[name][0]) - _tensor(t[name][0]) for o, t in zip(ours, theirs)])  # [S, N]
            table[name] = caption_interval(diff, *_clusters(scorer.captions, scorer.strata, set_name, diff.shape[1]))
        out[set_name] = table
    return out


def score_runs(scorer: Scorer, out: Path, runs: list[tuple[str, Path]]) -> tuple[dict, dict, dict]:
    """(the reference's summary, {run name: its summary or None when it has no checkpoint}, {"reference"
    and each scored run: its per-image scores})."""
    scores_dir = out / "scores"
    reference = cached_scores(scorer, scores_dir / "reference.json", 0, lambda: scorer.base)
    summaries, raw = {}, {"reference": reference}
    for name, run_dir in runs:
        from grpo_vision.run.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            summaries[name] = None
            continue
        step = int(ckpt.name[5:])
        raw[name] = cached_scores(scorer, scores_dir / f"{name}.json", step,
                                  lambda: load_run(run_dir, step, device=scorer.device).policy)
        summaries[name] = {"step": step, "sets": summarize(raw[name], reference, scorer.captions, scorer.strata)}
    return summarize(reference, reference, scorer.captions, scorer.strata), summaries, raw
