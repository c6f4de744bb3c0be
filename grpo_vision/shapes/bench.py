"""Checker benchmark: seconds per image of the exact checker on rendered scenes of every caption form.

The checker scores every training image (the `shapes_exact` reward) and every eval image, so it must stay
well under the policy's own cost per image: the target is 5 ms (0.26-0.42 ms measured on a 2-core CPU).
Speed is checked here, by `grpo-vision world bench`, never in timed tests (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from grpo_vision.shapes.checker import check
from grpo_vision.shapes.layout import sample_scene
from grpo_vision.shapes.scene import FORMS, render

TARGET_S = 5e-3  # seconds per image


def bench_checker(n_per_form: int = 50, repeats: int = 3, seed: int = 30, target_s: float = TARGET_S) -> dict:
    """Time `check` on n_per_form renders of each form (aesthetic factors on: noise, clipped and cornered
    objects), `repeats` passes after one untimed pass; the median pass is reported per image. `accepted`
    is the fraction of renders the checker accepts (1.0: a checker that rejected early would look fast)."""
    rng = np.random.default_rng(seed)
    samples = [sample_scene(rng, form, "all", True) for form in FORMS for _ in range(n_per_form)]
    images = [(render(scene), caption) for scene, caption in samples]
    accepted = sum(check(image, caption).correct for image, caption in images)  # also the warm-up pass
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for image, caption in images:
            check(image, caption)
        times.append(time.perf_counter() - start)
    per_image = round(statistics.median(times) / len(images), 6)
    return {"images": len(images), "forms": list(FORMS), "repeats": repeats, "accepted": accepted / len(images),
            "seconds_per_image": per_image, "target_s": target_s, "targets_met": per_image <= target_s}
