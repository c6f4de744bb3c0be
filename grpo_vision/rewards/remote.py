"""A reward behind an HTTP server: the wire format, the calls with retries, and the `remote` reward.

    reward.options.remote: {url: "http://127.0.0.1:8000", timeout: 60, retries: 2, backoff: 1.0, batch_size: 64}

A reward that needs its own environment (GenEval's mmdet 2.x pins an old torch) or its own GPU (a 7B-30B judge)
runs in another process, `grpo-vision serve-reward NAME` (tools/reward_server.py), and a run scores with it
through `remote`. Flow-GRPO serves its GenEval and UnifiedReward the same way (flow_grpo/rewards.py,
`geneval_score`: a POST per batch of 64 to a reward-server); its wire is pickle (which runs code on load) and JPEG
(lossy), and it retries up to 1000 times, so a dead server hangs a run. Here the wire is JSON, PNG (lossless on 8-bit
pixels: the server scores the very pixels a PNG of the image holds) and a bounded number of tries:

    POST {url}/score  (or {url}/score/{reward} when the server serves several)
        {"images": [base64 PNG, ...], "prompts": [str, ...], "metadata": [dict, ...]}
    200 {"scores": [float or null, ...], "reward": NAME, "options": {...}, "version": "0.1.0"}

One score per image; null is NaN ("does not apply": JSON has no NaN). A failure (the server down or slow, an HTTP
error, an answer that is not JSON, lacks `scores`, has the wrong count or a non-number) is tried again after
`backoff` seconds, doubling each time, `retries` times; then the reward raises a RewardError naming the URL and what
came back, and training stops on it with a checkpoint (train.py), never a silent 0. A 4xx other than 408 / 429 is
not tried again: the request itself is what the server refuses.
"""

from __future__ import annotations

import base64
import io
import json
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from grpo_vision.config import ConfigError, GrpoVisionWarning
from grpo_vision.images import to_uint8
from grpo_vision.rewards.base import RewardContext, RewardError, RewardFn, register_reward

KEY = "reward.options.remote"
ALL_NAN_CALLS = 3  # answers in a row with NaN for every image before a warning (see `remote_reward`)


# ---------------------------------------------------------------------------- the wire format


def png_base64(images: torch.Tensor) -> list[str]:
    """float `[B, 3, H, W]` in [0, 1] -> one base64 PNG per image (8 bits a channel, rounded as to_uint8 does)."""
    from PIL import Image

    out = []
    for a in to_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(a).save(buffer, format="PNG", compress_level=1)  # lossless at any level; 1 is the fastest
        out.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return out


def images_from_base64(encoded: Sequence[str]) -> torch.Tensor:
    """The server's side of `png_base64`: float `[B, 3, H, W]` in [0, 1]; ValueError naming the first bad image."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    arrays = []
    for i, text in enumerate(encoded):
        try:
            with Image.open(io.BytesIO(base64.b64decode(text, validate=True))) as image:
                arrays.append(np.asarray(image.convert("RGB")))
        except (ValueError, UnidentifiedImageError, OSError) as e:
            raise ValueError(f"images[{i}] is not a base64 PNG ({type(e).__name__}: {e})") from None
    if len({a.shape for a in arrays}) > 1:
        raise ValueError(f"the images differ in size ({sorted({a.shape[:2] for a in arrays})}); send one size a call")
    if not arrays:
        return torch.zeros(0, 3, 1, 1)
    # contiguous, as the trainer's images are: a channels-last tensor convolves to other float roundings
    return (torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255).contiguous()  # [B, 3, H, W]


def scores_to_json(scores: torch.Tensor) -> list[float | None]:
    """`[B]` -> a JSON list, NaN as null."""
    return [None if math.isnan(v) else v for v in scores.double().tolist()]


def scores_from_json(answer: Any, count: int) -> torch.Tensor:
    """An answer's `scores` as `[count]` float32 (null -> NaN); BadAnswer saying what is wrong with it."""
    if not isinstance(answer, dict) or not isinstance(answer.get("scores"), list):
        keys = sorted(answer)[:6] if isinstance(answer, dict) else type(answer).__name__
        raise BadAnswer(f"an answer without a list 'scores' (got {_excerpt(json.dumps(keys))})")
    scores = answer["scores"]
    if len(scores) != count:
        raise BadAnswer(f"{len(scores)} scores for {count} images")
    bad = [s for s in scores if not (s is None or (isinstance(s, (int, float)) and not isinstance(s, bool)))]
    if bad:
        raise BadAnswer(f"scores that are not numbers or null ({_excerpt(json.dumps(bad[:3]))})")
    return torch.tensor([math.nan if s is None else float(s) for s in scores], dtype=torch.float32)


# ---------------------------------------------------------------------------- calls with retries


class BadAnswer(ValueError):
    """What came back is not what was asked for (the call is tried again, within its limits)."""


def post_json(client, url: str, body: dict, parse: Callable[[Any], Any], name: str, retries: int, backoff: float,
              headers: dict | None = None) -> Any:
    """`parse(answer)` of the JSON that a POST of `body` to `url` answers, tried `1 + retries` times with `backoff`
    seconds before the second try, doubling after; RewardError(name, "URL: what came back (tries)") when every try
    failed. `client` is an httpx.Client (its timeout is the call's)."""
    import httpx

    start, tries = time.monotonic(), 0
    while True:
        tries += 1
        again = True
        try:
            response = client.post(url, json=body, headers=headers)
            if response.status_code >= 400:
                again = response.status_code in (408, 429) or response.status_code >= 500
                raise BadAnswer(f"HTTP {response.status_code}: {_error_text(response)}")
            try:
                answer = response.json()
            except ValueError:
                raise BadAnswer(f"an answer that is not JSON ({_excerpt(response.text) or 'empty'})") from None
            return parse(answer)
        except httpx.TimeoutException:
            what = f"no answer within {client.timeout.read:g} s (timeout)"
        except httpx.ConnectError as e:  # refused, unknown host
            what = f"cannot connect ({type(e).__name__}: {_excerpt(str(e)) or 'connection failed'}); is the server up?"
        except httpx.TransportError as e:  # the connection broke mid-call (the server died while scoring)
            what = f"the connection failed ({type(e).__name__}: {_excerpt(str(e)) or 'no details'})"
        except BadAnswer as e:
            what = str(e)
        if not again or tries > retries:
            spent = time.monotonic() - start
            raise RewardError(name, f"{url}: {what} ({tries} {'try' if tries == 1 else 'tries'} in {spent:.1f} s"
                                    f"{'' if again else ', not retried: the server refused the request'})")
        time.sleep(backoff * 2 ** (tries - 1))


def _error_text(response) -> str:
    """The error a server put in its answer: FastAPI's `detail`, our `error`, or the start of the body."""
    try:
        answer = response.json()
    except ValueError:
        return _excerpt(response.text) or "empty body"
    if isinstance(answer, dict):
        for key in ("error", "detail", "message"):
            if answer.get(key):
                found = answer[key]
                return _excerpt(found if isinstance(found, str) else json.dumps(found))
    return _excerpt(json.dumps(answer))


def _excerpt(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def check_url(url: str, key: str, example: str) -> str:
    """`url` without a trailing slash; ConfigError when it is empty or not http(s)."""
    if not url:
        raise ConfigError(f"{key}.url is empty: give the server's address, e.g. {key}.url={example}")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{key}.url={url!r} is not an http:// or https:// address, e.g. {example}")
    return url.rstrip("/")


def check_limits(opts, key: str) -> None:
    """The call limits every HTTP reward shares, checked at once (a 0 timeout would fail every call)."""
    if not opts.timeout > 0:
        raise ConfigError(f"{key}.timeout={opts.timeout:g}: give the seconds a call may take, > 0")
    if opts.retries < 0 or opts.backoff < 0:
        raise ConfigError(f"{key}: retries={opts.retries} and backoff={opts.backoff:g} must be >= 0")


# ---------------------------------------------------------------------------- the reward


@dataclass
class RemoteOptions:
    url: str = ""  # the server's address, e.g. http://127.0.0.1:8000 (grpo-vision serve-reward NAME --port 8000)
    reward: str = ""  # which of the server's rewards ("" = the only one it serves)
    timeout: float = 60.0  # seconds one call may take before it counts as failed
    retries: int = 2  # tries after a failed one, each after a pause
    backoff: float = 1.0  # seconds before the first retry, doubling after each
    batch_size: int = 64  # images per call (a call carries one batch; the server may merge concurrent ones)


@register_reward("remote", options=RemoteOptions)
def remote_reward(ctx: RewardContext, opts: RemoteOptions) -> RewardFn:
    """The scores of a reward served over HTTP (`grpo-vision serve-reward`), one call per `batch_size` images.

    NaN passes through: a served reward may not apply (an OCR reward on a prompt without quoted text). NaN for
    every image of ALL_NAN_CALLS answers in a row is more likely a server scoring the wrong thing (another reward,
    a prompt field it does not read), so it warns once, naming the URL; it does not stop the run, since a
    stretch of prompts that no served reward applies to is legitimate, and the run's health already counts steps
    without signal (run/health.py)."""
    import httpx

    base = check_url(opts.url, KEY, "http://127.0.0.1:8000")
    check_limits(opts, KEY)
    if opts.batch_size < 1:
        raise ConfigError(f"{KEY}.batch_size={opts.batch_size}: give the images per call, >= 1")
    url = f"{base}/score" + (f"/{opts.reward}" if opts.reward else "")
    client = httpx.Client(timeout=opts.timeout)
    state = {"all_nan": 0, "warned": False}

    def reward(images, prompts, metadata):
        metadata = list(metadata) if metadata is not None else [{} for _ in prompts]
        out = []
        for i in range(0, len(prompts), opts.batch_size):
            n = len(prompts[i:i + opts.batch_size])
            body = {"images": png_base64(images[i:i + n]), "prompts": list(prompts[i:i + n]),
                    "metadata": [_jsonable(m) for m in metadata[i:i + n]]}
            scores = post_json(client, url, body, lambda answer: scores_from_json(answer, n), "remote",
                               opts.retries, opts.backoff)
            state["all_nan"] = state["all_nan"] + 1 if n and bool(scores.isnan().all()) else 0
            if state["all_nan"] >= ALL_NAN_CALLS and not state["warned"]:
                state["warned"] = True
                warnings.warn(f"{KEY}: {url} answered NaN (does not apply) for every image of {ALL_NAN_CALLS} calls "
                              "in a row; check that it serves the reward you meant (GET /info)", GrpoVisionWarning,
                              stacklevel=2)
            out.append(scores)
        return torch.cat(out) if out else torch.zeros(0)
    return reward


def _jsonable(meta: dict | None) -> dict:
    """A metadata dict as JSON carries it: what JSON cannot hold (a tensor, a path) as its str."""
    return json.loads(json.dumps(meta or {}, default=str))
