"""The distribution: CFG, temperature, top-k/top-p, and the log-probs GRPO uses.

A rollout (decode.py) draws every token with `sample_token`; training scores known tokens with `token_logprobs`
(score.py). Classifier-free guidance doubles the batch: rows `[cond; null]` share one forward pass and
`logits = uncond + s * (cond - uncond)`.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

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
    speculative_window: int = 32  # decode=speculative: tokens one forward pass verifies (speculative.py)
    speculative_draft: str = "coupled"  # decode=speculative: "jacobi" (SJD's drafts) | "coupled" (MC-SJD's)
    speculative_candidates: int = 8  # decode=speculative: drafts tried at each branching position (1: a chain)
    speculative_branching: int = 2  # decode=speculative: positions after the last kept token that branch

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
        if self.speculative_candidates < 1 or self.speculative_branching < 0:
            raise ValueError(f"speculative_candidates must be >= 1 and speculative_branching >= 0, got "
                             f"{self.speculative_candidates} and {self.speculative_branching}")

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
                   s.mixed_precision, plan, s.speculative_window, s.speculative_draft, s.speculative_candidates,
                   s.speculative_branching)


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


def branches(logits: torch.Tensor, B: int, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits `[B or 2B, ...]` of a guided batch as (conditional rows, CFG's null rows after them; None unguided)."""
    return (logits[:B], logits[B:]) if params.guided else (logits, None)


def guided_logits(cond: torch.Tensor, uncond: torch.Tensor | None, cfg_scale: float) -> torch.Tensor:
    return cond if uncond is None else uncond + cfg_scale * (cond - uncond)  # [..., K]


def scoring_logp(cond: torch.Tensor, uncond: torch.Tensor | None, tokens: torch.Tensor,
                 params: SamplingParams) -> torch.Tensor:
    """Log-probs `[..., K]` of the distribution known `tokens` `[...]` are scored under, per `params.logprob_mode`:
    the one formula of both paths (the rollout draws from `target_logp`, which it equals where the token is kept)."""
    cond, uncond = cond.float(), None if uncond is None else uncond.float()
    if params.logprob_mode == "conditional":
        return (cond / params.temperature).log_softmax(-1)  # [..., K]
    logits = guided_logits(cond, uncond, params.cfg_scale) / params.temperature  # [..., K]
    return filter_logits(logits, params.top_k, params.top_p, keep=tokens).log_softmax(-1)  # [..., K]


def token_logprobs(cond: torch.Tensor, uncond: torch.Tensor | None, tokens: torch.Tensor,
                   params: SamplingParams) -> torch.Tensor:
    """Log-probs `[...]` of known `tokens` under `params.logprob_mode` (`scoring_logp`)."""
    return scoring_logp(cond, uncond, tokens, params).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


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

