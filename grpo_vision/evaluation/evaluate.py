"""Evaluate and sample a run: policy vs reference on the same prompts and seeds.

`evaluate` reports each reward's mean with a 95% interval (normal approximation, 1.96 standard
errors) for the policy and the reference, and, where the policy kind brings a judge (ShapesWorld's
exact checker), its accuracy per attribute. Both models draw image i of a prompt with the same
seed, so differences come from the weights, not from the sampling noise.
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from grpo_vision.run.checkpoint import (
    base_identity, check_base, find_checkpoint, load_checkpoint, load_iterative_state, recorded_base,
)
from grpo_vision.config import Config, ConfigError, GrpoVisionWarning
from grpo_vision.images import Cell, paint_grid, to_uint8
from grpo_vision.evaluation.intervals import caption_interval
from grpo_vision.policy import Judge
from grpo_vision.evaluation.judge import judge_tables, paired_differences
from grpo_vision.run.metrics import interval
from grpo_vision.policy import Bundle, load_bundle
from grpo_vision.splits import prompt_lists
from grpo_vision.run.machine import resolve_device
from grpo_vision.prompts import PromptEntry, load_prompts
from grpo_vision.step.reference import Reference
from grpo_vision.models.adapters import add_adapter
from grpo_vision.run.folder import read_run_config
from grpo_vision.files import write_file
from grpo_vision.rollouts import EVAL_SEED, Paired, check_seeds, compare
from grpo_vision.sampling import SamplingParams, decode_note


@dataclass
class LoadedRun:
    cfg: Config
    bundle: Bundle
    policy: torch.nn.Module  # with the checkpoint's weights (peft-wrapped if the run trained an adapter)
    reference: Reference
    step: int
    learned_rewards: dict | None = None  # iterative RL: what learning rewards had learned by this checkpoint
    other_base: str | None = None  # how policy.path / policy.tokenizer differ from the trained-on files (allowed)


def load_run(run_dir: str | Path, step: int | None = None, device: str = "run",
             allow_other_base: bool = False) -> LoadedRun:
    """A run's checkpoint (the latest, or `step`) on `device` (a --device value; "run": the run's own
    where this machine has it, else the best one here). Loads no reward: no code the run folder names runs.
    Refuses base files other than those the checkpoint was trained from, unless `allow_other_base`."""
    run_dir = Path(run_dir)
    read_run_config(run_dir, device=device)  # not a run folder: said before its checkpoints are looked for
    ckpt = find_checkpoint(run_dir, step)  # named step_NNNNNN
    # the settings that trained this checkpoint: a later resume may have changed its plan (run/resumes.py)
    cfg = read_run_config(run_dir, device=device, step=int(ckpt.name.removeprefix("step_")))
    other = check_base(ckpt / "trainer_state.json", recorded_base(ckpt), base_identity(cfg.policy), allow_other_base)
    if other:
        warnings.warn(f"--allow-other-base: {other}", GrpoVisionWarning, stacklevel=2)
    device = resolve_device(cfg.run.device, "--device")
    bundle = load_bundle(cfg.policy, device)
    policy = bundle.policy
    t = cfg.train
    if t.adapter != "none":
        policy = add_adapter(policy, t.adapter, t.adapter_rank, t.adapter_alpha, t.adapter_targets)
    reference = Reference(policy, cfg.train.reference, load_base=lambda: load_bundle(cfg.policy, device).policy)
    state, ref_state = load_checkpoint(ckpt, policy)
    if ref_state is not None:
        reference.load_state_dict(policy, ref_state)
    learned = load_iterative_state(ckpt)
    return LoadedRun(cfg, bundle, policy.eval(), reference, state["step"], learned["rewards"] if learned else None,
                     other)


def evaluate_run(run_dir: str | Path, step: int | None = None, n: int = 4, seed: int = EVAL_SEED, device: str = "run",
                 sets: dict[str, list[PromptEntry]] | None = None, temperature: float | None = None, draw: int = 1,
                 trust: bool = False, rewards: Sequence[str] = (), source: Callable[[str], str] | None = None,
                 allow_other_base: bool = False) -> dict:
    """`grpo-vision eval RUN`'s result: each reward's mean and interval for policy and reference on `sets` (the
    run's own eval sets by default, `draw` 2, 3, ... drawn again), `n` images per prompt. `trust`: load python:
    rewards the run folder names; `rewards`: NAME=python:module:function for rewards only the run's script had;
    `source(name)`: where set `name` was read, for error messages; `allow_other_base`: as load_run."""
    from grpo_vision.policy import check_prompts
    from grpo_vision.rewards import CompositeReward, check_rewards
    from grpo_vision.run.folder import refuse_code

    cfg = read_run_config(run_dir, device=device)
    cfg.data.eval_draw = draw
    own = sets is None
    sets = run_eval_sets(run_dir, cfg) if own else sets
    entries = [e for v in sets.values() for e in v]
    # the run's own prompts are the run folder's, and may name rewards too; prompts given here are the user's own
    refuse_code(cfg, entries if own else [], run_dir, trust)
    check_rewards(cfg, run_dir, entries, rewards, trust)
    check_seeds(seed, max(map(len, sets.values()), default=1), n)
    run = load_run(run_dir, step, device, allow_other_base)
    where = source or (lambda name: name)
    check_prompts(run.policy, ((f"{where(name)}, line {e.line}", e.prompt) for name, v in sets.items() for e in v))
    used = next(run.policy.parameters()).device
    scorer = CompositeReward.from_config(run.cfg.reward, used, run.bundle.reward_defaults, entries,
                                         run.reference.models(run.policy)).load()  # a self_judge judges as in training
    if run.learned_rewards:  # a reward that learned (clip_refit) scores as it had learned by this step
        scorer.load_state_dict(run.learned_rewards)
    params = eval_params(run.cfg, temperature)
    results = {name: evaluate(run.policy, run.reference, run.bundle.tokenizer, scorer, v, n, params, run.bundle.judge,
                              seed=seed) for name, v in sets.items()}
    return {"run": str(run_dir), "step": run.step, "device": str(used), "temperature": params.temperature,
            **({"draw": draw} if draw != 1 else {}), **({"other_base": run.other_base} if run.other_base else {}),
            "sets": results}


def run_eval_sets(run_dir: str | Path, cfg: Config) -> dict[str, list[PromptEntry]]:
    """A run's scored sets by name (test first, then held-out and the sample of training prompts): the
    files it wrote at its start (prompts/*.jsonl; test.jsonl always, the others when not empty). With
    data.eval_draw other than the run's, the config's draw (the kind's own sets only: the training
    prompts must stay the run's)."""
    files = {name: Path(run_dir) / "prompts" / f"{name}.jsonl" for name in ("test", "heldout", "train_sample")}
    if cfg.data.eval_draw == 1:
        return {name: load_prompts(path) for name, path in files.items() if name == "test" or path.is_file()}
    sets = prompt_lists(cfg)
    trained = Path(run_dir) / "prompts" / "train.jsonl"
    if cfg.data.eval_prompts or cfg.data.heldout_prompts or cfg.data.train_prompts or (
            trained.is_file() and [e.prompt for e in load_prompts(trained)] != [e.prompt for e in sets.train]):
        raise ConfigError(f"--draw {cfg.data.eval_draw}: {run_dir} takes its eval sets from prompts files, or "
                          "trained on other prompts than its policy kind draws now (prompts/train.jsonl); "
                          "give the prompts to score with --prompts")
    return sets.named()


def eval_temperatures(cfg: Config) -> list[float]:
    """Temperatures the report evaluates at, the headline first (log.eval_temperatures, else the
    training temperature)."""
    return list(cfg.log.eval_temperatures) or [cfg.sample.temperature]


def eval_params(cfg: Config, temperature: float | None = None) -> SamplingParams:
    """Sampling settings of `eval` and `sample`: at `temperature`, else at the report's headline one. A run that
    trained with sample.decode=graph, read where run.device has no CUDA, decodes with the same fixed-shape step
    unrecorded (`static`): the same tokens for the same seeds (sampling.py)."""
    params = SamplingParams.from_config(cfg.sample, temperature or eval_temperatures(cfg)[0])
    device = resolve_device(cfg.run.device)
    if params.decode == "graph" and not device.startswith("cuda"):
        params = dataclasses.replace(params, decode="static")
    if note := decode_note(params.decode, device):  # as train says it at its start; stdout keeps the results
        print(f"[sampling] {note}", file=sys.stderr, flush=True)
    return params


def evaluate(policy, reference: Reference, tokenizer, rewards, entries: list[PromptEntry], n: int,
             params: SamplingParams, judge: Judge | None = None, seed: int = EVAL_SEED) -> dict:
    """Each reward's mean and interval for `policy` and `reference` on `n` images of each entry (the same seeds,
    rollouts.compare), the judge's tables, and the paired changes with intervals over captions."""
    return summarize(compare(policy, reference, tokenizer, entries, n, params, seed, rewards, judge), judge)


def summarize(paired: Paired, judge: Judge | None = None) -> dict:
    """`evaluate`'s result of a paired draw (rollouts.compare)."""
    prompts, entries = paired.prompts, paired.entries[::paired.n]
    strata = [judge.form(p) for p in prompts] if judge is not None else None  # the sets are balanced by form
    result = {"prompts": len(entries), "captions": len({e.prompt for e in entries}), "images_per_prompt": paired.n,
              "models": {}}
    sides = {"policy": paired.policy, "reference": paired.reference}
    for name, scored in sides.items():
        table, by_form = judge_tables(judge, paired.images[name], prompts, scored.verdicts if judge else None)
        result["models"][name] = {"rewards": {k: reward_interval(v, paired.n) for k, v in scored.raw.items()},
                                  "judge": table,
                                  "judge_by_form": by_form}
    result["difference"] = {k: _diff(result, "rewards", k) for k in result["models"]["policy"]["rewards"]}
    # paired per image (the same prompt and seed on both sides); the interval resamples captions, all
    # their images with them: another draw of captions is what a reader would re-draw (evaluation/intervals.py)
    diffs = {k: paired.policy.raw[k].double() - paired.reference.raw[k].double() for k in paired.policy.raw}
    result["difference_ci"] = {k: caption_interval(d, prompts, strata) for k, d in diffs.items()}
    result["difference_ci_per_image"] = {k: interval(d) for k, d in diffs.items()}  # these captions held fixed
    if paired.policy.reasons:
        result["reasons"] = {k: failure_summary(paired.policy.reasons[k], paired.reference.reasons[k], prompts, strata)
                             for k in paired.policy.reasons}
    if result["models"]["policy"]["judge"]:
        keys = list(result["models"]["policy"]["judge"])
        result["judge_difference"] = {k: _diff(result, "judge", k) for k in keys}
        diffs = paired_differences(paired.policy.verdicts, paired.reference.verdicts, keys)
        result["judge_difference_ci"] = {k: caption_interval(d, prompts, strata) for k, d in diffs.items()}
        result["judge_difference_ci_per_image"] = {k: interval(d) for k, d in diffs.items()}
    if paired.policy.plan_verdicts and paired.reference.plan_verdicts:  # the plans against their prompts
        for name, scored in sides.items():
            result["models"][name]["plan_judge"] = judge_tables(judge, None, prompts, scored.plan_verdicts)[0]
        keys = list(result["models"]["policy"]["plan_judge"] or [])
        diffs = paired_differences(paired.policy.plan_verdicts, paired.reference.plan_verdicts, keys)
        result["plan_judge_difference_ci"] = {k: caption_interval(d, prompts, strata) for k, d in diffs.items()}
    return result


def reward_interval(values: torch.Tensor, n: int) -> dict:
    """A reward's mean and interval over the images it applies to (NaN excluded, e.g. `ocr` on a prompt that quotes
    no text); a reward that skips some prompts also says on how many it scored ("prompts": entries, n images each)."""
    out = interval(values)
    applies = ~values.isnan().view(-1, n)  # [E, n]
    if not bool(applies.all()):
        out["prompts"] = int(applies.any(1).sum())
    return out


def failure_summary(policy: list[list[tuple[str, str]]], reference: list[list[tuple[str, str]]],
                    prompts: list[str], strata: list | None = None, common: int = 3) -> dict:
    """What a reward that gives reasons (rewards/base.py) held against each model's images, on the same
    prompts and seeds: per kind of failure, the fraction of images with one (each model's, and the paired
    change with its interval over captions), and each model's most frequent reason texts."""
    kinds = list(dict.fromkeys(kind for side in (reference, policy) for image in side for kind, _ in image))
    rate = lambda side, kind: torch.tensor([float(any(k == kind for k, _ in image)) for image in side],  # noqa: E731
                                           dtype=torch.float64)  # [B] 1 where the image failed that way
    out = {"kinds": kinds, "images": len(prompts)}
    for name, side in (("policy", policy), ("reference", reference)):
        texts: dict[str, int] = {}
        for image in side:
            for text in dict.fromkeys(text for _, text in image):  # an image counts once per text
                texts[text] = texts.get(text, 0) + 1
        out[name] = {"failing": {k: round(float(rate(side, k).mean()), 5) for k in kinds},
                     "common": sorted(texts.items(), key=lambda kv: (-kv[1], kv[0]))[:common]}
    out["change"] = {k: caption_interval(rate(policy, k) - rate(reference, k), prompts, strata) for k in kinds}
    return out


def _diff(result: dict, table: str, key: str):
    p, r = (result["models"][m][table][key]["mean"] for m in ("policy", "reference"))
    return None if p is None or r is None else round(p - r, 5)


def save_sample_grid(parts: Sequence[Paired], path: Path, judge: Judge | None = None, per_prompt: int = 2,
                     prompts: int = 8, scale: int = 2, root: Path | None = None) -> dict:
    """A PNG of paired draws (rollouts.compare, on the eval seeds: the images `eval` scores): a row for each of
    the first `prompts` entries of each part, the policy's first `per_prompt` images on the left, the reference's
    on the same seeds on the right, each image `scale` times its size; under each, the judge's verdict per
    attribute (✓ / ✗) where the policy kind has a judge, then the image's text plan where the policy wrote one
    (sample.plan), and the judge's own rendering of the prompt (ground truth) last, where the judge can draw one
    (ShapesWorld). `root`: the run folder when `path` lies in a sub-folder of it (written as files.write_file
    writes). Returns what it shows, for the trackers: the sheet (PIL), each image's prompt and seed, and per side
    (policy, reference) the images, the verdicts and each reward's values; with plans, per side the plans too."""
    k = min(per_prompt, *(p.n for p in parts))
    rows = [(p, e * p.n + j) for p in parts for e in range(min(prompts, len(p.entries) // p.n)) for j in range(k)]
    entries = [p.entries[r] for p, r in rows[::k]]
    texts, seeds = [p.entries[r].prompt for p, r in rows], [p.seeds[r] for p, r in rows]
    shown = {side: {"images": torch.stack([p.images[side][r] for p, r in rows]),
                    "verdicts": [getattr(p, side).verdicts[r] for p, r in rows],
                    "rewards": {name: torch.stack([getattr(p, side).raw[name][r] for p, r in rows])
                                for name in getattr(parts[0], side).raw}} for side in ("policy", "reference")}
    plans = {side: None if any(p.plans.get(side) is None for p in parts) else [p.plans[side][r] for p, r in rows]
             for side in shown}
    chars = max(8, parts[0].images["policy"].shape[-1] * scale * 19 // 128)  # as verdict_lines fits 128 px
    cells = {side: [Cell(img, marks + plan_lines(plan, chars)) for img, marks, plan in zip(
        to_uint8(v["images"]), verdict_lines(v["verdicts"]), plans[side] or [None] * len(rows))]
        for side, v in shown.items()}
    draw = getattr(judge, "render", None)
    truth = [draw(e.prompt, 0) if draw else None for e in entries]
    grid = [[*cells["policy"][r * k:(r + 1) * k], *cells["reference"][r * k:(r + 1) * k],
             *([Cell(truth[r], ["ground truth"])] if truth[r] is not None else [])] for r in range(len(entries))]
    headings = [(0, "policy"), (k, "reference")] + ([(2 * k, "what the prompt\ndescribes")] if any(
        t is not None for t in truth) else [])
    sheet = paint_grid(grid, headings=headings, row_labels=[textwrap.fill(e.prompt, 26) for e in entries],
                       label_width=180, split=k, scale=scale, line=13)
    write_file(path, lambda f: sheet.save(f, format="PNG"), root)
    return {"sheet": sheet, "prompts": texts, "seeds": seeds, **{
        key: {side: v[key] for side, v in shown.items()} for key in ("images", "verdicts", "rewards")},
        **({"plans": plans} if any(v is not None for v in plans.values()) else {})}


def plan_lines(plan: str | None, width: int = 19, lines: int = 3) -> list[str]:
    """An image's text plan as caption lines: 'plan: ...' wrapped to `width` characters, at most `lines` of them (a
    longer plan cut with '…'; the trackers' text holds it whole); none for an image drawn without a plan."""
    if plan is None:
        return []
    return textwrap.wrap(f"plan: {plan or '(empty)'}", width, max_lines=lines, placeholder=" …")


def verdict_lines(verdicts: list) -> list[list[str]]:
    """Per image, its verdicts as caption lines that fit under a 128 px tile ('✓ count  ✗ color'); none for an
    image without a verdict (no judge, or a prompt it cannot read)."""
    out = []
    for verdict in verdicts:
        lines = []
        for a, ok in (verdict or {}).items():
            if a == "correct" or ok is None:
                continue
            mark = f"{'✓' if ok else '✗'} {a}"
            if lines and len(lines[-1]) + 2 + len(mark) <= 19:
                lines[-1] += "  " + mark
            else:
                lines.append(mark)
        out.append(lines)
    return out
