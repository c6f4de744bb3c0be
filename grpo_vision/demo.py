"""The Gradio demo: two checkpoints of a run (or its reference) on the same prompt and seeds.

    grpo-vision demo runs/shapes_grpo [--host 127.0.0.1] [--port 7860]

Each side picks a checkpoint step or the run's reference; image i of both sides is drawn with seed
`seed + i` (sampling draws per-image streams, so it depends on (prompt, seed) only, see
sampling.py), so differences between the galleries come from the weights. Every image is captioned
with each configured reward's score and, on ShapesWorld captions, the exact checker's verdict per
attribute. A second tab plots the run's metrics.jsonl.

The logic is plain functions (validation, scoring, summary, grid PNG, curves figure) and `DemoRun`,
which caches loaded checkpoints per step; `build_app` only wires them to Gradio components.
"""

from __future__ import annotations

import html
import math
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_vision.checkpoint import CheckpointError, checkpoint_steps, find_checkpoint
from grpo_vision.config import ConfigError
from grpo_vision.evaluate import LoadedRun, generate, load_run, reference_sampler, sampling_params
from grpo_vision.prompts import PromptsError
from grpo_vision.report import load_metrics
from grpo_vision.rewards import CompositeReward, RewardError
from grpo_vision.sampling import SamplingParams
from grpo_vision.images import to_uint8

MAX_IMAGES = 16  # images per side
MAX_PROMPT_CHARS = 200  # longer prompts are refused before tokenising
MAX_SEED = 2**32 - 1
EXAMPLES_PER_SPLIT = 6  # clickable prompts from each of the run's train and eval sets
REFERENCE = "reference"  # the step picker's entry for the run's reference
CACHED_STEPS = 4  # checkpoints kept loaded besides the latest (least recently used ones are dropped)
GRID_SCALE = 2  # pixels per image pixel in the downloadable grid (nearest neighbour)
# 64 px images shown large without blur, each caption (scores, checker) in full under its thumbnail.
# The class names are Gradio 6's gallery internals: if they change, captions fall back to Gradio's overlay.
CSS = """.pixelated img { image-rendering: pixelated; }
.pixelated .thumbnail-item { aspect-ratio: auto; height: auto; }
.pixelated .thumbnail-item > img { aspect-ratio: 1; height: auto; }
.pixelated .caption-label { position: static; white-space: pre-line; max-width: 100%; font-size: 11px; }
.pixelated .fixed-height { min-height: 0; }"""
RUN_HINT = "pass a directory written by `grpo-vision train`, e.g. runs/shapes_grpo after " \
           "`grpo-vision train configs/shapes.yaml`"


class DemoInputError(ValueError):
    """Bad input from the page or the API; the message is shown to the user as it is."""


@dataclass
class Side:
    label: str  # "step 2" or "reference (...)"
    images: torch.Tensor  # [n, 3, H, W] in [0, 1]
    rewards: dict[str, torch.Tensor]  # reward name -> [n] raw values, NaN = does not apply
    checks: list[dict | None]  # per image: the checker's verdict per attribute; None = not a ShapesWorld caption


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

    def __init__(self, run_dir: str | Path):
        self.run_dir = check_run_dir(run_dir)
        self._runs: dict[int, LoadedRun] = {}
        self._base = None  # the base policy, when the run has no reference (train.reference: none)
        self.lock = threading.Lock()  # one generation at a time: a LoRA reference toggles shared weights
        self.latest = checkpoint_steps(self.run_dir)[-1]  # "reference" is the reference saved with this step
        latest = self.load(self.latest)
        self.cfg, self.bundle = latest.cfg, latest.bundle
        self.rewards = CompositeReward.from_config(self.cfg.reward, world=self.bundle.world).load()
        self.examples = run_examples(self.cfg, self.bundle)
        self.reference_label = reference_label(latest.reference.mode, latest.reference.synced)

    def load(self, step: int) -> LoadedRun:
        run = self._runs.pop(step, None) or load_run(self.run_dir, step)
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
            if run.reference.mode == "none":  # reference_sampler would reload the base model every call
                if self._base is None:
                    self._base = reference_sampler(run.policy, run.reference, run.cfg)[0]
                return self._base, nullcontext(), self.reference_label
            return *reference_sampler(run.policy, run.reference, run.cfg), self.reference_label
        step = choice.removeprefix("step ").strip()
        if not choice.startswith("step ") or not step.isdigit():
            raise DemoInputError(f"unknown checkpoint {choice!r}; choose one of: {', '.join(self.choices())}")
        try:
            find_checkpoint(self.run_dir, int(step))
        except FileNotFoundError as e:
            raise DemoInputError(str(e)) from None
        return self.load(int(step)).policy, nullcontext(), choice

    def side(self, choice: str, prompt: str, seeds: list[int], params: SamplingParams) -> Side:
        prompts = [prompt] * len(seeds)
        with self.lock:
            model, ctx, label = self.sampler(choice)
            with ctx:
                images = generate(model, self.bundle.tokenizer, prompts, seeds, params)
            raw = self.rewards(images, prompts, [{} for _ in prompts]).raw
        return Side(label, images, raw, verdicts(images, prompt))


def reference_label(mode: str, synced: bool) -> str:
    what = {"frozen": "a frozen copy of the base policy", "lora": "the policy with its LoRA adapters disabled",
            "none": "this run has none, train.reference: none; showing the base policy"}[mode]
    return f"reference ({what}{', synced from the policy during training' if synced else ''})"


def run_examples(cfg, bundle) -> dict[str, list[str]]:
    """A few of the run's training and evaluation prompts (on ShapesWorld: seen and held-out)."""
    from grpo_vision.loading import train_and_eval_prompts

    try:
        seen, held_out = train_and_eval_prompts(cfg, bundle)
    except (ConfigError, PromptsError, FileNotFoundError):  # examples are a convenience, not a requirement
        return {}
    names = ("training prompts (world split)", "held-out prompts (never trained on)") if bundle.world else \
        ("training prompts", "evaluation prompts")
    return {names[0]: [e.prompt for e in seen[:EXAMPLES_PER_SPLIT]],
            names[1]: [e.prompt for e in held_out[:EXAMPLES_PER_SPLIT]]}


# ---------------------------------------------------------------------------- validation


def clean_prompt(prompt, policy, shapes: bool) -> str:
    """The prompt with whitespace collapsed (lower case on ShapesWorld), or DemoInputError saying why not."""
    text = " ".join(str(prompt or "").split())
    if not text:
        raise DemoInputError("Enter a prompt, e.g. 'a red circle'.")
    if len(text) > MAX_PROMPT_CHARS:
        raise DemoInputError(f"The prompt has {len(text)} characters; at most {MAX_PROMPT_CHARS} are accepted.")
    if shapes:
        from grpo_vision.policy import unknown_words
        from grpo_vision.shapes.scene import CaptionError, parse_caption

        text = text.lower()
        unknown = unknown_words(policy, text)  # a world's policy knows exactly the ShapesWorld words
        if unknown:
            raise DemoInputError(f"Not ShapesWorld words: {', '.join(map(repr, unknown))}. Captions look like "
                                 "'a red circle', 'a small blue square', 'a green triangle on a black background' "
                                 "or 'a red circle left of a blue square'.")
        try:
            parse_caption(text)
        except CaptionError as e:
            raise DemoInputError(str(e)) from None
    try:
        policy.encode_prompts([text])
    except ValueError as e:
        raise DemoInputError(str(e)) from None
    return text


def _whole(value, name: str, lo: int, hi: int) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number == int(number) and lo <= number <= hi):
        raise DemoInputError(f"{name} must be a whole number from {lo} to {hi}, got {value!r}.")
    return int(number)


def sampling_request(seed, n, cfg_scale, temperature, top_k, base: SamplingParams) -> tuple[list[int], SamplingParams]:
    """Seeds `[seed, seed + n)` and the sampling parameters (top-p and log-prob mode from the run)."""
    n = _whole(n, "The number of images", 1, MAX_IMAGES)
    seed = _whole(seed, "The seed", 0, MAX_SEED - n)
    top_k = _whole(top_k, "Top-k", 0, 1 << 20)
    for name, value in (("The CFG scale", cfg_scale), ("The temperature", temperature)):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise DemoInputError(f"{name} must be a number >= 0, got {value!r}.")
    if temperature == 0:
        raise DemoInputError("The temperature must be > 0 (lower it towards 0.1 for less varied images).")
    return [seed + i for i in range(n)], SamplingParams(float(cfg_scale), float(temperature), top_k, base.top_p,
                                                        base.logprob_mode)


# ---------------------------------------------------------------------------- scores and pictures


def verdicts(images: torch.Tensor, prompt: str) -> list[dict | None]:
    """The exact checker's per-attribute verdicts for each image (None: not a ShapesWorld caption)."""
    from grpo_vision.shapes.checker import check
    from grpo_vision.shapes.scene import CaptionError, as_policy_reads

    try:
        return [check(img, as_policy_reads(prompt)).as_dict() for img in images]
    except CaptionError:
        return [None] * len(images)


def caption(side: Side, i: int) -> str:
    """'clip 0.312 · aesthetic 5.41 · shapes_exact 1' and, on ShapesWorld, '✓ count ✓ color ✗ shape'."""
    scores = " · ".join(f"{name} {'n/a' if math.isnan(v[i]) else f'{float(v[i]):.3g}'}"
                        for name, v in side.rewards.items())
    check = side.checks[i]
    if check is None:
        return scores
    marks = " ".join(f"{'✓' if ok else '✗'} {a}" for a, ok in check.items() if ok is not None and a != "correct")
    return f"{scores}\n{marks}"


def side_json(side: Side, seeds: list[int]) -> dict:
    """Per-image scores and verdicts, JSON-ready (NaN -> None)."""
    rewards = {k: [None if math.isnan(x) else x for x in v.tolist()] for k, v in side.rewards.items()}
    return {"label": side.label, "seeds": seeds, "rewards": rewards, "checker": side.checks}


def _mean(values: list[float]) -> float | None:
    v = [x for x in values if not math.isnan(x)]
    return sum(v) / len(v) if v else None


def _row(name: str, a: float | None, b: float | None) -> list:
    r = lambda x: None if x is None else round(x, 5)  # noqa: E731
    return [name, r(a), r(b), None if a is None or b is None else r(a - b)]


def summary_rows(left: Side, right: Side) -> list[list]:
    """[score, left mean, right mean, left - right] per reward, then the checker's accuracy per attribute."""
    rows = [_row(name, _mean(left.rewards[name].tolist()), _mean(right.rewards[name].tolist()))
            for name in left.rewards]
    if left.checks and left.checks[0] is not None:
        for attr in left.checks[0]:
            a, b = (_mean([float(c[attr]) for c in s.checks if c[attr] is not None]) for s in (left, right))
            if a is not None:
                rows.append(_row(f"checker: {attr}", a, b))
    return rows


def grid_png(left: Side, right: Side, prompt: str, seeds: list[int], path: Path) -> Path:
    """Both sides next to each other, each image captioned with its scores; written to `path`."""
    from PIL import Image, ImageDraw

    n, cols = len(seeds), min(len(seeds), 4)
    rows = math.ceil(n / cols)
    size = left.images.shape[-1] * GRID_SCALE
    line, lines = 11, len(left.rewards) + 1  # caption: one line per reward, the seed, the checker verdict
    cell_w, cell_h, gap, head = size + 6, size + line * (lines + 1) + 6, 24, 34
    sheet = Image.new("RGB", (2 * cols * cell_w + gap + 8, head + rows * cell_h), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((4, 2), f"{prompt!r}   seeds {seeds[0]}..{seeds[-1]}", fill="black")
    for k, side in enumerate((left, right)):
        x_side = 4 + k * (cols * cell_w + gap)
        draw.text((x_side, 18), side.label, fill="black")
        for i, img in enumerate(to_uint8(side.images)):
            x, y = x_side + (i % cols) * cell_w, head + (i // cols) * cell_h
            sheet.paste(Image.fromarray(img).resize((size, size), Image.NEAREST), (x, y))
            text = [f"seed {seeds[i]}"] + [f"{name[:14]} {float(v[i]):.3g}" for name, v in side.rewards.items()]
            if side.checks[i] is not None:
                text.append("checker " + ("correct" if side.checks[i]["correct"] else "wrong"))
            for j, t in enumerate(text):
                draw.text((x, y + size + 2 + j * line), t, fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path


def curves_figure(metrics: list[dict]):
    """One panel per `reward/<name>/mean` and one for `loss/kl`, over steps (as report.plot_curves)."""
    from matplotlib.figure import Figure  # no pyplot: no global state shared between request threads
    from matplotlib.ticker import MaxNLocator

    keys = sorted({k for m in metrics for k in m if k.startswith("reward/") and k.endswith("/mean")}) + ["loss/kl"]
    cols = min(len(keys), 3)
    fig = Figure(figsize=(3.6 * cols, 2.8 * math.ceil(len(keys) / cols)))
    if not metrics:
        fig.text(0.5, 0.5, "no metrics.jsonl yet: the run has not logged a step", ha="center")
        return fig
    steps = [m["step"] for m in metrics]
    for i, key in enumerate(keys):
        ax = fig.add_subplot(math.ceil(len(keys) / cols), cols, i + 1)
        ax.plot(steps, [math.nan if m.get(key) is None else m[key] for m in metrics], lw=1, marker=".")
        ax.set_title(key.replace("/mean", ""), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------- the app


def build_app(run: DemoRun | str | Path, out_dir: str | Path | None = None):
    """The gr.Blocks app; `out_dir` holds the downloadable grids (default: a fresh temporary directory)."""
    import tempfile

    import gradio as gr  # imported here: a bad run directory fails before paying for it
    import pandas as pd

    run = run if isinstance(run, DemoRun) else DemoRun(run)
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="grpo_demo_"))
    base = sampling_params(run.cfg)
    calls = iter(range(1 << 62))  # numbers the grid files, so concurrent downloads never collide

    def compare(prompt, seed, n, cfg_scale, temperature, top_k, left_choice, right_choice):
        start = time.perf_counter()
        try:
            text = clean_prompt(prompt, run.bundle.policy, run.bundle.world is not None)
            seeds, params = sampling_request(seed, n, cfg_scale, temperature, top_k, base)
            left, right = (run.side(c, text, seeds, params) for c in (left_choice, right_choice))
        except (DemoInputError, RewardError, CheckpointError, FileNotFoundError) as e:
            # the message, not a stack trace (a bad prompt, a failing reward, a checkpoint deleted or cut
            # short since the page loaded); escaped, because gr.Error renders HTML
            raise gr.Error(html.escape(str(e), quote=False), print_exception=False) from None
        path = grid_png(left, right, text, seeds, out_dir / f"compare_{next(calls):05d}.png")
        table = pd.DataFrame(summary_rows(left, right), columns=["score", "left", "right", "left - right"])
        details = {"left": side_json(left, seeds), "right": side_json(right, seeds)}
        status = (f"**left:** {left.label} · **right:** {right.label} · prompt {text!r} · {len(seeds)} images each, "
                  f"seeds {seeds[0]}..{seeds[-1]} · {time.perf_counter() - start:.2f} s")
        galleries = ([(img, caption(side, i)) for i, img in enumerate(to_uint8(side.images))] for side in (left, right))
        return *galleries, table, str(path), status, details

    def refresh(left_choice, right_choice):  # new checkpoints of a running job; the picks stay if they still exist
        choices = run.choices()
        return (gr.Dropdown(choices=choices, value=left_choice if left_choice in choices else choices[0]),
                gr.Dropdown(choices=choices, value=right_choice if right_choice in choices else REFERENCE),
                curves_figure(load_metrics(run.run_dir)))

    choices = run.choices()
    r = run.cfg.sample
    with gr.Blocks(title=f"grpo_vision demo: {run.run_dir.name}", analytics_enabled=False) as app:
        gr.Markdown(f"## GRPO demo: `{run.run_dir}`\nPolicy `{run.cfg.policy.path}`, latest checkpoint step "
                    f"{run.latest}, {run.reference_label}. Image *i* of both sides uses seed + *i*.")
        with gr.Tab("Compare"):
            with gr.Row():
                prompt = gr.Textbox(label="prompt", placeholder="a red circle left of a blue square", scale=4,
                                    elem_id="prompt")
                button = gr.Button("Generate", variant="primary", scale=1, elem_id="generate")
            for label, prompts in run.examples.items():
                gr.Examples([[p] for p in prompts], inputs=[prompt], label=label)
            with gr.Row():
                seed = gr.Number(0, label="seed", precision=0)
                n = gr.Number(4, label=f"images per side (1 to {MAX_IMAGES})", precision=0)
                cfg_scale = gr.Slider(0.0, 10.0, r.cfg_scale, step=0.25, label="CFG scale (1 = off)")
                temperature = gr.Slider(0.05, 3.0, r.temperature, step=0.05, label="temperature")
                top_k = gr.Slider(0, run.bundle.policy.codebook_size, r.top_k, step=1, label="top-k (0 = off)")
            with gr.Row():
                sides = []
                for k, default in enumerate((choices[0], REFERENCE)):
                    with gr.Column():
                        pick = gr.Dropdown(choices, value=default, label=("left", "right")[k],
                                           allow_custom_value=True)  # DemoRun.sampler names what exists
                        gallery = gr.Gallery(label=("left", "right")[k], columns=4, format="png", object_fit="contain",
                                             elem_id=f"gallery-{('left', 'right')[k]}", elem_classes="pixelated",
                                             height="auto")
                        sides.append((pick, gallery))
            status = gr.Markdown(elem_id="status")
            summary = gr.Dataframe(label="mean per side (rewards; checker accuracy per attribute)", interactive=False)
            download = gr.DownloadButton("Download side-by-side PNG", elem_id="download")
            with gr.Accordion("per-image scores (JSON)", open=False):
                details = gr.JSON()
        with gr.Tab("Training curves"):
            plot = gr.Plot(label="reward and KL over steps (metrics.jsonl)")
            reload = gr.Button("Reload checkpoints and metrics")
        inputs = [prompt, seed, n, cfg_scale, temperature, top_k, sides[0][0], sides[1][0]]
        outputs = [sides[0][1], sides[1][1], summary, download, status, details]
        button.click(compare, inputs, outputs, api_name="generate")
        prompt.submit(compare, inputs, outputs, api_visibility="private")
        pickers_and_plot = [sides[0][0], sides[1][0], plot]
        reload.click(refresh, pickers_and_plot[:2], pickers_and_plot, api_name="refresh")
        app.load(refresh, pickers_and_plot[:2], pickers_and_plot, api_visibility="private")
    return app


def serve(run: DemoRun | str | Path, host: str = "127.0.0.1", port: int | None = None) -> None:
    """Serve the app until Ctrl-C (port None: the first free one from 7860)."""
    run = run if isinstance(run, DemoRun) else DemoRun(run)
    print(f"[demo] {run.run_dir}: checkpoints {', '.join(run.choices()[:-1])}; {run.reference_label}", flush=True)
    build_app(run).launch(server_name=host, server_port=port, css=CSS, footer_links=["api", "settings"])
