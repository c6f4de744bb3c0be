"""An estimate of a run's peak memory, printed beside the derived sizes at the start of `train`.

A batch that cannot fit is refused before any sampling (ConfigError naming the knob to lower), not
minutes later by an out-of-memory traceback. The estimate counts the policy's side only (reward
models are not counted; a reward that judges with the policy's own network, self_judge, is: its forward).
Policies that expose their sizes (`architecture()`: the built-in, LlamaGen and Janus) get every part: weights, optimizer, the step's buffers, the sampler's KV cache and logits,
and the update's saved activations and logits; a policy that does not gets weights and optimizer only,
and the estimate says it is a lower bound. `bench step` logs it beside the measured peak
(`perf/memory_estimate_gib`; docs/benchmarks.md compares them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from grpo_vision.config import ConfigError
from grpo_vision.run.health import warn

GIB = 2**30
WARN_FRACTION = 0.8  # warn when the estimate is above this fraction of the available memory
RETURN_FRACTION = 0.3  # on a CPU, from this fraction up freed memory is returned at once (machine.return_freed_memory)


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
    weight_bytes: int | None = None  # bytes of all parameters (dtypes may differ: a float32 VQ beside bf16 layers)
    trainable_bytes: int | None = None  # bytes of the trainable parameters (peft keeps adapters in float32)
    kv_bytes: int | None = None  # bytes per cached key or value (Janus decodes from float32 on a CPU)
    fused_copy: bool = False  # decode keeps concatenated copies of q/k/v and gate/up (the built-in policy)
    extra_bytes: int = 0  # frozen weights beside the policy's parameters (LlamaGen-T2I's T5 caption encoder)
    runtime_bytes: int = 0  # on a CPU, the process before any step: libraries, loaders' buffers
    adapter_bytes: int = 0  # per token, all layers: the inputs peft adapters copy to their own dtype (`adapter_copies`)
    adapter: bool = False  # the trainable weights are adapters (the base layers' weights are frozen)
    judge_len: int | None = None  # tokens of an understanding prompt (text and image), where the policy reads images
    vocab: int | None = None  # the text head's rows: an understanding forward's last-position logits


def saved_bytes_per_token(dim: int, kv_dim: int, ffn: int, act_bytes: int, full: bool, weight_inputs: bool) -> int:
    """Bytes one Llama block keeps for its backward pass, per token, as counted with autograd's saved-tensor hooks on
    transformers' Llama layers at Janus-Pro-1B's width (bf16 and float32, LoRA and full fine-tune: within 1% of each;
    docs/benchmarks.md): attention's q, k, v and output (2 x dim + 2 x kv_dim), SwiGLU's gate, up and silu (3 x ffn)
    and the RMSNorms' float32 inputs (2 x dim x 4 B). Where the weights' gradients need their layers' inputs (`full`:
    a full fine-tune; `weight_inputs`: that, or adapters in the layers' own dtype, which read the inputs themselves)
    also the norms' outputs (2 x dim) and down_proj's input (ffn); a full fine-tune also o_proj's input and one more
    copy of the residual width (2 x dim). Adapters of another dtype keep their own copies instead (`adapter_copies`)."""
    values = 2 * dim + 2 * kv_dim + 3 * ffn
    if weight_inputs or full:
        values += 2 * dim + ffn
    if full:
        values += 2 * dim
    return values * act_bytes + 2 * dim * 4


def estimate_memory(shape: PolicyShape, images: int, sample_batch: int, micro_batch: int, guided: bool,
                    frozen_reference: bool, activation_bytes: int | None = None,
                    checkpointing: bool = False, merged: int = 0, plan_tokens: int = 0,
                    plan_vocab: int = 0, judge_rows: int = 0, window: int = 1) -> dict[str, int]:
    """Bytes per part of a step's peak on one process: `images` per process per step, `sample_batch`
    rows per sampler call, `micro_batch` rows per forward/backward; CFG doubles the rows. Activations are
    `activation_bytes` a value (2 under bf16 autocast; default the weights' dtype); `checkpointing` keeps
    one block's activations and every block's input. `merged`: the bytes of the merged weights sampling
    holds beside the originals (sample.merge_adapter; models/adapters.py merged_bytes). A text plan of up to
    `plan_tokens` over `plan_vocab` (sample.plan) lengthens the image condition by as much, and adds the update's
    teacher-forced text rows (the prompt and the plan, without CFG rows) and their float32 plan logits.
    `judge_rows`: images per understanding forward of a reward that reads the policy's own network (self_judge,
    reward.batch_size), scored between sampling and the update. `window`: the tokens a rollout's pass reads a row
    (sample.speculative_window under decode=speculative, else 1): the cache holds W positions more, and a pass's
    logits and its verification's distributions are about 8 float32 `[rows, W, K]` (counted from
    sampling/speculative.py iterate, not measured on a GPU) where a token's are 4 `[rows, K]`."""
    s, pb, cfg_rows = shape, shape.param_bytes, 2 if guided else 1
    trainable_bytes = s.trainable_bytes if s.trainable_bytes is not None else s.trainable * pb
    parts = {
        # a frozen reference is a second copy; a T5 caption encoder (LlamaGen-T2I) stays beside the policy
        "weights": (s.weight_bytes or s.params * pb) * (2 if frozen_reference else 1) + s.extra_bytes,
        "optimizer": trainable_bytes * 3,  # gradient + AdamW's two moments, in the trainable weights' dtype
        # the decoded images three times (a reward's full-batch copies: to_uint8 clamps, then scales),
        # tokens (int64) and three float32 [n, N] tensors: rollout log-probs, entropies, reference log-probs
        "step": images * (3 * 4 * s.image_values + s.image_tokens * (8 + 3 * 4)),
    }
    if s.runtime_bytes:
        parts["runtime"] = s.runtime_bytes
    if s.layers is None:
        return parts
    seq, head_dim, ab = s.cond_len + plan_tokens + s.image_tokens, s.dim // s.heads, activation_bytes or pb
    kv_dim = s.kv_heads * head_dim
    rows = sample_batch * cfg_rows
    slack = window if window > 1 else 0  # a speculative window's writes past the image
    kv_cache = 2 * s.layers * rows * kv_dim * (seq + slack) * (s.kv_bytes or pb)  # keys and values
    fused = s.layers * s.dim * ((s.heads + 2 * s.kv_heads) * head_dim + 2 * s.ffn_dim) * pb if s.fused_copy else 0
    logits = rows * s.codebook * 4 * (4 if window == 1 else 8 * window)  # a few float32 [rows, K] a token or window
    parts["sampling"] = kv_cache + fused + merged + logits
    rows = micro_batch * cfg_rows
    block = saved_bytes_per_token(s.dim, kv_dim, s.ffn_dim, ab, full=not s.adapter, weight_inputs=not s.adapter_bytes)
    per_token = (s.layers * s.dim * ab + block + s.adapter_bytes // s.layers if checkpointing
                 else s.layers * block + s.adapter_bytes)
    # logits, log-softmax and their gradient in float32
    parts["training"] = rows * seq * per_token + 3 * rows * s.image_tokens * s.codebook * 4
    if plan_tokens:  # the text rows' activations and plan logits, held with the image rows' until one backward
        parts["training"] += micro_batch * ((s.cond_len + plan_tokens) * per_token + 3 * plan_tokens * plan_vocab * 4)
    if judge_rows and s.judge_len:
        parts["judging"] = judging_bytes(s, judge_rows)
    return parts


def judging_bytes(s: PolicyShape, rows: int) -> int:
    """An understanding forward of `rows` images under no_grad and without a cache (models/janus_understanding.py):
    no layer's activations outlive it, so its peak is one Llama block's working set over the `judge_len` tokens
    (the residual, the norm's output, q, k, v, the attention's output and o_proj's: 5 x dim + 2 x kv_dim; SwiGLU's
    gate, up and product: 3 x ffn), the attention weights of the math kernel a CPU runs (heads x T x T), and the
    last position's float32 logits twice (the head's and the softmax's). The SigLIP tower runs before it over
    fewer tokens (576 at 1024 wide for Janus-Pro) and is freed by then."""
    T, head_dim = s.judge_len, s.dim // s.heads
    block = T * (5 * s.dim + 2 * s.kv_heads * head_dim + 3 * s.ffn_dim) + s.heads * T * T
    return rows * (block * s.param_bytes + 2 * (s.vocab or 0) * 4)


PHASES = ("sampling", "judging", "training")  # a step's phases, one after the other


def peak(parts: dict[str, int]) -> int:
    """Weights, optimizer and step buffers stay; sampling, judging (a self_judge's scoring) and training come one
    after the other."""
    stays = sum(v for k, v in parts.items() if k not in PHASES)
    return stays + max(parts.get(k, 0) for k in PHASES)


def policy_shape(policy, tokenizer, trainable: list[torch.Tensor], runtime_bytes: int = 0) -> PolicyShape:
    """The shape of a loaded policy; one image is decoded to learn the image size. `runtime_bytes`: what the
    process held before loading it (on a CPU; `resident_bytes`)."""
    params = list(policy.parameters())
    device = params[0].device
    with torch.no_grad():
        image = tokenizer.decode(torch.zeros(1, policy.num_image_tokens, dtype=torch.long, device=device))
    inner = getattr(policy, "get_base_model", lambda: policy)()  # a peft wrapper's model
    arch = dict(inner.architecture()) if hasattr(inner, "architecture") else {}
    return PolicyShape(sum(p.numel() for p in params), sum(p.numel() for p in trainable), params[0].element_size(),
                       policy.num_image_tokens, image[0].numel(),
                       weight_bytes=sum(p.numel() * p.element_size() for p in params), adapter_bytes=adapter_copies(policy),
                       trainable_bytes=sum(p.numel() * p.element_size() for p in trainable), runtime_bytes=runtime_bytes,
                       adapter=any(hasattr(m, "base_layer") for m in policy.modules()), **arch)


def adapter_copies(policy) -> int:
    """Bytes a token costs, over all layers, in the input copies peft adapters keep for the backward pass: a
    LoRA layer casts its input to its own float32 weights when the layer is bf16, and autograd keeps that
    copy (a Janus-Pro-1B-sized LoRA step on a CPU: about 4 GiB of its 16, docs/benchmarks.md)."""
    total = 0
    for module in policy.modules():
        base = getattr(module, "base_layer", None)
        if base is None or not hasattr(base, "in_features"):
            continue
        own = [p for n, p in module.named_parameters() if not n.startswith("base_layer.") and p.requires_grad]
        if own and own[0].dtype != base.weight.dtype:
            total += base.in_features * own[0].element_size()
    return total


def resident_bytes() -> int | None:
    """This process's resident memory in bytes (Linux), else None."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux
        return None


def available_memory(device: torch.device) -> int | None:
    """Bytes this process may still use: free GPU memory plus what it holds there, or on the CPU the
    kernel's MemAvailable plus this process's resident memory; None when unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.split()}
        return info["MemAvailable"] + resident_bytes()
    except (OSError, KeyError, ValueError, IndexError, TypeError):  # not Linux: no check
        return None


# the knob that shrinks each part, for the refusal message
KNOBS = {"weights": "a smaller policy, policy.dtype, or train.adapter=lora with train.reference=adapter (no second copy)",
         "optimizer": "train.adapter=lora (trains an adapter only) or a smaller policy",
         "step": "sample.prompts_per_step (or sample.group_size): every image of a step is held at once",
         "sampling": "sample.batch_size (sequences per sampler call), or sample.merge_adapter=off (no merged copy)",
         "training": "train.micro_batch_size (sequences per forward/backward) or train.gradient_checkpointing",
         "judging": "reward.batch_size (images per understanding forward of the self_judge reward)",
         "runtime": "the other work in this process (it is what the process held before the run's first step)"}


def plan_cap_advice(parts_at: Callable[[int], dict[str, int]], max_tokens: int, available: int | None) -> str | None:
    """The advice to lower sample.plan.max_tokens, naming its value and the largest that fits, when it is what
    takes the estimate `parts_at(plan tokens)` over `available` (the run fits with a short plan); else None."""
    if not max_tokens or not available or peak(parts_at(max_tokens)) <= available or peak(parts_at(1)) > available:
        return None
    fits, over = 1, max_tokens  # the peak grows with the plan's length: bisect for the longest plan that fits
    while over - fits > 1:
        mid = (fits + over) // 2
        fits, over = (mid, over) if peak(parts_at(mid)) <= available else (fits, mid)
    return (f"sample.plan.max_tokens={max_tokens} lengthens every row's condition and adds the plan's rows and "
            f"logits: at most {fits} fits, so lower sample.plan.max_tokens to {fits} or less")


def check_memory(parts: dict[str, int], available: int | None, lower_bound: bool,
                 advice: str | None = None) -> tuple[str, str | None]:
    """(the line to print, a warning or None); ConfigError when the estimate exceeds `available`, with `advice`
    (else the knob of the largest part)."""
    need = peak(parts)
    what = "at least " if lower_bound else "about "
    line = (f"memory: {what}{need / GIB:.2f} GiB estimated peak ("
            + ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items()) + ")"
            + (f" of {available / GIB:.1f} GiB available" if available else "")
            + (" (architecture unknown: weights and optimizer only)" if lower_bound else ""))
    if not available or need <= WARN_FRACTION * available:
        return line, None
    largest = max(parts, key=parts.get)
    advice = advice if need > available and advice else \
        f"the largest part is {largest} ({parts[largest] / GIB:.2f} GiB): lower {KNOBS[largest]}"
    if need > available:
        raise ConfigError(f"this run needs {what}{need / GIB:.1f} GiB but {available / GIB:.1f} GiB are "
                          f"available; {advice}")
    return line, f"the estimated peak is {100 * need / available:.0f}% of the available memory; {advice}"


def config_parts(shape: PolicyShape, cfg, images_per_process: int, guided: bool, merged: int = 0,
                 plan_vocab: int = 0, judge_rows: int = 0, plan_tokens: int | None = None) -> dict[str, int]:
    """`estimate_memory` at a config's settings: what `train` estimates, and what `grpo-vision fit` checks its
    rows' overrides against (tools/fit.py); `judge_rows` as `estimate_memory`'s; `plan_tokens` in place of the
    config's plan cap (the refusal's search for the longest plan that fits)."""
    t = cfg.train
    return estimate_memory(shape, images_per_process, cfg.sample.batch_size, t.micro_batch_size, guided,
                           frozen_reference=t.reference == "frozen",
                           activation_bytes=2 if t.mixed_precision in ("bf16", "fp16") else None,
                           checkpointing=t.gradient_checkpointing, merged=merged,
                           plan_tokens=(cfg.sample.plan.max_tokens if cfg.sample.plan.enabled else 0)
                           if plan_tokens is None else plan_tokens,
                           plan_vocab=plan_vocab, judge_rows=judge_rows,
                           window=cfg.sample.speculative_window if cfg.sample.decode == "speculative" else 1)


def report_memory(policy, tokenizer, trainable: list[torch.Tensor], cfg, images_per_process: int, guided: bool,
                  device, loud: bool, runtime_bytes: int = 0, merged: int = 0,
                  optional_merge: bool = False, judge_rows: int = 0) -> tuple[int, bool]:
    """Estimate a run's peak memory for its config, print it (`loud`), warn when close, refuse when over;
    returns the estimated peak in bytes and whether rollouts merge the adapter. `runtime_bytes`: the process
    before the policy was loaded (a CPU's); `merged`: the merged weights' bytes when sampling merges, which
    `optional_merge` (sample.merge_adapter=auto) drops, saying so, where only they make the estimate too close;
    `judge_rows`: images per understanding forward of a reward that reads the policy's network (estimate_memory)."""
    shape = policy_shape(policy, tokenizer, trainable, runtime_bytes)
    available = available_memory(torch.device(device))

    plan_tokens = cfg.sample.plan.max_tokens if cfg.sample.plan.enabled else 0

    def parts_with(merged_bytes: int, plan: int = plan_tokens) -> dict[str, int]:
        return config_parts(shape, cfg, images_per_process, guided, merged_bytes,
                            getattr(policy, "plan_vocab_size", 0) or 0, judge_rows, plan)
    parts = parts_with(merged)
    if merged and optional_merge and available and peak(parts) > WARN_FRACTION * available \
            and peak(parts_with(0)) < peak(parts):
        if loud:
            print(f"[train] sample.merge_adapter=auto: sampling unmerged, the merged copy of the adapted weights "
                  f"({merged / GIB:.2f} GiB) would bring the estimate to {peak(parts) / GIB:.1f} of "
                  f"{available / GIB:.1f} GiB", flush=True)
        merged, parts = 0, parts_with(0)
    if torch.device(device).type == "cpu" and available and peak(parts) > RETURN_FRACTION * available:
        from grpo_vision.run.machine import return_freed_memory

        if return_freed_memory() and loud:  # glibc's arenas would keep what each phase freed (docs/benchmarks.md)
            print("[train] a large step for this CPU's memory: freed memory goes back to the system at once "
                  "(glibc's mmap threshold 64 KiB)", flush=True)
    line, too_close = check_memory(parts, available, lower_bound=shape.layers is None,
                                   advice=plan_cap_advice(lambda n: parts_with(merged, n), plan_tokens, available))
    if loud:
        print(f"[train] {line}", flush=True)
        if too_close:
            warn(too_close)
    return peak(parts), bool(merged)
