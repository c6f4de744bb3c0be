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

A window may hold more than one draft a position (`DraftTree`; sample.speculative_candidates and
speculative_branching): siblings of the main draft at the first positions, drawn from the same q without
replacement, each read under a tree attention mask (`kv_cache.Tree`). A position's candidates are tested in turn,
each against the residual its rejected elders left (recursive rejection without replacement, arXiv 2402.14160), so
the kept token is still distributed as p; the token after a kept sibling comes from the sibling's own prediction.

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
    first position c) takes this forward's prediction there, p[:, n + 1 + i], or its last, p[:, M - 1], past it.
    p: `[B, M, K]` the predictions along the window's main chain. Returns (q `[B, M-1, K]`, the slot index in this
    window `[B, M-1]`)."""
    B, M, K = p.shape
    slot = n[:, None] + 1 + torch.arange(M - 1, device=p.device)  # [B, M-1]
    return p.gather(1, slot.clamp_max(M - 1).unsqueeze(-1).expand(B, M - 1, K)), slot


# ---------------------------------------------------------------------------- the window's shape


@dataclass(frozen=True)
class Tree:
    """The shape of a speculative window (`decode_block`): W nodes, node 0 the row's last kept token at cache slot
    `start`, node i written at slot `start + i` and read at position `start + depth[i]`, attending over the cache
    before `start` and the window's nodes on its own path (`ancestors[i, j]`: j is i or above it). A chain
    (`Tree.chain`: depth i, every earlier node) is plain speculative decoding's window; a tree holds sibling drafts
    (`DraftTree`)."""
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


@dataclass(frozen=True)
class DraftTree:
    """Which drafts a window holds: node 0 the last kept token; a main chain of M nodes at depths 0 .. M-1 (slots
    0 .. M-1), the drafts plain SJD verifies; and at each of depths 1 .. `branching`, `candidates - 1` more drafts
    beside the main one, children of the main chain's node of the depth before (slots M .. W-1). Each is a leaf: kept,
    it is followed by the token drawn from its own prediction. A depth's candidates are tested in turn, each against
    the residual its rejected elders left and drawn from q without them (recursive rejection without replacement,
    Jeon et al. 2024, arXiv 2402.14160), so the kept token is distributed as the target, as one draft's is
    (tests/sampling/test_speculative.py). After SJD-PAC's proactive drafting (arXiv 2603.18599, section 3.2), which
    puts a full `candidates`-ary tree at the window's first depths: on the main job's trained policy, siblings along
    the main chain kept more a pass for the same W (docs/benchmarks.md). candidates 1 is a chain: SJD's window."""
    width: int  # W, the nodes a forward pass reads a row
    main: int  # M, the main chain's nodes
    branching: int  # depths that hold `candidates` drafts (0 for a chain)
    candidates: int  # drafts a branching depth holds (1 for a chain)
    parent: tuple  # [W] node i's parent (-1 for the root)
    rank: tuple  # [W] node i's place among its parent's children (0: the main draft of its depth)
    depth: tuple  # [W]

    @staticmethod
    def build(window: int, candidates: int = 1, branching: int = 0, longest: int | None = None) -> "DraftTree":
        """A window of `window` nodes; `candidates` drafts at each of the first `branching` depths (a chain when
        either is 1 or 0); a main chain of at most `longest` nodes (an image's tokens: drafts past it are cut off).
        Refuses a window that leaves the main chain shorter than the branching depths."""
        K, D = (candidates, branching) if candidates > 1 and branching > 0 else (1, 0)
        if window < D * K + 1:
            raise ValueError(f"a window of {window} cannot hold {K} drafts at each of {D} positions ({D * K + 1} "
                             f"nodes at least): widen sample.speculative_window to {D * K + 1} or more, or draft "
                             f"fewer (sample.speculative_candidates=1 is a chain)")
        M = min(window - D * (K - 1), longest or window)
        siblings = [(d, b) for d in range(1, D + 1) for b in range(1, K)]  # (depth, rank) of the nodes off the chain
        return DraftTree(M + len(siblings), M, D, K, (-1, *range(M - 1), *(d - 1 for d, _ in siblings)),
                         (0,) * M + tuple(b for _, b in siblings), (*range(M), *(d for d, _ in siblings)))

    def layout(self, device) -> Tree:
        """The tree as a policy's `decode_block` reads it: depths and ancestors."""
        anc = torch.eye(self.width, dtype=torch.bool)
        for i, p in enumerate(self.parent):  # parents come before their children
            if p >= 0:
                anc[i] |= anc[p]
        return Tree(torch.tensor(self.depth, device=device), anc.to(device))

    def tables(self, device) -> dict:
        """Index tensors of the tree for verification, on `device`."""
        W, M, K = self.width, self.main, self.candidates
        # each node's token as a column of [last, main drafts (M-1), siblings (D x K-1)]
        source = [0 if i == 0 else (self.depth[i] if self.rank[i] == 0 else
                                    M - 1 + (self.depth[i] - 1) * (K - 1) + self.rank[i]) for i in range(W)]
        parent, rank = torch.tensor(self.parent), torch.tensor(self.rank)
        # earlier[i, j]: j is a sibling of node i tested before it (the root has none)
        earlier = (parent[:, None] == parent[None, :]) & (rank[None, :] < rank[:, None]) & (parent >= 0)[:, None]
        return {"source": torch.tensor(source, device=device), "parent": parent.clamp_min(0).to(device),
                "rank": rank.to(device), "depth": torch.tensor(self.depth, device=device),
                "kids": torch.bincount(parent[1:], minlength=W).to(device), "earlier": earlier.to(device),
                "ancestors": self.layout(device).ancestors}


def verify(p: torch.Tensor, q: torch.Tensor, candidates: torch.Tensor, nodes: torch.Tensor, t: dict,
           u_accept: torch.Tensor, u_draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One window of speculative sampling per row, shaped as a `DraftTree` (a chain: SJD's window).

    p: `[B, W, K]` the target after each node (its position + 1, given its path); q: `[B, M-1, K]` the distributions
    the drafts of depths 1 .. M-1 came from; candidates: `[B, D, C]` the drafts of the branching depths in the order
    they are tested (the main one first, the rest drawn from q without replacement); nodes: `[B, W]` the window's
    tokens; t: `DraftTree.tables`; u_accept `[B, W]` (column 0 unused), u_draw `[B]` uniforms. From the root, a
    node's children are tested in rank order, each against the residual its rejected elder siblings left, with q
    less their tokens; the first kept one is entered; where none is, a token is drawn from the last residual.
    Returns (n `[B]` drafts kept, path `[B, M]` the slot of the kept node of depth 0 .. n (later columns: the main
    chain's), the token drawn after the last kept node `[B]`).
    """
    B, W, V = p.shape
    M, C = q.shape[1] + 1, candidates.shape[2]
    depth, rank, kids = t["depth"], t["rank"], t["kids"]
    at = lambda rows: rows.view(1, W, 1).expand(B, W, V)  # noqa: E731
    tok = nodes.unsqueeze(-1)  # [B, W, 1]
    accept = torch.zeros(B, W, dtype=torch.bool, device=p.device)
    P, last, Q = p, p, q  # P: what a parent's next child is tested against; Q: each depth's q less tested drafts
    for b in range(C):
        p_x = P.gather(1, at(t["parent"])).gather(-1, tok).squeeze(-1)  # [B, W]
        q_x = Q.gather(1, at((depth - 1).clamp_min(0))).gather(-1, tok).squeeze(-1)  # [B, W]
        accept |= ((rank == b) & (depth > 0)) & accept_draft(p_x, q_x, u_accept) & (q_x > 0)
        # each node's target once its b-th child is rejected: the residual of the q its children were drawn from
        rest = residual(P, Q.gather(1, at(depth.clamp_max(M - 2))))  # [B, W, V] unnormalised
        last = torch.where((kids == b + 1).view(1, W, 1), rest, last)
        if b + 1 < C:  # the next children are tested against these
            P, Q = rest / rest.sum(-1, keepdim=True), _without(Q, candidates[:, :, b])
    ok = accept & ~(accept.unsqueeze(1) & t["earlier"]).any(-1)  # [B, W] kept, and no elder sibling was
    ok[:, 0] = True
    chosen = ~((~ok).unsqueeze(1) & t["ancestors"]).any(-1)  # [B, W] every node of its path kept: one a depth
    end = torch.where(chosen, depth, -1).argmax(1)  # [B] the deepest
    path = torch.arange(M, device=p.device).expand(B, M).contiguous()  # a kept node's slot is >= its depth
    path.scatter_reduce_(1, depth.expand(B, W), torch.where(chosen, torch.arange(W, device=p.device), -1), "amax")
    bonus = inverse_cdf(last.gather(1, end.view(B, 1, 1).expand(B, 1, V)).squeeze(1), u_draw)  # [B]
    return depth[end], path, bonus


def window_nodes(last: torch.Tensor, draft: torch.Tensor, candidates: torch.Tensor, t: dict) -> torch.Tensor:
    """`[B, W]` each node's token: the last kept one `[B]`, the main drafts `[B, M-1]` and the branching depths'
    candidates `[B, D, C]` (the main one first) laid out as the tree's nodes (`DraftTree.tables`' source)."""
    nodes = torch.cat([last[:, None], draft, candidates[:, :, 1:].flatten(1)], 1)
    return nodes.gather(1, t["source"].expand(last.shape[0], -1))


def kept_tokens(nodes: torch.Tensor, path: torch.Tensor, n: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """`[B, M]` what a window keeps, `verify`'s (n, path, bonus) read off its nodes `[B, W]`: column j the kept node
    of depth j + 1 through column n - 1, then the token drawn after the last (later columns: past what is kept)."""
    return torch.cat([nodes.gather(1, path[:, 1:]), bonus[:, None]], 1).scatter(1, n[:, None], bonus[:, None])


def _without(q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """q `[B, M-1, K]` with each branching depth's draft `tokens` `[B, D]` removed and renormalised (a depth left
    with no mass stays zero: its next draft has no token to be, and is never kept)."""
    D = tokens.shape[1]
    head = q[:, :D].scatter(2, tokens.unsqueeze(-1), 0.0)  # [B, D, K]
    head = head / head.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
    return torch.cat([head, q[:, D:]], 1)


def draw_siblings(q: torch.Tensor, main: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`[B, D, C]` the candidates of the branching depths: the main draft `main` `[B, D]`, then C - 1 more drawn from
    q `[B, D, K]` without replacement, with uniforms `u` `[B, D, C-1]` (an exhausted q gives token 0, never kept)."""
    drawn = [main]
    for j in range(u.shape[2]):
        rest = q.scatter(2, torch.stack(drawn, -1), 0.0)  # [B, D, K]
        drawn.append(inverse_cdf(rest, u[:, :, j]))
    return torch.stack(drawn, -1)


# ---------------------------------------------------------------------------- the loop

Block = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Settle = Callable[[torch.Tensor, torch.Tensor], None]
# iterations between two host reads of "every row is done" on a CUDA device: each read waits for the device, and at
# most CHECK_EVERY - 1 masked iterations run after the last row is done (about 3% of a 256-token image's ~100); a
# CPU has nothing to wait for, so it looks after every iteration (CPU_CHECK_EVERY)
CHECK_EVERY, CPU_CHECK_EVERY = 4, 1


def uniforms_per_iteration(window: int) -> int:
    """Per row and iteration: W-1 acceptance tests (one a node), one draw, W-1 drafts (the main chain's, then the
    siblings'), W-1 coupling tests."""
    return 3 * window - 2


def speculative_decode(first: torch.Tensor, block: Block, u: torch.Tensor, n_tokens: int, tree: DraftTree,
                       params: SamplingParams, coupled: bool = False, settle: Settle | None = None,
                       check_every: int = 1, graph: bool = False) -> tuple[Rollout, SpeculativeStats]:
    """N image tokens per row by speculative Jacobi decoding, windows shaped as `tree` (`DraftTree.build(W)`: a chain).

    first: `[B or 2B, K]` the logits of token 0 (the prefill's; CFG's null rows after the B conditional ones).
    block(window `[B, W]`, c `[B]`, tokens `[B, N + 2W]`) -> logits `[B or 2B, W, K]`: the logits after each node
    of the window (the tree's node 0 the row's last kept token, token c-1, then its drafts, node i at position
    c - 1 + depth i) given its path and the kept tokens before it (columns < c of `tokens`; a cached block has
    them in its cache). settle(c `[B]`, slots `[B, D]`): a cached block's keys of the kept drafts at depths 1 .. D
    sit at those window slots; move them to the slots after c-1's (a chain keeps them in place: D = 0).
    u: `[B, N, U]` uniforms, U = uniforms_per_iteration(W).

    Every iteration runs on tensors of fixed shapes and addresses (`Window`), the rows' positions and counts among
    them, with no host read inside: the host asks whether every row is done once every `check_every` iterations
    (a row that is done runs masked iterations, which change nothing it returns), and with `graph` (a CUDA device)
    the iteration is recorded once as a CUDA graph and replayed, as the plain path's decode step is. The tokens do
    not depend on `check_every` or `graph` (a test checks it).
    """
    B, N, W, M = u.shape[0], n_tokens, tree.width, tree.main
    device = u.device
    width = N + 2 * W  # a window's writes past the image land in this slack and are cut off at the end
    out = Rollout(torch.zeros(B, width, dtype=torch.long, device=device), torch.zeros(B, width, device=device),
                  torch.zeros(B, width, device=device))
    logp = target_logp(*branches(first, B, params), params)  # [B, K]
    last = inverse_cdf(logp.exp(), u[:, 0, W - 1])  # [B] token 0
    _keep(out, first[:, None], logp[:, None], last[:, None], torch.zeros(B, dtype=torch.long, device=device), params)
    q = logp.exp()[:, None].expand(B, M - 1, -1).clone()  # [B, M-1, K] nothing predicts tokens 1.. yet but token 0's
    draft = inverse_cdf(q, u[:, 0, W:W + M - 1])
    state = Window(out, last, draft, _siblings(q, draft, u[:, 0], tree), q,
                   torch.ones(B, dtype=torch.long, device=device),  # c: tokens kept so far
                   torch.ones(B, dtype=torch.long, device=device),  # forwards: the prefill
                   torch.zeros(1, dtype=torch.long, device=device))  # t: iterations run
    step = functools.partial(iterate, state, block, settle or (lambda c, slots: None), u, N, tree,
                             tree.tables(device), params, coupled)
    if graph:
        step = record_step(step, [state.last, state.draft, state.candidates, state.q, state.c, state.forwards,
                                  state.t])
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
    draft: torch.Tensor  # [B, M-1] the next window's main drafts
    candidates: torch.Tensor  # [B, D, C] the drafts of its branching depths, the main one first
    q: torch.Tensor  # [B, M-1, K] the distributions they were drawn from
    c: torch.Tensor  # [B] tokens kept so far (done at N)
    forwards: torch.Tensor  # [B] forward passes each row needed, the prefill included
    t: torch.Tensor  # [1] iterations run (the row of the uniforms the next one reads)


def _siblings(q: torch.Tensor, draft: torch.Tensor, ut: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """`[B, D, C]` the branching depths' candidates for main drafts `draft` `[B, M-1]` drawn from q `[B, M-1, K]`,
    from this iteration's uniforms `ut` `[B, U]` (the draft block's columns past the main chain's)."""
    D, C, W, M = tree.branching, tree.candidates, tree.width, tree.main
    u = ut[:, W + M - 1:W + M - 1 + D * (C - 1)].reshape(ut.shape[0], D, C - 1)
    return draw_siblings(q[:, :D], draft[:, :D], u)


def iterate(s: Window, block: Block, settle: Settle, u: torch.Tensor, N: int, tree: DraftTree, t: dict,
            params: SamplingParams, coupled: bool) -> None:
    """One window of every row: the forward, the verification, the kept tokens written and the next drafts, all in
    place on `s` (a CUDA graph can record it). Rows that are done change nothing they return."""
    B, W, M = u.shape[0], tree.width, tree.main
    done = s.c >= N  # [B]
    s.t.add_(1)
    ut = u.index_select(1, s.t.clamp_max(N - 1)).squeeze(1)  # [B, U] this iteration's uniforms
    a, d, k = slice(0, W - 1), slice(W, W + M - 1), slice(2 * W - 1, 2 * W + M - 2)  # acceptance, draft, coupling
    nodes = window_nodes(s.last, s.draft, s.candidates, t)  # [B, W]
    logits = block(nodes, s.c.clamp_max(N), s.out.tokens)  # [B or 2B, W, K]
    logp = target_logp(*branches(logits, B, params), params)  # [B, W, K]
    p = logp.exp()
    u_accept = torch.cat([ut[:, :1], ut[:, a]], 1)  # [B, W]: node i's test reads column i (the root's is unused)
    n, path, bonus = verify(p, s.q, s.candidates, nodes, t, u_accept, ut[:, W - 1])  # [B], [B, M], [B]
    tokens = kept_tokens(nodes, path, n, bonus)  # [B, M]
    reps = logits.shape[0] // B
    _keep(s.out, logits.gather(1, path.repeat(reps, 1).unsqueeze(-1).expand(-1, -1, logits.shape[-1])),
          logp.gather(1, path.unsqueeze(-1).expand(-1, -1, logp.shape[-1])), tokens, s.c, params)
    settle(s.c.clamp_max(N), path[:, 1:tree.branching + 1])  # a kept sibling's keys to the slot its depth reads
    s.forwards.add_(~done)
    s.c.add_((n + 1) * ~done)
    s.last.copy_(bonus)
    q_next, slot = next_drafts(p[:, :M], n)  # [B, M-1, K], [B, M-1]
    if coupled:  # the old draft of the same position, where this window had one
        has_old = slot <= M - 2
        old = slot.clamp_max(max(M - 2, 0))
        x_old = s.draft.gather(1, old)  # [B, M-1]
        q_old = s.q.gather(1, old.unsqueeze(-1).expand_as(q_next))  # [B, M-1, K]
        s.draft.copy_(couple(x_old, q_old, q_next, has_old, ut[:, k], ut[:, d]))
    else:
        s.draft.copy_(inverse_cdf(q_next, ut[:, d]))  # [B, M-1]
    s.candidates.copy_(_siblings(q_next, s.draft, ut, tree))
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
    """`sampling.sample` by speculative Jacobi decoding, window `params.speculative_window` shaped as
    `params.speculative_candidates` drafts at each of the first `params.speculative_branching` positions
    (`DraftTree`), drafts `params.speculative_draft`: the condition rows `[B, L]` prefilled into a fixed-size cache,
    then one `policy.decode_block` a window, each row at its own positions in the cache."""
    B, N = cond.shape[0], policy.num_image_tokens
    if len(seeds) != B:
        raise ValueError(f"got {len(seeds)} seeds for {B} condition rows; pass one seed per image")
    tree = DraftTree.build(params.speculative_window, params.speculative_candidates, params.speculative_branching, N)
    skip = N + (params.plan.max_tokens if params.plan is not None else 0)
    u = speculative_uniforms(seeds, N, tree.width, skip, cond.device)  # [B, N, U]
    rows = torch.cat([cond, policy.null_condition(cond)]) if params.guided else cond  # [B or 2B, L]
    reps = rows.shape[0] // B
    cache = policy.new_cache(rows.shape[0], static=True, extra=tree.width)  # zeros: unwritten keys are masked
    first = policy.prefill(rows, cache)  # [B or 2B, K]
    layout = tree.layout(cond.device)

    def block(window, c, _):  # token c-1 of a row sits at cache slot L + c - 1
        return policy.decode_block(window.repeat(reps, 1), cache, (cond.shape[1] + c - 1).repeat(reps), layout)

    def settle(c, slots):
        move_keys(cache, cond.shape[1] + c - 1, slots)

    cuda = cond.device.type == "cuda"  # the window recorded once as a CUDA graph, the host looking less often
    return speculative_decode(first, block, u, N, tree, params, params.speculative_draft == "coupled", settle,
                              check_every=CHECK_EVERY if cuda else CPU_CHECK_EVERY, graph=cuda)
