"""Evaluate a run: policy vs reference on the same prompts and seeds, one result for `eval RUN`,
GRPOTrainer.evaluate and the report's eval.json (`evaluate_loaded`).

It reports each reward's mean with a 95% interval (normal approximation, 1.96 standard
errors) for the policy and the reference, and, where the policy kind brings a judge (ShapesWorld's
exact checker), its accuracy per attribute. Both models draw image i of a prompt with the same
seed, so differences come from the weights, not from the sampling noise.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from grpo_vision.evaluation.summary import summarize
from grpo_vision.rollouts import EVAL_SEED, Paired, compare
from grpo_vision.run.machine import resolve_device
from grpo_vision.sampling import SamplingParams, decode_note
from grpo_vision.step.load import LoadedRun, load_for_eval

if TYPE_CHECKING:
    from grpo_vision.config import Config
    from grpo_vision.prompts import PromptEntry


def evaluate_run(run_dir: str | Path, step: int | None = None, n: int | None = None, seed: int = EVAL_SEED,
                 device: str = "run", sets: dict[str, list[PromptEntry]] | None = None,
                 temperature: float | None = None, draw: int = 1, trust: bool = False, rewards: Sequence[str] = (),
                 source: Callable[[str], str] | None = None, allow_other_base: bool = False) -> dict:
    """`grpo-vision eval RUN`'s result (`evaluate_loaded`'s) for the run's checkpoint at `step` (the latest by
    default) on `sets` (the run's own scored sets by default, `draw` 2, 3, ... drawn again). `trust`: load python:
    rewards the run folder names; `rewards`: NAME=python:module:function for rewards only the run's script had;
    `source(name)`: where set `name` was read, for error messages; `allow_other_base`: as load_run."""
    run, scorer, sets = load_for_eval(run_dir, step, seed, n, device, sets, draw, trust, rewards, source,
                                      allow_other_base)
    return evaluate_loaded(run_dir, run, scorer, sets, n, seed, temperature, draw)


def evaluate_loaded(run_dir: str | Path, run: LoadedRun, rewards, sets: dict[str, list[PromptEntry]],
                    n: int | None = None, seed: int = EVAL_SEED, temperature: float | None = None, draw: int = 1,
                    headline: Callable[[Paired], None] | None = None, say: Callable[[str], None] | None = None) -> dict:
    """The one measurement of a run, which `eval RUN`, GRPOTrainer.evaluate and the report (eval.json) return:
    policy against reference on `n` images of each entry of each set (log.eval_images by default; the same seeds,
    rollouts.compare), at `temperature`, else at every log.eval_temperatures entry (the first set only past the
    first, the headline). `headline(paired)`: sees the first set's draw at the first temperature (the report's
    grid); `say`: a progress line per draw. Keys: run, step, device, temperature, train_temperature, draw and
    other_base where they apply, sets (name -> `summarize`'s result), by_temperature (str(t) -> the first set's,
    with several temperatures)."""
    n = n or run.cfg.log.eval_images
    temperatures = [temperature] if temperature else eval_temperatures(run.cfg)
    params = eval_params(run.cfg, temperatures[0])
    first = next(iter(sets))
    result = {"run": str(run_dir), "step": run.step, "device": str(next(run.policy.parameters()).device),
              "temperature": temperatures[0], "train_temperature": run.cfg.sample.temperature,
              **({"draw": draw} if draw != 1 else {}), **({"other_base": run.other_base} if run.other_base else {}),
              "sets": {}}
    by_temperature = {}
    for t in temperatures:  # the same prompts and seeds at each temperature
        for name, entries in sets.items() if t == temperatures[0] else [(first, sets[first])]:
            if say:
                say(f"evaluating on {len(entries)} {name} prompts x {n} images at temperature {t}")
            paired = compare(run.policy, run.reference, run.bundle.tokenizer, entries, n,
                             dataclasses.replace(params, temperature=t), seed, rewards, run.bundle.judge)
            if headline and t == temperatures[0] and name == first:  # before the next draw takes the memory
                headline(paired)
            summary = summarize(paired, run.bundle.judge)
            if t == temperatures[0]:
                result["sets"][name] = summary
            if name == first:
                by_temperature[str(t)] = summary
    if len(temperatures) > 1:
        result["by_temperature"] = by_temperature
    return result


def eval_temperatures(cfg: Config) -> list[float]:
    """Temperatures the report evaluates at, the headline first (log.eval_temperatures, else the
    training temperature)."""
    return list(cfg.log.eval_temperatures) or [cfg.sample.temperature]


def eval_params(cfg: Config, temperature: float | None = None) -> SamplingParams:
    """Sampling settings of `eval` and `sample`: at `temperature`, else at the report's headline one. A run that
    trained with sample.decode=graph, read where run.device has no CUDA, decodes with the same fixed-shape step
    unrecorded (`static`): the same tokens for the same seeds (sampling/decode.py)."""
    params = SamplingParams.from_config(cfg.sample, temperature or eval_temperatures(cfg)[0])
    device = resolve_device(cfg.run.device)
    if params.decode == "graph" and not device.startswith("cuda"):
        params = dataclasses.replace(params, decode="static")
    if note := decode_note(params.decode, device):  # as train says it at its start; stdout keeps the results
        print(f"[sampling] {note}", file=sys.stderr, flush=True)
    return params
