"""A step of fixed shapes and addresses recorded once as a CUDA graph and replayed: the plain decode step
(decode.py) and the speculative window (speculative.py) alike (PyTorch's CUDA graphs docs)."""

from __future__ import annotations

from typing import Sequence

import torch


def record_step(step, state: Sequence[torch.Tensor]) -> callable:
    """`step` (a decode step that reads and writes only tensors of fixed addresses) recorded as a CUDA
    graph; returns its replay. Recording needs warm-up runs on a side stream (PyTorch's CUDA graphs
    docs); they advance `state` (the logits, the column, the cache's position), which is put back after.
    The keys and values they wrote are written again by the replayed steps before any step reads them."""
    saved = [x.clone() for x in state]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    for x, value in zip(state, saved):
        x.copy_(value)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay
