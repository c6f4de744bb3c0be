"""serve-reward's parts in this process: the batcher that merges waiting requests, the app's answers to bad requests
and to a failing reward (FastAPI's TestClient), and the command's one-line errors. The real server process:
tests/rewards/test_remote_server.py."""

import asyncio
import socket

import pytest
import torch
from fastapi.testclient import TestClient

from grpo_vision import __version__
from grpo_vision.cli import main
from grpo_vision.rewards import CompositeReward, RewardContext, make_reward
from grpo_vision.rewards.remote import png_base64
from grpo_vision.tools.reward_server import Batcher, make_app

BROKEN = "python:tests.tools.test_reward_server:broken"


def broken(images, prompts, metadata):
    raise ValueError("the detector's weights are missing")


def mean_score(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))  # [B]


def test_waiting_requests_of_one_size_are_scored_together_up_to_max_batch():
    calls = []

    def score(images, prompts, metadata):
        calls.append(list(prompts))
        return mean_score(images, prompts, metadata)

    async def scenario():
        batcher = Batcher(score, max_batch=5)
        task = asyncio.create_task(batcher.run())
        small = [batcher.submit(torch.full((2, 3, 4, 4), i / 10), [f"{i}a", f"{i}b"], [{}, {}]) for i in range(3)]
        large = batcher.submit(torch.full((1, 3, 8, 8), 0.5), ["large"], [{}])  # another size: a call of its own
        results = await asyncio.gather(*small, large)
        task.cancel()
        return results

    results = asyncio.run(scenario())
    assert calls == [["0a", "0b", "1a", "1b"], ["2a", "2b"], ["large"]]  # 2 + 2 fit in 5; the third waits
    for i, scores in enumerate(results[:3]):
        assert torch.allclose(scores, torch.full((2,), i / 10))  # each request gets its own slice back
    assert torch.allclose(results[3], torch.tensor([0.5]))


def test_a_failing_call_fails_every_request_in_it():
    async def scenario():
        batcher = Batcher(broken, max_batch=8)
        task = asyncio.create_task(batcher.run())
        out = await asyncio.gather(*(batcher.submit(torch.zeros(1, 3, 4, 4), ["p"], [{}]) for _ in range(2)),
                                   return_exceptions=True)
        task.cancel()
        return out

    assert [str(e) for e in asyncio.run(scenario())] == ["the detector's weights are missing"] * 2


@pytest.fixture
def client():
    rewards = CompositeReward({"placebo": 1.0, BROKEN: 1.0}, [], RewardContext())
    with TestClient(make_app(rewards, max_batch=8)) as c:  # `with`: the app's lifespan starts the batchers
        yield c


IMAGES = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(2)).mul(255).round().div(255)


def test_the_app_scores_as_the_reward_does(client):
    answer = client.post("/score/placebo", json={"images": png_base64(IMAGES), "prompts": ["a", "b"]})
    expected = make_reward("placebo", RewardContext())(IMAGES, ["a", "b"], [{}, {}])
    assert answer.status_code == 200
    assert torch.equal(torch.tensor(answer.json()["scores"], dtype=torch.float32), expected)


@pytest.mark.parametrize("path, body, status, error", [
    ("/score/placebo", {"images": ["aGVsbG8="], "prompts": ["a"]}, 400,
     "images[0] is not a base64 PNG (UnidentifiedImageError: cannot identify image file"),
    ("/score/placebo", {"images": ["x"], "prompts": ["a", "b"]}, 422,
     "1 images, 2 prompts and 1 metadata: give one of each per image"),
    ("/score/clip", {"images": [], "prompts": []}, 404, f"this server serves placebo, {BROKEN}, not 'clip'"),
    ("/score", {"images": [], "prompts": []}, 404, f"this server serves placebo, {BROKEN}: POST /score/NAME"),
    (f"/score/{BROKEN}", None, 500,
     f"reward '{BROKEN}' failed: ValueError: the detector's weights are missing"),
])
def test_what_the_app_refuses_is_one_line(client, path, body, status, error):
    body = body or {"images": png_base64(IMAGES), "prompts": ["a", "b"]}
    answer = client.post(path, json=body)
    assert answer.status_code == status
    assert answer.json()["error"].startswith(error), answer.json()
    assert answer.json()["version"] == __version__


def test_a_taken_port_is_one_line_before_any_model_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve-reward", "placebo", "--port", str(port)])
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"grpo-vision: error: serve-reward: cannot listen on 127.0.0.1:{port} (Address "
                                       "already in use); give another --port or --host\n")


def test_an_unknown_reward_and_a_bad_option_are_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["serve-reward", "placebo", "nosuch", "--port", "1"])
    err = capsys.readouterr().err
    assert err.startswith("grpo-vision: error: unknown reward 'nosuch'; registered rewards: ") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        main(["serve-reward", "clip", "reward.options.clip.checkpoint=/nonexistent/clip.safetensors", "--port", "1"])
    err = capsys.readouterr().err
    assert "/nonexistent/clip.safetensors" in err and err.count("\n") == 1
