"""The Gradio demo: two checkpoints of a run (or its reference) on the same prompt and seeds.

    grpo-vision demo runs/shapes_grpo [--host 127.0.0.1] [--port 7860]

Each side picks a checkpoint step or the run's reference; image i of both sides is drawn with seed
`seed + i` (sampling draws per-image streams, so it depends on (prompt, seed) only, see
sampling/), so differences between the galleries come from the weights. Every image is captioned
with each configured reward's score and, where the policy kind has a judge (ShapesWorld's exact
checker), its verdict per attribute, for a reward that gives reasons (the `geneval` reward), why
the image lost points, and, for a run that plans before it draws (sample.plan), the image's text
plan. A prompt's metadata (GenEval's clauses) is its entry's in the run's prompt sets, else read
from GenEval's grammar ("a photo of a red dog"); a reward that cannot score a typed prompt shows
n/a and says why instead of failing the page. A second tab plots the run's metrics.jsonl.

The logic is plain functions (validation, scoring, summary, grid PNG) and `DemoRun`, which caches
loaded checkpoints per step; demo_app.py only wires them to Gradio components.
"""

from __future__ import annotations

import math
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Sequence

import torch

from grpo_vision.run.checkpoint import checkpoint_steps, find_checkpoint
from grpo_vision.config import MAX_SEED, ConfigError, brief
from grpo_vision.evaluation.grid import plan_lines
from grpo_vision.images import Cell, paint_grid, to_uint8
from grpo_vision.run.metrics import nanmean
from grpo_vision.run.machine import resolve_device
from grpo_vision.policy import unknown_words
from grpo_vision.prompts import PromptEntry, PromptsError
from grpo_vision.rewards import CompositeReward, check_rewards
from grpo_vision.run.folder import read_run_config, refuse_code
from grpo_vision.rollouts import Scored, draw, eval_seeds, plan_texts, score
from grpo_vision.sampling import SamplingParams
from grpo_vision.step.load import LoadedRun, load_run

MAX_IMAGES = 16  # images per side
MAX_PROMPT_CHARS = 200  # longer prompts are refused before tokenising
# the API takes any number the page's sliders cannot send: past these, guided logits overflow to inf and NaN
MAX_CFG_SCALE = 100.0
TEMPERATURES = (0.01, 100.0)
EXAMPLES_PER_SPLIT = 6  # clickable prompts from each of the run's train and eval sets
REFERENCE = "reference"  # the step picker's entry for the run's reference
CACHED_STEPS = 4  # checkpoints kept loaded besides the latest (least recently used ones are dropped)
GRID_SCALE = 2  # pixels per image pixel in the downloadable grid (nearest neighbour)
RUN_HINT = "pass a directory written by `grpo-vision train`, e.g. runs/shapes_grpo after " \
           "`grpo-vision train configs/shapes.yaml`"


class DemoInputError(ValueError):
    """Bad input from the page or the API; the message is shown to the user as it is."""


@dataclass
class Side:
    label: str  # "step 2" or "reference (...)"
    images: torch.Tensor  # [n, 3, H, W] in [0, 1]
    rewards: dict[str, torch.Tensor]  # reward name -> [n] raw values, NaN = does not apply
    checks: list[dict | None]  # per image: the judge's verdict per attribute; None = no judge, or not its prompt
    reasons: dict[str, list[list[tuple[str, str]]]] = field(default_factory=dict)  # reward -> per image, (kind, why)
    notes: dict[str, str] = field(default_factory=dict)  # reward -> why it could not score this prompt (n/a)
    plans: list[str] | None = None  # per image: the text plan it was drawn from (sample.plan); None: no text stage


# ---------------------------------------------------------------------------- the run


def check_run_dir(run_dir: str | Path) -> Path:
    """The run directory, or FileNotFoundError naming the path and how to get a usable one."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}; {RUN_HINT}")
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml); {RUN_HINT}")
    if not checkpoint_steps(run_dir):
        raise FileNotFoundError(f"{run_dir} has no checkpoint yet (no checkpoints/step_*); wait for the first "
                                "one (log.checkpoint_every) or let the run finish")
    return run_dir


class DemoRun:
    """A run's models, loaded on first use and cached per step; the reward models loaded once."""

    def __init__(self, run_dir: str | Path, device: str = "run", trust: bool = False, rewards: Sequence[str] = (),
                 allow_other_base: bool = False):
        """`device`: where to sample (a --device value); `trust`: allow python: rewards the run names; `rewards`:
        --reward NAME=python:module:function for a reward that only the run's script had; `allow_other_base`:
        load checkpoints although the run's base files changed (load_run)."""
        self.allow_other_base = allow_other_base
        self.run_dir = check_run_dir(run_dir)
        cfg = read_run_config(self.run_dir, device=device)
        refuse_code(cfg, (), self.run_dir, trust)  # before anything loads
        check_rewards(cfg, self.run_dir, (), rewards, trust)
        self.device = cfg.run.device
        self._runs: dict[int, LoadedRun] = {}
        self.lock = threading.Lock()  # one generation at a time: an adapter reference toggles shared weights
        self.latest = checkpoint_steps(self.run_dir)[-1]  # "reference" is the reference saved with this step
        latest = self.load(self.latest)
        self.cfg, self.bundle = latest.cfg, latest.bundle
        self.rewards = CompositeReward.from_config(self.cfg.reward, resolve_device(self.device, "--device"),
                                                   self.bundle.reward_defaults,
                                                   models=latest.reference.models(latest.policy)).load()
        self.examples = run_examples(self.cfg, self.bundle)
        self.metadata = run_metadata(self.run_dir)
        self.reference_label = reference_label(latest.reference.mode, latest.reference.synced)

    def load(self, step: int) -> LoadedRun:
        run = self._runs.pop(step, None) or load_run(self.run_dir, step, self.device, self.allow_other_base)
        self._runs[step] = run  # most recently used last
        older = [s for s in self._runs if s != self.latest]
        for s in older[:max(0, len(older) - CACHED_STEPS)]:
            del self._runs[s]
        return run

    def choices(self) -> list[str]:
        """The step picker's entries, newest first (re-read from disk: a running job adds steps)."""
        return [f"step {s}" for s in reversed(checkpoint_steps(self.run_dir))] + [REFERENCE]

    def sampler(self, choice: str):
        """(model, context to sample in, label) for a picker entry."""
        if choice == REFERENCE:
            run = self.load(self.latest)
            return *run.reference.sampler(run.policy), self.reference_label
        step = str(choice).removeprefix("step ").strip()  # the API may send any JSON value, not only a pick
        if not str(choice).startswith("step ") or not step.isdigit():
            raise DemoInputError(f"unknown checkpoint {brief(choice)}; choose one of: {', '.join(self.choices())}")
        try:
            find_checkpoint(self.run_dir, int(step))
        except FileNotFoundError as e:
            raise DemoInputError(str(e)) from None
        return self.load(int(step)).policy, nullcontext(), choice

    def side(self, choice: str, prompt: str, seeds: list[int], params: SamplingParams) -> Side:
        entries = [PromptEntry(prompt, metadata=self.metadata_for(prompt))] * len(seeds)
        with self.lock:
            model, ctx, label = self.sampler(choice)
            # each checkpoint draws with the text plan it trained with: a resume may have changed it (run/resumes.py)
            trained = self.load(self.latest if choice == REFERENCE else int(str(choice).removeprefix("step "))).cfg
            params = replace(params, plan=SamplingParams.from_config(trained.sample).plan)
            return draw_side(label, model, ctx, self.bundle.tokenizer, self.rewards, self.bundle.judge, entries,
                             seeds, params)

    def metadata_for(self, prompt: str) -> dict:
        """The prompt's metadata: its entry's in the run's prompt sets, else GenEval's clauses where it is
        in GenEval's grammar over COCO's classes or the ones the run's prompts name, else none."""
        if prompt in self.metadata:
            return self.metadata[prompt]
        from grpo_vision.rewards.geneval_prompts import parse

        return parse(prompt, self.class_names) or {}

    @cached_property
    def class_names(self) -> list[str]:
        """GenEval's 80 COCO classes, then the other classes the run's prompts name (fixed for a run)."""
        from grpo_vision.rewards.geneval_prompts import classes

        coco = classes()
        named = {c["class"] for m in self.metadata.values() for c in m.get("include", ()) if "class" in c}
        return [*coco, *sorted(named - set(coco))]


def draw_side(label: str, model, ctx, tokenizer, rewards, judge, entries: list[PromptEntry], seeds: list[int],
              params: SamplingParams) -> Side:
    """One side's images of `entries` on `seeds` (drawn in `ctx`, the sampler's context), scored as `eval` scores
    them (a failing reward is a note), with the plan each image was drawn from where the run plans."""
    with ctx, torch.no_grad():
        samples = draw(model, tokenizer, entries, seeds, params, 64)
    scored = score(rewards, samples.images, entries, judge, tolerant=True, plans=plan_texts(samples))
    return Side(label, samples.images, scored.raw, scored.verdicts, scored.reasons,
                scored.notes | not_applying(scored), plan_texts(samples))


def reference_label(mode: str, synced: bool) -> str:
    what = {"frozen": "a frozen copy of the base policy", "adapter": "the policy with its adapter disabled",
            "none": "this run has none, train.reference: none; showing the base policy"}[mode]
    return f"reference ({what}{', synced from the policy during training' if synced else ''})"


def run_metadata(run_dir: Path) -> dict[str, dict]:
    """Prompt -> its metadata, from the prompt sets the run wrote (prompts/*.jsonl), where not empty."""
    from grpo_vision.prompts import load_prompts

    out = {}
    for path in sorted((run_dir / "prompts").glob("*.jsonl")):
        try:
            out |= {e.prompt: e.metadata for e in load_prompts(path) if e.metadata}
        except PromptsError:  # a convenience: a file the run can no longer read gives no metadata
            continue
    return out


def not_applying(scored: Scored) -> dict[str, str]:
    """Why each reward that scored none of the images, without failing, has no score."""
    return {name: "does not apply to this prompt (no score: a reward that reads something the prompt must carry, "
                  "such as GenEval's clauses in its metadata or the quoted text ocr reads, found none)"
            for name, values in scored.raw.items() if name not in scored.notes and values.isnan().all()}


def run_examples(cfg, bundle) -> dict[str, list[str]]:
    """A few of the run's training prompts and of each eval set."""
    from grpo_vision.splits import checked_prompt_sets

    try:
        sets = checked_prompt_sets(cfg, bundle)
    except (ConfigError, PromptsError, FileNotFoundError):  # examples are a convenience, not a requirement
        return {}
    titles = {"test": "test prompts (never trained on)", "heldout": "held-out compositions (no model trained on)"}
    return {"training prompts": [e.prompt for e in sets.train[:EXAMPLES_PER_SPLIT]],
            **{titles[k]: [e.prompt for e in v[:EXAMPLES_PER_SPLIT]] for k, v in sets.named().items()}}


# ---------------------------------------------------------------------------- validation


def clean_prompt(prompt, policy, judge=None) -> str:
    """The prompt with whitespace collapsed, or DemoInputError saying why the policy (or, when the run
    has one, the judge) cannot read it."""
    text = " ".join(str(prompt or "").split())
    if not text:
        raise DemoInputError("Enter a prompt, e.g. one of the examples.")
    if len(text) > MAX_PROMPT_CHARS:
        raise DemoInputError(f"The prompt has {len(text)} characters; at most {MAX_PROMPT_CHARS} are accepted.")
    unknown = unknown_words(policy, text)  # a policy with a closed vocabulary names what it cannot read
    if unknown:
        raise DemoInputError(f"Words the policy does not know: {', '.join(map(repr, unknown))}. "
                             "Try one of the example prompts.")
    problem = judge.problem(text) if judge is not None else None
    if problem:
        raise DemoInputError(problem)
    try:
        policy.encode_prompts([text])
    except ValueError as e:
        raise DemoInputError(str(e)) from None
    return text


def _whole(value, name: str, lo: int, hi: int) -> int:
    try:
        number = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError, OverflowError):  # "abc", a list; an integer of 400 digits
        number = math.nan
    if not (math.isfinite(number) and number == int(number) and lo <= number <= hi):
        raise DemoInputError(f"{name} must be a whole number from {lo} to {hi}, got {brief(value)}.")
    return int(number)


def sampling_request(seed, n, cfg_scale, temperature, top_k, base: SamplingParams) -> tuple[list[int], SamplingParams]:
    """Seeds `[seed, seed + n)` and the sampling parameters (top-p, log-prob mode, precision and the text stage
    from the run)."""
    n = _whole(n, "The number of images", 1, MAX_IMAGES)
    seed = _whole(seed, "The seed", 0, MAX_SEED - n)
    top_k = _whole(top_k, "Top-k", 0, 1 << 20)
    for name, value, (lo, hi) in (("The CFG scale (1 = off)", cfg_scale, (0.0, MAX_CFG_SCALE)),
                                   ("The temperature", temperature, TEMPERATURES)):
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        if not (math.isfinite(number) and lo <= number <= hi):
            raise DemoInputError(f"{name} must be a number from {lo:g} to {hi:g}, got {brief(value)}.")
    return eval_seeds(1, n, seed), SamplingParams(float(cfg_scale), float(temperature), top_k, base.top_p,
                                                  base.logprob_mode, mixed_precision=base.mixed_precision,
                                                  plan=base.plan)


# ---------------------------------------------------------------------------- scores and pictures


def caption(side: Side, i: int) -> str:
    """'clip 0.312 · aesthetic 5.41 · geneval 0', a line per failing clause of a reward that gives reasons
    ('geneval ✗ position: expected dog right of target, found left of'), with a judge, '✓ count ✗ shape', and the
    image's text plan last ('plan: red circle ...') where the run plans."""
    scores = " · ".join(f"{name} {'n/a' if math.isnan(v[i]) else f'{float(v[i]):.3g}'}"
                        for name, v in side.rewards.items())
    lines = [scores, *(f"{name} ✗ {kind}: {text}" for name, per_image in side.reasons.items()
                       for kind, text in per_image[i])]
    check = side.checks[i]
    if check is not None:
        lines.append(" ".join(f"{'✓' if ok else '✗'} {a}" for a, ok in check.items() if ok is not None and a != "correct"))
    if side.plans is not None:
        lines.append(f"plan: {side.plans[i] or '(empty)'}")
    return "\n".join(lines)


def side_json(side: Side, seeds: list[int]) -> dict:
    """Per-image scores, reasons and verdicts, JSON-ready (NaN -> None), why a reward said n/a, and each image's
    text plan where the run plans."""
    rewards = {k: [None if math.isnan(x) else x for x in v.tolist()] for k, v in side.rewards.items()}
    reasons = {k: [[list(r) for r in image] for image in v] for k, v in side.reasons.items()}
    return {"label": side.label, "seeds": seeds, "rewards": rewards, "reasons": reasons, "not_scored": side.notes,
            "judge": side.checks, **({"plans": side.plans} if side.plans is not None else {})}


def _mean(values: list[float]) -> float | None:
    mean = nanmean(torch.tensor(values, dtype=torch.float64)) if values else math.nan
    return None if math.isnan(mean) else mean


def _row(name: str, a: float | None, b: float | None) -> list:
    r = lambda x: None if x is None else round(x, 4)  # noqa: E731
    return [name, r(a), r(b), None if a is None or b is None else r(a - b)]


def _percent_row(name: str, a: float | None, b: float | None) -> list:  # an accuracy: percent, change in points
    p = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    return [name, p(a), p(b), "n/a" if a is None or b is None else f"{100 * (a - b):+.1f} pts"]


def summary_rows(left: Side, right: Side) -> list[list]:
    """[score, left mean, right mean, left - right] per reward, then the judge's accuracy per attribute
    in percent (the change in points)."""
    rows = [_row(name, _mean(left.rewards[name].tolist()), _mean(right.rewards[name].tolist()))
            for name in left.rewards]
    if left.checks and left.checks[0] is not None:
        for attr in left.checks[0]:
            a, b = (_mean([float(c[attr]) for c in s.checks if c[attr] is not None]) for s in (left, right))
            if a is not None:
                rows.append(_percent_row(f"judge: {attr}", a, b))
    return rows


def grid_png(left: Side, right: Side, prompt: str, seeds: list[int], path: Path) -> Path:
    """Both sides next to each other, each image captioned with its seed, scores, the judge's verdict and its
    text plan (a few lines; the gallery's caption and the JSON hold it whole); written to `path`."""
    cols = min(len(seeds), 4)

    def cells(side: Side) -> list[Cell]:
        out = []
        for i, img in enumerate(to_uint8(side.images)):
            text = [f"seed {seeds[i]}"] + [f"{name[:14]} {float(v[i]):.3g}" for name, v in side.rewards.items()]
            text += [f"{name[:8]} ✗ {', '.join(dict.fromkeys(k for k, _ in v[i]))}"[:22]
                     for name, v in side.reasons.items() if v[i]]
            if side.checks[i] is not None:
                text.append("judge: " + ("correct" if side.checks[i]["correct"] else "wrong"))
            text += plan_lines(side.plans[i] if side.plans is not None else None, 22)
            out.append(Cell(img, text))
        return out

    left_cells, right_cells = cells(left), cells(right)
    # a short last row is padded on the left side, so the right side stays under its heading
    rows = [[*left_cells[r:r + cols], *[None] * (r + cols - len(seeds)), *right_cells[r:r + cols]]
            for r in range(0, len(seeds), cols)]
    sheet = paint_grid(rows, title=f"{prompt!r}   seeds {seeds[0]}..{seeds[-1]}",
                       headings=[(0, left.label), (cols, right.label)], scale=GRID_SCALE, split=cols, split_gap=24)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path
