"""Intervals that include what a reader would re-draw: the captions, and the training seeds.

A change of policy against reference is measured on images that come in clusters: the images of one
caption share it, so they are not independent draws. The per-image interval (`metrics.interval`)
holds the captions fixed and only says how noisy the images of *these* captions are; a reader who
draws other captions from the same distribution sees a wider spread. `caption_interval` resamples
captions, every image of a drawn caption with it (the cluster bootstrap: Davison & Hinkley 1997,
"Bootstrap Methods and their Application", section 3.8; Field & Welsh 2007), within each stratum (a
prompt form: the eval sets are drawn balanced by form, so the replicates keep that balance), and
takes the 2.5 and 97.5 percentiles of the replicates' means. Given values of several training seeds
on the same captions, each replicate also resamples the seeds (a two-way bootstrap over seeds and
captions), so the interval of a mean over seeds includes the seed-to-seed spread; with three seeds
that part is coarse (a reader should read the seeds' own values beside it).
"""

from __future__ import annotations

from typing import Sequence

import torch

REPLICATES = 4000  # the percentile interval's ends move by about 0.1 points between bootstrap seeds at 4000
SEED = 0  # a fixed bootstrap seed: the same numbers give the same interval


def caption_interval(values: torch.Tensor, captions: Sequence[str], strata: Sequence[str | None] | None = None,
                     replicates: int = REPLICATES, seed: int = SEED) -> dict:
    """Mean and 95% interval of `values` (`[N]` per image, or `[S, N]`: the same N images' captions
    under S training seeds; NaN = does not apply), resampling captions (and seeds). Returns
    {"mean", "ci95", "n": images, "captions": distinct captions with a value, "seeds": S when 2-D};
    ci95 is None with fewer than two captions (nothing to resample)."""
    v = values.double()
    two_d = v.dim() == 2
    v = v if two_d else v[None]
    S, N = v.shape
    if len(captions) != N or (strata is not None and len(strata) != N):
        raise ValueError(f"{N} values, {len(captions)} captions, {len(strata or [])} strata: one of each per image")
    index = {c: i for i, c in enumerate(dict.fromkeys(captions))}
    which = torch.tensor([index[c] for c in captions])
    keep = ~v.isnan()
    sums = torch.zeros(S, len(index), dtype=torch.float64).index_add_(1, which, v.nan_to_num())  # [S, C]
    counts = torch.zeros(S, len(index), dtype=torch.float64).index_add_(1, which, keep.double())
    seen = counts.sum(0) > 0  # captions where the measure applies (a judge attribute may not)
    out = {"n": int(keep.sum()) // S, "captions": int(seen.sum())}
    if two_d:
        out["seeds"] = S
    if not seen.any():
        return {"mean": None, "ci95": None, **out}
    per_seed = sums.sum(1) / counts.sum(1)  # [S]
    mean = float(per_seed.mean())
    if int(seen.sum()) < 2:
        return {"mean": round(mean, 5), "ci95": None, **out}
    g = torch.Generator().manual_seed(seed)
    stratum_of = dict(zip(captions, strata)) if strata is not None else {}  # a caption has one form
    layer = [stratum_of.get(c) for c in index]
    draws = torch.zeros(replicates, len(index), dtype=torch.float64)  # times each caption is drawn
    for stratum in dict.fromkeys(layer):
        members = torch.tensor([i for i, s in enumerate(layer) if s == stratum and seen[i]], dtype=torch.long)
        if len(members):
            picks = members[torch.randint(len(members), (replicates, len(members)), generator=g)]
            draws.scatter_add_(1, picks, torch.ones_like(picks, dtype=torch.float64))
    estimates = (draws @ sums.T) / (draws @ counts.T)  # [R, S]: each seed's mean over the drawn captions
    if S > 1:
        estimates = estimates.gather(1, torch.randint(S, (replicates, S), generator=g))
    lo, hi = torch.quantile(estimates.nanmean(1), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"mean": round(mean, 5), "ci95": [round(lo, 5), round(hi, 5)], **out}
