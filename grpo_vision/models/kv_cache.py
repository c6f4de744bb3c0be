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

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Tree:
    """The shape of a speculative window (`decode_block`): W nodes, node 0 the row's last kept token at cache slot
    `start`, node i written at slot `start + i` and read at position `start + depth[i]`, attending over the cache
    before `start` and the window's nodes on its own path (`ancestors[i, j]`: j is i or above it). A chain
    (`Tree.chain`: depth i, every earlier node) is plain speculative decoding's window; a tree holds sibling drafts
    (SJD-PAC, arXiv 2603.18599; `sampling/speculative.py` draft_tree)."""
    depth: torch.Tensor  # [W] int64
    ancestors: torch.Tensor  # [W, W] bool

    @staticmethod
    def chain(width: int, device=None) -> "Tree":
        idx = torch.arange(width, device=device)
        return Tree(idx, idx[None, :] <= idx[:, None])

    def positions(self, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, slots) `[B, W]` of rows whose windows start at `start` `[B]`: where each node is read (rotary
        angles, the layout canvas) and where its keys and values are written."""
        return start[:, None] + self.depth, start[:, None] + torch.arange(len(self.depth), device=start.device)

    def mask(self, start: torch.Tensor, length: int) -> torch.Tensor:
        """`[B, 1, W, T]` bool, the keys each node sees in a cache of `length` slots: those before its row's window,
        and the window's nodes on its path (later slots, stale or unwritten, masked)."""
        W = len(self.depth)
        rel = torch.arange(length, device=start.device) - start[:, None]  # [B, T] slot relative to the window
        on_path = self.ancestors[:, rel.clamp(0, W - 1)].transpose(0, 1) & (rel < W)[:, None]  # [B, W, T]
        return ((rel < 0)[:, None] | (on_path & (rel >= 0)[:, None])).unsqueeze(1)


def move_keys(cache, start: torch.Tensor, source: torch.Tensor) -> None:
    """Copy each row's keys and values at window slots `start + source` `[B, D]` to slots `start + 1 .. start + D`:
    the kept path of a tree window, which verification chose among siblings, to the slots that follow its root
    (where a chain would have put it). `cache.k` and `cache.v` are `[layers, B, Hkv, T, hd]`; rows of CFG's null
    branch (`cache` rows `2B`) move as their conditional rows."""
    rows, D = cache.k.shape[1], source.shape[1]
    reps = rows // start.shape[0]
    src = (start[:, None] + source).repeat(reps, 1)  # [rows, D]
    dst = (start[:, None] + 1 + torch.arange(D, device=start.device)).repeat(reps, 1)  # [rows, D]
    for buffer in (cache.k, cache.v):
        L, _, H, _, hd = buffer.shape
        at = lambda idx: idx[None, :, None, :, None].expand(L, rows, H, D, hd)  # noqa: E731
        buffer.scatter_(3, at(dst), buffer.gather(3, at(src)))
