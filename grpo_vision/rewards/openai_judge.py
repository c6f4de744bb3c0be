"""A vision-language judge behind an OpenAI-compatible chat-completions endpoint (vLLM, SGLang): P(yes).

    reward.options.openai_judge: {url: "http://127.0.0.1:8000/v1", model: Qwen/Qwen2.5-VL-7B-Instruct}
    score = P(yes) / (P(yes) + P(no))        in [0, 1], per image

The same question as the in-process judge (vlm_judge.py: its `question` default and the prompt entry's own
`metadata["questions"]`, averaged), asked with the image as a base64 PNG data URL, `max_tokens=1`, `logprobs=true`
and `top_logprobs`; the score reads the first generated token's top log-probs: P(yes) is the mass of the tokens
that are "yes" once stripped and lower-cased (" yes", "Yes", "YES"), P(no) the same for "no", normalised over the
two. This is how Janus-Pro-R1 reads its InternVL judge "online ... a URL" and how Flow-GRPO / Pref-GRPO call
UnifiedReward behind SGLang (flow_grpo/rewards.py, `unifiedreward_score_sglang`, which parses the generated text
instead and scores 0 when it finds no number). When neither answer is among the top log-probs, the image scores NaN
("does not apply") with a warning, never 0: the judge said something else, and 0 would teach "wrong".

The answer format is OpenAI's (`choices[0].logprobs.content[0].top_logprobs`: `[{token, logprob}, ...]`), which
vLLM and SGLang return. transformers' own `transformers serve` (5.25) accepts `logprobs` but ignores it (its
chat_completion.py lists it among the unused fields), so it cannot serve this reward.
Calls go out `concurrency` at a time (a thread pool: an engine batches concurrent requests itself).
"""

from __future__ import annotations

import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from grpo_vision.config import ConfigError, GrpoVisionWarning
from grpo_vision.rewards.base import RewardContext, RewardFn, register_reward
from grpo_vision.rewards.remote import BadAnswer, check_limits, check_url, png_base64, post_json
from grpo_vision.rewards.vlm_judge import VlmJudgeOptions, mean_per_image, questions_asked

KEY = "reward.options.openai_judge"


@dataclass
class OpenAIJudgeOptions:
    url: str = ""  # the endpoint's base URL, e.g. http://127.0.0.1:8000/v1 (vllm serve MODEL); /chat/completions added
    model: str = ""  # the model name the server serves (vLLM: the path or name given to `vllm serve`)
    api_key_env: str = ""  # the environment variable that holds the API key ("" = none); never the key itself
    question: str = VlmJudgeOptions.question  # the in-process judge's question; {prompt}: the image's prompt
    yes_word: str = "yes"  # the answer that scores 1; a token counts when stripped and lower-cased it is this word
    no_word: str = "no"  # the answer that scores 0, read the same way
    top_logprobs: int = 20  # log-probs asked for at the answer token (OpenAI allows up to 20; vLLM more)
    concurrency: int = 8  # requests in flight at once
    timeout: float = 60.0  # seconds one request may take before it counts as failed
    retries: int = 2  # tries after a failed one, each after a pause
    backoff: float = 1.0  # seconds before the first retry, doubling after each


def yes_probability(answer: Any, yes: str, no: str) -> float:
    """P(yes) / (P(yes) + P(no)) from one chat completion's first-token top log-probs; NaN when neither answer is
    among them; BadAnswer when the answer has no log-probs where OpenAI's format puts them."""
    try:
        top = answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        pairs = [(str(t["token"]), float(t["logprob"])) for t in top]
    except (KeyError, IndexError, TypeError, ValueError):
        raise BadAnswer("an answer without choices[0].logprobs.content[0].top_logprobs (does the server return "
                        "log-probs? transformers serve does not; vLLM and SGLang do)") from None
    p_yes = sum(math.exp(lp) for token, lp in pairs if token.strip().lower() == yes)
    p_no = sum(math.exp(lp) for token, lp in pairs if token.strip().lower() == no)
    return p_yes / (p_yes + p_no) if p_yes + p_no > 0 else math.nan


def request(model: str, image_png: str, question: str, top_logprobs: int) -> dict:
    """One chat completion: the image as a data URL, then the question; one token, with its top log-probs."""
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image_png}"}},
               {"type": "text", "text": question}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
            "logprobs": True, "top_logprobs": top_logprobs}


@register_reward("openai_judge", options=OpenAIJudgeOptions)
def openai_judge_reward(ctx: RewardContext, opts: OpenAIJudgeOptions) -> RewardFn:
    """P(yes) of a judge served behind an OpenAI-compatible endpoint, asked whether the image shows its prompt."""
    import httpx

    url = check_url(opts.url, KEY, "http://127.0.0.1:8000/v1") + "/chat/completions"
    check_limits(opts, KEY)
    if not opts.model:
        raise ConfigError(f"{KEY}.model is empty: give the model name the server serves (GET {opts.url}/models)")
    if opts.concurrency < 1 or opts.top_logprobs < 1:
        raise ConfigError(f"{KEY}: concurrency={opts.concurrency} and top_logprobs={opts.top_logprobs} must be >= 1")
    yes, no = opts.yes_word.strip().lower(), opts.no_word.strip().lower()
    if not yes or not no or yes == no:
        raise ConfigError(f"{KEY}: yes_word={opts.yes_word!r} and no_word={opts.no_word!r} must be two different "
                          "words")
    headers = {}
    if opts.api_key_env:
        key = os.environ.get(opts.api_key_env)
        if not key:
            raise ConfigError(f"{KEY}.api_key_env={opts.api_key_env}: that environment variable is not set; export "
                              "it with the key (the config names the variable, never the key)")
        headers["Authorization"] = f"Bearer {key}"
    client = httpx.Client(timeout=opts.timeout)

    def ask(job: tuple[str, str]) -> float:
        image, question = job
        return post_json(client, url, request(opts.model, image, question, opts.top_logprobs),
                         lambda answer: yes_probability(answer, yes, no), "openai_judge", opts.retries, opts.backoff,
                         headers)

    def reward(images, prompts, metadata):
        metadata = list(metadata) if metadata is not None else [{} for _ in prompts]
        encoded = png_base64(images)
        asked = questions_asked(prompts, metadata, opts.question)  # (image, question) per request
        jobs = [(encoded[i], q) for i, q in asked]
        with ThreadPoolExecutor(max_workers=opts.concurrency) as pool:
            answers = torch.tensor(list(pool.map(ask, jobs)), dtype=torch.float32)  # [Q]
        unread = int(answers.isnan().sum())
        if unread:
            warnings.warn(f"{KEY}: {url} answered neither {opts.yes_word!r} nor {opts.no_word!r} among the top "
                          f"{opts.top_logprobs} log-probs for {unread} of {len(jobs)} questions; those score NaN "
                          "(does not apply)", GrpoVisionWarning, stacklevel=2)
        return mean_per_image(asked, answers, len(prompts))
    return reward

