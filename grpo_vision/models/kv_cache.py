"""The cache writes of a decode step, eager or static, shared by the policies that decode with a KV cache.

Eager decoding attends over `keys[:pos + 1]`, a shape that grows every step. A *static* cache is
preallocated at its full length (zeros where nothing is written yet), the step's position is a tensor on
the device (`position`), keys and values are written there with `index_copy_`, and attention runs over the
whole cache with the keys after `position` masked out. Every tensor then keeps its shape and address from
step to step, so the step can be recorded once as a CUDA graph and replayed (`sampling/decode.py` record_step; the
same idea as gpt-fast's and LlamaGen's `torch.compile(mode="reduce-overhead")` decode). Masked keys get a
weight of exactly 0 (and their zero values add nothing), so both paths compute the same function; only the
order of a sum may differ, in the last bit.
"""

from __future__ import annotations

import torch


def static_position(device) -> torch.Tensor:
    """The position a static cache writes next: a 0-d int64 tensor, advanced in place by every decode step."""
    return torch.zeros((), dtype=torch.long, device=device)


def new_kv(shape: tuple, dtype, device, static: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keys, values and position of a new cache: uninitialised and no position (eager), or zeros and a position
    tensor (static: unwritten keys are masked, and their zero values add nothing where a NaN of `empty` would)."""
    new = torch.zeros if static else torch.empty
    return (new(shape, dtype=dtype, device=device), new(shape, dtype=dtype, device=device),
            static_position(device) if static else None)


def write_step(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int,
               position: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one step's keys and values `[B, Hkv, hd]` into one layer's cache `[B, Hkv, T, hd]`: at the int
    `pos` (eager) or at the tensor `position` (static). Returns the keys and values to attend over: the
    `pos + 1` written so far (eager), or the whole cache (static: mask with `future_keys`)."""
    if position is None:
        k_cache[:, :, pos], v_cache[:, :, pos] = k, v
        return k_cache[:, :, :pos + 1], v_cache[:, :, :pos + 1]
    at = position.view(1)
    k_cache.index_copy_(2, at, k.unsqueeze(2).to(k_cache.dtype))
    v_cache.index_copy_(2, at, v.unsqueeze(2).to(v_cache.dtype))
    return k_cache, v_cache


def future_keys(position: torch.Tensor, length: int) -> torch.Tensor:
    """`[length]` bool, True at the cache positions after `position`: the keys a static step must not see."""
    return torch.arange(length, device=position.device) > position
