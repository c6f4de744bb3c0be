"""Run by tests/run/test_distributed.py under `torchrun --nproc_per_node 2` on CPU (gloo): the policy
sharded with FSDP2's `fully_shard` per block and at the root, as accelerate's FSDP plugin
(transformer_based_wrap) shards it, against an unsharded copy on the same data. Writes what it
measured as JSON (first process) to argv[2]."""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from grpo_vision.run.distributed import (
    as_float, full_state_dict, full_weights, load_optimizer_state, optimizer_state, trainable_weights,
)
from grpo_vision.run.health import weights_finite
from grpo_vision.models.llama import LlamaImagePolicy
from grpo_vision.run.safe_state import load_state, save_state
from grpo_vision.sampling import SamplingParams, sample, sequence_logprobs


def shard(policy):
    # a CPU mesh named: fully_shard's default mesh is on CUDA wherever a GPU is visible, and on a one-GPU
    # machine the second process then asks for cuda:1 ("invalid device ordinal", seen on one H200)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in policy.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    return policy


def step(model, cond, rollout, params, opt) -> float:
    logp = sequence_logprobs(model, cond, rollout, params)  # [B, N], through forward: FSDP's hooks gather
    (-logp.mean()).backward()
    norm = as_float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0))
    opt.step()
    opt.zero_grad()
    return norm


def main(world: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    plain = LlamaImagePolicy.from_pretrained(Path(world) / "policy")
    sharded = shard(copy.deepcopy(plain))
    params = SamplingParams(cfg_scale=3.0)  # guided: the CFG rows go through forward too
    cond = plain.encode_prompts(["a red circle", "a blue square"] * 2)  # the same rows on both processes
    seeds = [11, 12, 13, 14]
    with full_weights(sharded):
        ours = sample(sharded, cond, seeds, params)
    ref = sample(plain, cond, seeds, params)
    result = {"same_tokens": bool(torch.equal(ours.tokens, ref.tokens)),
              "logprob_diff": (ours.logprobs - ref.logprobs).abs().max().item(),
              "resharded": type(sharded.lm_head.weight).__name__ == "DTensor"}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (sharded, plain)]
    norms = [step(m, cond, ref, params, o) for m, o in zip((sharded, plain), opts)]
    result["norm_diff"] = abs(norms[0] - norms[1])
    result["finite"] = weights_finite([p for p in sharded.parameters()])
    weights, full = trainable_weights(sharded), full_state_dict(sharded)  # collectives: every process
    state = optimizer_state(sharded, opts[0])
    path = Path(out).with_suffix(".optimizer.safetensors")
    if dist.get_rank() == 0:
        result["weight_diff"] = max((weights[k] - v).abs().max().item() for k, v in plain.state_dict().items())
        result["full_equals_trainable"] = all(torch.equal(full[k].cpu(), weights[k]) for k in weights)
        save_state(state, path)
    dist.barrier()
    # resume: a fresh sharded copy of the stepped weights loads the optimizer's saved state
    fresh = shard(copy.deepcopy(plain))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load_optimizer_state(fresh, fresh_opt, load_state(path))
    again = optimizer_state(fresh, fresh_opt)
    norms = [step(m, cond, ref, params, o) for m, o in ((sharded, opts[0]), (fresh, fresh_opt))]
    after = [trainable_weights(sharded), trainable_weights(fresh)]
    if dist.get_rank() == 0:
        flat = lambda d, k: d["state"][k]["exp_avg"]  # noqa: E731
        result["optimizer_round_trip"] = all(torch.equal(flat(state, k), flat(again, k)) for k in state["state"])
        result["resumed_step_diff"] = max((after[0][k] - after[1][k]).abs().max().item() for k in after[0])
        Path(out).write_text(json.dumps(result))
    # both ranks tear gloo down together: a rank that destroyed its group while the other still wrote
    # aborted once under load ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
