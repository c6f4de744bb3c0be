"""The openai_judge reward against a stdlib server answering in the OpenAI chat-completions format that vLLM and
SGLang return (`choices[0].logprobs.content[0].top_logprobs`), since no engine installed here returns log-probs:
`transformers serve` (5.25) ignores `logprobs` (transformers/cli/serving/chat_completion.py,
UNUSED_CHAT_COMPLETION_FIELDS), and vLLM / SGLang need a GPU build and a real model's weights."""

import base64
import io
import math
import re
import warnings

import pytest
import torch
from PIL import Image

from grpo_vision.config import ConfigError
from grpo_vision.rewards import RewardContext, RewardError, make_reward
from grpo_vision.rewards.vlm_judge import VlmJudgeOptions
from tests.rewards.fake_server import json_answer, server  # noqa: F401  (server: a fixture)

# Two 8 x 8 images: a bright one the fake judge calls "Yes", a dark one "No"
IMAGES = torch.stack([torch.full((3, 8, 8), 0.9), torch.full((3, 8, 8), 0.1)])
PROMPTS = ["a red circle", "a blue square"]
BRIGHT = [("Yes", 0.6), (" yes", 0.1), ("No", 0.15), (" no", 0.05), ("The", 0.1)]  # P(yes) = 0.7 / 0.9
DARK = [("No", 0.5), ("NO", 0.1), ("yes", 0.2), ("I", 0.2)]  # P(yes) = 0.2 / 0.8


def vllm_answer(top):
    """A chat completion with log-probs, in vLLM's (and OpenAI's) format."""
    entries = [{"token": t, "logprob": math.log(p), "bytes": list(t.encode())} for t, p in top]
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "judge",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": top[0][0]}, "finish_reason": "length",
                         "logprobs": {"content": [{**entries[0], "top_logprobs": entries}]}}],
            "usage": {"prompt_tokens": 80, "completion_tokens": 1, "total_tokens": 81}}


def judge(path, body, headers):
    """Reads the image from the data URL, as an engine does, and answers by its brightness."""
    url = body["messages"][0]["content"][0]["image_url"]["url"]
    png = base64.b64decode(url.removeprefix("data:image/png;base64,"))
    bright = Image.open(io.BytesIO(png)).convert("L").getpixel((0, 0)) > 128
    return json_answer(vllm_answer(BRIGHT if bright else DARK))


def openai_judge(url, **options):
    return make_reward("openai_judge", RewardContext(), {"url": f"{url}/v1", "model": "judge", "retries": 1,
                                                         "backoff": 0.01, **options})


def test_p_yes_is_the_normalised_mass_of_the_yes_and_no_variants(server):
    fake = server(judge)
    scores = openai_judge(fake.url)(IMAGES, PROMPTS, [{}, {}])
    assert torch.allclose(scores, torch.tensor([0.7 / 0.9, 0.2 / 0.8]), atol=1e-6)
    assert len(fake.requests) == 2  # concurrent: in any order
    path, body, _, _ = next(r for r in fake.requests if "red circle" in r[1]["messages"][0]["content"][1]["text"])
    assert path == "/v1/chat/completions"
    assert (body["model"], body["max_tokens"], body["logprobs"], body["top_logprobs"]) == ("judge", 1, True, 20)
    content = body["messages"][0]["content"]
    assert content[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert content[1] == {"type": "text", "text": VlmJudgeOptions.question.replace("{prompt}", "a red circle")}


def test_an_entry_s_own_questions_are_averaged_as_the_in_process_judge_does(server):
    fake = server(judge)
    questions = {"questions": ["Is there {prompt}?", "Is it bright?"]}
    scores = openai_judge(fake.url, concurrency=2)(IMAGES, PROMPTS, [questions, {}])
    assert torch.allclose(scores, torch.tensor([0.7 / 0.9, 0.2 / 0.8]), atol=1e-6)
    asked = sorted(body["messages"][0]["content"][1]["text"] for _, body, _, _ in fake.requests)
    assert asked == sorted(["Is there a red circle?", "Is it bright?",
                            VlmJudgeOptions.question.replace("{prompt}", "a blue square")])


def test_neither_answer_among_the_top_log_probs_is_nan_with_a_warning(server):
    fake = server(lambda *a: json_answer(vllm_answer([("The", 0.5), ("A", 0.3)])))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = openai_judge(fake.url, top_logprobs=5)(IMAGES, PROMPTS, [{}, {}])
    assert scores.isnan().all()  # not 0: the judge said something else
    assert [str(w.message) for w in caught] == [
        f"reward.options.openai_judge: {fake.url}/v1/chat/completions answered neither 'yes' nor 'no' among the top "
        "5 log-probs for 2 of 2 questions; those score NaN (does not apply)"]


def test_the_api_key_comes_from_the_named_variable(server, monkeypatch):
    fake = server(judge)
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    openai_judge(fake.url, api_key_env="JUDGE_KEY")(IMAGES[:1], PROMPTS[:1], [{}])
    assert fake.requests[0][2]["Authorization"] == "Bearer sk-test"
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(ConfigError, match=r"^reward.options.openai_judge.api_key_env=JUDGE_KEY: that environment "
                                          r"variable is not set"):
        openai_judge(fake.url, api_key_env="JUDGE_KEY")


def test_a_server_without_log_probs_is_one_line(server):
    # transformers serve's answer: the text, and `logprobs` null
    fake = server(lambda *a: json_answer({"choices": [{"index": 0, "message": {"content": "Yes"}, "logprobs": None}]}))
    with pytest.raises(RewardError, match=rf"^reward 'openai_judge' failed: {re.escape(fake.url)}/v1/chat/completions: "
                                          r"an answer without choices\[0\]\.logprobs\.content\[0\]\.top_logprobs "
                                          r"\(does the server return log-probs\? transformers serve does not; vLLM and "
                                          r"SGLang do\) \(2 tries in \d+\.\d s\)$"):
        openai_judge(fake.url)(IMAGES, PROMPTS, [{}, {}])


def test_an_unreachable_server_is_one_line():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(RewardError, match=rf"^reward 'openai_judge' failed: {re.escape(url)}/v1/chat/completions: "
                                          r"cannot connect \(ConnectError: .*\); is the server up\? \(2 tries"):
        openai_judge(url)(IMAGES, PROMPTS, [{}, {}])


@pytest.mark.parametrize("options, needle", [
    ({"model": "judge"}, r"reward.options.openai_judge.url is empty"),
    ({"url": "http://x/v1"}, r"reward.options.openai_judge.model is empty: give the model name the server serves"),
    ({"url": "http://x/v1", "model": "m", "concurrency": 0}, r"concurrency=0 and top_logprobs=20 must be >= 1"),
    ({"url": "http://x/v1", "model": "m", "no_word": "Yes"}, r"yes_word='yes' and no_word='Yes' must be two different"),
    ({"url": "http://x/v1", "model": "m", "api_key": "sk-1"}, r"reward.options.openai_judge.api_key"),
])
def test_bad_options_are_one_line(options, needle):
    with pytest.raises(ConfigError, match=needle):
        make_reward("openai_judge", RewardContext(), options)
