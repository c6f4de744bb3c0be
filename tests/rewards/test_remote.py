"""The `remote` reward against misbehaving servers (a stdlib server in a thread, tests/rewards/fake_server.py): each
failure is one line naming the URL and what came back, tried again within its limits, never a silent 0; NaN passes
through. The real `serve-reward` process is tested in test_remote_server.py."""

import base64
import hashlib
import io
import math
import re
import time
import warnings

import pytest
import torch
from PIL import Image

from grpo_vision.config import ConfigError
from grpo_vision.rewards import CompositeReward, RewardContext, RewardError, make_reward
from grpo_vision.rewards.remote import images_from_base64, png_base64, scores_from_json, scores_to_json
from tests.rewards.fake_server import json_answer, server  # noqa: F401  (server: a fixture)

IMAGES = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0)).mul(255).round().div(255)
PROMPTS = ["a red circle", "a blue square", "two green triangles"]


def digest_score(png: str) -> float:
    """What the fake scorer gives an image: a hash of its PNG's pixels, in [0, 1)."""
    pixels = Image.open(io.BytesIO(base64.b64decode(png))).tobytes()
    return int.from_bytes(hashlib.sha256(pixels).digest()[:4], "little") / 2**32


def good(path, body, headers):
    return json_answer({"scores": [digest_score(p) for p in body["images"]], "reward": "fake", "options": {},
                        "version": "0"})


def remote(url, **options):
    return make_reward("remote", RewardContext(), {"url": url, "retries": 2, "backoff": 0.05, "timeout": 5.0,
                                                   **options})


def test_the_wire_keeps_8_bit_pixels_exactly_and_nan_as_null():
    assert torch.equal(images_from_base64(png_base64(IMAGES)), IMAGES)  # PNG is lossless on 8-bit values
    assert scores_to_json(torch.tensor([0.25, math.nan, -1.5])) == [0.25, None, -1.5]
    back = scores_from_json({"scores": [0.25, None, -1.5]}, 3)
    assert back[0] == 0.25 and math.isnan(back[1]) and back[2] == -1.5


def test_scores_come_back_per_image_in_order_across_calls(server):
    fake = server(good)
    scores = remote(fake.url, batch_size=2)(IMAGES, PROMPTS, [{"n": 1}, {}, {"n": 3}])
    expected = torch.tensor([digest_score(p) for p in png_base64(IMAGES)])
    assert torch.equal(scores, expected)
    sent = [body for _, body, _, _ in fake.requests]
    assert [len(b["images"]) for b in sent] == [2, 1]  # batch_size 2: two calls
    assert [b["prompts"] for b in sent] == [PROMPTS[:2], PROMPTS[2:]]
    assert [b["metadata"] for b in sent] == [[{"n": 1}, {}], [{"n": 3}]]
    assert fake.requests[0][0] == "/score"
    remote(fake.url, reward="geneval")(IMAGES, PROMPTS, [{}] * 3)
    assert fake.requests[-1][0] == "/score/geneval"  # a server serving several rewards


def garbage(path, body, headers):
    return 200, "<html>502 Bad Gateway</html>"


def wrong_count(path, body, headers):
    return json_answer({"scores": [0.5] * (len(body["images"]) - 1)})


def wrong_schema(path, body, headers):
    return json_answer({"score": 0.5})


def not_numbers(path, body, headers):
    return json_answer({"scores": ["high"] * len(body["images"])})


def error_500(path, body, headers):
    return json_answer({"error": "reward 'geneval' failed: CUDA out of memory"}, 500)


@pytest.mark.parametrize("answer, what", [
    (garbage, r"an answer that is not JSON \(<html>502 Bad Gateway</html>\)"),
    (wrong_count, r"2 scores for 3 images"),
    (wrong_schema, r"an answer without a list 'scores' \(got \[\"score\"\]\)"),
    (not_numbers, r"scores that are not numbers or null \(\[\"high\", \"high\", \"high\"\]\)"),
    (error_500, r"HTTP 500: reward 'geneval' failed: CUDA out of memory"),
])
def test_a_bad_answer_is_tried_again_with_backoff_then_one_line(server, answer, what):
    fake = server(answer)
    start = time.monotonic()
    with pytest.raises(RewardError) as e:
        remote(fake.url)(IMAGES, PROMPTS, [{}] * 3)
    assert re.fullmatch(rf"reward 'remote' failed: {re.escape(fake.url)}/score: {what} \(3 tries in \d+\.\d s\)",
                        str(e.value)), str(e.value)
    times = [t for *_, t in fake.requests]
    assert len(times) == 3  # 1 + retries
    assert times[1] - times[0] >= 0.05 and times[2] - times[1] >= 0.1  # backoff, doubling
    assert time.monotonic() - start < 3


def test_a_server_that_is_down_is_one_line(server):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(RewardError, match=rf"^reward 'remote' failed: {re.escape(url)}/score: cannot connect "
                                          r"\(ConnectError: .*refused\); is the server up\? \(3 tries in \d+\.\d s\)$"):
        remote(url)(IMAGES, PROMPTS, [{}] * 3)


def test_a_server_that_dies_mid_call_is_one_line(server):
    fake = server(lambda path, body, headers: None)
    with pytest.raises(RewardError, match=rf"^reward 'remote' failed: {re.escape(fake.url)}/score: the connection "
                                          r"failed \(RemoteProtocolError: Server disconnected without sending a "
                                          r"response\.\) \(3 tries in \d+\.\d s\)$"):
        remote(fake.url)(IMAGES, PROMPTS, [{}] * 3)


def test_a_slow_server_times_out_each_try(server):
    def slow(path, body, headers):
        time.sleep(0.6)
        return good(path, body, headers)
    fake = server(slow)
    start = time.monotonic()
    with pytest.raises(RewardError, match=rf"^reward 'remote' failed: {re.escape(fake.url)}/score: no answer within "
                                          r"0.2 s \(timeout\) \(2 tries in \d+\.\d s\)$"):
        remote(fake.url, timeout=0.2, retries=1)(IMAGES, PROMPTS, [{}] * 3)
    assert 0.4 <= time.monotonic() - start < 1.5


def test_a_refused_request_is_not_tried_again(server):
    fake = server(lambda path, body, headers: json_answer({"detail": "3 images, 2 prompts"}, 422))
    with pytest.raises(RewardError, match=r"HTTP 422: 3 images, 2 prompts \(1 try in \d+\.\d s, not retried: the "
                                          r"server refused the request\)$"):
        remote(fake.url)(IMAGES, PROMPTS, [{}] * 3)
    assert len(fake.requests) == 1


def test_a_failure_that_clears_within_the_retries_scores(server):
    answers = iter([error_500, garbage, good])
    fake = server(lambda *a: next(answers)(*a))
    scores = remote(fake.url)(IMAGES, PROMPTS, [{}] * 3)
    assert torch.equal(scores, torch.tensor([digest_score(p) for p in png_base64(IMAGES)]))
    assert len(fake.requests) == 3


def test_nan_passes_through_and_all_nan_answers_warn_once(server):
    fake = server(lambda path, body, headers: json_answer({"scores": [None] * len(body["images"])}))
    reward = remote(fake.url)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            assert reward(IMAGES, PROMPTS, [{}] * 3).isnan().all()  # not 0: "does not apply"
    lines = [str(w.message) for w in caught]
    assert lines == [f"reward.options.remote: {fake.url}/score answered NaN (does not apply) for every image of 3 "
                     "calls in a row; check that it serves the reward you meant (GET /info)"]


def test_some_nan_neither_warns_nor_fails(server):
    fake = server(lambda path, body, headers: json_answer({"scores": [None, 1.0, None][:len(body["images"])]}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            scores = remote(fake.url)(IMAGES, PROMPTS, [{}] * 3)
    assert scores[1] == 1.0 and scores[[0, 2]].isnan().all()


def test_the_composite_keeps_the_remote_line_as_it_is(server):
    fake = server(wrong_count)
    composite = CompositeReward({"remote": 1.0}, [], RewardContext(), {"remote": {"url": fake.url, "retries": 0}})
    with pytest.raises(RewardError) as e:
        composite(IMAGES, PROMPTS, [{}] * 3)
    assert re.fullmatch(rf"reward 'remote' failed: {re.escape(fake.url)}/score: 2 scores for 3 images \(1 try in "
                        r"\d+\.\d s\)", str(e.value)), str(e.value)  # before: "... failed: RewardError: reward ..."


@pytest.mark.parametrize("options, needle", [
    ({}, r"reward.options.remote.url is empty: give the server's address, e.g. reward.options.remote.url=http"),
    ({"url": "127.0.0.1:8000"}, r"reward.options.remote.url='127.0.0.1:8000' is not an http:// or https:// address"),
    ({"url": "http://x", "timeout": 0}, r"reward.options.remote.timeout=0: give the seconds a call may take, > 0"),
    ({"url": "http://x", "retries": -1}, r"retries=-1 and backoff=1 must be >= 0"),
    ({"url": "http://x", "batch_size": 0}, r"reward.options.remote.batch_size=0: give the images per call, >= 1"),
    ({"url": "http://x", "timout": 5}, r"reward.options.remote.timout"),
])
def test_bad_options_are_one_line(options, needle):
    with pytest.raises(ConfigError, match=needle):
        make_reward("remote", RewardContext(), options)


def test_remote_and_openai_judge_are_names_a_matrix_mixes():
    from grpo_vision.tools.matrix import parse_reward_spec

    assert parse_reward_spec("2*remote+openai_judge", {}) == (("remote", 2.0), ("openai_judge", 1.0))
