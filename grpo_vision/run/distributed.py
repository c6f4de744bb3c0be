"""The policy under accelerate: data-parallel (DDP) or sharded (FSDP2), and the weights each phase needs.

`accelerate launch` decides how the run is distributed (`--multi_gpu`, or an FSDP config such as
configs/accelerate/fsdp.yaml); `train` prepares the policy and its optimizer with accelerate and
then needs three things this module gives, whatever was chosen:

* the UPDATE's forward passes go through the prepared model, so that DDP's hooks average gradients
  (`accelerator.no_sync` while micro-batches accumulate) and FSDP's hooks gather each block's shards;
* SAMPLING reads the weights directly (a KV cache, fused projections), so under FSDP every shard is
  gathered for the rollout and freed after it (`full_weights`);
* checkpoints hold full, unsharded tensors, so a run resumes on any number of processes.

Under FSDP the optimizer's state is saved keyed by parameter name (torch.distributed.checkpoint's
full state dict), which only an FSDP run reads back; DDP and one-process runs keep the plain format.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch

from grpo_vision.config import GrpoVisionWarning


def process_slice(total: int, acc) -> slice:
    """This process's share of `total` items split evenly in process order: of the step's B prompts, or
    of its B*G images and their rows. Whole groups stay on one process, so that every group's advantage
    comes from all of its images (derived_sizes checks that B divides by the processes)."""
    per = total // acc.num_processes
    return slice(acc.process_index * per, (acc.process_index + 1) * per)


def gather(acc, x: torch.Tensor) -> torch.Tensor:
    """Every process's rows of `x`, concatenated in process order, on the CPU."""
    return acc.gather(x.to(acc.device)).cpu()


def is_fsdp(model: torch.nn.Module) -> bool:
    """True for a model that FSDP2 sharded (accelerate's FSDP plugin calls `fully_shard`)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def prepare(acc, policy: torch.nn.Module, optimizer: torch.optim.Optimizer, adapter: str):
    """(model, optimizer) prepared by accelerate: `model` is what the update's forward passes call."""
    fsdp = str(acc.distributed_type).endswith("FSDP")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not fsdp:
        warnings.warn(f"an FSDP config was given, but accelerate runs {acc.distributed_type} here (it enables FSDP on "
                      "GPUs only): the policy is not sharded", GrpoVisionWarning, stacklevel=2)
    if fsdp:
        if adapter != "none":  # peft's merge (reference sync) and adapter-only state dicts assume full tensors
            raise ValueError("FSDP shards a full fine-tune; with train.adapter the trainable weights are small: "
                             "launch with --multi_gpu (DDP) instead of an FSDP config, or set train.adapter=none")
        if acc.mixed_precision == "fp16":  # accelerate would unscale a subset of the parameters twice
            raise ValueError("FSDP with fp16 mixed precision is not supported here: set train.mixed_precision=bf16")
        if acc.mixed_precision != "no" and any(p.dtype != torch.float32 for p in policy.parameters()):
            raise ValueError("FSDP with mixed precision keeps float32 master weights: set policy.dtype=float32")
    return acc.prepare(policy, optimizer)


def _fsdp_modules(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if is_fsdp(m)]


@contextmanager
def full_weights(model: torch.nn.Module):
    """Inside: every parameter of `model` is a whole tensor (FSDP's shards gathered, kept through
    forward passes); outside, sharded again. A no-op for a model that is not sharded."""
    if not (units := _fsdp_modules(model)):
        yield
        return
    # The root must initialise before any block runs: a block's own forward hook would otherwise make
    # that block a root, and the next forward through the model fails ("FSDP requires running forward
    # through the root module first"). unshard() initialises the parameters, not the root state.
    model._get_fsdp_state()._lazy_init()
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters and the buffers (checkpoint.trainable_state) as whole CPU tensors, by name; under FSDP a collective every process
    calls, and only the first process gets them."""
    if not is_fsdp(model):
        from grpo_vision.run.checkpoint import trainable_state

        return trainable_state(getattr(model, "module", model))  # DDP's own names start with "module."
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from grpo_vision.run.checkpoint import persistent_buffers

    names = {n for n, p in model.named_parameters() if p.requires_grad} | set(persistent_buffers(model))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {n: v.contiguous() for n, v in full.items() if n in names}


def optimizer_state(model: torch.nn.Module, optimizer) -> dict:
    """The optimizer's state to checkpoint (under FSDP: whole tensors keyed by parameter name, on the
    first process)."""
    if not is_fsdp(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer),  # accelerate's wrapper
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    if not is_fsdp(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), state,  # accelerate's wrapper
                             options=StateDictOptions(full_state_dict=True))


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of `model` whole, on every process (a frozen reference syncing from the policy)."""
    if not is_fsdp(model):
        return getattr(model, "module", model).state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def as_float(norm) -> float:
    """A gradient norm as a number; FSDP's is a DTensor, whole on every process once `full_tensor`."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def end_process_group() -> None:
    """Destroy the process group `accelerate launch` started, if any, while the interpreter is whole.
    A process that exits with a gloo group alive can abort in its teardown (SIGABRT, "terminate called
    without an active exception": pytorch/pytorch#190489), and the launcher then kills the others."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
