"""`grpo-vision serve-reward`: registered rewards over HTTP, for a run's `remote` reward (rewards/remote.py, which
also defines the wire format), and `bench reward-server`, its images/s.

    grpo-vision serve-reward geneval --config my.yaml --port 8000
    GET /health   {"status": "ok", "rewards": [...]}              200 once the rewards' models are loaded
    GET /info     {"version", "rewards": [{"name", "options"}], "max_batch"}
    POST /score[/NAME]  {"images": [base64 PNG], "prompts": [...], "metadata": [...]}
                  -> {"scores": [float or null], "reward", "options", "version"}; 4xx/500 {"error": "..."}

FastAPI + uvicorn rather than litserve: both are installed already (gradio, which the demo needs, depends on them),
so serving adds no dependency; litserve would add one, and what it brings beyond them (a request batcher, worker
processes per device) is, for one reward model per server, the 40 lines of `Batcher` below.
Requests that arrive while the reward is busy wait, and are then scored together in one call of up to
`max_batch` images (the dynamic batching of Triton and litserve): a reward model runs one call at a time, and a
bigger call fills it better than several small ones.
"""

import asyncio  # no `from __future__ import annotations`: FastAPI reads the request model from make_app's closures
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from grpo_vision import __version__
from grpo_vision.config import ConfigError
from grpo_vision.rewards import CompositeReward, RewardError
from grpo_vision.rewards.base import reward_options
from grpo_vision.rewards.remote import images_from_base64, scores_to_json


@dataclass
class Job:
    images: torch.Tensor  # [n, 3, H, W] in [0, 1]
    prompts: list[str]  # [n]
    metadata: list[dict]  # [n]
    done: asyncio.Future  # set to the scores [n], or to the reward's error


class Batcher:
    """One reward's queue: `submit` waits for the scores of one request; `run` scores the waiting requests of one
    image size together, up to `max_batch` images a call (a request larger than that is scored alone)."""

    def __init__(self, score: Callable[[torch.Tensor, list[str], list[dict]], torch.Tensor], max_batch: int):
        self.score, self.max_batch = score, max_batch
        self.pending: list[Job] = []
        self.wake = asyncio.Event()
        self.calls = 0  # reward calls made (a test reads how requests were merged)

    async def submit(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        job = Job(images, prompts, metadata, asyncio.get_running_loop().create_future())
        self.pending.append(job)
        self.wake.set()
        return await job.done

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.pending:
                jobs = self._take()
                try:  # in a thread: the server still answers /health while a model scores
                    scores = await asyncio.to_thread(self.score, torch.cat([j.images for j in jobs]),
                                                     [p for j in jobs for p in j.prompts],
                                                     [m for j in jobs for m in j.metadata])
                    self.calls += 1
                except Exception as e:  # the reward failed: every request of the call gets its error
                    for j in jobs:
                        if not j.done.done():  # a client that went away cancelled its own
                            j.done.set_exception(e)
                    continue
                start = 0
                for j in jobs:
                    if not j.done.done():
                        j.done.set_result(scores[start:start + len(j.prompts)])
                    start += len(j.prompts)

    def _take(self) -> list[Job]:
        """The first waiting request and those after it of the same image size that fit in `max_batch`."""
        first, *rest = self.pending
        taken, n, left = [first], len(first.prompts), []
        for job in rest:
            if job.images.shape[1:] == first.images.shape[1:] and n + len(job.prompts) <= self.max_batch:
                taken.append(job)
                n += len(job.prompts)
            else:
                left.append(job)
        self.pending = left
        return taken


def make_app(rewards: CompositeReward, max_batch: int):
    """The FastAPI app serving every reward of `rewards` (loaded already)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel

    options = {name: _options(name, rewards.options.get(name)) for name in rewards.names}
    batchers: dict[str, Batcher] = {}

    @asynccontextmanager
    async def lifespan(app):
        for name in rewards.names:  # made in the server's event loop, which their futures belong to
            batchers[name] = Batcher(lambda i, p, m, name=name: rewards.score(name, i, p, m), max_batch)
        tasks = [asyncio.create_task(b.run()) for b in batchers.values()]
        app.state.batchers = batchers
        yield
        for task in tasks:
            task.cancel()

    app = FastAPI(title="grpo-vision reward server", version=__version__, lifespan=lifespan)

    class ScoreRequest(BaseModel):
        images: list[str]  # base64 PNG, one per image
        prompts: list[str]  # one per image
        metadata: list[dict] | None = None  # one per image (None: {} each)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message, "version": __version__}, status_code=status)

    @app.get("/health")
    def health():
        return {"status": "ok", "rewards": rewards.names}

    @app.get("/info")
    def info():
        return {"version": __version__, "max_batch": max_batch,
                "rewards": [{"name": n, "options": options[n]} for n in rewards.names]}

    async def score(name: str, request: ScoreRequest):
        if name not in batchers:
            return error(404, f"this server serves {', '.join(rewards.names)}, not {name!r}: POST /score/NAME")
        n = len(request.images)
        metadata = request.metadata if request.metadata is not None else [{} for _ in range(n)]
        if len(request.prompts) != n or len(metadata) != n:
            return error(422, f"{n} images, {len(request.prompts)} prompts and {len(metadata)} metadata: give one "
                              "of each per image")
        try:
            images = await asyncio.to_thread(images_from_base64, request.images)
        except ValueError as e:
            return error(400, str(e))
        try:
            scores = await batchers[name].submit(images, request.prompts, metadata) if n else torch.zeros(0)
        except RewardError as e:
            print(f"[serve-reward] {e}", file=sys.stderr, flush=True)
            return error(500, str(e))
        return {"scores": scores_to_json(scores), "reward": name, "options": options[name], "version": __version__}

    @app.post("/score")
    async def score_only(request: ScoreRequest):
        if len(rewards.names) != 1:
            return error(404, f"this server serves {', '.join(rewards.names)}: POST /score/NAME (the remote reward's "
                              "`reward` option)")
        return await score(rewards.names[0], request)

    @app.post("/score/{name}")
    async def score_named(name: str, request: ScoreRequest):
        return await score(name, request)

    return app


def _options(name: str, given: dict | None) -> dict:
    """Reward `name`'s options as its dataclass holds them, defaults filled in ({} for a reward with none)."""
    parsed = reward_options(name, given)
    return dataclasses.asdict(parsed) if dataclasses.is_dataclass(parsed) else {}


def build_rewards(names: Sequence[str], cfg, device: str) -> CompositeReward:
    """The rewards `names` with the config's reward.options, loaded (a missing model file stops here)."""
    if not names:
        raise ConfigError("serve-reward: name at least one reward")
    served = dataclasses.replace(cfg.reward, weights={n: 1.0 for n in names}, monitor=[])
    return CompositeReward.from_config(served, device).load()


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port`; ConfigError in one line when it cannot be (the port taken)."""
    try:
        sock = socket.create_server((host, port))
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)  # create_server's strerror repeats the address
        raise ConfigError(f"serve-reward: cannot listen on {host}:{port} ({why}); give another --port "
                          "or --host") from None
    return sock


def serve(rewards: CompositeReward, host: str, port: int, max_batch: int) -> None:
    """Serve until Ctrl-C; a line on stdout once it listens."""
    import uvicorn

    sock = listen(host, port)
    server = uvicorn.Server(uvicorn.Config(make_app(rewards, max_batch), log_level="warning"))
    print(f"[serve-reward] {', '.join(rewards.names)} on http://{host}:{sock.getsockname()[1]} (POST /score, "
          f"GET /info, GET /health); Ctrl-C stops", flush=True)
    server.run(sockets=[sock])


# ---------------------------------------------------------------------------- a server process, and its bench


def spawn(args: Sequence[str], port: int, wait: float = 60.0) -> tuple[subprocess.Popen, str]:
    """`grpo-vision serve-reward ARGS --port PORT` in a new process on loopback, and its URL once /health answers."""
    import httpx

    command = [sys.executable, "-m", "grpo_vision.cli", "serve-reward", *args, "--port", str(port)]
    log = tempfile.TemporaryFile("w+")  # not a pipe: a server that writes much would block on a full one
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + wait
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"serve-reward exited with {process.returncode}: {log.read().strip()}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"serve-reward did not answer /health within {wait:g} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_reward_server(names: Sequence[str], overrides: Sequence[str], config: str, batch: int, size: int,
                        repeats: int, clients: int) -> dict:
    """Images/s of reward `names[0]` scored in this process and through a server process on loopback (PNG, HTTP,
    the batcher), one client and `clients` at once, on `batch` random `size` x `size` images; medians of
    `repeats`."""
    from concurrent.futures import ThreadPoolExecutor

    from grpo_vision.config import load_config
    from grpo_vision.rewards import make_reward
    from grpo_vision.rewards.base import RewardContext

    cfg = load_config(config or None, list(overrides))
    name = names[0]
    local = build_rewards([name], cfg, "cpu")
    images = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(0))
    images = images.mul(255).round().div(255)  # 8-bit pixels: the server scores the very same values
    prompts, metadata = [f"a picture {i}" for i in range(batch)], [{} for _ in range(batch)]
    config_args = ["--config", config] if config else []
    process, url = spawn([name, *config_args, *overrides, "--max-batch", str(batch * clients)], free_port())
    try:
        remote = make_reward("remote", RewardContext(batch_size=batch), {"url": url, "timeout": 600.0})

        def timed(fn) -> float:
            fn()  # warm-up: the model's first call, the connection
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return sorted(times)[len(times) // 2]

        in_process = timed(lambda: local.score(name, images, prompts, metadata))
        one = timed(lambda: remote(images, prompts, metadata))
        with ThreadPoolExecutor(clients) as pool:
            many = timed(lambda: list(pool.map(lambda _: remote(images, prompts, metadata), range(clients))))
        same = torch.equal(remote(images, prompts, metadata), local.score(name, images, prompts, metadata))
    finally:
        process.terminate()
        process.wait(timeout=30)
    return {"reward": name, "batch": batch, "size": size, "repeats": repeats, "clients": clients,
            "images_per_s_in_process": round(batch / in_process, 1),
            "images_per_s_server_one_client": round(batch / one, 1),
            f"images_per_s_server_{clients}_clients": round(batch * clients / many, 1),
            "overhead_ms_per_call": round(1000 * (one - in_process), 1), "remote_equals_in_process": same,
            "torch_threads": torch.get_num_threads()}
