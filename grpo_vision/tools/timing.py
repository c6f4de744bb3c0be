"""The benches' clock and what they ran on: wall seconds with the device's queued work finished, medians after a
warm-up call, runs interleaved so that machine noise hits each alike, rates rounded to significant digits, and
the machine fields every bench reports (`machine`)."""

from __future__ import annotations

import importlib.metadata
import statistics
import time

import torch

OPTIONAL = ["diffusers", "open_clip_torch", "gradio", "peft", "transformers", "accelerate"]


def machine() -> dict:
    """What the figures were measured on: the device, torch and CUDA, and the optional packages present."""
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "cpu_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out |= {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1)}
    else:
        out["gpu"] = None
    packages = {}
    for name in OPTIONAL:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = "missing"
    return out | {"packages": packages}


def sig(x: float, digits: int = 3) -> float:
    """`x` to `digits` significant digits: 0.00203 images/s stays readable (not 0.0)."""
    return float(f"{x:.{digits}g}")


def sync() -> None:
    """Wait for the GPU's queued kernels: a CUDA call returns before they finish."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds(fn) -> float:
    """Wall seconds of one call of `fn`, the device's queued work finished before and after it."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def median_seconds(fn, repeats: int, first: bool = False):
    """Median seconds of `repeats` calls after one warm-up call (`first`: and the warm-up's own seconds)."""
    warm = seconds(fn)
    median = statistics.median([seconds(fn) for _ in range(repeats)])
    return (median, warm) if first else median


def interleaved(runs: dict, repeats: int, warm: bool = True) -> dict[str, list[float]]:
    """Seconds of each of `runs` (name -> fn) in `repeats` rounds that call each once, after one untimed call
    of each (`warm=False`: the caller has made it): a busy moment of the machine slows all of them, so their
    ratios hold."""
    for fn in runs.values() if warm else ():
        fn()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(seconds(fn))
    return times
