"""What several test files share: the repository root, the real command line in a subprocess, and the
micro run's config. Imported as `tests.helpers` (the tests run from the repository root, as the reward
specs `python:tests.test_train:...` do); fixtures live in conftest.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO = ROOT / "configs" / "shapes_micro.yaml"  # two steps of 2 prompts x 4 images on the micro world


def cli_cmd(*args) -> list[str]:
    """`grpo-vision ARGS` as a fresh interpreter runs it (for Popen: signals, several processes)."""
    return [sys.executable, "-m", "grpo_vision.cli", *map(str, args)]


def run_cli(*args, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    """`grpo-vision ARGS` in a subprocess from the repository root, its output captured as text. Only for
    what needs a process of its own: exit codes and stderr as a shell sees them, signals, start-up
    imports; anything else calls `grpo_vision.cli.main([...])` or the library in-process."""
    return subprocess.run(cli_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kwargs)


def micro_args(world, out, *overrides) -> list[str]:
    """`train`'s arguments for the micro config on `world`, its run under `out`: no sample grids, one eval image."""
    return [str(MICRO), f"policy.path={world}", f"run.out_dir={out}", "log.sample_every=0", "log.eval_images=1",
            *overrides]


def micro_cfg(world, out, *overrides):
    """The same run as a Config, for `grpo_vision.train.train(cfg, progress=False)` in this process."""
    from grpo_vision.config import load_config

    path, *rest = micro_args(world, out, *overrides)
    return load_config(path, rest)


@contextmanager
def within(seconds: int):
    """Fail, rather than hang, when the body blocks: a FIFO opened for reading waits for a writer for ever."""
    def stop(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def png_declaring(path: Path, width: int, height: int) -> Path:
    """A valid 1 x 1 PNG whose header (IHDR, its CRC recomputed) declares `width` x `height`: a few hundred
    bytes that a decoder would size its buffers from."""
    import io
    import struct
    import zlib

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())  # signature (8), then IHDR: length (4), "IHDR", 13 bytes of fields, CRC
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    path.write_bytes(bytes(data))
    return path


def refuse_writes(monkeypatch) -> None:
    """Every os.open fails with EROFS, as on a folder that turned read-only (root passes permission checks, so the
    refusal is simulated where it happens)."""
    import errno
    import os

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(args[0]))

    monkeypatch.setattr(os, "open", read_only)


def peaked_llama(scale: float, **config):
    """A tiny random built-in policy (seed 0) in eval mode, every weight matrix times `scale`: random N(0, 0.02)
    weights give near-uniform conditionals, scaled ones peaked enough that top-k / top-p cut real mass."""
    import torch

    from grpo_vision.models.llama import LlamaImagePolicy, LlamaPolicyConfig

    torch.manual_seed(0)
    policy = LlamaImagePolicy(LlamaPolicyConfig(**config)).eval()
    with torch.no_grad():
        for p in policy.parameters():
            if p.ndim > 1:
                p.mul_(scale)
    return policy
