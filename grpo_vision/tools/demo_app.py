"""The demo's Gradio app: wires tools/demo.py's functions to components; no logic of its own.

    grpo-vision demo runs/shapes_grpo [--host 127.0.0.1] [--port 7860]
"""

from __future__ import annotations

import atexit
import html
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from grpo_vision.run.checkpoint import CheckpointError
from grpo_vision.tools.demo import (MAX_IMAGES, MAX_PROMPT_CHARS, REFERENCE, DemoInputError, DemoRun, caption,
                                    clean_prompt, grid_png, sampling_request, side_json, summary_rows)
from grpo_vision.images import to_uint8
from grpo_vision.run.metrics import load_metrics
from grpo_vision.evaluation.plots import curves_figure
from grpo_vision.rewards import RewardError
from grpo_vision.sampling import SamplingParams

# 64 px images shown large without blur, each caption (scores, verdicts) in full under its thumbnail.
# The class names are Gradio 6's gallery internals: if they change, captions fall back to Gradio's overlay.
CSS = """.pixelated img { image-rendering: pixelated; }
.pixelated .thumbnail-item { aspect-ratio: auto; height: auto; }
.pixelated .thumbnail-item > img { aspect-ratio: 1; height: auto; }
.pixelated .caption-label { position: static; white-space: pre-line; max-width: 100%; font-size: 11px; }
.pixelated .fixed-height { min-height: 0; }"""
COLUMNS = ["score", "left", "right", "left - right"]
# The app takes no file, yet Gradio serves an upload route to every page: a cap keeps it from filling the disk
MAX_UPLOAD = "1mb"
# Request bodies: a click is a prompt of at most 200 characters and seven small values, well under 64 KiB; Gradio
# would take 50 MB into its queue. The upload route's files are capped by MAX_UPLOAD, its body here.
MAX_BODY, MAX_UPLOAD_BODY = 64 << 10, 4 << 20
# Gradio keeps a copy of every gallery image and grid it serves: swept every 10 min once an hour old, all at exit
CACHE_SWEEP = (600, 3600)
EMPTY_STATE = ("Nothing compared yet. Type a prompt or click an example, then **Generate**: each side samples the "
               "same seeds, so what differs between them is the checkpoint. Under each image: its rewards and, where "
               "the world has a judge, ✓ / ✗ per attribute.")


def build_app(run: DemoRun | str | Path, out_dir: str | Path | None = None):
    """The gr.Blocks app; `out_dir` holds the downloadable grids (default: a temporary one, removed at exit)."""
    import gradio as gr  # imported here: a bad run directory fails before paying for it
    import pandas as pd

    run = run if isinstance(run, DemoRun) else DemoRun(run)
    out_dir = Path(out_dir) if out_dir else temporary_dir()
    base = SamplingParams.from_config(run.cfg.sample)
    calls = iter(range(1 << 62))  # numbers the grid files, so concurrent downloads never collide

    def compare(prompt, seed, n, cfg_scale, temperature, top_k, left_choice, right_choice):
        start = time.perf_counter()
        try:
            text = clean_prompt(prompt, run.bundle.policy, run.bundle.judge)
            seeds, params = sampling_request(seed, n, cfg_scale, temperature, top_k, base)
            left, right = (run.side(c, text, seeds, params) for c in (left_choice, right_choice))
        except (DemoInputError, RewardError, CheckpointError, FileNotFoundError) as e:
            # the message, not a stack trace (a bad prompt, a failing reward, a checkpoint deleted or cut
            # short since the page loaded); escaped, because gr.Error renders HTML
            raise gr.Error(html.escape(str(e), quote=False), print_exception=False) from None
        path = grid_png(left, right, text, seeds, out_dir / f"compare_{next(calls):05d}.png")
        table = pd.DataFrame(summary_rows(left, right), columns=COLUMNS)
        details = {"left": side_json(left, seeds), "right": side_json(right, seeds)}
        status = (f"**left:** {left.label} · **right:** {right.label} · prompt {text!r} · {len(seeds)} images each, "
                  f"seeds {seeds[0]}..{seeds[-1]} · {time.perf_counter() - start:.2f} s" +
                  "".join(f" · **{name} n/a:** {html.escape(why, quote=False)}" for name, why in {**left.notes, **right.notes}.items()))
        galleries = ([(img, caption(side, i)) for i, img in enumerate(to_uint8(side.images))] for side in (left, right))
        return *galleries, table, str(path), status, details

    def refresh(left_choice, right_choice):  # new checkpoints of a running job; the picks stay if they still exist
        choices = run.choices()
        return (gr.Dropdown(choices=choices, value=left_choice if left_choice in choices else choices[0]),
                gr.Dropdown(choices=choices, value=right_choice if right_choice in choices else REFERENCE),
                curves_figure(load_metrics(run.run_dir)))

    choices = run.choices()
    r = run.cfg.sample
    with gr.Blocks(title=f"grpo_vision demo: {run.run_dir.name}", analytics_enabled=False,
                   delete_cache=CACHE_SWEEP) as app:
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
            status = gr.Markdown(EMPTY_STATE, elem_id="status", label="status")
            summary = gr.Dataframe(pd.DataFrame(columns=COLUMNS), label="mean per side (rewards; the judge's "
                                   "accuracy per attribute)", interactive=False)
            download = gr.DownloadButton("Download side-by-side PNG", elem_id="download", label="side-by-side PNG")
            with gr.Accordion("per-image scores (JSON)", open=False):
                details = gr.JSON(label="per-image scores")
        with gr.Tab("Training curves"):
            plot = gr.Plot(label="reward and KL over steps (metrics.jsonl)")
            reload = gr.Button("Reload checkpoints and metrics")
        inputs = [prompt, seed, n, cfg_scale, temperature, top_k, sides[0][0], sides[1][0]]
        outputs = [sides[0][1], sides[1][1], summary, download, status, details]
        # preprocess=False: compare gets the values as sent and checks them itself (sampling_request); Gradio's own
        # conversion failed on a seed of "abc" with a traceback on the console and "Error" for the caller
        button.click(compare, inputs, outputs, api_name="generate", preprocess=False)
        prompt.submit(compare, inputs, outputs, api_visibility="private", preprocess=False)
        pickers_and_plot = [sides[0][0], sides[1][0], plot]
        reload.click(refresh, pickers_and_plot[:2], pickers_and_plot, api_name="refresh")
        app.load(refresh, pickers_and_plot[:2], pickers_and_plot, api_visibility="private")
    return app


def temporary_dir() -> Path:
    """A fresh directory for the grids, removed when the process exits (Ctrl-C and SIGTERM included)."""
    path = Path(tempfile.mkdtemp(prefix="grpo_demo_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def launch(app, host: str = "127.0.0.1", port: int | None = None) -> None:
    """Serve `app` in the background with the demo's settings (port None: the first free one from 7860)."""
    from starlette.middleware import Middleware

    # quiet: Gradio's own start-up lines suggest share=True, a public link this command does not offer
    app.launch(server_name=host, server_port=port, css=CSS, footer_links=["api", "settings"], quiet=True,
               prevent_thread_lock=True, max_file_size=MAX_UPLOAD,
               app_kwargs={"middleware": [Middleware(BodyLimit, limit=MAX_BODY, upload_limit=MAX_UPLOAD_BODY)]})


class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes (`upload_limit` on Gradio's upload route), by its
    Content-Length before the app reads it, or, for a body sent without one, once that much has arrived."""

    def __init__(self, app, limit: int, upload_limit: int):
        self.app, self.limit, self.upload_limit = app, limit, upload_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.upload_limit if scope["path"].rstrip("/").endswith("/upload") else self.limit
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > limit:
            return await refuse_body(send, limit)
        received, refused, started = 0, False, False

        async def counted():
            nonlocal received, refused
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit and not refused:
                refused = True
                if not started:
                    await refuse_body(send, limit)
                return {"type": "http.disconnect"}  # the app stops reading, as if the client had gone
            return message

        async def guarded(message):
            nonlocal started
            if not refused:  # after a refusal, whatever the app answers is dropped
                started = started or message["type"] == "http.response.start"
                await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not refused:
                raise


async def refuse_body(send, limit: int) -> None:
    body = (f"request body over {limit} bytes, refused: the demo takes a prompt of at most {MAX_PROMPT_CHARS} "
            "characters and a few numbers").encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def serve(run: DemoRun | str | Path, host: str = "127.0.0.1", port: int | None = None) -> None:
    """Serve the app until Ctrl-C (port None: the first free one from 7860)."""
    run = run if isinstance(run, DemoRun) else DemoRun(run)
    print(f"[demo] {run.run_dir}: checkpoints {', '.join(run.choices()[:-1])}; {run.reference_label}", flush=True)
    app = build_app(run)
    launch(app, host, port)
    url = f"http://{host}:{app.server_port}"
    print(f"[demo] open {url} (Ctrl-C stops it); from another machine, tunnel it: ssh -L {app.server_port}:"
          f"127.0.0.1:{app.server_port} <this host>, then open http://127.0.0.1:{app.server_port} there "
          "(docs/security.md)", flush=True)
    # SIGTERM (kill, a job scheduler) stops it like Ctrl-C: Gradio's cache and the grids are removed on the way out
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        app.block_thread()
    finally:
        signal.signal(signal.SIGTERM, previous)
        app.close()
