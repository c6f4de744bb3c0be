"""Speculative Jacobi decoding (SJD): several image tokens a forward pass, drawn from exactly the plain sampler's
distribution (`sample.decode: speculative`).

SJD (Teng et al., "Accelerating Auto-regressive Text-to-Image Generation with Training-free Speculative Jacobi
Decoding", ICLR 2025, arXiv 2410.01699) drafts the next W - 1 tokens of every row, feeds the last accepted token
and the drafts through the model in one forward over W positions, and verifies the drafts left to right with the
speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023): draft x, drawn from q, is kept with probability
min(1, p(x) / q(x)), p the target at its position given the tokens before it; at the first rejection the token is
drawn from the residual norm(max(0, p - q)) and the rest of the window is dropped; a window whose drafts all pass
takes one more token from the next position's target. Each kept or redrawn token is then distributed as p given the
tokens kept before it, so a whole image is distributed exactly as plain decoding's. The target p is
`distribution.target_logp`: CFG, temperature, top-k and top-p applied as the plain sampler applies them.

The drafts are Jacobi's: the next window's draft for each position is drawn from this forward's prediction there
(computed from drafts that may since have been rejected), and positions this forward did not reach start from its
last prediction. Any q keeps the distribution exact as long as the draft was really drawn from q with randomness the
verification has not seen; a good q only raises acceptance. MC-SJD (arXiv 2510.24211) couples each new draft with
the previous one at the same position (maximal coupling: the old draft is kept with probability
min(1, q_new(x) / q_old(x)), else one is drawn from norm(max(0, q_new - q_old))), so that a draft's context changes
less from one iteration to the next; the coupled draft is still distributed as q_new (`coupled=True`).

Rows advance by their own accepted lengths (SJD's released code advances a batch by its shortest row's); the loop
stops when every row has its N tokens. Randomness is per row: the uniforms of iteration t of row i come from row
i's seed alone, so an image still depends on (condition, seed) and not on the batch. The stream is not the plain
path's: speculative and plain decoding draw the same distribution, not the same tokens for a seed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from grpo_vision.sampling.distribution import (
    SamplingParams, branches, entropy_of, inverse_cdf, reported_logp, seeded_uniforms, target_logp,
)
from grpo_vision.sampling.cuda_graph import record_step
from grpo_vision.sampling.sequences import Rollout


@dataclass
class SpeculativeStats:  # what speculative decoding cost, beside its rollout
    forwards: torch.Tensor  # [B] int64 forward passes each row needed, the prefill included (plain decoding: N)
    batch_forwards: int  # forward passes the batch ran: its slowest row's, and the masked ones the host did not see


# ---------------------------------------------------------------------------- the rule (pure functions)


def accept_draft(p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Bool `[...]`: keep a draft whose target and draft probabilities are `p_x`, `q_x` `[...]`, with uniforms `u`
    in [0, 1): true with probability min(1, p_x / q_x) (never when p_x = 0)."""
    return u * q_x < p_x


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) `[..., K]`, unnormalised (inverse_cdf normalises): what a rejected draft is redrawn from.
    Where it has no mass (p <= q everywhere, so a rejection had probability 0 and only rounding made one), p."""
    r = (p - q).clamp_min(0.0)  # [..., K]
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def verify(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u_accept: torch.Tensor,
           u_draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One window of speculative sampling per row.

    p: `[B, W, K]` target probabilities at the window's positions (position i given the drafts before it);
    q: `[B, W-1, K]` the distributions the drafts were drawn from; draft: `[B, W-1]`; u_accept: `[B, W-1]`,
    u_draw: `[B]` uniforms. Returns (n `[B]`, the number of leading drafts kept; tokens `[B, W]`, valid through
    column n: the kept drafts, then the token drawn at column n from the residual, or from p there when every
    draft was kept).
    """
    B, W, K = p.shape
    p_x = p[:, :W - 1].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, W-1]
    q_x = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, W-1]
    kept = accept_draft(p_x, q_x, u_accept)  # [B, W-1]
    n = kept.long().cumprod(1).sum(1)  # [B] drafts kept before the first rejection
    q_pad = torch.cat([q, q.new_zeros(B, 1, K)], 1)  # [B, W, K]: past the last draft the residual is p itself
    at = n.view(B, 1, 1).expand(B, 1, K)
    last = inverse_cdf(residual(p.gather(1, at), q_pad.gather(1, at)).squeeze(1), u_draw)  # [B]
    tokens = torch.cat([draft, draft[:, -1:] if W > 1 else last[:, None]], 1)  # [B, W]
    return n, tokens.scatter(1, n[:, None], last[:, None])


def couple(x_old: torch.Tensor, q_old: torch.Tensor, q_new: torch.Tensor, has_old: torch.Tensor, u_keep: torch.Tensor,
           u_draw: torch.Tensor) -> torch.Tensor:
    """MC-SJD's maximal coupling `[...]`: a draft distributed as `q_new` `[..., K]` that equals the previous draft
    `x_old` `[...]` (drawn from `q_old`) as often as two such draws can; a fresh draw where `has_old` is False."""
    keep = has_old & accept_draft(q_new.gather(-1, x_old.unsqueeze(-1)).squeeze(-1),
                                  q_old.gather(-1, x_old.unsqueeze(-1)).squeeze(-1), u_keep)  # [...]
    fresh = inverse_cdf(residual(q_new, q_old * has_old.unsqueeze(-1)), u_draw)  # [...]
    return torch.where(keep, x_old, fresh)


def next_drafts(p: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the next window's drafts come from: the draft slot of position c' + i (c' = c + n + 1, this window's
    first position c) takes this forward's prediction there, p[:, n + 1 + i], or its last, p[:, W - 1], past it.
    Returns (q `[B, W-1, K]`, the slot index in this window `[B, W-1]`)."""
    B, W, K = p.shape
    slot = n[:, None] + 1 + torch.arange(W - 1, device=p.device)  # [B, W-1]
    return p.gather(1, slot.clamp_max(W - 1).unsqueeze(-1).expand(B, W - 1, K)), slot


# ---------------------------------------------------------------------------- the loop

Block = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# iterations between two host reads of "every row is done" on a CUDA device: each read waits for the device, and at
# most CHECK_EVERY - 1 masked iterations run after the last row is done (about 3% of a 256-token image's ~100); a
# CPU has nothing to wait for, so it looks after every iteration (CPU_CHECK_EVERY)
CHECK_EVERY, CPU_CHECK_EVERY = 4, 1


def uniforms_per_iteration(window: int) -> int:
    """Per row and iteration: W-1 acceptance tests, one draw, W-1 drafts, W-1 coupling tests."""
    return 3 * window - 2


def speculative_decode(first: torch.Tensor, block: Block, u: torch.Tensor, n_tokens: int, window: int,
                       params: SamplingParams, coupled: bool = False, check_every: int = 1,
                       graph: bool = False) -> tuple[Rollout, SpeculativeStats]:
    """N image tokens per row by speculative Jacobi decoding.

    first: `[B or 2B, K]` the logits of token 0 (the prefill's; CFG's null rows after the B conditional ones).
    block(window `[B, W]`, c `[B]`, tokens `[B, N + 2W]`) -> logits `[B or 2B, W, K]`: the logits of positions
    c .. c+W-1 of each row given its window, the tokens at c-1 .. c+W-2 (its last kept token, then drafts), and
    the kept tokens before them (columns < c of `tokens`; a cached block has them in its cache). u: `[B, N, U]`
    uniforms, U = uniforms_per_iteration(W).

    Every iteration runs on tensors of fixed shapes and addresses (`Window`), the rows' positions and counts among
    them, with no host read inside: the host asks whether every row is done once every `check_every` iterations
    (a row that is done runs masked iterations, which change nothing it returns), and with `graph` (a CUDA device)
    the iteration is recorded once as a CUDA graph and replayed, as the plain path's decode step is. The tokens do
    not depend on `check_every` or `graph` (a test checks it).
    """
    B, N, W = u.shape[0], n_tokens, window
    device = u.device
    width = N + 2 * W  # a window's writes past the image land in this slack and are cut off at the end
    out = Rollout(torch.zeros(B, width, dtype=torch.long, device=device), torch.zeros(B, width, device=device),
                  torch.zeros(B, width, device=device))
    logp = target_logp(*branches(first, B, params), params)  # [B, K]
    last = inverse_cdf(logp.exp(), u[:, 0, W - 1])  # [B] token 0
    _keep(out, first[:, None], logp[:, None], last[:, None], torch.zeros(B, dtype=torch.long, device=device), params)
    q = logp.exp()[:, None].expand(B, W - 1, -1).clone()  # [B, W-1, K] nothing predicts tokens 1.. yet but token 0's
    state = Window(out, last, inverse_cdf(q, u[:, 0, W:2 * W - 1]), q,
                   torch.ones(B, dtype=torch.long, device=device),  # c: tokens kept so far
                   torch.ones(B, dtype=torch.long, device=device),  # forwards: the prefill
                   torch.zeros(1, dtype=torch.long, device=device))  # t: iterations run
    step = functools.partial(iterate, state, block, u, N, W, params, coupled)
    if graph:
        step = record_step(step, [state.last, state.draft, state.q, state.c, state.forwards, state.t])
    while not bool((state.c >= N).all()):  # one host read every `check_every` iterations
        for _ in range(check_every):
            step()
    cut = Rollout(out.tokens[:, :N].contiguous(), out.logprobs[:, :N].contiguous(), out.entropy[:, :N].contiguous(),
                  forwards=state.forwards.clone())
    return cut, SpeculativeStats(cut.forwards, int(state.t) + 1)


@dataclass
class Window:  # the speculative loop's state, every tensor of a fixed shape and address
    out: Rollout  # [B, N + 2W] the kept tokens, their log-probs and entropies (a window's slack past N)
    last: torch.Tensor  # [B] each row's last kept token
    draft: torch.Tensor  # [B, W-1] the next window's drafts
    q: torch.Tensor  # [B, W-1, K] the distributions they were drawn from
    c: torch.Tensor  # [B] tokens kept so far (done at N)
    forwards: torch.Tensor  # [B] forward passes each row needed, the prefill included
    t: torch.Tensor  # [1] iterations run (the row of the uniforms the next one reads)


def iterate(s: Window, block: Block, u: torch.Tensor, N: int, W: int, params: SamplingParams, coupled: bool) -> None:
    """One window of every row: the forward, the verification, the kept tokens written and the next drafts, all in
    place on `s` (a CUDA graph can record it). Rows that are done change nothing they return."""
    B = u.shape[0]
    done = s.c >= N  # [B]
    s.t.add_(1)
    ut = u.index_select(1, s.t.clamp_max(N - 1)).squeeze(1)  # [B, U] this iteration's uniforms
    a, d, k = slice(0, W - 1), slice(W, 2 * W - 1), slice(2 * W - 1, 3 * W - 2)  # acceptance, draft, coupling
    logits = block(torch.cat([s.last[:, None], s.draft], 1), s.c.clamp_max(N), s.out.tokens)  # [B or 2B, W, K]
    logp = target_logp(*branches(logits, B, params), params)  # [B, W, K]
    p = logp.exp()
    n, tokens = verify(p, s.q, s.draft, ut[:, a], ut[:, W - 1])  # [B], [B, W]
    _keep(s.out, logits, logp, tokens, s.c, params)  # columns past c + n are written again by a later window
    s.forwards.add_(~done)
    s.c.add_((n + 1) * ~done)
    s.last.copy_(tokens.gather(1, n[:, None]).squeeze(1))
    q_next, slot = next_drafts(p, n)  # [B, W-1, K], [B, W-1]
    if coupled:  # the old draft of the same position, where this window had one
        has_old = slot <= W - 2
        old = slot.clamp_max(max(W - 2, 0))
        x_old = s.draft.gather(1, old)  # [B, W-1]
        q_old = s.q.gather(1, old.unsqueeze(-1).expand_as(q_next))  # [B, W-1, K]
        s.draft.copy_(couple(x_old, q_old, q_next, has_old, ut[:, k], ut[:, d]))
    else:
        s.draft.copy_(inverse_cdf(q_next, ut[:, d]))  # [B, W-1]
    s.q.copy_(q_next)


def _keep(out: Rollout, logits, logp, tokens, col, params: SamplingParams) -> None:
    """Write tokens `[B, W']` from column `col` `[B]` on, with their log-probs and entropies."""
    cols = col[:, None] + torch.arange(tokens.shape[1], device=tokens.device)  # [B, W']
    reported = reported_logp(branches(logits, tokens.shape[0], params)[0], logp, tokens, params)
    for buffer, value in zip((out.tokens, out.logprobs, out.entropy), (tokens, reported, entropy_of(logp))):
        buffer.scatter_(1, cols, value)


def speculative_uniforms(seeds, n_tokens: int, window: int, skip: int, device) -> torch.Tensor:
    """`[B, N, U]` each row's uniforms for speculative decoding: its seed's stream after the first `skip` values
    (those the plain path's image tokens and a text plan draw from: no uniform is shared between a row's plan and
    its image)."""
    U = uniforms_per_iteration(window)
    return seeded_uniforms(seeds, skip + n_tokens * U, device)[:, skip:].view(len(seeds), n_tokens, U)


@torch.no_grad()
def sample_speculative(policy, cond: torch.Tensor, seeds, params: SamplingParams) -> tuple[Rollout, SpeculativeStats]:
    """`sampling.sample` by speculative Jacobi decoding, window `params.speculative_window`, drafts
    `params.speculative_draft`: the condition rows `[B, L]` prefilled into a fixed-size cache, then one
    `policy.decode_block` a window, each row at its own positions in the cache."""
    B, N = cond.shape[0], policy.num_image_tokens
    if len(seeds) != B:
        raise ValueError(f"got {len(seeds)} seeds for {B} condition rows; pass one seed per image")
    W = max(1, min(params.speculative_window, N))
    skip = N + (params.plan.max_tokens if params.plan is not None else 0)
    u = speculative_uniforms(seeds, N, W, skip, cond.device)  # [B, N, U]
    rows = torch.cat([cond, policy.null_condition(cond)]) if params.guided else cond  # [B or 2B, L]
    reps = rows.shape[0] // B
    cache = policy.new_cache(rows.shape[0], static=True, extra=W)  # zeros: unwritten keys are masked, values add 0
    first = policy.prefill(rows, cache)  # [B or 2B, K]

    def block(window, c, _):  # token c-1 of a row sits at cache position L + c - 1
        return policy.decode_block(window.repeat(reps, 1), cache, (cond.shape[1] + c - 1).repeat(reps))

    cuda = cond.device.type == "cuda"  # the window recorded once as a CUDA graph, the host looking less often
    return speculative_decode(first, block, u, N, W, params, params.speculative_draft == "coupled",
                              check_every=CHECK_EVERY if cuda else CPU_CHECK_EVERY, graph=cuda)
