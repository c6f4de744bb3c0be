"""`grpo-vision serve-reward` as a real process on loopback (started once for the module), scored through the
`remote` reward: the same numbers as in this process, its health, version and options; and a training run whose
served reward fails mid-run stops with a checkpoint and the server's one line."""

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from grpo_vision import __version__
from grpo_vision.rewards import RewardContext, RewardError, make_reward
from grpo_vision.rewards.remote import png_base64
from grpo_vision.tools.reward_server import free_port, spawn
from tests.helpers import ROOT, micro_cfg
from tests.rewards.fake_server import FakeServer, json_answer

pytestmark = pytest.mark.e2e

# ShapesWorld's tiny CLIP, from the repository (a policy kind's defaults are not applied by serve-reward)
CLIP = {"model": str(ROOT / "grpo_vision" / "shapes" / "shapes_clip.json"),
        "checkpoint": str(ROOT / "worlds" / "shapes" / "clip" / "clip.safetensors")}
IMAGES = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(1)).mul(255).round().div(255)
PROMPTS = [f"prompt {i}" for i in range(6)]


@pytest.fixture(scope="module")
def served():
    process, url = spawn(["jpeg_compressibility", "placebo", "clip", *(f"reward.options.clip.{k}={v}" for k, v in
                                                                   CLIP.items()), "--max-batch", "16"], free_port())
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.mark.parametrize("name", ["jpeg_compressibility", "placebo", "clip"])
def test_served_scores_equal_in_process_scores_exactly(served, name):
    # clip: before the server's decoded images were made contiguous, its scores were 1 ulp off (a channels-last
    # tensor convolves to other roundings)
    remote = make_reward("remote", RewardContext(), {"url": served, "reward": name, "batch_size": 4})
    local = make_reward(name, RewardContext(), CLIP if name == "clip" else None)
    by_call = torch.cat([local(IMAGES[i:i + 4], PROMPTS[i:i + 4], [{}] * 4) for i in (0, 4)])  # a model's roundings
    assert torch.equal(remote(IMAGES, PROMPTS, [{}] * 6), by_call)  # depend on its batch: the same calls as remote's


def test_concurrent_clients_each_get_their_own_scores(served):
    remote = make_reward("remote", RewardContext(), {"url": served, "reward": "placebo"})
    local = make_reward("placebo", RewardContext())
    batches = [IMAGES[i:i + 2] for i in range(0, 6, 2)] * 3
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda b: remote(b, ["p", "q"], [{}, {}]), batches))
    assert all(torch.equal(g, local(b, ["p", "q"], [{}, {}])) for g, b in zip(got, batches))


def test_health_info_and_every_answer_say_the_version_and_options(served):
    assert httpx.get(f"{served}/health").json() == {"status": "ok",
                                                     "rewards": ["jpeg_compressibility", "placebo", "clip"]}
    assert httpx.get(f"{served}/info").json() == {
        "version": __version__, "max_batch": 16,
        "rewards": [{"name": "jpeg_compressibility", "options": {}}, {"name": "placebo", "options": {}},
                    {"name": "clip", "options": {**CLIP, "trust_torchscript": False}}]}
    answer = httpx.post(f"{served}/score/placebo", json={"images": png_base64(IMAGES[:1]), "prompts": ["p"]}).json()
    assert set(answer) == {"scores", "reward", "options", "version"}
    assert (answer["reward"], answer["options"], answer["version"]) == ("placebo", {}, __version__)


def test_a_request_the_server_refuses_is_one_line(served):
    bad = {"images": ["not png"], "prompts": ["p"]}
    answer = httpx.post(f"{served}/score/placebo", json=bad)
    assert answer.status_code == 400
    assert answer.json()["error"].startswith("images[0] is not a base64 PNG (")
    remote = make_reward("remote", RewardContext(), {"url": served})  # two rewards served: which one?
    with pytest.raises(RewardError, match=rf"^reward 'remote' failed: {re.escape(served)}/score: HTTP 404: this "
                                          r"server serves jpeg_compressibility, placebo, clip: POST /score/NAME \(the remote "
                                          r"reward's `reward` option\) \(1 try in \d+\.\d s, not retried"):
        remote(IMAGES, PROMPTS, [{}] * 6)


def test_a_served_reward_failing_mid_run_stops_it_with_a_checkpoint(micro_world, tmp_path):
    from grpo_vision.train import train

    calls = []

    def answer(path, body, headers):  # scores the first step, then fails as a crashed reward model does
        calls.append(len(body["images"]))
        if len(calls) > 1:
            return json_answer({"error": "reward 'geneval' failed: CUDA out of memory"}, 500)
        return json_answer({"scores": [math.sin(i) for i in range(len(body["images"]))]})

    fake = FakeServer(answer)
    try:
        cfg = micro_cfg(micro_world, tmp_path, "run.name=remote", "reward.weights={remote: 1.0}",
                        f"reward.options.remote.url={fake.url}", "reward.options.remote.retries=1",
                        "reward.options.remote.backoff=0.01", "log.checkpoint_every=0")
        with pytest.raises(RewardError) as e:
            train(cfg, progress=False)
    finally:
        fake.close()
    assert re.fullmatch(rf"reward 'remote' failed: {re.escape(fake.url)}/score: HTTP 500: reward 'geneval' failed: "
                        rf"CUDA out of memory \(2 tries in \d+\.\d s\) \(checkpoint saved at step 1 in "
                        rf"{re.escape(str(tmp_path / 'remote'))}\)", str(e.value)), str(e.value)
    assert (tmp_path / "remote" / "checkpoints" / "latest").read_text() == "step_000001"
    assert [json.loads(line)["step"] for line in (tmp_path / "remote" / "metrics.jsonl").read_text().splitlines()] \
        == [1]  # step 1 logged; step 2 stopped at its reward


FAKE_GENEVAL = '''
import argparse
from PIL import Image, ImageStat

def parse_args():  # evaluate_images.py's arguments
    parser = argparse.ArgumentParser()
    parser.add_argument("imagedir")
    parser.add_argument("--model-path", default="./")
    parser.add_argument("--model-config", default=None)
    parser.add_argument("--options", nargs="*", default=[])
    args = parser.parse_args()
    args.options = dict(opt.split("=", 1) for opt in args.options)
    return args

def load_models(args):
    return "detector", ("clip", "transform", "tokenizer"), ["dog", "cat"]

def evaluate_image(filepath, metadata):  # a stand-in verdict: bright enough for THRESHOLD, set by the server
    assert object_detector == "detector" and metadata["prompt"]
    brightness = ImageStat.Stat(Image.open(filepath).convert("L")).mean[0] / 255
    return {"correct": brightness > THRESHOLD, "tag": metadata["tag"]}
'''


def test_the_geneval_server_script_speaks_the_remote_wire(tmp_path):
    """docs/examples/geneval_server.py, run on a stand-in for GenEval's evaluate_images.py (GenEval itself needs
    mmdet 2.x on a GPU): the remote reward gets its verdicts, null where a prompt has no GenEval tag."""
    import subprocess
    import sys
    import time

    (tmp_path / "evaluation").mkdir()
    (tmp_path / "evaluation" / "evaluate_images.py").write_text(FAKE_GENEVAL)
    port = free_port()
    process = subprocess.Popen([sys.executable, str(ROOT / "docs" / "examples" / "geneval_server.py"), "--checkout",
                                str(tmp_path), "--model-path", str(tmp_path), "--port", str(port),
                                "--options", "threshold=0.5"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        images = torch.stack([torch.full((3, 8, 8), v) for v in (0.8, 0.2, 0.8)])
        meta = [{"tag": "single_object", "include": [{"class": "dog", "count": 1}]}] * 2 + [{}]
        remote = make_reward("remote", RewardContext(), {"url": url})
        scores = remote(images, ["a photo of a dog"] * 3, meta)
        assert scores[:2].tolist() == [1.0, 0.0] and math.isnan(scores[2])
        assert httpx.get(f"{url}/info").json()["rewards"][0]["options"]["threshold"] == 0.5
    finally:
        process.terminate()
        process.wait(timeout=10)
