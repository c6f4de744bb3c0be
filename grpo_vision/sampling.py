"""Sampling owns the distribution: CFG, temperature, top-k/top-p, and the log-probs GRPO uses.

Rollouts (`sample`) prefill the condition into a preallocated KV cache and decode one image token
at a time (LlamaGen's `generate.py` pattern). Classifier-free guidance doubles the batch: rows
`[cond; null]` share one forward pass and `logits = uncond + s * (cond - uncond)`.

Which log-probs go into the policy ratio and the KL (`logprob_mode`):

* ``guided`` (default): the log-prob of the distribution the token was actually drawn from,
  `log softmax(filter(guided / T))`. The objective then is the deployed sampler itself, gradients
  flow through both CFG branches, and importance ratios are exact. Published recipes that use
  guided log-probs: Janus-Pro-R1 (guided / s), ddpo-pytorch, Flow-GRPO.
* ``conditional``: `log softmax(cond / T)`, the conditional branch alone, with no top-k/top-p
  (a filter of the conditional branch could exclude a token drawn from the guided one). This is
  what T2I-R1 and AR-GRPO do while sampling with CFG; cheaper (no null rows in training), but
  the ratio is then a ratio of a different distribution than the one sampled.

Top-k/top-p in guided mode are applied as masks on the guided logits. When scoring a token that is
known (teacher forcing), that token is always kept in the support: at the first update this is
exactly the rollout distribution (the drawn token was in it), and after updates it keeps log-probs
finite when the token drifts out of the top-k, instead of -inf ratios and infinite KL.

Randomness is per image: each row gets a seed and its own stream of uniforms, and tokens are drawn
by inverse-CDF sampling, so an image depends on (prompt, seed) and not on what else was in the
batch. That is what lets the demo show policy and reference for the same seed.

How a rollout runs (`decode`, not part of the distribution): ``eager`` attends over the keys written so
far, a shape that grows every step; ``static`` uses a cache preallocated at its full length, the
position a tensor on the device and the attention masked (`models/kv_cache.py`), so every tensor keeps
its shape and address; ``graph`` records that step, the token draw included, once as a CUDA graph and
replays it for every token (no per-token Python or kernel-launch cost; PyTorch's CUDA graphs docs, the
gpt-fast / LlamaGen `reduce-overhead` decode); ``compiled`` is the same static step compiled by
`torch.compile` (inductor fuses its norms, rotary, residuals and the draw into fewer kernels), recorded as
a CUDA graph on a GPU and run as it is on a CPU. The compiled step is one function of the module
(`decode_step`), compiled once per process and shape, never per rollout. All draw the same tokens from the
same seeds. ``speculative`` (speculative.py, SJD) verifies several drafted tokens a forward pass: the same
distribution, exactly, but other tokens for a seed.

A text plan before the image (`sample.plan`, T2I-R1's two-stage rollout, arXiv 2505.00703; policy.PlanningPolicy):
`sample_plan` draws plan tokens one at a time from the policy's plan logits, with the plan's own temperature /
top-k / top-p and no guidance, until each row's end token or `max_tokens`; `sequence_logprobs` scores them
with the same settings (T2I-R1 sampled with transformers' default generation config and scored with a plain
softmax: a gap this closes). A row's plan uniforms are its seed's stream after its N image uniforms, so the
image tokens of a (condition, seed) are the same with or without a plan stage before them.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from grpo_vision.config import ConfigError
from grpo_vision.policy import ImagePolicy

LOGPROB_MODES = ("guided", "conditional")
DECODE_MODES = ("auto", "eager", "static", "graph", "compiled", "speculative")


@dataclass(frozen=True)
class SamplingParams:
    cfg_scale: float = 1.0  # 1 = no guidance (no null rows)
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    logprob_mode: str = "guided"  # "guided" | "conditional", see module docstring
    decode: str = "eager"  # how a rollout runs: auto | eager | static | graph | compiled | speculative (docstring)
    mixed_precision: str = "no"  # "bf16": the rollout runs under bf16 autocast (sample.mixed_precision)
    plan: PlanParams | None = None  # a text plan before each image (sample.plan); None: the image stage only
    speculative_window: int = 16  # decode=speculative: tokens one forward pass verifies (speculative.py)
    speculative_draft: str = "coupled"  # decode=speculative: "jacobi" (SJD's drafts) | "coupled" (MC-SJD's)

    def __post_init__(self):
        if self.logprob_mode not in LOGPROB_MODES:
            raise ValueError(f"logprob_mode must be one of {LOGPROB_MODES}, got {self.logprob_mode!r}")
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {self.decode!r}")
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision must be 'no' or 'bf16', got {self.mixed_precision!r}")
        # as config/schema.py checks sample.temperature and sample.cfg_scale: NaN passes `<= 0` and inf is a
        # number, and either turns every logit into NaN (every token the same code, NaN log-probs) without an error
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if not (math.isfinite(self.cfg_scale) and self.cfg_scale >= 0):
            raise ValueError(f"cfg_scale must be a finite number >= 0, got {self.cfg_scale}")
        if self.speculative_window < 1:
            raise ValueError(f"speculative_window must be >= 1, got {self.speculative_window}")
        if self.speculative_draft not in ("jacobi", "coupled"):
            raise ValueError(f"speculative_draft must be 'jacobi' or 'coupled', got {self.speculative_draft!r}")

    @property
    def guided(self) -> bool:
        return self.cfg_scale != 1.0

    @classmethod
    def from_config(cls, sample_cfg, temperature: float | None = None) -> "SamplingParams":
        """The settings of a config's `sample` section; `temperature` replaces sample.temperature
        (evaluation at other temperatures; training always samples at the configured one)."""
        s, p = sample_cfg, sample_cfg.plan
        plan = PlanParams(p.max_tokens, p.temperature, p.top_k, p.top_p, p.template) if p.enabled else None
        return cls(s.cfg_scale, temperature or s.temperature, s.top_k, s.top_p, s.logprob_mode, s.decode,
                   s.mixed_precision, plan, s.speculative_window, s.speculative_draft)


@dataclass(frozen=True)
class PlanParams:
    """The text stage's settings (sample.plan): its distribution, sampled and scored alike, and its prompt."""
    max_tokens: int = 64  # the plan-length cap, its end token included
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    template: str = "{prompt}"  # the text stage's prompt; {prompt} is the caption

    def __post_init__(self):
        if self.max_tokens < 1 or self.temperature <= 0:
            raise ValueError(f"a plan needs max_tokens >= 1 and temperature > 0, got {self.max_tokens}, "
                             f"{self.temperature}")

    @property
    def distribution(self) -> "SamplingParams":
        """The plan tokens' distribution as image tokens' are written: no guidance, filters kept when scoring."""
        return SamplingParams(1.0, self.temperature, self.top_k, self.top_p, "guided")


@dataclass
class Plan:  # the text stage of B rollouts; every row T = max_tokens wide
    ids: torch.Tensor  # [B, L] the text stage's input ids (the templated prompt)
    tokens: torch.Tensor  # [B, T] plan tokens, the end token included; the end token again after it (never read)
    mask: torch.Tensor  # [B, T] bool, the plan's own tokens, its end token included (T2I-R1 masks after the EOS)
    logprobs: torch.Tensor  # [B, T] float32 the sampler's log-probs, 0 outside the mask
    entropy: torch.Tensor  # [B, T] float32 the entropy of each token's distribution, 0 outside the mask
    texts: list[str]  # [B] each plan as text (policy.plan_text), without its end token
    prompts: list[str]  # [B] the text stage's prompts (the template applied), from which `ids` were encoded

    @classmethod
    def empty(cls, rows: int, device=None) -> "Plan":
        """The text stage of `rows` rollouts drawn without one: T = 0, so that every rollout is one sequence of
        T + N positions, its plan segment empty (`plan_texts` shows no plan for it)."""
        z = torch.zeros(rows, 0, device=device)
        return cls(z.long(), z.long(), z.bool(), z, z.clone(), [""] * rows, [""] * rows)

    @property
    def width(self) -> int:
        """T, the plan segment's positions (0 without a text stage)."""
        return self.tokens.shape[1]

    def select(self, rows: torch.Tensor) -> "Plan":
        """The plan of `rows` (an index tensor or a bool mask `[B]`)."""
        index = rows.nonzero().squeeze(1) if rows.dtype == torch.bool else rows
        return Plan(*(getattr(self, f)[rows.to(self.ids.device)] for f in ("ids", "tokens", "mask", "logprobs",
                                                                             "entropy")),
                    [self.texts[int(i)] for i in index.tolist()], [self.prompts[int(i)] for i in index.tolist()])

    def token_lists(self, end: int) -> list[list[int]]:
        """Each row's plan tokens without its end token (what the image stage is conditioned on)."""
        keep = self.mask & (self.tokens != end)  # [B, T]
        return [row[m].tolist() for row, m in zip(self.tokens.cpu(), keep.cpu())]

    @staticmethod
    def cat(plans: Sequence["Plan"], encode=None) -> "Plan":
        """The rows of `plans` in order. Input ids of several widths (a kind that pads each batch to its longest
        prompt, as Janus does) are made again by `encode` (the policy's encode_plan_prompts) for all the prompts."""
        prompts = [t for p in plans for t in p.prompts]
        if len({p.ids.shape[1] for p in plans}) == 1:
            ids = torch.cat([p.ids for p in plans])
        elif encode is None:
            raise ValueError("the plans' input ids differ in width: pass the policy's encode_plan_prompts")
        else:
            ids = encode(prompts)
        return Plan(ids, *(torch.cat([getattr(p, f) for p in plans]) for f in ("tokens", "mask", "logprobs",
                                                                              "entropy")),
                    [t for p in plans for t in p.texts], prompts)


@dataclass
class Rollout:
    """B rollouts. `rollouts.draw` gives each its text stage (`Plan.empty`, T = 0, without sample.plan), so that a
    drawn rollout is one sequence of T + N positions, a plan segment then an image segment: `sequence_logprobs`,
    `count` and `image_segment` are `[B, T + N]` whatever the stage (nanochat's engine masks, torchtune's
    response_padding_masks, TRL's completion_mask carry such a segment as an always-present mask)."""
    tokens: torch.Tensor  # [B, N] int64 codebook ids
    logprobs: torch.Tensor  # [B, N] float32, per `logprob_mode`
    entropy: torch.Tensor  # [B, N] float32, entropy of the sampling distribution at each step
    plan: Plan | None = None  # the text stage before the image (sample.plan); None: none, made `Plan.empty`
    # [B] int64 forward passes each row's image needed, the prefill included (speculative decoding; None: plain
    # decoding, N each): rollout/forwards_per_image in the metrics
    forwards: torch.Tensor | None = None

    def __post_init__(self):
        self.plan = Plan.empty(self.tokens.shape[0], self.tokens.device) if self.plan is None else self.plan

    @property
    def sequence_logprobs(self) -> torch.Tensor:
        """`[B, T + N]` the sampler's log-probs of the plan's tokens (0 after its end), then of the image's."""
        return torch.cat([self.plan.logprobs, self.logprobs], 1)

    def count(self, plan_weight: float = 1.0) -> torch.Tensor:
        """`[B, T + N]` how much each token counts (grpo.TokenWeights.count): `plan_weight` on a plan's tokens, its
        end token included, 0 on its padding, 1 on every image token."""
        return torch.cat([self.plan.mask.float() * plan_weight, torch.ones_like(self.logprobs)], 1)

    @property
    def image_segment(self) -> torch.Tensor:
        """`[B, T + N]` bool, the image positions (the segment mask the image-grid options read)."""
        return torch.cat([torch.zeros_like(self.plan.mask), torch.ones_like(self.tokens, dtype=torch.bool)], 1)

    def select(self, rows: torch.Tensor) -> "Rollout":
        """The rollouts `rows` (an index tensor), every field kept."""
        pick = lambda x: None if x is None else x[rows.to(x.device)]  # noqa: E731
        return Rollout(pick(self.tokens), pick(self.logprobs), pick(self.entropy), self.plan.select(rows),
                       pick(self.forwards))

    @staticmethod
    def cat(parts: Sequence["Rollout"], encode=None) -> "Rollout":
        """The rows of `parts` in order, every field kept (`encode`: Plan.cat's)."""
        return Rollout(*(torch.cat([getattr(p, f) for p in parts]) for f in ("tokens", "logprobs", "entropy")),
                       Plan.cat([p.plan for p in parts], encode), cat_forwards([p.forwards for p in parts]))


# ---------------------------------------------------------------------------- the distribution


def kth_largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value along the last dim, `[..., 1]` (no gradient: it is a threshold)."""
    # numpy's introselect beats torch.topk on CPU (docs/benchmarks.md), but would break a compiled step in two
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        i = x.shape[-1] - k
        a = np.partition(x.detach().float().numpy(), i, axis=-1)[..., i:i + 1]
        return torch.from_numpy(a).to(x.dtype)
    return torch.topk(x, k, dim=-1).values[..., -1:]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Mask logits `[..., K]` outside the top-k / top-p set with -inf; `keep` `[...]` always survives."""
    remove = torch.zeros_like(logits, dtype=torch.bool)  # [..., K]
    if 0 < top_k < logits.shape[-1]:
        kth = kth_largest(logits, top_k)  # [..., 1]
        remove |= logits < kth
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits.masked_fill(remove, float("-inf")), dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)  # [..., K]
        mass_before = probs.cumsum(-1) - probs  # [..., K]
        outside = mass_before >= top_p  # [..., K] sorted order; keeps the smallest set reaching top_p
        remove |= torch.zeros_like(outside).scatter(-1, order, outside)
    if keep is not None:
        remove.scatter_(-1, keep.unsqueeze(-1), False)
    return logits.masked_fill(remove, float("-inf"))


def guided_logits(cond: torch.Tensor, uncond: torch.Tensor | None, cfg_scale: float) -> torch.Tensor:
    return cond if uncond is None else uncond + cfg_scale * (cond - uncond)  # [..., K]


def token_logprobs(cond: torch.Tensor, uncond: torch.Tensor | None, tokens: torch.Tensor,
                   params: SamplingParams, with_entropy: bool = False):
    """Log-probs `[...]` of known `tokens` under `params.logprob_mode`; the one formula for both paths.
    `with_entropy`: (log-probs, the entropy `[...]` of the same distribution at each position)."""
    cond, uncond = cond.float(), None if uncond is None else uncond.float()
    if params.logprob_mode == "conditional":
        logits = cond / params.temperature  # [..., K]
    else:
        logits = guided_logits(cond, uncond, params.cfg_scale) / params.temperature  # [..., K]
        logits = filter_logits(logits, params.top_k, params.top_p, keep=tokens)
    logp = logits.log_softmax(-1)  # [..., K]
    picked = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [...]
    if not with_entropy:
        return picked
    return picked, -(logp.exp() * logp.masked_fill(logp == float("-inf"), 0.0)).sum(-1)  # [...] each


def target_logp(cond: torch.Tensor, uncond: torch.Tensor | None, params: SamplingParams) -> torch.Tensor:
    """`log softmax(filter(guided / T))` `[..., K]`, -inf outside the filter: the distribution every image token
    is drawn from (plain and speculative decoding alike)."""
    cond, uncond = cond.float(), None if uncond is None else uncond.float()
    logits = guided_logits(cond, uncond, params.cfg_scale) / params.temperature  # [..., K]
    return filter_logits(logits, params.top_k, params.top_p).log_softmax(-1)  # [..., K]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token `[...]` from each (unnormalised) distribution `probs` `[..., K]`, uniforms `u` `[...]` in [0, 1)."""
    cdf = probs.cumsum(-1)  # [..., K]
    # v in (0, total]: zero-probability tokens are never drawn
    v = (1.0 - u).unsqueeze(-1) * cdf[..., -1:]  # [..., 1]
    return torch.searchsorted(cdf, v).clamp_max(cdf.shape[-1] - 1).squeeze(-1)  # [...]


def entropy_of(logp: torch.Tensor) -> torch.Tensor:
    """The entropy `[...]` of distributions given as log-probs `[..., K]` (-inf entries add nothing)."""
    probs = logp.exp()  # [..., K]
    return -(probs * logp.masked_fill(probs == 0, 0.0)).sum(-1)  # [...]


def reported_logp(cond: torch.Tensor, logp: torch.Tensor, token: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The log-prob `[...]` a rollout returns for a `token` drawn from `logp` `[..., K]` (target_logp), per
    `params.logprob_mode`: the drawn distribution's, or the conditional branch's alone."""
    if params.logprob_mode == "conditional":
        logp = (cond.float() / params.temperature).log_softmax(-1)
    return logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)


def sample_token(cond: torch.Tensor, uncond: torch.Tensor | None, u: torch.Tensor, params: SamplingParams):
    """Draw one token per row from logits `[B, K]` with uniforms `u` `[B]`; return (token, logp, entropy)."""
    logp = target_logp(cond, uncond, params)  # [B, K], -inf outside
    token = inverse_cdf(logp.exp(), u)  # [B]
    return token, reported_logp(cond, logp, token, params), entropy_of(logp)


def seeded_uniforms(seeds: Sequence[int] | torch.Tensor, n: int, device) -> torch.Tensor:
    """`[B, n]` uniforms, row i from its own generator seeded with seeds[i]."""
    rows = [torch.rand(n, generator=torch.Generator().manual_seed(int(s))) for s in seeds]
    return torch.stack(rows).to(device)


# ---------------------------------------------------------------------------- rollouts


def decode_mode(policy: ImagePolicy, requested: str, device: torch.device) -> str:
    """The decode path a rollout takes: `auto` is a CUDA graph where the policy has a static decode and
    the rows are on a GPU, else eager. A ValueError when a path is asked for that cannot run."""
    static = getattr(policy, "static_decode", False)  # policies opt in: new_cache(rows, static=True)
    if requested in ("auto", "eager"):
        return "graph" if requested == "auto" and static and device.type == "cuda" else "eager"
    if requested == "speculative":
        if not hasattr(policy, "decode_block"):
            raise ValueError(f"sample.decode 'speculative': {type(policy).__name__} has no decode_block (several "
                             "tokens a row from per-row cache positions); use eager")
        return requested
    if not static:
        raise ValueError(f"sample.decode {requested!r}: {type(policy).__name__} has no static decode; use eager")
    if requested == "graph" and device.type != "cuda":
        raise ValueError(f"sample.decode 'graph' needs a CUDA device (the rows are on {device}); use static or auto")
    return requested


def decode_note(decode: str, device: torch.device | str) -> str | None:
    """The line a command prints before its first rollout where `sample.decode` costs time a user would not guess
    (None: nothing to say). Measured figures: docs/benchmarks.md (the compiled step on a CPU: 0.86-1.1 s a sampler
    call against eager's 0.48-0.52 at the built-in policy's size) and docs/experiments/speculative_rollouts.md (a
    main-job step took 14 s speculative against 9.3 plain on a CPU)."""
    cpu = torch.device(device).type == "cpu"
    if decode == "compiled":
        return ("sample.decode=compiled: compiling the decode step at the first rollout, once per process and shape "
                + ("(about 30 s on a CPU); on a CPU the compiled step has measured slower than eager decoding at the "
                   "built-in policy's size (docs/benchmarks.md)" if cpu else "(inside the CUDA graph)"))
    if decode == "speculative" and cpu:
        return ("sample.decode=speculative on a CPU: exact, but slower than plain decoding here (a pass over W tokens "
                "costs about W single-token steps; a main-job step took 14 s against 9.3); its fewer passes are "
                "meant for a GPU (docs/experiments/speculative_rollouts.md)")
    return None


def draw(logits: torch.Tensor, u: torch.Tensor, col: torch.Tensor, out: Rollout,
         params: SamplingParams) -> torch.Tensor:
    """Token `col` of every row from `logits` `[B or 2B, K]` (CFG's null rows after the B conditional ones) with
    uniforms `u` `[B, N]`, written into `out`; returns the rows to decode next `[B or 2B]`."""
    B = u.shape[0]
    c, un = (logits[:B], logits[B:]) if params.guided else (logits, None)
    token, logp, entropy = sample_token(c, un, u.gather(1, col).squeeze(1), params)
    for buffer, value in zip((out.tokens, out.logprobs, out.entropy), (token, logp, entropy)):
        buffer.scatter_(1, col, value.unsqueeze(1))
    col.add_(1)
    return token.repeat(2) if params.guided else token  # [B or 2B]


def decode_step(policy: ImagePolicy, cache, logits: torch.Tensor, u: torch.Tensor, col: torch.Tensor, out: Rollout,
                params: SamplingParams) -> torch.Tensor:
    """One token of every row: drawn from `logits`, decoded into `cache`, the next logits written over `logits`.
    Every tensor it reads and writes keeps its address (a static cache), so a CUDA graph can record it."""
    return logits.copy_(policy.decode(draw(logits, u, col, out, params), cache))


@lru_cache(maxsize=1)  # made at the first compiled rollout of the process
def compiled_decode_step():
    """`decode_step` compiled by inductor, once per process: torch.compile caches the code per dtype and setting
    (guards), so a later rollout runs it without compiling again. Shapes are left to its automatic dynamic mode:
    a Janus cache is as long as the batch's longest prompt, and the second length seen compiles a version for
    any length, not one a step."""
    # a recompile per group size, dtype and setting; the default limit of 8 would fall back to eager silently
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(decode_step)


@torch.no_grad()  # not inference_mode: rollout tensors are reused by autograd in training
def sample(policy: ImagePolicy, cond: torch.Tensor, seeds: Sequence[int] | torch.Tensor,
           params: SamplingParams) -> Rollout:
    """Sample N image tokens for each condition row `[B, L]`, row i from seed `seeds[i]`."""
    B, N, device = cond.shape[0], policy.num_image_tokens, cond.device
    if len(seeds) != B:
        raise ValueError(f"got {len(seeds)} seeds for {B} condition rows; pass one seed per image")
    mode = decode_mode(policy, params.decode, device)
    if mode == "speculative":
        from grpo_vision.speculative import sample_speculative  # it builds on this module's distribution
        return sample_speculative(policy, cond, seeds, params)[0]  # its Rollout.forwards: the passes it took
    u = seeded_uniforms(seeds, N, device)  # [B, N]
    rows = torch.cat([cond, policy.null_condition(cond)]) if params.guided else cond  # [B or 2B, L]
    cache = policy.new_cache(rows.shape[0], static=True) if mode != "eager" else policy.new_cache(rows.shape[0])
    out = Rollout(torch.zeros(B, N, dtype=torch.long, device=device), torch.zeros(B, N, device=device),
                  torch.zeros(B, N, device=device))
    col = torch.zeros(B, 1, dtype=torch.long, device=device)  # the token being drawn, a tensor a graph can read
    logits = policy.prefill(rows, cache)  # [B or 2B, K]
    if mode in ("graph", "compiled") and N > 1:
        step = compiled_decode_step() if mode == "compiled" else decode_step
        with compile_errors(mode):
            if device.type == "cuda":
                replay = record_step(lambda: step(policy, cache, logits, u, col, out, params),
                                     [logits, col, cache.position])
            else:  # inductor's CPU code, run step by step
                replay = lambda: step(policy, cache, logits, u, col, out, params)  # noqa: E731
                replay()
        for _ in range(N - 2 if mode == "compiled" and device.type != "cuda" else N - 1):
            replay()
    else:
        for _ in range(N - 1):
            logits = policy.decode(draw(logits, u, col, out, params), cache)
    draw(logits, u, col, out, params)  # the last token: nothing decodes after it
    return out


class CompileError(ConfigError):
    """torch.compile could not compile the decode step (sample.decode: compiled): one line, naming the fix."""


@contextmanager
def compile_errors(mode: str):
    """Inductor's failures while compiling the decode step, as one CompileError line: torch 2.11's Triton code
    generation failed on the Janus-Pro-1B step on an H200 (docs/benchmarks.md), where the CUDA graph runs."""
    if mode != "compiled":
        yield
        return
    try:
        yield
    except Exception as e:
        if not type(e).__module__.startswith(("torch._inductor", "torch._dynamo")):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        raise CompileError(f"sample.decode=compiled: torch {torch.__version__} could not compile this policy's decode "
                           f"step ({type(e).__name__}: {first[:200]}); use sample.decode=graph (a GPU) or eager"
                           ) from None


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


@torch.no_grad()
def sample_plan(policy, prompts: Sequence[str], seeds: Sequence[int], params: PlanParams) -> Plan:
    """The text stage of one rollout per prompt (policy.PlanningPolicy), row i from seed `seeds[i]`: plan tokens
    drawn one at a time, without guidance, until each row's end token or `params.max_tokens` (a plan cut there
    keeps its tokens, as T2I-R1's `max_textcot_length` does). Rows that have ended are not read again."""
    B, T, end = len(prompts), params.max_tokens, policy.plan_end_id
    if len(seeds) != B:
        raise ValueError(f"got {len(seeds)} seeds for {B} prompts; pass one seed per image")
    texts = [params.template.format(prompt=p) for p in prompts]
    ids = policy.encode_plan_prompts(texts)  # [B, L]
    device, dist = ids.device, params.distribution
    # each row's stream after its N image uniforms: the image stage draws the same uniforms with or without a plan
    u = seeded_uniforms(seeds, policy.num_image_tokens + T, device)[:, policy.num_image_tokens:]  # [B, T]
    tokens = torch.full((B, T), end, dtype=torch.long, device=device)
    mask = torch.zeros(B, T, dtype=torch.bool, device=device)
    logprobs, entropy = torch.zeros(B, T, device=device), torch.zeros(B, T, device=device)
    cache = policy.new_plan_cache(B, T)
    logits = policy.plan_prefill(ids, cache)  # [B, V]
    alive = torch.ones(B, dtype=torch.bool, device=device)  # rows whose plan has not ended
    for t in range(T):
        token, logp, ent = sample_token(logits, None, u[:, t], dist)  # [B] each
        tokens[:, t] = torch.where(alive, token, end)
        logprobs[:, t], entropy[:, t] = logp * alive, ent * alive
        mask[:, t] = alive
        alive &= token != end
        if t == T - 1 or not bool(alive.any()):  # one host read a plan token: plans are short, images are not
            break
        logits = policy.plan_decode(tokens[:, t], cache)  # [B, V]
    plan = Plan(ids, tokens, mask, logprobs, entropy, [], texts)
    plan.texts = [policy.plan_text(row) for row in plan.token_lists(end)]
    return plan


def plan_logprobs(logits: torch.Tensor, plan: Plan, params: PlanParams, with_entropy: bool = False):
    """Log-probs `[B, T]` of the plan's tokens from teacher-forced plan logits `[B, T', V]` (T' <= T: the batch's
    longest plan), 0 outside its mask, with the settings it was sampled with (`with_entropy`: and entropies)."""
    used = logits.shape[1]
    picked = token_logprobs(logits, None, plan.tokens[:, :used], params.distribution, with_entropy)
    outs = picked if with_entropy else (picked,)
    mask = plan.mask
    padded = [torch.cat([x, x.new_zeros(x.shape[0], mask.shape[1] - used)], 1).masked_fill(~mask, 0.0) for x in outs]
    return tuple(padded) if with_entropy else padded[0]


def plan_width(plan: Plan) -> int:
    """The teacher-forced plan positions a batch needs: up to its longest plan's end token."""
    seen = plan.mask.any(0).nonzero()
    return int(seen[-1]) + 1 if len(seen) else 1


def sample_batched(policy: ImagePolicy, cond: torch.Tensor, seeds: Sequence[int], params: SamplingParams,
                   batch_size: int) -> Rollout:
    """`sample` in chunks of `batch_size` rows (the results do not depend on the chunking)."""
    parts = [sample(policy, cond[i:i + batch_size], seeds[i:i + batch_size], params)
             for i in range(0, cond.shape[0], batch_size)]
    return Rollout(*(torch.cat([getattr(p, f) for p in parts]) for f in ("tokens", "logprobs", "entropy")),
                   forwards=cat_forwards([p.forwards for p in parts]))


def cat_forwards(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Rollout.forwards of rows put together: None unless every part has them."""
    return torch.cat(list(parts)) if parts and all(f is not None for f in parts) else None


# ---------------------------------------------------------------------------- training log-probs


def sequence_logprobs(policy: ImagePolicy, cond: torch.Tensor, tokens: torch.Tensor,
                      params: SamplingParams, with_entropy: bool = False, plan: Plan | None = None):
    """Teacher-forced log-probs `[B, N]` of `tokens` `[B, N]`, with gradients, in one forward pass
    (`with_entropy`: and each position's entropy `[B, N]`, the entropy bonus's and STAGE's).

    Equal to `sample(...).logprobs` for the same policy weights (a test checks ratio == 1). With the rows' `plan`:
    `[B, T + N]`, the plan's log-probs (`plan_logprobs`, 0 after its end) before the image's, from one call of the
    module (`forward(cond, tokens, plan)`), so that DDP's and FSDP's hooks see one forward for both segments.
    """
    B = cond.shape[0]
    plan = plan if plan is not None and plan.width else None  # T = 0: the image segment is the whole sequence
    guided = params.guided and params.logprob_mode == "guided"  # conditional mode needs the conditional branch only
    if guided:
        null = getattr(policy, "module", policy).null_condition(cond)  # a DDP wrapper keeps the policy in .module
        rows, image_tokens = torch.cat([cond, null]), tokens.repeat(2, 1)  # [2B, L], [2B, N]
    else:
        rows, image_tokens = cond, tokens
    # the policy is called (its forward is image_logits), so that a DDP or FSDP wrapper's hooks run
    if plan is None:
        logits, text = policy(rows, image_tokens), None  # [2B or B, N, K]
    else:  # the forward stops at the batch's longest plan's end: [2B or B, N, K], [B, T', V]
        logits, text = policy(rows, image_tokens, dataclasses.replace(plan, tokens=plan.tokens[:, :plan_width(plan)]))
    c, un = (logits[:B], logits[B:]) if guided else (logits, None)
    image = token_logprobs(c, un, tokens, params, with_entropy)  # [B, N]
    if plan is None:
        return image
    planned = plan_logprobs(text.float(), plan, params.plan, with_entropy)  # [B, T]
    if not with_entropy:
        return torch.cat([planned, image], 1)  # [B, T + N]
    return torch.cat([planned[0], image[0]], 1), torch.cat([planned[1], image[1]], 1)


def micro_batches(rows: int | torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
    """Row indices in consecutive chunks of `size`: of `range(rows)`, or of the given index tensor (an
    update's shuffled minibatch). The one way every pass over a step's sequences splits them."""
    rows = torch.arange(rows) if isinstance(rows, int) else rows
    return rows.split(size)


@torch.no_grad()
def batched_logprobs(policy: ImagePolicy, cond: torch.Tensor, tokens: torch.Tensor, params: SamplingParams,
                     micro_batch: int, with_entropy: bool = False, plan: Plan | None = None):
    """`sequence_logprobs` without gradients, `micro_batch` rows a forward pass: `[B, N]` (the old and
    the reference log-probs of a step; `with_entropy`: and the entropies `[B, N]`; with a `plan`, `[B, T + N]`)."""
    parts = [sequence_logprobs(policy, cond[idx], tokens[idx], params, with_entropy,
                               None if plan is None else plan.select(idx))
             for idx in micro_batches(cond.shape[0], micro_batch)]
    if not with_entropy:
        return torch.cat(parts)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

