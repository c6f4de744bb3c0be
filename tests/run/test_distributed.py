"""FSDP: the code that runs the policy sharded (distributed.py) on two CPU processes, and the whole
training loop through accelerate's FSDP plugin where accelerate allows it (an accelerator)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import MICRO, ROOT

pytestmark = pytest.mark.e2e  # several processes


def test_a_sharded_policy_samples_updates_and_checkpoints_as_an_unsharded_one(micro_world, tmp_path):
    # torch's FSDP2 runs on CPU (gloo); accelerate does not enable it there (next test), so the two
    # processes shard the policy with fully_shard as accelerate's plugin does, and compare each phase
    out = tmp_path / "fsdp.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          str(ROOT / "tests" / "run" / "fsdp_worker.py"), str(micro_world), str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["same_tokens"] and r["logprob_diff"] < 1e-5  # full_weights: the rollout of the whole model
    assert r["resharded"]  # and the shards freed after it
    # the same data on both processes: FSDP's averaged gradient is the one-process gradient
    assert r["norm_diff"] < 1e-5 and r["weight_diff"] < 1e-6 and r["finite"]
    assert r["full_equals_trainable"] and r["optimizer_round_trip"]
    assert r["resumed_step_diff"] < 1e-7  # a run resumed from the saved state steps as the one that saved it


@pytest.mark.skipif(torch.cuda.device_count() < 1,
                    reason="accelerate enables FSDP only on an accelerator: on CPU, AcceleratorState makes a "
                           "multi-process run MULTI_CPU (DDP) and ignores the FSDP plugin, and `accelerate launch "
                           "--use_fsdp --cpu` starts one plain process; runs on a GPU machine")
def test_training_under_accelerate_fsdp_resumes_exactly(micro_world, tmp_path):
    # as test_train's exact-resume test, every run launched with the FSDP config: a checkpoint's whole
    # weights and name-keyed optimizer state load back into the shards
    def launch(*args):
        out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                              str(ROOT / "configs" / "accelerate" / "fsdp.yaml"), "--num_processes",
                              str(min(2, torch.cuda.device_count())), "--mixed_precision", "no",
                              "--fsdp_transformer_layer_cls_to_wrap", "Block", "-m", "grpo_vision.cli", "train",
                              *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]

    common = [f"policy.path={micro_world}", f"run.out_dir={tmp_path}", "log.sample_every=0", "log.eval_images=1",
              "train.steps=4"]
    launch(str(MICRO), *common, "run.name=straight")
    launch(str(MICRO), *common, "run.name=half", "log.checkpoint_every=2")
    shutil.rmtree(tmp_path / "half" / "checkpoints" / "step_000004")  # as if stopped after step 2
    (tmp_path / "half" / "checkpoints" / "latest").write_text("step_000002")
    launch("--resume", str(tmp_path / "half"))
    a, b = (load_file(tmp_path / run / "checkpoints" / "step_000004" / "policy.safetensors")
            for run in ("straight", "half"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
