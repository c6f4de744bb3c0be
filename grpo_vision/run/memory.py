"""A rough estimate of a run's peak memory, printed beside the derived sizes at the start of `train`.

A batch that cannot fit is refused before any sampling (ConfigError naming the knob to lower), not
minutes later by an out-of-memory traceback. The estimate counts the policy's side only (reward
models are not counted) and is rough by design: enough to tell 2 GiB from 200 GiB. For a policy
that does not expose its architecture (Janus) only the weights and optimizer are counted, and the
estimate says it is a lower bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from grpo_vision.config import ConfigError
from grpo_vision.run.health import warn

GIB = 2**30
WARN_FRACTION = 0.8  # warn when the estimate is above this fraction of the available memory


@dataclass
class PolicyShape:  # what the estimate needs from a policy; the architecture fields are None when unknown
    params: int  # all parameters of the policy
    trainable: int  # parameters the optimizer updates
    param_bytes: int  # bytes per parameter (its dtype)
    image_tokens: int  # N, tokens per image
    image_values: int  # 3 * H * W, float32 values of one decoded image
    cond_len: int | None = None  # L, condition tokens per caption
    layers: int | None = None
    dim: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    ffn_dim: int | None = None
    codebook: int | None = None  # K, image-token logits per position


def estimate_memory(shape: PolicyShape, images: int, sample_batch: int, micro_batch: int, guided: bool,
                    frozen_reference: bool) -> dict[str, int]:
    """Bytes per part of a step's peak on one process: `images` per process per step, `sample_batch`
    rows per sampler call, `micro_batch` rows per forward/backward; CFG doubles the rows."""
    s, pb, cfg_rows = shape, shape.param_bytes, 2 if guided else 1
    parts = {
        "weights": s.params * pb * (2 if frozen_reference else 1),  # a frozen reference is a second copy
        "optimizer": s.trainable * pb * 3,  # gradient + AdamW's two moments
        # the decoded images three times (a reward's full-batch copies: to_uint8 clamps, then scales),
        # tokens (int64) and three float32 [n, N] tensors: rollout log-probs, entropies, reference log-probs
        "step": images * (3 * 4 * s.image_values + s.image_tokens * (8 + 3 * 4)),
    }
    if s.layers is None:
        return parts
    seq, head_dim = s.cond_len + s.image_tokens, s.dim // s.heads
    rows = sample_batch * cfg_rows
    kv_cache = 2 * s.layers * rows * s.kv_heads * seq * head_dim * pb  # keys and values
    fused = s.layers * s.dim * ((s.heads + 2 * s.kv_heads) * head_dim + 2 * s.ffn_dim) * pb  # decode's fused copies
    parts["sampling"] = kv_cache + fused + rows * s.codebook * 4 * 4  # a few float32 [rows, K] per token
    rows = micro_batch * cfg_rows
    # kept for backward, per layer and token: about 8 x dim + 3 x ffn_dim values, plus the attention
    # weights (heads x seq) when attention is not fused; logits, log-softmax and their gradient in float32
    per_token = s.layers * (8 * s.dim + 3 * s.ffn_dim + s.heads * seq) * pb
    parts["training"] = rows * seq * per_token + 3 * rows * s.image_tokens * s.codebook * 4
    return parts


def peak(parts: dict[str, int]) -> int:
    """Weights, optimizer and step buffers stay; sampling and training come one after the other."""
    return parts["weights"] + parts["optimizer"] + parts["step"] + max(parts.get("sampling", 0),
                                                                      parts.get("training", 0))


def policy_shape(policy, tokenizer, trainable: list[torch.Tensor]) -> PolicyShape:
    """The shape of a loaded policy; one image is decoded to learn the image size."""
    params = list(policy.parameters())
    device = params[0].device
    with torch.no_grad():
        image = tokenizer.decode(torch.zeros(1, policy.num_image_tokens, dtype=torch.long, device=device))
    c = getattr(policy, "cfg", None)  # the built-in policy's LlamaPolicyConfig; Janus exposes none
    known = all(hasattr(c, a) for a in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "cond_len"))
    arch = dict(cond_len=c.cond_len, layers=c.n_layers, dim=c.dim, heads=c.n_heads, kv_heads=c.n_kv_heads,
                ffn_dim=c.ffn_dim, codebook=policy.codebook_size) if known else {}
    return PolicyShape(sum(p.numel() for p in params), sum(p.numel() for p in trainable), params[0].element_size(),
                       policy.num_image_tokens, image[0].numel(), **arch)


def available_memory(device: torch.device) -> int | None:
    """Bytes this process may still use: free GPU memory plus what it holds there, or on the CPU the
    kernel's MemAvailable plus this process's resident memory; None when unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.split()}
        with open(f"/proc/{os.getpid()}/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return info["MemAvailable"] + resident
    except (OSError, KeyError, ValueError, IndexError):  # not Linux: no check
        return None


# the knob that shrinks each part, for the refusal message
KNOBS = {"weights": "a smaller policy, policy.dtype, or train.adapter=lora with train.reference=adapter (no second copy)",
         "optimizer": "train.adapter=lora (trains an adapter only) or a smaller policy",
         "step": "sample.prompts_per_step (or sample.group_size): every image of a step is held at once",
         "sampling": "sample.batch_size (sequences per sampler call)",
         "training": "train.micro_batch_size (sequences per forward/backward)"}


def check_memory(parts: dict[str, int], available: int | None, lower_bound: bool) -> tuple[str, str | None]:
    """(the line to print, a warning or None); ConfigError when the estimate exceeds `available`."""
    need = peak(parts)
    what = "at least " if lower_bound else "about "
    line = (f"memory: {what}{need / GIB:.2f} GiB estimated peak ("
            + ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items()) + ")"
            + (f" of {available / GIB:.1f} GiB available" if available else "")
            + (" (architecture unknown: weights and optimizer only)" if lower_bound else ""))
    if not available or need <= WARN_FRACTION * available:
        return line, None
    largest = max(parts, key=parts.get)
    advice = f"the largest part is {largest} ({parts[largest] / GIB:.2f} GiB): lower {KNOBS[largest]}"
    if need > available:
        raise ConfigError(f"this run needs {what}{need / GIB:.1f} GiB but {available / GIB:.1f} GiB are "
                          f"available; {advice}")
    return line, f"the estimated peak is {100 * need / available:.0f}% of the available memory; {advice}"


def report_memory(policy, tokenizer, trainable: list[torch.Tensor], cfg, images_per_process: int, guided: bool,
                  device, loud: bool) -> None:
    """Estimate a run's peak memory for its config, print it (`loud`), warn when close, refuse when over."""
    shape = policy_shape(policy, tokenizer, trainable)
    parts = estimate_memory(shape, images_per_process, cfg.sample.batch_size, cfg.train.micro_batch_size, guided,
                            frozen_reference=cfg.train.reference == "frozen")
    line, too_close = check_memory(parts, available_memory(torch.device(device)), lower_bound=shape.layers is None)
    if loud:
        print(f"[train] {line}", flush=True)
        if too_close:
            warn(too_close)
